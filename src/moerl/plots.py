"""Figures from recorded runs (shared by scripts/make_figures.py and the notebooks).

Each function takes the tidy frame from moerl.results.load_metrics and draws one question:
seeds are shown as a band (min-max) around the mean over seeds.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

# Scripts draw off-screen; a notebook kernel keeps its inline backend so figures show in cells.
if "ipykernel" not in sys.modules and "MPLBACKEND" not in os.environ:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402


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


def curves(df: pd.DataFrame, panels: list[tuple[str, str]], title: str, smooth: int = 1,
           log_keys: tuple[str, ...] = ()) -> plt.Figure:
    """One panel per (metric key, panel title); one line (+ seed band) per arm."""
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (key, name) in zip(axes[0], panels):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # up to 20 arms stay distinguishable
        for arm, sub in df.groupby("arm", sort=True):
            if key in sub:
                _band(ax, sub, key, arm, smooth=smooth)
        ax.set_title(name)
        ax.set_xlabel("GRPO step")
        if key in log_keys:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def routing_by_layer(df: pd.DataFrame, title: str) -> plt.Figure:
    """Mean routing disagreement (trainer native top-k vs rollout top-k) per MoE layer and arm."""
    cols = sorted((c for c in df.columns if c.startswith("routing/agreement/layer")),
                  key=lambda c: int(c.rsplit("layer", 1)[1]))
    fig, ax = plt.subplots(figsize=(6, 3.4))
    arms = sorted(df["arm"].unique())
    width = 0.8 / max(len(arms), 1)
    for i, arm in enumerate(arms):
        sub = df[df["arm"] == arm]
        vals = [1 - sub[c].mean() if c in sub and sub[c].notna().any() else np.nan for c in cols]
        ax.bar(np.arange(len(cols)) + i * width, vals, width, label=arm)
    ax.set_xticks(np.arange(len(cols)) + 0.4 - width / 2, [c.rsplit("/", 1)[1] for c in cols])
    ax.set_ylabel("fraction of tokens whose top-k differs")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def _arm_grid(arms: list[str], width: float = 3.2, height: float = 3.0, ncols: int = 4):
    n = max(len(arms), 1)
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def ratio_histograms(samples: pd.DataFrame, key: str = "raw_ratio", title: str = "") -> plt.Figure:
    """Per arm, the distribution of a per-token weight from samples/*.npz (all steps and seeds),
    on a log-x axis: 1 is no mismatch; the tails are what TIS truncates and IcePop/MIS mask."""
    arms = sorted(samples["arm"].unique())
    fig, axes = _arm_grid(arms)
    vals = samples[key].to_numpy(dtype=float)
    vals = vals[np.isfinite(vals) & (vals > 0)]
    lo, hi = (np.quantile(vals, [0.0, 1.0]) if vals.size else (0.5, 2.0))
    lo, hi = min(lo, 0.9), max(hi, 1.1)
    bins = np.geomspace(lo, hi, 50)
    for ax, arm in zip(axes, arms):
        x = samples.loc[samples["arm"] == arm, key].to_numpy(dtype=float)
        x = x[np.isfinite(x) & (x > 0)]
        ax.hist(x, bins=bins, color="C0", alpha=0.8)
        ax.axvline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(0.1, 0.2, 0.5, 1.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        q = np.quantile(x, [0.01, 0.99]) if x.size else (np.nan, np.nan)
        ax.set_title(f"{arm}\np1={q[0]:.3g}  p99={q[1]:.3g}  n={x.size}", fontsize=9)
        ax.set_xlabel(key)
    fig.suptitle(title or f"per-token {key} (all sampled steps and seeds)")
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
                        qs: tuple[float, ...] = (0.01, 0.5, 0.99), title: str = "") -> plt.Figure:
    """Per arm, the p1/p50/p99 (by default) of a per-token quantity at each sampled step."""
    table = sample_quantiles(samples, key, qs)
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for i, (arm, sub) in enumerate(table.groupby("arm", sort=True)):
        color = f"C{i % 10}"
        cols = [f"q{q:g}" for q in qs]
        ax.plot(sub["step"], sub[cols[len(cols) // 2]], color=color, label=arm, marker="o", ms=3)
        ax.fill_between(sub["step"], sub[cols[0]], sub[cols[-1]], color=color, alpha=0.15)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"{key} (median, band p{qs[0] * 100:g}-p{qs[-1] * 100:g})")
    ax.set_title(title or f"{key} quantiles over training")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def logprob_scatter(samples: pd.DataFrame, title: str = "", max_points: int = 4000, seed: int = 0) -> plt.Figure:
    """Per arm, rollout logprob vs trainer (pi_old) logprob of the same sampled tokens; points off
    the diagonal are the mismatch; red points were truncated (TIS) or masked (IcePop/MIS)."""
    arms = sorted(samples["arm"].unique())
    fig, axes = _arm_grid(arms, width=3.0, height=3.0)
    lo = float(min(samples["rollout_logp"].min(), samples["trainer_logp"].min()))
    for ax, arm in zip(axes, arms):
        sub = samples[samples["arm"] == arm]
        if len(sub) > max_points:
            sub = sub.sample(max_points, random_state=seed)
        flagged = sub["truncated"].astype(bool) | sub["masked"].astype(bool)
        ax.scatter(sub.loc[~flagged, "rollout_logp"], sub.loc[~flagged, "trainer_logp"], s=3, alpha=0.4, color="C0")
        if flagged.any():
            ax.scatter(sub.loc[flagged, "rollout_logp"], sub.loc[flagged, "trainer_logp"], s=5, color="C3",
                       label="truncated/masked")
            ax.legend(fontsize=7, loc="upper left")
        ax.plot([lo, 0], [lo, 0], color="k", lw=0.8, ls="--")
        ax.set_title(arm, fontsize=9)
        ax.set_xlabel("rollout logprob")
        ax.set_ylabel("trainer logprob (pi_old)")
    fig.suptitle(title or "rollout vs trainer logprob of sampled tokens")
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
    """Refit cost from scripts/bench_refit.py's JSON: measured seconds and bytes per refit,
    adapter-only vs merged, for each preset it ran; and bytes per refit at scale (analytic)."""
    presets = bench.get("presets")
    if not isinstance(presets, list) or not presets:
        raise KeyError(f"{name}.json: expected a non-empty list 'presets' with adapter/merged entries "
                       f"(have keys {sorted(bench)})")
    analytic = bench.get("analytic") or {}
    ncols = 3 if analytic else 2
    fig, axes = plt.subplots(1, ncols, figsize=(4.4 * ncols, 3.6))
    labels = [str(p.get("preset", i)) for i, p in enumerate(presets)]
    x = np.arange(len(presets))
    for j, mode in enumerate(("adapter", "merged")):
        secs = [p.get(mode, {}).get("seconds_median", np.nan) * 1e3 for p in presets]
        byts = [p.get(mode, {}).get("bytes", np.nan) / 2**20 for p in presets]
        axes[0].bar(x + 0.4 * j, secs, 0.4, label=mode)
        axes[1].bar(x + 0.4 * j, byts, 0.4, label=mode)
    for ax, ylabel in ((axes[0], "ms per refit (median)"), (axes[1], "MiB per refit")):
        ax.set_xticks(x + 0.2, labels)
        ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_title("measured refit time")
    axes[1].set_title("bytes sent per refit")
    if analytic:
        models = list(analytic)
        keys = sorted({k[: -len("_bytes")] for m in models for k in analytic[m] if k.endswith("_bytes")},
                      key=lambda k: (k != "full_bf16", k))
        width = 0.8 / max(len(keys), 1)
        for i, k in enumerate(keys):
            axes[2].bar(np.arange(len(models)) + i * width,
                        [analytic[m].get(f"{k}_bytes", np.nan) / 2**30 for m in models], width, label=k)
        axes[2].set_xticks(np.arange(len(models)) + 0.4 - width / 2, models, fontsize=7)
        axes[2].set_yscale("log")
        axes[2].set_ylabel("GiB per refit")
        axes[2].set_title("at scale (analytic)")
        axes[2].legend(fontsize=6, ncol=2)
        axes[2].grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def summary_bars(runs: pd.DataFrame, title: str,
                 panels: tuple[tuple[str, str, bool], ...] = (
                     ("final_eval/eval/greedy", "held-out acc. (greedy, final)", False),
                     ("mean/mismatch/k3", "k3 KL rollout vs trainer", True),
                     ("mean/routing/disagreement", "routing disagreement", False),
                     ("mean/is/p99", "IS ratio p99", False))) -> plt.Figure:
    """The headline: one bar per arm (mean over seeds, error bar = std, dots = seeds) per metric,
    from moerl.results.run_table / load_summaries."""
    panels = tuple(p for p in panels if p[0] in runs.columns)
    arms = sorted(runs["arm"].unique())
    panel_w = max(3.0, 0.4 * len(arms) + 1.0)
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_w * len(panels), 4.0), squeeze=False)
    for ax, (key, name, logy) in zip(axes[0], panels):
        vals = pd.to_numeric(runs[key], errors="coerce")
        stats = vals.groupby(runs["arm"]).agg(["mean", "std"]).reindex(arms)
        x = np.arange(len(arms))
        ax.bar(x, stats["mean"], yerr=stats["std"].fillna(0), color="C0", alpha=0.7, capsize=2)
        pos = {a: i for i, a in enumerate(arms)}
        ax.scatter([pos[a] for a in runs["arm"]], vals, color="k", s=6, zorder=3)
        ax.set_xticks(x, arms, rotation=60, ha="right", fontsize=8)
        ax.set_title(name, fontsize=9)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def experiment_figures(df: pd.DataFrame, experiment: str, out_dir: Path, runs: pd.DataFrame | None = None,
                       samples: pd.DataFrame | None = None) -> list[Path]:
    """The standard figure set of one experiment: curves from ``df`` (load_metrics); with ``runs``
    (load_summaries / run_table) the headline bar chart ``<experiment>_summary.png``; with
    ``samples`` (load_token_samples) the importance-weight histograms, quantiles and scatter."""
    out_dir = Path(out_dir)
    df = df[df["experiment"] == experiment]
    extra = []
    if runs is not None and not runs.empty:
        runs = runs[runs["experiment"] == experiment]
        extra.append(save(summary_bars(runs, f"{experiment}: per arm (mean ± std over seeds, dots = seeds)"),
                          out_dir / f"{experiment}_summary.png"))
    if samples is not None and not samples.empty:
        samples = samples[samples["experiment"] == experiment]
        extra.append(save(ratio_histograms(samples, "raw_ratio", f"{experiment}: per-token pi_old/pi_rollout"),
                          out_dir / f"{experiment}_is_hist.png"))
        extra.append(save(quantiles_over_time(samples, "raw_ratio", title=f"{experiment}: pi_old/pi_rollout quantiles"),
                          out_dir / f"{experiment}_is_quantiles.png"))
        extra.append(save(logprob_scatter(samples, f"{experiment}: rollout vs trainer logprob"),
                          out_dir / f"{experiment}_logprob_scatter.png"))
    return _curve_figures(df, experiment, out_dir) + extra


def _curve_figures(df: pd.DataFrame, experiment: str, out_dir: Path) -> list[Path]:
    train = df[df["reward/mean"].notna()] if "reward/mean" in df else df
    evals = df[df["eval/pass1"].notna()] if "eval/pass1" in df else df.iloc[:0]
    panels = [(k, n) for k, n in (("reward/mean", "training reward"), ("mismatch/k3", "k3 KL (rollout vs trainer)"),
                                  ("routing/disagreement", "routing disagreement")) if k in train]
    paths = [save(curves(train, panels,
                         f"{experiment}: training", smooth=5, log_keys=("mismatch/k3",)),
                  out_dir / f"{experiment}_training.png")]
    if not evals.empty:
        paths.append(save(curves(evals, [("eval/pass1", "held-out pass@1 (T=1)"), ("eval/greedy", "held-out greedy")],
                                 f"{experiment}: held-out accuracy"), out_dir / f"{experiment}_accuracy.png"))
    mitig = [(k, n) for k, n in (("clip/frac", "PPO clip fraction"), ("is/p99", "IS weight p99"),
                                 ("mask/token_frac", "masked token fraction"),
                                 ("effective/token_frac", "effective token fraction")) if k in train]
    if mitig:
        paths.append(save(curves(train, mitig, f"{experiment}: clipping and importance weights", smooth=5),
                          out_dir / f"{experiment}_mitigations.png"))
    if any(c.startswith("routing/agreement/layer") for c in train.columns):
        paths.append(save(routing_by_layer(train, f"{experiment}: routing disagreement per layer"),
                          out_dir / f"{experiment}_routing_layers.png"))
    return paths
