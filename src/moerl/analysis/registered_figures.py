"""Figures of experiment 07's registered grids (moerl.analysis.confirmatory), one question each.

Each figure is drawn only once its grid's verdicts are unsealed -- every registered run of the grid and of
the confirmatory control finished -- and returns None before: a figure of a partial grid would show what
pre-registration keeps out of sight until the last seed is in. Every verdict is drawn with its marks: a
gate that decided it ("regime gate", "acts on < floor", with the ungated verdict) and ``*`` where a rule it
uses was set after the grid's first run (post hoc).

- ``confirmatory_figure``: which arm ends where the fp32 control ends, at fp8?
- ``drift_figure``: at nvfp4 over 600 steps, does a correction stop the drift or only delay the collapse?
- ``mechanism_figure``: where does the 4-bit mismatch live (experts or attention; Kimi's INT4 experts), and
  which arm prevents the collapse it causes?
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from moerl.analysis import confirmatory, power
from moerl.analysis.dose import EXPERIMENT, REGISTERED
from moerl.analysis.figure_style import arm_color, plt, save
from moerl.analysis.registration import Registration, analysis_path
from moerl.analysis.verdicts import DRIFT_GROWTH, EARLY_LATE_WINDOW
from moerl.tracking import read_metrics

ROLLING = 25  # steps: per-step k3 is heavy-tailed; a rolling median shows its trend


@dataclass(frozen=True)
class Unsealed:
    """A grid whose verdicts may be drawn: its verdicts, the whole report, its registered plan, and
    ``late(name, verdict)``: ' *' where a rule the verdict uses was set after the grid's first run, else ''."""
    verdicts: dict
    result: dict
    spec: confirmatory.Grid
    late: Callable[[str, dict], str]


def _unsealed(every_run: list[dict], grid: str) -> Unsealed | None:
    """The grid once its verdicts are unsealed; None before."""
    result = confirmatory.report(every_run, REGISTERED, confirmatory.rules_of(REGISTERED))
    verdicts = result["verdicts"].get(grid)
    if not verdicts:
        return None
    path_runs = [r for r in every_run if confirmatory.grid_of(r, REGISTERED) is not None]
    label = Registration(analysis_path(EXPERIMENT), runs=path_runs).labels
    return Unsealed(verdicts, result, confirmatory.path_grids(REGISTERED)[grid],
                    lambda name, v: " *" if label(confirmatory.rules_used(name, v, grid, REGISTERED), grid) else "")


def _gate(v: dict, sep: str = " ") -> str:
    """The gate that decided a verdict, with the verdict it would have had without it ('' if none)."""
    return (f"{sep}(acts on < floor; ungated {v['floor_ungated']})" if "floor_ungated" in v
            else f"{sep}(regime gate; ungated {v['ungated']})" if "ungated" in v else "")


def _members(every_run: list[dict], grid: str, arm: str, rung: str) -> dict[int, dict]:
    """The grid's finished runs of ``arm`` at ``rung``, by seed (the same runs its verdicts read)."""
    return confirmatory.cell_by_seed(every_run, grid, arm, rung, REGISTERED)


def rolling_median(values: np.ndarray, window: int = ROLLING) -> np.ndarray:
    """The trailing median over ``window`` steps (fewer at the start), NaN-aware."""
    return np.array([np.nanmedian(values[max(0, i - window + 1): i + 1]) for i in range(len(values))])


def confirmatory_figure(every_run: list[dict], path: Path) -> Path | None:
    """One question: on the registered fp8 grid, which arm ends where the fp32 control ends? Per arm, each
    seed's final held-out pass@1 minus the control's of the same seed, the mean with the one-sided 95 % t
    bounds of its "like the control" rule, and under each arm its registered verdicts."""
    grid = _unsealed(every_run, "confirmatory_fp8")
    if grid is None:
        return None
    verdicts, late = grid.verdicts, grid.late
    like = confirmatory.rules_of(REGISTERED)["like_control_t"]
    differences = confirmatory.minus_control(every_run, REGISTERED)

    def verdict_line(name: str) -> str:
        v = verdicts[name]
        kind = "behind the control" if name.endswith("behind control") else name.split(" ", 1)[1].replace("_", " ")
        return f"{kind}: {v['verdict']}{_gate(v, sep=chr(10))}{late(name, v)}"

    fig, ax = plt.subplots(figsize=(10.5, 5.4))
    arms = list(differences)
    for i, arm in enumerate(arms):
        values = differences[arm]
        ax.scatter([i] * len(values), list(values.values()), color=arm_color(arm), alpha=0.7, zorder=3, s=18)
        bounds = power.t_interval(values.values(), level=2 * like["level"] - 1)
        if bounds:
            mean, low, high = bounds
            ax.errorbar(i + 0.22, mean, yerr=[[mean - low], [high - mean]], fmt="s", color="k", ms=4, capsize=4,
                        zorder=4)
    ax.axhline(0, color="k", lw=0.6)
    ax.axhspan(-like["margin"], 0, color="tab:gray", alpha=0.2, lw=0,
               label=f"at most {like['margin']:g} below the control: \"trains like it\" needs the lower bound here")
    names = {arm: [n for n in verdicts if n.split(" ", 1)[0] == arm or (arm == "baseline" and n.startswith("baseline"))]
             for arm in arms}
    ax.set_xticks(range(len(arms)), [f"{arm}\n{len(differences[arm])} seeds\n" + "\n".join(verdict_line(n) for n in names[arm])
                                    for arm in arms], fontsize=7)
    ax.set_xlim(-0.6, len(arms) - 0.3)
    ax.set_ylabel("final held-out pass@1 − control's (same seed)")
    ax.legend(loc="lower right", fontsize=7)
    regime = grid.result["verdicts"]["confirmatory_control"]["regime"]["verdict"]
    fig.suptitle("Experiment 07, registered fp8 grid: which arm ends where the fp32 control ends?\n"
                 f"dots: seeds; square and bar: mean and its one-sided 95 % t bounds; control's regime: {regime}; "
                 "under each arm its registered verdicts (\"helps\": against the baseline, paired by seed; * post hoc)",
                 fontsize=9)
    fig.tight_layout()
    return save(fig, path)


def drift_figure(every_run: list[dict], path: Path) -> Path | None:
    """One question: at nvfp4 over 600 steps, does a correction stop the drift or only delay the collapse?
    One column per arm. Top: each seed's per-step k3 of the rollout against the fp32 trainer (rolling
    median), the early and late windows the drift rule compares shaded, collapse steps marked, and the arm's
    registered ``keeps drifting`` verdict with each seed's late / early growth. Bottom: each seed's held-out
    pass@1 along training beside the confirmatory control's final one, so a collapse the correction only
    delayed shows as pass@1 given back after step 300, where the other grids end (dotted)."""
    grid = _unsealed(every_run, "confirmatory_nvfp4_600")
    if grid is None:
        return None
    verdicts, late, spec = grid.verdicts, grid.late, grid.spec
    rung = spec.rungs[0]
    control = _members(every_run, "confirmatory_control", "fp32_control", "fp32")
    control_end = float(np.mean([r["pass1_end"] for r in control.values()]))
    control_steps = "/".join(str(s) for s in sorted({r["steps"] for r in control.values()}))
    fig, axes = plt.subplots(2, len(spec.arms), figsize=(3.4 * len(spec.arms), 7.2), sharey="row", sharex=True,
                             squeeze=False, gridspec_kw={"height_ratios": [3, 2]})
    for column, arm in enumerate(spec.arms):
        top, bottom = axes[0][column], axes[1][column]
        runs = _members(every_run, spec.name, arm, rung)
        for shade, seed in zip(np.linspace(0.45, 1.0, len(runs)), sorted(runs)):
            run = runs[seed]
            rows = read_metrics(Path(run["run_dir"]) / "metrics.jsonl")
            trained = [r for r in rows if isinstance(r.get("mismatch/k3"), (int, float))]
            steps = np.array([r["step"] for r in trained])
            k3 = rolling_median(np.array([r["mismatch/k3"] for r in trained], dtype=float))
            top.semilogy(steps, k3, color=arm_color(arm), alpha=shade, lw=1)
            if run.get("collapse_step") is not None and len(steps):
                at = int(np.searchsorted(steps, run["collapse_step"]).clip(0, len(steps) - 1))
                top.plot(steps[at], k3[at], "x", color="k", ms=7, mew=1.5, zorder=4)
            evals = [r for r in rows if "eval/pass1" in r]
            bottom.plot([r["step"] for r in evals], [r["eval/pass1"] for r in evals], "o-", ms=2.5, lw=1,
                        color=arm_color(arm), alpha=shade)
        top.axvspan(0, EARLY_LATE_WINDOW, color="tab:gray", alpha=0.15, lw=0)
        top.axvspan(spec.steps - EARLY_LATE_WINDOW, spec.steps, color="tab:gray", alpha=0.15, lw=0)
        for ax in (top, bottom):
            ax.axvline(spec.steps // 2, color="k", ls=":", lw=0.8)
        # the control ran fewer steps than this grid: its line stops where the control stopped
        bottom.hlines(control_end, 0, max(r["steps"] for r in control.values()), color=arm_color("fp32_control"),
                      ls="--", lw=1, label=f"fp32 control's end (step {control_steps}, {len(control)} seeds)")
        growth = [r.get("k3_growth") for r in runs.values()]
        growth_text = ", ".join("—" if g is None else f"{g:.2g}" for g in growth)
        name = f"{arm} keeps_drifting"
        if name in verdicts:
            v = verdicts[name]
            head = f"keeps drifting: {v['verdict']}{late(name, v)}{_gate(v)}"
        else:  # the uncorrected arm: the drift the corrections are judged against
            head = "the drift to stop"
        top.set_title(f"{arm} ({len(runs)} seeds)\n{head}\nlate / early k3: {growth_text}", fontsize=8)
        bottom.set_xlabel("GRPO step")
    axes[0][0].set_ylabel(f"k3, rollout vs fp32 trainer\n({ROLLING}-step rolling median)")
    axes[1][0].set_ylabel("held-out pass@1 (fp32 evaluator)")
    axes[1][0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"Experiment 07, registered {rung} grid, {spec.steps} steps: does a correction stop the drift "
                 "or only delay the collapse?\n"
                 f"lines: seeds; shaded: the first and last {EARLY_LATE_WINDOW} steps the drift rule compares (drifts: "
                 f"late / early median k3 > {DRIFT_GROWTH:g} in every seed); x: collapse step; dotted: step "
                 f"{spec.steps // 2}, where the other grids end; * post hoc", fontsize=9)
    fig.tight_layout()
    return save(fig, path)


def _mechanism_rung(name: str, spec: confirmatory.Grid) -> tuple[str, str]:
    """(arm, rung) a mechanism verdict is about: its ``at <rung>``, else the one rung its arm runs at."""
    arm = name.split(" ", 1)[0]
    return arm, name.rsplit(" at ", 1)[1] if " at " in name else spec.only.get(arm, spec.rungs)[0]


def mechanism_figure(every_run: list[dict], path: Path) -> Path | None:
    """One question: where does the 4-bit mismatch live, and which arm prevents the collapse it causes?
    Per rung (each 4-bit format on the routed experts only or on attention only; Kimi's INT4 experts) and arm:
    the seeds that collapsed with the registered verdicts about that arm there, and each seed's run-median k3
    (the dose that part of the model gives)."""
    import textwrap

    from matplotlib.transforms import blended_transform_factory

    grid = _unsealed(every_run, "mechanism")
    if grid is None:
        return None
    verdicts, late, spec = grid.verdicts, grid.late, grid.spec
    cells = [(rung, arm) for rung in spec.rungs for arm in spec.arms if rung in spec.only.get(arm, spec.rungs)]
    about: dict[tuple[str, str], list[str]] = {}
    for name, v in verdicts.items():
        arm, rung = _mechanism_rung(name, spec)
        kind = name.split(" ", 1)[1].rsplit(" at ", 1)[0].replace("_", " ")
        about.setdefault((rung, arm), []).append(
            "\n".join(textwrap.wrap(f"{kind}: {v['verdict']}{late(name, v)}{_gate(v)}", 15)))
    x, at, groups = 0.0, {}, {}
    for i, (rung, arm) in enumerate(cells):
        if i and rung != cells[i - 1][0]:
            x += 0.6  # a gap between rungs
        at[(rung, arm)] = x
        groups.setdefault(rung, []).append(x)
        x += 1.0
    fig, (ax_c, ax_k) = plt.subplots(2, 1, figsize=(1.05 * x + 1.5, 8.6), sharex=True,
                                     gridspec_kw={"height_ratios": [1.3, 1]})
    for (rung, arm), xi in at.items():
        runs = _members(every_run, spec.name, arm, rung)
        collapsed = sum(r.get("collapse_step") is not None for r in runs.values())
        share = collapsed / len(runs) if runs else 0.0
        ax_c.bar(xi, share, width=0.8, color=arm_color(arm), edgecolor="k", lw=0.4)
        ax_c.text(xi, share + 0.03, "\n".join([f"{collapsed}/{len(runs)}", *about.get((rung, arm), [])]),
                  ha="center", va="bottom", fontsize=6.5)
        k3 = [r["k3_median"] for r in runs.values() if r.get("k3_median")]
        ax_k.scatter([xi] * len(k3), k3, color=arm_color(arm), s=16, zorder=3)
    for ax in (ax_c, ax_k):
        for xs in list(groups.values())[1:]:
            ax.axvline(xs[0] - 0.8, color="k", lw=0.5, ls=":")
    ax_c.set_ylim(0, 1.7)
    ax_c.set_yticks([0, 0.5, 1.0])
    ax_c.set_ylabel("share of seeds that collapsed")
    ax_k.set_yscale("log")
    ax_k.set_ylabel("k3, rollout vs fp32 trainer\n(run median, one dot per seed)")
    ax_k.set_xticks(list(at.values()), [arm for _, arm in at], fontsize=7, rotation=30, ha="right")
    below = blended_transform_factory(ax_k.transData, ax_k.transAxes)
    for rung, xs in groups.items():
        ax_k.text(sum(xs) / len(xs), -0.32, f"rollout {rung}", transform=below, ha="center", va="top", fontsize=9)
    fig.suptitle("Experiment 07, registered mechanism grid: where does the 4-bit mismatch live, and which arm "
                 "prevents the collapse it causes?\nabove each bar: collapsed seeds and the registered verdicts "
                 "about that arm at that rung (* post hoc); qat_*: the trainer's own weights fake-quantised to INT4",
                 fontsize=9)
    fig.tight_layout()
    return save(fig, path)
