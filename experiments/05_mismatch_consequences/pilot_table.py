"""Summarise pilot runs (one row per run directory) for the pilot table in README.md.

    python experiments/05_mismatch_consequences/pilot_table.py [--markdown] runs/pilots/<name> [...]
    python experiments/05_mismatch_consequences/pilot_table.py --markdown results/pilots/05_*   # recorded

Per run: steps, training reward as 25-step means, mean k3, tokens re-routed in any layer, grad-norm
median/max, non-finite updates, the collapse step (moerl.analysis.collapse) and the initial/final pass@1.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

from moerl.analysis.collapse import collapse_step
from moerl.tracking import read_metrics


def load_rows(run: Path) -> list[dict]:
    """A run directory's metrics rows: metrics.jsonl, or the gzipped copy kept in results/pilots."""
    if (run / "metrics.jsonl").exists():
        return read_metrics(run / "metrics.jsonl")
    with gzip.open(run / "metrics.jsonl.gz", "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def summarise(run: Path, name: str | None = None) -> dict:
    rows = load_rows(run)
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/pass1" in r]
    if not train:
        return {"run": name or run.name, "steps": 0}
    rewards = [r["reward/mean"] for r in train]

    def vals(key):
        return np.array([r[key] for r in train if isinstance(r.get(key), (int, float))], dtype=float)

    grad = vals("grad_norm")
    return {"run": name or run.name, "steps": len(train),
            "reward_blocks": [round(float(np.mean(rewards[i:i + 25])), 3) for i in range(0, len(rewards), 25)],
            "k3_mean": float(np.nanmean(vals("mismatch/k3"))),
            "any_layer_differs": float(np.nanmean(vals("routing/any_layer_differs"))),
            "extreme_gt2": float(np.nanmean(vals("mismatch/extreme_gt2"))),
            "grad_norm_median": float(np.nanmedian(grad)), "grad_norm_max": float(np.nanmax(grad)),
            "nonfinite_updates": int(vals("updates/skipped_nonfinite").sum()),
            "collapse_step": collapse_step(rows),
            "pass1_initial": evals[0].get("eval/pass1") if evals else None,
            "pass1_final": evals[-1].get("eval/pass1") if evals else None}


def markdown_row(s: dict) -> str:
    blocks = " → ".join(f"{x:.2f}" for x in s["reward_blocks"])
    collapse = "—" if s["collapse_step"] is None else str(s["collapse_step"])
    return (f"| {s['run']} | {s['steps']} | {blocks} | {s['k3_mean']:.1e} | {s['any_layer_differs']:.3f} | "
            f"{s['grad_norm_median']:.2f} / {s['grad_norm_max']:.1f} | {collapse} | "
            f"{s['pass1_initial']:.3f} → {s['pass1_final']:.3f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", action="store_true", help="a table row per run (default: a JSON object per run)")
    ap.add_argument("pilots", nargs="+", help="pilot directories, e.g. runs/pilots/<name> or results/pilots/05_*")
    args = ap.parse_args(argv)
    # every directory is checked before a row is printed: a mistyped one is named, not skipped in silence
    found = {arg: sorted(Path(arg).rglob("metrics.jsonl*")) for arg in args.pilots}
    for arg, metrics in found.items():
        if not metrics:
            sys.exit(f"pilot_table: {arg}: no metrics.jsonl or metrics.jsonl.gz under it (expected a pilot "
                     "directory written by pilots.sh, or an archived one in results/pilots/)")
    for arg, metrics in found.items():
        for path in metrics:
            s = summarise(path.parent, Path(arg).name)
            print(markdown_row(s) if args.markdown else json.dumps(s))


if __name__ == "__main__":
    main()
