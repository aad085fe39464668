"""Sharding math: round trips (property tests) and sharded compute == unsharded compute."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from moerl.lora.sharding import (Layout, ShardingError, ShardSpec, fuse_qkv, gather_stages, join_fused,
                                 local_experts, qkv_sizes, reshard, shard, spec_for, split_fused,
                                 split_stages, stage_layers, to_local_expert_ids, unshard)
import pytest

SETTINGS = settings(max_examples=25, deadline=None)


@SETTINGS
@given(parts=st.sampled_from([1, 2, 4]), seg=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       cols=st.integers(1, 5), dim=st.sampled_from([0, 1]), seed=st.integers(0, 99))
def test_fused_split_join_round_trip(parts, seg, cols, dim, seed):
    torch.manual_seed(seed)
    sizes = [s * parts for s in seg]
    shape = (sum(sizes), cols) if dim == 0 else (cols, sum(sizes))
    t = torch.randn(shape)
    shards = split_fused(t, sizes, parts, dim)
    assert all(s.shape[dim] == sum(sizes) // parts for s in shards)
    assert torch.equal(join_fused(shards, sizes, dim), t)


EXPERT_NAMES = [("m.layers.0.mlp.experts.gate_up_proj", (8, 12, 6)), ("m.layers.0.mlp.experts.down_proj", (8, 6, 4)),
                ("m.layers.0.mlp.experts.gate_up_proj.lora_A", (8, 2, 6)),
                ("m.layers.0.mlp.experts.gate_up_proj.lora_B", (1, 12, 2)),
                ("m.layers.0.mlp.experts.down_proj.lora_A", (8, 2, 4)),
                ("m.layers.0.mlp.experts.down_proj.lora_B", (1, 6, 2)),
                ("m.layers.0.self_attn.q_proj.lora_B", (8, 2)), ("m.layers.0.self_attn.o_proj.lora_A", (2, 8)),
                ("m.layers.0.self_attn.o_proj.weight", (8, 8)), ("m.norm.weight", (8,))]


@SETTINGS
@given(tp=st.sampled_from([1, 2]), ep=st.sampled_from([1, 2, 4]), etp=st.sampled_from([1, 2]),
       tp2=st.sampled_from([1, 2]), ep2=st.sampled_from([1, 2, 8]), seed=st.integers(0, 99))
def test_shard_unshard_and_reshard_round_trip(tp, ep, etp, tp2, ep2, seed):
    torch.manual_seed(seed)
    src, dst = Layout(tp=tp, ep=ep, etp=etp), Layout(tp=tp2, ep=ep2, etp=tp2)
    for name, shape in EXPERT_NAMES:
        t = torch.randn(shape)
        spec = spec_for(name, shape)
        pieces = shard(t, spec, src, name)
        assert torch.equal(unshard(pieces, spec, src, name), t), name
        moved = reshard(pieces, spec, src, dst, name)
        assert torch.equal(unshard(moved, spec, dst, name), t), name


def test_unshard_rejects_diverged_replicas_and_bad_splits():
    spec = spec_for("m.layers.0.self_attn.q_proj.lora_A", (2, 8))  # replicated over TP
    pieces = shard(torch.randn(2, 8), spec, Layout(tp=2))
    pieces[(0, 1)] = pieces[(0, 1)] + 1
    with pytest.raises(ShardingError, match="copy 1 differs"):
        unshard(pieces, spec, Layout(tp=2), "q.lora_A")
    with pytest.raises(ShardingError, match="does not split into 3"):
        shard(torch.randn(8, 4), ShardSpec(0), Layout(tp=3), "w")


def test_column_and_row_parallel_linear_with_lora_match_unsharded():
    torch.manual_seed(0)
    x, w, a, b = torch.randn(5, 8), torch.randn(12, 8), torch.randn(2, 8), torch.randn(12, 2)
    full = F.linear(x, w) + F.linear(F.linear(x, a), b)
    lay = Layout(tp=2)
    # column parallel (q_proj): outputs concatenate
    ws, as_, bs = (shard(t, spec_for(f"l.q_proj.{n}", t.shape), lay) for t, n in ((w, "weight"), (a, "lora_A"), (b, "lora_B")))
    col = torch.cat([F.linear(x, ws[(0, r)]) + F.linear(F.linear(x, as_[(0, r)]), bs[(0, r)]) for r in range(2)], -1)
    assert torch.allclose(col, full, atol=1e-5)
    # row parallel (o_proj): input split, partial outputs summed
    w2, a2 = torch.randn(12, 8), torch.randn(2, 8)
    full2 = F.linear(x, w2) + F.linear(F.linear(x, a2), b)
    ws, as_, bs = (shard(t, spec_for(f"l.o_proj.{n}", t.shape), lay) for t, n in ((w2, "weight"), (a2, "lora_A"), (b, "lora_B")))
    xs = x.chunk(2, -1)
    row = sum(F.linear(xs[r], ws[(0, r)]) + F.linear(F.linear(xs[r], as_[(0, r)]), bs[(0, r)]) for r in range(2))
    assert torch.allclose(row, full2, atol=1e-5)


def test_fused_qkv_column_parallel_keeps_heads_together():
    torch.manual_seed(0)
    nh, nkv, hd, hidden = 4, 2, 3, 6
    q, k, v = torch.randn(nh * hd, hidden), torch.randn(nkv * hd, hidden), torch.randn(nkv * hd, hidden)
    fused = fuse_qkv(q, k, v)
    sizes = qkv_sizes(nh, nkv, hd)
    pieces = shard(fused, ShardSpec(0, sizes), Layout(tp=2))
    x = torch.randn(3, hidden)
    for r in range(2):  # rank r computes exactly its heads of q, k and v
        out = F.linear(x, pieces[(0, r)])
        qr, kr, vr = out.split([s // 2 for s in sizes], -1)
        assert torch.allclose(qr, F.linear(x, q.chunk(2)[r]), atol=1e-6)
        assert torch.allclose(kr, F.linear(x, k.chunk(2)[r]), atol=1e-6)
        assert torch.allclose(vr, F.linear(x, v.chunk(2)[r]), atol=1e-6)


def _experts_ref(h, idx, wts, gate_up, down):
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e >= gate_up.shape[0]:
                continue  # EP sentinel: another rank's expert
            g, u = F.linear(h[t], gate_up[e]).chunk(2, -1)
            out[t] += wts[t, j] * F.linear(F.silu(g) * u, down[e])
    return out


@pytest.mark.parametrize("mode", ["per_expert", "shared", "shared_outer"])
@pytest.mark.parametrize("layout", [Layout(ep=2), Layout(etp=2), Layout(ep=2, etp=2), Layout(ep=4)])
def test_sharded_moe_with_expert_lora_equals_unsharded(mode, layout):
    from moerl.lora.expert_modes import sharing

    torch.manual_seed(1)
    num_e, hidden, inter, r, k, tokens = 8, 6, 4, 2, 2, 7
    base = {"gate_up_proj": torch.randn(num_e, 2 * inter, hidden), "down_proj": torch.randn(num_e, hidden, inter)}
    lora = {}
    for p, w in base.items():
        sa, sb = sharing(mode, p)
        lora[f"{p}.lora_A"] = torch.randn(1 if sa else num_e, r, w.shape[2])
        lora[f"{p}.lora_B"] = torch.randn(1 if sb else num_e, w.shape[1], r)
    h = torch.randn(tokens, hidden)
    idx = torch.stack([torch.randperm(num_e)[:k] for _ in range(tokens)])
    wts = torch.rand(tokens, k)

    def eff(tensors, p):
        return tensors[p] + torch.matmul(tensors[f"{p}.lora_B"], tensors[f"{p}.lora_A"])

    full = _experts_ref(h, idx, wts, eff({**base, **lora}, "gate_up_proj"), eff({**base, **lora}, "down_proj"))
    pieces = {n: shard(t, spec_for(f"x.mlp.experts.{n}", t.shape), layout, n) for n, t in {**base, **lora}.items()}
    total = torch.zeros_like(full)
    for e in range(layout.ep):
        local_idx = to_local_expert_ids(idx, num_e, layout.ep, e)
        for t in range(layout.etp):
            mine = {n: p[(e, t)] for n, p in pieces.items()}
            # the rank's gate_up shard is [its gate | its up], its down shard the matching columns
            total += _experts_ref(h, local_idx, wts, eff(mine, "gate_up_proj"), eff(mine, "down_proj"))
    assert torch.allclose(total, full, atol=1e-4), (total - full).abs().max()
    assert list(local_experts(num_e, layout.ep, layout.ep - 1)) == list(range(num_e - num_e // layout.ep, num_e))


def test_pipeline_stages_own_their_layers_and_gather_checks_owners():
    assert [list(r) for r in stage_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    tensors = {f"model.layers.{i}.self_attn.q_proj.lora_A": torch.full((1,), float(i)) for i in range(5)}
    tensors["model.embed_tokens.weight"] = torch.zeros(1)
    tensors["lm_head.weight"] = torch.ones(1)
    stages = split_stages(tensors, 5, 2)
    assert set(stages[0]) >= {"model.embed_tokens.weight", "model.layers.2.self_attn.q_proj.lora_A"}
    assert "lm_head.weight" in stages[1]
    assert gather_stages(stages, 5) == tensors
    stages[1]["model.layers.0.self_attn.q_proj.lora_A"] = torch.zeros(1)
    with pytest.raises(ShardingError, match="sent by pipeline stage 1 but owned by stage 0"):
        gather_stages(stages, 5)
