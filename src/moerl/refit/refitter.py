"""Refit: trainer -> rollout engine, adapter-only or merged, in buckets with checksums.

    refitter = make_refitter(cfg.refit, policy, engine, rollout_dtype=cfg.rollout.dtype)
    metrics = refitter.sync()   # {"refit/bytes", "refit/seconds", "refit/buckets", ...}

``engine`` is either an ``EngineProcess`` (own process, shared-memory staging buffer) or any
in-process engine exposing ``.model`` (moerl.rollout.hf.HFEngine): both go through the same plan,
pack, checksum and receiver code; in both the sender packs straight into the engine's staging buffer.
"""
from __future__ import annotations

import time

import torch
from torch import nn

from moerl.lora.sharding import Layout
from moerl.refit.adapter_format import AdapterMap
from moerl.refit.loaders import make_apply
from moerl.refit.pack import pack_bucket
from moerl.refit.plan import PlanCache, TransferPlan, dtype_name
from moerl.refit.receiver import Receiver
from moerl.refit.weights import merged_sources
from moerl.rollout.precision import COMPUTE_DTYPES

# A quantised rollout keeps LoRA tensors in bf16 over its quantised base: they travel in its compute dtype.
_DTYPES = COMPUTE_DTYPES


class LocalTransport:
    """In-process engine: pack straight into the receiver's staging buffer, verify each bucket there."""

    def __init__(self, model: nn.Module, mode: str):
        self.receiver = Receiver(make_apply(model, mode))

    def prepare(self, plan: TransferPlan) -> None:
        self.receiver.set_plan(plan)

    def buffer(self, index: int) -> torch.Tensor:
        return self.receiver.region(index)

    def send(self, version: int, index: int, checksum: int) -> None:
        self.receiver.stage(version, index, None, checksum)

    def commit(self, version: int) -> int:
        return self.receiver.commit(version)


class Refitter:
    def __init__(self, mode: str, bucket_bytes: int, policy: nn.Module, transport, wire_dtype: torch.dtype,
                 engine_layout: Layout = Layout()):
        if mode not in ("adapter", "merged"):
            raise ValueError(f"refit.mode: unknown mode '{mode}' (have: adapter, merged)")
        self.mode, self.bucket_bytes, self.policy, self.transport = mode, bucket_bytes, policy, transport
        self.wire_dtype, self.engine_layout = dtype_name(wire_dtype), engine_layout
        self.cache = PlanCache()
        self.version = 0
        self._sent_signature: str | None = None
        self._adapter_map = AdapterMap(policy) if mode == "adapter" else None
        self._tamper = None  # tests: callable(bucket_index, buffer) run after packing (fault injection)

    def tensors(self) -> dict:
        """What this refit sends: canonical adapter tensors, or merged full weights (plain names; the
        LoRA-adapted ones as lazy ``MergedWeight``s computed block by block while packing)."""
        if self.mode == "adapter":
            return self._adapter_map.state()
        return merged_sources(self.policy)

    def plan(self, tensors: dict[str, torch.Tensor]) -> TransferPlan:
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        return self.cache.get(shapes, self.mode, self.wire_dtype, self.bucket_bytes, self.engine_layout)

    def sync(self) -> dict:
        start = time.perf_counter()
        tensors = self.tensors()
        plan = self.plan(tensors)
        if plan.signature != self._sent_signature:
            self.transport.prepare(plan)
            self._sent_signature = plan.signature
        self.version += 1
        for bucket in plan.buckets:
            buf = self.transport.buffer(bucket.index)
            digest = pack_bucket(bucket, tensors, buf, plan)
            if self._tamper is not None:
                self._tamper(bucket.index, buf)
            self.transport.send(self.version, bucket.index, digest)
        applied = self.transport.commit(self.version)
        return {"refit/bytes": float(plan.total_bytes), "refit/seconds": time.perf_counter() - start,
                "refit/buckets": float(len(plan.buckets)), "refit/tensors": float(applied),
                "refit/version": float(self.version)}


def make_refitter(cfg, policy: nn.Module, engine, rollout_dtype: str = "bf16",
                  engine_layout: Layout = Layout()) -> Refitter:
    """``cfg`` is moerl.config.RefitConfig. ``engine``: an EngineProcess, or an in-process engine with
    ``.model`` (the engine's resident PEFT copy). The wire dtype is the engine's dtype."""
    from moerl.refit.engine_process import EngineProcess

    if rollout_dtype not in _DTYPES:
        raise ValueError(f"rollout.dtype: unknown dtype '{rollout_dtype}' (have: {list(_DTYPES)})")
    if isinstance(engine, EngineProcess):
        if engine.mode != cfg.mode:
            raise ValueError(f"refit.mode={cfg.mode} but the engine process was started for '{engine.mode}'")
        transport = engine
    elif hasattr(engine, "model"):
        transport = LocalTransport(engine.model, cfg.mode)
    else:
        raise TypeError(f"refit: engine {type(engine).__name__} is neither an EngineProcess nor has .model")
    return Refitter(cfg.mode, int(cfg.bucket_mb * 2**20), policy, transport, _DTYPES[rollout_dtype], engine_layout)
