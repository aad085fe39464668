"""Compact transfer form of a RoutingTrace: ceil(log2 E) bits per expert id, valid rows only.

Engines ship routes as int32 (SGLang), uint8/uint16 (vLLM) or int16 (verl); at Kimi-K2 scale
(60 MoE layers x top-8 x 384 experts) that is 960 B per token as int16 against 540 B packed at
9 bits. No library packs arbitrary bit widths over torch tensors (numpy.packbits packs single
bits only), so the bit layout is written here, vectorised: each id becomes ``bits`` little-endian
bits, the bit stream is grouped in bytes. Invalid rows (padding, the last token, uncaptured rows)
are not sent at all; the valid mask travels as one bit per token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moerl.replay.trace import RoutingTrace, TraceError, index_dtype


def bits_per_index(num_experts: int) -> int:
    """ceil(log2 E), at least 1 (an expert id in 0..E-1)."""
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    return max(1, math.ceil(math.log2(num_experts)))


def _pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Flat non-negative ints < 2**bits -> uint8 bytes, little-endian bit order."""
    shifts = torch.arange(bits, dtype=torch.int64, device=values.device)
    stream = ((values.reshape(-1, 1).to(torch.int64) >> shifts) & 1).reshape(-1)
    pad = (-stream.numel()) % 8
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int64, device=values.device)
    return (stream.view(-1, 8) * weights).sum(-1).to(torch.uint8)


def _unpack_bits(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of _pack_bits: the first ``count`` values as int64."""
    need = (count * bits + 7) // 8
    if data.numel() != need:
        raise TraceError(f"packed payload has {data.numel()} bytes, expected {need} for {count} values of "
                         f"{bits} bits")
    shifts = torch.arange(8, dtype=torch.int64, device=data.device)
    stream = ((data.to(torch.int64).reshape(-1, 1) >> shifts) & 1).reshape(-1)[: count * bits]
    weights = torch.tensor([1 << i for i in range(bits)], dtype=torch.int64, device=data.device)
    return (stream.view(count, bits) * weights).sum(-1)


@dataclass
class PackedTrace:
    """What crosses the engine -> trainer boundary: bytes plus the metadata to rebuild the trace."""

    payload: torch.Tensor  # uint8: the valid rows' ids, ``bits`` each, row-major [valid_tokens, L, k]
    valid_bits: torch.Tensor  # uint8: the [N, T] valid mask, one bit per token
    shape: tuple[int, int]  # (N, T)
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int

    @property
    def bits(self) -> int:
        return bits_per_index(self.num_experts)

    @property
    def nbytes(self) -> int:
        return self.payload.numel() + self.valid_bits.numel()


def pack(trace: RoutingTrace) -> PackedTrace:
    """Pack the valid rows of ``trace``; ``unpack(pack(t))`` equals ``t.zero_invalid()`` exactly."""
    n, t, layers, k = trace.indices.shape
    rows = trace.indices[trace.valid].to(torch.int64)  # [valid_tokens, L, k]
    payload = _pack_bits(rows, bits_per_index(trace.num_experts))
    valid_bits = _pack_bits(trace.valid.reshape(-1).to(torch.int64), 1)
    return PackedTrace(payload, valid_bits, (n, t), trace.moe_layers, trace.num_experts, trace.top_k)


def unpack(packed: PackedTrace) -> RoutingTrace:
    """Rebuild the trace; invalid rows come back as expert 0 (never read: replay falls back to native)."""
    n, t = packed.shape
    layers, k = len(packed.moe_layers), packed.top_k
    valid = _unpack_bits(packed.valid_bits, 1, n * t).bool().view(n, t)
    count = int(valid.sum())
    rows = _unpack_bits(packed.payload, packed.bits, count * layers * k).view(count, layers, k)
    idx = torch.zeros(n, t, layers, k, dtype=index_dtype(packed.num_experts), device=packed.payload.device)
    idx[valid] = rows.to(idx.dtype)
    return RoutingTrace(idx, valid, packed.moe_layers, packed.num_experts, packed.top_k)


# -- sizes ------------------------------------------------------------------------------------------
def packed_bits_per_token(num_moe_layers: int, top_k: int, num_experts: int) -> int:
    """L * k * ceil(log2 E): one token's routes across all MoE layers."""
    return num_moe_layers * top_k * bits_per_index(num_experts)


def trace_size_row(name: str, num_moe_layers: int, top_k: int, num_experts: int) -> dict:
    """Bytes per token packed vs the unpacked encodings engines and trainers use."""
    n_ids = num_moe_layers * top_k
    unpacked = torch.empty((), dtype=index_dtype(num_experts)).element_size()
    return {
        "model": name, "moe_layers": num_moe_layers, "top_k": top_k, "num_experts": num_experts,
        "bits_per_id": bits_per_index(num_experts),
        "packed_bytes": packed_bits_per_token(num_moe_layers, top_k, num_experts) / 8,
        "smallest_int_bytes": n_ids * unpacked,  # RoutingTrace in memory (uint8 <=256 experts, else int16)
        "int16_bytes": n_ids * 2,  # verl
        "int32_bytes": n_ids * 4,  # SGLang meta_info, early vLLM
    }


# Public configs (config.json of each release): layers - first_k_dense_replace, experts_per_tok, experts.
PAPER_MODELS = {
    "Kimi-K2 (1T-A32B)": (61 - 1, 8, 384),
    "DeepSeek-V3 (671B-A37B)": (61 - 3, 8, 256),
    "Qwen3-30B-A3B": (48, 8, 128),
    "Qwen3-235B-A22B": (94, 8, 128),
}


def paper_model_sizes() -> list[dict]:
    return [trace_size_row(name, *spec) for name, spec in PAPER_MODELS.items()]
