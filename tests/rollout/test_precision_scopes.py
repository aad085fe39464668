"""Where the 4-bit mismatch lives: rungs that quantise the routed experts only or attention only,
Kimi-K2-Thinking's INT4 experts (against a reference quantiser written here with numpy), and the
trainer-side mitigation that puts the trainer's own weights on the engine's grid."""
import numpy as np
import pytest
import torch

from moerl.config import ConfigError, LoraConfig, ModelConfig, RolloutConfig, load_config
from moerl.lora.peft_lora import apply_lora
from moerl.models.presets import build_model
from moerl.rollout.hf import HFEngine
from moerl.rollout.precision import (QUANTIZERS, fake_quantize_masters, fake_quantize_ste,
                                     quantize_dequantize_int4, quantize_dequantize_int4_kimi,
                                     quantize_dequantize_nvfp4)


def kimi_reference(w: np.ndarray) -> np.ndarray:
    """compressed-tensors symmetric int4, group 32 along the input, Kimi's QAT grid: scale = amax / 7 stored
    in bf16, w / scale computed on bf16 values and rounded to bf16 before rounding to a code in [-7, 7],
    dequantised values in bf16. bf16 rounding: round-to-nearest-even on the top 16 bits of the fp32
    pattern."""
    def bf16(x):
        bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return rounded.astype(np.uint32).view(np.float32)

    out = np.empty_like(w, dtype=np.float32)
    rows = bf16(w.reshape(-1, w.shape[-1]))  # the engine's bf16 copy
    flat = out.reshape(-1, w.shape[-1])
    for r, row in enumerate(rows):
        for start in range(0, row.size, 32):
            group = row[start:start + 32]
            scale = bf16(np.float32(np.abs(group).max()) / np.float32(7.0))
            codes = np.clip(np.round(bf16(group / scale)), -7, 7) if scale else np.zeros_like(group)
            flat[r, start:start + 32] = bf16(codes.astype(np.float32) * scale)
    return out


def test_kimi_int4_matches_the_reference_and_is_idempotent():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 24, 96, generator=g) * torch.logspace(-3, 0, 24)[None, :, None]
    w[0, 0, :32] = 0.0  # an all-zero group stays zero
    dq = quantize_dequantize_int4_kimi(w)
    np.testing.assert_array_equal(dq.numpy(), kimi_reference(w.numpy()))
    assert torch.equal(dq[0, 0, :32], torch.zeros(32))
    # Every group holds at most 15 distinct values (codes -7..7) and its largest weight codes to +-7.
    groups = dq.reshape(-1, 32)
    assert max(len(torch.unique(row)) for row in groups) <= 15
    assert torch.equal(dq.to(torch.bfloat16).float(), dq)  # already bf16 values: the engine stores them as is


def _policy(tokenizer, preset="deepseek_v3"):
    return apply_lora(build_model(ModelConfig(preset=preset, num_layers=3, first_k_dense=1, init_std=0.1), tokenizer),
                      LoraConfig(), preset)


@pytest.mark.parametrize("precision, changed, kept", [
    ("nvfp4_experts", ".experts.", ".self_attn."), ("int4_experts", ".experts.", ".self_attn."),
    ("nvfp4_attention", ".self_attn.", ".experts."), ("int4_attention", ".self_attn.", ".experts."),
    ("int4_kimi", ".experts.", ".self_attn."),
    ("int3n_experts", ".experts.", ".self_attn."), ("int6_attention", ".self_attn.", ".experts.")])
def test_scoped_rungs_round_only_their_half(tokenizer, precision, changed, kept):
    policy = _policy(tokenizer)
    bf16 = HFEngine(policy, tokenizer, RolloutConfig(dtype="bf16", max_new_tokens=4))
    engine = HFEngine(policy, tokenizer, RolloutConfig(dtype=precision, max_new_tokens=4))
    a, b = dict(bf16.model.named_parameters()), dict(engine.model.named_parameters())
    assert engine.quantised_weights and all(changed in n for n in engine.quantised_weights)
    for name in a:
        differs = not torch.equal(a[name], b[name])
        assert differs == (name in engine.quantised_weights), name
    # Kimi keeps the shared experts, the dense first layer, the router and lm_head in bf16.
    assert not any("shared_experts" in n or "layers.0.mlp" in n or n.endswith("mlp.gate.weight")
                   for n in engine.quantised_weights)
    assert any(kept in n for n in a) and not any(kept in n for n in engine.quantised_weights)
    batch = engine.generate(["1+2*3="], ["7"], group_size=2, seed=0)
    assert torch.isfinite(batch.rollout_logprobs).all()


def test_trainer_fake_quant_puts_the_base_on_the_engines_grid(tokenizer):
    policy = _policy(tokenizer)
    # As the trainer does: the engine first (it rounds its own bf16 copy), then the trainer's masters.
    engine = HFEngine(policy, tokenizer, RolloutConfig(dtype="int4_kimi", max_new_tokens=4))
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    changed = fake_quantize_masters(policy, "int4_kimi")
    after = dict(policy.named_parameters())
    assert changed and all(".experts." in n and not after[n].requires_grad for n in changed)
    assert sorted(changed) == sorted(engine.quantised_weights)
    for name, p in after.items():
        assert torch.equal(p, before[name]) == (name not in changed), name
    eng = dict(engine.model.named_parameters())
    for name in changed:  # the trainer computes with exactly the engine's expert weights
        assert torch.equal(eng[name].float(), after[name].detach()), name


def test_straight_through_estimator_forward_on_grid_gradient_identity():
    g = torch.Generator().manual_seed(1)
    master = torch.randn(8, 64, generator=g, requires_grad=True)
    on_grid = fake_quantize_ste(master, "int4_kimi")
    torch.testing.assert_close(on_grid.detach(), quantize_dequantize_int4_kimi(master))
    upstream = torch.randn(8, 64, generator=g)
    (on_grid * upstream).sum().backward()
    assert torch.equal(master.grad, upstream)  # identity backward: the gradient reaches the master unchanged
    # A trainable master is parametrized: full precision kept, seen on the grid, its gradient flows.
    root = torch.nn.Module()
    root.layer = torch.nn.Module()
    root.layer.self_attn = torch.nn.Linear(64, 8, bias=False)
    master_before = root.layer.self_attn.weight.detach().clone()
    assert fake_quantize_masters(root, "int4_attention") == ["layer.self_attn.weight"]
    attn = root.layer.self_attn
    assert torch.equal(attn.parametrizations.weight.original.detach(), master_before)
    torch.testing.assert_close(attn.weight.detach(), quantize_dequantize_int4(master_before))
    x = torch.randn(2, 64, generator=g)
    attn(x).sum().backward()
    torch.testing.assert_close(attn.parametrizations.weight.original.grad, x.sum(0).expand(8, 64))


def test_fake_quant_must_match_the_rollout():
    with pytest.raises(ConfigError, match="trainer.fake_quant=int4_kimi puts the trainer on the rollout's grid"):
        load_config("experiments/07_dose_threshold/arms/baseline.yaml", ["trainer.fake_quant=int4_kimi"])
    cfg = load_config("experiments/07_dose_threshold/arms/baseline.yaml",
                      ["rollout.dtype=int4_kimi", "trainer.fake_quant=int4_kimi"])
    assert cfg.trainer.fake_quant == "int4_kimi"


def test_nvfp4_stack_scale_rounds_as_coarsely_as_per_expert_scales():
    """A fused expert stack shares one NVFP4 per-tensor scale here; vLLM keeps one per expert. The values
    differ, the relative RMS error of the round trip does not (within 1 %)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 128, 256, generator=g) * (1 + 0.5 * torch.rand(16, 1, 1, generator=g)) * 0.02
    shared = quantize_dequantize_nvfp4(w)
    per_expert = torch.stack([quantize_dequantize_nvfp4(expert) for expert in w])

    def error(q):
        return float((q - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt())

    assert not torch.equal(shared, per_expert)
    assert abs(error(shared) / error(per_expert) - 1) < 0.01


def int_reference(w: np.ndarray, bits: int, narrow: bool) -> np.ndarray:
    """Symmetric round-to-nearest on one scale per row of at most 128 inputs (numpy): amax / (2^(b-1) - 0.5)
    and codes in [-2^(b-1), 2^(b-1) - 1], or Kimi's narrow range amax / (2^(b-1) - 1), codes in +-(2^(b-1) - 1)."""
    half = 2 ** (bits - 1)
    top = half - 1 if narrow else half - 0.5
    scale = np.abs(w).max(-1, keepdims=True) / np.float32(top)  # fp32, as the quantiser divides
    return np.clip(np.round(w / scale), -(half - 1) if narrow else -half, half - 1) * scale


@pytest.mark.parametrize("fmt, bits, narrow", [("int3", 3, False), ("int3n", 3, True), ("int2", 2, False),
                                               ("int5", 5, False), ("int6", 6, False)])
def test_crossover_formats_match_a_numpy_reference(fmt, bits, narrow):
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    np.testing.assert_allclose(QUANTIZERS[fmt](w).numpy(), int_reference(w.numpy(), bits, narrow),
                               rtol=1e-6, atol=1e-7)
    codes = 2 ** bits - (1 if narrow else 0)  # distinct values a row can hold
    assert max(len(torch.unique(row)) for row in QUANTIZERS[fmt](w)) <= codes


def test_crossover_formats_order_by_bits():
    """The dose knob: int2 > int3n > int3 > int4 > int5 > int6 in weight error (int3n: one code fewer than int3)."""
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    err = {f: ((QUANTIZERS[f](w) - w).norm() / w.norm()).item() for f in ("int2", "int3n", "int3", "int4", "int5", "int6")}
    assert list(err) == sorted(err, key=err.get, reverse=True)
    assert torch.equal(QUANTIZERS["int4"](w), quantize_dequantize_int4(w))
