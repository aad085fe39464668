import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_helpers import random_trace
from moerl.replay.trace import RoutingTrace, TraceError, index_dtype


@st.composite
def traces(draw):
    n, t = draw(st.integers(1, 5)), draw(st.integers(1, 7))
    total_layers = draw(st.integers(1, 6))
    dense = draw(st.integers(0, total_layers - 1))
    moe = tuple(range(dense, total_layers))
    e = draw(st.sampled_from([2, 8, 60, 256, 257, 384]))
    k = draw(st.integers(1, min(e, 8)))
    return random_trace(n, t, moe, e, k, seed=draw(st.integers(0, 2**16)))


def test_index_dtype_boundaries():
    assert index_dtype(256) == torch.uint8 and index_dtype(257) == torch.int16
    assert index_dtype(384) == torch.int16


@settings(max_examples=40, deadline=None)
@given(traces(), st.data())
def test_slicing_and_cat_round_trip(trace, data):
    n = trace.shape[0]
    rows = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n))
    sub = trace[torch.tensor(rows)]
    assert torch.equal(sub.indices, trace.indices[rows]) and torch.equal(sub.valid, trace.valid[rows])
    cut = data.draw(st.integers(1, n))
    back = RoutingTrace.cat([trace[:cut], trace[cut:]]) if cut < n else trace[:cut]
    assert torch.equal(back.indices, trace.indices) and torch.equal(back.valid, trace.valid)
    for number in trace.moe_layers:
        idx, valid = trace.layer(number)
        assert torch.equal(idx, trace.indices[:, :, trace.moe_layers.index(number)].long())


def test_layer_lookup_is_by_global_number():
    tr = random_trace(2, 3, (1, 2, 3), 8, 2)  # DeepSeek-V3 style: layer 0 dense
    assert torch.equal(tr.layer(1)[0], tr.indices[:, :, 0].long())
    with pytest.raises(TraceError, match="layer 0 is not an MoE layer"):
        tr.layer(0)


def test_out_of_range_expert_names_sample_token_layer():
    tr = random_trace(3, 4, (1, 2), 8, 2, valid=torch.ones(3, 4, dtype=torch.bool))
    idx = tr.indices.clone()
    idx[2, 1, 1, 0] = 9
    with pytest.raises(TraceError, match=r"sample 2, token 1, layer 2: expert id 9 out of range"):
        RoutingTrace(idx, tr.valid, (1, 2), 8, 2)


def test_duplicates_rejected_on_valid_rows_only():
    tr = random_trace(2, 3, (0,), 8, 2, valid=torch.ones(2, 3, dtype=torch.bool))
    idx = tr.indices.clone()
    idx[1, 2, 0] = torch.tensor([5, 5])
    with pytest.raises(TraceError, match=r"sample 1, token 2, layer 0: duplicate experts"):
        RoutingTrace(idx, tr.valid, (0,), 8, 2)
    valid = tr.valid.clone()
    valid[1, 2] = False
    RoutingTrace(idx, valid, (0,), 8, 2)  # an invalid row's content is never used


def test_check_fits_names_mismatch():
    tr = random_trace(2, 5, (1, 2), 8, 2)
    with pytest.raises(TraceError, match=r"trace covers \(2, 5\).*batch is \(2, 4\)"):
        tr.check_fits(torch.zeros(2, 4), (1, 2), 8, 2)
    with pytest.raises(TraceError, match="MoE layers"):
        tr.check_fits(torch.zeros(2, 5), (0, 1), 8, 2)
    with pytest.raises(TraceError, match="top-2"):
        tr.check_fits(torch.zeros(2, 5), (1, 2), 8, 4)
    with pytest.raises(TraceError, match="dtype torch.int16, expected torch.uint8"):
        RoutingTrace(tr.indices.to(torch.int16), tr.valid, (1, 2), 8, 2)
    with pytest.raises(TraceError, match="3 layer columns but moe_layers lists 2"):
        RoutingTrace(torch.zeros(2, 5, 3, 2, dtype=torch.uint8), torch.zeros(2, 5, dtype=torch.bool), (1, 2), 8, 2)
