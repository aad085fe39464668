"""benchmarks/bench_replay.py: its default command runs (threads from the config, else the machine's)."""
from __future__ import annotations

import json

from tests_helpers import load_script


def test_components_run_with_the_configs_threads(tmp_path):
    bench = load_script("benchmarks/bench_replay.py", "_bench_replay")
    bench.main(["--repeats", "1", "--no-trainer", "--presets", "qwen3_moe", "--out", str(tmp_path)])
    overhead = json.loads((tmp_path / "overhead.json").read_text())
    assert isinstance(overhead["threads"], int) and overhead["threads"] >= 1
    assert "qwen3_moe" in overhead["mismatch_by_preset"]
