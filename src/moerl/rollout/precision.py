"""Rollout precisions: the dtype an engine computes in and, for quantised rollouts, how its weights are
rounded. Each quantised precision is a mechanism production RL systems run, weight-only (W·A16):

| precision | weights | as run by |
|---|---|---|
| ``fp8``   | e4m3, one scale per output channel (amax / 448) | vLLM ``quantization="fp8"`` / llm-compressor ``FP8_DYNAMIC`` channel scales on GPUs without FP8 GEMMs (FP8 Marlin); NeMo-RL and slime FP8 rollouts |
| ``int8``  | symmetric int8, one scale per output channel (amax / 127) | FlashRL's INT8 rollouts (vLLM W8A16, the setting its truncated importance sampling was introduced for) |
| ``nvfp4`` | e2m1 values in blocks of 16 along the input, one e4m3 scale per block, one fp32 scale per tensor | NVIDIA's NVFP4 (vLLM ``ref_nvfp4_quant`` convention: global scale 448·6 / amax); QeRL's 4-bit LoRA RL rollouts |
| ``int4``  | symmetric int4 in groups of 128 along the input, scale = group amax / 7.5, values clamped to [-8, 7] | compressed-tensors ``W4A16`` (``calculate_qparams``, symmetric), run by vLLM's Marlin kernels |

A CPU has none of these kernels, so each weight is rounded once through its format on the engine's copy
and kept dequantised in bf16: the engine then computes with exactly the values the quantised weight can
hold, activations in bf16 (the W·A16 products run through ``rollout.kernels``). Nothing adds noise.

Left in bf16, as in those engines: embeddings, ``lm_head``, norms, the MoE router gate (vLLM builds it
without a quant config) and its bias, and the LoRA tensors (applied in 16 bit on top of the quantised
base). Weights are ``[..., out, in]`` (transformers' fused expert stacks included); blocks and groups run
along ``in``, and a last block shorter than the block size (a narrow CPU model) is its own block.
"""
from __future__ import annotations

import torch
from torch import nn

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
E2M1_MAX = 6.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
NVFP4_BLOCK = 16
INT4_GROUP = 128

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16,
                  "int8": torch.bfloat16, "nvfp4": torch.bfloat16, "int4": torch.bfloat16}
QUANTISED = ("fp8", "int8", "nvfp4", "int4")


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype an engine of ``precision`` stores its weights and activations in."""
    return COMPUTE_DTYPES[precision]


def quantize_dequantize_e4m3(weight: torch.Tensor) -> torch.Tensor:
    """Round ``weight`` [..., out, in] through e4m3 with one scale per output channel (amax / 448)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale


def quantize_dequantize_int8(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 with one scale per output channel: round(w / s) clamped to [-127, 127], s = amax / 127."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(w / scale).clamp(-127, 127) * scale


def _blocks(w: torch.Tensor, size: int) -> tuple[torch.Tensor, int]:
    """``w`` [..., out, in] as [..., out, n_blocks, size], the last block zero-padded; and the padding."""
    pad = (-w.shape[-1]) % size
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(*w.shape[:-1], w.shape[-1] // size, size), pad


def _unblock(blocks: torch.Tensor, pad: int) -> torch.Tensor:
    w = blocks.reshape(*blocks.shape[:-2], -1)
    return w[..., : w.shape[-1] - pad] if pad else w


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest FP4 e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives), ties to the even mantissa, as the
    hardware conversion rounds; magnitudes above 6 saturate."""
    grid = E2M1_VALUES.to(x.device)
    mag = x.abs().clamp(max=E2M1_MAX)
    upper = torch.bucketize(mag, grid).clamp(1, len(grid) - 1)  # grid[upper - 1] <= mag <= grid[upper]
    low, high = grid[upper - 1], grid[upper]
    to_high = (mag - low) > (high - mag)
    tie = (mag - low) == (high - mag)
    even_high = (upper % 2) == 0  # grid index parity is the mantissa bit: even index = even mantissa
    value = torch.where(to_high | (tie & even_high), high, low)
    return torch.copysign(value, x)


def quantize_dequantize_nvfp4(weight: torch.Tensor) -> torch.Tensor:
    """NVFP4: per-tensor fp32 scale g = 448·6 / amax; per 16-block scale s = e4m3(block_amax / 6 · g);
    values e2m1(w · g / s); dequantised as e2m1 · s / g."""
    w = weight.detach().float()
    global_scale = E4M3_MAX * E2M1_MAX / w.abs().amax().clamp(min=1e-12)
    blocks, pad = _blocks(w, NVFP4_BLOCK)
    block_scale = (blocks.abs().amax(-1, keepdim=True) / E2M1_MAX * global_scale)
    block_scale = block_scale.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    safe = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    values = round_e2m1(blocks * global_scale / safe)
    return _unblock(values * block_scale / global_scale, pad)


def quantize_dequantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
    """Symmetric int4 in groups of ``group`` along the input: s = group amax / 7.5, round(w / s) clamped to
    [-8, 7]."""
    w = weight.detach().float()
    blocks, pad = _blocks(w, group)
    scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 7.5
    return _unblock(torch.round(blocks / scale).clamp(-8, 7) * scale, pad)


QUANTIZERS = {"fp8": quantize_dequantize_e4m3, "int8": quantize_dequantize_int8,
              "nvfp4": quantize_dequantize_nvfp4, "int4": quantize_dequantize_int4}


def is_quantised_weight(name: str, param: torch.Tensor) -> bool:
    """Matrices of the linear layers and experts; not embeddings, lm_head, router gates or LoRA."""
    if param.dim() < 2 or "lora_" in name:
        return False
    if "embed_tokens" in name or "lm_head" in name:
        return False
    parts = name.split(".")
    return "gate" not in parts  # the router (mlp.gate.weight); experts' gate_up_proj / gate_proj stay in


@torch.no_grad()
def quantize_model(model: nn.Module, precision: str) -> list[str]:
    """Replace every eligible weight of ``model`` by its round trip through ``precision``'s format, stored
    in the engine's compute dtype. Returns the names changed (none for an unquantised precision)."""
    quantizer = QUANTIZERS.get(precision)
    if quantizer is None:
        return []
    changed = []
    for name, param in model.named_parameters():
        if is_quantised_weight(name, param):
            param.copy_(quantizer(param).to(param.dtype if param.dtype != torch.float32
                                            else compute_dtype(precision)))
            changed.append(name)
    return changed
