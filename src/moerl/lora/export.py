"""The trained LoRA as adapters other tools load: PEFT's own format and vLLM's per-expert format.

    paths = export_adapter(policy, cfg, run_dir / "checkpoints" / "step_60" / "adapter",
                           base_model="results/warm_start/qwen3_moe-1d51b6386b44")

- ``peft/``: what ``PeftModel.save_pretrained`` writes for the fused-expert transformers model
  (``target_parameters`` on ``mlp.experts.gate_up_proj`` / ``down_proj``); load it with
  ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_model), path)``.
- ``vllm/``: per-expert linear names (``experts.{e}.gate_proj`` ...), the layout vLLM's
  ``LLMEngine.add_lora`` and Megatron-Bridge's HF export use (moerl.refit.adapter_format).

The shared expert modes (Megatron-Bridge's ``share_expert_adapters`` and shared-outer) are not a
PEFT feature: their factors are expanded to one per expert first, which computes exactly the same
weights, so both directories load with stock PEFT / vLLM whatever mode was trained.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from moerl.refit.adapter_format import AdapterMap, canonical_adapter, save_hf_adapter


def per_expert_canonical(canonical: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Expand shared expert factors ([1, ...]) to one copy per expert ([E, ...])."""
    out = {}
    for name, t in canonical.items():
        if ".experts." in f".{name}" and t.dim() == 3 and t.shape[0] == 1 and num_experts > 1:
            t = t.expand(num_experts, *t.shape[1:])
        out[name] = t.contiguous()
    return out


def export_adapter(policy: nn.Module, cfg, out_dir: str | Path, base_model: str = "") -> dict[str, Path]:
    """Write ``out_dir/peft`` and ``out_dir/vllm`` for the LoRA of ``policy`` (moerl.lora.peft_lora
    applied under ``cfg.lora``, ``cfg`` an ExperimentConfig); returns both paths."""
    out_dir = Path(out_dir)
    canonical = {k: v.detach().float().cpu() for k, v in canonical_adapter(policy).items()}
    from moerl.models.routers import find_moe_layers

    # the model's own family and expert count (a checkpoint's, not the tiny preset keys it leaves unused)
    family = policy.config.model_type if cfg.model.path else cfg.model.preset
    num_experts = find_moe_layers(policy)[0].num_experts if cfg.model.path else cfg.model.num_experts
    peft_model = policy
    if cfg.lora.expert_mode != "per_expert":
        # The adapter file holds no base weights: a per-expert PEFT copy of the architecture (random
        # base, built from the config) only has to carry the expanded factors to save_pretrained.
        from moerl.data.tokenizer import build_tokenizer
        from moerl.lora.peft_lora import apply_lora
        from moerl.models.presets import build_model

        per_expert = replace(cfg.lora, expert_mode="per_expert")
        peft_model = apply_lora(build_model(cfg.model, build_tokenizer()), per_expert, cfg.model.preset)
        AdapterMap(peft_model).load(per_expert_canonical(canonical, num_experts))
    base_model = resolvable_base_model(base_model) if base_model else ""
    peft_dir = out_dir / "peft"
    peft_model.save_pretrained(str(peft_dir))
    if base_model:
        _set_base_model(peft_dir, base_model)
    from moerl.refit.adapter_format import EXPERT_LINEARS

    if family not in EXPERT_LINEARS:  # Granite-MoE's hub weights are fused 3-D tensors: no per-expert names
        return {"peft": peft_dir}
    vllm_dir = save_hf_adapter(out_dir / "vllm", canonical, family, num_experts, cfg.lora.rank,
                               cfg.lora.alpha, base_model)
    return {"peft": peft_dir, "vllm": vllm_dir}


def resolvable_base_model(base_model: str | Path) -> str:
    """The base model as an adapter's ``base_model_name_or_path`` must name it to be found from
    wherever the adapter is loaded: a local directory by its absolute path (a path relative to the
    repository would resolve against the loader's working directory), a hub name unchanged."""
    local = Path(base_model).expanduser()
    return str(local.resolve()) if local.exists() else str(base_model)


def _set_base_model(peft_dir: Path, base_model: str) -> None:
    import json

    path = peft_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = str(base_model)
    path.write_text(json.dumps(config, indent=2) + "\n")
