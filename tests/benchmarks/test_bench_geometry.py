"""benchmarks/bench_geometry.py: one measurement pass at a cluster routing geometry, timed by phase and
recorded in results/ with the machine's load beside it."""
from __future__ import annotations

import json

import pytest

from tests_helpers import load_script


@pytest.mark.slow
def test_a_pass_is_timed_by_phase_and_recorded(tmp_path):
    bench = load_script("benchmarks/bench_geometry.py", "_bench_geometry")
    record = bench.main(["--geometry", "moonlight_16b_a3b", "--prompts", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_geometry_moonlight_16b_a3b_h64.json").read_text())
    assert saved["moe_layers"] == 26 and saved["experts"] == 64 and saved["top_k"] == 6
    assert set(saved["seconds"]) == {"engine_build", "rollout", "trainer_native", "trainer_replay", "statistics"}
    # the phases are parts of the pass: they add up to it
    assert sum(saved["seconds"].values()) == pytest.approx(saved["pass_seconds"], rel=1e-9)
    assert saved["within_budget"] == (saved["pass_seconds"] <= saved["budget_seconds"])
    assert len(saved["load_average_1min"]) == 2 and saved["machine"]["torch_version"] == record["machine"]["torch_version"]
