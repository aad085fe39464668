"""Figures and tables of routing agreement per MoE layer: where trainer and rollout route
differently, by global layer number (so a dense-first-layer model lines up with the others). Used by
notebook 04 and the figure set of an experiment.
"""
from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd

from moerl.analysis.figure_style import arm_color, outlier_keys, plt

def routing_by_layer(df: pd.DataFrame, title: str, arms: list[str] | None = None,
                     presets: dict[str, str] | None = None, others: list[str] | None = None) -> plt.Figure:
    """Share of tokens whose trainer-native top-k differs from the rollout's, per MoE layer and arm.
    The x axis is the global layer number for every preset (a DeepSeek-V3-style model's first
    layers are dense and have no router, so its bars start later). One panel per preset
    (``presets``: arm -> preset); an arm far above the rest of its panel is drawn clipped, its
    values written on its bars. ``others``: arms drawn not as bars but as one grey band per panel,
    the min-max over them at each layer (arms that route alike, drawn without a bar each)."""
    cols = sorted((c for c in df.columns if c.startswith("routing/agreement/layer")),
                  key=lambda c: int(c.rsplit("layer", 1)[1]))
    arms = [a for a in (arms or sorted(df["arm"].unique())) if a in set(df["arm"])]
    groups: dict[str, list[str]] = {}
    for arm in arms:
        groups.setdefault((presets or {}).get(arm, ""), []).append(arm)
    fig, axes = plt.subplots(1, len(groups), figsize=(4.8 * len(groups) + 0.6, 4.0), squeeze=False)
    for ax, (preset, members) in zip(axes[0], groups.items()):
        shown = df[df["arm"].isin(members)]
        layers = [c for c in cols if shown[c].notna().any()]
        numbers = [int(c.rsplit("layer", 1)[1]) for c in layers]
        vals = {arm: np.array([1 - shown.loc[shown["arm"] == arm, c].mean() for c in layers]) for arm in members}
        peaks = {arm: float(np.nanmax(v)) if np.isfinite(v).any() else np.nan for arm, v in vals.items()}
        clipped = outlier_keys(peaks)
        top = max([p for a, p in peaks.items() if a not in clipped and np.isfinite(p)] or [1.0]) * 1.3
        width = 0.8 / max(len(members), 1)
        rest = [a for a in (others or []) if (presets or {}).get(a, "") == preset and a in set(df["arm"])]
        dis_rest = {a: np.array([1 - df.loc[df["arm"] == a, c].mean() for c in layers]) for a in rest}
        aligned = sorted(a for a, v in dis_rest.items() if not np.nanmax(v, initial=0) > 0)  # fp32: none differ
        banded = sorted(a for a in dis_rest if a not in aligned)
        if banded:
            table = np.array([dis_rest[a] for a in banded])
            lo, hi = np.nanmin(table, axis=0), np.nanmax(table, axis=0)
            ax.bar(numbers, np.minimum(hi, top) - np.minimum(lo, top), 0.9, bottom=np.minimum(lo, top),
                   color="0.8", alpha=0.6, zorder=0,
                   label=textwrap.fill(f"grey: min-max of {', '.join(banded)}", 60))
        if aligned:
            ax.plot([], [], ls="none", label=textwrap.fill(f"{', '.join(aligned)}: 0 in every layer", 60))
        for i, arm in enumerate(members):
            x = np.array(numbers) + (i - (len(members) - 1) / 2) * width
            v = vals[arm]
            ax.bar(x, np.minimum(v, top), width, color=arm_color(arm), hatch="//" if arm in clipped else None,
                   label=arm + (" (clipped, values on bars)" if arm in clipped else ""))
            if arm in clipped:
                for xi, vi in zip(x, v):
                    if np.isfinite(vi):
                        ax.text(xi, top * 0.5, f"{vi:.2f}", rotation=90, ha="center", va="center", fontsize=7,
                                bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
        ax.set_ylim(0, top)
        ax.set_xticks(numbers, [str(n) for n in numbers], fontsize=8)
        ax.set_xlabel("global layer number (layers without a router not shown)", fontsize=8)
        ax.set_title(f"{preset} preset" if preset else title, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1 if rest else 2, frameon=False)
    axes[0][0].set_ylabel("tokens whose native top-k\ndiffers from the rollout's", fontsize=8)
    if len(groups) > 1 or next(iter(groups)):
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def routing_layers_table(df: pd.DataFrame, summaries: pd.DataFrame | None = None) -> pd.DataFrame:
    """Mean routing agreement per arm (rows) and MoE layer (columns, global layer numbers), with
    the arm's preset and replay mode when ``summaries`` (moerl.analysis.results.load_summaries) is given."""
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
