"""Emulated low-precision kernels against a reference written apart from them: numpy float32 products
and a bit-level round-to-nearest-even to bf16, so neither the accumulation dtype nor the rounding is
taken from torch's own conversion."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moerl.rollout.kernels import EmulatedLowPrecision, emulated_sdpa, rollout_kernels


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> nearest bf16 value (ties to even), by integer arithmetic on the bit pattern."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


def ulps_apart(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in bf16 steps between two arrays of bf16 values (+0 and -0 are one value apart)."""
    def ordered(x):
        bits = (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.int64)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)
    return np.abs(ordered(a) - ordered(b))


def assert_matches_reference(out: torch.Tensor, reference_fp32: np.ndarray):
    """``out`` is bf16 and equals the reference rounded once to bf16, up to one bf16 step where numpy's
    and torch's fp32 summation orders put the fp32 result on either side of a rounding boundary."""
    assert out.dtype == torch.bfloat16
    ref = bf16_round(reference_fp32)
    got = f32(out)
    apart = ulps_apart(got, ref)
    assert apart.max() <= 1, f"{apart.max()} bf16 steps from the reference"
    assert (apart == 0).mean() >= 0.98


def rand_bf16(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def test_bf16_round_reference_itself():
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even (1); 1 + 3 * 2^-8 rounds up to 1 + 2^-6.
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -9, -2.5], dtype=np.float32)
    assert bf16_round(x).tolist() == [1.0, 1.0, 1 + 2 ** -6, 1.0, -2.5]
    assert np.array_equal(bf16_round(x), torch.from_numpy(x).bfloat16().float().numpy())


def test_linear_accumulates_in_fp32_and_rounds_the_output_once():
    # 1 + 256 terms of 2^-9: fp32 accumulation gives 1.5; a bf16 accumulator would stay at 1 (each
    # 2^-9 is below half a bf16 step of 1).
    x = torch.cat([torch.ones(1), torch.full((256,), 2.0 ** -9)]).to(torch.bfloat16)[None]
    w = torch.ones(1, 257, dtype=torch.bfloat16)
    with EmulatedLowPrecision():
        out = F.linear(x, w)
    assert out.dtype == torch.bfloat16 and out.item() == 1.5
    # 1 + 3 * 2^-8 in fp32 is not a bf16 value: the output is rounded (to nearest even), not truncated.
    x = torch.tensor([[1.0, 2.0 ** -8, 2.0 ** -8, 2.0 ** -8]], dtype=torch.bfloat16)
    with EmulatedLowPrecision():
        out = F.linear(x, torch.ones(1, 4, dtype=torch.bfloat16))
    assert out.item() == 1 + 2 ** -6


@pytest.mark.parametrize("bias", [False, True])
def test_linear_against_numpy(bias):
    x, w = rand_bf16(37, 96, seed=1), rand_bf16(48, 96, seed=2)
    b = rand_bf16(48, seed=3) if bias else None
    with EmulatedLowPrecision():
        out = F.linear(x, w, b)
        module_out = torch.nn.Linear(96, 48, bias=bias).to(torch.bfloat16)
        module_out.weight.data.copy_(w)
        if bias:
            module_out.bias.data.copy_(b)
        via_module = module_out(x)
    ref = f32(x) @ f32(w).T + (f32(b) if bias else 0)
    assert_matches_reference(out, ref)
    assert torch.equal(out, via_module)


@pytest.mark.parametrize("op", ["matmul", "operator", "bmm", "baddbmm", "einsum"])
def test_batched_products_against_numpy(op):
    a, b = rand_bf16(3, 17, 40, seed=4), rand_bf16(3, 40, 23, seed=5)
    bias = rand_bf16(3, 17, 23, seed=6)
    with EmulatedLowPrecision():
        out = {"matmul": lambda: torch.matmul(a, b), "operator": lambda: a @ b, "bmm": lambda: torch.bmm(a, b),
               "baddbmm": lambda: torch.baddbmm(bias, a, b), "einsum": lambda: torch.einsum("bij,bjk->bik", a, b),
               }[op]()
    ref = np.matmul(f32(a), f32(b)) + (f32(bias) if op == "baddbmm" else 0)
    assert_matches_reference(out, ref)


def test_grouped_experts_product_against_numpy():
    grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm")
    tokens, weight = rand_bf16(12, 32, seed=7), rand_bf16(3, 32, 16, seed=8)
    offsets = torch.tensor([5, 5, 12], dtype=torch.int32)  # expert 1 gets no token
    with EmulatedLowPrecision():
        out = grouped_mm(tokens, weight, offs=offsets)
    starts = [0, 5, 5]
    ref = np.concatenate([f32(tokens)[s:e] @ f32(weight)[g] for g, (s, e) in enumerate(zip(starts, [5, 5, 12]))])
    assert_matches_reference(out, ref)


def reference_attention(q, k, v, keep):
    """FlashAttention's rounding points in numpy: fp32 scores and softmax, bf16 probabilities,
    fp32 accumulation of P.V; rows that may attend to nothing give zeros."""
    q, k, v = f32(q), f32(k), f32(v)
    if k.shape[1] != q.shape[1]:
        k, v = np.repeat(k, q.shape[1] // k.shape[1], axis=1), np.repeat(v, q.shape[1] // v.shape[1], axis=1)
    scores = (q @ np.swapaxes(k, -1, -2)).astype(np.float32) * np.float32(1 / np.sqrt(q.shape[-1]))
    scores = np.where(keep, scores, -np.inf)
    peak = scores.max(-1, keepdims=True)
    safe = np.where(np.isfinite(peak), peak, 0)
    e = np.where(keep, np.exp(scores - safe), 0).astype(np.float32)
    total = e.sum(-1, keepdims=True)
    probs = np.where(total > 0, e / np.where(total > 0, total, 1), 0).astype(np.float32)
    return bf16_round(probs) @ v


def test_attention_rounding_points_causal_gqa_and_masked_rows():
    q, k, v = rand_bf16(2, 4, 6, 16, seed=9), rand_bf16(2, 2, 6, 16, seed=10), rand_bf16(2, 2, 6, 16, seed=11)
    keep = np.tril(np.ones((6, 6), dtype=bool))[None, None].repeat(2, 0)
    keep[1, :, :, :2] = False  # sample 1 is left-padded by two tokens...
    keep[1, :, 0, :] = False   # ...and its first position may attend to nothing
    with EmulatedLowPrecision():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(keep), enable_gqa=True)
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_matches_reference(out, reference_attention(q, k, v, keep))
    assert torch.all(out[1, :, 0] == 0)
    assert_matches_reference(causal, reference_attention(q, k, v, np.tril(np.ones((6, 6), dtype=bool))))
    # A float (additive) mask means the same as the boolean one.
    additive = torch.zeros(keep.shape).masked_fill(torch.from_numpy(~keep), float("-inf")).to(torch.bfloat16)
    assert torch.equal(emulated_sdpa(q, k, v, additive, enable_gqa=True)[0], out[0])


def test_fp32_products_and_elementwise_ops_are_untouched():
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    xb = x.to(torch.bfloat16)
    with EmulatedLowPrecision():
        fp32_out, silu = F.linear(x, w), F.silu(xb)
    assert torch.equal(fp32_out, F.linear(x, w))
    assert silu.dtype == torch.bfloat16 and torch.equal(silu, F.silu(xb))


def test_weight_cache_follows_in_place_refits_and_views():
    layer = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    x = rand_bf16(4, 16, seed=12)
    mode = EmulatedLowPrecision()
    with torch.no_grad(), mode:
        first = layer(x)
        layer.weight.copy_(rand_bf16(8, 16, seed=13))  # a refit writes in place
        second = layer(x)
        transposed = torch.matmul(x, layer.weight.t())  # a view shares its base's fp32 copy
    assert not torch.equal(first, second)
    assert_matches_reference(second, f32(x) @ f32(layer.weight).T)
    assert torch.equal(second, transposed)


def test_rollout_kernels_choice():
    assert isinstance(rollout_kernels("emulated", torch.bfloat16), EmulatedLowPrecision)
    assert not isinstance(rollout_kernels("emulated", torch.float32), EmulatedLowPrecision)
    assert not isinstance(rollout_kernels("native", torch.bfloat16), EmulatedLowPrecision)
    with pytest.raises(ValueError, match="rollout.kernels"):
        rollout_kernels("fast", torch.bfloat16)


def test_a_write_through_data_between_calls_is_seen():
    """Refit appliers write ``param.data``, which does not bump the version counter: a cache trusted
    across generate calls would keep multiplying by the old weights."""
    layer = torch.nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    x = rand_bf16(4, 16, seed=14)
    mode = EmulatedLowPrecision()
    with torch.no_grad():
        with mode:
            before = layer(x)
        layer.weight.data.copy_(rand_bf16(8, 16, seed=15))
        with mode:
            after = layer(x)
    assert not torch.equal(before, after)
    assert_matches_reference(after, f32(x) @ f32(layer.weight).T)
