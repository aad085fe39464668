"""FP8 rollout: e4m3 weights with per-channel scales, computed in bf16."""
import pytest
import torch

from moerl.config import ConfigError, LoraConfig, ModelConfig, RolloutConfig, load_config
from moerl.lora.peft_lora import apply_lora
from moerl.models.presets import build_model
from moerl.rollout.fp8 import E4M3_MAX, is_fp8_weight, quantize_dequantize_e4m3
from moerl.rollout.hf import HFEngine


def test_round_trip_is_e4m3_per_output_channel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 16, 64, generator=g) * torch.logspace(-3, 1, 16)[None, :, None]  # rows of very different scale
    dq = quantize_dequantize_e4m3(w)
    scale = w.abs().amax(-1, keepdim=True) / E4M3_MAX
    q = dq / scale
    # Every value is an e4m3 number times its row's scale; each row's largest magnitude survives exactly.
    torch.testing.assert_close(q, q.to(torch.float8_e4m3fn).float(), rtol=0, atol=1e-4)
    torch.testing.assert_close(dq.abs().amax(-1), w.abs().amax(-1), rtol=1e-6, atol=0)
    normal = q.abs() >= 2.0 ** -6  # e4m3 normal range: relative error <= half an ulp of a 3-bit mantissa
    assert ((dq - w).abs() <= w.abs() * 2.0 ** -4 + 1e-12)[normal].all()
    assert not torch.equal(dq, w)


def test_which_weights_are_fp8(tokenizer):
    policy = apply_lora(build_model(ModelConfig(preset="deepseek_v3", num_layers=3, first_k_dense=1), tokenizer),
                        LoraConfig(), "deepseek_v3")
    names = {n: is_fp8_weight(n, p) for n, p in policy.named_parameters()}
    assert not any(v for n, v in names.items() if "lora_" in n or "embed_tokens" in n or "lm_head" in n)
    assert not any(v for n, v in names.items() if n.endswith("mlp.gate.weight"))  # the router stays bf16
    assert any(v for n, v in names.items() if "experts" in n and "gate_up_proj" in n)
    assert any(v for n, v in names.items() if "shared_experts" in n)
    assert any(v for n, v in names.items() if "layers.0.mlp" in n)  # the dense first layer
    assert any(v for n, v in names.items() if "self_attn" in n)


def test_fp8_engine_rounds_base_weights_only_and_generates(tokenizer):
    policy = apply_lora(build_model(ModelConfig(preset="qwen3_moe", init_std=0.1), tokenizer), LoraConfig(),
                        "qwen3_moe")
    bf16 = HFEngine(policy, tokenizer, RolloutConfig(dtype="bf16", max_new_tokens=4))
    fp8 = HFEngine(policy, tokenizer, RolloutConfig(dtype="fp8", max_new_tokens=4))
    a, b = dict(bf16.model.named_parameters()), dict(fp8.model.named_parameters())
    assert fp8.fp8_weights and all(b[n].dtype == torch.bfloat16 for n in b)
    for name in a:
        if name in fp8.fp8_weights:
            assert not torch.equal(a[name], b[name]), name
        else:
            assert torch.equal(a[name], b[name]), name
    batch = fp8.generate(["1+2*3="], ["7"], group_size=2, seed=0)
    assert torch.isfinite(batch.rollout_logprobs).all() and batch.routing is not None


def test_fp8_with_merged_refit_is_rejected():
    with pytest.raises(ConfigError, match="rollout.dtype=fp8 needs refit.mode=adapter"):
        load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml", ["rollout.dtype=fp8", "refit.mode=merged"])
