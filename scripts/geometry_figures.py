"""Experiment 06's figures, fit and RESULTS section from the point JSONs (results/geometry/*.json).

    python scripts/geometry_figures.py [--points results/geometry] [--figures results/figures]

Writes results/figures/06_routing_geometry_{ladders,router_state,cluster_extrapolation,flip_along_stack}.png,
results/geometry/summary.md
(the tables, the fit and the claims) and replaces the experiment-06 section of results/RESULTS.md
(between its markers; appended when absent). The tables and claims come from
moerl.analysis.geometry_claims, the fits and figures from moerl.analysis.geometry_report.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from moerl.analysis.geometry_claims import (claims_lines, fit_lines, gpu_width_lines, pct,  # noqa: E402
                                            points_table, prediction_lines)
from moerl.analysis.geometry_report import (BASE, PAPER_SHARE, figure_cluster_extrapolation,  # noqa: E402
                                            figure_flip_along_stack, figure_ladders, figure_router_state,
                                            load_points, predictions)
from moerl.analysis.results import write_marked_section  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="results/geometry")
    ap.add_argument("--figures", default="results/figures")
    ap.add_argument("--results", default="results/RESULTS.md")
    args = ap.parse_args()
    try:
        df = load_points(args.points)
    except FileNotFoundError as err:
        raise SystemExit(f"geometry_figures: {err}") from None
    figs = Path(args.figures)
    figs.mkdir(parents=True, exist_ok=True)
    figure_ladders(df).savefig(figs / "06_routing_geometry_ladders.png", dpi=110, bbox_inches="tight")
    for name, figure in (("router_state", figure_router_state), ("cluster_extrapolation", figure_cluster_extrapolation),
                         ("flip_along_stack", figure_flip_along_stack)):
        figure(df).savefig(figs / f"06_routing_geometry_{name}.png", dpi=110, bbox_inches="tight")
    preds = predictions(df)
    body = ["### Is the 94 % a geometry effect?", "", *claims_lines(df, preds), "",
            "![ladders](figures/06_routing_geometry_ladders.png)", "",
            "![does router state change the share?](figures/06_routing_geometry_router_state.png)", "",
            "![the cluster models' geometries, measured and extrapolated to their real width vs the paper's 94 %]"
            "(figures/06_routing_geometry_cluster_extrapolation.png)", "",
            "![the per-layer flip probability along the MoE stack]"
            "(figures/06_routing_geometry_flip_along_stack.png)", "",
            "### Measured points", "", *points_table(df), "", "### Fit (random-init routers, bf16 rollout)", "",
            f"Around the base ({BASE['L']} MoE layers x {BASE['E']} experts, top-{BASE['k']}, hidden {BASE['H']}): "
            "log p = log p_base + sum of b log(x / x_base), the >= 1 share by independence 1 - (1 - p)^L.", "",
            *fit_lines(df), "", "### Cluster geometries", "", *prediction_lines(preds), "",
            f"Paper: {pct(PAPER_SHARE)} of tokens differ in >= 1 router on Qwen3-30B-A3B (R3 paper, arXiv 2510.11370).",
            "", "### Trained routers at hidden 256-2048 on a GPU (`scripts/gpu_width_geometry.py`)", "",
            *gpu_width_lines(args.points), "",
            "![re-routed share against width, CPU and GPU points](geometry/gpu/gpu_width_share.png)"]
    Path(args.points, "summary.md").write_text("\n".join(["# Experiment 06: routing geometry (generated)", "",
                                                           *[b.replace("](figures/", "](../figures/").replace("](geometry/", "](") for b in body]]) + "\n")
    write_marked_section(args.results, "experiment 06", "scripts/geometry_figures.py", "\n".join([
        "## 06_routing_geometry", "",
        f"Written by `python scripts/geometry_figures.py` from the point JSONs in `{args.points}` "
        "(`experiments/06_routing_geometry/run.sh`); bf16 rollout with emulated kernels vs the fp32 "
        "trainer, one batch of 16 prompts x 8 samples per point, intervals resample sequences.", "", *body]))
    print("\n".join(body))


if __name__ == "__main__":
    main()
