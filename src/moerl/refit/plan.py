"""Transfer plan: which bytes of which tensor go where, shared by the in-process and out-of-process refit.

As in NeMo-RL's refit work, everything that does not change between refits (names, shapes, dtypes,
shard mapping, byte offsets, bucket membership) is computed once into a ``TransferPlan`` and cached;
a refit then only packs tensors into its buckets (moerl.refit.pack) and the engine verifies and
applies them (moerl.refit.receiver). The buckets of one refit sit one after another in a single
staging buffer (``Bucket.start``): the sender packs straight into it and the engine applies from it.
Each bucket carries an xxh3-64 checksum of its bytes (moerl.refit.checksum).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping

import torch

from moerl.lora.sharding import Layout, shard, spec_for

ALIGN = 64  # byte alignment of every tensor inside a bucket (any dtype view stays aligned)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"refit: unsupported wire dtype '{name}' (have: {list(_DTYPES)})")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class RefitError(RuntimeError):
    """A refit that did not apply; the engine keeps serving the previous weights."""


class CorruptBucketError(RefitError):
    """A bucket whose bytes do not match its checksum (names the bucket)."""


class StaleBucketError(RefitError):
    """A bucket of an older refit arriving after a newer one began (one given up on as lost): ignored."""


@dataclass(frozen=True)
class Slot:
    name: str
    rank: tuple[int, int]  # engine (ep_rank, tp_rank) this piece is for
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    index: int
    nbytes: int
    slots: tuple[Slot, ...]
    start: int = 0  # byte offset of the bucket in the refit's staging buffer (slot offsets are relative to it)


@dataclass(frozen=True)
class TransferPlan:
    mode: str  # adapter | merged
    wire_dtype: str
    bucket_bytes: int
    engine_layout: Layout
    buckets: tuple[Bucket, ...]
    signature: str  # hash of (mode, dtype, layout, names, shapes, bucket size): the cache key

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        return max(b.nbytes for b in self.buckets)

    def names(self) -> list[str]:
        return sorted({s.name for b in self.buckets for s in b.slots})

    def ranks(self) -> list[tuple[int, int]]:
        return sorted({s.rank for b in self.buckets for s in b.slots})


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def signature(mode: str, wire_dtype: str, bucket_bytes: int, layout: Layout,
              shapes: Mapping[str, tuple[int, ...]]) -> str:
    h = hashlib.sha1(f"{mode}|{wire_dtype}|{bucket_bytes}|{layout}".encode())
    for name in sorted(shapes):
        h.update(f"{name}:{tuple(shapes[name])};".encode())
    return h.hexdigest()


def shard_shapes(name: str, shape: tuple[int, ...], layout: Layout) -> dict[tuple[int, int], tuple[int, ...]]:
    """Shapes of ``name``'s pieces on each engine rank (via the real sharding functions on a meta tensor)."""
    if layout == Layout():
        return {(0, 0): tuple(shape)}
    pieces = shard(torch.empty(shape, device="meta"), spec_for(name, shape), layout, name)
    return {r: tuple(p.shape) for r, p in pieces.items()}


def build_plan(shapes: Mapping[str, tuple[int, ...]], mode: str, wire_dtype: str, bucket_bytes: int,
               engine_layout: Layout = Layout()) -> TransferPlan:
    """Greedy packing in name order; a tensor larger than a bucket gets a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"refit.bucket_mb must be > 0 (got {bucket_bytes} bytes)")
    elem = torch.empty((), dtype=dtype_of(wire_dtype)).element_size()
    buckets: list[Bucket] = []
    cur: list[Slot] = []
    off = start = 0
    for name in sorted(shapes):
        for rank, shp in sorted(shard_shapes(name, tuple(shapes[name]), engine_layout).items()):
            nbytes = elem * int(torch.Size(shp).numel())
            if cur and off + nbytes > bucket_bytes:
                buckets.append(Bucket(len(buckets), off, tuple(cur), start))
                cur, start, off = [], start + off, 0
            cur.append(Slot(name, rank, shp, off, nbytes))
            off = _align(off + nbytes)
    if cur:
        buckets.append(Bucket(len(buckets), off, tuple(cur), start))
    if not buckets:
        raise ValueError("refit: nothing to transfer (empty tensor set)")
    return TransferPlan(mode, wire_dtype, bucket_bytes, engine_layout, tuple(buckets),
                        signature(mode, wire_dtype, bucket_bytes, engine_layout, shapes))


@dataclass
class PlanCache:
    """Plans by signature; ``hits``/``misses`` let tests check a refit did not re-plan."""

    plans: dict[str, TransferPlan] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def get(self, shapes: Mapping[str, tuple[int, ...]], mode: str, wire_dtype: str, bucket_bytes: int,
            layout: Layout = Layout()) -> TransferPlan:
        key = signature(mode, wire_dtype, bucket_bytes, layout, shapes)
        plan = self.plans.get(key)
        if plan is None:
            self.misses += 1
            plan = self.plans[key] = build_plan(shapes, mode, wire_dtype, bucket_bytes, layout)
        else:
            self.hits += 1
        return plan


# ---- typed views of a buffer -------------------------------------------------------------------


def _view(buf: torch.Tensor, slot: Slot, dtype: torch.dtype) -> torch.Tensor:
    return buf[slot.offset:slot.offset + slot.nbytes].view(dtype).view(slot.shape)


_VIEWS: dict = {}  # (plan signature, bucket, buffer address, rank) -> [(slot, typed view)]: computed once


def slot_views(bucket: Bucket, buf: torch.Tensor, plan: TransferPlan, rank=None) -> list:
    """Typed views of a bucket's slots in ``buf`` (the bucket's bytes from offset 0), cached: buffers
    are reused refit after refit, so a refit does no per-tensor slicing/view work (NeMo-RL's
    "ahead-of-time metadata" lesson)."""
    key = (plan.signature, bucket.index, buf.data_ptr(), buf.numel(), rank)
    views = _VIEWS.get(key)
    if views is None:
        if len(_VIEWS) > 4096:
            _VIEWS.clear()
        dtype = dtype_of(plan.wire_dtype)
        views = _VIEWS[key] = [(s, _view(buf, s, dtype)) for s in bucket.slots if rank is None or s.rank == rank]
    return views


def bucket_region(staging: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """The bytes of ``bucket`` in a refit's staging buffer."""
    return staging[bucket.start:bucket.start + bucket.nbytes]


@torch.no_grad()
def unpack_bucket(bucket: Bucket, buf: torch.Tensor, plan: TransferPlan,
                  rank: tuple[int, int] = (0, 0)) -> dict[str, torch.Tensor]:
    """Copies (not views) of this rank's tensors in a packed bucket (tests, debugging)."""
    return {slot.name: view.clone() for slot, view in slot_views(bucket, buf, plan, rank)}
