"""docs/benchmarks.md's table reads the benchmarks' own JSON files: a figure, target or sameness check there
is the recording's, a missing recording is named, and a failed sameness check is shown, not hidden."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from moerl.analysis import benchmark_records

RESULTS = Path(__file__).resolve().parents[2] / "results"


def test_every_row_reads_a_recording_of_this_repository():
    table = benchmark_records.latest_table(RESULTS)
    rows = table.splitlines()[2:]
    assert len(rows) == len(benchmark_records.ROWS)
    assert "` absent)" not in table
    step = json.loads((RESULTS / "step" / "bench_step.json").read_text())
    assert f"**{step['speedup']:.2f}×**" in rows[0]


def test_a_missing_recording_is_named_not_an_error(tmp_path):
    table = benchmark_records.latest_table(tmp_path)
    assert table.count("not recorded (`results/") == len(benchmark_records.ROWS)
    assert "`results/step/bench_step.json` absent" in table
    assert "`results/bench/floor/bench_floor.json` absent" in table


def test_sides_that_computed_different_numbers_are_shown(tmp_path):
    (tmp_path / "step").mkdir()
    for name in ("bench_step.json", "bench_step_threads1.json"):
        record = json.loads((RESULTS / "step" / name).read_text())
        record["metrics_identical"] = name == "bench_step.json"
        (tmp_path / "step" / name).write_text(json.dumps(record))
    row = benchmark_records.row_step(tmp_path)
    assert row.same_numbers == "**no**"
    shutil.copytree(RESULTS / "bench" / "experts", tmp_path / "bench" / "experts")
    record = json.loads((tmp_path / "bench" / "experts" / "bench_experts.json").read_text())
    record["identical"]["gradients"] = False
    (tmp_path / "bench" / "experts" / "bench_experts.json").write_text(json.dumps(record))
    assert benchmark_records.row_experts(tmp_path).same_numbers.startswith("**differs**")


def test_a_target_set_after_a_recording_is_the_one_judged_and_both_are_named(tmp_path):
    # bench_peer.py's 07 target (0.4) postdates the 07 recording, which stores the generic 0.8
    assert benchmark_records._peer_target_now("experiments/07_dose_threshold/arms/baseline.yaml") == 0.4
    assert benchmark_records._peer_target_now("experiments/00_tiny_moe_cpu/arms/baseline.yaml") == 0.8
    record = json.loads((RESULTS / "peer" / "07" / "bench_peer.json").read_text())
    (tmp_path / "peer" / "07").mkdir(parents=True)
    (tmp_path / "peer" / "07" / "bench_peer.json").write_text(json.dumps({**record, "target": 0.8}))
    row = benchmark_records.row_peer(tmp_path, "07", "07's task", "experiments/07_dose_threshold/arms/baseline.yaml")
    assert row.target.startswith("≤ 0.4: ") and "records the earlier 0.8" in row.target
    # the command that writes the row's own file, in the venv that has TRL
    assert row.cells()[1] == ("`.venv-peer/bin/python benchmarks/bench_peer.py --threads 1 --structures matched "
                              "--rounds 6 --arm experiments/07_dose_threshold/arms/baseline.yaml --out results/peer/07`")
