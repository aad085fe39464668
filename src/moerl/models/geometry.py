"""Routing geometries of the cluster models at CPU width.

A geometry is the routing structure of a published model: how many decoder layers, how many of them
are dense, how many routed and shared experts, the top-k, expert groups and the scoring rule. The values
come from the model's published config.json, shipped in ``moerl/models/public_configs`` (each file
names its source in ``_source``); nothing is downloaded. The width (hidden size, expert FFN size,
attention heads) is not the published one: a CPU cannot hold it, so the caller chooses it and
``geometry_model_config`` says which is which.

    Qwen3-30B-A3B       qwen3_30b_a3b.json      48 layers, all MoE, 128 experts, top-8, softmax, normalised top-k
    Moonlight-16B-A3B   moonlight_16b_a3b.json  27 layers, first dense, 64 routed top-6 + 2 shared, sigmoid + bias
    DeepSeek-V3         deepseek_v3.json        61 layers, first 3 dense, 256 routed top-8, 8 groups / top-4, 1 shared
    Kimi-K2             kimi_k2.json            61 layers, first dense, 384 routed top-8, 1 shared, 1 group

The DeepSeek-V3 family (Moonlight and Kimi-K2 use its transformers class) scores experts with a
sigmoid, selects on score + ``e_score_correction_bias`` within the top ``topk_group`` of ``n_group``
groups, and weights the chosen experts by their normalised sigmoid scores times
``routed_scaling_factor``. The correction bias is a learned buffer (auxiliary-loss-free balancing);
at random init it is zero, as every other weight here is untrained.
"""
from __future__ import annotations

import json
from pathlib import Path

from moerl.config import ModelConfig

PUBLIC_CONFIG_DIR = Path(__file__).resolve().parent / "public_configs"

# geometry name -> the shipped public config it is read from
GEOMETRIES = {
    "qwen3_30b_a3b": "qwen3_30b_a3b.json",
    "moonlight_16b_a3b": "moonlight_16b_a3b.json",
    "deepseek_v3": "deepseek_v3.json",
    "kimi_k2": "kimi_k2.json",
}

# The CPU width every geometry is built at unless the caller says otherwise: experiment 05's width
# (hidden 64, expert FFN 32, 2 heads of 32), so geometry is the only thing that changes.
CPU_WIDTH = dict(hidden_size=64, moe_intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=32)


def public_config(name: str) -> dict:
    """The published config.json values of geometry ``name`` (with its ``_source`` citation)."""
    if name not in GEOMETRIES:
        raise ValueError(f"unknown geometry '{name}' (have: {sorted(GEOMETRIES)})")
    return json.loads((PUBLIC_CONFIG_DIR / GEOMETRIES[name]).read_text())


def routing_structure(name: str) -> dict:
    """The routing structure of ``name`` as the published file states it, in one flat dict.

    Keys: family, layers, dense_layers, moe_layers, experts, top_k, shared_experts, groups,
    topk_group, scoring, norm_topk_prob, routed_scaling_factor, source."""
    pub = public_config(name)
    layers = pub["num_hidden_layers"]
    if pub["family"] == "qwen3_moe":
        if pub.get("decoder_sparse_step", 1) != 1 or pub.get("mlp_only_layers"):
            raise ValueError(f"{name}: only all-MoE Qwen3 configs are supported")
        return dict(family="qwen3_moe", layers=layers, dense_layers=0, moe_layers=layers,
                    experts=pub["num_experts"], top_k=pub["num_experts_per_tok"], shared_experts=0,
                    groups=1, topk_group=1, scoring="softmax", norm_topk_prob=pub["norm_topk_prob"],
                    routed_scaling_factor=1.0, source=pub["_source"])
    dense = pub["first_k_dense_replace"]
    return dict(family="deepseek_v3", layers=layers, dense_layers=dense, moe_layers=layers - dense,
                experts=pub["n_routed_experts"], top_k=pub["num_experts_per_tok"],
                shared_experts=pub["n_shared_experts"], groups=pub["n_group"], topk_group=pub["topk_group"],
                scoring=pub["scoring_func"], norm_topk_prob=True,
                routed_scaling_factor=pub["routed_scaling_factor"], source=pub["_source"])


def geometry_model_config(name: str, **width) -> ModelConfig:
    """A ModelConfig with the routing structure of ``name`` and a CPU width.

    ``width`` may set hidden_size, moe_intermediate_size, num_heads, num_kv_heads, head_dim, init_std
    and experts_implementation (defaults: ``CPU_WIDTH``); the routing structure is not negotiable."""
    allowed = set(CPU_WIDTH) | {"init_std", "experts_implementation"}
    unknown = set(width) - allowed
    if unknown:
        raise ValueError(f"geometry_model_config: {sorted(unknown)} are routing structure, not width "
                         f"(width keys: {sorted(allowed)})")
    s = routing_structure(name)
    fields = {**CPU_WIDTH, **width}
    if s["family"] == "qwen3_moe":
        return ModelConfig(preset="qwen3_moe", num_layers=s["layers"], num_experts=s["experts"],
                           top_k=s["top_k"], **fields)
    pub = public_config(name)
    overrides = {"routed_scaling_factor": s["routed_scaling_factor"]}
    if pub.get("q_lora_rank") is None:  # Moonlight projects queries directly (no query LoRA)
        overrides["q_lora_rank"] = None
    return ModelConfig(preset="deepseek_v3", num_layers=s["layers"], num_experts=s["experts"], top_k=s["top_k"],
                       first_k_dense=s["dense_layers"], n_shared_experts=s["shared_experts"],
                       n_group=s["groups"], topk_group=s["topk_group"], overrides=overrides, **fields)

