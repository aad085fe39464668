"""Engine-side appliers: validate a whole refit first, then copy (never half-updated weights)."""
from __future__ import annotations

import torch
from torch import nn

from moerl.refit.adapter_format import AdapterMap, AdapterMismatchError
from moerl.refit.weights import is_lora_name, plain_name


class BaseLoader:
    """Plain-name full weights (``model.layers.0.mlp.experts.gate_up_proj``) into a plain or PEFT model.

    With ``zero_lora`` (merged refit into a PEFT engine) every LoRA B is zeroed after the copy, so the
    engine computes exactly the merged weights it was sent."""

    def __init__(self, model: nn.Module, zero_lora: bool = False):
        self.targets: dict[str, torch.Tensor] = {}
        self.lora_b: list[torch.Tensor] = []
        for name, t in model.state_dict(keep_vars=True).items():
            if is_lora_name(name):
                if "lora_B" in name:
                    self.lora_b.append(t)
                continue
            self.targets[plain_name(name)] = t
        self.zero_lora = zero_lora

    def check(self, tensors: dict[str, torch.Tensor], strict: bool = True) -> None:
        for name in sorted(tensors):
            if name not in self.targets:
                raise AdapterMismatchError(f"weight '{name}': the engine's model has no such tensor")
            if tuple(tensors[name].shape) != tuple(self.targets[name].shape):
                raise AdapterMismatchError(f"weight '{name}': shape {tuple(tensors[name].shape)}, the engine's "
                                           f"model expects {tuple(self.targets[name].shape)}")
        if strict:
            missing = sorted(set(self.targets) - set(tensors))
            if missing:
                raise AdapterMismatchError(f"weight '{missing[0]}': missing from a full-weight refit "
                                           f"({len(missing)} missing in all)")

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor], strict: bool = True) -> None:
        self.check(tensors, strict)
        for name, t in tensors.items():
            self.targets[name].data.copy_(t)
        if self.zero_lora:
            for b in self.lora_b:
                b.data.zero_()


def make_apply(model: nn.Module, mode: str):
    """``apply(tensors)`` for a refit ``mode`` (adapter | merged) into ``model``; maps built once."""
    if mode == "adapter":
        return AdapterMap(model).load
    if mode == "merged":
        return BaseLoader(model, zero_lora=True).load
    raise ValueError(f"refit.mode: unknown mode '{mode}' (have: adapter, merged)")
