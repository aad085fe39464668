"""Compare runs: k3, reward, held-out pass@1, clip fraction and importance weights of each run overlaid in
one figure, and one table row per run.

    python scripts/compare_runs.py RUN_DIR RUN_DIR [...]                   # two (or more) run directories
    python scripts/compare_runs.py 'runs/00_tiny_moe_cpu/*/seed0'           # a glob (quoted or expanded)
    python scripts/compare_runs.py results/runs/00_tiny_moe_cpu baseline r3 # an experiment's arms, every seed
    python scripts/compare_runs.py ... --out runs/compare.png                # where the figure goes

A path may be a run directory (it holds metrics.jsonl), an arm's directory (its seeds) or an experiment's
(its arms); names after an experiment's directory pick its arms (an arm's former name picks its current
one). Smoke runs (a ``smoke`` folder on the path) are left out unless a path names one. Writes the figure
(default ``runs/compare_runs.png``) and prints the table; runs that logged none of a quantity show n/a.
"""
from __future__ import annotations

import argparse
import glob
import statistics
import sys
from pathlib import Path

from moerl.tracking import read_metrics

REPO = Path(__file__).resolve().parents[1]

# (metric key, panel title): what the figure overlays, one panel per quantity.
PANELS = [("mismatch/k3", "k3 (trainer vs rollout)"), ("reward/mean", "reward (training batch)"),
          ("eval/pass1", "held-out pass@1"), ("clip/frac", "clipped token fraction"),
          ("is/p99", "importance weight, p1 and p99")]


def _is_smoke(path: Path) -> bool:
    return "smoke" in path.parts


def find_runs(paths: list[str]) -> tuple[list[Path], list[str]]:
    """The run directories the paths name (globs expanded, folders searched), and the arm names given
    after an experiment's directory."""
    runs: list[Path] = []
    arms: list[str] = []
    for given in paths:
        matches = sorted(glob.glob(given)) if any(c in given for c in "*?[") else [given]
        if not matches or not Path(matches[0]).exists():
            if runs and "/" not in given and not any(c in given for c in "*?["):
                arms.append(given)  # an arm of the experiment named before it
                continue
            raise SystemExit(f"compare_runs: {given}: no such run directory (expected a folder holding "
                             "metrics.jsonl, or an arm's or experiment's folder)")
        for match in map(Path, matches):
            named_smoke = _is_smoke(match)
            found = [match] if (match / "metrics.jsonl").exists() else \
                sorted(p.parent for p in match.rglob("metrics.jsonl"))
            runs += [r for r in found if named_smoke or not _is_smoke(r.relative_to(match.parent))]
    runs = list(dict.fromkeys(runs))
    if not runs:
        raise SystemExit(f"compare_runs: no runs (metrics.jsonl) under {' '.join(paths)} (smoke runs are left out "
                         "unless a path names one)")
    return runs, arms


def filter_arms(runs: list[Path], arms: list[str]) -> list[Path]:
    """The runs of the named arms (seed directories' parents), each arm's former name mapped to its current one."""
    if not arms:
        return runs
    from moerl.config import current_arm

    wanted = {current_arm(r.parent.parent.name, a) for r in runs[:1] for a in arms}
    kept = [r for r in runs if r.parent.name.split("+")[0] in wanted or r.parent.name in wanted]
    missing = sorted(wanted - {r.parent.name for r in kept} - {r.parent.name.split("+")[0] for r in kept})
    if missing:
        raise SystemExit(f"compare_runs: no run for arm(s) {missing} (found: {sorted({r.parent.name for r in runs})})")
    return kept


def label(run: Path, runs: list[Path]) -> str:
    """The run's path after the part every compared run shares (at least arm/seed)."""
    import os

    parts = [Path(os.path.relpath(r.resolve())).parts for r in runs]
    common = 0
    while all(len(p) > common + 2 for p in parts) and len({p[common] for p in parts}) == 1:
        common += 1
    return "/".join(Path(os.path.relpath(run.resolve())).parts[common:])


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def summary_row(rows: list[dict]) -> dict[str, float | None]:
    """The table's columns for one run (None where the run logged none of it)."""
    def values(key: str, train_only: bool = True) -> list[float]:
        return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))
                and (not train_only or "reward/mean" in r)]

    def median(key: str) -> float | None:
        v = values(key)
        return statistics.median(v) if v else None

    reward = values("reward/mean")
    evals = sorted(((int(r["step"]), float(r["eval/pass1"])) for r in rows
                    if isinstance(r.get("eval/pass1"), (int, float))))
    return {"steps": max((int(r["step"]) for r in rows), default=0),
            "k3 (median)": median("mismatch/k3"),
            "reward, last 10": statistics.fmean(reward[-10:]) if reward else None,
            "pass@1 start": evals[0][1] if evals else None,
            "pass@1 end": evals[-1][1] if len(evals) > 1 else None,
            "clip fraction (median)": median("clip/frac"),
            "IS p99 (median)": median("is/p99")}


def _fmt(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3g}" if abs(value) < 1e-2 and value != 0 else f"{value:.3f}"


def table(runs: list[Path], metrics: dict[Path, list[dict]]) -> str:
    rows = {label(r, runs): summary_row(metrics[r]) for r in runs}
    cols = list(next(iter(rows.values())))
    lines = ["| run | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(_fmt(v[c]) for c in cols) + " |" for name, v in rows.items()]
    return "\n".join(lines)


def figure(runs: list[Path], metrics: dict[Path, list[dict]], out: Path) -> Path:
    from moerl.analysis.figure_style import add_caption, arm_style, plt, save

    fig, axes = plt.subplots(1, len(PANELS), figsize=(3.3 * len(PANELS), 3.3))
    arms = [r.parent.name for r in runs]
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        rows, name = metrics[run], label(run, runs)
        # one colour per arm where each run is another arm, else one per run (seeds, or a re-run beside its recording)
        color = arm_style(arms[i])["color"] if len(set(arms)) == len(arms) else cycle[i % len(cycle)]
        for ax, (key, title) in zip(axes, PANELS):
            steps, values = series(rows, key)
            if not steps:
                continue
            marker = {"marker": "o", "markersize": 3} if key == "eval/pass1" else {}
            ax.plot(steps, values, label=name, lw=1.1, color=color, **marker)
            if key == "is/p99":
                low_steps, low = series(rows, "is/p1")
                ax.plot(low_steps, low, lw=1.0, ls=":", color=color)
    for ax, (key, title) in zip(axes, PANELS):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        if key == "mismatch/k3" and ax.lines:
            ax.set_yscale("log")
    axes[-1].axhline(1.0, color="grey", lw=0.8)
    handles, labels = max((ax.get_legend_handles_labels() for ax in axes), key=lambda hl: len(hl[1]))
    ncol = min(3, max(len(labels), 1))
    rows_of_legend = -(-len(labels) // ncol)
    top = 1 - 0.07 * rows_of_legend - 0.02
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.legend(handles, labels, loc="upper center", ncol=ncol, fontsize=8, frameon=False, bbox_to_anchor=(0.5, 1.0))
    add_caption(fig, "One line per run. k3 = exp(d) - 1 - d, d = log pi_trainer - log pi_rollout, token mean per "
                     "step (log scale). IS weights: p99 solid, p1 dotted, per step.")
    return save(fig, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="run, arm or experiment directories, globs, or arm names after "
                                             "an experiment's directory")
    ap.add_argument("--out", default=str(REPO / "runs" / "compare_runs.png"), help="the figure (PNG)")
    args = ap.parse_args(argv)
    runs, arms = find_runs(args.paths)
    runs = filter_arms(runs, arms)
    metrics = {r: read_metrics(r / "metrics.jsonl") for r in runs}
    print(table(runs, metrics))
    print(f"figure: {figure(runs, metrics, Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
