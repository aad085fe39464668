"""benchmarks/bench_experts.py on a tiny random-init model: it runs both sides and finds them bit-identical."""
from __future__ import annotations

import json

from tests_helpers import load_script


def test_bench_experts_compares_both_forwards(tmp_path):
    bench = load_script("benchmarks/bench_experts.py", "_bench_experts")
    result = bench.main(["--rounds", "1", "--out", str(tmp_path), "warm_start.enabled=false", "model.init_std=0.1",
                         "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
                         "trainer.micro_batch_size=4", "data.train_size=64", "data.test_size=8"])
    assert result["identical"] == {"logprobs": True, "gradients": True}
    assert result["rows"] == 4 and result["ratio"] > 0
    assert json.loads((tmp_path / "bench_experts.json").read_text())["identical"]["gradients"] is True
