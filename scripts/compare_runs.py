"""Print the arms of an experiment side by side: accuracy before/after GRPO, mismatch, routing.

    python scripts/compare_runs.py results/runs/00_tiny_moe_cpu [arm ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from moerl.analysis.results import MissingRunError, load_summaries

COLUMNS = [
    ("arm", "arm", "{}"), ("seed", "seed", "{}"),
    ("initial_eval/eval/pass1", "pass@1 start", "{:.3f}"), ("final_eval/eval/pass1", "pass@1 end", "{:.3f}"),
    ("initial_eval/eval/greedy", "greedy start", "{:.3f}"), ("final_eval/eval/greedy", "greedy end", "{:.3f}"),
    ("mean/mismatch/k3", "k3 mean", "{:.2e}"), ("mean/mismatch/k3_max", "k3 max (mean)", "{:.2e}"),
    ("mean/routing/disagreement", "route disagree (mean over layers)", "{:.4f}"),
    ("mean/routing/any_layer_differs", "tokens re-routed in >= 1 layer", "{:.4f}"),
    # is/* is logged at the loss's level: per token, or per sequence for a sequence-level MIS arm
    ("cfg/is_level", "IS level", "{}"), ("mean/is/p99", "IS p99 (at that level)", "{:.3f}"),
    ("mean/time/step", "s/step", "{:.2f}"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment_dir")
    ap.add_argument("arms", nargs="*")
    args = ap.parse_args()
    root = Path(args.experiment_dir)
    try:
        df = load_summaries(root.parent, experiment=root.name)
    except MissingRunError as err:  # reported by name, not as a stack trace
        sys.exit(f"compare_runs: {err}")
    if df.empty:
        sys.exit(f"compare_runs: no finished runs (summary.json) under {root}")
    if args.arms:
        from moerl.config import current_arm

        args.arms = [current_arm(root.name, a) for a in args.arms]  # an arm's former name: its current one
        missing = [a for a in args.arms if a not in set(df["arm"])]
        if missing:
            sys.exit(f"compare_runs: no finished run for arm(s) {missing} under {root} "
                     f"(finished: {sorted(set(df['arm']))})")
        df = df[df["arm"].isin(args.arms)]
    cols = [c for c in COLUMNS if c[0] in df.columns]
    print(" | ".join(name for _, name, _ in cols))
    print(" | ".join("---" for _ in cols))
    for _, row in df.sort_values(["arm", "seed"]).iterrows():
        print(" | ".join("n/a" if pd.isna(row[key]) else fmt.format(row[key]) for key, _, fmt in cols))


if __name__ == "__main__":
    main()
