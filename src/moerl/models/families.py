"""The MoE families moerl trains, as a table: what a checkpoint's ``model_type`` maps to.

One row per family says where LoRA goes (attention projections and routed-expert tensors, by the names
transformers gives them) and how its router is read and replayed (``moerl.models.routers``). The tiny
presets (``model.preset``) and a user's checkpoint (``model.path``) go through the same rows, so a
checkpoint of a family here gets capture, R2/R3 replay, refit and every rollout precision with no code of
its own.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Family:
    model_type: str
    # Attention projections LoRA may target; those the checkpoint has are used (DeepSeek's q_proj exists only
    # without a q LoRA rank, q_a_proj/q_b_proj only with one).
    attention: tuple[str, ...]
    # The fused routed-expert tensors (PEFT ``target_parameters``), each [E, out, in].
    experts: tuple[str, ...]
    # Dense leading layers (config key) and shared experts, for the README's table and the probe's figure.
    dense_first_key: str | None = None
    shared_experts: str = "none"
    examples: str = ""


_MHA = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("qwen3_moe", _MHA, _FUSED, examples="Qwen3-30B-A3B, Qwen3-235B-A22B"),
    Family("mixtral", _MHA, _FUSED, examples="Mixtral-8x7B"),
    Family("deepseek_v3", _MLA, _FUSED, "first_k_dense_replace", "always-on shared experts",
           "Moonlight-16B-A3B, DeepSeek-V3, Kimi-K2 (shrunk)"),
    Family("olmoe", _MHA, _FUSED, examples="OLMoE-1B-7B (0924, 0125, -Instruct)"),
    Family("qwen2_moe", _MHA, _FUSED, shared_experts="one sigmoid-gated shared expert",
           examples="Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B"),
    Family("deepseek_v2", _MLA, _FUSED, "first_k_dense_replace", "always-on shared experts",
           "DeepSeek-V2-Lite, DeepSeek-V2"),
    Family("granitemoe", _MHA, ("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight"),
           examples="granite-3.1-1b-a400m, granite-3.1-3b-a800m"),
)}


def family(model_type: str) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not a supported MoE family (supported: "
                         f"{', '.join(FAMILIES)})") from None


def attention_targets(model: nn.Module, model_type: str) -> list[str]:
    """The attention projections of ``model_type`` that ``model`` has (LoRA ``target_modules``)."""
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return [t for t in family(model_type).attention if t in present]
