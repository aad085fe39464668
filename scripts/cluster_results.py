"""The results table of a scale experiment (01-04) from its wandb runs, beside the paper's values.

    python scripts/cluster_results.py ENTITY/PROJECT --experiment 02_kimi_k2_lora_grpo_r3 [--last 20]

Loads the experiment's runs through wandb's public API (moerl.analysis.results.load_wandb_runs: verl's
metric names mapped to this repo's, runs keyed by the experiment / arm / seed the launcher logs as
wandb group and tags) and prints one Markdown row per quantity and arm: the paper's value and
source, and this run's value (mean over the last ``--last`` logged steps, mean ± std over seeds).
Paste the table into the experiment's README "Results" section. Needs network and a wandb login.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
import pandas as pd

from moerl.analysis.results import MissingRunError, load_wandb_runs, mean_std

# (label, metric, format, paper value, source) per quantity the READMEs compare with a paper.
QUANTITIES = [
    ("k3 KL, rollout vs trainer", "mismatch/k3", "{:.2e}",
     "1.5e-3 without R3, ≈7.5e-4 with R3 (Qwen3-30B-A3B)", "R3 paper, arXiv 2510.11370"),
    ("tokens with ratio > 2 or < 1/2", "mismatch/extreme_frac", "{:.2e}",
     "≈10× fewer with R3", "R3 paper"),
    ("max |p_trainer - p_rollout|", "mismatch/dp_max", "{:.3f}", "—", "—"),
    ("IS effective sample size", "is/ess", "{:.3f}", "—", "verl rollout_corr"),
    ("tokens masked by the correction", "mask/token_frac", "{:.4f}",
     "MIS/IcePop: grows until training halts", "Mind Lab R3 blog"),
    ("training reward", "reward/mean", "{:.3f}", "3/3 baseline runs collapsed, 0/3 with R3", "R3 paper"),
    ("held-out pass@1", "eval/pass1", "{:.3f}", "71.83 (R3) vs 62.23 (baseline), avg. score", "R3 paper"),
]


def table(df: pd.DataFrame, last: int) -> str:
    """Markdown: one row per (quantity, arm), the paper's value beside this run's."""
    lines = ["| quantity | arm | paper | source | this repo (last steps, mean ± std over seeds) |",
             "|---|---|---|---|---|"]
    for label, key, fmt, paper, source in QUANTITIES:
        for arm, sub in df.groupby("arm", sort=True):
            if key not in sub or sub[key].notna().sum() == 0:
                value = "not logged"
            else:
                per_seed = (sub.dropna(subset=[key]).sort_values("step").groupby("seed")[key]
                            .apply(lambda s: float(np.mean(s.to_numpy(dtype=float)[-last:]))))
                value = mean_std(per_seed.mean(), per_seed.std(), len(per_seed), fmt)
            lines.append(f"| {label} | {arm} | {paper} | {source} | {value} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, api=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("project", help="wandb ENTITY/PROJECT the launcher logged to")
    ap.add_argument("--experiment", required=True, help="e.g. 02_kimi_k2_lora_grpo_r3 (the runs' wandb group)")
    ap.add_argument("--last", type=int, default=20, help="steps at the end of each run to average")
    args = ap.parse_args(argv)
    try:
        df = load_wandb_runs(args.project, filters={"group": args.experiment}, api=api)
    except MissingRunError as err:
        sys.exit(f"cluster_results: {err}")
    text = table(df[df["experiment"] == args.experiment], args.last)
    print(text)
    return text


if __name__ == "__main__":
    main()
