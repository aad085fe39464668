"""Sender side of a refit: cast, reshard and checksum tensors into a bucket in one pass.

Each tensor is written into the bucket a block of rows at a time and every block is hashed right
after it is written, while it is still in cache, so the checksum costs no extra pass over memory.
The digest equals ``checksum(bucket bytes)`` (the receiver's one-shot check). A source is either a
tensor or a lazily merged weight (moerl.refit.weights.MergedWeight) that computes each block of
``base + delta`` on demand, so a merged refit never builds full-size merged temporaries.
"""
from __future__ import annotations

from typing import Mapping

import torch

from moerl.lora.sharding import Layout, shard, spec_for
from moerl.refit.checksum import StreamingChecksum
from moerl.refit.plan import Bucket, RefitError, TransferPlan, slot_views

# Bytes of a bucket written before they are hashed: small enough to stay in a core's L2 cache (the
# fp32 source block of a bf16 wire is twice this), large enough that per-block Python costs are noise.
BLOCK_BYTES = 512 * 1024


def _materialize(src) -> torch.Tensor:
    return src if isinstance(src, torch.Tensor) else src.materialize()


def _write_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; a strided source of another dtype (e.g. the canonical view of PEFT's
    expert-interleaved LoRA B) is cast in its own memory order first, then reordered dtype-to-dtype:
    both steps are fast copies, where one strided casting copy is markedly slower."""
    if src.dtype != dst.dtype and not src.is_contiguous() and src.dim() > 1:
        tmp = torch.empty_like(src, dtype=dst.dtype)  # keeps ``src``'s strides when it is dense
        if tmp.stride() == src.stride():
            tmp.copy_(src)
            src = tmp
    dst.copy_(src)


@torch.no_grad()
def pack_bucket(bucket: Bucket, tensors: Mapping[str, object], buf: torch.Tensor, plan: TransferPlan) -> int:
    """Write the bucket's tensors into ``buf`` (its bytes, from offset 0), cast to the wire dtype and
    resharded to the engine's layout; return the xxh3-64 of ``buf[:bucket.nbytes]``."""
    digest = StreamingChecksum(buf)
    sharded: dict[str, dict] = {}
    reshard = plan.engine_layout != Layout()
    for slot, view in slot_views(bucket, buf, plan):
        src = tensors[slot.name]
        if reshard:
            if slot.name not in sharded:
                t = _materialize(src)
                sharded[slot.name] = shard(t, spec_for(slot.name, tuple(t.shape)), plan.engine_layout, slot.name)
            src = sharded[slot.name][slot.rank]
        if tuple(src.shape) != tuple(view.shape):
            raise RefitError(f"refit: tensor '{slot.name}' has shape {tuple(src.shape)}, the cached plan says "
                             f"{slot.shape} (the model changed; build a new plan)")
        rows = view.shape[0] if view.dim() else 1
        row_bytes = slot.nbytes // max(rows, 1)
        # a strided source is written whole: its row blocks would not be dense
        whole = view.dim() < 2 or (isinstance(src, torch.Tensor) and not src.is_contiguous())
        step = max(1, rows if whole else BLOCK_BYTES // max(row_bytes, 1))
        for lo in range(0, rows, step):
            hi = min(rows, lo + step)
            if not isinstance(src, torch.Tensor):
                src.write(view, lo, hi)
            elif hi - lo == rows:
                _write_tensor(view, src)
            else:
                view[lo:hi].copy_(src[lo:hi])
            digest.upto(slot.offset + hi * row_bytes)
    return digest.digest(bucket.nbytes)
