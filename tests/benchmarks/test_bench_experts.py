"""benchmarks/bench_experts.py on a tiny random-init model: it runs both sides and finds them bit-identical."""
from __future__ import annotations

import json

import pytest

from tests_helpers import load_script


def test_bench_experts_compares_both_forwards(tmp_path):
    bench = load_script("benchmarks/bench_experts.py", "_bench_experts")
    result = bench.main(["--rounds", "1", "--out", str(tmp_path), "warm_start.enabled=false", "model.init_std=0.1",
                         "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
                         "trainer.micro_batch_size=4", "data.train_size=64", "data.test_size=8"])
    assert result["identical"] == {"logprobs": True, "gradients": True}
    assert result["rows"] == 4 and result["ratio"] > 0
    assert json.loads((tmp_path / "bench_experts.json").read_text())["identical"]["gradients"] is True


@pytest.mark.slow
def test_bench_experts_compiles_the_policy_and_measures_its_distance_from_eager(tmp_path):
    bench = load_script("benchmarks/bench_experts.py", "_bench_experts")
    result = bench.main(["--rounds", "1", "--compile", "--out", str(tmp_path), "warm_start.enabled=false",
                         "model.init_std=0.1", "model.num_layers=2", "rollout.prompts_per_step=2",
                         "rollout.group_size=2", "rollout.max_new_tokens=4", "trainer.micro_batch_size=4",
                         "data.train_size=64", "data.test_size=8"])
    compiled = result["compiled"]
    assert compiled["graphs"] >= 1 and compiled["graph_breaks"] == compiled["graphs"] - 1
    assert compiled["compile_seconds"] > 0 and compiled["ratio_to_eager"] > 0
    # a compiled product may reorder sums, never change the model: far below any mismatch the lab measures
    assert compiled["max_abs_logprob_difference"] < 1e-3 and compiled["max_relative_gradient_difference"] < 1e-2
    assert "moerl local + torch.compile" in result["median_s"]
    # the compiler's best case: the same model without LoRA is one graph, and it is timed eager and compiled
    plain = result["compiled_without_lora"]
    assert plain["graphs"] == 1 and plain["graph_breaks"] == 0 and plain["ratio_to_eager"] > 0
    assert {"no LoRA: eager", "no LoRA: torch.compile"} <= result["median_s"].keys()
