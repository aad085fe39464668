"""benchmarks/bench_step.py: both sides step, log the same metrics, and the record is written."""
from __future__ import annotations

import json

from tests_helpers import load_script


def test_one_alternated_step_each_logs_identical_metrics(tmp_path):
    bench = load_script("benchmarks/bench_step.py", "_bench_step")
    result = bench.main(["--rounds", "1", "--warmup", "0", "--threads", "1", "--out", str(tmp_path),
                         "rollout.prompts_per_step=4", "rollout.group_size=2", "warm_start.steps=2",
                         f"warm_start.cache_dir={tmp_path / 'warm_start'}"])
    assert result["metrics_identical"], result["differing_steps"]
    record = json.loads((tmp_path / "bench_step_threads1.json").read_text())
    assert record["rounds"] == 1 and record["medians"]["before"]["time/wall"] > 0
