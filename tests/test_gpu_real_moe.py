"""The prepared GPU check of experiment 08, rehearsed on the CPU at a tiny geometry: every part runs (checkpoint
written in the hub's format, probe, decode throughput, three GRPO steps of the r3 arm) and its record is written."""
from __future__ import annotations

import json
import subprocess
import sys


def test_gpu_real_moe_rehearses_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, "scripts/gpu_real_moe.py", "--device", "cpu", "--smoke", "--out",
                           str(tmp_path), "--prompts", "4", "--grpo-prompts", "2", "--max-new-tokens", "8"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "olmoe_tiny.json").read_text())
    assert set(record["probe"]["precisions"]) == {"bf16", "fp8", "nvfp4"}
    assert record["rollout"]["new_tokens"] == 4 * 8  # every sequence decoded to full length
    assert record["grpo"]["steps"] == 3 and record["grpo"]["replayed_agreement"] == [1.0, 1.0, 1.0]
    assert 0 < record["active_bytes_bf16"] < 2 * record["params"]
    assert (tmp_path / "olmoe_tiny_probe.png").exists()
