"""Emulated low-precision kernels: bf16 (or fp16) matrix products computed by fp32 kernels.

A GPU inference engine computes a bf16 matrix product from bf16 operands, accumulates in fp32 and
writes a bf16 output (cuBLAS / CUTLASS GEMMs, FlashAttention, vLLM's fused-MoE Triton kernel). A CPU
reaches the same numbers two ways:

- ``native``: torch's own bf16 kernels. On CPUs with AVX512-BF16/AMX oneDNN runs them fast; on an
  AVX2-only CPU they are 6-20x slower than an fp32 GEMM on the same values, and their results (summation
  order, blocking) differ from one CPU model to the next, so bf16 trajectories do not reproduce across
  machines.
- ``emulated``: every matrix product takes its bf16 operands up to fp32 (exactly: bf16 is a prefix of
  fp32), runs the fp32 kernel and rounds the output to bf16 (round to nearest even, ``Tensor.to``). It runs
  at fp32 speed on every CPU, and its numbers are fp32 numbers rounded once.

What the emulated path guarantees: the same rounding points and the same formats on every CPU, hence the same
statistics (mismatch, rewards, routing) from run to run and machine to machine. It does not guarantee the
same bits everywhere: the fp32 products it rounds come from the CPU's own GEMM, whose last bits depend on the
instruction set and blocking, so a product near a bf16 rounding boundary can round the other way on another
CPU kind, and a sampled trajectory departs within a few steps. Bit for bit only where the fp32 GEMMs agree:
on the CPU kind that recorded a run (``scripts/check_reproducible.py`` picks its check accordingly).

Only matrix products change. Elementwise operations (norms, activations, residual adds, softmax of the
router) and every stored tensor stay bf16 as on the native path, so the rounding points are the GPU's:
one bf16 rounding per operator output. Attention follows FlashAttention-2's (and torch's CPU flash
kernel's) points: scores Q·Kᵀ accumulate in fp32, the softmax is taken in fp32, the probabilities are
rounded to bf16 before they multiply V (fp32 accumulation), and the output is rounded to bf16.

Written here because no library offers it: torch's ``allow_bf16_reduced_precision_reduction`` and
autocast choose *which* kernels run, not how a CPU emulates a GPU's rounding points. A
``TorchFunctionMode`` catches the products wherever transformers calls them (``nn.Linear``, the router's
``F.linear``, sdpa attention, the grouped-expert GEMM), so the model code is untouched.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Literal

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

Kernels = Literal["native", "emulated"]
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _low_precision_dtype(*tensors) -> torch.dtype | None:
    """The low-precision dtype of the operands, or None when no operand is low precision."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION:
            return t.dtype
    return None


def _up(t):
    """An operand in fp32 (exact for bf16/fp16 values); non-float tensors and None pass through."""
    return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def emulated_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Scaled dot-product attention with FlashAttention's rounding points (see the module docstring).

    Same semantics as ``F.scaled_dot_product_attention`` for inference: boolean masks keep ``True``
    positions, float masks are added to the scores, ``is_causal`` is aligned top-left, and
    ``enable_gqa`` shares each key/value head among ``Hq / Hkv`` query heads."""
    if dropout_p:
        raise ValueError("emulated attention is for inference: dropout_p must be 0")
    q, k, v = query.float(), key.float(), value.float()
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        length_q, length_k = q.shape[-2], k.shape[-2]
        keep = torch.ones(length_q, length_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    probs = torch.softmax(scores, dim=-1)
    # A query that may attend to nothing (a left-padding position) gets a zero output, as torch's fused
    # CPU/CUDA kernels give it, where a plain softmax over -inf gives NaN.
    probs = probs.masked_fill(scores.amax(dim=-1, keepdim=True) == float("-inf"), 0.0)
    probs = probs.to(out_dtype).float()  # the probabilities enter P·V in the input precision
    return torch.matmul(probs, v).to(out_dtype)


class WeightCache:
    """fp32 copies of the weights, made once per generate call instead of on every product.

    A decode loop multiplies by the same weights once per token, and no weight changes while a batch is
    generated. Between calls they do (a refit), and a write through ``param.data`` does not bump the
    parameter's version counter, so the cache is emptied every time the mode is entered rather than
    trusted across calls; within a call a version change still drops a copy. Keys are weak: a weight that
    is freed drops its copy. Views of a weight (the grouped experts' transposed stacks) share their
    base's copy. The copies hold exactly the bf16 values, so caching changes no number."""

    def __init__(self):
        self._copies = WeakTensorKeyDictionary()

    def clear(self) -> None:
        self._copies = WeakTensorKeyDictionary()

    def up(self, weight):
        if not isinstance(weight, torch.Tensor) or weight.dtype not in LOW_PRECISION:
            return _up(weight)
        base = weight._base if weight._base is not None else weight
        if not base.is_contiguous():
            return weight.float()
        hit = self._copies.get(base)
        if hit is None or hit[0] != base._version:
            hit = (base._version, base.float())
            self._copies[base] = hit
        copy = hit[1]
        if base is weight:
            return copy
        return copy.as_strided(weight.size(), weight.stride(), weight.storage_offset())


def _emulations(cache: WeightCache) -> dict:
    """torch function -> its emulation. Looked up by identity on every call inside the mode."""

    def linear(input, weight, bias=None):
        out = F.linear(_up(input), cache.up(weight), _up(bias))
        return out.to(_low_precision_dtype(input, weight, bias))

    def binary(func):
        def run(a, b, *args, **kwargs):
            return func(_up(a), _up(b), *args, **kwargs).to(_low_precision_dtype(a, b))
        return run

    def with_bias(func):  # addmm / baddbmm: (bias, a, b) with optional beta / alpha
        def run(bias, a, b, *args, **kwargs):
            return func(_up(bias), _up(a), _up(b), *args, **kwargs).to(_low_precision_dtype(bias, a, b))
        return run

    def grouped(func):  # (tokens sorted by expert, the expert weight stack, offsets)
        def run(input, weight, *args, **kwargs):
            dtype = _low_precision_dtype(input, weight)
            return func(_up(input), cache.up(weight), *args, **kwargs).to(dtype)
        return run

    def sdpa(query, key, value, *args, **kwargs):
        return emulated_sdpa(query, key, value, *args, out_dtype=_low_precision_dtype(query, key, value),
                             **kwargs)

    def einsum(equation, *operands):
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])
        return torch.einsum(equation, *[_up(o) for o in operands]).to(_low_precision_dtype(*operands))

    table = {
        F.linear: linear,
        torch.matmul: binary(torch.matmul), torch.Tensor.matmul: binary(torch.matmul),
        torch.Tensor.__matmul__: binary(torch.matmul),
        torch.mm: binary(torch.mm), torch.Tensor.mm: binary(torch.mm),
        torch.bmm: binary(torch.bmm), torch.Tensor.bmm: binary(torch.bmm),
        torch.addmm: with_bias(torch.addmm), torch.baddbmm: with_bias(torch.baddbmm),
        torch.einsum: einsum,
        F.scaled_dot_product_attention: sdpa,
    }
    for grouped_mm in (getattr(F, "grouped_mm", None), getattr(torch, "_grouped_mm", None)):
        if grouped_mm is not None:
            table[grouped_mm] = grouped(grouped_mm)
    return table


class EmulatedLowPrecision(TorchFunctionMode):
    """Inside this mode, matrix products with a bf16/fp16 operand run as fp32 kernels on the same values
    and round their output to the operand precision; every other operation runs untouched. Its weight
    cache lives for one ``with`` block (one generate call)."""

    def __init__(self):
        super().__init__()
        self.weights = WeightCache()
        self._table = _emulations(self.weights)

    def __enter__(self):
        self.weights.clear()  # weights may have changed since the last call (a refit)
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        emulation = self._table.get(func)
        if emulation is not None and _low_precision_dtype(*args, *kwargs.values()) is not None:
            return emulation(*args, **kwargs)  # the mode is off inside its own handler
        return func(*args, **kwargs)


def rollout_kernels(kernels: Kernels, dtype: torch.dtype):
    """The context the engine computes in: emulation for a low-precision engine with ``emulated``
    kernels, nothing otherwise (an fp32 engine's products are fp32 products either way)."""
    if kernels == "emulated" and dtype in LOW_PRECISION:
        return EmulatedLowPrecision()
    if kernels not in ("native", "emulated"):
        raise ValueError(f"rollout.kernels: expected 'native' or 'emulated', got {kernels!r}")
    return nullcontext()
