"""Pick the two dose-matched formats of experiment 07's crossover at the warm start, before any of its runs:
the routed experts rounded coarsely enough to give the mismatch that attention-only int4 gives, and the
attention projections rounded finely enough to give the mismatch that experts-only int4 gives.

    .venv/bin/python experiments/07_dose_threshold/calibrate_crossover.py [--prompts 64] [--out results/07_dose_threshold]

The rule, fixed before anything is measured: every format below is measured as experiment 06 measures a
point (``moerl.analysis.routing_geometry.measure``: the engine samples each prompt 8 times at T = 1 from the
375-step warm start, the fp32 trainer scores the same tokens; the dose is the native k3). The references are
the two halves of the int4 rung (``int4_attention``, ``int4_experts``): the new formats stay on int4's grid
and change only its bit width, so the crossover changes the dose and the location and nothing else. For each
reference the candidate of the other location whose k3 is nearest in ratio (smallest |log k3 / k3_ref|) is
chosen. The prompts are a calibration set kept apart from the final evaluation: ``--prompts`` worked problems
that are in neither the training split nor the 256 held-out problems
(``moerl.data.synthetic.worked_calibration_rows``), so the held-out problems that score the crossover's runs
play no part in choosing its formats. Writes ``<out>/crossover_calibration.json`` (every measured point, the
choice and this command) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from moerl.analysis.routing_geometry import measure  # noqa: E402
from moerl.config import load_config  # noqa: E402
from moerl.data.synthetic import worked_calibration_rows  # noqa: E402
from moerl.trainer.grpo import check_splits  # noqa: E402
from moerl.trainer.warm_start import load_warm_start, warm_start_dir  # noqa: E402

ARM = ROOT / "experiments/07_dose_threshold/arms/baseline.yaml"
# reference -> the candidates that would give the other location the reference's dose
# (a first pass at 64 prompts with the bit widths alone chose int3_experts at 0.62x and int6_attention at
# 0.77x their references on 256 prompts; the narrow-range int3 and int5 in groups of 32 lie between)
MATCH = {"int4_attention": ("int3_experts", "int3n_experts", "int2_experts"),
         "int4_experts": ("int5_attention", "int5g32_attention", "int6_attention")}
KEPT = ("dtype", "native/k3", "r3/k3", "routing/any_layer_differs", "response_length_mean", "seconds")


def choose(points: dict[str, dict]) -> dict[str, dict]:
    """For each reference, the candidate whose native k3 is nearest the reference's in ratio."""
    chosen = {}
    for ref, candidates in MATCH.items():
        target = points[ref]["native/k3"]
        ratio = {c: points[c]["native/k3"] / target for c in candidates}
        best = min(candidates, key=lambda c: abs(math.log(ratio[c])))
        chosen[best] = {"matches": ref, "k3": points[best]["native/k3"], "target_k3": target,
                        "ratio": ratio[best], "candidates": ratio}
    return chosen


def table(points: dict[str, dict], chosen: dict[str, dict]) -> str:
    lines = ["| format | k3 at the warm start | routed differently (any layer) | role |", "|---|---|---|---|"]
    for name, p in points.items():
        role = ("reference" if name in MATCH else
                f"chosen: {chosen[name]['ratio']:.2f}x {chosen[name]['matches']}" if name in chosen else "candidate")
        lines.append(f"| {name} | {p['native/k3']:.2e} | {p['routing/any_layer_differs']:.3f} | {role} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", default="results/07_dose_threshold")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(ARM, ["threads=1"])
    policy, tokenizer, _ = load_warm_start(cfg, train_if_missing=False, progress=False)
    policy.eval()
    train, test = check_splits(cfg)
    rows = worked_calibration_rows(args.prompts, cfg.data.seed, train, test, cfg.data.max_a, cfg.data.max_bc)
    points = {}
    for name in [*MATCH, *(c for cs in MATCH.values() for c in cs)]:
        point = measure(policy, tokenizer, cfg, rows, dtype=name, seed=0)
        points[name] = {k: point[k] for k in KEPT}
        print(json.dumps(points[name]), flush=True)
    chosen = choose(points)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": "python " + " ".join([str(Path(sys.argv[0]).relative_to(ROOT)
                                                   if Path(sys.argv[0]).is_absolute() else sys.argv[0]),
                                                  *sys.argv[1:]]),
              "warm_start": warm_start_dir(cfg).name, "warm_start_steps": cfg.warm_start.steps,
              "calibration_set": {"prompts": len(rows), "samples_per_prompt": cfg.rollout.group_size,
                                  "drawn_by": "moerl.data.synthetic.worked_calibration_rows (in neither split)",
                                  "first": rows[0]["question"]},
              "rule": "for each reference, the candidate of the other location with the smallest |log(k3 / k3_ref)|",
              "points": points, "chosen": chosen}
    (out / "crossover_calibration.json").write_text(json.dumps(record, indent=1) + "\n")
    print("\n" + table(points, chosen))


if __name__ == "__main__":
    main()
