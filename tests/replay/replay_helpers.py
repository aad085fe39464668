"""Shared builders for the replay tests (a unique module name; tests/ has no packages)."""
from __future__ import annotations

import functools

import torch

from moerl.config import ModelConfig
from moerl.data.tokenizer import build_tokenizer
from moerl.models.presets import build_model
from moerl.replay.trace import RoutingTrace, index_dtype

PRESETS = ("qwen3_moe", "deepseek_v3", "mixtral")


@functools.lru_cache(maxsize=1)
def tokenizer():
    return build_tokenizer()


def small_config(preset: str, **kw) -> ModelConfig:
    """Small and sharp (init_std=0.1, so routing matters); DeepSeek-V3's MLA needs kv heads = heads."""
    base = dict(preset=preset, hidden_size=32, num_layers=3, num_experts=8, top_k=2, moe_intermediate_size=32,
                num_heads=2, num_kv_heads=2 if preset == "deepseek_v3" else 1, head_dim=16, init_std=0.1,
                first_k_dense=1, n_group=2, topk_group=1, experts_implementation="eager")
    base.update(kw)
    return ModelConfig(**base)


def small_model(preset: str, seed: int = 0, **kw):
    return build_model(small_config(preset, **kw), tokenizer(), seed=seed)


def random_ids(n: int, t: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, len(tokenizer()), (n, t), generator=g)


def random_trace(n, t, moe_layers, num_experts, top_k, seed=0, valid=None) -> RoutingTrace:
    """Distinct experts per row (a random permutation's first k)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(n, t, len(moe_layers), num_experts, generator=g).argsort(-1)[..., :top_k]
    if valid is None:
        valid = torch.rand(n, t, generator=g) < 0.8
    return RoutingTrace(idx.to(index_dtype(num_experts)), valid, tuple(moe_layers), num_experts, top_k)
