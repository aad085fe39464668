"""Expert LoRA variants PEFT does not have: ``shared`` and ``shared_outer``, on the fused expert layout.

transformers 5.x keeps a layer's experts as two fused tensors, ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` (Qwen3MoeExperts, MixtralExperts, DeepseekV3NaiveMoe), read by the experts
forward (grouped_mm, batched_mm or eager) as plain attributes. A ``torch.nn.utils.parametrize``
parametrization on each tensor returns ``W + scale * B @ A`` on every access, so every experts
implementation sees the adapted weights, ``block.experts`` stays the module the router hooks of
moerl.models.routers attach to, and only A/B are trainable.

Canonical LoRA layout for one fused tensor ``W [E, out, in]`` (used here, in sharding and refit):
``A [E_A, r, in]`` and ``B [E_B, out, r]`` with ``E_A, E_B`` either E (one per expert) or 1 (shared,
broadcast over experts):

| mode | gate_up A | gate_up B | down A | down B | source |
|---|---|---|---|---|---|
| per_expert | E | E | E | E | PEFT ``target_parameters`` (own layout, see ``peft_expert_factors``) |
| shared | 1 | 1 | 1 | 1 | Megatron-Bridge ``share_expert_adapters=True`` (default) |
| shared_outer | 1 | E | E | 1 | Megatron-Bridge ``experts_shared_outer_loras`` / SGLang |
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn.utils import parametrize

EXPERT_PARAMS = ("gate_up_proj", "down_proj")
EXPERT_MODES = ("per_expert", "shared", "shared_outer")

# (A shared?, B shared?) per fused tensor and mode; fc1 = gate_up_proj, fc2 = down_proj.
_SHARING = {
    "shared": {"gate_up_proj": (True, True), "down_proj": (True, True)},
    "shared_outer": {"gate_up_proj": (True, False), "down_proj": (False, True)},
    "per_expert": {"gate_up_proj": (False, False), "down_proj": (False, False)},
}


def sharing(mode: str, param: str) -> tuple[bool, bool]:
    """(A shared by all experts, B shared by all experts) for ``param`` under ``mode``."""
    if mode not in _SHARING:
        raise ValueError(f"lora.expert_mode: unknown mode '{mode}' (have: {list(EXPERT_MODES)})")
    if param not in _SHARING[mode]:
        raise ValueError(f"expert LoRA: unknown fused expert tensor '{param}' (have: {list(EXPERT_PARAMS)})")
    return _SHARING[mode][param]


class ExpertLoRADelta(nn.Module):
    """Parametrization ``W [E, out, in] -> W + scale * B @ A``; A/B broadcast over experts when shared.

    Initialised as PEFT does (A Kaiming-uniform, B zero), so the adapted model starts equal to the base.
    """

    def __init__(self, num_experts: int, out_features: int, in_features: int, rank: int, alpha: float,
                 share_a: bool, share_b: bool, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.num_experts, self.rank, self.scale = num_experts, rank, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(1 if share_a else num_experts, rank, in_features,
                                               dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(1 if share_b else num_experts, out_features, rank,
                                               dtype=dtype, device=device))
        for a in self.lora_A:  # same rule as PEFT's reset_lora_parameters (kaiming_uniform_, a=sqrt(5))
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))

    def delta(self) -> torch.Tensor:
        """``scale * B @ A`` as [E or 1, out, in] (1 when both sides are shared)."""
        return torch.matmul(self.lora_B, self.lora_A) * self.scale

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight + self.delta().to(weight.dtype)


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, experts module) of every MoE layer: modules holding both fused expert tensors."""
    found = []
    for name, module in model.named_modules():
        has = all(p in module._parameters or (parametrize.is_parametrized(module, p)) for p in EXPERT_PARAMS)
        if has:
            found.append((name, module))
    return found


def attach_expert_lora(model: nn.Module, cfg) -> list[str]:
    """Put ``cfg.expert_mode`` (shared | shared_outer) LoRA on every fused expert tensor of ``model``.

    ``cfg`` is a moerl.config.LoraConfig. Returns the names of the experts modules adapted. The base
    tensors stay frozen; the new A/B are trainable (so ``lora_state_dict`` picks them up).
    """
    if cfg.expert_mode == "per_expert":
        raise ValueError("lora.expert_mode=per_expert is PEFT target_parameters (moerl.lora.peft_lora), "
                         "not attach_expert_lora")
    experts = _experts_modules(model)
    if not experts:
        raise ValueError(f"{type(model).__name__}: no experts module with fused "
                         f"{'/'.join(EXPERT_PARAMS)} tensors found")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.init_seed + 1)  # independent of the attention adapters' draw
    for _, module in experts:
        for pname in EXPERT_PARAMS:
            if parametrize.is_parametrized(module, pname):
                raise ValueError(f"{type(module).__name__}.{pname} already carries an expert LoRA")
            weight = module._parameters[pname]
            weight.requires_grad_(False)
            share_a, share_b = sharing(cfg.expert_mode, pname)
            num_e, out_f, in_f = weight.shape
            delta = ExpertLoRADelta(num_e, out_f, in_f, cfg.rank, cfg.alpha, share_a, share_b,
                                    dtype=weight.dtype, device=weight.device)
            # unsafe=True: the parametrization keeps shape and dtype; skip its consistency probe.
            parametrize.register_parametrization(module, pname, delta, unsafe=True)
    torch.random.set_rng_state(gen_state)
    return [name for name, _ in experts]


def expert_lora_modules(model: nn.Module) -> dict[str, ExpertLoRADelta]:
    """``{"<experts module>.<param>": ExpertLoRADelta}`` for every parametrized expert tensor."""
    out = {}
    for name, module in model.named_modules():
        plist = getattr(module, "parametrizations", None)
        if plist is None:
            continue
        for pname in EXPERT_PARAMS:
            if pname in plist:
                for p in plist[pname]:
                    if isinstance(p, ExpertLoRADelta):
                        out[f"{name}.{pname}"] = p
    return out


# ---- PEFT per_expert layout <-> canonical ------------------------------------------------------


def peft_expert_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int):
    """PEFT ParamWrapper factors -> canonical ``A [E, r, in]``, ``B [E, out, r]``.

    PEFT stores ``lora_A.weight [E*r, in]`` expert-major and ``lora_B.weight [out, r*E]`` with the
    expert index *fastest* (see peft.tuners.lora.layer.ParamWrapper.get_delta_weight).
    """
    if lora_a.shape[0] % num_experts or lora_b.shape[1] % num_experts:
        raise ValueError(f"PEFT expert LoRA: A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} do not "
                         f"split into {num_experts} experts")
    a = lora_a.reshape(num_experts, -1, lora_a.shape[-1])
    b = lora_b.reshape(lora_b.shape[0], -1, num_experts).permute(2, 0, 1)
    return a, b


def peft_expert_tensors(a: torch.Tensor, b: torch.Tensor):
    """Canonical ``A [E, r, in]``, ``B [E, out, r]`` -> PEFT ``lora_A.weight``, ``lora_B.weight``."""
    num_e, rank, in_f = a.shape
    return a.reshape(num_e * rank, in_f), b.permute(1, 2, 0).reshape(b.shape[1], rank * num_e)
