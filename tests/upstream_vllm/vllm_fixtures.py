"""A tiny Qwen3-MoE policy (LoRA on attention) and a VLLMEngine over its base weights, on vLLM's CPU build.

head_dim 32: vLLM's CPU attention refuses smaller heads ("Unsupported CPU attention configuration:
head_dim=16"). init_std 0.1 so the next-token distributions are far from uniform and a bf16
mismatch or a missing adapter shows in the logprobs.
"""
from __future__ import annotations

import torch

from moerl.config import LoraConfig, ModelConfig, RolloutConfig

MODEL = ModelConfig(preset="qwen3_moe", hidden_size=64, num_layers=2, num_experts=8, top_k=2,
                    moe_intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=32, init_std=0.1)
LORA = LoraConfig(rank=8, alpha=16.0, target_attention=True, target_experts=False)
ROLLOUT = RolloutConfig(dtype="bf16", max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0,
                        capture_routing=False)
QUESTIONS = ["12 + 3 * 4", "7 + 8 * 9", "40 + 2 * 5", "3 + 3 * 3"]


def build_policy(seed: int = 0):
    from moerl.data.tokenizer import build_tokenizer
    from moerl.lora.peft_lora import apply_lora
    from moerl.models.presets import build_model

    tok = build_tokenizer()
    policy = apply_lora(build_model(MODEL, tok, seed=seed), LORA, MODEL.preset).eval()
    return policy, tok


@torch.no_grad()
def randomize_adapter(policy, seed: int, scale: float = 0.5) -> None:
    """Give every LoRA B a random value (PEFT initialises B = 0: an adapter with no effect)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in policy.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=g) * scale)


@torch.no_grad()
def teacher_forced_logprobs(model, batch) -> torch.Tensor:
    from moerl.trainer.logprobs import forward_logprobs

    return forward_logprobs(model, batch)[0]


def mismatch(reference: torch.Tensor, batch) -> dict:
    """k3 (mean and max over response tokens) and max |Δ logp| of the engine's logprobs against ``reference``."""
    from moerl.trainer.metrics import mismatch_metrics

    m = mismatch_metrics(reference, batch.rollout_logprobs, batch.response_mask)
    delta = (reference - batch.rollout_logprobs)[batch.response_mask]
    return {"k3": m["mismatch/k3"], "k3_max": m["mismatch/k3_max"], "max_abs_dlogp": float(delta.abs().max()),
            "mean_abs_dlogp": float(delta.abs().mean()), "tokens": int(batch.response_mask.sum())}
