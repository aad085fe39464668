import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay_helpers import random_trace
from moerl.replay.packing import (PAPER_MODELS, bits_per_index, pack, paper_model_sizes, trace_size_row,
                                  unpack)
from moerl.replay.trace import TraceError


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 4), t=st.integers(1, 9), layers=st.integers(1, 4),
       e=st.sampled_from([1, 2, 3, 7, 8, 9, 64, 128, 255, 256, 257, 384, 1000]), k=st.integers(1, 8),
       seed=st.integers(0, 2**16))
def test_round_trip_exact_and_size(n, t, layers, e, k, seed):
    k = min(k, e)
    tr = random_trace(n, t, tuple(range(7, 7 + layers)), e, k, seed=seed)
    packed = pack(tr)
    back = unpack(packed)
    want = tr.zero_invalid()
    assert back.indices.dtype == want.indices.dtype
    assert torch.equal(back.indices, want.indices) and torch.equal(back.valid, tr.valid)
    assert back.moe_layers == tr.moe_layers
    valid_tokens = int(tr.valid.sum())
    assert packed.payload.numel() == math.ceil(valid_tokens * layers * k * bits_per_index(e) / 8)
    assert packed.valid_bits.numel() == math.ceil(n * t / 8)


def test_bits_per_index():
    assert [bits_per_index(e) for e in (1, 2, 8, 9, 128, 256, 257, 384)] == [1, 1, 3, 4, 7, 8, 9, 9]


def test_bits_are_actually_packed():
    # 8 ids of 3 bits = exactly 3 bytes; values 0..7 in order, little-endian bit stream.
    from moerl.replay.trace import RoutingTrace
    idx = torch.arange(8, dtype=torch.uint8).view(1, 1, 1, 8)
    tr = RoutingTrace(idx, torch.ones(1, 1, dtype=torch.bool), (0,), 8, 8)
    assert pack(tr).payload.tolist() == [0b10001000, 0b11000110, 0b11111010]


def test_truncated_payload_is_an_error():
    tr = random_trace(2, 3, (0, 1), 384, 8, valid=torch.ones(2, 3, dtype=torch.bool))
    packed = pack(tr)
    packed.payload = packed.payload[:-1]
    with pytest.raises(TraceError, match="expected"):
        unpack(packed)


def test_paper_model_sizes():
    rows = {r["model"]: r for r in paper_model_sizes()}
    kimi = rows["Kimi-K2 (1T-A32B)"]
    assert (kimi["moe_layers"], kimi["bits_per_id"], kimi["packed_bytes"], kimi["int16_bytes"]) == (60, 9, 540, 960)
    assert rows["DeepSeek-V3 (671B-A37B)"]["packed_bytes"] == 58 * 8  # 8 bits: packing = uint8
    assert rows["Qwen3-30B-A3B"]["packed_bytes"] == 48 * 8 * 7 / 8
    assert rows["Qwen3-235B-A22B"]["packed_bytes"] == 94 * 8 * 7 / 8
    assert set(rows) == set(PAPER_MODELS)
    assert trace_size_row("x", 4, 2, 8)["smallest_int_bytes"] == 8
