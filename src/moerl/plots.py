"""Figures from recorded runs (shared by scripts/make_figures.py and the notebooks).

One figure answers one question. The questions of an experiment, the arms each compares and the
metrics it draws live in ``experiments/<name>/figures.yaml`` (see :func:`load_questions`); every arm
keeps one colour in every figure (:func:`arm_color`), and legends sit outside the axes. Seeds are
drawn as a band (min-max) around the mean over seeds.
"""
from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import matplotlib.ticker
import yaml

# Scripts draw off-screen; a notebook kernel keeps its inline backend so figures show in cells.
if "ipykernel" not in sys.modules and "MPLBACKEND" not in os.environ:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

# One colour per arm, the same in every figure of every experiment. Related arms share a hue
# family (replay: blues, corrections: greens/olive, DeepSeek-V3 preset: reds, LoRA/refit: purples).
ARM_COLORS = {
    "fp32_rollout": "#000000",
    "baseline": "#7f7f7f",
    "r2": "#9ecae1",
    "r3": "#1f77b4",
    "r3_tis": "#17becf",
    "tis": "#2ca02c",
    "mis": "#98df8a",
    "icepop": "#bcbd22",
    "gspo": "#8c564b",
    "ppo_tight_clip": "#c49c94",
    "baseline_fp8": "#393b79",
    "deepseek_fp32_rollout": "#7b4173",
    "deepseek_baseline": "#ff9896",
    "deepseek_r3": "#d62728",
    "deepseek_r3_position_bug": "#ff7f0e",
    "lora_shared": "#9467bd",
    "lora_shared_outer": "#c5b0d5",
    "refit_merged": "#e377c2",
}
_FALLBACK = plt.cm.tab20.colors

# Axis labels and scales of the metrics a figure may draw.
METRIC_LABELS = {
    "reward/mean": "training reward",
    "mismatch/k3": "k3 KL, rollout vs trainer",
    "mismatch/k3_max": "k3 KL, worst token",
    "mismatch/dp_max": "max |p_trainer - p_rollout|",
    "mismatch/extreme_frac": "extreme-token fraction",
    "routing/disagreement": "routing disagreement",
    "routing/agreement": "routing agreement (native)",
    "routing/replayed_agreement": "replayed agreement",
    "grad_norm": "gradient norm",
    "clip/frac": "PPO clip fraction",
    "is/p99": "IS weight p99",
    "is/truncated_frac": "TIS truncated fraction",
    "mask/token_frac": "masked token fraction",
    "effective/token_frac": "tokens with gradient",
    "routing/any_layer_differs": "tokens re-routed in >= 1 MoE layer",
    "routing/differing_layers_mean": "re-routed MoE layers per token",
    "routing/agreement": "routing agreement, trainer-native vs rollout",
    "refit/seconds": "refit seconds",
    "eval/pass1": "held-out pass@1 (T=1)",
    "eval/greedy": "held-out greedy accuracy",
}
LOG_METRICS = {"mismatch/k3", "mismatch/k3_max", "mismatch/dp_max", "mismatch/extreme_frac", "grad_norm",
               "refit/seconds"}


def arm_color(arm: str):
    """The arm's fixed colour; an arm not in ARM_COLORS gets a colour derived from its name, so it
    is also the same in every figure."""
    if arm in ARM_COLORS:
        return ARM_COLORS[arm]
    digest = int(hashlib.sha1(arm.encode()).hexdigest(), 16)
    return _FALLBACK[digest % len(_FALLBACK)]


@dataclass
class Question:
    """One figure: ``title`` (the question), the ``arms`` it compares and the ``metrics`` it draws.
    ``kind``: ``curves`` (metrics over training; a reward panel marks each run's collapse step) or
    ``tau_curve`` (the extreme-token curve F(tau) of each arm, from its ``mismatch/extreme_gt*``)."""

    name: str
    title: str
    arms: list[str]
    metrics: list[str] = field(default_factory=lambda: ["reward/mean", "mismatch/k3", "routing/disagreement"])
    reference: str = "baseline"
    kind: str = "curves"


QUESTION_KINDS = ("curves", "tau_curve")


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
        unknown = set(entry) - {"name", "title", "arms", "metrics", "reference", "kind"}
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
    """An x at each run's collapse step (moerl.collapse), on the arm's smoothed reward curve."""
    from moerl.collapse import collapse_step

    for _, run in df.groupby("seed"):
        run = run.sort_values("step")
        step = collapse_step(run.to_dict("records"))
        if step is not None:
            reward = run.set_index("step")["reward/mean"].rolling(smooth, min_periods=1).mean()
            ax.plot([step], [reward.get(step, np.nan)], marker="x", ms=9, mew=2.2, color=arm_color(arm),
                    ls="none", label="collapse step")


def curves(df: pd.DataFrame, panels: list[tuple[str, str]], title: str, smooth: int = 1,
           log_keys: tuple[str, ...] = (), arms: list[str] | None = None) -> plt.Figure:
    """One panel per (metric key, panel title); one line (+ seed band) per arm, in the arm's fixed
    colour; ``arms`` selects and orders the arms (default: all, alphabetically). A training-reward
    panel marks each run that collapsed (moerl.collapse) with an x at its collapse step."""
    arms = arms or sorted(df["arm"].unique())
    df = df[df["arm"].isin(arms)]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.0), squeeze=False)
    for ax, (key, name) in zip(axes[0], panels):
        for arm in arms:
            sub = df[df["arm"] == arm]
            if key in sub:
                _band(ax, sub, key, arm, smooth=smooth, color=arm_color(arm), lw=1.4)
                if key == "reward/mean":
                    _collapse_marks(ax, sub, arm, smooth)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("GRPO step")
        if key in log_keys:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    _legend_outside(fig, axes, arms)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def tau_curve(df: pd.DataFrame, title: str, arms: list[str] | None = None) -> plt.Figure:
    """F(tau): the share of response tokens with max(rho, 1/rho) > tau, rho = pi_old / pi_rollout, per arm
    (mean over its steps, one point per seed and the mean over seeds as the line), on log-log axes."""
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
        ax.plot(taus, mean, marker="o", color=arm_color(arm), label=arm, lw=1.5)
        for row in per_seed.values:
            ax.scatter(taus, row, s=8, color=arm_color(arm), alpha=0.45)
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=(floor or 1e-6) / 2)  # an arm with no extreme token sits at 0
    ax.set_ylim(bottom=0)
    ax.set_xticks(taus, [f"{t:g}" for t in taus])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("tau")
    ax.set_ylabel("F(tau) = share of tokens with\nmax(rho, 1/rho) > tau", fontsize=9)
    ax.grid(alpha=0.3)
    _legend_outside(fig, ax, arms)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def question_figure(df: pd.DataFrame, question: Question, smooth: int = 5) -> plt.Figure:
    """The figure of one question: its metrics over training for its arms, or its F(tau) curve."""
    if question.kind == "tau_curve":
        return tau_curve(df, question.title, question.arms)
    panels = [(k, METRIC_LABELS.get(k, k)) for k in question.metrics if k in df and df[k].notna().any()]
    if not panels:
        raise KeyError(f"question '{question.name}': none of its metrics {question.metrics} was recorded")
    return curves(df, panels, question.title, smooth=smooth, log_keys=tuple(LOG_METRICS),
                  arms=[a for a in question.arms if a in set(df["arm"])])


def routing_by_layer(df: pd.DataFrame, title: str, arms: list[str] | None = None) -> plt.Figure:
    """Mean routing disagreement (trainer native top-k vs rollout top-k) per MoE layer and arm."""
    cols = sorted((c for c in df.columns if c.startswith("routing/agreement/layer")),
                  key=lambda c: int(c.rsplit("layer", 1)[1]))
    arms = [a for a in (arms or sorted(df["arm"].unique())) if a in set(df["arm"])]
    shown = df[df["arm"].isin(arms)]
    cols = [c for c in cols if shown[c].notna().any()]  # MoE layers no shown arm has (a shallower model)
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    width = 0.8 / max(len(arms), 1)
    for i, arm in enumerate(arms):
        sub = df[df["arm"] == arm]
        vals = [1 - sub[c].mean() if c in sub and sub[c].notna().any() else np.nan for c in cols]
        ax.bar(np.arange(len(cols)) + i * width, vals, width, label=arm, color=arm_color(arm))
    ax.set_xticks(np.arange(len(cols)) + 0.4 - width / 2, [c.rsplit("/", 1)[1] for c in cols])
    ax.set_ylabel("tokens whose top-k differs")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    _legend_outside(fig, [ax], arms)
    fig.tight_layout()
    return fig


def _arm_grid(arms: list[str], width: float = 2.6, height: float = 2.5, ncols: int = 4):
    n = max(len(arms), 1)
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def correction_marks(loss: dict | None) -> list[tuple[str, float, float | None, str]]:
    """What the arm's loss does to the importance weight rho = pi_old/pi_rollout, as (kind, lo, hi,
    label) marks for a histogram: a TIS cap line, or the MIS / IcePop keep band."""
    if not loss:
        return []
    variant = loss.get("variant")
    if variant == "tis":
        return [("cap", loss.get("tis_cap", 2.0), None, f"TIS cap {loss.get('tis_cap', 2.0):g}")]
    if variant == "icepop":
        return [("band", loss.get("icepop_alpha", 0.5), loss.get("icepop_beta", 5.0),
                 f"IcePop keeps [{loss.get('icepop_alpha', 0.5):g}, {loss.get('icepop_beta', 5.0):g}]")]
    if variant == "mis":
        level = loss.get("is_level", "token")
        return [("band", loss.get("mis_lower", 0.5), loss.get("mis_upper", 2.0),
                 f"MIS keeps [{loss.get('mis_lower', 0.5):g}, {loss.get('mis_upper', 2.0):g}]"
                 + ("" if level == "token" else f" ({level} ratio)"))]
    return []


def ratio_histograms(samples: pd.DataFrame, key: str = "raw_ratio", title: str = "",
                     arms: list[str] | None = None, losses: dict[str, dict] | None = None) -> plt.Figure:
    """Per arm, the distribution of a per-token weight from samples/*.npz (all steps and seeds),
    on a log-x axis: 1 is no mismatch. ``losses`` (arm -> loss config) adds what each correction
    acts on: the TIS cap, the MIS / IcePop keep band (shaded)."""
    arms = [a for a in (arms or sorted(samples["arm"].unique())) if a in set(samples["arm"])]
    fig, axes = _arm_grid(arms)
    vals = samples.loc[samples["arm"].isin(arms), key].to_numpy(dtype=float)
    vals = vals[np.isfinite(vals) & (vals > 0)]
    lo, hi = (np.quantile(vals, [0.0, 1.0]) if vals.size else (0.5, 2.0))
    lo, hi = min(lo, 0.4), max(hi, 2.5)
    bins = np.geomspace(lo, hi, 80)
    ticks = [t for t in (1e-4, 1e-3, 1e-2, 0.1, 0.5, 1, 2, 5, 10, 100) if lo <= t <= hi]
    for ax, arm in zip(axes, arms):
        x = samples.loc[samples["arm"] == arm, key].to_numpy(dtype=float)
        x = x[np.isfinite(x) & (x > 0)]
        ax.hist(x, bins=bins, color=arm_color(arm), alpha=0.85)
        ax.axvline(1.0, color="k", lw=0.8, ls="--")
        for kind, a, b, label in correction_marks((losses or {}).get(arm)):
            if kind == "cap":
                ax.axvline(a, color="C3", lw=1.2, label=label)
            else:
                ax.axvspan(a, b, color="C2", alpha=0.12, label=label)
                for edge in (a, b):
                    ax.axvline(edge, color="C2", lw=1.0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6, loc="upper left", frameon=False)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.tick_params(axis="y", labelsize=7)
        q = np.quantile(x, [0.01, 0.99]) if x.size else (np.nan, np.nan)
        ax.set_title(f"{arm}\np1={q[0]:.3g}  p99={q[1]:.3g}  n={x.size}", fontsize=8)
        ax.set_xlabel(key, fontsize=8)
    fig.suptitle(title or f"per-token {key} (all sampled steps and seeds)", fontsize=10)
    fig.tight_layout()
    return fig


def sample_quantiles(samples: pd.DataFrame, key: str = "raw_ratio",
                     qs: tuple[float, ...] = (0.01, 0.5, 0.99)) -> pd.DataFrame:
    """Quantiles of a per-token quantity per (arm, step), pooled over seeds: a tidy frame with
    columns arm, step, and one column per quantile (q0.01, ...)."""
    grouped = samples.groupby(["arm", "step"])[key]
    out = pd.concat({f"q{q:g}": grouped.quantile(q) for q in qs}, axis=1).reset_index()
    out["tokens"] = grouped.size().to_numpy()
    return out


def quantiles_over_time(samples: pd.DataFrame, key: str = "raw_ratio",
                        qs: tuple[float, ...] = (0.01, 0.5, 0.99), title: str = "",
                        arms: list[str] | None = None) -> plt.Figure:
    """Per arm, the p1/p50/p99 (by default) of a per-token quantity at each sampled step."""
    arms = [a for a in (arms or sorted(samples["arm"].unique())) if a in set(samples["arm"])]
    table = sample_quantiles(samples[samples["arm"].isin(arms)], key, qs)
    fig, ax = plt.subplots(figsize=(6.0, 3.3))
    cols = [f"q{q:g}" for q in qs]
    for arm in arms:
        sub = table[table["arm"] == arm]
        color = arm_color(arm)
        ax.plot(sub["step"], sub[cols[len(cols) // 2]], color=color, label=arm, marker="o", ms=3)
        ax.fill_between(sub["step"], sub[cols[0]], sub[cols[-1]], color=color, alpha=0.15)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
    low, high = ax.get_ylim()
    # Minor ticks get labels only within about a decade; over more they would overlap.
    minor = matplotlib.ticker.FormatStrFormatter("%.3g") if high / low <= 20 else matplotlib.ticker.NullFormatter()
    ax.yaxis.set_minor_formatter(minor)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"{key}: median, p{qs[0] * 100:g}-p{qs[-1] * 100:g} band", fontsize=8)
    ax.set_title(title or f"{key} quantiles over training", fontsize=10)
    ax.grid(alpha=0.3)
    _legend_outside(fig, [ax], arms)
    fig.tight_layout()
    return fig


def logprob_scatter(samples: pd.DataFrame, title: str = "", max_points: int = 4000, seed: int = 0,
                    arms: list[str] | None = None) -> plt.Figure:
    """Per arm, the per-token log-ratio log pi_old - log pi_rollout against the rollout logprob of
    the same sampled token: where (at which token probabilities) the mismatch sits; red points were
    truncated (TIS) or masked (IcePop/MIS). The y axis is shared so arms compare directly."""
    arms = [a for a in (arms or sorted(samples["arm"].unique())) if a in set(samples["arm"])]
    fig, axes = _arm_grid(arms, width=2.6, height=2.5)
    delta_all = samples["trainer_logp"] - samples["rollout_logp"]
    span = float(np.nanquantile(np.abs(delta_all[samples["arm"].isin(arms)]), 0.9995)) or 1e-6
    for ax, arm in zip(axes, arms):
        sub = samples[samples["arm"] == arm]
        if len(sub) > max_points:
            sub = sub.sample(max_points, random_state=seed)
        delta = sub["trainer_logp"] - sub["rollout_logp"]
        flagged = sub["truncated"].astype(bool) | sub["masked"].astype(bool)
        ax.scatter(sub.loc[~flagged, "rollout_logp"], delta[~flagged], s=3, alpha=0.4, color=arm_color(arm))
        if flagged.any():
            ax.scatter(sub.loc[flagged, "rollout_logp"], delta[flagged], s=5, color="C3", label="truncated/masked")
            ax.legend(fontsize=6, loc="lower left", frameon=False)
        ax.axhline(0.0, color="k", lw=0.8, ls="--")
        ax.set_ylim(-1.1 * span, 1.1 * span)
        ax.set_title(arm, fontsize=9)
        ax.set_xlabel("rollout logprob", fontsize=8)
        ax.set_ylabel("log pi_old - log pi_rollout", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(title or "where the mismatch sits: per-token log-ratio vs token probability", fontsize=10)
    fig.tight_layout()
    return fig


def routing_layers_table(df: pd.DataFrame, summaries: pd.DataFrame | None = None) -> pd.DataFrame:
    """Mean routing agreement per arm (rows) and MoE layer (columns, global layer numbers), with
    the arm's preset and replay mode when ``summaries`` (moerl.results.load_summaries) is given."""
    cols = sorted((c for c in df.columns if c.startswith("routing/agreement/layer")),
                  key=lambda c: int(c.rsplit("layer", 1)[1]))
    table = df.groupby("arm")[cols].mean()
    table.columns = [int(c.rsplit("layer", 1)[1]) for c in cols]
    table.columns.name = "MoE layer"
    if summaries is not None and not summaries.empty and "cfg/preset" in summaries:
        knobs = summaries.groupby("arm")[["cfg/preset", "cfg/replay"]].first()
        table = knobs.join(table, how="right").rename(columns={"cfg/preset": "preset", "cfg/replay": "replay"})
        table = table.sort_values(["preset", "replay"])
    return table


def refit_figure(bench: dict, name: str = "bench_refit") -> plt.Figure:
    """What does a refit cost, and does the engine's copy drift? From scripts/bench_refit.py's JSON:
    measured time and bytes per refit (adapter-only vs merged, per preset), the relative error of the
    bf16 engine's effective weights over repeated refits, and bytes per refit at scale (analytic)."""
    presets = bench.get("presets")
    if not isinstance(presets, list) or not presets:
        raise KeyError(f"{name}.json: expected a non-empty list 'presets' with adapter/merged entries "
                       f"(have keys {sorted(bench)})")
    analytic = bench.get("analytic") or {}
    drift = bench.get("drift") or {}
    panels = ["time", "bytes"] + (["drift"] if drift else []) + (["analytic"] if analytic else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.3))
    ax_of = dict(zip(panels, np.ravel(axes)))
    mode_colors = {"adapter": "C0", "merged": "C1"}
    labels = [str(p.get("preset", i)) for i, p in enumerate(presets)]
    x = np.arange(len(presets))
    for j, mode in enumerate(("adapter", "merged")):
        secs = [p.get(mode, {}).get("seconds_median", np.nan) * 1e3 for p in presets]
        byts = [p.get(mode, {}).get("bytes", np.nan) / 2**20 for p in presets]
        ax_of["time"].bar(x + 0.4 * j, secs, 0.4, label=mode, color=mode_colors[mode])
        ax_of["bytes"].bar(x + 0.4 * j, byts, 0.4, label=mode, color=mode_colors[mode])
    for key, ylabel, title in (("time", "ms per refit (median)", "measured refit time"),
                               ("bytes", "MiB per refit", "bytes sent per refit")):
        ax = ax_of[key]
        ax.set_xticks(x + 0.2, labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    if drift:
        ax = ax_of["drift"]
        for mode, values in drift.items():
            ax.plot(np.arange(1, len(values) + 1), values, label=mode, color=mode_colors.get(mode))
        ax.set_xlabel("refits")
        ax.set_ylabel("rel. error of engine weights", fontsize=8)
        ax.set_title("bf16 drift over refits", fontsize=10)
        ax.grid(alpha=0.3)
    if analytic:
        ax = ax_of["analytic"]
        models = list(analytic)
        keys = sorted({k[: -len("_bytes")] for m in models for k in analytic[m] if k.endswith("_bytes")},
                      key=lambda k: (k != "full_bf16", k))
        width = 0.8 / max(len(keys), 1)
        for i, k in enumerate(keys):
            ax.bar(np.arange(len(models)) + i * width, [analytic[m].get(f"{k}_bytes", np.nan) / 2**30 for m in models],
                   width, label=k, color=plt.cm.Set2.colors[i % 8])
        ax.set_xticks(np.arange(len(models)) + 0.4 - width / 2, [m.split(" (")[0] for m in models], fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("GiB per refit", fontsize=8)
        ax.set_title("at scale (analytic)", fontsize=10)
        ax.legend(fontsize=6, frameon=False)
        ax.grid(alpha=0.3, axis="y")
    ax_of["time"].legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def _paired_ratio(runs: pd.DataFrame, key: str, reference: str) -> pd.DataFrame:
    """Per arm: the ratio of ``key`` to the reference arm's on the same seed (seeds share prompts
    and initial weights), mean and min/max over seeds."""
    vals = runs.assign(v=pd.to_numeric(runs[key], errors="coerce")).pivot_table(index="arm", columns="seed", values="v")
    if reference not in vals.index:
        return pd.DataFrame(columns=["mean", "lo", "hi", "n"])
    ratio = vals.div(vals.loc[reference], axis=1)
    return pd.DataFrame({"mean": ratio.mean(axis=1), "lo": ratio.min(axis=1), "hi": ratio.max(axis=1),
                         "n": ratio.notna().sum(axis=1)})


def summary_figure(runs: pd.DataFrame, title: str, questions: list[Question] | None = None,
                   reference: str = "baseline", k3_key: str = "mean/mismatch/k3") -> plt.Figure:
    """The headline: how much does each arm change the mismatch? Left, k3 relative to the reference
    arm on the same seed (bar = mean, whisker = min-max over seeds); right, the share of tokens whose
    trainer-native top-k equals the rollout's beside the share of replayed rows that took the
    trace's experts. Arms are grouped by question (dotted separators)."""
    questions = questions or []
    arms = arm_order(runs["arm"].unique(), questions)
    groups, seen = [], set()
    for q in questions:
        members = [a for a in q.arms if a in arms and a not in seen]
        seen.update(members)
        if members:
            groups.append((q.name, members))
    rest = [a for a in arms if a not in seen]
    if rest:
        groups.append(("other", rest))
    order = [a for _, members in groups for a in members]
    y = np.arange(len(order))[::-1]
    pos = dict(zip(order, y))
    fig, (ax_k3, ax_route) = plt.subplots(1, 2, figsize=(9.5, 0.32 * len(order) + 2.0), sharey=True)
    ratio = _paired_ratio(runs, k3_key, reference).reindex(order)
    # An arm with (near-)zero mismatch (the fp32 rollout) would stretch the log axis by many decades:
    # the axis covers the others and such an arm gets a note at the left edge instead of a bar.
    shown = ratio["mean"][(ratio["mean"] > 1e-3)]
    left = min(0.5, float(shown.min()) / 1.5) if not shown.empty else 0.1
    right = max(2.0, float(ratio["hi"][ratio["mean"] > 1e-3].max()) * 1.6) if not shown.empty else 10.0
    for arm in order:
        r = ratio.loc[arm]
        if not r["mean"] == r["mean"]:
            continue
        if r["mean"] <= 1e-3:
            ax_k3.text(left * 1.05, pos[arm], f"{r['mean']:.1g}× (no mismatch)", va="center", fontsize=7)
            continue
        ax_k3.barh(pos[arm], r["mean"], color=arm_color(arm), height=0.7)
        if r["n"] > 1:
            ax_k3.plot([r["lo"], r["hi"]], [pos[arm]] * 2, color="k", lw=1)
        ax_k3.text(max(r["mean"], r["hi"] if r["n"] > 1 else 0) * 1.08, pos[arm], f"{r['mean']:.2g}×",
                   va="center", fontsize=7)
    ax_k3.set_xscale("log")  # first: setting the scale resets the axis' locators and formatters
    ax_k3.set_xlim(left, right)
    # 1-2-5 ticks over a few decades; over more (a broken arm at 1e4x), one tick per decade stays legible.
    subs = (1.0, 2.0, 5.0) if np.log10(right / left) <= 3 else (1.0,)
    ax_k3.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=subs))
    ax_k3.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g×"))
    ax_k3.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax_k3.axvline(1.0, color="k", lw=0.8, ls="--")
    statistic = "run-median " if k3_key.startswith("median/") else ""
    ax_k3.set_xlabel(f"{statistic}k3 KL relative to {reference} (same seed)", fontsize=9)
    ax_k3.set_yticks(y, order, fontsize=8)
    from matplotlib.patches import Patch

    legend = []
    for key, offset, label, hatch in (("mean/routing/agreement", -0.18, "trainer's native top-k = rollout's", None),
                                      ("mean/routing/replayed_agreement", 0.18, "replayed rows took the trace's experts", "///")):
        if key not in runs:
            continue
        vals = pd.to_numeric(runs[key], errors="coerce").groupby(runs["arm"]).mean().reindex(order)
        ax_route.barh([pos[a] + offset for a in order], vals.values, height=0.34,
                      color=[arm_color(a) for a in order], hatch=hatch, edgecolor="k", lw=0.3)
        legend.append(Patch(facecolor="white", edgecolor="k", hatch=hatch, label=label))
    finite = pd.to_numeric(runs.get("mean/routing/agreement", pd.Series(dtype=float)), errors="coerce").dropna()
    low = float(finite.min()) if not finite.empty else 0.98
    ax_route.set_xlim(max(0.0, low - (1 - low) * 0.5), 1.0005)
    ax_route.set_xlabel("share of tokens (routing)", fontsize=9)
    ax_route.legend(handles=legend, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=1,
                    frameon=False)
    for ax in (ax_k3, ax_route):
        ax.grid(alpha=0.3, axis="x")
        start = 0
        for name, members in groups[:-1]:
            start += len(members)
            ax.axhline(y[start - 1] - 0.5, color="k", lw=0.6, ls=":")
    for name, members in groups:
        ax_route.text(1.02, np.mean([pos[a] for a in members]), name, transform=ax_route.get_yaxis_transform(),
                      va="center", fontsize=8, style="italic")
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


def save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


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
    paths = []
    for q in questions:
        wanted = [k for k in train if k.startswith("mismatch/extreme_gt")] if q.kind == "tau_curve" else q.metrics
        recorded = [k for k in wanted if k in train and train[k].notna().any()]
        if any(a in set(train["arm"]) for a in q.arms) and recorded:
            paths.append(save(question_figure(train, q), out_dir / f"{experiment}_{q.name}.png"))
    if runs is not None and not runs.empty:
        runs = runs[runs["experiment"] == experiment]
        reference = questions[0].reference
        k3_key = "mean/mismatch/k3"
        if "mismatch/k3" in train:  # per-step k3 is heavy-tailed: compare runs by their median step
            k3_key = "median/mismatch/k3"
            medians = train.groupby(["arm", "seed"])["mismatch/k3"].median().rename(k3_key).reset_index()
            runs = runs.drop(columns=[k3_key], errors="ignore").merge(medians, on=["arm", "seed"], how="left")
        paths.append(save(summary_figure(runs, f"{experiment}: what each arm does to the mismatch "
                                               f"(mean over seeds, whisker = min-max)", questions, reference,
                                         k3_key=k3_key),
                          out_dir / f"{experiment}_summary.png"))
        if "final_eval/eval/pass1" in runs:
            paths.append(save(gain_figure(runs, f"{experiment}: held-out accuracy, final minus initial", questions),
                              out_dir / f"{experiment}_accuracy.png"))
    if any(c.startswith("routing/agreement/layer") for c in train.columns):
        focus = _question_arms(questions, ("family", "replay")) or None
        paths.append(save(routing_by_layer(train, f"{experiment}: where do trainer and rollout route differently?",
                                           arms=focus), out_dir / f"{experiment}_routing_layers.png"))
    if samples is not None and not samples.empty:
        samples = samples[samples["experiment"] == experiment]
        hist_arms = _question_arms(questions, ("mitigations",)) or None
        paths.append(save(ratio_histograms(samples, "raw_ratio", f"{experiment}: per-token pi_old / pi_rollout and "
                                           "what each correction acts on", arms=hist_arms, losses=losses),
                          out_dir / f"{experiment}_is_hist.png"))
        focus = _question_arms(questions, ("replay",)) or None
        paths.append(save(quantiles_over_time(samples, "raw_ratio", title=f"{experiment}: does the spread of "
                                              "pi_old / pi_rollout change over training?", arms=focus),
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

