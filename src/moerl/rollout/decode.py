"""The embedded engine's decode loop: the same numbers as transformers' ``generate``, without its per-token
machinery.

A rollout step at the CPU lab's sizes is ~40 decode calls of 256 tokens through a model of hidden 64: every
call is a few hundred tiny kernels, and most of a call's time went to work around them rather than in them.
``generate`` re-derives masks and positions, re-enters every module and its hooks, and (with the emulated
bf16 kernels) converts and repeats the whole bf16 KV cache to fp32 in every layer of every call -- a cost
that grows with the length and was a quarter of the rollout. This loop is what an inference engine's model
runner does (vLLM writes each model's forward over its own KV cache for the same reason):

- the prompt's prefill is the model's own forward (one call; hooks record its routes), and its keys and
  values seed a cache allocated once for the whole generation, in fp32 and already repeated per query head,
  which is exactly what the emulated attention computed on every call (bf16 values are exact in fp32);
- each decode call then runs the layers over plain tensors: the products through the engine's precision
  (``moerl.rollout.kernels``: fp32 kernels rounded once to bf16, or fp32), attention over a view of the
  cache, the router's softmax / top-k and transformers' grouped-experts computation op for op; the
  norms and the rotary embedding are the model's own modules;
- sampling replays ``generate``'s: fp32 logits, the same warpers in the same order, one ``multinomial``
  over the batch per step (the same random stream), padding after EOS, and the last sampled token never
  forwarded.

Every operation and operand shape is the one ``generate`` runs, so on one machine the tokens, logprobs and
routes are bit-identical to it (``tests/rollout/test_decode.py`` checks each rollout precision). Covered:
Qwen3-MoE models (every layer MoE), LoRA on attention and PEFT's per-expert LoRA on the fused expert
tensors, ``emulated`` low-precision kernels or fp32. Anything else (``native`` bf16 kernels, other
families, the ``shared`` expert-LoRA modes) runs through ``generate``: :func:`unsupported` says why.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

from moerl.models.experts import NAME as EXPERTS_NAME
from moerl.rollout.kernels import LOW_PRECISION


def _grouped_mm():
    """The grouped product transformers' experts call (``F.grouped_mm``, else ``torch._grouped_mm``)."""
    return getattr(F, "grouped_mm", None) or torch._grouped_mm


def _base(module: nn.Module) -> nn.Module:
    """The PEFT model's underlying transformers model (or the model itself)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def _unwrap_experts(module: nn.Module) -> nn.Module:
    """The transformers experts module under PEFT's ``ParamWrapper`` layers (one per wrapped tensor)."""
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def _wrappers(module: nn.Module) -> list[nn.Module]:
    """PEFT's ``ParamWrapper`` layers around an experts module, outermost first."""
    found = []
    while hasattr(module, "base_layer"):
        if hasattr(module, "parameter_name"):
            found.append(module)
        module = module.base_layer
    return found


def unsupported(model: nn.Module, dtype: torch.dtype, kernels: str) -> str | None:
    """Why this engine cannot use the decode loop (None when it can)."""
    from peft.tuners.lora.layer import Linear as LoraLinear, ParamWrapper

    base = _base(model)
    device = next(base.parameters()).device
    if device.type != "cpu":
        return f"device {device} (the loop is written for the CPU lab; a GPU runs generate)"
    if getattr(base.config, "model_type", None) != "qwen3_moe":
        return f"model type {base.config.model_type!r} (the loop covers qwen3_moe)"
    if dtype in LOW_PRECISION and kernels != "emulated":
        return f"rollout.kernels={kernels!r} (the loop reproduces the emulated kernels and fp32)"
    if dtype not in (torch.float32, *LOW_PRECISION):
        return f"dtype {dtype}"
    if getattr(base.config, "_experts_implementation", None) not in ("grouped_mm", EXPERTS_NAME):
        return f"experts implementation {base.config._experts_implementation!r} (the loop reproduces grouped_mm)"
    for layer in base.model.layers:
        mlp = layer.mlp
        if not (hasattr(mlp, "gate") and hasattr(mlp, "experts")):
            return "a dense MLP layer"
        if any(n.startswith("experts.") and "lora" in n for n, _ in mlp.named_parameters()) and \
                not isinstance(mlp.experts, ParamWrapper):
            return "expert LoRA outside PEFT's per-expert wrapper (lora.expert_mode shared/shared_outer)"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            module = getattr(layer.self_attn, proj)
            if isinstance(module, LoraLinear):
                if module.merged or module.lora_variant or len(module.active_adapters) != 1:
                    return f"{proj}: merged, multi-adapter or variant LoRA"
            elif not isinstance(module, nn.Linear):
                return f"{proj}: {type(module).__name__}"
    return None


@dataclass
class _Linear:
    """One projection: its weight and, when LoRA-wrapped, (A, B, scaling) applied as PEFT's forward does."""
    weight: torch.Tensor
    lora: tuple[torch.Tensor, torch.Tensor, float] | None = None


class _Products:
    """Matrix products in the engine's precision: fp32, or bf16/fp16 operands computed by fp32 kernels and
    rounded once to the operand precision (the emulated kernels, ``moerl.rollout.kernels``)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.low = dtype, dtype in LOW_PRECISION

    def weight(self, w: torch.Tensor) -> torch.Tensor:
        """What the product reads: the fp32 copy a low-precision weight is computed with (exact)."""
        return w.detach().float() if self.low else w.detach()

    def linear(self, x: torch.Tensor, w32: torch.Tensor) -> torch.Tensor:
        if self.low:
            return F.linear(x.float(), w32).to(self.dtype)
        return F.linear(x, w32)

    def projection(self, x: torch.Tensor, p: _Linear) -> torch.Tensor:
        out = self.linear(x, p.weight)
        if p.lora is not None:  # PEFT's Linear.forward: base + B(A(x)) * scaling, each product rounded
            a, b, scaling = p.lora
            out = out + self.linear(self.linear(x, a), b) * scaling
        return out

    def grouped(self, x: torch.Tensor, w32_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        if self.low:
            return _grouped_mm()(x.float(), w32_t, offs=offsets).to(self.dtype)
        return _grouped_mm()(x, w32_t, offs=offsets)


class _Layer:
    def __init__(self, layer: nn.Module, products: _Products):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.groups = attn.num_key_value_groups
        self.q, self.k, self.v, self.o = (self._linear(getattr(attn, p), products)
                                          for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
        gate = mlp.gate
        self.router = products.weight(gate.weight)
        self.top_k, self.num_experts, self.norm_topk_prob = gate.top_k, gate.num_experts, gate.norm_topk_prob
        experts = _unwrap_experts(mlp.experts)
        wrapped = {w.parameter_name for w in _wrappers(mlp.experts)}
        folded = set(getattr(experts, "parametrizations", {}))
        if wrapped - folded:  # outside expert_lora_materialised the weights would lack their LoRA
            raise RuntimeError(f"expert LoRA on {sorted(wrapped - folded)} is not folded: build the decode loop "
                               f"inside the engine's expert_lora_materialised context")
        self.experts = experts
        self.silu = (type(experts.act_fn).__name__ in ("SiLU", "SiLUActivation")
                     and type(experts)._apply_gate.__name__ == "_default_apply_gate")
        # Read inside the engine's context: PEFT's per-expert LoRA is folded into these (cached) weights.
        self.gate_up_t = products.weight(experts.gate_up_proj).transpose(-2, -1)
        self.down_t = products.weight(experts.down_proj).transpose(-2, -1)

    @staticmethod
    def _linear(module: nn.Module, products: _Products) -> _Linear:
        if hasattr(module, "lora_A"):
            name = module.active_adapters[0]
            if name in module.lora_A and not module.disable_adapters:
                lora = (products.weight(module.lora_A[name].weight), products.weight(module.lora_B[name].weight),
                        module.scaling[name])
                return _Linear(products.weight(module.base_layer.weight), lora)
            module = module.base_layer
        return _Linear(products.weight(module.weight))


class DecodeLoop:
    """One generation's state: the layers' weights as read for this call, the KV cache and the routes.

    Build it inside the engine's context (kernels, folded expert LoRA), run :meth:`prefill` once and
    :meth:`step` per fed-back token."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, batch_size: int, max_length: int):
        base = _base(model)
        self.model, self.dtype = base, dtype
        self.products = _Products(dtype)
        self.emulated = dtype in LOW_PRECISION
        self.layers = [_Layer(layer, self.products) for layer in base.model.layers]
        self.embed = base.model.embed_tokens.weight
        self.final_norm, self.rotary = base.model.norm, base.model.rotary_emb
        self.lm_head = self.products.weight(base.lm_head.weight)
        first = self.layers[0]
        heads = base.config.num_attention_heads
        # fp32 caches (a bf16 engine's keys and values are exact in fp32), one row per query head: what the
        # emulated attention, or transformers' repeat_kv before an fp32 sdpa, rebuilt on every call.
        self.keys = [torch.zeros(batch_size, heads, max_length, first.head_dim, dtype=torch.float32)
                     for _ in self.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.length = 0
        self.routes: list[list[torch.Tensor]] = [[] for _ in self.layers]  # per layer, per call [N, t, k]

    # -- the prompt ------------------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        """The model's own forward over the prompt (inside the engine's context, where the caller's hooks
        record its routes); seeds the cache. Returns the last position's logits [N, V] in fp32."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=True, logits_to_keep=1)
        t0 = input_ids.shape[1]
        for i, layer in enumerate(out.past_key_values.layers):
            k = layer.keys.float().repeat_interleave(self.layers[i].groups, dim=1)
            v = layer.values.float().repeat_interleave(self.layers[i].groups, dim=1)
            self.keys[i][:, :, :t0] = k
            self.values[i][:, :, :t0] = v
        self.length = t0
        return out.logits[:, -1, :].to(copy=True, dtype=torch.float32)

    # -- one fed-back token ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, key_mask: torch.Tensor,
             record_routes: bool) -> torch.Tensor:
        """Forward ``tokens`` [N] at ``positions`` [N]; ``key_mask`` [N, length + 1] marks the real keys.
        Returns the logits [N, V] in fp32."""
        t = self.length
        n = tokens.shape[0]
        x = F.embedding(tokens[:, None], self.embed)  # [N, 1, H]
        cos, sin = self.rotary(x, positions[:, None])
        # transformers gives sdpa no mask when no key is padding (and then is_causal is False for one query)
        mask = None if bool(key_mask.all()) else key_mask[:, None, None, :]
        for i, layer in enumerate(self.layers):
            residual = x
            h = layer.input_norm(x)
            x = residual + self._attention(i, layer, h, cos, sin, mask, t)
            residual = x
            h = layer.post_norm(x)
            x = residual + self._moe(i, layer, h.view(n, -1), record_routes).view(n, 1, -1)
        self.length = t + 1
        h = self.final_norm(x)
        logits = self.products.linear(h, self.lm_head)
        return logits[:, -1, :].to(copy=True, dtype=torch.float32)

    def _attention(self, i: int, layer: _Layer, h, cos, sin, mask, t: int) -> torch.Tensor:
        p = self.products
        n = h.shape[0]
        shape = (n, 1, -1, layer.head_dim)
        q = layer.q_norm(p.projection(h, layer.q).view(shape)).transpose(1, 2)
        k = layer.k_norm(p.projection(h, layer.k).view(shape)).transpose(1, 2)
        v = p.projection(h, layer.v).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = self.keys[i], self.values[i]
        keys[:, :, t:t + 1] = k.float().repeat_interleave(layer.groups, dim=1)
        values[:, :, t:t + 1] = v.float().repeat_interleave(layer.groups, dim=1)
        k_all, v_all = keys[:, :, :t + 1], values[:, :, :t + 1]
        if self.emulated:
            out = self._emulated_attention(q, k_all, v_all, mask, layer.scaling)
        elif mask is None:  # transformers lets sdpa share key/value heads only without a mask
            groups = layer.groups
            out = F.scaled_dot_product_attention(q, k_all[:, ::groups], v_all[:, ::groups], scale=layer.scaling,
                                                 enable_gqa=True)
        else:  # with a mask it repeats them (repeat_kv): the cache holds them repeated
            out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=layer.scaling)
        out = out.transpose(1, 2).contiguous().reshape(n, 1, -1).contiguous()
        return p.projection(out, layer.o)

    def _emulated_attention(self, q, keys, values, mask, scale) -> torch.Tensor:
        """``emulated_sdpa`` with its operands already in fp32 and repeated (the same operations)."""
        scores = torch.matmul(q.float(), keys.transpose(-2, -1)) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = probs.masked_fill(scores.amax(dim=-1, keepdim=True) == float("-inf"), 0.0)
        probs = probs.to(self.dtype).float()
        return torch.matmul(probs, values).to(self.dtype)

    def _gate(self, layer: _Layer, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' ``act(gate) * up``. A bf16 SiLU is computed in fp32 and rounded once: the same bf16
        bits for every finite bf16 input (``tests/rollout/test_decode.py`` checks all 65280), and 3x faster on
        the strided half of ``gate_up`` than torch's bf16 kernel."""
        if not (self.emulated and layer.silu):
            return layer.experts._apply_gate(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate.float()).to(gate.dtype) * up

    def _moe(self, i: int, layer: _Layer, h: torch.Tensor, record_routes: bool) -> torch.Tensor:
        """Qwen3-MoE's router and transformers' grouped-experts forward, op for op."""
        p = self.products
        logits = p.linear(h, layer.router)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top_value, top_index = torch.topk(probs, layer.top_k, dim=-1)
        if layer.norm_topk_prob:
            top_value /= top_value.sum(dim=-1, keepdim=True)
        top_value = top_value.to(logits.dtype)
        if record_routes:
            self.routes[i].append(top_index[:, None, :])
        n, k = top_index.shape
        sample_weights, expert_ids = top_value.reshape(-1), top_index.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids)
        selected = h[perm // k]
        weights_g = sample_weights[perm]
        per_expert = torch.histc(expert_ids_g.float(), bins=layer.num_experts, min=0, max=layer.num_experts - 1)
        offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
        out = p.grouped(selected, layer.gate_up_t, offsets)
        out = self._gate(layer, out)
        out = p.grouped(out, layer.down_t, offsets)
        weighted = out * weights_g.unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.size(0))
        return weighted[inverse].view(n, k, -1).sum(dim=1).to(h.dtype)


def logits_warpers(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """``generate``'s sampling warpers for these settings, in its order (temperature, top-k, top-p)."""
    warpers = LogitsProcessorList()
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return warpers


@torch.no_grad()
def decode(model: nn.Module, dtype: torch.dtype, engine_context: Callable[[], AbstractContextManager],
           prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *,
           max_new_tokens: int, eos_token_id: int | list[int], pad_token_id: int, greedy: bool, temperature: float,
           top_k: int, top_p: float, record_routes: bool):
    """Sample up to ``max_new_tokens`` per row as ``generate`` does. Returns (sequences [N, T0 + steps],
    raw fp32 logits of every step [N, steps, V], the decode calls' routes per layer [N, fed, k] or None).

    ``engine_context()`` is entered once, around reading the weights and the prefill: the engine's kernels
    and its folded expert LoRA. The decode calls compute their products explicitly and run outside it.
    Routes of the prompt come from the caller's hooks (``record_generation``) around the prefill; the
    decode calls' routes are returned, to be appended to them."""
    n, t0 = prompt_ids.shape
    warpers = None if greedy else logits_warpers(temperature, top_k, top_p)
    positions = prompt_mask.long().cumsum(-1) - 1
    positions = positions.masked_fill(prompt_mask == 0, 0)
    with engine_context():
        loop = DecodeLoop(model, dtype, n, t0 + max_new_tokens)
        logits = loop.prefill(prompt_ids, prompt_mask, positions)
    sequences, raw_logits = prompt_ids, []
    key_mask = prompt_mask.bool()
    stops = torch.as_tensor(eos_token_id).reshape(-1)  # a chat model ends a turn with one of several ids
    unfinished = torch.ones(n, dtype=torch.long)
    position = positions[:, -1]
    while True:
        raw_logits.append(logits)
        if greedy:
            tokens = torch.argmax(logits, dim=-1)
        else:
            probs = F.softmax(warpers(sequences, logits), dim=-1)
            tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
        tokens = tokens * unfinished + pad_token_id * (1 - unfinished)
        sequences = torch.cat([sequences, tokens[:, None]], dim=-1)
        done = torch.isin(tokens, stops.to(tokens.device)) | (sequences.shape[1] >= t0 + max_new_tokens)
        unfinished = unfinished & ~done
        if unfinished.max() == 0:
            break
        position = position + 1
        key_mask = torch.cat([key_mask, key_mask.new_ones(n, 1)], dim=-1)
        logits = loop.step(tokens, position, key_mask, record_routes)
    routes = [torch.cat(r, dim=1) for r in loop.routes] if record_routes and loop.routes[0] else None
    return sequences, torch.stack(raw_logits, dim=1), routes


