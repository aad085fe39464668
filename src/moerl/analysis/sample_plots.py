"""Figures of per-token samples (``samples/*.npz``: the rollout's and trainer's logprob of each
sampled token, its importance ratio, whether a correction truncated or masked it): where the
mismatch sits and what each correction acts on. Used by notebook 03 and the figure set of an
experiment (:func:`moerl.analysis.plots.experiment_figures`).
"""
from __future__ import annotations

import matplotlib.ticker
import numpy as np
import pandas as pd

from moerl.analysis.figure_style import add_caption, arm_color, arm_grid, outlier_keys, plt

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


LEVEL_TEXT = {"sequence": "sequence ratio: product of its token ratios",
              "geometric": "sequence ratio: geometric mean of its token ratios"}


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values for a log axis from ``lo`` to ``hi`` that do not collide: decades over a wide
    range, 1-2-5 steps (or finer) over a narrow one."""
    decades = np.log10(hi / lo)
    if decades > 2.5:
        cands = [10.0 ** k for k in range(-8, 9)]
    elif decades > 0.6:
        cands = [m * 10.0 ** k for k in range(-8, 9) for m in (1, 2, 5)]
    else:  # round steps (0.05, 0.1, 0.2, ...) that give 3 to 6 ticks
        step = next((m * 10.0 ** k for k in range(-4, 3) for m in (1, 2, 5) if (hi - lo) / (m * 10.0 ** k) <= 6),
                    hi - lo)
        cands = [round(t, 6) for t in np.arange(np.ceil(lo / step) * step, hi, step)]
    ticks = [t for t in cands if lo <= t <= hi]
    return ticks or [lo, hi]


def ratio_histograms(samples: pd.DataFrame, key: str = "raw_ratio", title: str = "",
                     arms: list[str] | None = None, losses: dict[str, dict] | None = None,
                     caption: str = "") -> plt.Figure:
    """Per arm, the distribution of a per-token weight from samples/*.npz (all steps and seeds),
    on a log-x axis: 1 is no mismatch. ``losses`` (arm -> loss config) adds what each correction
    acts on: the TIS cap, the MIS / IcePop keep band (shaded). An arm whose loss works on a
    sequence-level ratio (MIS) is histogrammed per sequence on its own x range, and its axis says
    so. The x range covers the data's 0.01-99.99 % quantiles and every cap or band edge (so none is
    off the plot); the rare values beyond it are counted in the bins at its edges and in the panel
    title. Panels of a row share their y scale."""
    from moerl.analysis.results import is_level

    arms = [a for a in (arms or sorted(samples["arm"].unique())) if a in set(samples["arm"])]
    n = max(len(arms), 1)
    ncols = min(4, n)
    nrows = -(-n // ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(2.8 * ncols, 2.7 * nrows), squeeze=False, sharey="row")
    for ax in grid.flat[n:]:
        ax.set_visible(False)
    axes = list(grid.flat[:n])
    per_arm = {}
    for arm in arms:
        sub = samples[samples["arm"] == arm]
        level = is_level((losses or {}).get(arm))
        if level != "token" and "sample" in sub:
            sub = sub.drop_duplicates(["seed", "step", "sample"])  # one value per sequence
        x = sub[key].to_numpy(dtype=float)
        per_arm[arm] = (x[np.isfinite(x) & (x > 0)], level)
    def x_range(arms_here: list[str]) -> tuple[float, float]:
        vals = np.concatenate([per_arm[a][0] for a in arms_here] or [np.array([])])
        lo, hi = np.quantile(vals, [1e-4, 1 - 1e-4]) if vals.size else (0.9, 1.1)
        edges = [e for a in arms_here for _, e1, e2, _ in correction_marks((losses or {}).get(a))
                 for e in (e1, e2) if e is not None]
        lo, hi = min([lo, 1.0, *edges]), max([hi, 1.0, *edges])
        pad = (hi / lo) ** 0.06
        return lo / pad, hi * pad

    token_arms = [a for a in arms if per_arm[a][1] == "token"]
    shared = x_range(token_arms) if token_arms else None
    for ax, arm in zip(axes, arms):
        x, level = per_arm[arm]
        lo, hi = shared if level == "token" else x_range([arm])
        bins = np.geomspace(lo, hi, 60)
        ticks = _log_ticks(lo, hi)
        beyond = int(((x < lo) | (x > hi)).sum())
        ax.hist(np.clip(x, bins[0], bins[-1] * (1 - 1e-12)), bins=bins, color=arm_color(arm), alpha=0.85)
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
        unit = "tokens" if level == "token" else "sequences"
        ax.set_title(f"{arm}\np1={q[0]:.3g}  p99={q[1]:.3g}  n={x.size} {unit}"
                     + (f"\n{beyond} beyond the axis, in its edge bins" if beyond else ""), fontsize=8)
        ax.set_xlabel(LEVEL_TEXT.get(level, f"per-token {key}"), fontsize=7 if level != "token" else 8)
    for row in grid:
        row[0].set_ylabel("count (log)", fontsize=8)
        row[0].set_ylim(bottom=0.7)
    fig.suptitle(title or f"per-token {key} (all sampled steps and seeds)", fontsize=10)
    fig.tight_layout()
    add_caption(fig, caption)
    return fig


def sample_quantiles(samples: pd.DataFrame, key: str = "raw_ratio",
                     qs: tuple[float, ...] = (0.01, 0.5, 0.99)) -> pd.DataFrame:
    """Quantiles of a per-token quantity per (arm, step), pooled over seeds: a tidy frame with
    columns arm, step, and one column per quantile (q0.01, ...)."""
    grouped = samples.groupby(["arm", "step"])[key]
    out = pd.concat({f"q{q:g}": grouped.quantile(q) for q in qs}, axis=1).reset_index()
    out["tokens"] = grouped.size().to_numpy()
    return out


def spread_over_training(samples: pd.DataFrame, key: str = "raw_ratio", qs: tuple[float, float] = (0.01, 0.99),
                         title: str = "", arms: list[str] | None = None) -> plt.Figure:
    """Does the spread of a per-token quantity change over training? Per arm (one row each), the
    spread ln(p99 / p1) of ``key`` at each sampled step (seeds pooled; small dots), and its median
    over the first and the last third of the sampled steps (open and filled marker, joined), the
    late / early ratio written at the right. The median of a ratio is 1 for every arm and is not
    drawn; on a log axis an arm with no mismatch (fp32) stays on the plot, decades to the left."""
    arms = [a for a in (arms or sorted(samples["arm"].unique())) if a in set(samples["arm"])]
    table = sample_quantiles(samples[samples["arm"].isin(arms)], key, qs)
    lo_col, hi_col = f"q{qs[0]:g}", f"q{qs[1]:g}"
    table["spread"] = np.log(table[hi_col] / table[lo_col])
    # An arm with (almost) no mismatch (fp32 rollout) would stretch the axis by decades: named below instead.
    typical = table.groupby("arm")["spread"].median()
    floor_arms = [a for a in arms if typical.get(a, 0) < 1e-3 * float(typical.median())]
    arms = [a for a in arms if a not in floor_arms]
    y = np.arange(len(arms))[::-1]
    fig, ax = plt.subplots(figsize=(7.4, 0.38 * len(arms) + 1.6))
    positive = table.loc[table["spread"] > 0, "spread"]
    floor = float(positive.min()) if len(positive) else 1e-6
    right = []
    for yy, arm in zip(y, arms):
        sub = table[table["arm"] == arm].sort_values("step")
        spread = sub["spread"].to_numpy(dtype=float)
        third = max(1, len(spread) // 3)
        early, late = float(np.median(spread[:third])), float(np.median(spread[-third:]))
        color = arm_color(arm)
        ax.scatter(np.maximum(spread, floor), np.full(len(spread), yy), s=7, color=color, alpha=0.35, lw=0)
        if early > 0 and late > 0:
            ax.plot([early, late], [yy, yy], color=color, lw=1.5)
            ax.plot([early], [yy], "o", mfc="white", mec=color, ms=7, mew=1.5)
            ax.plot([late], [yy], "o", color=color, ms=7)
            right.append((yy, f"×{late / early:.2g}"))
        else:
            right.append((yy, "no spread"))
    ax.set_xscale("log")
    ax.set_yticks(y, arms, fontsize=9)
    ax.set_ylim(-0.7, len(arms) - 0.3)
    for yy, text in right:
        ax.text(1.01, yy, text, transform=ax.get_yaxis_transform(), va="center", fontsize=8)
    ax.set_xlabel(f"spread of {key}: ln(p{qs[1] * 100:g} / p{qs[0] * 100:g}) per sampled step (log axis)", fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    from matplotlib.lines import Line2D

    ax.legend(handles=[Line2D([], [], marker="o", ls="none", mfc="white", mec="k", label="first third of training"),
                       Line2D([], [], marker="o", ls="none", color="k", label="last third"),
                       Line2D([], [], marker="o", ls="none", color="k", alpha=0.35, ms=3, label="each sampled step")],
              fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    fig.suptitle(title or f"Does the spread of {key} change over training?", fontsize=10)
    fig.tight_layout()
    floor = "; ".join(f"{a} (spread ~{typical[a]:.1g}, numerical floor)" for a in floor_arms)
    add_caption(fig, "Right: the spread's median over the last third of the sampled steps divided by that over the "
                "first third. Quantiles are of all sampled tokens of the arm at that step, seeds pooled."
                + (f" Not drawn: {floor}." if floor else ""))
    return fig


def logprob_scatter(samples: pd.DataFrame, title: str = "", max_points: int = 4000, seed: int = 0,
                    arms: list[str] | None = None) -> plt.Figure:
    """Per arm, the per-token log-ratio log pi_old - log pi_rollout against the rollout logprob of
    the same sampled token: where (at which token probabilities) the mismatch sits; red points were
    truncated (TIS) or masked (IcePop/MIS). The y scale is shared so arms compare directly, except
    for an arm whose spread is over 10x the others' (a broken replay): it gets its own, and says so."""
    arms = [a for a in (arms or sorted(samples["arm"].unique())) if a in set(samples["arm"])]
    fig, axes = arm_grid(arms, width=2.6, height=2.5)
    delta_all = (samples["trainer_logp"] - samples["rollout_logp"]).abs()
    spans = {arm: float(np.nanquantile(delta_all[samples["arm"] == arm], 0.9995)) for arm in arms}
    own = outlier_keys(spans, factor=10.0)
    span = max([v for a, v in spans.items() if a not in own] or [1e-6]) or 1e-6
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
        limit = (spans[arm] or 1e-6) if arm in own else span
        ax.set_ylim(-1.1 * limit, 1.1 * limit)
        ax.set_title(arm + ("\n(own y scale: spread > 10× the others')" if arm in own else ""), fontsize=9,
                     color="C3" if arm in own else "k")
        ax.set_xlabel("rollout logprob", fontsize=8)
        ax.set_ylabel("log pi_old - log pi_rollout", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(title or "where the mismatch sits: per-token log-ratio vs token probability", fontsize=10)
    fig.tight_layout()
    return fig


def mis_caption(losses: dict[str, dict] | None) -> str:
    """Why an MIS band reads as it does: it bounds a sequence ratio, whose spread depends on the level."""
    from moerl.analysis.results import is_level

    parts = []
    for arm, loss in sorted((losses or {}).items()):
        level = is_level(loss)
        if loss.get("variant") == "mis" and level != "token":
            parts.append(f"{arm} keeps sequences whose {LEVEL_TEXT[level].split(': ')[1]} lies in "
                         f"[{loss.get('mis_lower', 0.5):g}, {loss.get('mis_upper', 2.0):g}]")
    if not parts:
        return ""
    return ("; ".join(parts) + ". A product over a sequence's tokens spreads far wider than their geometric mean "
            "(a per-token average), so a band on the product is set wide and a band on the geometric mean "
            "narrow.")
