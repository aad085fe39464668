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


def _experts_call_hooks(layer: "MoELayer", route: Callable, read_only: bool) -> list:
    """The hooks of a family whose block ends in ``experts(hidden, top_k_index, top_k_weights)``: the gate's
    forward hook keeps the live logits (families whose block never calls its gate recompute them from the
    experts' input instead), the experts' pre-hook sees the native top-k and may replace it."""
    live: dict = {"logits": None}
    family, block = layer.family, layer.block
    from_input = getattr(family, "logits_from_experts_input", None)

    def keep_logits(module, args, output):
        live["logits"] = family.logits_from_gate_output(output)

    def pre_experts(module, args):
        hidden, index, weights = args[0], args[1], args[2]
        logits = live["logits"]
        if from_input is not None and not read_only:
            logits = from_input(block, hidden)
        new = route(index, logits, weights.dtype)
        if new is None:
            return None
        return (hidden, new[0], new[1]) + tuple(args[3:])

    handles = []
    if not read_only and from_input is None:
        handles.append(block.gate.register_forward_hook(keep_logits))
    handles.append(block.experts.register_forward_pre_hook(pre_experts))
    return handles


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


class SoftmaxScaled:
    """DeepSeek-V2 / DeepSeek-V2-Lite: softmax over all experts in fp32, the chosen gathered, times
    ``routed_scaling_factor`` (no renormalisation). Its block computes the router logits with
    ``F.linear(hidden.float(), gate.weight.float())`` and never calls ``gate``, so a replay recomputes
    them from the experts' input, which is the same hidden state."""

    name = "deepseek_v2"

    def logits_from_gate_output(self, output):
        return output

    def logits_from_experts_input(self, block, hidden):
        return torch.nn.functional.linear(hidden.float(), block.gate.weight.float())

    def gate_weights(self, block, logits, index, dtype):
        return (torch.softmax(logits.float(), dim=-1).gather(-1, index) * block.routed_scaling_factor).to(dtype)


class GraniteTopKGating:
    """Granite-MoE: the router itself sorts tokens by expert (``GraniteMoeTopKGating`` returns sorted
    indices, gates and expert sizes) and the block never calls an experts module with a top-k, so the
    hook sits on the router's output: the native top-k is re-read from its logits (the same ``topk`` it
    ran) and a replaced top-k is sorted again by the router's own steps. Gate weights: softmax over the
    chosen experts' logits."""

    name = "granitemoe"

    def logits_from_gate_output(self, output):
        return output[-1]

    def gate_weights(self, block, logits, index, dtype):
        return torch.softmax(logits.float().gather(-1, index), dim=-1).to(dtype)

    @staticmethod
    def router_outputs(index: torch.Tensor, gates: torch.Tensor, logits: torch.Tensor, num_experts: int):
        """``GraniteMoeTopKGating.forward``'s outputs for a given top-k (its own sorting steps)."""
        k = index.shape[-1]
        expert_size = torch.zeros(index.shape[0], num_experts, dtype=torch.long, device=index.device) \
            .scatter(1, index, 1).sum(0).tolist()
        _, sorted_experts = index.flatten().sort(0)
        batch_index = sorted_experts.div(k, rounding_mode="trunc")
        return sorted_experts, batch_index, gates.flatten()[sorted_experts], expert_size, logits

    def hooks(self, layer: "MoELayer", route: Callable, read_only: bool) -> list:
        router = layer.block.router

        def on_router(module, args, output):
            logits = output[-1]
            native = logits.topk(layer.top_k, dim=1)[1]
            new = route(native, logits, args[0].dtype)
            if new is None:
                return None
            index, weights = new
            return self.router_outputs(index, weights, logits, layer.num_experts)

        return [router.register_forward_hook(on_router)]

    def watch_received(self, layer: "MoELayer", callback: Callable[[torch.Tensor], None]):
        """A hook that hands ``callback`` the top-k [tokens, k] the experts compute with, rebuilt from the
        router's final (sorted) output: registered after ``hooks``, it sees a replaced routing too."""

        def on_router(module, args, output):
            sorted_positions, expert_size = output[0], output[3]
            experts = torch.repeat_interleave(torch.arange(len(expert_size), device=sorted_positions.device),
                                              torch.tensor(expert_size, device=sorted_positions.device))
            flat = torch.empty_like(sorted_positions)
            flat[sorted_positions] = experts
            callback(flat.view(-1, layer.top_k))

        return layer.block.router.register_forward_hook(on_router)


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
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeMoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return {
        Qwen3MoeSparseMoeBlock: SoftmaxTopK("qwen3_moe", lambda b: b.gate.norm_topk_prob),
        MixtralSparseMoeBlock: SoftmaxTopK("mixtral", lambda b: True),
        DeepseekV3MoE: SigmoidGroupLimited(),
        OlmoeSparseMoeBlock: SoftmaxTopK("olmoe", lambda b: b.gate.norm_topk_prob),
        # Qwen1.5/Qwen2-MoE: the routed experts as Qwen3's; the sigmoid-gated shared expert is dense (not routed)
        Qwen2MoeSparseMoeBlock: SoftmaxTopK("qwen2_moe", lambda b: b.gate.norm_topk_prob),
        DeepseekV2Moe: SoftmaxScaled(),
        GraniteMoeMoE: GraniteTopKGating(),
    }


# The attribute of a decoder layer that holds its feed-forward block, MoE or dense (Granite-MoE: block_sparse_moe).
MLP_ATTRIBUTES = ("mlp", "block_sparse_moe")


def feed_forward(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's feed-forward block (``mlp`` or ``block_sparse_moe``), None if it has none."""
    return next((getattr(layer, a) for a in MLP_ATTRIBUTES if isinstance(getattr(layer, a, None), nn.Module)), None)


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
        if isinstance(layers, nn.ModuleList) and len(layers) and feed_forward(layers[0]) is not None:
            return layers
    raise ValueError(f"{type(model).__name__}: no decoder layers with an .mlp (or .block_sparse_moe) found")


def find_moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoE layers of ``model`` (PEFT-wrapped or not), keyed by global layer number."""
    families = _families()
    found = []
    for number, layer in enumerate(_decoder_layers(model)):
        block = feed_forward(layer)
        family = next((f for cls, f in families.items() if isinstance(block, cls)), None)
        if family is None:
            continue  # a dense layer (DeepSeek-V3's first_k_dense_replace)
        gate = getattr(block, "gate", None) or getattr(block, "router", None)
        cfg = getattr(block, "config", None) or getattr(gate, "config", None)
        num_experts = getattr(gate, "num_experts", None) or getattr(block, "n_routed_experts", None) \
            or getattr(block.experts if hasattr(block, "experts") else gate, "num_experts", None)
        top_k = getattr(gate, "top_k", None) or getattr(block, "top_k", None)
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

        def route(index, logits, weights_dtype, layer=layer):
            """(new index, its family-rule weights) when ``policy`` replaces the native top-k, else None."""
            new_index = policy(layer, index, logits)
            if new_index is None:
                return None
            if read_only:
                raise RuntimeError(f"layer {layer.layer_number}: a read-only routing policy returned experts")
            new_index = new_index.to(device=index.device, dtype=index.dtype)
            new_weights = layer.family.gate_weights(layer.block, logits, new_index, weights_dtype)
            if may_repeat:
                new_weights = collapse_repeated(new_index, new_weights)
            return new_index, new_weights

        install = getattr(layer.family, "hooks", None)
        handles += install(layer, route, read_only) if install else _experts_call_hooks(layer, route, read_only)
    try:
        yield layers
    finally:
        for h in handles:
            h.remove()


def moe_layer_numbers(model: nn.Module) -> tuple[int, ...]:
    return tuple(layer.layer_number for layer in find_moe_layers(model))
