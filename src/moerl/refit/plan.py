"""Transfer plan, bucket packing and checksums: shared by the in-process and out-of-process refit.

As in NeMo-RL's refit work, everything that does not change between refits (names, shapes, dtypes,
shard mapping, byte offsets, bucket membership) is computed once into a ``TransferPlan`` and cached;
a refit then only packs tensors into a bucket buffer, checksums it and copies it across. Each bucket
carries an xxh3-64 checksum of its bytes that the receiver verifies before staging anything.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Mapping

import torch
import xxhash

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


def checksum(buf: torch.Tensor) -> int:
    """xxh3-64 of a contiguous uint8 CPU tensor's bytes (xxhash: ~10 GB/s, far above copy cost here)."""
    return xxhash.xxh3_64_intdigest(memoryview(buf.numpy()))


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
    off = 0
    for name in sorted(shapes):
        for rank, shp in sorted(shard_shapes(name, tuple(shapes[name]), engine_layout).items()):
            nbytes = elem * int(torch.Size(shp).numel())
            if cur and off + nbytes > bucket_bytes:
                buckets.append(Bucket(len(buckets), off, tuple(cur)))
                cur, off = [], 0
            cur.append(Slot(name, rank, shp, off, nbytes))
            off = _align(off + nbytes)
    if cur:
        buckets.append(Bucket(len(buckets), off, tuple(cur)))
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


# ---- pack / unpack -----------------------------------------------------------------------------


def _view(buf: torch.Tensor, slot: Slot, dtype: torch.dtype) -> torch.Tensor:
    return buf[slot.offset:slot.offset + slot.nbytes].view(dtype).view(slot.shape)


_VIEWS: dict = {}  # (plan signature, bucket, buffer address, rank) -> [(slot, typed view)]: computed once


def _views(bucket: Bucket, buf: torch.Tensor, plan: TransferPlan, rank=None) -> list:
    """Typed views of a bucket's slots in ``buf``, cached: buffers are reused refit after refit, so a
    refit does no per-tensor slicing/view work (NeMo-RL's "ahead-of-time metadata" lesson)."""
    key = (plan.signature, bucket.index, buf.data_ptr(), buf.numel(), rank)
    views = _VIEWS.get(key)
    if views is None:
        if len(_VIEWS) > 4096:
            _VIEWS.clear()
        dtype = dtype_of(plan.wire_dtype)
        views = _VIEWS[key] = [(s, _view(buf, s, dtype)) for s in bucket.slots if rank is None or s.rank == rank]
    return views


@torch.no_grad()
def pack_bucket(bucket: Bucket, tensors: Mapping[str, torch.Tensor], buf: torch.Tensor, plan: TransferPlan) -> int:
    """Copy (casting to the wire dtype, resharding to the engine's layout) into ``buf``; return checksum."""
    sharded: dict[str, dict] = {}
    for slot, view in _views(bucket, buf, plan):
        t = tensors[slot.name]
        if plan.engine_layout != Layout():
            if slot.name not in sharded:
                sharded[slot.name] = shard(t, spec_for(slot.name, tuple(t.shape)), plan.engine_layout, slot.name)
            t = sharded[slot.name][slot.rank]
        if t.shape != view.shape:
            raise RefitError(f"refit: tensor '{slot.name}' has shape {tuple(t.shape)}, the cached plan says "
                             f"{slot.shape} (the model changed; build a new plan)")
        view.copy_(t)
    return checksum(buf[:bucket.nbytes])


@torch.no_grad()
def unpack_bucket(bucket: Bucket, buf: torch.Tensor, plan: TransferPlan,
                  rank: tuple[int, int] = (0, 0), out: dict | None = None) -> dict[str, torch.Tensor]:
    """Copies (not views) of this rank's tensors: the buffer is reused for the next bucket. With
    ``out`` (a staging dict from an earlier refit of the same plan) the copies go into its tensors."""
    out = {} if out is None else out
    for slot, view in _views(bucket, buf, plan, rank):
        dst = out.get(slot.name)
        if dst is None:
            out[slot.name] = view.clone()
        else:
            dst.copy_(view)
    return out


class Receiver:
    """Engine side of a refit: verify each bucket, stage its tensors, apply all at commit.

    ``apply(tensors)`` must validate before it mutates (AdapterMap.load does); any failure drops the
    staged tensors, so the engine never serves half-updated weights."""

    def __init__(self, apply, rank: tuple[int, int] = (0, 0)):
        self.apply, self.rank = apply, rank
        self.plan: TransferPlan | None = None
        self.staged = {}
        self._reset(None)

    def _reset(self, version) -> None:
        self.version, self.received, self.error = version, set(), None

    def set_plan(self, plan: TransferPlan) -> None:
        self.plan = plan
        self.staged: dict[str, torch.Tensor] = {}  # staging tensors, allocated once per plan and reused
        self._reset(None)

    def stage(self, version: int, index: int, buf: torch.Tensor, expected: int) -> None:
        if self.plan is None:
            raise RefitError("refit: a bucket arrived before any transfer plan")
        if version != self.version:
            self._reset(version)
        if self.error is not None:
            raise RefitError(self.error)
        try:
            bucket = self.plan.buckets[index]
        except IndexError:
            self.error = f"refit {version}: bucket {index} is not in the plan ({len(self.plan.buckets)} buckets)"
            raise RefitError(self.error) from None
        got = checksum(buf[:bucket.nbytes])
        if got != expected:
            self.error = (f"refit {version}: bucket {index} of {len(self.plan.buckets)} failed its checksum "
                          f"(got {got:#018x}, sender said {expected:#018x}; {bucket.nbytes} bytes, first tensor "
                          f"'{bucket.slots[0].name}'); keeping the previous weights")
            raise CorruptBucketError(self.error)
        unpack_bucket(bucket, buf, self.plan, self.rank, out=self.staged)
        self.received.add(index)

    def commit(self, version: int) -> int:
        """Apply the staged refit; returns the number of tensors applied."""
        try:
            if self.plan is None or version != self.version:
                raise RefitError(f"refit {version}: commit without any bucket of this refit")
            if self.error is not None:
                raise RefitError(self.error)
            missing = sorted(set(range(len(self.plan.buckets))) - self.received)
            if missing:
                raise RefitError(f"refit {version}: partial transfer, bucket(s) {missing[:8]} of "
                                 f"{len(self.plan.buckets)} never arrived; keeping the previous weights")
            self.apply(self.staged)
            return len(self.staged)
        finally:
            self._reset(None)
