"""Engine side of a refit: verify each bucket where it lies in the staging buffer, apply at commit.

The staging buffer holds one whole refit (every bucket at its ``Bucket.start``). A transport that
can write into it (the in-process one, and the engine process through shared memory) packs there
directly, so the engine's only passes over the bytes are one checksum per bucket on arrival and one
copy into its weights at commit, reading typed views of the staging buffer. Nothing is applied
before every bucket of the refit has arrived and passed its checksum: a corrupt, missing or
mismatching refit leaves the engine serving the previous weights.

The sender must not write a bucket's bytes after sending it until the refit's commit has returned
(moerl.refit.refitter.Refitter.sync keeps to this); the checksum is what guards the way in between.
"""
from __future__ import annotations

import torch

from moerl.refit.checksum import StreamingChecksum, checksum
from moerl.refit.plan import (CorruptBucketError, RefitError, StaleBucketError, TransferPlan, bucket_region,
                              slot_views)

_COPY_BLOCK = 512 * 1024  # bytes copied into staging before they are hashed (still in cache)


def new_staging(plan: TransferPlan, shared: bool = False) -> torch.Tensor:
    """A zeroed buffer for one refit of ``plan`` (zeroed: alignment padding hashes the same every time)."""
    buf = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    return buf.share_memory_() if shared else buf


@torch.no_grad()
def copy_and_checksum(dst: torch.Tensor, src: torch.Tensor) -> int:
    """``dst.copy_(src)`` (uint8, same length) and the checksum of the copy, hashed block by block."""
    digest = StreamingChecksum(dst)
    for lo in range(0, dst.numel(), _COPY_BLOCK):
        hi = min(dst.numel(), lo + _COPY_BLOCK)
        dst[lo:hi].copy_(src[lo:hi])
        digest.upto(hi)
    return digest.digest(dst.numel())


class Receiver:
    """Verify each bucket, keep it in the staging buffer, apply the whole refit at commit.

    ``apply(tensors)`` gets name -> typed views of the staging buffer; it must validate before it
    mutates (AdapterMap.load and BaseLoader.load do) and copy out of the views (they are overwritten by
    the next refit). Any failure drops the refit, so the engine never serves half-updated weights."""

    def __init__(self, apply, rank: tuple[int, int] = (0, 0)):
        self.apply, self.rank = apply, rank
        self.plan: TransferPlan | None = None
        self.staging: torch.Tensor | None = None
        self.staged: dict[str, torch.Tensor] = {}
        self.newest: int | None = None  # the newest refit version a bucket arrived for
        self._reset(None)

    def _reset(self, version) -> None:
        self.version, self.received, self.error = version, set(), None

    def set_plan(self, plan: TransferPlan, staging: torch.Tensor | None = None) -> None:
        """Use ``staging`` (at least ``plan.total_bytes``; e.g. shared memory the sender packs into)
        or a new buffer; the views ``apply`` reads are built here, once per plan."""
        staging = new_staging(plan) if staging is None else staging
        if staging.dtype != torch.uint8 or staging.numel() < plan.total_bytes:
            raise RefitError(f"refit: staging buffer of {staging.numel()} bytes for a plan of {plan.total_bytes}")
        self.plan, self.staging = plan, staging
        self.regions = [bucket_region(staging, b) for b in plan.buckets]
        self.staged = {slot.name: view for b, region in zip(plan.buckets, self.regions)
                       for slot, view in slot_views(b, region, plan, self.rank)}
        self._reset(None)

    def region(self, index: int) -> torch.Tensor:
        """Where bucket ``index`` is staged: a sender that packs here saves the engine a copy."""
        return self.regions[index]

    def stage(self, version: int, index: int, buf: torch.Tensor | None, expected: int) -> None:
        """Check bucket ``index`` of refit ``version``. ``buf`` holds its bytes: None or its staging
        region (checked where it lies), or any other buffer (copied into the region, the copy checked)."""
        if self.plan is None:
            raise RefitError("refit: a bucket arrived before any transfer plan")
        if self.newest is not None and version < self.newest:
            # A bucket the sender gave up on (it timed out) delivered late: it must not reset or
            # corrupt the refit now being staged.
            raise StaleBucketError(f"refit {version}: bucket {index} arrived after refit {self.newest} began; ignored")
        self.newest = version
        if version != self.version:
            self._reset(version)
        if self.error is not None:
            raise RefitError(self.error)
        if not 0 <= index < len(self.plan.buckets):
            self.error = f"refit {version}: bucket {index} is not in the plan ({len(self.plan.buckets)} buckets)"
            raise RefitError(self.error)
        bucket, region = self.plan.buckets[index], self.regions[index]
        if buf is None or buf.data_ptr() == region.data_ptr():
            got = checksum(region)
        else:
            got = copy_and_checksum(region, buf[:bucket.nbytes])
        if got != expected:
            self.error = (f"refit {version}: bucket {index} of {len(self.plan.buckets)} failed its checksum "
                          f"(got {got:#018x}, sender said {expected:#018x}; {bucket.nbytes} bytes, first tensor "
                          f"'{bucket.slots[0].name}'); keeping the previous weights")
            raise CorruptBucketError(self.error)
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
