import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moerl.replay.engine_output import (batch_layout, encode_sglang_routed_experts, layer_layout,
                                        trace_from_sglang, trace_from_vllm)
from moerl.replay.trace import TraceError


def make_batch(prompt_lens, resp_lens, t0, t):
    n = len(prompt_lens)
    mask = torch.zeros(n, t, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        mask[i, t0 - p:t0 + r] = 1
    return mask


def engine_routes(rng, p, r, num_layers, dense, e, k):
    """vLLM-shaped: [p + r - 1, num_hidden_layers, k], distinct experts, dense layers zero-filled."""
    arr = np.stack([rng.permutation(e)[:k] for _ in range((p + r - 1) * num_layers)]).reshape(p + r - 1, num_layers, k)
    arr[:, dense] = 0
    return arr.astype(np.int16)


@st.composite
def layouts(draw):
    n = draw(st.integers(1, 4))
    t0 = draw(st.integers(1, 6))
    max_r = draw(st.integers(1, 6))
    prompt_lens = [draw(st.integers(1, t0)) for _ in range(n)]
    resp_lens = [draw(st.integers(1, max_r)) for _ in range(n)]
    num_layers = draw(st.integers(1, 5))
    first_dense = draw(st.integers(0, num_layers - 1))
    e = draw(st.sampled_from([4, 8, 384]))
    k = draw(st.integers(1, 4))
    return n, t0, t0 + max_r, prompt_lens, resp_lens, num_layers, first_dense, e, k, draw(st.integers(0, 999))


@settings(max_examples=50, deadline=None)
@given(layouts())
def test_vllm_alignment_by_layer_number(layout):
    n, t0, t, prompt_lens, resp_lens, num_layers, first_dense, e, k, seed = layout
    rng = np.random.default_rng(seed)
    dense = list(range(first_dense))
    moe = tuple(range(first_dense, num_layers))
    mask = make_batch(prompt_lens, resp_lens, t0, t)
    routes = [engine_routes(rng, p, r, num_layers, dense, e, k) for p, r in zip(prompt_lens, resp_lens)]
    tr = trace_from_vllm(routes, mask, t0, moe, e, k, num_layers)
    assert tr.shape == (n, t, len(moe), k) and tr.moe_layers == moe
    for i, (p, r) in enumerate(zip(prompt_lens, resp_lens)):
        cols = list(range(t0 - p, t0)) + list(range(t0, t0 + r))
        for j, c in enumerate(cols[:-1]):
            assert tr.valid[i, c]
            assert tr.indices[i, c].tolist() == routes[i][j, list(moe)].tolist()
        last = cols[-1]
        assert not tr.valid[i, last]  # the last generated token: no forward, no route
        pad = torch.ones(t, dtype=torch.bool)
        pad[cols] = False
        assert not tr.valid[i][pad].any()  # padding is never valid
    # SGLang carries the same rows as base64 int32; the trace must be identical.
    metas = [{"routed_experts": encode_sglang_routed_experts(r)} for r in routes]
    tr2 = trace_from_sglang(metas, mask, t0, moe, e, k, num_layers)
    assert torch.equal(tr2.indices, tr.indices) and torch.equal(tr2.valid, tr.valid)


def test_dense_first_layer_mapped_by_number_not_position():
    # DeepSeek-V3 style: 4 layers, layer 0 dense (zero-filled by vLLM), MoE layers 1..3.
    rng = np.random.default_rng(0)
    mask = make_batch([3], [2], 3, 5)
    routes = engine_routes(rng, 3, 2, 4, [0], 8, 2)
    tr = trace_from_vllm([routes], mask, 3, (1, 2, 3), 8, 2, 4)
    assert tr.indices[0, 0].tolist() == routes[0, 1:].tolist()
    # The position-mapping bug (columns 0..2 for MoE layers 1..3) picks the zero-filled dense column:
    # duplicate expert 0 in every row, so no row can be replayed; every one falls back and is counted.
    buggy = routes[:, [0, 1, 2, 3]].copy()
    buggy[:, 1:] = routes[:, :3]
    tr = trace_from_vllm([buggy], mask, 3, (1, 2, 3), 8, 2, 4)
    assert not tr.valid.any() and tr.duplicate_rows == 4


def test_a_row_with_duplicate_experts_falls_back_alone():
    rng = np.random.default_rng(3)
    mask = make_batch([3, 2], [2, 2], 3, 5)
    routes = [engine_routes(rng, 3, 2, 3, [0], 8, 2), engine_routes(rng, 2, 2, 3, [0], 8, 2)]
    routes[1][1, 2] = [5, 5]  # sample 1, its second token (batch column 2), layer 2
    tr = trace_from_vllm(routes, mask, 3, (1, 2), 8, 2, 3)
    assert tr.duplicate_rows == 1 and not tr.valid[1, 2]
    assert tr.valid[0, :4].all() and tr.valid[1, [1, 3]].all()  # every other row still replays
    assert tr.indices[1, 3].tolist() == routes[1][2, 1:].tolist()


def test_engine_that_reports_routes_on_a_dense_layer_is_rejected():
    rng = np.random.default_rng(1)
    mask = make_batch([2, 2], [2, 1], 2, 4)
    routes = [engine_routes(rng, 2, 2, 3, [], 8, 2), engine_routes(rng, 2, 1, 3, [], 8, 2)]
    with pytest.raises(TraceError, match="sample 0, token 0: layer 0 is dense in the model but carries experts"):
        trace_from_vllm(routes, mask, 2, (1, 2), 8, 2, 3)


@pytest.mark.parametrize("k", [1, 2])
def test_routes_packed_by_position_are_rejected_for_any_top_k(k):
    # A producer that packs the MoE layers' routes into the first columns (the position mapping) leaves
    # real routes in the dense layer's column. With top-1 no "distinct experts" test can see that.
    rng = np.random.default_rng(2)
    mask = make_batch([3], [3], 3, 6)
    routes = engine_routes(rng, 3, 3, 4, [0], 8, k)
    packed = np.zeros_like(routes)
    packed[:, :3] = routes[:, 1:]
    packed[0, 0] = np.arange(1, k + 1)  # token 0 routed to non-zero experts in the dense column
    with pytest.raises(TraceError, match=r"sample 0, token 0: layer 0 is dense in the model but carries experts"):
        trace_from_vllm([packed], mask, 3, (1, 2, 3), 8, k, 4)


def test_layer_layout_follows_each_family_rule():
    from transformers import DeepseekV3Config, MixtralConfig, Qwen3MoeConfig

    ds = layer_layout(DeepseekV3Config(num_hidden_layers=5, first_k_dense_replace=2, n_routed_experts=16,
                                       num_experts_per_tok=4))
    assert (ds.num_hidden_layers, ds.moe_layers, ds.num_experts, ds.top_k) == (5, (2, 3, 4), 16, 4)
    qw = layer_layout(Qwen3MoeConfig(num_hidden_layers=4, mlp_only_layers=[1], decoder_sparse_step=1,
                                     num_experts=8, num_experts_per_tok=2))
    assert qw.moe_layers == (0, 2, 3)
    assert layer_layout(MixtralConfig(num_hidden_layers=3)).moe_layers == (0, 1, 2)
    with pytest.raises(TraceError, match="no MoE layer rule for model_type 'llama'"):
        layer_layout(type("Cfg", (), {"model_type": "llama", "num_hidden_layers": 2})())


def _set(arr, where, value):
    arr = arr.copy()
    arr[where] = value
    return arr


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r[:-1], r"sample 1: 3 token rows, expected 4 \(prompt 3 \+ response 2 - 1 - start 0\)"),
    (lambda r: np.concatenate([r, r[:1]]), r"sample 1: 5 token rows, expected 4"),
    (lambda r: r[:, :2], r"sample 1: 2 layers in the routes, the model has 3"),
    (lambda r: r[:, :, :1], r"sample 1: top-k 1 in the routes, the model routes top-2"),
    (lambda r: _set(r, (0, 1, 0), 8), r"sample 1, token 0, layer 1: expert id 8 out of range"),
    (lambda r: r[:, :, 0], r"sample 1: routed experts must be \[tokens, layers, top_k\]"),
    (lambda r: r.astype(np.float32), r"sample 1: routed experts must be integers"),
])
def test_bad_engine_output_names_the_sample(mutate, message):
    rng = np.random.default_rng(2)
    mask = make_batch([2, 3], [1, 2], 3, 5)
    routes = [engine_routes(rng, 2, 1, 3, [0], 8, 2), engine_routes(rng, 3, 2, 3, [0], 8, 2)]
    routes[1] = mutate(routes[1])
    with pytest.raises(TraceError, match=message):
        trace_from_vllm(routes, mask, 3, (1, 2), 8, 2, 3)


def test_expert_id_above_uint8_is_not_wrapped():
    mask = make_batch([1], [2], 1, 3)
    routes = np.array([[[300, 1]], [[2, 3]]])
    with pytest.raises(TraceError, match="expert id 300 out of range"):
        trace_from_vllm([routes], mask, 1, (0,), 256, 2, 1)


def test_sample_count_and_padding_layout_errors():
    mask = make_batch([1, 1], [1, 1], 1, 2)
    with pytest.raises(TraceError, match="routes for 1 samples, batch has 2"):
        trace_from_vllm([np.zeros((1, 1, 2))], mask, 1, (0,), 8, 2, 1)
    bad = torch.tensor([[1, 0, 1, 1]])
    with pytest.raises(TraceError, match="sample 0: prompt is not left-padded"):
        batch_layout(bad, 3)
    with pytest.raises(TraceError, match="sample 0: response is not right-padded"):
        batch_layout(torch.tensor([[1, 1, 0, 1]]), 2)


def test_missing_rows_and_sglang_start_offset_are_invalid_not_filled():
    rng = np.random.default_rng(3)
    mask = make_batch([3, 2], [3, 2], 3, 6)
    full0, full1 = engine_routes(rng, 3, 3, 2, [], 8, 2), engine_routes(rng, 2, 2, 2, [], 8, 2)
    full0[1] = -1  # NeMo-RL's missing-row sentinel
    metas = [{"routed_experts": encode_sglang_routed_experts(full0)},
             {"routed_experts": encode_sglang_routed_experts(full1[2:]), "routed_experts_start_len": 2}]
    tr = trace_from_sglang(metas, mask, 3, (0, 1), 8, 2, 2)
    assert tr.valid[0].tolist() == [True, False, True, True, True, False]
    # Sample 1: prompt at columns 1-2, response 3-4; rows start at position 2 = column 3; last token 4.
    assert tr.valid[1].tolist() == [False, False, False, True, False, False]
    assert tr.indices[1, 3].tolist() == full1[2].tolist()
    partial = full1.copy()
    partial[0, 0] = -1
    with pytest.raises(TraceError, match="sample 0, token 0: negative expert ids in some layers only"):
        trace_from_vllm([partial], mask[1:], 3, (0, 1), 8, 2, 2)
    with pytest.raises(TraceError, match="sglang sample 1: .* not a multiple"):
        trace_from_sglang([metas[0], {"routed_experts": encode_sglang_routed_experts(np.zeros(3))}], mask, 3,
                          (0, 1), 8, 2, 2)
    none_captured = trace_from_vllm([None, full1], mask, 3, (0, 1), 8, 2, 2)
    assert not none_captured.valid[0].any() and none_captured.valid[1].sum() == 3
