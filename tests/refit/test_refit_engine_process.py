"""Refit into a rollout engine running in its own process (shared-memory buckets, checksums)."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from moerl.config import ExperimentConfig
from moerl.data.tokenizer import build_tokenizer
from moerl.lora.peft_lora import apply_lora
from moerl.models.presets import build_model
from moerl.refit.engine_process import EngineProcess
from moerl.refit.plan import CorruptBucketError
from moerl.refit.refitter import make_refitter
from moerl.refit.weights import effective_state_dict
from moerl.rollout.hf import HFEngine


@contextmanager
def _threads(n: int):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _perturb(model, scale):
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * scale)


@pytest.mark.parametrize("refit_mode", ["adapter"])  # merged: in-process tests + benchmarks/bench_refit.py
def test_engine_process_refit_round_trip_and_corruption(refit_mode):
    torch.manual_seed(0)
    cfg = ExperimentConfig()
    cfg.refit.mode, cfg.refit.bucket_mb = refit_mode, 0.1
    tok = build_tokenizer()
    policy = apply_lora(build_model(cfg.model, tok), cfg.lora, cfg.model.preset)
    ids = torch.randint(3, 30, (3, 10))
    # The reference is the same computation on this machine: an in-process engine holding the same
    # bf16 weights and unmerged LoRA, refitted through the same plan. bf16 kernels differ between CPUs
    # (AMX / AVX512-BF16 or not), so no tolerance is taken from a constant measured on one of them.
    local = HFEngine(policy, tok, cfg.rollout, cfg.data.task)
    local_refitter = make_refitter(cfg.refit, policy, local, cfg.rollout.dtype)
    with EngineProcess(cfg, policy, threads=1) as engine:
        refitter = make_refitter(cfg.refit, policy, engine, cfg.rollout.dtype)
        before = engine.logits(ids)
        _perturb(policy, 0.05)
        metrics = refitter.sync()
        local_refitter.sync()
        assert metrics["refit/buckets"] >= 2 and metrics["refit/bytes"] > 0
        got = engine.logits(ids)
        with torch.no_grad(), _threads(1):  # the engine process computes on one thread
            want = local.model(input_ids=ids).logits.float()
        # same weights, same kernels, same thread count: equal up to nothing but summation order
        change = (want - before).abs().mean()
        assert change > 0.01  # the refit moved the logits by far more than any rounding
        assert (got - want).abs().max() <= 1e-3 * change
        if refit_mode == "merged":
            merged = build_model(cfg.model, tok)
            merged.load_state_dict(effective_state_dict(policy))
            with torch.no_grad():
                assert torch.equal(got, merged.to(torch.bfloat16)(input_ids=ids).logits.float())
        eff = engine.effective_state_dict()
        w = "model.layers.1.mlp.experts.down_proj"
        assert torch.allclose(eff[w], effective_state_dict(policy)[w], atol=2e-2)

        # corrupted bucket: the error names it and the engine keeps the previous weights
        _perturb(policy, 1.0)
        refitter._tamper = lambda index, buf: buf.__setitem__(3, buf[3] ^ 0x40) if index == 1 else None
        with pytest.raises(CorruptBucketError, match=r"bucket 1 of \d+"):
            refitter.sync()
        assert torch.equal(engine.logits(ids), got)
        refitter._tamper = None
        refitter.sync()  # and the next clean refit applies
        assert not torch.equal(engine.logits(ids), got)
        assert refitter.cache.misses == 1 and refitter.cache.hits == 2
