"""Quantised rollouts (fp8, int8, nvfp4, int4): each format against a reference quantiser written here
with numpy, apart from the engine's (a brute-force nearest-value search over each format's grid)."""
import numpy as np
import pytest
import torch

from moerl.config import ConfigError, LoraConfig, ModelConfig, RolloutConfig, load_config
from moerl.lora.peft_lora import apply_lora
from moerl.models.presets import build_model
from moerl.rollout.precision import (E4M3_MAX, is_quantised_weight, quantize_dequantize_e4m3,
                                     quantize_dequantize_int4, quantize_dequantize_int8,
                                     quantize_dequantize_nvfp4, round_e2m1)
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


def test_which_weights_are_quantised(tokenizer):
    policy = apply_lora(build_model(ModelConfig(preset="deepseek_v3", num_layers=3, first_k_dense=1), tokenizer),
                        LoraConfig(), "deepseek_v3")
    names = {n: is_quantised_weight(n, p) for n, p in policy.named_parameters()}
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
    assert fp8.quantised_weights and all(b[n].dtype == torch.bfloat16 for n in b)
    for name in a:
        if name in fp8.quantised_weights:
            assert not torch.equal(a[name], b[name]), name
        else:
            assert torch.equal(a[name], b[name]), name
    batch = fp8.generate(["1+2*3="], ["7"], group_size=2, seed=0)
    assert torch.isfinite(batch.rollout_logprobs).all() and batch.routing is not None


@pytest.mark.parametrize("precision", ["fp8", "int8", "nvfp4", "int4"])
def test_quantised_rollout_with_merged_refit_is_rejected(precision):
    with pytest.raises(ConfigError, match=f"rollout.dtype={precision} needs refit.mode=adapter"):
        load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml", [f"rollout.dtype={precision}", "refit.mode=merged"])


# -- independent references -------------------------------------------------------------------------
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def nearest_ties_to_even(x: np.ndarray, magnitudes: np.ndarray) -> np.ndarray:
    """Nearest of the increasing ``magnitudes`` to |x| by brute force (saturating at the largest), with
    the sign of x; a tie goes to the even index, which for both formats below is the even mantissa."""
    mag = np.minimum(np.abs(np.asarray(x, dtype=np.float64)), magnitudes[-1])
    dist = np.abs(mag[..., None] - magnitudes)
    best = dist.min(-1, keepdims=True)
    candidates = np.where(dist == best, np.arange(len(magnitudes)), 10 ** 6)
    even = np.where(candidates % 2 == 0, candidates, 10 ** 6).min(-1)
    index = np.where(even < 10 ** 6, even, candidates.min(-1))
    return np.sign(x) * magnitudes[index]


def ref_e2m1(x: np.ndarray) -> np.ndarray:
    """Nearest e2m1 value: the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 (grid position parity = mantissa bit)."""
    return nearest_ties_to_even(x, E2M1_GRID)


def ref_e4m3(x: np.ndarray) -> np.ndarray:
    """Nearest e4m3fn value: bit codes 0..126 decode to increasing magnitudes, and a code's last bit is
    its mantissa's last bit."""
    return nearest_ties_to_even(x, torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy())


def ref_nvfp4(w: np.ndarray) -> np.ndarray:
    out = np.empty_like(w)
    g = 448.0 * 6.0 / np.abs(w).max()
    for idx in np.ndindex(w.shape[:-1]):
        row = w[idx]
        for start in range(0, row.shape[0], 16):
            block = row[start:start + 16]
            s = ref_e4m3(np.array(np.abs(block).max() / 6.0 * g, dtype=np.float32))
            out[idx + (slice(start, start + 16),)] = 0.0 if s == 0 else ref_e2m1(block * g / s) * s / g
    return out


def ref_int(w: np.ndarray, group: int | None, qmax: float, lo: int, hi: int) -> np.ndarray:
    out = np.empty_like(w)
    for idx in np.ndindex(w.shape[:-1]):
        row = w[idx]
        size = group or row.shape[0]
        for start in range(0, row.shape[0], size):
            block = row[start:start + size]
            s = np.abs(block).max() / qmax
            out[idx + (slice(start, start + size),)] = np.clip(np.round(block / s), lo, hi) * s
    return out


def weights(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows of very different scale, and a few outliers, as trained weights have
    w = torch.randn(*shape, generator=g) * torch.logspace(-2, 1, shape[-2])[:, None]
    w.view(-1)[:: 97] *= 8
    return w


def test_round_e2m1_matches_the_reference_grid_search():
    x = torch.cat([torch.linspace(-7, 7, 2801), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])])
    np.testing.assert_array_equal(round_e2m1(x).numpy(), ref_e2m1(x.numpy()))


@pytest.mark.parametrize("shape", [(24, 64), (2, 8, 40)])  # 40: a last block shorter than 16
def test_nvfp4_matches_reference(shape):
    w = weights(*shape, seed=1)
    np.testing.assert_allclose(quantize_dequantize_nvfp4(w).numpy(), ref_nvfp4(w.numpy()), rtol=1e-6, atol=0)


@pytest.mark.parametrize("shape", [(24, 300), (3, 8, 64)])  # 300: groups of 128, 128 and 44; 64: one short group
def test_int4_group128_matches_reference(shape):
    w = weights(*shape, seed=2)
    np.testing.assert_allclose(quantize_dequantize_int4(w).numpy(), ref_int(w.numpy(), 128, 7.5, -8, 7),
                               rtol=1e-6, atol=0)


def test_int8_per_channel_matches_reference():
    w = weights(3, 16, 96, seed=3)
    np.testing.assert_allclose(quantize_dequantize_int8(w).numpy(), ref_int(w.numpy(), None, 127.0, -127, 127),
                               rtol=1e-6, atol=0)


def test_e4m3_reference_agrees_with_the_fp8_path():
    w = weights(16, 64, seed=4)
    scale = w.abs().amax(-1, keepdim=True) / E4M3_MAX
    ref = ref_e4m3((w / scale).numpy()) * scale.numpy()
    np.testing.assert_allclose(quantize_dequantize_e4m3(w).numpy(), ref, rtol=1e-6, atol=0)


def test_dose_order_of_the_formats_on_gaussian_weights():
    """Relative weight error, measured rather than assumed: per-channel int8 is a smaller dose than fp8
    e4m3, the 4-bit formats are the largest."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    err = {name: ((q(w) - w).norm() / w.norm()).item() for name, q in
           [("int8", quantize_dequantize_int8), ("fp8", quantize_dequantize_e4m3),
            ("nvfp4", quantize_dequantize_nvfp4), ("int4", quantize_dequantize_int4)]}
    assert err["int8"] < err["fp8"] < min(err["nvfp4"], err["int4"]), err
    assert max(err.values()) < 0.2


@pytest.mark.parametrize("precision", ["int8", "nvfp4", "int4"])
def test_quantised_engine_generates(tokenizer, precision):
    policy = apply_lora(build_model(ModelConfig(preset="qwen3_moe", init_std=0.1), tokenizer), LoraConfig(),
                        "qwen3_moe")
    engine = HFEngine(policy, tokenizer, RolloutConfig(dtype=precision, kernels="emulated", max_new_tokens=4))
    assert engine.quantised_weights and not any("lora_" in n or "lm_head" in n for n in engine.quantised_weights)
    batch = engine.generate(["1+2*3="], ["7"], group_size=2, seed=0)
    assert torch.isfinite(batch.rollout_logprobs).all() and batch.routing is not None
