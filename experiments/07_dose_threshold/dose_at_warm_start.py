"""The dose each rung gives before any training: the mismatch between every low-precision rollout and the
fp32 trainer at experiment 07's warm start, measured as experiment 06 measures a point.

    .venv/bin/python experiments/07_dose_threshold/dose_at_warm_start.py [--prompts 64] [--out results/07_dose_threshold]

For each rung (bf16, int8, fp8, nvfp4, int4): the engine samples ``--prompts`` held-out prompts x 8 at
T = 1 and the fp32 trainer scores the same tokens natively and with the rollout's experts replayed (R3)
(moerl.analysis.routing_geometry.measure). Writes ``<out>/dose_at_warm_start.json`` and prints a table ordered by
k3: the order of the ladder by the mismatch each rung causes, measured, not assumed from bit width.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from moerl.analysis.dose_report import warm_start_dose_lines, warm_start_dose_summary  # noqa: E402
from moerl.analysis.routing_geometry import measure  # noqa: E402
from moerl.config import load_config  # noqa: E402
from moerl.trainer.grpo import check_splits  # noqa: E402
from moerl.trainer.warm_start import load_warm_start, warm_start_dir  # noqa: E402

ARM = ROOT / "experiments/07_dose_threshold/arms/baseline.yaml"
RUNGS = ("bf16", "int8", "fp8", "nvfp4", "int4")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", default="results/07_dose_threshold")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(ARM, ["threads=1"])
    policy, tokenizer, _ = load_warm_start(cfg, train_if_missing=False, progress=False)
    policy.eval()
    _, test_rows = check_splits(cfg)
    points = {rung: measure(policy, tokenizer, cfg, test_rows[: args.prompts], dtype=rung, seed=0) for rung in RUNGS}
    for point in points.values():  # which warm start was measured (base.yaml's at the time)
        point.update(warm_start=warm_start_dir(cfg).name, warm_start_steps=cfg.warm_start.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dose_at_warm_start.json").write_text(json.dumps(points, indent=1) + "\n")
    print("\n".join(warm_start_dose_lines(points)) + "\n\n" + warm_start_dose_summary(points))


if __name__ == "__main__":
    main()
