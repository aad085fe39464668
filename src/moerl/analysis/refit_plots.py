"""Figures of the refit benchmark (``benchmarks/bench_refit.py``'s JSON): what a refit costs,
adapter-only against merged, whether the engine's weights drift over refits, and what a refit would
send at the cluster models' size. Used by scripts/make_figures.py and notebook 05.
"""
from __future__ import annotations

import numpy as np

from moerl.analysis.figure_style import plt

REFIT_MODE_LABELS = {"adapter": "adapter-only (engine keeps bf16 W, applies the adapter unmerged)",
                     "merged": "merged (adapter merged into a bf16 base and unmerged, each refit)"}


def refit_figures(bench: dict, name: str = "bench_refit") -> dict[str, plt.Figure]:
    """One question per figure, from benchmarks/bench_refit.py's JSON: ``cost`` (what does a refit cost,
    adapter-only vs merged: measured time and bytes per preset), ``drift`` (does the engine's copy of
    the weights drift over repeated refits?) and ``at_scale`` (how many bytes would a refit send at
    the cluster models' size, analytic); the last two only when the JSON holds them."""
    presets = bench.get("presets")
    if not isinstance(presets, list) or not presets:
        raise KeyError(f"{name}.json: expected a non-empty list 'presets' with adapter/merged entries "
                       f"(have keys {sorted(bench)})")
    figures = {}
    mode_colors = {"adapter": "C0", "merged": "C1"}
    labels = [f"{p.get('preset', i)}\n({p['base_params'] / 1e6:.3g} M params)" if p.get("base_params")
              else str(p.get("preset", i)) for i, p in enumerate(presets)]
    x = np.arange(len(presets))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.0))
    for j, mode in enumerate(("adapter", "merged")):
        for ax, values in ((axes[0], [p.get(mode, {}).get("seconds_median", np.nan) * 1e3 for p in presets]),
                           (axes[1], [p.get(mode, {}).get("bytes", np.nan) / 2**20 for p in presets])):
            bars = ax.bar(x + 0.4 * j - 0.2, values, 0.4, label=REFIT_MODE_LABELS[mode], color=mode_colors[mode])
            ax.bar_label(bars, [f"{v:.3g}" for v in values], fontsize=9)
    for ax, ylabel in ((axes[0], "ms per refit (median over rounds)"), (axes[1], "MiB sent per refit")):
        ax.set_xticks(x, labels, fontsize=10)
        ax.set_yscale("log")
        ax.set_ylabel(ylabel, fontsize=10)
        ax.margins(y=0.25)
        ax.grid(alpha=0.3, axis="y")
    ratios = "; ".join(f"{p.get('preset')}: {p['speedup_adapter_vs_merged']:.2g}× faster, "
                       f"{p.get('bytes_ratio', float('nan')):.2g}× fewer bytes" for p in presets
                       if "speedup_adapter_vs_merged" in p)
    axes[0].set_title("time per refit", fontsize=11)
    axes[1].set_title("bytes per refit", fontsize=11)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=1,
               fontsize=9, frameon=False)
    fig.suptitle("What does a refit cost, adapter-only against merged?" + (f"\n(adapter-only {ratios})" if ratios else ""),
                 fontsize=11)
    fig.tight_layout()
    figures["cost"] = fig
    drift = bench.get("drift") or {}
    if drift:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for mode, values in drift.items():
            ax.plot(np.arange(1, len(values) + 1), values, label=REFIT_MODE_LABELS.get(mode, mode),
                    color=mode_colors.get(mode), lw=2)
            ax.annotate(f"{values[-1]:.2g}", (len(values), values[-1]), xytext=(4, 0), textcoords="offset points",
                        va="center", fontsize=9, color=mode_colors.get(mode))
        ax.set_xlabel("refits", fontsize=10)
        ax.set_ylabel("relative error of the engine's weights\n(Frobenius, vs the trainer's fp32 W + BA)", fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
        ax.set_title("Does the engine's copy of the weights drift over repeated refits?", fontsize=11)
        fig.tight_layout()
        figures["drift"] = fig
    analytic = bench.get("analytic") or {}
    if analytic:
        fig, ax = plt.subplots(figsize=(9.0, 4.2))
        models = list(analytic)
        keys = sorted({k[: -len("_bytes")] for m in models for k in analytic[m] if k.endswith("_bytes")},
                      key=lambda k: (k != "full_bf16", k))
        width = 0.8 / max(len(keys), 1)
        for i, k in enumerate(keys):
            ax.bar(np.arange(len(models)) + i * width, [analytic[m].get(f"{k}_bytes", np.nan) / 2**30 for m in models],
                   width, label="merged: every weight in bf16" if k == "full_bf16" else f"adapter-only, {k}",
                   color=plt.cm.Set2.colors[i % 8])
        ax.set_xticks(np.arange(len(models)) + 0.4 - width / 2, [m.split(" (")[0] for m in models], fontsize=10)
        ax.set_yscale("log")
        ax.set_ylabel("GiB per refit", fontsize=10)
        ax.legend(fontsize=8, frameon=False, loc="center left", bbox_to_anchor=(1.0, 0.5),
                  title="LoRA rank, expert layout", title_fontsize=8)
        ax.grid(alpha=0.3, axis="y")
        ax.set_title("How many bytes would a refit send at the cluster models' size? (analytic)", fontsize=11)
        fig.tight_layout()
        figures["at_scale"] = fig
    return figures
