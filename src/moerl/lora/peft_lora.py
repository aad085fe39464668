"""LoRA on attention and on the fused expert tensors with PEFT (``target_parameters``).

PEFT's ``target_parameters`` puts a LoRA on each fused 3-D expert parameter ([E, out, in]) with one
A/B pair per expert: the ``per_expert`` mode. The ``shared`` and ``shared_outer`` modes
(Megatron-Bridge's default and its variant) live in moerl.lora.expert_modes.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Iterator

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model

from moerl.config import LoraConfig
from moerl.models.families import FAMILIES, attention_targets

# The tiny presets' targets (their models always have these projections); a checkpoint's come from its model.
ATTENTION_TARGETS = {
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
}
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def peft_config(cfg: LoraConfig, preset: str, model: torch.nn.Module | None = None) -> PeftLoraConfig:
    """PEFT's config for ``preset`` (a family's model_type); with ``model``, the attention projections it has."""
    if not (cfg.target_attention or cfg.target_experts):
        raise ValueError("lora: at least one of target_attention / target_experts must be true")
    attention = attention_targets(model, preset) if model is not None and preset in FAMILIES \
        else ATTENTION_TARGETS[preset]
    experts = list(FAMILIES[preset].experts) if preset in FAMILIES else EXPERT_TARGETS
    return PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=0.0,  # ParamWrapper requires dropout 0
        target_modules=attention if cfg.target_attention else [],
        target_parameters=experts if cfg.target_experts and cfg.expert_mode == "per_expert" else None,
        bias="none",
    )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig, preset: str):
    """Wrap ``model`` with LoRA adapters; only adapter weights stay trainable. ``preset``: the family's
    model_type (a tiny preset's name, or a checkpoint's ``config.model_type``)."""
    torch.manual_seed(cfg.init_seed)
    if not cfg.target_attention and cfg.target_experts and cfg.expert_mode != "per_expert":
        # Nothing for PEFT to wrap (PEFT refuses an empty target list): freeze the base and let
        # moerl.lora.expert_modes add the only adapters.
        from moerl.lora.expert_modes import attach_expert_lora

        model.requires_grad_(False)
        attach_expert_lora(model, cfg)
        return model
    peft_model = get_peft_model(model, peft_config(cfg, preset, model))
    if cfg.target_experts and cfg.expert_mode != "per_expert":
        from moerl.lora.expert_modes import attach_expert_lora

        attach_expert_lora(peft_model, cfg)
    return peft_model


def lora_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors only (what adapter refit sends), detached."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


@contextmanager
def expert_lora_materialised(model: torch.nn.Module) -> Iterator[int]:
    """Inference only: each LoRA-wrapped expert tensor's effective weight, computed once for the
    whole context instead of on every forward; yields how many tensors were materialised.

    PEFT's ``ParamWrapper`` registers a parametrization on every forward that folds
    ``W + scaling * B @ A`` into one ``baddbmm`` over the whole expert stack, then removes it. In a
    generation loop that is one fold per decoded token, per layer, per tensor (about a third of a
    decode step here), while the weights only change at a refit. We enter PEFT's own activation
    (the same fold, in the same dtype) once and make the wrappers call their base layer directly
    until the context ends, so every forward sees bit-identical weights.
    """
    from peft.tuners.lora.layer import ParamWrapper

    if torch.is_grad_enabled():
        raise RuntimeError("expert_lora_materialised is for inference (torch.no_grad()): a cached "
                           "fold would be shared by the autograd graphs of several forwards")
    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper) and not m.disable_adapters
                and not m.merged]
    with ExitStack() as stack:
        for wrapper in wrappers:
            stack.enter_context(wrapper._activate_lora(wrapper.active_adapters))
            wrapper.forward = wrapper.base_layer.__call__  # an instance attribute shadows the class's
            stack.callback(delattr, wrapper, "forward")
        yield len(wrappers)
