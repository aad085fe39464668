"""Refit plan/pack/checksum, resharding to the engine's layout, and the HF/PEFT adapter format."""
from __future__ import annotations

import json

import pytest
import torch

from moerl.config import ExperimentConfig, RefitConfig
from moerl.data.tokenizer import build_tokenizer
from moerl.lora.peft_lora import apply_lora
from moerl.lora.sharding import Layout, shard, spec_for
from moerl.models.presets import build_model
from moerl.refit.adapter_format import (AdapterMap, AdapterMismatchError, canonical_adapter, from_hf_peft,
                                        load_hf_adapter, save_hf_adapter, to_hf_peft)
from moerl.refit.pack import pack_bucket
from moerl.refit.plan import CorruptBucketError, PlanCache, RefitError, build_plan, unpack_bucket
from moerl.refit.receiver import Receiver
from moerl.refit.refitter import make_refitter
from moerl.refit.weights import effective_state_dict


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _policy(tok, mode="per_expert", preset="qwen3_moe", rank=8, seed=0):
    cfg = ExperimentConfig()
    cfg.model.preset, cfg.lora.expert_mode, cfg.lora.rank = preset, mode, rank
    model = apply_lora(build_model(cfg.model, tok), cfg.lora, preset)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.05)
    return cfg, model


def test_plan_buckets_pack_unpack_and_cache():
    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(100 + i, 7) for i in range(10)}
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    plan = build_plan(shapes, "adapter", "bfloat16", bucket_bytes=4096)
    assert len(plan.buckets) > 1 and all(b.nbytes <= 4096 or len(b.slots) == 1 for b in plan.buckets)
    assert plan.names() == sorted(tensors)
    buf = torch.empty(plan.max_bucket_bytes, dtype=torch.uint8)
    got = {}
    for b in plan.buckets:
        pack_bucket(b, tensors, buf, plan)
        got.update(unpack_bucket(b, buf, plan))
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in tensors.items())
    cache = PlanCache()
    p1 = cache.get(shapes, "adapter", "bfloat16", 4096)
    assert cache.get(shapes, "adapter", "bfloat16", 4096) is p1 and (cache.hits, cache.misses) == (1, 1)


def test_plan_reshards_to_engine_layout():
    torch.manual_seed(0)
    tensors = {"m.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 8, 6),
               "m.layers.0.mlp.experts.down_proj.lora_A": torch.randn(4, 2, 4),
               "m.layers.0.mlp.experts.down_proj.lora_B": torch.randn(1, 6, 2),
               "m.layers.0.self_attn.o_proj.weight": torch.randn(6, 6)}
    layout = Layout(tp=2, ep=2, etp=2)
    plan = build_plan({k: tuple(v.shape) for k, v in tensors.items()}, "merged", "float32", 256, layout)
    buf = torch.empty(plan.max_bucket_bytes, dtype=torch.uint8)
    per_rank: dict = {}
    for b in plan.buckets:
        pack_bucket(b, tensors, buf, plan)
        for rank in plan.ranks():
            per_rank.setdefault(rank, {}).update(unpack_bucket(b, buf, plan, rank))
    for name, t in tensors.items():
        for rank, piece in shard(t, spec_for(name, tuple(t.shape)), layout, name).items():
            assert torch.equal(per_rank[rank][name], piece), (name, rank)


def test_receiver_rejects_corrupt_and_partial_and_applies_nothing():
    tensors = {f"t{i}": torch.randn(64) for i in range(6)}
    plan = build_plan({k: tuple(v.shape) for k, v in tensors.items()}, "adapter", "float32", 512)
    applied = []
    rx = Receiver(applied.append)
    rx.set_plan(plan)
    buf = torch.empty(plan.max_bucket_bytes, dtype=torch.uint8)
    digest = pack_bucket(plan.buckets[1], tensors, buf, plan)
    buf[10] ^= 0xFF
    with pytest.raises(CorruptBucketError, match=r"bucket 1 of \d+ failed its checksum"):
        rx.stage(1, 1, buf, digest)
    with pytest.raises(RefitError, match="bucket 1"):
        rx.commit(1)
    assert not applied
    digest = pack_bucket(plan.buckets[0], tensors, buf, plan)  # version 2: only bucket 0 arrives
    rx.stage(2, 0, buf, digest)
    with pytest.raises(RefitError, match=r"partial transfer, bucket\(s\) \[1"):
        rx.commit(2)
    assert not applied


@pytest.mark.parametrize("mode,preset", [("per_expert", "qwen3_moe"), ("shared", "mixtral"),
                                         ("shared_outer", "qwen3_moe")])
def test_hf_peft_export_round_trip(tok, tmp_path, mode, preset):
    cfg, model = _policy(tok, mode, preset)
    canon = canonical_adapter(model)
    hf = to_hf_peft(canon, preset, cfg.model.num_experts)
    gate = "gate_proj" if preset == "qwen3_moe" else "w1"
    key = f"base_model.model.model.layers.0.mlp.experts.7.{gate}.lora_A.weight"
    assert hf[key].shape == (cfg.lora.rank, cfg.model.hidden_size)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight" in hf
    path = save_hf_adapter(tmp_path / "a", canon, preset, cfg.model.num_experts, cfg.lora.rank, cfg.lora.alpha)
    back, config = load_hf_adapter(path, preset, mode)
    assert config["r"] == cfg.lora.rank and gate in config["target_modules"]
    assert set(back) == set(canon) and all(torch.equal(back[k], canon[k]) for k in canon)
    # and it loads into a fresh model of the same mode, giving the same merged weights
    _, fresh = _policy(tok, mode, preset, seed=1)
    AdapterMap(fresh).load(back)
    a, b = effective_state_dict(model), effective_state_dict(fresh)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    json.loads((path / "adapter_config.json").read_text())


def test_shared_mode_import_rejects_differing_experts(tok):
    cfg, model = _policy(tok, "per_expert")
    hf = to_hf_peft(canonical_adapter(model), "qwen3_moe", cfg.model.num_experts)
    with pytest.raises(AdapterMismatchError, match="shares it but the experts' copies differ"):
        from_hf_peft(hf, "qwen3_moe", "shared")


def test_adapter_mismatch_names_first_offending_tensor(tok):
    _, model = _policy(tok, "per_expert", rank=8)
    _, other = _policy(tok, "per_expert", rank=16)
    amap = AdapterMap(model)
    bad = canonical_adapter(other)
    with pytest.raises(AdapterMismatchError, match=r"adapter tensor 'model\.layers\.0\..*': rank mismatch"):
        amap.load(bad)
    good = canonical_adapter(model)
    renamed = dict(good)
    renamed["model.layers.0.self_attn.q_proj.lora_X"] = renamed.pop("model.layers.0.self_attn.q_proj.lora_A")
    with pytest.raises(AdapterMismatchError, match="'model.layers.0.self_attn.q_proj.lora_X': the engine's model"):
        amap.load(renamed)


@pytest.mark.parametrize("refit_mode,expert_mode", [("adapter", "per_expert"), ("merged", "shared"),
                                                    ("adapter", "shared_outer")])
def test_in_process_refit_round_trip_and_failed_refit_keeps_weights(tok, refit_mode, expert_mode):
    from moerl.rollout.hf import HFEngine

    cfg, policy = _policy(tok, expert_mode)
    cfg.rollout.dtype = "fp32"  # exact round trip here; the bf16 engine is checked in test_refit_engine_process
    engine = HFEngine(policy, tok, cfg.rollout)
    refitter = make_refitter(RefitConfig(mode=refit_mode, bucket_mb=0.05), policy, engine, "fp32")
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    metrics = refitter.sync()
    assert metrics["refit/buckets"] > 1 and refitter.cache.misses == 1
    ids = torch.randint(3, 30, (2, 8))
    merged = build_model(cfg.model, tok)
    merged.load_state_dict(effective_state_dict(policy))
    with torch.no_grad():
        ref = merged(input_ids=ids).logits
        got = engine.model(input_ids=ids).logits.float()
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()
    refitter.sync()
    assert refitter.cache.hits == 1  # the plan was reused
    # a corrupted bucket: error names it, the engine keeps serving the previous weights
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(1.0)
    refitter._tamper = lambda index, buf: buf.__setitem__(0, buf[0] ^ 1) if index == 1 else None
    with pytest.raises(CorruptBucketError, match="bucket 1"):
        refitter.sync()
    with torch.no_grad():
        assert torch.equal(engine.model(input_ids=ids).logits.float(), got)
