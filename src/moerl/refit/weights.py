"""What a refit reads from the trainer's model: adapter tensors, or the merged (effective) weights.

The trainer's policy is a PEFT model (attention LoRA as ``lora.Linear``, per-expert LoRA as nested
``ParamWrapper``s) possibly with moerl's shared / shared_outer parametrizations on the fused expert
tensors. ``effective_state_dict`` returns ``base + delta`` under the *plain* transformers names
(``model.layers.0.mlp.experts.gate_up_proj``), i.e. what a merged refit sends and what a model
without LoRA loads. Reading a PEFT-wrapped parameter directly would silently omit the LoRA.
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


@torch.no_grad()
def effective_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Merged weights ``base + scale * B @ A`` under plain names, computed out of place (base untouched)."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    out: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():  # parameters and persistent buffers
        if not is_lora_name(name):
            out[plain_name(name)] = p.detach()
    for mname, module in model.named_modules():
        if isinstance(module, LoraLayer):
            adapters = [a for a in module.active_adapters if a in module.lora_A]
            if isinstance(module, ParamWrapper):
                key = plain_name(f"{mname}.{module.parameter_name}")
            else:
                key = plain_name(f"{mname}.weight")
            if key not in out:
                raise KeyError(f"effective_state_dict: LoRA module {mname} adapts '{key}', not a parameter")
            for adapter in adapters:
                out[key] = out[key] + module.get_delta_weight(adapter).to(out[key].dtype)
        plist = getattr(module, "parametrizations", None)
        if plist is not None:
            for pname in list(plist.keys()):
                if any(isinstance(p, ExpertLoRADelta) for p in plist[pname]):
                    out[plain_name(f"{mname}.{pname}")] = getattr(module, pname).detach()
    if dtype is not None:
        out = {k: v.to(dtype) for k, v in out.items()}
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
