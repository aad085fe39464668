"""FP8 rollout weights: e4m3 with one scale per output channel, dequantised to bf16 for compute.

What FP8 rollouts do at scale, emulated on a CPU without FP8 matmuls: vLLM's ``quantization="fp8"``
stores every Linear weight except ``lm_head`` as ``float8_e4m3fn`` with a scale (per tensor in its
online mode, per output channel in llm-compressor's ``FP8_DYNAMIC`` "channel" scheme) and, on GPUs
without FP8 GEMMs, runs weight-only W8A16 (FP8 Marlin: weights dequantised, activations in 16 bit);
NeMo-RL's ``nemo_rl/models/generation/fp8.py`` and slime cast the trainer's bf16 weights to FP8
(blockwise scales) at every refit. Here the weights are rounded through e4m3 once, on the engine's copy,
and kept dequantised in bf16, so the rollout computes with exactly the values an FP8 weight can hold;
activations stay bf16 (W8A16).

Left in bf16, as in those engines: embeddings, ``lm_head``, norms, the MoE router gate (vLLM builds it
without a quant config) and its bias, and the LoRA tensors (applied in 16 bit on top of the FP8 base).
"""
from __future__ import annotations

import torch
from torch import nn

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def quantize_dequantize_e4m3(weight: torch.Tensor) -> torch.Tensor:
    """Round ``weight`` [..., out, in] through e4m3 with one scale per output channel (amax / 448)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() * scale


def is_fp8_weight(name: str, param: torch.Tensor) -> bool:
    """Matrices of the linear layers and experts; not embeddings, lm_head, router gates or LoRA."""
    if param.dim() < 2 or "lora_" in name:
        return False
    if "embed_tokens" in name or "lm_head" in name:
        return False
    parts = name.split(".")
    return "gate" not in parts  # the router (mlp.gate.weight); experts' gate_up_proj / gate_proj stay in


@torch.no_grad()
def quantize_model_fp8(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Replace every FP8-eligible weight of ``model`` by its e4m3 round trip, in ``compute_dtype``.
    Returns the names changed (the engine logs how many)."""
    changed = []
    for name, param in model.named_parameters():
        if is_fp8_weight(name, param):
            param.copy_(quantize_dequantize_e4m3(param).to(param.dtype if param.dtype != torch.float32
                                                           else compute_dtype))
            changed.append(name)
    return changed
