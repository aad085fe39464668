"""How every figure looks: one colour per arm in every figure of every experiment, one line style
and marker per rollout precision or variant, captions under the axes, and the off-screen backend
scripts draw with. The figure modules (plots, sample_plots, routing_plots, refit_plots,
registered_figures) take their styling from here, so an arm is recognisable across all of them.
"""
from __future__ import annotations

import hashlib
import os
import sys
import textwrap
from pathlib import Path

import matplotlib

# Scripts draw off-screen; a notebook kernel keeps its inline backend so figures show in cells.
if "ipykernel" not in sys.modules and "MPLBACKEND" not in os.environ:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

# One colour per arm, the same in every figure of every experiment. Related arms share a hue
# family (replay: blues, corrections: greens/olive, DeepSeek-V3 preset: reds, LoRA/refit: purples).
# The colour belongs to the base arm: a run named ``<arm>+<overrides>`` (a rung of a dose ladder,
# a setting swept) takes its arm's colour and tells its variant by line style and marker
# (:func:`arm_style`).
ARM_COLORS = {
    "fp32_rollout": "#000000",
    "fp32_control": "#000000",  # experiment 07's name for the fp32 rollout (no mismatch)
    "baseline": "#7f7f7f",
    "r2": "#9ecae1",
    "r3": "#1f77b4",
    "r3_tis": "#17becf",
    "tis": "#2ca02c",
    "mis": "#98df8a",  # the former name of the three MIS arms below
    "geo_mis_3pct": "#98df8a",  # 00: geometric MIS, band [0.97, 1.03]
    "seq_mis": "#98df8a",  # 05: sequence-level MIS (verl's Seq-MIS), band [0.5, 2]
    "geo_mis_0p1pct": "#98df8a",  # 07: geometric MIS, band [0.999, 1.001]
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
    # 07: the trainer's own weights fake-quantised to INT4 (golds)
    "qat_int4": "#8c6d31",
    "qat_int4_r3": "#bd9e39",
    "qat_int4_tis": "#e7ba52",
}
_FALLBACK = plt.cm.tab20.colors

# Rollout precisions in the order of the mismatch they cause (experiment 07's ladder): a run's
# ``rollout.dtype`` override takes the line style and marker of its place here, in every figure.
PRECISIONS = ("fp32", "bf16", "int8", "fp8", "nvfp4", "int4")
VARIANT_LINESTYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (1, 3)))
VARIANT_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def base_arm(run: str) -> str:
    """The arm a run name belongs to: the name before its first ``+`` (``tis+rollout.dtype=fp8`` ->
    ``tis``). A name that only extends a known arm (``tis_cap3``) belongs to that arm."""
    arm = run.split("+", 1)[0]
    if arm in ARM_COLORS:
        return arm
    stems = [a for a in ARM_COLORS if arm.startswith(a + "_")]
    return max(stems, key=len) if stems else arm


def run_variant(run: str) -> str:
    """What a run name adds to its arm: its overrides as ``key=value,...`` ('' for a plain arm),
    whichever spelling the run directory has (``tis+rollout.dtype-fp8`` or ``tis+rollout.dtype=fp8``)."""
    from moerl.config import legacy_run_label

    return legacy_run_label(run).partition("+")[2]


def arm_color(arm: str):
    """The colour of a run's base arm (:func:`base_arm`), the same in every figure; an arm not in
    ARM_COLORS gets a colour derived from its name, so it is also the same everywhere."""
    arm = base_arm(arm)
    if arm in ARM_COLORS:
        return ARM_COLORS[arm]
    digest = int(hashlib.sha1(arm.encode()).hexdigest(), 16)
    return _FALLBACK[digest % len(_FALLBACK)]


def _variant_index(variant: str) -> int:
    """0 for no variant; a rollout precision by its place in PRECISIONS; any other variant by a hash
    of its text (stable across figures)."""
    if not variant:
        return 0
    settings = dict(part.split("=", 1) for part in variant.split(",") if "=" in part)
    dtype = settings.get("rollout.dtype")
    if dtype in PRECISIONS:
        return PRECISIONS.index(dtype)
    return 1 + int(hashlib.sha1(variant.encode()).hexdigest(), 16) % (len(VARIANT_LINESTYLES) - 1)


def arm_style(run: str) -> dict:
    """Matplotlib style of a run name: its base arm's colour, its variant's line style and marker
    (the plain arm: solid, circles)."""
    i = _variant_index(run_variant(run))
    return {"color": arm_color(run), "ls": VARIANT_LINESTYLES[i], "marker": VARIANT_MARKERS[i]}


def add_caption(fig: plt.Figure, text: str, width: int = 0) -> None:
    """``text`` under the figure, wrapped to its width (saved with bbox_inches='tight')."""
    if not text:
        return

    width = width or max(int(fig.get_figwidth() * 15), 110)  # the legend beside the axes widens the saved figure
    fig.text(0.01, 0.0, textwrap.fill(text, width), ha="left", va="top", fontsize=8, style="italic",
             transform=fig.transFigure)


def outlier_keys(values: dict[str, float], factor: float = 5.0) -> set[str]:
    """Keys whose value exceeds ``factor`` times the median of the others: an arm (a broken replay)
    that would set a shared axis and flatten every other arm."""
    out = set()
    for k, v in values.items():
        others = [x for kk, x in values.items() if kk != k and np.isfinite(x)]
        if others and np.isfinite(v) and v > factor * max(np.median(others), 1e-12):
            out.add(k)
    return out


def arm_grid(arms: list[str], width: float = 2.6, height: float = 2.5, ncols: int = 4):
    """A grid of panels, one per arm, ``ncols`` wide; the unused panels of the last row hidden."""
    n = max(len(arms), 1)
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def save(fig: plt.Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG (parents created) and close it, so a long script does not hold every figure."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
