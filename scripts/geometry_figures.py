"""Experiment 06's figures, fit and RESULTS section from the point JSONs (results/geometry/*.json).

    python scripts/geometry_figures.py [--points results/geometry] [--figures results/figures]

Writes results/figures/06_routing_geometry_{ladders,state_cluster}.png, results/geometry/summary.md
(the tables, the fit and the claims) and replaces the experiment-06 section of results/RESULTS.md
(between its markers; appended when absent).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from moerl.geometry_report import (BASE, FACTORS, PAPER_SHARE, figure_ladders, figure_state_cluster, fits, ladder,
                                   load_points, predictions)

BEGIN, END = "<!-- experiment 06: begin (scripts/geometry_figures.py) -->", "<!-- experiment 06: end -->"


def pct(x, lo=None, hi=None) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{100 * x:.1f} %" + (f" [{100 * lo:.1f}, {100 * hi:.1f}]" if lo is not None else "")


def points_table(df) -> list[str]:
    lines = ["| point | state | rollout | MoE layers x experts, top-k | hidden | tokens (seqs) | mean p_l | "
             ">= 1 layer differs [95 % CI] | independence 1-prod(1-p_l) | k3 | k3 with R3 | F(2) | F(2) with R3 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in df.sort_values(["point", "rollout"]).iterrows():
        lines.append(f"| {r.point} | {r.state} | {r.rollout} | {r.L} x {r.E}, top-{r.k} | {r.H} | {r.tokens:.0f} "
                     f"({r.seqs:.0f}) | {r.p_mean:.4f} | {pct(r.share, r.share_lo, r.share_hi)} | "
                     f"{pct(r.independence)} | {r.k3:.2e} | {r.k3_r3:.2e} | {r.F2:.4f} | {r.F2_r3:.4f} |")
    return lines


def fit_lines(df) -> list[str]:
    fitted = fits(df)
    lines = ["| ladder | points | slope b in p ~ x^b | ± s.e. | residual s.d. (log p) |", "|---|---|---|---|---|"]
    for name, f in fitted.items():
        xs = ", ".join(str(int(v)) for v in ladder(df, name)[FACTORS[name]])
        lines.append(f"| {name} | {xs} | {f['b']:+.3f} | {math.sqrt(f['cov'][1][1]):.3f} | {f['s']:.3f} |")
    return lines


def prediction_lines(preds) -> list[str]:
    def cell(r, prefix):
        if f"{prefix}_share" not in r or r[f"{prefix}_share"] != r[f"{prefix}_share"]:
            return "n/a"
        text = f"{pct(r[f'{prefix}_share'], r[f'{prefix}_share_lo'], r[f'{prefix}_share_hi'])} (p_l {r[f'{prefix}_p']:.3g})"
        missing = r.get(f"{prefix}_missing")
        return text + (f"; no {missing} ladder: held at the anchor" if isinstance(missing, str) and missing else "")

    lines = ["| model | real geometry (MoE layers x experts, top-k, hidden) | measured at h64 (random init) | "
             "fit from random init, h64 | fit from random init, real width | fit from trained exp-05 routers, "
             "real width |", "|---|---|---|---|---|---|"]
    for _, r in preds.iterrows():
        meas = pct(r.get("measured_share"), r.get("measured_lo"), r.get("measured_hi")) \
            if "measured_share" in r and r.measured_share == r.measured_share else "not measured"
        lines.append(f"| {r.model} | {r.L} x {r.E}, top-{r.k}, {r.H} | {meas} | {cell(r, 'random_cpu')} | "
                     f"{cell(r, 'random_real')} | {cell(r, 'trained_real')} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="results/geometry")
    ap.add_argument("--figures", default="results/figures")
    ap.add_argument("--results", default="results/RESULTS.md")
    args = ap.parse_args()
    df = load_points(args.points)
    figs = Path(args.figures)
    figs.mkdir(parents=True, exist_ok=True)
    figure_ladders(df).savefig(figs / "06_routing_geometry_ladders.png", dpi=110, bbox_inches="tight")
    figure_state_cluster(df).savefig(figs / "06_routing_geometry_state_cluster.png", dpi=110, bbox_inches="tight")
    preds = predictions(df)
    body = ["### Measured points", "", *points_table(df), "", "### Fit (random-init routers, bf16 rollout)", "",
            f"Around the base ({BASE['L']} MoE layers x {BASE['E']} experts, top-{BASE['k']}, hidden {BASE['H']}): "
            "log p = log p_base + sum of b log(x / x_base), the >= 1 share by independence 1 - (1 - p)^L.", "",
            *fit_lines(df), "", "### Cluster geometries", "", *prediction_lines(preds), "",
            f"Paper: {pct(PAPER_SHARE)} of tokens differ in >= 1 router on Qwen3-30B-A3B (R3 paper, arXiv 2510.11370)."]
    Path(args.points, "summary.md").write_text("\n".join(["# Experiment 06: routing geometry (generated)", "", *body]) + "\n")
    print("\n".join(body))


if __name__ == "__main__":
    main()
