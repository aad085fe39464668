"""One adapter per MoE router family: find the MoE layers, read the top-k a forward chose, and
(for replay) substitute other experts with gate weights recomputed by the family's own rule.

transformers has no router-replay API. Every family's MoE block ends in the same call,
``experts(hidden [tokens, H], top_k_index [tokens, k], top_k_weights [tokens, k])``, so we hook
there: a forward hook on the block's gate keeps the live router logits, and a forward pre-hook on
``block.experts`` sees the native top-k and may replace (index, weights). The same two hooks serve
capture in the rollout engine, diagnostics in the trainer and R2/R3 replay, and they keep working
when PEFT wraps the experts (the block still calls ``self.experts``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch
from torch import nn


class RouterFamily(Protocol):
    name: str

    def logits_from_gate_output(self, output) -> torch.Tensor: ...

    def gate_weights(self, block: nn.Module, logits: torch.Tensor, index: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor: ...


class SoftmaxTopK:
    """Qwen3-MoE and Mixtral: softmax over all experts in fp32, gather the chosen, renormalise."""

    def __init__(self, name: str, renormalise: Callable[[nn.Module], bool]):
        self.name, self._renormalise = name, renormalise

    def logits_from_gate_output(self, output):
        return output[0]  # (router_logits, router_scores, router_indices)

    def gate_weights(self, block, logits, index, dtype):
        probs = torch.softmax(logits.float(), dim=-1).gather(-1, index)
        if self._renormalise(block):
            probs = probs / probs.sum(-1, keepdim=True)
        return probs.to(dtype)


class SigmoidGroupLimited:
    """DeepSeek-V3 / Kimi-K2 / Moonlight: sigmoid scores gathered at the chosen experts, normalised,
    times ``routed_scaling_factor``. The correction bias only affects *selection*, never weights."""

    name = "deepseek_v3"

    def logits_from_gate_output(self, output):
        return output  # the gate returns fp32 logits only; selection happens in the block

    def gate_weights(self, block, logits, index, dtype):
        w = torch.sigmoid(logits.float()).gather(-1, index)
        if block.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return (w * block.routed_scaling_factor).to(dtype)


def _families() -> dict[type, RouterFamily]:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return {
        Qwen3MoeSparseMoeBlock: SoftmaxTopK("qwen3_moe", lambda b: b.gate.norm_topk_prob),
        MixtralSparseMoeBlock: SoftmaxTopK("mixtral", lambda b: True),
        DeepseekV3MoE: SigmoidGroupLimited(),
    }


@dataclass
class MoELayer:
    layer_number: int  # global index in model.layers (dense layers count)
    block: nn.Module
    family: RouterFamily
    num_experts: int
    top_k: int


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) and hasattr(layers[0], "mlp"):
            return layers
    raise ValueError(f"{type(model).__name__}: no decoder layers with an .mlp found")


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoE layers of ``model`` (PEFT-wrapped or not), keyed by global layer number."""
    families = _families()
    found = []
    for number, layer in enumerate(_decoder_layers(model)):
        block = layer.mlp
        family = next((f for cls, f in families.items() if isinstance(block, cls)), None)
        if family is None:
            continue  # a dense layer (DeepSeek-V3's first_k_dense_replace)
        cfg = getattr(block, "config", None) or getattr(block.gate, "config", None)
        num_experts = getattr(block.gate, "num_experts", None) or getattr(block, "n_routed_experts", None)
        top_k = getattr(block.gate, "top_k", None) or getattr(block, "top_k", None)
        if num_experts is None or top_k is None:
            raise ValueError(f"layer {number}: cannot read num_experts/top_k from {type(block).__name__} ({cfg})")
        found.append(MoELayer(number, block, family, int(num_experts), int(top_k)))
    if not found:
        raise ValueError(f"{type(model).__name__}: no MoE layer of a known family "
                         f"({', '.join(c.__name__ for c in families)})")
    return found


# A routing policy sees one MoE call and may replace its routing:
#   policy(layer, native_index [tokens, k], logits [tokens, E]) -> new index [tokens, k] or None
# (logits is None under intercept_routing(..., read_only=True)).
RoutingPolicy = Callable[[MoELayer, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def collapse_repeated(index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Zero the weight of every repeat of an expert within a row ([tokens, k]): the expert runs once.

    A native top-k never repeats an expert; a replayed row can (a zero-filled row is expert 0 k times).
    Megatron scatters a row's top-k into a [tokens, E] routing map and probability table
    (megatron/core/transformer/moe/moe_utils.py ``topk_routing_with_score_function``:
    ``zeros_like(logits).scatter(1, top_indices, probs)``), so repeats collapse into one expert with one
    weight; the transformers experts loop would instead run the expert once per repeat and add them up."""
    srt, order = index.sort(dim=-1, stable=True)
    repeat_sorted = torch.zeros_like(srt, dtype=torch.bool)
    repeat_sorted[..., 1:] = srt[..., 1:] == srt[..., :-1]
    if not bool(repeat_sorted.any()):
        return weights
    repeat = torch.zeros_like(repeat_sorted).scatter(-1, order, repeat_sorted)
    return weights.masked_fill(repeat, 0)


@contextmanager
def intercept_routing(model: nn.Module, policy: RoutingPolicy, may_repeat: bool = True,
                      read_only: bool = False) -> Iterator[list[MoELayer]]:
    """Run ``policy`` on every MoE call inside the block; replaced indices get family-rule weights.

    ``may_repeat=False`` promises that the policy only returns rows of distinct experts (rows of a
    validated RoutingTrace, native top-k rows), so the search for repeated experts
    (``collapse_repeated``) is skipped; with True (the default) every replaced row is searched.
    ``read_only=True`` (routing capture): the policy only reads the native top-k and returns None, so
    the router logits that reweighting needs are not kept (no hook on the gate; it gets None)."""
    layers = find_moe_layers(model)
    handles = []
    for layer in layers:
        live: dict = {"logits": None}

        def keep_logits(module, args, output, live=live, layer=layer):
            live["logits"] = layer.family.logits_from_gate_output(output)

        def route(module, args, layer=layer, live=live):
            hidden, index, weights = args[0], args[1], args[2]
            new_index = policy(layer, index, live["logits"])
            if new_index is None:
                return None
            if read_only:
                raise RuntimeError(f"layer {layer.layer_number}: a read-only routing policy returned experts")
            new_index = new_index.to(index.dtype)
            new_weights = layer.family.gate_weights(layer.block, live["logits"], new_index, weights.dtype)
            if may_repeat:
                new_weights = collapse_repeated(new_index, new_weights)
            return (hidden, new_index, new_weights) + tuple(args[3:])

        if not read_only:
            handles.append(layer.block.gate.register_forward_hook(keep_logits))
        handles.append(layer.block.experts.register_forward_pre_hook(route))
    try:
        yield layers
    finally:
        for h in handles:
            h.remove()


def moe_layer_numbers(model: nn.Module) -> tuple[int, ...]:
    return tuple(layer.layer_number for layer in find_moe_layers(model))
