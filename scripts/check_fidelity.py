"""Does a new execution path reproduce experiment 07's recorded science, seed for seed?

    python scripts/check_fidelity.py rollout.path=static [--seeds 3] [--jobs 1] [--runs runs/fidelity]
        [--recorded results/runs] [--out results/fidelity] [--compare-only]

A path that is not bit-identical to the recorded one (say a compiled static-shape rollout) is its own run
identity; before anything is recorded with it, it must give the same *science* as the recorded runs.
This script runs the cells that carry experiment 07's verdicts on the new path -- the fp32 control, and
the uncorrected baseline at the fp8 and nvfp4 rungs (the control has no rung: its rollout is fp32 at every
rung), 3 seeds each -- and compares each cell with the recorded runs of ``results/runs/07_dose_threshold``.

Resumable: the runs go through ``scripts/sweep.py`` into ``--runs`` (one thread each, ``--jobs`` at a
time): a finished run is skipped, an interrupted one resumes from its checkpoint. ``--compare-only``
compares what is there (cells with fewer than 2 finished seeds are shown as pending).

The rule, fixed before any run on a new path is read: per cell, for each measure below, the seed interval
(min..max over the seeds, moerl.analysis.verdicts.seed_interval, as 07's verdicts use) on the new path
overlaps the recorded one's:
- ``mismatch/k3``, run median per seed (the dose);
- the re-routing share ``routing/any_layer_differs``, run median per seed;
- held-out pass@1 at every evaluated step (the trajectory, fp32 evaluator);
and the number of collapsed seeds (moerl.analysis.collapse) is the same, with the collapse steps listed.
The fp32 control has no mismatch to measure: its k3 is rounding noise (~1e-13) that any reordering of
fp32 sums moves, so there the rule is that k3 stays below ``CONTROL_K3_CEILING`` on both sides.
The path passes when every cell and measure does. Writes ``<out>/<label>.md`` (the table) and
``<out>/<label>.json``, label = the overrides joined.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from moerl.analysis.dose import EXPERIMENT, load_runs  # noqa: E402
from moerl.analysis.verdicts import seed_interval  # noqa: E402
from moerl.tracking import read_metrics  # noqa: E402

EXPERIMENT_DIR = REPO / "experiments" / EXPERIMENT
CELLS = (("fp32_control", "fp32"), ("baseline", "fp8"), ("baseline", "nvfp4"))
MEASURES = (("k3_median", "k3 (run median)"), ("any_layer_differs", "re-routing share (run median)"))
CONTROL_K3_CEILING = 1e-6  # the fp32 control's k3: fp32 rounding noise, not a dose


def overlap(a: tuple[float, float] | None, b: tuple[float, float] | None) -> bool | None:
    if a is None or b is None:
        return None
    return a[0] <= b[1] and b[0] <= a[1]


def pass1_trajectory(run_dir: str) -> dict[int, float]:
    return {int(r["step"]): float(r["eval/pass1"]) for r in read_metrics(Path(run_dir) / "metrics.jsonl")
            if "eval/pass1" in r}


def cell_runs(root: Path, arm: str, rung: str, finished_steps: int | None = None) -> list[dict]:
    """The runs of one cell under ``root`` (finished ones: as many steps as planned), by seed."""
    runs = [r for r in load_runs(root) if r["arm"] == arm and r["rung"] == rung
            and r["steps"] == r["steps_planned"]]
    return sorted(runs, key=lambda r: r["seed"])


def compare_cell(recorded: list[dict], new: list[dict], control: bool = False) -> dict:
    """Per measure: both sides' per-seed values, their intervals and whether they overlap (for the
    control's k3: whether both stay under CONTROL_K3_CEILING)."""
    out = {"seeds_recorded": [r["seed"] for r in recorded], "seeds_new": [r["seed"] for r in new], "rows": []}
    for key, label in MEASURES:
        a, b = [r[key] for r in recorded], [r[key] for r in new]
        ia, ib = seed_interval(a), seed_interval(b)
        agree = overlap(ia, ib)
        if control and key == "k3_median" and ia is not None and ib is not None:
            label, agree = f"{label} < {CONTROL_K3_CEILING:g} (no mismatch)", max(ia[1], ib[1]) < CONTROL_K3_CEILING
        out["rows"].append({"measure": label, "recorded": a, "new": b, "recorded_ci": ia, "new_ci": ib,
                            "overlap": agree})
    traj_a = [pass1_trajectory(r["run_dir"]) for r in recorded]
    traj_b = [pass1_trajectory(r["run_dir"]) for r in new]
    steps = sorted(set.intersection(*(set(t) for t in traj_a + traj_b))) if traj_a and traj_b else []
    for step in steps:
        a, b = [t[step] for t in traj_a], [t[step] for t in traj_b]
        ia, ib = seed_interval(a), seed_interval(b)
        out["rows"].append({"measure": f"pass@1 at step {step}", "recorded": a, "new": b, "recorded_ci": ia,
                            "new_ci": ib, "overlap": overlap(ia, ib)})
    ca, cb = [r["collapse_step"] for r in recorded], [r["collapse_step"] for r in new]
    same_count = sum(c is not None for c in ca) == sum(c is not None for c in cb)
    out["rows"].append({"measure": "collapsed seeds (steps)", "recorded": ca, "new": cb, "recorded_ci": None,
                        "new_ci": None, "overlap": same_count if recorded and new else None})
    out["passed"] = (len(new) >= 2 and len(recorded) >= 2 and all(r["overlap"] for r in out["rows"]))
    return out


def _fmt(values: list, ci) -> str:
    vals = ", ".join("-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v)) for v in values)
    return f"[{vals}]" + (f" ({ci[0]:.4g}..{ci[1]:.4g})" if ci else "")


def table(label: str, cells: dict[str, dict]) -> str:
    lines = [f"# Fidelity of `{label}` against the recorded runs of experiment 07",
             "", "Written by `python scripts/check_fidelity.py " + label.replace(",", " ") + "`. Rule (fixed "
             "before the runs): per cell and measure, the seed intervals (min..max over seeds) overlap, and "
             "the same number of seeds collapse.", "",
             "| cell | measure | recorded (per seed) | new path (per seed) | overlap |", "|---|---|---|---|---|"]
    for name, cell in cells.items():
        if cell.get("pending"):
            lines.append(f"| {name} | (pending: {cell['pending']}) | | | |")
            continue
        for row in cell["rows"]:
            verdict = {True: "yes", False: "**no**", None: "-"}[row["overlap"]]
            lines.append(f"| {name} | {row['measure']} | {_fmt(row['recorded'], row['recorded_ci'])} | "
                         f"{_fmt(row['new'], row['new_ci'])} | {verdict} |")
    passed = all(c.get("passed") for c in cells.values())
    lines += ["", f"**Fidelity check: {'passed' if passed else 'not passed'}** "
                  f"({sum(bool(c.get('passed')) for c in cells.values())} of {len(cells)} cells)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="+", help="the new path, e.g. rollout.path=static")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--runs", default="runs/fidelity", help="where the new path's runs go (resumable)")
    ap.add_argument("--recorded", default="results/runs")
    ap.add_argument("--out", default="results/fidelity")
    ap.add_argument("--compare-only", action="store_true", help="compare what is there; start no run")
    args = ap.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o or o.startswith("rollout.dtype=")]
    if bad:
        ap.error(f"overrides must be key=value and must not set rollout.dtype (the cells do): {bad}")
    label = ",".join(args.overrides)
    runs_root = Path(args.runs) / label.replace("/", "_")
    if not args.compare_only:
        for arm, rung in CELLS:
            rung_override = [] if arm == "fp32_control" else [f"rollout.dtype={rung}"]
            cmd = [sys.executable, str(REPO / "scripts" / "sweep.py"), str(EXPERIMENT_DIR), "--arms", arm,
                   "--seeds", str(args.seeds), "--jobs", str(args.jobs), "--threads", "1",
                   "--output-dir", str(runs_root), *rung_override, *args.overrides]
            print(" ".join(cmd[1:]), flush=True)
            subprocess.run(cmd, check=True)
    cells = {}
    for arm, rung in CELLS:
        recorded = cell_runs(Path(args.recorded), arm, rung)
        new = cell_runs(runs_root, arm, rung)
        name = f"{arm} @ {rung}"
        if len(new) < 2:
            cells[name] = {"pending": f"{len(new)} finished seed(s) under {runs_root}"}
            continue
        cells[name] = compare_cell(recorded, new, control=arm == "fp32_control")
    text = table(label, cells)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{label}.md").write_text(text)
    (out / f"{label}.json").write_text(json.dumps({"overrides": args.overrides, "runs": str(runs_root),
                                                   "cells": cells}, indent=1, default=str))
    print(text)
    return 0 if all(c.get("passed") for c in cells.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
