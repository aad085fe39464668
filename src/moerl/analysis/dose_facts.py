"""The measured facts experiment 07's README cites in its prose, computed from the recorded runs and files.

The README's interpretation is prose; every number it cites sits in a generated section written from
these functions by ``scripts/write_readme_numbers.py`` (whose ``--check`` the test suite runs), so a
re-recorded run or a changed rule cannot leave a stale number behind. The tables with many columns live
in moerl.analysis.dose_report; these are the measures those tables do not show.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from moerl.analysis.dose import (ACTS_ON_PREREGISTERED, CONTROL_GAIN, GEO_MIS, TIS_REWEIGHTED, metric_values,
                                 mismatch_order, regime)
from moerl.analysis.dose_report import by_seed, dose_order, fmt, ladder_rows, pre_collapse_ratios
from moerl.analysis.verdicts import EARLY_LATE_WINDOW
from moerl.tracking import read_metrics

# The warm start's regime criteria (calibrate.py): held-out pass@1 in the band, per-token entropy and
# answer length at least these.
CALIBRATION_REGIME = {"pass1": (0.25, 0.55), "entropy": 0.2, "length": 25}
# pass@1 at lower sampling temperatures: how much a policy could gain by sharpening alone, the easiest
# thing for GRPO to learn (greedy accuracy is the limit as T -> 0).
SHARPER_TEMPERATURES = (0.8, 0.6)
K3_WINDOW = 25  # steps: the per-step k3 is heavy-tailed, so its growth is read from 25-step medians


def _rows(run: dict) -> list[dict]:
    return [r for r in read_metrics(Path(run["run_dir"]) / "metrics.jsonl") if "reward/mean" in r]


def _window_mean(run: dict, key: str, which: str) -> float | None:
    """Mean of ``key`` over a run's first or last EARLY_LATE_WINDOW training steps."""
    v = metric_values(_rows(run), key)
    part = v[:EARLY_LATE_WINDOW] if which == "early" else v[-EARLY_LATE_WINDOW:]
    return float(np.nanmean(part)) if part.size else None


def _early_to_late(runs: dict[int, dict], key: str, show) -> str:
    """Per seed: ``key``'s mean over the first and the last EARLY_LATE_WINDOW steps, 'a → b', comma-separated."""
    return ", ".join(f"{show(_window_mean(runs[s], key, 'early'))} → {show(_window_mean(runs[s], key, 'late'))}"
                     for s in sorted(runs))


def _span(values, spec: str = ".3f", sign: bool = False) -> str:
    """'a–b' over seeds (or the one value), in the given format."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return "—"
    f = ("+" if sign else "") + spec
    lo, hi = format(vals[0], f), format(vals[-1], f)
    return lo if lo == hi else f"{lo} to {hi}" if sign else f"{lo}–{hi}"


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f} %"


def _gain(run: dict) -> float | None:
    if run.get("pass1_start") is None or run.get("pass1_end") is None:
        return None
    return run["pass1_end"] - run["pass1_start"]


def _eval(run: dict, key: str) -> tuple[float | None, float | None]:
    """A run's first and last logged value of an evaluation metric (e.g. eval/greedy)."""
    evals = [r[key] for r in read_metrics(Path(run["run_dir"]) / "metrics.jsonl") if key in r]
    return (evals[0], evals[-1]) if evals else (None, None)


def calibration_lines(table: dict[int, dict], chosen: int | None = None, saturated: tuple[int, dict] | None = None,
                      temperatures: tuple[float, ...] = SHARPER_TEMPERATURES) -> list[str]:
    """calibrate.py's table (results/07_dose_threshold/calibration.json): one row per warm-start length, the
    chosen one in bold; ``saturated`` adds experiment 05's warm start (steps, its step-0 evaluation) for
    comparison."""
    lines = ["| warm-start steps | pass@1 | pass@1 at T = " + " / ".join(f"{t:g}" for t in temperatures)
             + " | greedy | entropy (nats/token) | answer tokens | in regime |", "|---|---|---|---|---|---|---|"]
    for steps in sorted(table):
        r = table[steps]
        cool = r.get("pass1_at_temperature")
        cool = " / ".join(f"{cool[str(t)]:.3f}" for t in temperatures) if cool else "—"
        cells = [str(steps), f"{r['pass1']:.3f}", cool]
        if steps == chosen:
            cells = [f"**{c}**" for c in cells]
        lines.append(f"| {' | '.join(cells)} | {r['greedy']:.3f} | {r['entropy_per_token']:.3f} | "
                     f"{r['answer_tokens']:.1f} | {'yes' if r['in_regime'] else 'no'} |")
    if saturated is not None:
        steps, ev = saturated
        lines.append(f"| {steps} (experiment 05) | {ev['pass1']:.3f} | — | {ev['greedy']:.3f} | — | — | — |")
    return lines


def calibration_summary(table: dict[int, dict], chosen: int, temperatures: tuple[float, ...] = SHARPER_TEMPERATURES) -> str:
    """The chosen warm start against the regime criteria, and the room to learn by sharpening alone
    (pass@1 at the lowest temperature minus at T = 1) of every length measured at lower temperatures."""
    band, min_entropy = CALIBRATION_REGIME["pass1"], CALIBRATION_REGIME["entropy"]
    r = table[chosen]
    above = r["pass1"] - band[1]
    where = f"{above:.3f} above the band" if above > 0 else f"{-above:.3f} inside the band" if r["pass1"] >= band[0] \
        else f"{band[0] - r['pass1']:.3f} below the band"
    sharp = {s: t["pass1_at_temperature"][str(temperatures[-1])] - t["pass1"]
             for s, t in table.items() if t.get("pass1_at_temperature")}
    sharpening = ", ".join(f"{s} steps {'+' if d >= 0 else ''}{d:.2f}" for s, d in sorted(sharp.items()))
    return (f"Chosen: **{chosen} steps** — pass@1 {r['pass1']:.3f} ({where} [{band[0]:g}, {band[1]:g}]), entropy "
            f"{r['entropy_per_token']:.3f} nats/token (target ≥ {min_entropy:g}), {r['answer_tokens']:.1f}-token answers. "
            f"Sampling at T = {temperatures[-1]:g} instead of 1 changes pass@1 by: {sharpening}.")


def weight_errors(shape: tuple[int, int] = (64, 256), seed: int = 5) -> dict[str, float]:
    """Relative weight error ||q(w) - w|| / ||w|| of each rollout format on one seeded Gaussian matrix (the
    one tests/rollout/test_precision.py orders the formats on): the dose a format gives a weight, before
    any model turns it into a mismatch."""
    import torch

    from moerl.rollout.precision import QUANTIZERS

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    formats = {"bf16": lambda x: x.to(torch.bfloat16).float(), **QUANTIZERS}
    return {name: ((q(w) - w).norm() / w.norm()).item() for name, q in formats.items()}


def weight_error_line() -> str:
    errors = weight_errors()
    return ("Relative weight error on a seeded Gaussian 64 × 256 matrix: "
            + ", ".join(f"{name} {100 * e:.3g} %" for name, e in sorted(errors.items(), key=lambda kv: kv[1])) + ".")


def control_facts(runs: list[dict], reevaluated: dict | None = None) -> str:
    """The 3-seed control (``launch.sh control``): its gains, greedy accuracy, grad-norm maxima, the
    regime check and how far each seed is from the rule in completions; then the supplementary
    re-measurement (reevaluate_control.py) if recorded."""
    controls = sorted((r for r in runs if r["arm"] == "fp32_control"), key=lambda r: r["seed"])
    if not controls:
        return "The control has not been recorded."
    gains = [_gain(r) for r in controls]
    greedy = [_eval(r, "eval/greedy") for r in controls]
    collapsed = [r["seed"] for r in controls if r["collapse_step"] is not None]
    state = regime({r["seed"]: r for r in controls})
    starts = sorted({fmt(r["pass1_start"]) for r in controls})
    lines = [f"Control, {len(controls)} seeds: held-out pass@1 {' / '.join(starts)} → "
             f"{', '.join(fmt(r['pass1_end']) for r in controls)} (gains "
             f"{', '.join(f'{g:+.3f}' for g in gains)}), greedy {' / '.join(sorted({fmt(g[0]) for g in greedy}))} → "
             f"{_span([g[1] for g in greedy], '.2f')}, "
             + (f"collapsed in seeds {collapsed}" if collapsed else "no collapse")
             + f", grad-norm max {', '.join(fmt(r['grad_norm_max'], '.1f') for r in controls)}.",
             f"Regime: {state['status']}."]
    for r, g in zip(controls, gains):
        if g is not None and g < CONTROL_GAIN and r.get("eval_completions"):
            n = r["eval_completions"]
            lines.append(f"Seed {r['seed']} gains {g:.4f}: {round(g * n)} more correct completions of {n:,}, where "
                         f"{math.ceil(CONTROL_GAIN * n - 1e-9)} were needed.")
    if reevaluated:
        seeds = reevaluated["seeds"]
        again = [seeds[k]["remeasured"]["gain"] for k in sorted(seeds)]
        se = max(seeds[k]["remeasured"]["gain_se"] for k in seeds)
        short = [int(k.removeprefix("seed")) for k in sorted(seeds) if seeds[k]["remeasured"]["gain"] < CONTROL_GAIN]
        lines.append(f"Re-measured with {reevaluated['samples']} completions per problem (reevaluate_control.py, "
                     f"supplementary): gains {', '.join(f'{g:+.3f}' for g in again)} (± {se:.3f}, binomial), mean "
                     f"{np.mean(again):+.3f}; below +{CONTROL_GAIN:.2f} in " + (f"seeds {short}." if short else "no seed."))
    return "\n".join(lines)


def _k3_windows(run: dict, at: int = 100) -> tuple[float, float, float]:
    """25-step medians of the per-step k3: the first window, the window ending at step ``at``, the last."""
    k3 = metric_values(_rows(run), "mismatch/k3")
    w = K3_WINDOW
    return float(np.median(k3[:w])), float(np.median(k3[at - w:at])), float(np.median(k3[-w:]))


def ladder_facts(runs: list[dict]) -> str:
    """The seed-0 ladder's collapse, beside the control's seeds: which rungs collapse and how, the shape of
    the collapse at the threshold rung (k3 growth, grad-norm spikes, training reward), and what the
    rungs that do not collapse gain."""
    ladder, control = ladder_rows(runs)
    if control is None:
        return "The ladder's control has not been recorded."
    controls = [r for r in runs if r["arm"] == "fp32_control"]
    control_grad = max(r["grad_norm_max"] for r in controls)
    order = [r for r in mismatch_order(ladder) if r != "fp32"]
    collapsed = [r for r in order if ladder[r]["collapse_step"] is not None]
    lines = ["- collapsed (seed 0): " + ("; ".join(
        f"{r}: held-out pass@1 {fmt(ladder[r]['pass1_start'])} → {fmt(ladder[r]['pass1_end'])}, collapse step "
        f"{ladder[r]['collapse_step']}, run-median k3 {ladder[r]['k3_median']:.3f}" for r in collapsed) or "none"),
             f"- the control's gains over its {len(controls)} seeds: "
             f"{_span([_gain(r) for r in controls], '.3f', sign=True)}; its grad-norm max ≤ {control_grad:.1f}"]
    first = collapsed[0] if collapsed else None  # by k3, whether or not the control met its rule
    if first is not None:
        run = ladder[first]
        start, mid, end = _k3_windows(run)
        lines.append(f"- {first}, the lowest collapsing rung by k3: 25-step median k3 {start:.1e} at the start, "
                     f"{mid:.1e} by step 100, {end:.1e} at the end ({end / start:.0f}×); grad-norm max "
                     f"{run['grad_norm_max']:.0f}; training reward {run['reward_first']:.2f} → {run['reward_last']:.2f} "
                     f"(first → last 25 steps)")
    standing = [r for r in order if ladder[r]["collapse_step"] is None]
    if standing:
        lines.append("- no collapse: " + ", ".join(
            f"{r} gains {_gain(ladder[r]):+.3f} (grad-norm max {ladder[r]['grad_norm_max']:.1f})" for r in standing)
            + f"; the control's seed 0 gains {_gain(control):+.3f}")
    order_line = dose_order(ladder)
    if order_line:
        lines.append(f"- {order_line[0].lower()}{order_line[1:]}")
    return "\n".join(lines)


def grid_facts(runs: list[dict], rung: str) -> str:
    """The main grid's measures at ``rung`` that its table does not show: the uncorrected arm's own run
    (collapse steps, gains, drift, the ratio tail along training), the tail and capped share under TIS, the
    share keeping a gradient under MIS early and late, R3's k3 against the baseline's (whole run, and before
    the baseline's collapse), and the control's gains and grad-norm maxima."""
    base = by_seed(runs, "baseline", rung)
    control = by_seed(runs, "fp32_control")
    if not base:
        return f"The main grid at {rung} has not run yet."
    tail = "share of tokens with ρ outside [1/2, 2]"
    steps = [base[s]["collapse_step"] for s in sorted(base) if base[s]["collapse_step"] is not None]
    lines = [f"- baseline (seeds {sorted(base)}): collapse steps {steps or 'none'}; gains "
             f"{', '.join(f'{_gain(base[s]):+.3f}' for s in sorted(base))}; grad-norm max "
             f"{', '.join(format(base[s]['grad_norm_max'], '.0f') for s in sorted(base))}; k3 late / early "
             f"{EARLY_LATE_WINDOW} steps {_span([base[s]['k3_growth'] for s in base], '.1f')}×; {tail}, first → last "
             f"{EARLY_LATE_WINDOW} steps: {_early_to_late(base, TIS_REWEIGHTED, _pct)}",
             f"- control (seeds {sorted(control)}): gains {', '.join(f'{_gain(control[s]):+.3f}' for s in sorted(control))}; "
             f"grad-norm max ≤ {max(c['grad_norm_max'] for c in control.values()):.1f}"]
    tis = by_seed(runs, "tis", rung)
    if tis:
        capped = ACTS_ON_PREREGISTERED["tis"]
        lines.append(f"- tis: {tail}, first → last {EARLY_LATE_WINDOW} steps: {_early_to_late(tis, TIS_REWEIGHTED, _pct)}"
                     f"; capped (`{capped}`, the pre-registered measure): "
            + _span([tis[s]["acts_on"][capped] for s in tis], ".2%").replace("%", " %"))
    mis = by_seed(runs, GEO_MIS, rung)
    if mis:
        lines.append(f"- {GEO_MIS}: tokens keeping a gradient, first → last {EARLY_LATE_WINDOW} steps: "
                     + _early_to_late(mis, "effective/token_frac", lambda x: f"{x:.3f}"))
    r3 = by_seed(runs, "r3", rung)
    if r3:
        whole = [r3[s]["k3_median"] / base[s]["k3_median"] for s in sorted(set(r3) & set(base))]
        before = pre_collapse_ratios(r3, base)
        lines.append(f"- r3: run-median k3 ÷ the baseline's, same seed: {_span(whole, '.2f')}×"
                     + (f"; over the steps before the baseline's collapse: {_span(before.values(), '.2f')}×"
                        if before else ""))
    means = {arm: np.mean([_gain(r) for r in by_seed(runs, arm, rung).values()])
             for arm in ("tis", "r3") if by_seed(runs, arm, rung)}
    if len(means) == 2:
        lines.append(f"- tis − r3, mean final gain over seeds: {means['tis'] - means['r3']:+.3f}")
    return "\n".join(lines)



def mechanism_facts(every_run: list[dict], registered: dict, recorded: list[dict]) -> str:
    """The registered mechanism grid's measures its verdict table does not show, once the grid and the
    confirmatory control are complete: where every run starts and where the control ends; per 4-bit format
    the attention-only rung's k3 against the experts-only rung's and against the whole-model rung's seed-0
    ladder run (``recorded``: the ladder's runs); per rung and arm the mean gain over seeds (95 % t interval)."""
    from moerl.analysis import confirmatory, power

    status = confirmatory.progress(every_run, registered)
    if not (status.get("mechanism", {}).get("complete") and status.get("confirmatory_control", {}).get("complete")):
        return "The mechanism grid's facts are written once it and the confirmatory control are complete."
    grid = confirmatory.path_grids(registered)["mechanism"]
    cells = {(arm, rung): confirmatory.cell_by_seed(every_run, "mechanism", arm, rung, registered)
             for arm in grid.arms for rung in grid.only.get(arm, grid.rungs)}
    control = confirmatory.cell_by_seed(every_run, "confirmatory_control", "fp32_control", "fp32", registered)
    # The step-0 evaluation samples with the data seed, not the run's: every run of one policy starts at one
    # value; the QAT arms start from the warm start's weights on the INT4 grid, another policy.
    def starts_of(keys) -> str:
        found = sorted({round(r["pass1_start"], 6) for key in keys for r in cells.get(key, {}).values()})
        return " / ".join(f"{x:.4f}" for x in found) or "—"

    plain = [key for key in cells if not key[0].startswith("qat_")] + [("fp32_control", "fp32")]
    cells[("fp32_control", "fp32")] = control
    lines = [f"- held-out pass@1 at step 0: {starts_of(plain)} in every run of the fp32 control and of the "
             f"unquantised trainer (its evaluation samples with the data seed, so every seed starts at the same value), "
             f"{starts_of([k for k in cells if k[0].startswith('qat_')])} for the trainer on the INT4 grid (QAT); the "
             f"confirmatory control ends at {np.mean([r['pass1_end'] for r in control.values()]):.3f} "
             f"(mean of {len(control)} seeds)"]
    del cells[("fp32_control", "fp32")]
    k3 = {key: float(np.median([r["k3_median"] for r in runs.values()])) for key, runs in cells.items() if runs}
    ladder, _ = ladder_rows(recorded)
    for fmt_name in ("nvfp4", "int4"):
        attention, experts = k3.get(("baseline", f"{fmt_name}_attention")), k3.get(("baseline", f"{fmt_name}_experts"))
        whole = ladder.get(fmt_name, {}).get("k3_median")
        if attention is None or experts is None:
            continue
        lines.append(f"- {fmt_name}, the uncorrected arm's k3 (median over seeds of the run median): attention only "
                     f"{attention / experts:.0f}× experts only; attention only {attention / whole:.2f}× the "
                     f"whole-model rung's seed-0 ladder run" if whole else "")
    for rung in grid.rungs:
        parts = []
        for arm in grid.arms:
            runs = cells.get((arm, rung))
            if not runs:
                continue
            gains = [r["pass1_end"] - r["pass1_start"] for r in runs.values()]
            interval = power.t_interval(gains, level=0.95)
            parts.append(f"{arm} {interval[0]:+.3f} [{interval[1]:+.3f}, {interval[2]:+.3f}]")
        lines.append(f"- {rung}, mean held-out pass@1 gain over seeds [95 % t]: " + "; ".join(parts))
    gains = [r["pass1_end"] - r["pass1_start"] for r in control.values()]
    interval = power.t_interval(gains, level=0.95)
    lines.append(f"- the confirmatory control's gain: {interval[0]:+.3f} [{interval[1]:+.3f}, {interval[2]:+.3f}]")
    return "\n".join(line for line in lines if line)


def _window_median(values: np.ndarray, end: int, window: int = EARLY_LATE_WINDOW) -> float:
    """Median of per-step ``values`` over the ``window`` training steps ending at step ``end``."""
    return float(np.nanmedian(values[end - window:end]))


def drift_facts(every_run: list[dict], registered: dict) -> str:
    """The 600-step nvfp4 grid's measures beside its drift verdicts, once it and the confirmatory control
    are complete. The registered rule reads k3 over the first and last 50 steps; these split the run at its
    midpoint, where the 300-step grids end, so a reader sees whether a correction's drift goes on in the
    second half or levels off (stopped, or only slowed), and whether what an arm learned by the midpoint
    holds to the end (a delayed collapse would give it back)."""
    from moerl.analysis import confirmatory, power

    grid_name = "confirmatory_nvfp4_600"
    status = confirmatory.progress(every_run, registered)
    if not (status.get(grid_name, {}).get("complete") and status.get("confirmatory_control", {}).get("complete")):
        return "The 600-step grid's facts are written once it and the confirmatory control are complete."
    grid = confirmatory.path_grids(registered)[grid_name]
    mid, w = grid.steps // 2, EARLY_LATE_WINDOW
    control = confirmatory.cell_by_seed(every_run, "confirmatory_control", "fp32_control", "fp32", registered)
    control_steps = sorted({r["steps"] for r in control.values()})
    lines = [f"- the confirmatory control ({'/'.join(map(str, control_steps))} steps) ends at held-out pass@1 "
             f"{np.mean([r['pass1_end'] for r in control.values()]):.3f} (mean of {len(control)} seeds)"]
    for arm in grid.arms:
        runs = confirmatory.cell_by_seed(every_run, grid_name, arm, grid.rungs[0], registered)
        seeds = sorted(runs)
        rows = {s: read_metrics(Path(runs[s]["run_dir"]) / "metrics.jsonl") for s in seeds}  # each file once
        k3 = {s: metric_values([r for r in rows[s] if "reward/mean" in r], "mismatch/k3") for s in seeds}
        first = [_window_median(k3[s], mid) / _window_median(k3[s], w) for s in seeds]
        second = [_window_median(k3[s], grid.steps) / _window_median(k3[s], mid) for s in seeds]
        at_mid = [next((r["eval/pass1"] for r in reversed(rows[s]) if "eval/pass1" in r and r.get("step") == mid), None)
                  for s in seeds]
        change = [runs[s]["pass1_end"] - m for s, m in zip(seeds, at_mid) if m is not None]
        collapsed = [runs[s]["collapse_step"] for s in seeds if runs[s].get("collapse_step") is not None]
        registered_growth = _span([runs[s].get("k3_growth") for s in seeds], ".2f")
        line = (f"- {arm} ({len(seeds)} seeds): late / early {w} steps k3 (the drift rule's measure) "
                f"{registered_growth}×; k3 over steps {mid - w + 1}–{mid} ÷ the first {w}: "
                f"{_span(first, '.2f')}×; the last {w} ÷ steps {mid - w + 1}–{mid}: {_span(second, '.2f')}×; "
                f"collapse steps {collapsed or 'none'}")
        if len(change) == len(seeds) and len(change) > 1:
            interval = power.t_interval(change, level=0.95)
            line += (f"; held-out pass@1 at step {mid} {np.mean(at_mid):.3f}, at step {grid.steps} "
                     f"{np.mean([runs[s]['pass1_end'] for s in seeds]):.3f} (mean over seeds), change "
                     f"{interval[0]:+.3f} [{interval[1]:+.3f}, {interval[2]:+.3f}] (95 % t)")
        lines.append(line)
    return "\n".join(lines)
