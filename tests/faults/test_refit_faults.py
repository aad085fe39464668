"""Refit buckets corrupted, truncated, reordered or dropped on the way to the engine, in both engine
modes (in-process and its own process): a bad refit is refused naming the bucket, the engine keeps
the weights it had, and the next clean refit applies; buckets out of order change nothing."""
from __future__ import annotations

import pytest
import torch

from moerl.config import ExperimentConfig, RefitConfig
from moerl.data.tokenizer import build_tokenizer
from moerl.lora.peft_lora import apply_lora
from moerl.models.presets import build_model
from moerl.refit.plan import CorruptBucketError, RefitError
from moerl.refit.refitter import make_refitter
from moerl.refit.weights import effective_state_dict


def _nudge(policy, scale=0.05):
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * scale)


class Wire:
    """Sits on the transport's ``send``: drops bucket ``drop``, or holds bucket ``hold`` back until
    the bucket after it was sent (a reorder). ``out(version, index, checksum)`` delivers one."""

    def __init__(self, out):
        self.out = out
        self.drop = self.hold = None
        self._held = None

    def send(self, version, index, checksum):
        if index == self.drop:
            return
        if index == self.hold:
            self._held = (version, index, checksum)
            return
        self.out(version, index, checksum)
        if self._held is not None:
            held, self._held = self._held, None
            self.out(*held)


def _faults(refitter, weights, wire, nbytes_of_bucket_1):
    """Each fault in turn; the engine's weights after each (refused ones must not change them)."""
    _nudge(refitter.policy)
    before = weights()
    refitter._tamper = lambda i, buf: buf.__setitem__(5, buf[5] ^ 0x10) if i == 1 else None
    with pytest.raises(CorruptBucketError, match=r"bucket 1 of \d+ failed its checksum.*keeping the previous"):
        refitter.sync()
    assert _same(weights(), before)
    refitter._tamper = lambda i, buf: buf[nbytes_of_bucket_1 // 2: nbytes_of_bucket_1].zero_() if i == 1 else None
    with pytest.raises(CorruptBucketError, match=r"bucket 1 of \d+ failed its checksum"):
        refitter.sync()  # truncated: the second half of the bucket never written
    assert _same(weights(), before)
    refitter._tamper = None
    wire.drop = 2
    with pytest.raises(RefitError, match=r"bucket\(s\) \[2\]"):
        refitter.sync()
    assert _same(weights(), before)
    wire.drop, wire.hold = None, 1
    refitter.sync()  # bucket 1 arrives after bucket 2
    in_order = weights()
    assert not _same(in_order, before)
    wire.hold = None
    refitter.sync()  # the same weights sent again in order
    assert _same(weights(), in_order)
    expected = {k: v.float() for k, v in effective_state_dict(refitter.policy).items()}
    assert all(torch.allclose(in_order[k], expected[k], atol=5e-2) for k in expected)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _setup():
    torch.manual_seed(0)
    cfg = ExperimentConfig()
    cfg.refit.bucket_mb = 0.1
    tok = build_tokenizer()
    return cfg, tok, apply_lora(build_model(cfg.model, tok), cfg.lora, cfg.model.preset)


def _bucket_bytes(refitter, i=1):
    plan = refitter.plan(refitter.tensors())
    assert len(plan.buckets) >= 4
    return plan.buckets[i].nbytes


def test_refit_bucket_faults_in_process():
    from moerl.rollout.hf import HFEngine

    cfg, tok, policy = _setup()
    engine = HFEngine(policy, tok, cfg.rollout)
    refitter = make_refitter(RefitConfig(bucket_mb=0.1), policy, engine, cfg.rollout.dtype)
    transport = refitter.transport
    wire = Wire(transport.send)  # each bucket has its own region of the staging buffer: a held one stays put
    transport.send = wire.send
    refitter.sync()
    _faults(refitter, lambda: {k: v.float().clone() for k, v in effective_state_dict(engine.model).items()}, wire,
            _bucket_bytes(refitter))


def test_refit_bucket_faults_engine_process():
    from moerl.refit.engine_process import EngineProcess

    cfg, tok, policy = _setup()
    with EngineProcess(cfg, policy, timeout=60) as engine:
        refitter = make_refitter(cfg.refit, policy, engine, cfg.rollout.dtype)
        refitter.sync()
        real = engine._conn.send
        wire = Wire(lambda v, i, c: real(("stage", v, i, c)))
        engine._conn.send = lambda msg: wire.send(*msg[1:]) if msg[0] == "stage" else real(msg)
        engine.timeout = 3  # a dropped bucket is given up on after 3 s without an answer
        _faults(refitter, engine.effective_state_dict, wire, _bucket_bytes(refitter))
        engine.timeout = 60


def test_a_bucket_given_up_on_and_delivered_late_is_ignored():
    """A bucket that times out and then arrives (between other requests, or in the middle of the next
    refit) must neither answer another request nor reset or corrupt the next refit."""
    from moerl.refit.engine_process import EngineProcess

    cfg, tok, policy = _setup()
    with EngineProcess(cfg, policy, timeout=60) as engine:
        refitter = make_refitter(cfg.refit, policy, engine, cfg.rollout.dtype)
        refitter.sync()
        before = engine.effective_state_dict()
        real = engine._conn.send
        held = []  # bucket 2 of the refit that fails, held back by the wire

        def send(msg):
            if msg[0] == "stage" and msg[2] == 2 and not held:
                held.append(msg)
                return None
            real(msg)
            if held and msg[0] == "stage" and msg[1] > held[0][1] and msg[2] == 0:
                real(held[0])  # late again, now in the middle of the next refit
            return None

        engine._conn.send = send
        engine.timeout = 3
        _nudge(policy)
        with pytest.raises(RefitError, match=r"bucket\(s\) \[2\]"):
            refitter.sync()
        engine.timeout = 60
        real(held[0])  # arrives after the sender gave up: its acknowledgement answers no request
        assert _same(engine.effective_state_dict(), before)
        refitter.sync()
        expected = {k: v.float() for k, v in effective_state_dict(refitter.policy).items()}
        got = engine.effective_state_dict()
        assert not _same(got, before)
        assert all(torch.allclose(got[k], expected[k], atol=5e-2) for k in expected)
