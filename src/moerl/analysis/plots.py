"""Figures from recorded runs (shared by scripts/make_figures.py and the notebooks).

One figure answers one question. The questions of an experiment, the arms each compares and the
metrics it draws live in ``experiments/<name>/figures.yaml`` (see :func:`load_questions`); every arm
keeps one colour in every figure (:func:`arm_color`; a run ``<arm>+<overrides>`` takes its arm's
colour and shows its rung or variant by line style and marker, :func:`arm_style`), and legends sit
outside the axes. Seeds are drawn as a band (min-max) around the mean over seeds.

This module draws metrics over training and the per-experiment summary; figures of per-token samples
live in :mod:`moerl.analysis.sample_plots`, of routing per layer in :mod:`moerl.analysis.routing_plots`,
of the refit benchmark in :mod:`moerl.analysis.refit_plots`, and the styling they share in
:mod:`moerl.analysis.figure_style`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.ticker
import numpy as np
import pandas as pd
import yaml

from moerl.analysis.figure_style import add_caption, arm_color, arm_style, plt, save
from moerl.analysis.routing_plots import routing_by_layer
from moerl.analysis.sample_plots import logprob_scatter, mis_caption, ratio_histograms, spread_over_training

REPO = Path(__file__).resolve().parents[3]

# Axis labels and scales of the metrics a figure may draw.
METRIC_LABELS = {
    "reward/mean": "training reward",
    "mismatch/k3": "k3 KL, rollout vs trainer",
    "mismatch/k3_max": "k3 KL, worst token",
    "mismatch/dp_max": "max |p_trainer - p_rollout|",
    "mismatch/extreme_frac": "extreme-token fraction",
    "routing/disagreement": "routing disagreement (mean over MoE layers)",
    "routing/replayed_agreement": "replayed agreement",
    "grad_norm": "gradient norm",
    "clip/frac": "PPO clip fraction",
    "is/p99": "IS weight p99",
    "is/truncated_frac": "TIS truncated fraction",
    "mask/token_frac": "masked token fraction",
    "effective/token_frac": "tokens with gradient",
    "routing/any_layer_differs": "tokens re-routed in >= 1 MoE layer",
    "routing/differing_layers_mean": "re-routed MoE layers per token",
    "routing/agreement": "routing agreement, native vs rollout\n(per layer, mean over MoE layers)",
    "routing/all_layers_agree": "tokens agreeing in all MoE layers",
    "reward/mixed_group_frac": "groups with mixed rewards (carry a gradient)",
    "refit/seconds": "refit seconds",
    "eval/pass1": "held-out pass@1 (T=1)",
    "eval/greedy": "held-out greedy accuracy",
}
LOG_METRICS = {"mismatch/k3", "mismatch/k3_max", "mismatch/dp_max", "mismatch/extreme_frac", "grad_norm",
               "refit/seconds"}

@dataclass
class Question:
    """One figure: ``title`` (the question), the ``arms`` it compares and the ``metrics`` it draws.
    ``kind``: ``curves`` (metrics over training; a reward panel marks each run's collapse step),
    ``tau_curve`` (the extreme-token curve F(tau) of each arm, from its ``mismatch/extreme_gt*``),
    ``relative`` (the first metric over training divided by the same family's baseline on the same
    seed, one panel per entry of ``panels``), ``difference`` (the first metric minus the
    ``reference`` arm's on the same seed, one panel per arm, the family baseline's difference drawn
    in every panel for comparison), ``shares`` (per arm, the mean over steps and seeds of each
    metric, a share of tokens: one bar panel per metric) or ``collapse`` (the collapse definition
    drawn: smoothed reward, its threshold and each run's collapse step, one panel per entry of
    ``panels``).
    ``caption``: a sentence under the figure (what it does not show, how to read it). ``paper``: a
    source's number to draw beside the runs, ``{value, label}`` (a horizontal line) or
    ``{scale, arms, label}`` (those arms' curve times ``scale``, e.g. 0.1 for "10x fewer")."""

    name: str
    title: str
    arms: list[str]
    metrics: list[str] = field(default_factory=lambda: ["reward/mean", "mismatch/k3", "routing/disagreement"])
    reference: str = "baseline"
    kind: str = "curves"
    caption: str = ""
    paper: list[dict] = field(default_factory=list)
    panels: list[dict] = field(default_factory=list)


QUESTION_KINDS = ("curves", "tau_curve", "relative", "difference", "shares", "collapse")


def load_questions(experiment: str, experiments_dir: str | Path | None = None) -> list[Question]:
    """The questions of ``experiments/<experiment>/figures.yaml``; none when the file is absent.
    Every entry needs name, title and arms; a missing key is named with the file."""
    path = Path(experiments_dir or REPO / "experiments") / experiment / "figures.yaml"
    if not path.exists():
        return []
    raw = yaml.safe_load(path.read_text()) or {}
    out = []
    for i, entry in enumerate(raw.get("questions", [])):
        missing = [k for k in ("name", "title", "arms") if k not in entry]
        if missing:
            raise ValueError(f"{path}: questions[{i}] lacks {missing} (expected name, title, arms[, metrics, reference])")
        unknown = set(entry) - {"name", "title", "arms", "metrics", "reference", "kind", "caption", "paper", "panels"}
        if unknown:
            raise ValueError(f"{path}: questions[{i}] has unknown key(s) {sorted(unknown)}")
        if entry.get("kind", "curves") not in QUESTION_KINDS:
            raise ValueError(f"{path}: questions[{i}].kind is {entry['kind']!r}, expected one of {QUESTION_KINDS}")
        out.append(Question(**entry))
    return out


def arm_order(arms, questions: list[Question]) -> list[str]:
    """Arms in question order (each arm where it first appears), then any others alphabetically."""
    present = set(arms)
    order = []
    for q in questions:
        order += [a for a in q.arms if a in present and a not in order]
    return order + sorted(present - set(order))


def _legend_outside(fig: plt.Figure, axes, arms: list[str] | None = None) -> None:
    handles, labels = {}, []
    for ax in np.ravel(axes):
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    if arms is not None:
        labels = [a for a in arms if a in handles] + [lab for lab in labels if lab not in arms]
    if labels:
        fig.legend([handles[lab] for lab in labels], labels, loc="center left", bbox_to_anchor=(1.0, 0.5),
                   fontsize=8, frameon=False)


def _log_or_symlog(ax, values: np.ndarray) -> None:
    """Log scale; symlog when some values are 0 (a log axis would drop them), linear below the
    smallest positive value."""
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    positive = v[v > 0]
    if v.size and (v <= 0).any() and positive.size:
        ax.set_yscale("symlog", linthresh=float(positive.min()))
        ax.set_ylim(bottom=0)
    else:
        ax.set_yscale("log")


def _band(ax, df: pd.DataFrame, key: str, label: str, smooth: int = 1, **kw):
    sub = df[["step", "seed", key]].dropna()
    if sub.empty:
        return
    wide = sub.pivot_table(index="step", columns="seed", values=key)
    if smooth > 1:
        wide = wide.rolling(smooth, min_periods=1).mean()
    mean = wide.mean(axis=1)
    line, = ax.plot(mean.index, mean.values, label=label, **kw)
    if wide.shape[1] > 1:
        ax.fill_between(wide.index, wide.min(axis=1), wide.max(axis=1), alpha=0.2, color=line.get_color())


def _collapse_marks(ax, df: pd.DataFrame, arm: str, smooth: int) -> None:
    """An x at each run's collapse step (moerl.analysis.collapse), on the arm's smoothed reward curve."""
    from moerl.analysis.collapse import collapse_step

    for _, run in df.groupby("seed"):
        run = run.sort_values("step")
        step = collapse_step(run.to_dict("records"))
        if step is not None:
            reward = run.set_index("step")["reward/mean"].rolling(smooth, min_periods=1).mean()
            ax.plot([step], [reward.get(step, np.nan)], marker="x", ms=9, mew=2.2, color=arm_color(arm),
                    ls="none", label="collapse step")


def curves(df: pd.DataFrame, panels: list[tuple[str, str]], title: str, smooth: int = 1,
           log_keys: tuple[str, ...] = (), arms: list[str] | None = None,
           paper: list[dict] | None = None) -> plt.Figure:
    """One panel per (metric key, panel title); one line (+ seed band) per arm, in the arm's fixed
    colour; ``arms`` selects and orders the arms (default: all, alphabetically). A training-reward
    panel marks each run that collapsed (moerl.analysis.collapse) with an x at its collapse step. A log
    panel with zeros is drawn symlog, so the zeros stay on the axis. ``paper``: horizontal lines
    ``{value, label}`` (a source's number)."""
    arms = arms or sorted(df["arm"].unique())
    df = df[df["arm"].isin(arms)]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(3.3 * len(panels), 5.0), 3.0), squeeze=False)
    for ax, (key, name) in zip(axes[0], panels):
        for arm in arms:
            sub = df[df["arm"] == arm]
            if key in sub:
                _band(ax, sub, key, arm, smooth=smooth, color=arm_color(arm), ls=arm_style(arm)["ls"], lw=1.4)
                if key == "reward/mean":
                    _collapse_marks(ax, sub, arm, smooth)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("GRPO step")
        for ref in paper or []:
            if "value" in ref:
                ax.axhline(ref["value"], color="k", lw=1.0, ls="-.", label=ref.get("label", "source"))
        if key in log_keys:
            _log_or_symlog(ax, df[key].to_numpy(dtype=float) if key in df else np.array([]))
        ax.grid(alpha=0.3)
    _legend_outside(fig, axes, arms)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def tau_curve(df: pd.DataFrame, title: str, arms: list[str] | None = None, paper: list[dict] | None = None) -> plt.Figure:
    """F(tau): the share of response tokens with max(rho, 1/rho) > tau, rho = pi_old / pi_rollout, per arm
    (mean over its steps, one point per seed and the mean over seeds as the line), on log-log axes.
    ``paper``: ``{scale, arms, label}`` draws those arms' curves times ``scale`` (a source's "10x
    fewer" is scale 0.1), dashed in the arm's colour."""
    keys = sorted((float(c.removeprefix("mismatch/extreme_gt")), c) for c in df.columns
                  if c.startswith("mismatch/extreme_gt"))
    if not keys:
        raise KeyError("no mismatch/extreme_gt* metric was recorded")
    arms = [a for a in (arms or sorted(df["arm"].unique())) if a in set(df["arm"])]
    taus = [t for t, _ in keys]
    fig, ax = plt.subplots(figsize=(5.2, 3.6))
    floor = None
    for arm in arms:
        per_seed = df[df["arm"] == arm].groupby("seed")[[c for _, c in keys]].mean()
        if per_seed.empty:
            continue
        mean = per_seed.mean(axis=0).values
        positive = per_seed.values[per_seed.values > 0]
        if positive.size:
            floor = positive.min() if floor is None else min(floor, positive.min())
        style = arm_style(arm)
        ax.plot(taus, mean, marker=style["marker"], ls=style["ls"], color=style["color"], label=arm, lw=1.5)
        for row in per_seed.values:
            ax.scatter(taus, row, s=8, color=arm_color(arm), alpha=0.45)
        for ref in paper or []:
            if "scale" in ref and arm in ref.get("arms", []):
                scaled = mean * float(ref["scale"])
                positive = scaled[scaled > 0]
                if positive.size:
                    floor = positive.min() if floor is None else min(floor, positive.min())
                ax.plot(taus, scaled, ls="--", lw=1.0, color=arm_color(arm),
                        label=f"{arm} × {float(ref['scale']):g}: {ref.get('label', 'source')}")
    ax.set_xscale("log")
    linthresh = (floor or 1e-6) / 2
    ax.set_yscale("symlog", linthresh=linthresh)  # an arm with no extreme token sits at 0
    ax.set_ylim(bottom=0)
    # 0, then powers of ten above the linear stretch only: a tick inside it would sit on top of 0's
    first = int(np.ceil(np.log10(linthresh)))
    ax.set_yticks([0.0] + [10.0 ** k for k in range(first, 1)])
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xticks(taus, [f"{t:g}" for t in taus])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("tau")
    ax.set_ylabel("F(tau) = share of tokens with\nmax(rho, 1/rho) > tau", fontsize=9)
    ax.grid(alpha=0.3)
    _legend_outside(fig, ax, arms)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _rolling_median(wide: pd.DataFrame, window: int) -> pd.DataFrame:
    return wide.rolling(window, min_periods=1).median() if window > 1 else wide


def _ratio_minor_label(value: float, _pos=None) -> str:
    """Minor ticks of a ratio axis labelled at 2, 3 and 5 times a power of ten only (0.5×, 2×, 3×):
    every minor tick labelled would collide near 1×."""
    if value <= 0:
        return ""
    mantissa = round(value / 10 ** np.floor(np.log10(value)), 6)
    return f"{value:g}×" if mantissa in (2.0, 3.0, 5.0) else ""


FLOOR_RATIO = 1e-3  # an arm below this fraction of its family baseline's k3 is at the numerical floor (fp32)


def relative_curves(df: pd.DataFrame, key: str, panels: list[dict], references: dict[str, str], title: str,
                    smooth: int = 20, caption: str = "") -> plt.Figure:
    """``key`` of each arm divided by that of its family's baseline (``references``: arm -> its
    reference arm) on the same seed, step by step, after a rolling median over ``smooth`` steps
    (per-step k3 is heavy-tailed); line = geometric mean over seeds, band = min-max. One panel per
    ``{title, arms}`` of ``panels``. An arm at the numerical floor (fp32 rollout, below FLOOR_RATIO
    of its baseline) is named in a note rather than drawn: it would stretch the axis by decades."""
    # Each panel its own ratio axis: a broken arm at 1000x would otherwise flatten the corrections near 1x.
    fig, axes = plt.subplots(1, len(panels), figsize=(max(4.3 * len(panels), 6.4), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        notes = []
        for arm in panel["arms"]:
            ref = references.get(arm)
            if ref is None or ref == arm or arm not in set(df["arm"]) or ref not in set(df["arm"]):
                continue
            a = _rolling_median(df[df["arm"] == arm].pivot_table(index="step", columns="seed", values=key), smooth)
            b = _rolling_median(df[df["arm"] == ref].pivot_table(index="step", columns="seed", values=key), smooth)
            seeds = [c for c in a.columns if c in b.columns]
            ratio = (a[seeds] / b[seeds]).replace([np.inf, -np.inf], np.nan)
            ratio = ratio.where(ratio > 0)
            if ratio.dropna(how="all").empty:
                continue
            center = np.exp(np.log(ratio).mean(axis=1))
            if float(center.median()) < FLOOR_RATIO:
                notes.append(f"{arm}: ~{float(center.median()):.0e}× {ref} (numerical floor, not drawn)")
                continue
            line, = ax.plot(center.index, center.values, color=arm_color(arm), ls=arm_style(arm)["ls"], lw=1.4,
                            label=f"{arm} / {ref}: {float(center.median()):.2g}× (median over steps)")
            if ratio.shape[1] > 1:
                ax.fill_between(ratio.index, ratio.min(axis=1), ratio.max(axis=1), color=line.get_color(), alpha=0.15)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}×"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FuncFormatter(_ratio_minor_label))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title(panel.get("title", ""), fontsize=9)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        low, high = ax.get_ylim()
        if high / max(low, 1e-300) > 100:  # over more than two decades the minor labels (0.2×, 0.3×, ...) collide
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        for note in notes:  # in the legend under the panel, not over the curves or past the axes
            ax.plot([], [], " ", label=note)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=1, frameon=False)
    axes[0][0].set_ylabel(f"{METRIC_LABELS.get(key, key)}\n÷ same family's baseline, same seed", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    add_caption(fig, caption or f"Each step: rolling median of {key} over {smooth} steps, divided by the family "
                "baseline's on the same seed; line = geometric mean over seeds, band = min-max over seeds.")
    return fig


def collapse_figure(df: pd.DataFrame, panels: list[dict], title: str, caption: str = "") -> plt.Figure:
    """The collapse definition (moerl.analysis.collapse) drawn per arm: the WINDOW-step mean training reward
    (line: mean over seeds, band: min-max over seeds), its threshold (dotted: FRACTION of the
    running peak, mean over seeds) and an x at each run's collapse step. fp32-rollout arms (no
    rollout mismatch) are dashed, so the controls read apart from the mismatched arms."""
    from moerl.analysis.collapse import FRACTION, WINDOW, collapse_step, rolling_mean

    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False, sharey=True)
    for ax, panel in zip(axes[0], panels):
        for arm in panel["arms"]:
            sub = df[df["arm"] == arm]
            if sub.empty:
                continue
            fp32 = "fp32" in arm
            smooth, thresh = {}, {}
            for seed, run in sub.groupby("seed"):
                run = run.sort_values("step")
                mean = pd.Series(rolling_mean(run["reward/mean"].to_numpy(dtype=float), WINDOW), index=run["step"])
                smooth[seed] = mean
                thresh[seed] = FRACTION * mean.cummax()
                step = collapse_step(run.to_dict("records"))
                if step is not None:
                    ax.plot([step], [mean.get(step, np.nan)], marker="x", ms=9, mew=2.2, color=arm_color(arm),
                            ls="none", label="_collapse")
            wide, lim = pd.DataFrame(smooth), pd.DataFrame(thresh)
            ax.plot(wide.index, wide.mean(axis=1), color=arm_color(arm), lw=2.0 if fp32 else 1.4,
                    ls="--" if fp32 else "-", label=arm)
            if wide.shape[1] > 1:
                ax.fill_between(wide.index, wide.min(axis=1), wide.max(axis=1), color=arm_color(arm), alpha=0.15)
            ax.plot(lim.index, lim.mean(axis=1), color=arm_color(arm), lw=0.9, ls=":")
        ax.set_title(panel.get("title", ""), fontsize=9)
        ax.set_xlabel("GRPO step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    axes[0][0].set_ylabel(f"training reward, {WINDOW}-step mean", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    add_caption(fig, caption or f"Line: {WINDOW}-step mean training reward, mean over seeds; band: min-max over seeds; "
                f"dotted: the collapse threshold, {FRACTION:g} × the running peak of the {WINDOW}-step mean (mean over "
                "seeds); x: a run's collapse step (below the threshold and never back above it). Dashed: fp32 "
                "rollout (no rollout mismatch).")
    return fig


def difference_curves(df: pd.DataFrame, key: str, arms: list[str], reference: str, title: str, smooth: int = 20,
                      compare: str = "baseline", caption: str = "") -> plt.Figure:
    """``key`` of each arm minus the ``reference`` arm's (a control) on the same seed, step by step,
    after a rolling mean over ``smooth`` steps: line = mean over seeds, band = min-max. One panel per
    arm (shared y), each with ``compare``'s difference in its colour, thin, so every arm reads
    against the uncorrected one without a tangle of overlapping bands."""
    present = set(df["arm"])
    shown = [a for a in arms if a in present and a != reference]
    if reference not in present or not shown:
        raise KeyError(f"difference figure: needs the reference arm {reference!r} and one of {arms} "
                       f"(recorded: {sorted(present)})")

    def diff(arm):
        wide = df[df["arm"] == arm].pivot_table(index="step", columns="seed", values=key)
        ref = df[df["arm"] == reference].pivot_table(index="step", columns="seed", values=key)
        seeds = [c for c in wide.columns if c in ref.columns]
        return (wide[seeds] - ref[seeds]).rolling(smooth, min_periods=1).mean()

    panels = [a for a in shown if a != compare] or shown
    fig, axes = plt.subplots(1, len(panels), figsize=(2.9 * len(panels) + 0.8, 3.2), squeeze=False, sharey=True)
    base = diff(compare) if compare in shown else None
    base_mean = float(base.mean(axis=1).mean()) if base is not None else None
    for ax, arm in zip(axes[0], panels):
        if base is not None and arm != compare:
            ax.plot(base.index, base.mean(axis=1), color=arm_color(compare), lw=1.0, label=f"{compare} − {reference}")
        d = diff(arm)
        ax.plot(d.index, d.mean(axis=1), color=arm_color(arm), lw=1.6, label=f"{arm} − {reference}")
        if d.shape[1] > 1:
            ax.fill_between(d.index, d.min(axis=1), d.max(axis=1), color=arm_color(arm), alpha=0.2, lw=0)
        ax.axhline(0, color="k", lw=0.8, ls="--")
        mean = float(d.mean(axis=1).mean())
        ax.set_title(f"{arm}: {mean:+.3f}" + (f" ({compare} {base_mean:+.3f})" if base_mean is not None
                                              and arm != compare else ""), fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.24), frameon=False)
    axes[0][0].set_ylabel(f"{METRIC_LABELS.get(key, key)}\nminus {reference}'s (same seed)", fontsize=9)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    add_caption(fig, caption or f"{key} minus {reference}'s on the same seed, rolling mean over {smooth} steps; line: "
                "mean over seeds, band: min-max over seeds; panel title: the mean of the line over training (and "
                f"{compare}'s).")
    return fig


def shares_figure(df: pd.DataFrame, arms: list[str], metrics: list[str], title: str, caption: str = "") -> plt.Figure:
    """Per arm (rows) and metric (panels), a share of response tokens: bar = mean over seeds of each
    run's mean over steps, dots = seeds, the value written beside the bar (a share of 0.005 % and
    one of 4 % both read)."""
    arms = [a for a in arms if a in set(df["arm"])]
    metrics = [m for m in metrics if m in df and df.loc[df["arm"].isin(arms), m].notna().any()]
    if not arms or not metrics:
        raise KeyError(f"shares figure: none of {metrics} recorded for {arms}")
    y = np.arange(len(arms))[::-1]
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.1 * len(metrics) + 1.0, 0.42 * len(arms) + 1.6),
                             squeeze=False, sharey=True)
    for ax, key in zip(axes[0], metrics):
        per_run = df[df["arm"].isin(arms)].groupby(["arm", "seed"])[key].mean()
        means = per_run.groupby("arm").mean().reindex(arms)
        ax.barh(y, means.values, color=[arm_color(a) for a in arms], height=0.65)
        for (arm, _), v in per_run.items():
            ax.plot([v], [y[arms.index(arm)]], "o", ms=3, color="k", alpha=0.6)
        top = float(np.nanmax(per_run.values)) if per_run.notna().any() else 1.0
        highest = per_run.groupby("arm").max().reindex(arms)
        for yy, v, h in zip(y, means.values, highest.values):
            if v == v:
                ax.text(max(v, h) + 0.03 * (top or 1), yy, f"{100 * v:.3g} %", va="center", fontsize=8)
        ax.set_xlim(0, (top or 1) * 1.4)
        ax.set_title(METRIC_LABELS.get(key, key), fontsize=10)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{100 * v:.3g} %"))
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(alpha=0.3, axis="x")
    axes[0][0].set_yticks(y, arms, fontsize=9)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    add_caption(fig, caption or "Bar: mean over seeds of each run's mean over training steps; dots: seeds.")
    return fig


def question_figure(df: pd.DataFrame, question: Question, smooth: int = 5,
                    references: dict[str, str] | None = None) -> plt.Figure:
    """The figure of one question: its metrics over training for its arms, its F(tau) curve, its
    metric relative to each family's baseline (``references``: arm -> baseline arm;
    moerl.analysis.results.family_references), or the collapse definition drawn."""
    panels_of = question.panels or [{"title": "", "arms": question.arms}]
    if question.kind == "tau_curve":
        fig = tau_curve(df, question.title, question.arms, paper=question.paper)
    elif question.kind == "relative":
        refs = references or {a: question.reference for a in question.arms}
        fig = relative_curves(df, question.metrics[0], panels_of, refs, question.title, caption=question.caption)
        return fig
    elif question.kind == "collapse":
        return collapse_figure(df, panels_of, question.title, caption=question.caption)
    elif question.kind == "difference":
        return difference_curves(df, question.metrics[0], question.arms, question.reference, question.title,
                                 caption=question.caption)
    elif question.kind == "shares":
        return shares_figure(df, question.arms, question.metrics, question.title, caption=question.caption)
    else:
        panels = [(k, METRIC_LABELS.get(k, k)) for k in question.metrics if k in df and df[k].notna().any()]
        if not panels:
            raise KeyError(f"question '{question.name}': none of its metrics {question.metrics} was recorded")
        fig = curves(df, panels, question.title, smooth=smooth, log_keys=tuple(LOG_METRICS),
                     arms=[a for a in question.arms if a in set(df["arm"])], paper=question.paper)
    add_caption(fig, question.caption)
    return fig


def _paired_ratio(runs: pd.DataFrame, key: str, reference: str | dict[str, str]) -> pd.DataFrame:
    """Per arm: the ratio of ``key`` to the reference arm's on the same seed (seeds share prompts
    and initial weights), mean and min/max over seeds. ``reference``: one arm for all, or arm ->
    its reference (moerl.analysis.results.family_references: each arm against its own family's baseline)."""
    vals = runs.assign(v=pd.to_numeric(runs[key], errors="coerce")).pivot_table(index="arm", columns="seed", values="v")
    refs = reference if isinstance(reference, dict) else {a: reference for a in vals.index}
    rows = {}
    for arm in vals.index:
        ref = refs.get(arm)
        if ref is None or ref not in vals.index:
            continue
        ratio = vals.loc[arm] / vals.loc[ref]
        rows[arm] = {"mean": ratio.mean(), "median": ratio.median(), "lo": ratio.min(), "hi": ratio.max(),
                     "n": int(ratio.notna().sum())}
    return pd.DataFrame.from_dict(rows, orient="index", columns=["mean", "median", "lo", "hi", "n"])


def summary_figure(runs: pd.DataFrame, title: str, questions: list[Question] | None = None,
                   reference: str = "baseline", k3_key: str = "mean/mismatch/k3",
                   references: dict[str, str] | None = None) -> plt.Figure:
    """The headline: how much does each arm change the mismatch? Left, k3 relative to its own model
    family's baseline on the same seed (bar = median over seeds, whisker = min-max; ``references``:
    arm -> baseline arm, default moerl.analysis.results.family_references); right, the share of tokens
    routed alike in every MoE layer (the README's and RESULTS.md's routing column), mean over seeds with
    their range, on an axis zoomed to the arms that agree and ending at 1 (an arm far below is labelled).
    Arms are grouped by family under a heading naming the family's baseline."""

    from moerl.analysis.results import family_references

    questions = questions or []
    arms = arm_order(runs["arm"].unique(), questions)
    if references is None:
        references = family_references(runs) or {a: reference for a in arms}
    presets = runs.groupby("arm")["cfg/preset"].first().to_dict() if "cfg/preset" in runs else {}
    groups: dict[str, list[str]] = {}
    for arm in arms:
        ref = references.get(arm, "")
        label = (f"{presets[arm]} preset: k3 ÷ {ref}" if arm in presets else f"k3 ÷ {ref}") if ref else "no reference"
        groups.setdefault(label, []).append(arm)
    rows: list[tuple[str, str]] = []
    for label, members in groups.items():
        rows.append(("header", label))
        rows += [("arm", a) for a in members]
    y = np.arange(len(rows))[::-1]
    pos = {name: yy for (kind, name), yy in zip(rows, y) if kind == "arm"}
    order = list(pos)
    fig, (ax_k3, ax_route) = plt.subplots(1, 2, figsize=(9.5, 0.3 * len(rows) + 2.0), sharey=True)
    # The median over seeds of the per-seed ratios: the statistic the claims table reports.
    ratio = _paired_ratio(runs, k3_key, references).reindex(order)
    ratio["mean"] = ratio["median"]
    # An arm with (near-)zero mismatch (the fp32 rollout) would stretch the log axis by many decades:
    # the axis covers the others and such an arm gets a note at the left edge instead of a bar.
    shown = ratio["mean"][(ratio["mean"] > 1e-3)]
    left = min(0.5, float(shown.min()) / 1.5) if not shown.empty else 0.1
    right = max(2.0, float(ratio["hi"][ratio["mean"] > 1e-3].max()) * 8) if not shown.empty else 10.0
    for arm in order:
        r = ratio.loc[arm]
        if not r["mean"] == r["mean"]:
            continue
        if arm == references.get(arm):
            ax_k3.text(left * 1.05, pos[arm], "reference (1×)", va="center", fontsize=7)
            continue
        if r["mean"] <= 1e-3:
            ax_k3.text(left * 1.05, pos[arm], f"{r['mean']:.1g}× (numerical floor)", va="center", fontsize=7)
            continue
        # a dot at the median and the seeds' range: a bar on a log axis would start at an arbitrary edge
        if r["n"] > 1:
            ax_k3.plot([r["lo"], r["hi"]], [pos[arm]] * 2, color="k", lw=1)
        ax_k3.plot([r["mean"]], [pos[arm]], "o", color=arm_color(arm), markeredgecolor="k", markersize=7)
        ax_k3.text(max(r["mean"], r["hi"] if r["n"] > 1 else 0) * 1.08, pos[arm], f"{r['mean']:.2g}×",
                   va="center", fontsize=7)
    ax_k3.set_xscale("log")  # first: setting the scale resets the axis' locators and formatters
    ax_k3.set_xlim(left, right)
    # 1-2-5 ticks over a few decades; over more (a broken arm at 1e3x), one tick per decade stays legible.
    subs = (1.0, 2.0, 5.0) if np.log10(right / left) <= 3 else (1.0,)
    ax_k3.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=subs))
    # Long labels (1000×, 10000×) collide on a narrow axis: powers of ten from 1000 up as 1e3×.
    ax_k3.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda v, _: f"1e{np.log10(v):.0f}×" if v >= 1e3 and float(np.log10(v)).is_integer() else f"{v:g}×"))
    ax_k3.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_k3.axvline(1.0, color="k", lw=0.8, ls="--")
    statistic = "run-median " if k3_key.startswith("median/") else "run-mean "
    ax_k3.set_xlabel(f"{statistic}k3 KL ÷ its family's baseline (same seed)", fontsize=9)
    ax_k3.set_yticks(y, [name for _, name in rows], fontsize=8)
    ax_k3.set_ylim(-0.7, len(rows) - 0.3)  # the top heading has no bar: keep its row
    for (kind, _), tick in zip(rows, ax_k3.get_yticklabels()):
        if kind == "header":
            tick.set_fontweight("bold")
            tick.set_fontsize(8.5)

    # The README's and RESULTS.md's routing column: the share of tokens routed alike in every MoE layer.
    key = "mean/routing/all_layers_agree"
    if key not in runs and "mean/routing/any_layer_differs" in runs:
        runs = runs.assign(**{key: 1 - pd.to_numeric(runs["mean/routing/any_layer_differs"], errors="coerce")})
    finite = pd.Series(dtype=float)
    if key in runs:
        per_run = pd.to_numeric(runs[key], errors="coerce")
        vals = per_run.groupby(runs["arm"]).mean().reindex(order)
        finite = vals.dropna()
        seeds = per_run.groupby(runs["arm"]).agg(["min", "max"]).reindex(order)
    # Zoom to the arms near full agreement, so 0.974 vs 0.981 reads; an arm far below is labelled; the axis
    # ends at 1 (a share).
    if not finite.empty:
        med = float(finite.median())
        kept = finite[finite >= 1 - 4 * max(1 - med, 1e-4)]
        low = float(kept.min()) - 0.35 * (1 - float(kept.min()) + 1e-4)
        for arm, v in finite.items():
            if v >= low:
                lo, hi = seeds.loc[arm, "min"], seeds.loc[arm, "max"]
                ax_route.plot([lo, hi], [pos[arm]] * 2, color="k", lw=1, clip_on=False)
                ax_route.plot([v], [pos[arm]], "o", color=arm_color(arm), markeredgecolor="k", markersize=7,
                              clip_on=False)
                ax_route.text(min(lo, v) - 0.02 * (1 - low), pos[arm], f"{v:.4f}", va="center", ha="right",
                              fontsize=7)
            else:
                ax_route.text(low + 0.01 * (1 - low), pos[arm], f"← {v:.3f} (off axis)", va="center", fontsize=6.5,
                              color="C3")
    else:
        low = 0.9
    ax_route.set_xlim(low, 1.0)
    ax_route.set_xlabel("tokens routed alike in every MoE layer\n(mean over seeds, range; zoomed)", fontsize=9)
    for ax in (ax_k3, ax_route):
        ax.grid(alpha=0.3, axis="x")
        for (kind, _), yy in zip(rows, y):
            if kind == "header" and yy != y[0]:
                ax.axhline(yy + 0.5, color="k", lw=0.6, ls=":")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def gain_figure(runs: pd.DataFrame, title: str, questions: list[Question] | None = None) -> plt.Figure:
    """Does any arm change what GRPO learns? Held-out pass@1 (T=1) and greedy accuracy, final minus
    initial, per arm: bar = mean over seeds, dots = seeds."""
    arms = arm_order(runs["arm"].unique(), questions or [])
    y = np.arange(len(arms))[::-1]
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 0.3 * len(arms) + 1.5), sharey=True)
    for ax, (metric, label) in zip(axes, (("eval/pass1", "pass@1 (T=1) gain"), ("eval/greedy", "greedy accuracy gain"))):
        final, initial = f"final_eval/{metric}", f"initial_eval/{metric}"
        if final not in runs or initial not in runs:
            ax.set_visible(False)
            continue
        gain = pd.to_numeric(runs[final], errors="coerce") - pd.to_numeric(runs[initial], errors="coerce")
        stats = gain.groupby(runs["arm"]).mean().reindex(arms)
        ax.barh(y, stats.values, color=[arm_color(a) for a in arms], height=0.7)
        pos = dict(zip(arms, y))
        ax.scatter(gain.values, [pos[a] for a in runs["arm"]], color="k", edgecolors="white", linewidths=0.6, s=14, zorder=3)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_xlabel(f"held-out {label}", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(y, arms, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def experiment_figures(df: pd.DataFrame, experiment: str, out_dir: Path, runs: pd.DataFrame | None = None,
                       samples: pd.DataFrame | None = None, questions: list[Question] | None = None,
                       losses: dict[str, dict] | None = None) -> list[Path]:
    """The figure set of one experiment, one question each. ``df``: load_metrics; ``runs``
    (load_summaries / run_table): the headline summary and the accuracy gains; ``samples``
    (load_token_samples): importance-weight histograms (with each arm's correction marks from
    ``losses``, arm -> loss config), quantiles and the logprob scatter; ``questions``: from
    experiments/<experiment>/figures.yaml (default: read it)."""
    out_dir = Path(out_dir)
    questions = load_questions(experiment) if questions is None else questions
    df = df[df["experiment"] == experiment]
    train = df[df["reward/mean"].notna()] if "reward/mean" in df else df
    if not questions:  # no figures.yaml: one question over all arms
        questions = [Question("training", f"{experiment}: training", sorted(train["arm"].unique()))]
    from moerl.analysis.results import family_references

    if runs is not None and not runs.empty:
        runs = runs[runs["experiment"] == experiment]
    references = family_references(runs) if runs is not None and not runs.empty else None
    presets = (runs.groupby("arm")["cfg/preset"].first().to_dict()
               if runs is not None and "cfg/preset" in runs else None)
    paths = []
    for q in questions:
        wanted = [k for k in train if k.startswith("mismatch/extreme_gt")] if q.kind == "tau_curve" else q.metrics
        recorded = [k for k in wanted if k in train and train[k].notna().any()]
        if any(a in set(train["arm"]) for a in q.arms) and recorded:
            paths.append(save(question_figure(train, q, references=references), out_dir / f"{experiment}_{q.name}.png"))
    if runs is not None and not runs.empty:
        reference = questions[0].reference
        k3_key = "mean/mismatch/k3"
        if "mismatch/k3" in train:  # per-step k3 is heavy-tailed: compare runs by their median step
            k3_key = "median/mismatch/k3"
            medians = train.groupby(["arm", "seed"])["mismatch/k3"].median().rename(k3_key).reset_index()
            runs = runs.drop(columns=[k3_key], errors="ignore").merge(medians, on=["arm", "seed"], how="left")
        paths.append(save(summary_figure(runs, f"{experiment}: what each arm does to the mismatch "
                                               f"(median over seeds, whisker = min-max)", questions, reference,
                                         k3_key=k3_key, references=references),
                          out_dir / f"{experiment}_summary.png"))
        if "final_eval/eval/pass1" in runs:
            paths.append(save(gain_figure(runs, f"{experiment}: held-out accuracy, final minus initial", questions),
                              out_dir / f"{experiment}_accuracy.png"))
    if any(c.startswith("routing/agreement/layer") for c in train.columns):
        # The arms that change the routing (replay, rollout precision, the architecture) get bars; the rest
        # (loss-side corrections, which route as the baseline does) one grey min-max band per panel.
        focus = _question_arms(questions, ("family", "replay", "rerouted")) or None
        others = [a for a in train["arm"].unique() if focus and a not in focus]
        paths.append(save(routing_by_layer(train, f"{experiment}: where do trainer and rollout route differently?",
                                           arms=focus, presets=presets, others=others),
                          out_dir / f"{experiment}_routing_layers.png"))
    if samples is not None and not samples.empty:
        samples = samples[samples["experiment"] == experiment]
        hist_arms = _question_arms(questions, ("mitigations",)) or None
        paths.append(save(ratio_histograms(samples, "raw_ratio", f"{experiment}: pi_old / pi_rollout and "
                                           "what each correction acts on", arms=hist_arms, losses=losses,
                                           caption=mis_caption(losses)),
                          out_dir / f"{experiment}_is_hist.png"))
        focus = _question_arms(questions, ("replay",)) or None
        # Per-token ratio for every arm (raw_ratio of a sequence-level MIS arm is its sequence's ratio).
        tokens = samples.assign(token_ratio=np.exp(samples["trainer_logp"].astype(float)
                                                   - samples["rollout_logp"].astype(float)))
        paths.append(save(spread_over_training(tokens, "token_ratio", title=f"{experiment}: does the spread of "
                                               "per-token pi_old / pi_rollout change over training?",
                                               arms=arm_order(tokens["arm"].unique(), questions)),
                          out_dir / f"{experiment}_is_quantiles.png"))
        paths.append(save(logprob_scatter(samples, f"{experiment}: at which token probabilities does the mismatch sit?",
                                          arms=focus), out_dir / f"{experiment}_logprob_scatter.png"))
    return paths


def _question_arms(questions: list[Question], names: tuple[str, ...]) -> list[str]:
    out = []
    for q in questions:
        if q.name in names:
            out += [a for a in q.arms if a not in out]
    return out

