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

from moerl.config import load_config  # noqa: E402
from moerl.analysis.routing_geometry import measure  # noqa: E402
from moerl.trainer.grpo import check_splits  # noqa: E402
from moerl.trainer.warm_start import load_warm_start, warm_start_dir  # noqa: E402

ARM = ROOT / "experiments/07_dose_threshold/arms/baseline.yaml"
RUNGS = ("bf16", "int8", "fp8", "nvfp4", "int4")
FOUR_BIT = ("nvfp4", "int4")


def table_lines(points: dict[str, dict]) -> list[str]:
    """The rungs ordered by the k3 each gives (the README's table)."""
    layers = "/".join(sorted({str(len(p["moe_layers"])) for p in points.values()}))
    lines = [f"| rung | k3 | k3 with R3 | tokens re-routed in ≥ 1 of {layers} MoE layers | mean per-layer flip | F(2) | "
             "F(2) with R3 |", "|---|---|---|---|---|---|---|"]
    for rung in sorted(points, key=lambda r: points[r]["native/k3"]):
        p = points[rung]
        lines.append(f"| {rung} | {p['native/k3']:.2e} | {p['r3/k3']:.2e} | {p['all/share']:.3f} "
                     f"[{p['all/share_lo']:.3f}, {p['all/share_hi']:.3f}] | {p['all/p_mean']:.3f} | "
                     f"{p['native/extreme_gt2']:.4f} | {p['r3/extreme_gt2']:.4f} |")
    return lines


def summary_line(points: dict[str, dict]) -> str:
    """The ladder's order and spans, and the share of k3 R3 removes at 8-16 bits and at 4 bits."""
    order = sorted(points, key=lambda r: points[r]["native/k3"])
    k3 = [points[r]["native/k3"] for r in order]
    share = [points[r]["all/share"] for r in order]

    def removed(rungs: list[str]) -> str:
        cut = sorted(100 * (1 - points[r]["r3/k3"] / points[r]["native/k3"]) for r in rungs if r in points)
        return f"{cut[0]:.0f}–{cut[-1]:.0f} %" if cut else "—"

    four_bit = [r for r in order if r in FOUR_BIT]
    wide = [r for r in order if r not in four_bit]
    return (f"Ordered by k3, the ladder is {' < '.join(order)}: a {max(k3) / min(k3):.0f}× span in k3 and "
            f"{max(share) / min(share):.1f}× in re-routing; the 4-bit formats re-route "
            f"{100 * min(points[r]['all/share'] for r in four_bit):.0f}–{100 * max(points[r]['all/share'] for r in four_bit):.0f} % "
            f"of the tokens. R3 removes {removed(wide)} of k3 at 8 and 16 bits and {removed(four_bit)} at 4 bits.")


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
    print("\n".join(table_lines(points)) + "\n\n" + summary_line(points))


if __name__ == "__main__":
    main()
