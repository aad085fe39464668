"""The 4-bit rollout quantisers (moerl.rollout.precision) against the upstream code that defines each
format, where it imports: compressed-tensors at the version vLLM's CPU build pins (0.17.0, also the pin of
vLLM 0.24.0, the cluster's), and vLLM's own NVFP4 reference. The main environment has neither, so precision.py re-encodes the formats; here each one runs
beside the library code the engines use.

- ``fp8`` (e4m3, a scale per output channel) and ``int4`` (W4A16, groups of 128): compressed-tensors' qparams,
  quantize and dequantize, bit for bit on fp32 weights; on bf16 weights compressed-tensors keeps bf16 scales
  and arithmetic, a different rounding with an error of the same size.
- ``int4_kimi`` (Kimi-K2-Thinking's routed experts): codes on the QAT grid (bf16 scale amax / 7), packed
  and unpacked in the ``pack-quantized`` format and dequantised to bf16 by compressed-tensors, bit for bit.
- ``nvfp4``: vLLM's ``ref_nvfp4_quant_dequant`` (its CPU emulation) computes the same formula with its
  fp32 operations in another order, so a few weights in a thousand land on the neighbouring e2m1 value
  (mostly whole blocks whose e4m3 scale rounds the other way); the test bounds that share and shows that
  a real difference of formula (block 32) fails the bound.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors comes with vLLM's CPU build "
                                                 "(scripts/test_upstream.sh vllm)")

from compressed_tensors.compressors import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams  # noqa: E402

from moerl.rollout import precision  # noqa: E402


def bf16_weights(seed: int, out: int = 256, inp: int = 1024, std: float = 0.02) -> torch.Tensor:
    """bf16-representable weights (the engine's master copy) whose rows span two decades of scale."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * torch.logspace(-2, 0, out)[:, None] * std
    return w.to(torch.bfloat16).float()


def test_compressed_tensors_is_the_cluster_vllms_pin():
    import compressed_tensors

    assert compressed_tensors.__version__ == "0.17.0"  # required by vLLM 0.24.0 (requirements/gpu.txt) too


def test_fp8_is_compressed_tensors_channel_fp8_bit_for_bit():
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    for seed in range(3):
        w = bf16_weights(seed)
        scale, zero_point = calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True), args)
        reference = dequantize(quantize(w, scale, zero_point, args), scale, zero_point, args)
        assert torch.equal(precision.quantize_dequantize_e4m3(w), reference)


def test_int4_is_compressed_tensors_w4a16_bit_for_bit():
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=precision.INT4_GROUP)
    for seed in range(3):
        w = bf16_weights(seed)
        groups = w.reshape(w.shape[0], -1, precision.INT4_GROUP)
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        reference = dequantize(quantize(w, scale, zero_point, args), scale, zero_point, args)
        assert torch.equal(precision.quantize_dequantize_int4(w), reference)


def test_kimi_int4_codes_pack_and_dequantise_as_compressed_tensors():
    """Kimi-K2-Thinking's config.json: compressed-tensors, pack-quantized, int4 symmetric, group 32. A refit
    quantises the engine's bf16 weights with the checkpoint's bf16 scale (amax / 7); the engine reads the
    packed int32 codes and computes code x scale in bf16."""
    group = precision.KIMI_INT4_GROUP
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    for seed in range(3):
        w = bf16_weights(seed)
        w[0, :group] = 0.0  # an all-zero group
        scale = (w.reshape(w.shape[0], -1, group).abs().amax(-1) / precision.KIMI_INT4_DIVISOR).to(torch.bfloat16)
        zero_point = torch.zeros_like(scale, dtype=torch.int8)
        codes = quantize(w.to(torch.bfloat16), scale, zero_point, args, dtype=torch.int8)
        assert -7 <= int(codes.min()) and int(codes.max()) <= 7  # the QAT grid: -8 is never used
        packed = pack_to_int32(codes, 4)
        assert packed.dtype == torch.int32 and packed.shape == (w.shape[0], w.shape[1] // 8)
        unpacked = unpack_from_int32(packed, 4, codes.shape)
        assert torch.equal(unpacked, codes)
        engine = dequantize(unpacked, scale, zero_point, args, dtype=torch.bfloat16)
        assert torch.equal(precision.quantize_dequantize_int4_kimi(w), engine.float())
    # compressed-tensors' own RTN qparams (amax / 7.5, codes down to -8) are another grid: the divisor of 7
    # is Kimi's QAT choice, not the library default
    rtn_scale, rtn_zp = calculate_qparams(*(lambda g: (g.amin(-1), g.amax(-1)))(w.reshape(w.shape[0], -1, group)), args)
    rtn = dequantize(quantize(w, rtn_scale, rtn_zp, args), rtn_scale, rtn_zp, args)
    assert not torch.equal(rtn.to(torch.bfloat16).float(), precision.quantize_dequantize_int4_kimi(w))


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_on_bf16_weights_compressed_tensors_rounds_otherwise_with_the_same_error(fmt):
    """Given bf16 weights, compressed-tensors computes the scales and the round trip in bf16; the fp8 and
    int4 rungs compute them in fp32 (the recorded grids ran so). Many weights land on a neighbouring
    value, the size of the error is the same."""
    args = (QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel") if fmt == "fp8" else
            QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=precision.INT4_GROUP))
    ours_fn = precision.QUANTIZERS[fmt]
    for seed in range(3):
        w = bf16_weights(seed).to(torch.bfloat16)
        groups = w.reshape(w.shape[0], -1, w.shape[1] if fmt == "fp8" else precision.INT4_GROUP)
        scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        assert scale.dtype == torch.bfloat16
        upstream = dequantize(quantize(w, scale, zero_point, args), scale, zero_point, args).float()
        ours = ours_fn(w.float()).to(torch.bfloat16).float()

        def rms(q):
            return float((q - w.float()).pow(2).mean().sqrt())

        assert not torch.equal(ours, upstream)
        assert abs(rms(ours) / rms(upstream) - 1) < 0.01


def _nvfp4_agreement(block: int) -> tuple[float, float]:
    """(share of weights identical in bf16, mean |moerl - vLLM| / mean |moerl - w|) over five tensors,
    against vLLM's reference with ``block``-wide blocks (NVFP4's is 16)."""
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant_dequant

    same = total = gap = error = 0.0
    for seed in range(5):
        w = bf16_weights(seed)
        ours = precision.quantize_dequantize_nvfp4(w).to(torch.bfloat16).float()
        global_scale = (torch.tensor(precision.E4M3_MAX * precision.E2M1_MAX) / w.abs().amax()).reshape(1)
        reference = ref_nvfp4_quant_dequant(w, global_scale, block).to(torch.bfloat16).float()
        same += float((ours == reference).sum())
        total += w.numel()
        gap += float((ours - reference).abs().sum())
        error += float((ours - w).abs().sum())
    return same / total, gap / error


def test_nvfp4_agrees_with_vllms_reference_up_to_the_order_of_operations():
    pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_upstream.sh vllm builds its venv")
    identical, gap = _nvfp4_agreement(precision.NVFP4_BLOCK)
    assert identical >= 0.99 and gap <= 0.02, (identical, gap)  # measured: 0.998 and 0.005
    # the bound fails for a real difference of formula, here the block width (measured: 0.60 and 0.65)
    identical, gap = _nvfp4_agreement(32)
    assert identical < 0.9 and gap > 0.1, (identical, gap)
