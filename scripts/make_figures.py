"""Regenerate the figures of experiments 00 and 05 (every experiment with a figures.yaml) and of the
refit benchmark in results/figures/*.png from recorded runs (one command).

    python scripts/make_figures.py [--runs results/runs] [--out results/figures] [--refit results/refit]

Per experiment under --runs that has an ``experiments/<experiment>/figures.yaml``, one figure per
question of it (the arms it compares, the metrics it draws, its caption and a source's reference
line), the headline summary (run-median k3 relative to the same model family's baseline, per-layer
native vs replayed routing agreement), held-out accuracy gains, routing per layer and, where
samples/*.npz were saved, importance-weight histograms with each correction's cap or band, the
ratio's spread early vs late in training and the rollout-vs-trainer logprob scatter. An experiment
without a figures.yaml is skipped and named (06: scripts/geometry_figures.py; 07:
experiments/07_dose_threshold/report.py). Plus the refit figures (cost; bf16 drift; bytes at
scale) when --refit holds benchmarks/bench_refit.py's JSON.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moerl.analysis.figure_style import save
from moerl.analysis.plots import experiment_figures, load_questions
from moerl.analysis.refit_plots import refit_figures
from moerl.analysis.results import (MissingRunError, load_arm_configs, load_metrics, load_refit, load_summaries,
                           load_token_samples)


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="results/runs")
    ap.add_argument("--out", default="results/figures")
    ap.add_argument("--refit", default="results/refit", help="benchmarks/bench_refit.py output ('' to skip)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        df = load_metrics(args.runs)
        runs = load_summaries(args.runs)
    except MissingRunError as err:
        sys.exit(f"make_figures: {err}")
    # Finished runs only: a run still going (a sweep in progress) would draw a partial curve.
    done = set(zip(runs["experiment"], runs["arm"], runs["seed"]))
    df = df[[k in done for k in zip(df["experiment"], df["arm"], df["seed"])]]
    try:
        samples = load_token_samples(args.runs)
    except MissingRunError:
        samples = None
    paths = []
    for experiment in sorted(df["experiment"].unique()):
        if not load_questions(experiment):
            # Without questions every run would go into one figure; such an experiment draws its own
            # (experiment 07: experiments/07_dose_threshold/report.py).
            print(f"make_figures: skipping {experiment}: no experiments/{experiment}/figures.yaml")
            continue
        losses = {arm: cfg.get("loss", {}) for arm, cfg in load_arm_configs(args.runs, experiment).items()}
        paths += experiment_figures(df, experiment, out, runs=runs, samples=samples, losses=losses)
    if args.refit:
        try:
            benches = load_refit(args.refit)
        except MissingRunError as err:
            print(f"make_figures: skipping the refit figure: {err}")
            benches = {}
        for name, bench in benches.items():
            if "presets" in bench:  # refit_<name>.png: the cost; _drift, _at_scale: the other questions
                for question, fig in refit_figures(bench, name).items():
                    suffix = "" if question == "cost" else f"_{question}"
                    paths.append(save(fig, out / f"refit_{name}{suffix}.png"))
    for path in paths:
        print(f"wrote {path}")
    return paths


if __name__ == "__main__":
    main()
