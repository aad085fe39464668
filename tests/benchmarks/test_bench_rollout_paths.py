"""benchmarks/bench_rollout_paths.py: its bit-identity check of two rollout batches."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from moerl.replay.trace import RoutingTrace
from moerl.rollout.batch import RolloutBatch
from tests_helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    return load_script("benchmarks/bench_rollout_paths.py", "_bench_rollout_paths")


def _batch() -> RolloutBatch:
    n, t = 2, 5
    indices = torch.tensor([0, 1], dtype=torch.uint8).expand(n, t, 1, 2).clone()
    trace = RoutingTrace(indices=indices, valid=torch.ones(n, t, dtype=torch.bool),
                         moe_layers=[0], num_experts=4, top_k=2)
    return RolloutBatch(input_ids=torch.arange(n * t).reshape(n, t), attention_mask=torch.ones(n, t),
                        response_mask=torch.ones(n, t, dtype=torch.bool), rollout_logprobs=torch.full((n, t), -0.5),
                        prompt_length=2, group=torch.zeros(n, dtype=torch.long), routing=trace)


def test_same_batch_names_what_differs():
    bench, a = _bench(), _batch()
    assert bench.same_batch(a, _batch()) == {"tokens": True, "logprobs": True, "routing": True}
    logp = a.rollout_logprobs.clone()
    logp[0, 3] = torch.nextafter(logp[0, 3], torch.tensor(0.0))  # one bit
    assert bench.same_batch(a, replace(a, rollout_logprobs=logp)) == {"tokens": True, "logprobs": False,
                                                                      "routing": True}
    shorter = a.select([0])
    assert bench.same_batch(a, shorter)["tokens"] is False
