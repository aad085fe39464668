"""Tiny MoE presets built from transformers configs with random init: nothing is downloaded.

The families are the real transformers classes (Qwen3-MoE, DeepSeek-V3 = the Kimi-K2/Moonlight
architecture, Mixtral), shrunk by config, so routing, fused expert tensors and precision effects
are the ones a full-size model has.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, MixtralConfig, PretrainedConfig,
                          Qwen3MoeConfig)

from moerl.config import ModelConfig
from moerl.models.experts import implementation

PRESETS = ("qwen3_moe", "deepseek_v3", "mixtral")


def build_hf_config(cfg: ModelConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int,
                    max_positions: int = 256) -> PretrainedConfig:
    common = dict(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        num_experts_per_tok=cfg.top_k, initializer_range=cfg.init_std,
        max_position_embeddings=max_positions, pad_token_id=pad_id, bos_token_id=bos_id,
        eos_token_id=eos_id, tie_word_embeddings=False, router_aux_loss_coef=cfg.router_aux_loss_coef,
    )
    if cfg.preset == "qwen3_moe":
        hf = Qwen3MoeConfig(**common, head_dim=cfg.head_dim, num_experts=cfg.num_experts,
                            moe_intermediate_size=cfg.moe_intermediate_size,
                            intermediate_size=cfg.moe_intermediate_size * 2, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[])
    elif cfg.preset == "mixtral":
        hf = MixtralConfig(**common, head_dim=cfg.head_dim, num_local_experts=cfg.num_experts,
                           intermediate_size=cfg.moe_intermediate_size)
    elif cfg.preset == "deepseek_v3":
        # MLA attention, as in DeepSeek-V3/Kimi-K2, shrunk: q/kv low-rank projections and a rope part.
        # MLA projects keys and values for every head: no grouped-query sharing.
        common["num_key_value_heads"] = cfg.num_heads
        hf = DeepseekV3Config(**common, n_routed_experts=cfg.num_experts,
                              moe_intermediate_size=cfg.moe_intermediate_size,
                              intermediate_size=cfg.moe_intermediate_size * 2,
                              n_shared_experts=cfg.n_shared_experts, first_k_dense_replace=cfg.first_k_dense,
                              n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=True,
                              routed_scaling_factor=2.5, q_lora_rank=cfg.hidden_size // 2,
                              kv_lora_rank=cfg.hidden_size // 4, qk_nope_head_dim=cfg.head_dim // 2,
                              qk_rope_head_dim=cfg.head_dim // 2, v_head_dim=cfg.head_dim,
                              rope_interleave=True)
    else:
        raise ValueError(f"model.preset: unknown preset '{cfg.preset}' (have: {list(PRESETS)})")
    for key, value in cfg.overrides.items():
        if not hasattr(hf, key):
            raise ValueError(f"model.overrides.{key}: not a key of {type(hf).__name__}")
        setattr(hf, key, value)
    return hf


def max_positions(cfg: ModelConfig) -> int:
    """The positions the model is built with (256, or ``model.overrides.max_position_embeddings``)."""
    return int(cfg.overrides.get("max_position_embeddings", 256))


def check_overrides(cfg: ModelConfig, tokenizer) -> None:
    """Build the model with ``model.overrides`` and run two tokens through it: an override value the model
    class cannot take fails deep inside transformers (an IndexError, a ZeroDivisionError) naming no key.
    Raises a ConfigError naming ``model.overrides``. Nothing to do without overrides."""
    from moerl.config import ConfigError

    if not cfg.overrides:
        return
    try:
        model = build_model(cfg, tokenizer)
        with torch.no_grad():
            model(input_ids=torch.tensor([[tokenizer.bos_token_id, len(tokenizer) - 1]]))  # the largest id
    except Exception as err:  # noqa: BLE001 - whatever the model class raises, the override is the cause
        raise ConfigError(f"model.overrides={cfg.overrides}: the model cannot be built or run with it "
                          f"({type(err).__name__}: {' '.join(str(err).split())[:160]}); fix or remove the override") \
            from None


def build_model(cfg: ModelConfig, tokenizer, seed: int = 0, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A randomly initialised fp32 causal LM for ``cfg`` (deterministic in ``seed`` on one device).

    ``device``: where the weights are created and initialised. A GPU initialises a model of billions of
    parameters in milliseconds where a CPU thread takes tens of seconds; its random stream is the GPU's,
    so the initial weights differ from the CPU's for the same seed."""
    hf_cfg = build_hf_config(cfg, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id,
                             tokenizer.eos_token_id, max_positions(cfg))
    torch.manual_seed(seed)
    with nullcontext() if torch.device(device).type == "cpu" else torch.device(device):
        model = AutoModelForCausalLM.from_config(
            hf_cfg, experts_implementation=implementation(cfg.experts_implementation), attn_implementation="sdpa")
    return model.float()
