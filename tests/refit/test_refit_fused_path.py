"""The fused refit path: checksum while packing, pack straight into the staging buffer, apply from it.

It must deliver exactly the tensors a plain ``effective_state_dict`` / adapter read cast to the wire
dtype gives (bit for bit, fp32 and bf16), keep the xxh3-64 of the bucket bytes as its checksum, and
refuse a bucket whose bytes changed after packing, whether it is checked in place or copied in.
"""
from __future__ import annotations

import pytest
import torch
import xxhash

from moerl.config import ExperimentConfig
from moerl.data.tokenizer import build_tokenizer
from moerl.lora.peft_lora import apply_lora
from moerl.lora.sharding import Layout, shard, spec_for
from moerl.models.presets import build_model
from moerl.refit.adapter_format import AdapterMap
from moerl.refit.pack import BLOCK_BYTES, pack_bucket
from moerl.refit.plan import CorruptBucketError, RefitError, build_plan, dtype_of
from moerl.refit.receiver import Receiver
from moerl.refit.refitter import Refitter
from moerl.refit.weights import MergedWeight, effective_state_dict, merged_sources


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _policy(tok, expert_mode: str, preset: str = "qwen3_moe", seed: int = 0):
    cfg = ExperimentConfig()
    cfg.model.preset, cfg.lora.expert_mode = preset, expert_mode
    model = apply_lora(build_model(cfg.model, tok), cfg.lora, preset)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)  # B nonzero: the merged weights differ from the base
    return model


class _Capture:
    """Transport into a receiver whose ``apply`` keeps a copy of what it was handed."""

    def __init__(self, rank=(0, 0), in_place=True):
        self.applied: dict[str, torch.Tensor] = {}
        self.receiver = Receiver(lambda ts: self.applied.update({k: v.clone() for k, v in ts.items()}), rank)
        self.in_place = in_place
        self._elsewhere = torch.empty(0, dtype=torch.uint8)

    def prepare(self, plan):
        self.receiver.set_plan(plan)
        self._elsewhere = torch.zeros(plan.max_bucket_bytes, dtype=torch.uint8)

    def buffer(self, index):
        return self.receiver.region(index) if self.in_place else self._elsewhere

    def send(self, version, index, checksum):
        self.receiver.stage(version, index, None if self.in_place else self._elsewhere, checksum)

    def commit(self, version):
        return self.receiver.commit(version)


@pytest.mark.parametrize("expert_mode", ["per_expert", "shared", "shared_outer"])
def test_merged_sources_equal_effective_state_dict_bitwise(tok, expert_mode):
    policy = _policy(tok, expert_mode)
    want = effective_state_dict(policy)
    got = merged_sources(policy)
    assert got.keys() == want.keys()
    lazy = [k for k, v in got.items() if isinstance(v, MergedWeight)]
    assert any(".experts." in k for k in lazy), "the expert weights should be merged lazily"
    for k, src in got.items():
        full = src.materialize() if isinstance(src, MergedWeight) else src
        assert torch.equal(full, want[k]), k
        if isinstance(src, MergedWeight) and src.shape[0] > 2:  # block by block = all at once
            blocks = torch.cat([src.rows(lo, min(lo + 3, src.shape[0])) for lo in range(0, src.shape[0], 3)])
            assert torch.equal(blocks, want[k]), k


@pytest.mark.parametrize("mode,expert_mode,wire,in_place", [
    ("merged", "per_expert", torch.float32, True), ("merged", "per_expert", torch.bfloat16, False),
    ("merged", "shared_outer", torch.float32, True), ("merged", "shared", torch.bfloat16, True),
    ("adapter", "per_expert", torch.float32, True), ("adapter", "per_expert", torch.bfloat16, True),
    ("adapter", "shared_outer", torch.float32, False)])
def test_refit_delivers_exactly_the_reference_tensors(tok, mode, expert_mode, wire, in_place):
    """What the engine is handed equals the trainer's tensors cast to the wire dtype, bit for bit."""
    policy = _policy(tok, expert_mode)
    transport = _Capture(in_place=in_place)
    refitter = Refitter(mode, 64 * 1024, policy, transport, wire)  # several buckets, large tensors split
    metrics = refitter.sync()
    assert metrics["refit/buckets"] > 2
    ref = effective_state_dict(policy) if mode == "merged" else AdapterMap(policy).state()
    assert transport.applied.keys() == ref.keys()
    for k, v in ref.items():
        assert transport.applied[k].dtype == wire and torch.equal(transport.applied[k], v.to(wire)), k


def test_refit_reshards_merged_weights_exactly(tok):
    policy = _policy(tok, "per_expert")
    layout = Layout(tp=2, ep=2, etp=2)
    ref = effective_state_dict(policy)
    names = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.self_attn.q_proj.weight")
    pieces = {k: shard(ref[k], spec_for(k, tuple(ref[k].shape)), layout, k) for k in names}
    ranks = sorted(set.intersection(*(set(p) for p in pieces.values())))
    assert len(ranks) >= 2
    for rank in ranks[:1] + ranks[-1:]:
        transport = _Capture(rank=rank)
        Refitter("merged", 256 * 1024, policy, transport, torch.float32, engine_layout=layout).sync()
        for k in names:
            assert torch.equal(transport.applied[k], pieces[k][rank]), (k, rank)


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_fused_checksum_is_xxh3_of_the_bucket_bytes(wire):
    """Same checksum as hashing the packed bucket in one go: strided, blocked and lazy sources,
    alignment padding included."""
    torch.manual_seed(0)
    big = torch.randn(4 * BLOCK_BYTES // 512 + 3, 128)  # several blocks of rows
    strided = torch.randn(40, 6, 5).permute(2, 0, 1)  # e.g. PEFT's expert-interleaved LoRA B
    tensors = {"a": big, "b": strided, "c": torch.randn(7), "d": torch.tensor(1.5),
               "e": MergedWeight(torch.randn(9, 33), [lambda lo, hi: (torch.ones(hi - lo, 33), True)])}
    plan = build_plan({k: tuple(v.shape) for k, v in tensors.items()}, "merged", wire, 1 << 30)
    (bucket,) = plan.buckets
    buf = torch.full((plan.max_bucket_bytes,), 0xAB, dtype=torch.uint8)  # padding bytes are hashed too
    digest = pack_bucket(bucket, tensors, buf, plan)
    assert digest == xxhash.xxh3_64_intdigest(buf[:bucket.nbytes].numpy().tobytes())
    dtype = dtype_of(wire)
    for slot in bucket.slots:
        got = buf[slot.offset:slot.offset + slot.nbytes].view(dtype).view(slot.shape)
        src = tensors[slot.name]
        want = src.materialize() if isinstance(src, MergedWeight) else src
        assert torch.equal(got, want.to(dtype)), slot.name


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("where", ["first", "middle", "last", "padding"])
def test_receiver_refuses_a_bucket_changed_after_packing(in_place, where):
    """Any changed byte of a bucket (tensor data or alignment padding) is refused, nothing applied."""
    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(i + 3, 5) for i in range(8)}
    plan = build_plan({k: tuple(v.shape) for k, v in tensors.items()}, "adapter", "bfloat16", 256)
    bucket = plan.buckets[1]
    pos = {"first": 0, "middle": bucket.nbytes // 2, "last": bucket.nbytes - 1,
           "padding": bucket.slots[0].offset + bucket.slots[0].nbytes}[where]
    assert where != "padding" or pos < bucket.slots[1].offset
    applied = []
    rx = Receiver(applied.append)
    rx.set_plan(plan)
    elsewhere = torch.zeros(plan.max_bucket_bytes, dtype=torch.uint8)
    for b in plan.buckets:
        buf = rx.region(b.index) if in_place else elsewhere
        digest = pack_bucket(b, tensors, buf, plan)
        if b.index == 1:
            buf[pos] ^= 0x01
            with pytest.raises(CorruptBucketError, match=rf"bucket 1 of {len(plan.buckets)} failed its checksum"):
                rx.stage(1, b.index, None if in_place else buf, digest)
        elif b.index > 1:  # the refit is already refused
            with pytest.raises(RefitError, match="bucket 1"):
                rx.stage(1, b.index, None if in_place else buf, digest)
        else:
            rx.stage(1, b.index, None if in_place else buf, digest)
    with pytest.raises(RefitError, match="bucket 1"):
        rx.commit(1)
    assert not applied
    for b in plan.buckets:  # the same refit, clean: applies
        buf = rx.region(b.index) if in_place else elsewhere
        rx.stage(2, b.index, None if in_place else buf, pack_bucket(b, tensors, buf, plan))
    assert rx.commit(2) == len(tensors) and applied
