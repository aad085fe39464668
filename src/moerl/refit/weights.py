"""What a refit reads from the trainer's model: adapter tensors, or the merged (effective) weights.

The trainer's policy is a PEFT model (attention LoRA as ``lora.Linear``, per-expert LoRA as nested
``ParamWrapper``s) possibly with moerl's shared / shared_outer parametrizations on the fused expert
tensors. ``effective_state_dict`` returns ``base + delta`` under the *plain* transformers names
(``model.layers.0.mlp.experts.gate_up_proj``), i.e. what a merged refit sends and what a model
without LoRA loads. Reading a PEFT-wrapped parameter directly would silently omit the LoRA.
``merged_sources`` gives the same weights, bit for bit, as lazy ``MergedWeight``s that a merged refit
computes block by block straight into its buckets.
"""
from __future__ import annotations

import re

import torch
from torch import nn
from torch.nn.utils import parametrize

from moerl.lora.expert_modes import ExpertLoRADelta

_PARAM_RE = re.compile(r"\.parametrizations\.([A-Za-z0-9_]+)\.original$")
LORA_MARKERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def plain_name(name: str) -> str:
    """A PEFT / parametrized parameter name -> the name it has in the plain transformers model."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    name = name.replace(".base_layer", "")
    return _PARAM_RE.sub(r".\1", name)


def is_lora_name(name: str) -> bool:
    return any(f".{m}" in name for m in LORA_MARKERS) or bool(
        re.search(r"\.parametrizations\.[A-Za-z0-9_]+\.\d+\.", name))


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """LoRA tensors only (PEFT names, plus ``...parametrizations.<p>.0.lora_A`` for shared modes)."""
    out = {n: p.detach() for n, p in model.named_parameters() if is_lora_name(n)}
    if not out:
        raise ValueError(f"{type(model).__name__}: no LoRA tensors found (is the model PEFT-wrapped?)")
    return out


def _base_and_lora_modules(model: nn.Module, caller: str):
    """(plain-named base tensors, [(module name, module, weight key, active adapters, moerl expert
    parametrization names)]): the walk ``effective_state_dict`` and ``merged_sources`` share."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    out: dict = {}
    for name, p in model.state_dict().items():  # parameters and persistent buffers
        if not is_lora_name(name):
            out[plain_name(name)] = p.detach()
    modules = []
    for mname, module in model.named_modules():
        key, adapters = None, []
        if isinstance(module, LoraLayer):
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            param = module.parameter_name if isinstance(module, ParamWrapper) else "weight"
            key = plain_name(f"{mname}.{param}")
            if key not in out:
                raise KeyError(f"{caller}: LoRA module {mname} adapts '{key}', not a parameter")
        plist = getattr(module, "parametrizations", None)
        expert = [n for n in (plist.keys() if plist is not None else ())
                  if any(isinstance(p, ExpertLoRADelta) for p in plist[n])]
        if key is not None or expert:
            modules.append((mname, module, key, adapters, expert))
    return out, modules


@torch.no_grad()
def effective_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Merged weights ``base + scale * B @ A`` under plain names, computed out of place (base untouched)."""
    out, modules = _base_and_lora_modules(model, "effective_state_dict")
    for mname, module, key, adapters, expert in modules:
        for adapter in adapters:
            out[key] = out[key] + module.get_delta_weight(adapter).to(out[key].dtype)
        for pname in expert:
            out[plain_name(f"{mname}.{pname}")] = getattr(module, pname).detach()
    if dtype is not None:
        out = {k: v.to(dtype) for k, v in out.items()}
    return out


class MergedWeight:
    """``base + delta_1 + delta_2 ...`` of one LoRA-adapted weight, computed a block of rows (dim 0)
    at a time, so a merged refit writes each block into its bucket while it is in cache instead of
    building full-size merged copies. Each delta is ``block(lo, hi) -> (rows lo:hi of the delta or a
    row that broadcasts, whether the caller may overwrite it)``; the arithmetic is that of
    ``effective_state_dict`` operation for operation, so the values are identical."""

    def __init__(self, base: torch.Tensor, deltas: list):
        self.base, self.deltas = base, list(deltas)
        self.shape, self.dtype = base.shape, base.dtype

    @torch.no_grad()
    def rows(self, lo: int, hi: int) -> torch.Tensor:
        out = self.base[lo:hi]
        for block in self.deltas:
            d, owned = block(lo, hi)
            d = d.to(out.dtype)
            # out + d, in that operand order; into d's memory when it is a fresh block of the same shape
            out = torch.add(out, d, out=d) if owned and d.shape == out.shape else out + d
        return out

    @torch.no_grad()
    def write(self, dst: torch.Tensor, lo: int, hi: int) -> None:
        """Rows ``lo:hi`` of the merged weight into ``dst[lo:hi]`` (casting to ``dst``'s dtype)."""
        dst[lo:hi].copy_(self.rows(lo, hi))

    def materialize(self) -> torch.Tensor:
        return self.rows(0, self.shape[0])


def _peft_experts_delta(module, adapter: str):
    """Blocks of PEFT's per-expert ``ParamWrapper.get_delta_weight`` (experts lo:hi), or None where
    only PEFT's own full computation is known to give its values (the caller then uses it)."""
    a_w, b_w, base = module.lora_A[adapter].weight, module.lora_B[adapter].weight, module.get_param()
    if module.num_experts <= 1 or not module._did_swap_in_out_features or not (
            a_w.dtype == b_w.dtype == base.dtype == torch.float32):
        return None
    num = module.num_experts
    wa = a_w.detach().reshape(num, -1, a_w.shape[-1])  # [E, r, in]
    wb = b_w.detach().reshape(b_w.shape[0], -1, num)  # [out, r, E], expert index fastest
    scale = module.scaling[adapter]

    def block(lo: int, hi: int):
        # PEFT: einsum("o r e, e r i -> e o i", B, A) * scaling, i.e. B_e @ A_e per expert, then the scale
        d = torch.empty(hi - lo, wb.shape[0], wa.shape[-1], dtype=wa.dtype)
        for e in range(lo, hi):
            torch.mm(wb[:, :, e], wa[e], out=d[e - lo])
        return d.mul_(scale), True

    return block


def _expert_param_delta(p: ExpertLoRADelta):
    """Blocks of ``ExpertLoRADelta.delta()`` (``matmul(B, A) * scale``, a factor shared by all experts
    broadcast); computed once when both factors are shared."""
    if p.lora_A.shape[0] == 1 and p.lora_B.shape[0] == 1:
        d = p.delta().detach()
        return lambda lo, hi: (d, False)

    def block(lo: int, hi: int):
        a = p.lora_A if p.lora_A.shape[0] == 1 else p.lora_A[lo:hi]
        b = p.lora_B if p.lora_B.shape[0] == 1 else p.lora_B[lo:hi]
        return (torch.matmul(b.detach(), a.detach()) * p.scale), True

    return block


@torch.no_grad()
def merged_sources(model: nn.Module) -> dict:
    """``effective_state_dict(model)`` with each LoRA-adapted weight as a lazy ``MergedWeight``
    (plain tensors for the rest): same names, same values, no merged copies made up front."""
    from peft.tuners.lora.layer import ParamWrapper

    out, modules = _base_and_lora_modules(model, "merged_sources")
    for mname, module, key, adapters, expert in modules:
        for adapter in adapters:
            src = out[key]
            block = _peft_experts_delta(module, adapter) if isinstance(module, ParamWrapper) else None
            if block is None:
                d = module.get_delta_weight(adapter).detach()
                if d.shape != src.shape:  # broadcasting delta: merge it here, as effective_state_dict
                    out[key] = (src.materialize() if isinstance(src, MergedWeight) else src) + d.to(src.dtype)
                    continue
                block = lambda lo, hi, d=d: (d[lo:hi], False)  # noqa: E731
            if isinstance(src, MergedWeight):
                src.deltas.append(block)
            else:
                out[key] = MergedWeight(src, [block])
        plist = getattr(module, "parametrizations", None)
        for pname in expert:
            key = plain_name(f"{mname}.{pname}")
            if len(plist[pname]) == 1:
                out[key] = MergedWeight(plist[pname].original.detach(), [_expert_param_delta(plist[pname][0])])
            else:  # a chain of parametrizations: evaluate it as the model does
                out[key] = getattr(module, pname).detach()
    return out


def strip_expert_lora(model: nn.Module) -> None:
    """Remove moerl expert parametrizations, keeping the *base* tensors (not merged)."""
    for _, module in model.named_modules():
        plist = getattr(module, "parametrizations", None)
        if plist is None:
            continue
        for pname in list(plist.keys()):
            parametrize.remove_parametrizations(module, pname, leave_parametrized=False)


@torch.no_grad()
def base_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The frozen base weights under plain names, *without* LoRA (what an adapter-refit engine holds)."""
    out = {plain_name(n): t.detach() for n, t in model.state_dict().items() if not is_lora_name(n)}
    if dtype is not None:
        out = {k: v.to(dtype) for k, v in out.items()}
    return out
