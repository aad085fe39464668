"""Rollout precisions: the dtype an engine computes in and, for quantised rollouts, how its weights are
rounded. Each quantised precision is a mechanism production RL systems run, weight-only (W·A16):

| precision | weights | as run by |
|---|---|---|
| ``fp8``   | e4m3, one scale per output channel (amax / 448) | channel-scale FP8 checkpoints (llm-compressor) on vLLM's FP8 Marlin, weight-only; verl's and NeMo-RL's FP8 rollouts use 128 x 128 weight blocks with FP8 activations, and vLLM's online ``quantization="fp8"`` one weight scale per tensor (``Fp8PerTensorOnlineLinearMethod``) |
| ``int8``  | symmetric int8, one scale per output channel (amax / 127) | the format of FlashRL's INT8 rollouts, the setting its truncated importance sampling was introduced for (below: how FlashRL's own quantiser differs) |
| ``nvfp4`` | e2m1 values in blocks of 16 along the input, one e4m3 scale per block, one fp32 scale per tensor | NVIDIA's NVFP4 (vLLM ``ref_nvfp4_quant`` convention: global scale 448·6 / amax); QeRL's 4-bit LoRA RL rollouts |
| ``int4``  | symmetric int4 in groups of 128 along the input, scale = group amax / 7.5, values clamped to [-8, 7] | compressed-tensors ``W4A16`` (``calculate_qparams``, symmetric), run by vLLM's Marlin kernels |
| ``int4_kimi`` | routed experts only: symmetric int4 in groups of 32, scale = bf16(group amax / 7), values in [-7, 7] | Kimi-K2-Thinking's native INT4 release (below) |

**Where the 4-bit mismatch lives.** ``<format>_experts`` / ``<format>_attention`` (``nvfp4`` and ``int4``)
round only the routed experts' weights, or only the attention projections, through the format and leave
every other weight in bf16: the two halves of a 4-bit rung, to separate a mismatch in the experts' weights
from one in attention's.

**Kimi-K2-Thinking's INT4.** Its ``config.json`` ships ``quantization_config`` = compressed-tensors,
``format: pack-quantized``, one config group of ``weights: {num_bits: 4, type: int, symmetric: true,
strategy: group, group_size: 32}`` on the routed experts, with attention, the shared experts, the dense
first layer and ``lm_head`` in the ``ignore`` list (bf16)
(https://huggingface.co/moonshotai/Kimi-K2-Thinking/blob/main/config.json). Its grid is the QAT one,
scale = amax / 7 and codes in [-7, 7] (the largest weight of every group codes to ±7), stored as a bf16
scale: SkyRL's fake-INT4 QAT documents and verifies this convention bit for bit against Kimi's release
(``skyrl/backends/skyrl_train/workers/megatron/fake_int4_qat.py``, NovaSky-AI/SkyRL a9564572,
``scale_divisor=7.0, q_min=-7``), whose divide, round and multiply run in the weight's dtype (bf16), as
compressed-tensors' quantize() does on bf16 weights; so do they here (a divide in fp32 would move some
near-tie codes by a step). :func:`fake_quantize_masters` puts the trainer's own weights on
the same grid (SkyRL's trainer-side mitigation).

Checked against the upstream code of each format in vLLM's CPU build
(``tests/upstream_vllm/test_quant_formats_upstream.py``): ``fp8`` and ``int4`` equal compressed-tensors bit for
bit given fp32 weights (their scales and round trip are fp32 here; on bf16 weights compressed-tensors keeps
them in bf16, a different rounding with an error of the same size); ``int4_kimi`` equals it on the engine's
bf16 weights, Kimi's codes through ``pack-quantized`` packing too; ``nvfp4`` equals vLLM's
``ref_nvfp4_quant_dequant`` but for a few weights in a thousand, where its fp32 operations in another order
round the other way (kept as recorded: the 07 grids ran on these exact values). ``int8`` is not FlashRL's
quantiser itself: flash-llm-rl 1.0.3 (``flash_rl/flash_quantization.py``) keeps the per-channel scales of a
pre-quantised W8A8 checkpoint and clamps to [-128, 127]; here the scale is amax / 127 of the current weights,
recomputed at every refit.

A CPU has none of these kernels, so each weight is rounded once through its format on the engine's copy
and kept dequantised in bf16: the engine then computes with exactly the values the quantised weight can
hold, activations in bf16 (the W·A16 products run through ``rollout.kernels``). Nothing adds noise.

Left in bf16, as in those engines: embeddings, ``lm_head``, norms, the MoE router gate (vLLM builds it
without a quant config) and its bias, and the LoRA tensors (applied in 16 bit on top of the quantised
base). Weights are ``[..., out, in]`` (transformers' fused expert stacks included); blocks and groups run
along ``in``, and a last block shorter than the block size (a narrow CPU model) is its own block. NVFP4's
per-tensor scale is one per parameter, so a fused expert stack shares one where vLLM keeps one per expert:
the rounded values differ, the size of the error does not
(``tests/rollout/test_precision_scopes.py::test_nvfp4_stack_scale_rounds_as_coarsely_as_per_expert_scales``).
"""
from __future__ import annotations

import torch
from torch import nn

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
E2M1_MAX = 6.0
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
NVFP4_BLOCK = 16
INT4_GROUP = 128

KIMI_INT4_GROUP = 32
KIMI_INT4_DIVISOR = 7.0  # scale = amax / 7, codes in [-7, 7] (Kimi / Miles QAT; compressed-tensors RTN uses 7.5, [-8, 7])

# A quantised precision is a format and the weights it covers: every eligible weight ("all"), the routed
# experts only ("experts") or the attention projections only ("attention").
SCOPED = {"nvfp4_experts": ("nvfp4", "experts"), "nvfp4_attention": ("nvfp4", "attention"),
          "int4_experts": ("int4", "experts"), "int4_attention": ("int4", "attention"),
          "int4_kimi": ("int4_kimi", "experts")}
QUANTISED = ("fp8", "int8", "nvfp4", "int4", *SCOPED)
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                  **{p: torch.bfloat16 for p in QUANTISED}}


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


def quantize_dequantize_int4_kimi(weight: torch.Tensor) -> torch.Tensor:
    """Kimi-K2-Thinking's INT4 grid on the engine's bf16 copy, as a refit re-quantises it: groups of 32 along
    the input, scale = bf16(group amax / 7) (one fp32 divide, one rounding: the checkpoint's bf16
    ``weight_scale``), then codes round(w / scale) clamped to [-7, 7] and code · scale, both in bf16, the
    arithmetic of compressed-tensors' quantize() / dequantize() on bf16 weights and of SkyRL's fake-INT4 QAT.
    An all-zero group stays zero. Returns fp32 holding the bf16 values."""
    w = weight.detach().to(torch.bfloat16)
    blocks, pad = _blocks(w, KIMI_INT4_GROUP)
    scale = (blocks.abs().amax(-1, keepdim=True).float() / KIMI_INT4_DIVISOR).to(torch.bfloat16)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(blocks / safe).clamp(-KIMI_INT4_DIVISOR, KIMI_INT4_DIVISOR)
    return _unblock(codes * scale, pad).float()


QUANTIZERS = {"fp8": quantize_dequantize_e4m3, "int8": quantize_dequantize_int8,
              "nvfp4": quantize_dequantize_nvfp4, "int4": quantize_dequantize_int4,
              "int4_kimi": quantize_dequantize_int4_kimi}


def format_and_scope(precision: str) -> tuple[str | None, str]:
    """(the quantiser's format, the weights it covers) of a precision; (None, "all") when unquantised."""
    if precision in SCOPED:
        return SCOPED[precision]
    return (precision if precision in QUANTIZERS else None), "all"


def in_scope(name: str, scope: str) -> bool:
    """Whether a (quantisable) weight belongs to ``scope``: the routed experts (``.experts.``: not the
    DeepSeek-V3 / Kimi-K2 shared experts, not a dense layer's MLP) or the attention projections."""
    if scope == "experts":  # Granite-MoE keeps its routed experts as input_linear / output_linear
        return ".experts." in name or ".input_linear." in name or ".output_linear." in name
    if scope == "attention":
        return ".self_attn." in name
    return True


def is_quantised_weight(name: str, param: torch.Tensor) -> bool:
    """Matrices of the linear layers and experts; not embeddings, lm_head, router gates or LoRA."""
    if param.dim() < 2 or "lora_" in name:
        return False
    if "embed_tokens" in name or "lm_head" in name:
        return False
    parts = name.split(".")
    # Routers stay in their own precision (vLLM keeps them unquantised): mlp.gate.weight, Granite-MoE's
    # block_sparse_moe.router.layer.weight, Qwen2-MoE's shared_expert_gate; experts' gate_up_proj stay in.
    return not {"gate", "router", "shared_expert_gate"} & set(parts)


@torch.no_grad()
def quantize_model(model: nn.Module, precision: str) -> list[str]:
    """Replace every eligible weight of ``model`` in ``precision``'s scope by its round trip through the
    format, stored in the engine's compute dtype. Returns the names changed (none for an unquantised
    precision)."""
    fmt, scope = format_and_scope(precision)
    if fmt is None:
        return []
    quantizer = QUANTIZERS[fmt]
    changed = []
    for name, param in model.named_parameters():
        if is_quantised_weight(name, param) and in_scope(name, scope):
            param.copy_(quantizer(param).to(param.dtype if param.dtype != torch.float32
                                            else compute_dtype(precision)))
            changed.append(name)
    return changed


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: the weight's round trip through a format; backward: the identity (straight-through)."""

    @staticmethod
    def forward(ctx, weight, quantizer):
        return quantizer(weight).to(weight.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quantize_ste(weight: torch.Tensor, precision: str) -> torch.Tensor:
    """``weight`` on ``precision``'s grid in the forward pass, its gradient passed straight through to the
    master weight (quantisation-aware training, as SkyRL's fake-INT4 QAT)."""
    fmt, _ = format_and_scope(precision)
    return _FakeQuantSTE.apply(weight, QUANTIZERS[fmt])


class _OnGrid(nn.Module):
    def __init__(self, precision: str):
        super().__init__()
        self.precision = precision

    def forward(self, weight):
        return fake_quantize_ste(weight, self.precision)


@torch.no_grad()
def fake_quantize_masters(model: nn.Module, precision: str) -> list[str]:
    """The trainer-side mitigation of a quantised rollout: the trainer computes with the weights the
    engine computes with (the same format, the same scope), so the weight half of the mismatch is gone.

    A trainable master keeps full precision and is seen through :func:`fake_quantize_ste` (a
    parametrization: forward on the grid, gradient straight through). A frozen master (the base weights
    under LoRA) gets no gradient for the straight-through estimator to deliver, so it is put on the grid
    once, in place: rounded from the bf16 copy the engine holds, through the same quantiser, to the bf16
    values the engine computes with (SkyRL's masters are bf16 too). The trainer's base is then exactly
    the engine's, and a LoRA adapter on top trains against it. Call it after LoRA has frozen the base.
    Returns the names changed."""
    fmt, scope = format_and_scope(precision)
    if fmt is None:
        raise ValueError(f"fake_quantize_masters: {precision!r} is not a quantised precision (one of {QUANTISED})")
    from torch.nn.utils import parametrize

    changed = []
    for name, param in list(model.named_parameters()):
        if not (is_quantised_weight(name, param) and in_scope(name, scope)):
            continue
        if param.requires_grad:
            owner_name, _, attr = name.rpartition(".")
            with torch.enable_grad():
                parametrize.register_parametrization(model.get_submodule(owner_name), attr, _OnGrid(precision))
        else:
            engine_copy = param.to(compute_dtype(precision))
            param.copy_(QUANTIZERS[fmt](engine_copy).to(compute_dtype(precision)).to(param.dtype))
        changed.append(name)
    return changed
