"""Experiment 07's tables and figures from its recorded runs: the dose ladder (one row per rung of the
uncorrected arm, the fp32 control first), the control's learning test, the threshold, and, where the main
grid has run, every mitigation arm per rung.

    .venv/bin/python experiments/07_dose_threshold/report.py [--runs results/runs] [--out results/07_dose_threshold]
    .venv/bin/python experiments/07_dose_threshold/report.py --pilots results/pilots/07_*   # the regime pilots

Writes ``<out>/ladder.md`` and ``<out>/ladder.json`` and draws ``results/figures/07_dose_ladder.png``
(one question: how do the mismatch and the held-out accuracy move with the dose?). Every number comes
from metrics.jsonl through moerl.analysis.dose; the rules are stated there. The command line is
``experiments/07_dose_threshold/report.py``; the README writer and notebook 08 call these functions.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moerl.analysis import confirmatory, power
from moerl.analysis.dose import (ACTS_ON, ACTS_ON_PREREGISTERED, EXPERIMENT, GEO_MIS, GRID_SEEDS,
                                 MATCH_MARGIN, MITIGATIONS, REGISTERED, RUNGS, RunReadError, arm_threshold,
                                 control_learns, dose_order_uncertainty, k3_median_before, load_runs, mismatch_order,
                                 mitigation_verdicts, paired_noise_sd, r3_reduces_mismatch, regime, registered,
                                 threshold, threshold_shift)
from moerl.analysis.figure_style import arm_color, save
from moerl.analysis.registered_figures import (confirmatory_figure, drift_figure, mechanism_figure,
                                               rolling_median)
from moerl.analysis.registration import Registration, analysis_path
from moerl.analysis.results import write_marked_section
from moerl.analysis.verdicts import DRIFT_GROWTH, EARLY_LATE_WINDOW
from moerl.tracking import read_metrics


def fmt(x, spec=".3f"):
    return "—" if x is None else format(x, spec)


# The registered rules each verdict is computed under (experiments/07_dose_threshold/analysis.yaml).
RULES_OF = {"helps": ["helps_threshold", "acts_on_floor", "effect_gate"],
            "like_control": ["match_margin", "acts_on_floor", "effect_gate", "control_gain", "regime_seeds", "regime_gate"],
            "prevents_collapse": ["prevents_collapse_seeds", "collapse", "acts_on_floor", "effect_gate", "control_gain",
                                  "regime_seeds", "regime_gate"],
            "keeps_drifting": ["drift"], "masking": ["masking"],
            "r3_reduces_mismatch": ["r3_reduces_mismatch", "r3_k3_pre_collapse"],
            "threshold": ["control_gain", "regime_seeds", "collapse", "regime_gate"]}
_REGISTRATION: list = []


def registration(runs: list[dict] | None = None) -> Registration:
    """The experiment's registered analysis with its git history, judged against the runs' recorded
    starts (built once per report)."""
    if runs is not None or not _REGISTRATION:
        _REGISTRATION[:] = [Registration(analysis_path(EXPERIMENT), runs=runs or [])]
    return _REGISTRATION[0]


def post_hoc(kind: str, arm: str | None = None, grid: str = "main", gate_fired: bool = True) -> str:
    """' — post hoc: <rule> (<commit>), ...' for a verdict of ``kind`` computed under a rule set after the
    grid started ('' when every rule it uses was registered in time). A regime gate that passed changed
    nothing (``gate_fired`` False): its own registration is then not counted."""
    rules = [r for r in RULES_OF[kind] if gate_fired or r != "regime_gate"]
    if arm and kind in ("helps", "like_control", "prevents_collapse") and ACTS_ON.get(arm) != ACTS_ON_PREREGISTERED.get(arm):
        rules.append("acts_on_measure")
    late = [st for st in (registration().status(r, grid) for r in rules) if st.post_hoc]
    return "" if not late else " — *post hoc*: " + ", ".join(f"{st.rule} ({st.set_by or 'uncommitted'})" for st in late)


def confirmatory_markdown(every_run: list[dict]) -> str:
    """The confirmatory and mechanism grids: progress, the registered verdicts of complete grids, each
    labelled post hoc where a rule it uses was set after its grid's first run (judged from those runs only),
    and the complete mechanism grid's exploratory table (moerl.analysis.confirmatory)."""
    path_runs = [r for r in every_run if confirmatory.grid_of(r, REGISTERED) is not None]
    result = confirmatory.report(every_run, REGISTERED, confirmatory.rules_of(REGISTERED))
    judged = Registration(analysis_path(EXPERIMENT), runs=path_runs)
    return confirmatory.markdown(result, label=judged.labels, registered=REGISTERED)


def ladder_rows(runs: list[dict]) -> tuple[dict, dict | None]:
    """Seed-0 run of the uncorrected arm per rung (fp32: the control) and the control's seed-0 run."""
    control = next((r for r in runs if r["arm"] == "fp32_control" and r["seed"] == 0), None)
    ladder = {r["rung"]: r for r in runs if r["arm"] == "baseline" and r["seed"] == 0}
    if control is not None:
        ladder["fp32"] = control
    return ladder, control


def ladder_complete(ladder: dict[str, dict]) -> bool:
    """Every rung of the ladder (moerl.analysis.dose.RUNGS) has a finished seed-0 run."""
    return set(RUNGS) <= set(ladder) and all(r["steps"] == r["steps_planned"] for r in ladder.values())


def _learns(run: dict) -> str:
    if run["steps"] < run["steps_planned"]:
        return f"unfinished: step {run['steps']} of {run['steps_planned']}"
    return "learns by the rule" if control_learns(run) else "does not learn by the rule"


def ladder_table(ladder: dict[str, dict]) -> list[str]:
    """The seed-0 ladder, one row per rung in mismatch order (also the experiment README's table)."""
    lines = ["| rung | steps | k3 (run median) | tokens re-routed in >= 1 layer (run median) | F(2) (run median) | "
             "grad-norm median / max | training reward, first → last 25 steps | held-out pass@1 (fp32 evaluator), "
             "start → end | collapse step |", "|---|---|---|---|---|---|---|---|---|"]
    for rung in mismatch_order(ladder):
        s = ladder[rung]
        lines.append(f"| {rung}{' (control)' if rung == 'fp32' else ''} | {s['steps']}/{s['steps_planned']} | "
                     f"{fmt(s['k3_median'], '.2e')} | {fmt(s['any_layer_differs'])} | {fmt(s['extreme_gt2'], '.2e')} | "
                     f"{fmt(s['grad_norm_median'], '.2f')} / {fmt(s['grad_norm_max'], '.1f')} | "
                     f"{s['reward_first']:.3f} → {s['reward_last']:.3f} | {fmt(s['pass1_start'])} → "
                     f"{fmt(s['pass1_end'])} (step {s['pass1_end_step']}) | {s['collapse_step'] or '—'} |")
    return lines


def markdown(runs: list[dict]) -> str:
    ladder, control = ladder_rows(runs)
    lines = ladder_table(ladder)
    controls = [r for r in runs if r["arm"] == "fp32_control"]
    lines += ["", "Control (fp32 rollout), every seed: " + ", ".join(
        f"seed {r['seed']}: pass@1 {fmt(r['pass1_start'])} → {fmt(r['pass1_end'])} at step {r['pass1_end_step']}"
        f" ({_learns(r)})" for r in sorted(controls, key=lambda r: r["seed"]))]
    finished = ladder_complete(ladder)
    state = regime({r["seed"]: r for r in controls})
    found = threshold(ladder, control, state["learns"]) if control is not None else None
    ungated = threshold(ladder, control) if control is not None else None
    verdict = found or ("not tested" if not state["learns"] else "none")
    lines.append("Threshold (lowest rung in mismatch order whose uncorrected run collapses while the control "
                 f"learns): **{verdict}**" + ("" if finished else " — the ladder is not complete yet")
                 + ("" if state["learns"] else f" (regime: {state['status']}; seed 0 alone, ungated: {ungated or 'none'})")
                 + post_hoc("threshold", grid="ladder", gate_fired=not state["learns"]))
    order = dose_order(ladder)
    if order:
        lines.append(order)
    return "\n".join(lines) + "\n"


def dose_order(ladder: dict[str, dict]) -> str:
    """How sure the ladder is of the order of its two highest-dose rungs (one seed each): their k3 ratio
    with a moving-block bootstrap interval over steps (moerl.analysis.dose.dose_order_uncertainty)."""
    rungs = [r for r in mismatch_order(ladder) if r != "fp32"]
    if len(rungs) < 2:
        return ""
    low, high = rungs[-2], rungs[-1]
    rows = {r: read_metrics(Path(ladder[r]["run_dir"]) / "metrics.jsonl") for r in (low, high)}
    u = dose_order_uncertainty(rows[low], rows[high])
    return (f"Dose order of the top two rungs (seed 0): run-median k3 {high} / {low} {u['ratio']:.2f} "
            f"[{u['lo']:.2f}, {u['hi']:.2f}] (95 %, block bootstrap over steps): "
            + ("resolved" if u["resolved"] else f"**not resolved**, {low} and {high} are tied in dose"))


def by_seed(runs: list[dict], arm: str, rung: str | None = None) -> dict[int, dict]:
    """seed -> summary of the finished runs of ``arm`` (at ``rung``; the control's rung is fp32)."""
    return {r["seed"]: r for r in runs if r["arm"] == arm and (rung is None or r["rung"] == rung)
            and r["steps"] == r["steps_planned"]}


def grid(runs: list[dict]) -> dict[str, dict]:
    """rung -> the main grid's paired statistics and verdicts there (rungs where a mitigation arm ran)."""
    control = by_seed(runs, "fp32_control")
    state = regime(control)
    out = {}
    for rung in sorted({r["rung"] for r in runs if r["arm"] in MITIGATIONS}):
        baseline = by_seed(runs, "baseline", rung)
        base_minus_control = {s: baseline[s]["pass1_end"] - control[s]["pass1_end"]
                              for s in sorted(set(baseline) & set(control))}
        present = [arm for arm in MITIGATIONS if by_seed(runs, arm, rung)]
        # the noise model: paired differences against the control, pooled over every arm at this rung
        sd = paired_noise_sd([base_minus_control] + [
            {s: by_seed(runs, a, rung)[s]["pass1_end"] - control[s]["pass1_end"]
             for s in sorted(set(by_seed(runs, a, rung)) & set(control))} for a in present])
        arms = {arm: mitigation_verdicts(arm, by_seed(runs, arm, rung), baseline, control, state["learns"], sd)
                for arm in present}
        r3 = by_seed(runs, "r3", rung)
        out[rung] = {"baseline_seeds": sorted(baseline), "control_seeds": sorted(control), "arms": arms,
                     "regime": state, "noise_sd": sd, "baseline_minus_control": base_minus_control,
                     "baseline_collapsed": sum(r.get("collapse_step") is not None for r in baseline.values()),
                     "r3_reduces_mismatch": r3_reduces_mismatch(r3, baseline, pre_collapse_ratios(r3, baseline))
                     if r3 and baseline else None}
    return out


def pre_collapse_ratios(r3: dict[int, dict], baseline: dict[int, dict]) -> dict[int, float]:
    """seed -> R3 / baseline median k3 over the steps before the baseline's collapse (seeds whose baseline
    collapsed; registered rule ``r3_k3_pre_collapse``)."""
    out = {}
    for s in sorted(set(r3) & set(baseline)):
        step = baseline[s].get("collapse_step")
        if step is None:
            continue
        a = k3_median_before(read_metrics(Path(r3[s]["run_dir"]) / "metrics.jsonl"), step)
        b = k3_median_before(read_metrics(Path(baseline[s]["run_dir"]) / "metrics.jsonl"), step)
        if a is not None and b:
            out[s] = a / b
    return out


def thresholds(runs: list[dict], table: dict[str, dict]) -> dict:
    """Per arm, over the main grid's rungs (mismatch order): seeds collapsed of seeds finished at each,
    its threshold (moerl.analysis.dose.arm_threshold) and how it moves the baseline's (moerl.analysis.dose.threshold_shift)."""
    ladder, _ = ladder_rows(runs)
    order = [r for r in mismatch_order(ladder) if r in table] + sorted(r for r in table if r not in ladder)
    arms = ["baseline", *[a for a in MITIGATIONS if any(a in table[r]["arms"] for r in order)]]
    control = by_seed(runs, "fp32_control")
    out = {"rungs": order, "arms": {}, "regime": regime(control)["learns"],
           "control": (sum(r.get("collapse_step") is not None for r in control.values()), len(control))}
    for arm in arms:
        seeds = {rung: by_seed(runs, arm, rung) for rung in order}
        collapsed = {rung: (sum(r.get("collapse_step") is not None for r in s.values()), len(s)) for rung, s in seeds.items()}
        steps = {rung: [r["collapse_step"] for r in s.values() if r.get("collapse_step") is not None]
                 for rung, s in seeds.items()}
        out["arms"][arm] = {"collapsed": collapsed, "collapse_steps": steps, "threshold": arm_threshold(collapsed, order)}
    base = out["arms"]["baseline"]["threshold"]
    for arm, v in out["arms"].items():
        if arm != "baseline":
            v["shift"] = threshold_shift(v["threshold"], base, order)
    return out


def thresholds_markdown(t: dict) -> str:
    if not t["rungs"]:
        return ""
    lines = ["\nWhere each arm collapses (main-grid rungs in mismatch order; seeds collapsed / finished, mean step "
             "to collapse; an arm's threshold is the lowest rung with a collapsed seed):\n",
             "| arm | " + " | ".join(t["rungs"]) + " | threshold | vs the baseline's |",
             "|---|" + "---|" * (len(t["rungs"]) + 2)]
    for arm, v in t["arms"].items():
        cells = []
        for rung in t["rungs"]:
            k, n = v["collapsed"][rung]
            steps = v["collapse_steps"][rung]
            cells.append("not run" if not n else f"{k}/{n}" + (f" (step {sum(steps) / len(steps):.0f})" if steps else ""))
        th = v["threshold"]
        where = th["rung"] or (f"above {th['above']}" if th["above"] else "—")
        seeds = min(n for _, n in v["collapsed"].values())
        note = f" — provisional: {seeds} of {GRID_SEEDS} seeds" if seeds < GRID_SEEDS else ""
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {where} | {v.get('shift', '—')}{note} |")
    lines.append(f"\nThe fp32 control (no mismatch): {t['control'][0]} of {t['control'][1]} seeds collapsed.")
    return "\n".join(lines) + "\n"


def thresholds_figure(t: dict, path: Path) -> Path | None:
    """One question: at which rung does each arm collapse? Cells: seeds collapsed / finished, shaded by
    the share; each row's label carries the arm's threshold and how it moves the baseline's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not t["rungs"]:
        return None
    arms, rungs = list(t["arms"]), t["rungs"]
    fig, ax = plt.subplots(figsize=(max(7.6, 4.6 + 1.8 * len(rungs)), 0.62 * len(arms) + 1.9))
    share = [[(lambda k, n: k / n if n else float("nan"))(*t["arms"][a]["collapsed"][r]) for r in rungs] for a in arms]
    ax.imshow(share, cmap="Reds", vmin=0, vmax=1, aspect="auto")
    for i, arm in enumerate(arms):
        for j, rung in enumerate(rungs):
            k, n = t["arms"][arm]["collapsed"][rung]
            steps = t["arms"][arm]["collapse_steps"][rung]
            label = "not run" if not n else f"{k}/{n} collapsed" + (f"\nmean step {sum(steps) / len(steps):.0f}" if steps else "")
            ax.text(j, i, label, ha="center", va="center", fontsize=9, color="white" if n and k / n > 0.6 else "black")

    def row_label(arm: str) -> str:
        v = t["arms"][arm]
        where = v["threshold"]["rung"] or (f"above {v['threshold']['above']}" if v["threshold"]["above"] else "—")
        return f"{arm}\nthreshold: {where}" + (f"\n({v['shift']})" if "shift" in v else "")

    ax.set_yticks(range(len(arms)), [row_label(a) for a in arms], fontsize=8)
    ax.set_xticks(range(len(rungs)), [f"rollout {r}" for r in rungs])
    ax.set_xlabel("main-grid rung, ordered by measured mismatch")
    ax.set_title(f"Experiment 07: at which rung does each arm collapse?\n(threshold: lowest rung with a collapsed "
                 f"seed; fp32 control: {t['control'][0]}/{t['control'][1]} collapsed)"
                 + ("" if t.get("regime", True) else "\nregime not met (the control learned in fewer seeds than "
                    "registered): thresholds shown ungated, their verdicts 'not tested'"),
                 fontsize=10, color="k" if t.get("regime", True) else "tab:red")
    fig.tight_layout()
    return save(fig, path)


def _provisional(verdict: dict) -> str:
    """A note on a verdict drawn from fewer seeds than the grid's 3 (the grid is still recording)."""
    n = len(verdict["seeds"])
    return "" if n >= GRID_SEEDS else f" — provisional: {n} of {GRID_SEEDS} seeds"


def _interval(values: dict[int, float]) -> str:
    v = list(values.values())
    if not v:
        return "—"
    return f"{sum(v) / len(v):+.3f} [{min(v):+.3f}, {max(v):+.3f}]"


def _preregistered_note(arm: str, v: dict) -> str:
    """The verdicts of an arm under every rule as first written (moerl.analysis.dose.registered), where
    they differ from the verdicts printed (amended rules, registered in analysis.yaml); '' otherwise."""
    pre = v["preregistered"]
    kinds = ("helps", "like_control", "prevents_collapse")
    if all(pre[k] == v[k] for k in kinds) and pre["acted_measure"] == v["acted_measure"]:
        return ""
    measure = (f" (\"acted on\" first measured as `{pre['acted_measure']}`: "
               f"{', '.join(fmt(a) for a in pre['acted_frac']) or '—'} per seed)"
               if pre["acted_measure"] != v["acted_measure"] else "")
    return (f"{arm} under the rules as first written{measure}: helps {pre['helps']}, trains like the control "
            f"(within {MATCH_MARGIN} either way) {pre['like_control']}, prevents collapse (counting all the baseline's "
            f"seeds) {pre['prevents_collapse']}.")


def _growths(values: dict[int, float | None]) -> str:
    return ", ".join(f"{g:.3g}×" for g in values.values() if g is not None) or "—"


def grid_table(g: dict) -> list[str]:
    """One rung of the main grid: per arm its seeds, collapses, paired differences, what it acted on, its drift
    and its verdicts, each with the regime gate and any post-hoc label (also the experiment README's table)."""
    lines = ["| arm | seeds | collapsed (steps) | final pass@1 − baseline | final pass@1 − control | "
             "acted on (share of tokens, per seed) | tokens keeping a gradient | k3 late / early 50 steps | helps | "
             f"trains like the control (at most {MATCH_MARGIN} below) | prevents collapse |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, v in g["arms"].items():
        acted = ", ".join(fmt(a) for a in v["acted_frac"]) or "—"
        kept = ", ".join(fmt(e) for e in v["effective_token_frac"].values())
        lines.append(f"| {arm} | {v['seeds']}{_provisional(v)} | {v['collapsed']} ({v['collapse_steps'] or '—'}) | "
                     f"{_interval(v['minus_baseline'])} | {_interval(v['minus_control'])} | {acted} | {kept} | "
                     f"{_growths(v['k3_growth'])} | {cell(v, 'helps', arm)} | {cell(v, 'like_control', arm)} | "
                     f"{cell(v, 'prevents_collapse', arm)} |")
    return lines


def grid_markdown(table: dict[str, dict]) -> str:
    if not table:
        return "\nMain grid: not run yet.\n"
    lines = ["\nMain grid (finished runs; paired seeds; mean [min, max] over seeds; rules: moerl.analysis.dose):\n"]
    for rung, g in table.items():
        lines += [f"**rung {rung}** — baseline seeds {g['baseline_seeds']} ({g['baseline_collapsed']} collapsed), "
                  f"control seeds {g['control_seeds']}", "", *grid_table(g)]
        lines += ["", f"Regime (one gate for every verdict that needs a learning control): {g['regime']['status']}.",
                  "", *power_table(rung, g)]
        for arm, v in g["arms"].items():
            note = _preregistered_note(arm, v)
            if note:
                lines += ["", note]
        r3 = g["r3_reduces_mismatch"]
        if r3:
            ratios = ", ".join(f"{x:.2f}" for x in r3["k3_ratio"].values())
            whole = ", ".join(f"{x:.2f}" for x in r3["k3_ratio_whole_run"].values())
            lines += ["", f"R3 / baseline median k3 per seed: {ratios}"
                      + (f" (before the baseline's collapse step; over the whole runs {whole})" if r3["pre_collapse"] else "")
                      + f" ({r3['k3']}); tokens keeping a gradient, "
                      f"R3 − baseline: {_interval(r3['effective_minus_baseline'])} ({r3['kept']}); "
                      f"R3 reduces the mismatch without shrinking the sample set: **{r3['verdict']}**"
                      + post_hoc("r3_reduces_mismatch")]
        lines.append("")
    return "\n".join(lines)


def cell(v: dict, kind: str, arm: str) -> str:
    """A verdict as a table prints it: the verdict; the ungated one where the regime gate made it 'not
    tested'; the post-hoc label of any rule it uses that was set after the grid started."""
    ungated = v.get("ungated", {}).get(kind)
    return (f"{v[kind]}" + (f" (regime; ungated: {ungated})" if ungated and ungated != v[kind] else "")
            + post_hoc(kind, arm, gate_fired=v.get("regime") is False))


def figure_mark(v: dict, arm: str) -> str:
    """A verdict's mark in a figure: provisional (fewer seeds than registered), gated by the regime, post hoc."""
    marks = []
    if len(v["seeds"]) < GRID_SEEDS:
        marks.append("provisional")
    if v.get("regime") is False:
        marks.append(f"ungated: {v['ungated']['like_control']}")
    if post_hoc("like_control", arm, gate_fired=v.get("regime") is False):
        marks.append("post hoc")
    return ("\n" + "\n".join(marks)) if marks else ""


def _ci(p: dict) -> str:
    if not p.get("interval"):
        return "—"
    mean, lo, hi = p["interval"]
    return f"{mean:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def power_table(rung: str, g: dict) -> list[str]:
    """Each paired verdict with its 95 % t interval over seeds and its power under the noise model
    (moerl.analysis.power): the registered every-seed rule's chance of saying yes when the truth is at the
    comparison's margin, and the seeds the t rule would need for 80 %."""
    sd = g.get("noise_sd")
    head = (f"Interval and power (noise model at {rung}: paired sd of final pass@1 differences "
            f"{fmt(sd)}, pooled over {len(g['arms']) + 1} arms' differences from the control; the evaluation alone "
            f"contributes {power.binomial_sd(0.6, 1024) * 2 ** 0.5:.3f} (binomial, 1,024 completions, two evaluations)). "
            "Power: P(the registered every-seed rule says yes) if the truth sat at the effect named; it falls as "
            "seeds are added. Seeds for 80 %: under the one-sided t rule registered for the confirmatory grid.")
    lines = [head, "", "| arm | verdict | compared | mean [95 % t interval] | effect assumed | power (every-seed rule) | "
             "seeds for 80 % (t rule) |", "|---|---|---|---|---|---|---|"]
    for arm, v in g["arms"].items():
        for kind, what in (("helps", "− baseline > 0"), ("like_control", f"− control > −{MATCH_MARGIN}")):
            pw = v["power"][kind]
            lines.append(f"| {arm} | {kind.replace('_', ' ')}: {cell(v, kind, arm)} | {what} | {_ci(pw)} | "
                         f"{pw['effect']:+.3f} | {fmt(pw.get('power_every_seed'), '.2f')} ({pw['n']} seeds) | "
                         f"{pw.get('seeds_for_80') or '—'} |")
    return lines


def masking_claim(runs: list[dict], rung: str):
    """Mind Lab's "masking IS discards ever more samples" at ``rung``, by experiment 05's own rule and code
    (moerl.analysis.claims.claim_masking) on the finished baseline, MIS and IcePop runs there; None without MIS or
    IcePop runs."""
    import pandas as pd

    from moerl.analysis import claims

    chosen = [r for r in runs if r["arm"] in ("baseline", GEO_MIS, "icepop") and r["rung"] == rung
              and r["steps"] == r["steps_planned"]]
    if not any(r["arm"] != "baseline" for r in chosen):
        return None
    rows = [{"arm": r["arm"], "seed": r["seed"], **m} for r in chosen
            for m in read_metrics(Path(r["run_dir"]) / "metrics.jsonl")]
    metrics = pd.DataFrame(rows)
    claim = claims.claim_masking(metrics, pd.DataFrame([{"arm": r["arm"], "seed": r["seed"]} for r in chosen]),
                                 arms=(GEO_MIS, "icepop"))
    return claim, masking_trend_caveat(metrics, claim.verdict)


def masking_trend_caveat(metrics, verdict: str) -> str:
    """Experiment 05's masking rule answers "yes" on the *level* (fewer than half the tokens keep a
    gradient late in the run). Where no masking arm's share fell in any seed, say that the "ever more"
    half of the claim was not what happened, so the row does not read as more than was measured."""
    from moerl.analysis import claims, verdicts

    if verdict != verdicts.YES:
        return ""
    early = claims.window_mean(metrics, "effective/token_frac", "early")
    late = claims.window_mean(metrics, "effective/token_frac", "late")
    masked = claims.window_mean(metrics, "mask/token_frac")

    def per_seed(series, arm):
        return list(series[arm].values) if arm in series.index.get_level_values(0) else []

    fell = [l_ < e for arm in (GEO_MIS, "icepop") if verdicts.acts_on(per_seed(masked, arm))
            for e, l_ in zip(per_seed(early, arm), per_seed(late, arm))]
    if fell and not any(fell):
        return (" — on the level only: the share of tokens keeping a gradient did not fall from the first to the "
                f"last {verdicts.EARLY_LATE_WINDOW} steps in any seed, so \"ever more\" is not shown")
    return ""


def beside(v: dict, kind: str) -> str:
    """What a claim's verdict is printed with: its 95 % t interval and the every-seed rule's power."""
    pw = v["power"][kind]
    return (f"({_ci(pw)}, 95 % t; power {fmt(pw.get('power_every_seed'), '.2f')} at {pw['n']} seeds, "
            f"{pw.get('seeds_for_80') or '—'} seeds for 80 %)")


def registered_beside(registered: dict | None, rung: str, arm: str) -> str:
    """Where the registered grid at ``rung`` has judged ``arm`` again on more seeds: its verdicts, to read
    beside the main grid's 3-seed row."""
    verdicts = (registered or {}).get(f"confirmatory_{rung}") or {}
    mine = {name.split(" ", 1)[1]: v for name, v in verdicts.items() if name.split(" ", 1)[0] == arm}
    if not mine:
        return ""
    n = max(v.get("n") or 0 for v in mine.values())
    said = "; ".join(f"{kind.replace('_', ' ')}: {v['verdict']}"
                     + (f" (ungated {v['floor_ungated']}: acts-on floor)" if "floor_ungated" in v else "")
                     for kind, v in mine.items())
    return f" — **registered {rung} grid ({n} seeds, below): {said}**"


def claims_markdown(runs: list[dict], table: dict[str, dict], registered: dict | None = None) -> str:
    """claim | source | moerl | verdict, from the ladder and the main grid (rules: moerl.analysis.dose,
    moerl.analysis.verdicts); where a registered grid judged an arm again at the same rung (``registered``:
    its verdicts by grid), those verdicts beside the row."""
    controls = [r for r in runs if r["arm"] == "fp32_control" and r["steps"] == r["steps_planned"]]
    learns = len(controls) >= 3 and all(control_learns(r) for r in controls)
    ladder, control = ladder_rows(runs)
    found = threshold(ladder, control) if control is not None else None
    done = ladder_complete(ladder)
    rungs = [r for r in mismatch_order(ladder) if r != "fp32"]
    if not learns:
        collapse = ("not tested", f"the fp32 control learned (≥ +0.10 held-out pass@1) in {sum(map(control_learns, controls))}"
                    f" of {len(controls)} finished seeds; 3 of 3 are needed")
    elif not done:
        collapse = ("not tested", "the ladder pilot has not finished")
    elif found is None:
        collapse = ("no", f"no rung up to {rungs[-1] if rungs else '—'} collapsed within "
                    f"{control['steps_planned']} steps while the control learned")
    else:
        collapse = ("yes", f"the uncorrected run collapses from rung {found} (step {ladder[found]['collapse_step']}) "
                    "while the control learns")
    lines = ["| claim | source | moerl | verdict |", "|---|---|---|---|",
             f"| uncorrected GRPO on an MoE collapses | R3 paper (arXiv 2510.11370) | {collapse[1]} | **{collapse[0]}**"
             f"{post_hoc('threshold', grid='ladder', gate_fired=not learns)} |"]
    for rung, g in table.items():
        r3, tis = g["arms"].get("r3"), g["arms"].get("tis")
        if r3:
            lines.append(f"| R3 keeps GRPO training like the mismatch-free run (rung {rung}) | R3 paper | "
                         f"final pass@1 − control {_interval(r3['minus_control'])}, − baseline "
                         f"{_interval(r3['minus_baseline'])}; collapsed {r3['collapsed']} of {len(r3['seeds'])} "
                         f"(baseline {g['baseline_collapsed']}) | **{cell(r3, 'like_control', 'r3')}** "
                         f"{beside(r3, 'like_control')} (helps: {cell(r3, 'helps', 'r3')} {beside(r3, 'helps')}; "
                         f"prevents collapse: {cell(r3, 'prevents_collapse', 'r3')}){_provisional(r3)}"
                         f"{registered_beside(registered, rung, 'r3')} |")
        if g.get("r3_reduces_mismatch"):
            m = g["r3_reduces_mismatch"]
            ratios = ", ".join(f"{x:.2f}" for x in m["k3_ratio"].values())
            lines.append(f"| R3 reduces the mismatch without shrinking the effective sample set (rung {rung}) | "
                         f"Mind Lab R3 blog | R3 / baseline k3 per seed {ratios}; tokens keeping a gradient R3 − "
                         f"baseline {_interval(m['effective_minus_baseline'])} | **{m['verdict']}**"
                         f"{post_hoc('r3_reduces_mismatch')}"
                         f"{_provisional({'seeds': list(m['k3_ratio'])})} |")
        if tis:
            pre = tis.get("preregistered")
            pre_note = (f" (pre-registered measure, truncated share {', '.join(fmt(a) for a in pre['acted_frac'])}: "
                        f"{pre['like_control']})" if pre else "")
            lines.append(f"| token TIS (cap 2) lets a low-precision rollout train like a full-precision one (rung "
                         f"{rung}) | FlashRL (Liu, Yao et al., 2025) | final pass@1 − fp32 control "
                         f"{_interval(tis['minus_control'])}; share of tokens with ρ outside [1/2, 2] per seed "
                         f"{', '.join(fmt(a) for a in tis['acted_frac'])} | **{cell(tis, 'like_control', 'tis')}** "
                         f"{beside(tis, 'like_control')}{pre_note}"
                         f"{_provisional(tis)}{registered_beside(registered, rung, 'tis')} |")
        if tis:
            lines.append(f"| TIS does not stop the drift (rung {rung}) | Mind Lab R3 blog | k3 late / early "
                         f"{EARLY_LATE_WINDOW} steps per seed: baseline {_growths(tis['baseline_k3_growth'])}, TIS "
                         f"{_growths(tis['k3_growth'])} | **{tis['keeps_drifting']}** (experiment 05's rule, applied "
                         f"after these runs were read: yes when TIS's k3 grows > {DRIFT_GROWTH}× in every seed, no in "
                         f"none){post_hoc('keeps_drifting')}{_provisional(tis)} |")
        found_masking = masking_claim(runs, rung)
        if found_masking is not None:
            masking, caveat = found_masking
            lines.append(f"| {masking.claim} (rung {rung}) | {masking.source} | {masking.repo} | **{masking.verdict}** "
                         f"(experiment 05's rule, `moerl.analysis.claims.claim_masking`, applied after these runs were read: "
                         f"{masking.rule}){caveat}{post_hoc('masking')} |")
    if not table:
        lines.append("| R3, TIS, MIS, IcePop move the threshold | R3 paper, Mind Lab, FlashRL, IcePop, MIS | main grid "
                     "not run yet | **not tested** |")
    return "\n".join(lines) + "\n"


def registration_markdown(every_run: list[dict]) -> str:
    """The registered rules of the grids that have run: when each was first written, every amendment, and
    whether the value the verdicts use was set before the grid's first run (moerl.analysis.registration).
    The grids on the registered rollout path are judged from their own runs, the earlier grids from theirs
    (a path grid's fp8 baseline would otherwise count as a run of the main grid)."""
    reg = registration()
    path_runs = [r for r in every_run if confirmatory.grid_of(r, REGISTERED) is not None]
    on_path = Registration(analysis_path(EXPERIMENT), runs=path_runs)
    earlier = set(REGISTERED["grids"]) - set(confirmatory.PATH_GRIDS)
    return "\n".join(["", f"Registered analysis (`experiments/{EXPERIMENT}/analysis.yaml`, sha256 {reg.sha256[:12]}): "
                       "each rule of a grid that has run, the commit that first wrote it, its amendments, and whether "
                       "the value used was set before the grid's first run (post hoc otherwise):", "",
                       *reg.timeline(started_only=True, grids=earlier),
                       *on_path.timeline(started_only=True, grids=set(confirmatory.PATH_GRIDS), header=False), "",
                       *repeat_lines(every_run), ""])


def repeat_lines(every_run: list[dict]) -> list[str]:
    """Per registered grid, the runs that repeat an earlier run read before registration (same training and
    seed; moerl.analysis.registration.repeats): their outcome was partly seen when the grid was registered."""
    from moerl.analysis.registration import repeats

    grid = {r["run_dir"]: confirmatory.grid_of(r, REGISTERED) for r in every_run}
    found = repeats([{**r, "registered": grid[r["run_dir"]] is not None} for r in every_run])
    if not found:
        return ["No registered run repeats an earlier run read before registration."]
    lines = ["Registered runs that repeat, bit for bit, an earlier run read before registration (same training "
             "config and seed; the evaluation size or the length differ; `moerl.analysis.registration.repeats`):", "",
             "| grid | repeated runs | of | steps repeated | runs |", "|---|---|---|---|---|"]
    planned = {name: len(g.planned()) for name, g in confirmatory.path_grids(REGISTERED).items()}
    by_grid: dict[str, list[dict]] = {}
    for entry in found:
        by_grid.setdefault(grid[entry["run"]], []).append(entry)
    for name, entries in by_grid.items():
        steps = sorted({e["steps"] for e in entries})
        arms = sorted({Path(e["run"]).parent.name.split("+")[0] for e in entries})
        seeds = sorted({e["seed"] for e in entries})
        lines.append(f"| {name} | {len(entries)} | {planned.get(name, '?')} | {', '.join(map(str, steps))} | "
                     f"seeds {', '.join(map(str, seeds))} of {', '.join(arms)} |")
    return lines


def fresh_seed_markdown(every_run: list[dict]) -> str:
    """Each registered grid's verdicts again on its fresh seeds only: the seeds of runs that repeat an earlier
    run read before registration (repeat_lines) are dropped from the grid (and from the control it is paired
    with), and the same rules, with Holm within the family, are applied to the rest."""
    import copy

    from moerl.analysis.registration import repeats

    grid = {r["run_dir"]: confirmatory.grid_of(r, REGISTERED) for r in every_run}
    found = repeats([{**r, "registered": grid[r["run_dir"]] is not None} for r in every_run])
    if not found:
        return ""
    seen: dict[str, set[int]] = {}
    for e in found:
        seen.setdefault(grid[e["run"]], set()).add(e["seed"])
    fresh = copy.deepcopy(REGISTERED)
    for name, seeds in seen.items():
        fresh["grids"][name]["seeds"] = [s for s in fresh["grids"][name]["seeds"] if s not in seeds]
    result = confirmatory.report(every_run, fresh, confirmatory.rules_of(fresh))
    dropped = "; ".join(f"{name} seeds {', '.join(map(str, sorted(seeds)))}" for name, seeds in seen.items())
    lines = ["", f"On fresh seeds only ({dropped} dropped: they repeat runs read before registration; grids "
             "without a repeated run are not reprinted), the same rules and Holm within each family:", "",
             "| grid | comparison | verdict | mean [one-sided 95 % t bounds] | seeds | p | Holm p | verdict under Holm |",
             "|---|---|---|---|---|---|---|---|"]
    fmt = lambda p: "—" if p is None else f"{p:.3g}"  # noqa: E731
    for name, verdicts in result["verdicts"].items():
        if name not in seen:
            continue
        for comparison, v in verdicts.items():
            x = v.get("gain", v)
            mean = (f"{x['mean']:+.3f} [{x['low']:+.3f}, {x['high']:+.3f}]" if x.get("mean") is not None
                    and x.get("low") is not None else "—")
            n = x.get("n", len(v.get("k3_growth", [])))
            lines.append(f"| {name} | {comparison} | {v['verdict']} | {mean} | {n} | {fmt(v.get('p'))} | "
                         f"{fmt(v.get('p_holm'))} | {v.get('verdict_holm', v['verdict'])} |")
    return "\n".join(lines) + "\n"


def power_plan(table: dict[str, dict]) -> str:
    """The confirmatory grid's seeds and evaluation size from the noise model of the recorded fp8 grid:
    the seeds each registered comparison needs for 80 % power under the t rule, against those registered."""
    g = table.get("fp8")
    if not g or not g.get("noise_sd"):
        return ""
    sd, n_eval = g["noise_sd"], REGISTERED["grids"]["main"]["eval_completions"]
    p = 0.6  # final pass@1 of the fp8 arms, about
    eval_now = power.binomial_sd(p, n_eval) * 2 ** 0.5
    seed_part = max(sd ** 2 - eval_now ** 2, 0.0) ** 0.5
    plan = REGISTERED["grids"]["confirmatory_fp8"]
    eval_new = power.binomial_sd(p, plan["eval_completions"]) * 2 ** 0.5
    sd_new = (seed_part ** 2 + eval_new ** 2) ** 0.5
    df = 3 * (len(g["arms"]) + 1) - (len(g["arms"]) + 1)
    from scipy import stats

    sd_up = sd_new * (df / stats.chi2.ppf(0.2, df)) ** 0.5  # upper 80 % confidence bound of the sd
    helps = registered("helps_t")
    margin = registered("like_control_t")["margin"]
    rows = []
    for name, effect, thr in (("trains like the control", 0.0, -margin),
                              ("helps", helps["smallest_effect"], helps["threshold"])):
        rows.append(f"| {name} | {effect:+.3f} | {thr:+.3f} | {power.seeds_needed(effect, thr, sd_new)} | "
                    f"{power.seeds_needed(effect, thr, sd_up)} | {len(plan['seeds'])} | "
                    f"{power.power_t(effect, thr, sd_up, len(plan['seeds'])):.2f} |")
    gains = list(g["regime"]["gains"].values())
    if len(gains) >= 2:  # the control's gain: measured spread, or its own evaluation noise where larger
        rule = registered("regime_t")
        mean_gain = sum(gains) / len(gains)
        import numpy as np

        sd_gain = max(float(np.std(gains, ddof=1)), power.binomial_sd(0.6, plan["eval_completions"]) * 2 ** 0.5)
        n_ctl = len(REGISTERED["grids"]["confirmatory_control"]["seeds"])
        rows.append(f"| the control learns (mean gain's lower bound > {rule['lower_bound_above']}) | {mean_gain:+.3f} | "
                    f"{rule['lower_bound_above']:+.3f} | {power.seeds_needed(mean_gain, rule['lower_bound_above'], sd_gain)} | "
                    f"{power.seeds_needed(mean_gain, rule['lower_bound_above'], sd_gain * 1.5)} (sd × 1.5) | {n_ctl} | "
                    f"{power.power_t(mean_gain, rule['lower_bound_above'], sd_gain * 1.5, n_ctl):.2f} |")
    need = power.completions_for(margin, p)
    return "\n".join([
        "", "Power plan for the confirmatory fp8 grid (registered in analysis.yaml before its first run):",
        f"the recorded fp8 grid's paired sd {sd:.4f} splits into evaluation noise {eval_now:.4f} (binomial, "
        f"{n_eval} completions, two evaluations) and seed-to-seed spread {seed_part:.4f}; at the registered "
        f"{plan['eval_completions']} completions (evaluation noise {eval_new:.4f} < {margin / 3:.4f}, a third of the "
        f"margin; {need} would do) the paired sd is {sd_new:.4f}, {sd_up:.4f} at its upper 80 % bound ({df} df).", "",
        "| comparison | true effect assumed | threshold | seeds for 80 % (sd) | seeds for 80 % (upper sd) | "
        "seeds registered | power registered (upper sd) |", "|---|---|---|---|---|---|---|", *rows, ""])


def figure(runs: list[dict], path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ladder, control = ladder_rows(runs)
    order = mismatch_order(ladder)
    fig, (ax_k3, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = range(len(order))
    low = [i for i, r in zip(x, order) if r != "fp32"]
    ax_k3.semilogy(low, [ladder[order[i]]["k3_median"] for i in low], "o-", color=arm_color("baseline"))
    if "fp32" in order:
        ax_k3.annotate("no mismatch\n(k3 = 0 up to\nfp32 round-off)", (0, 0.5), xycoords=("data", "axes fraction"),
                       ha="center", fontsize=8)
    ax_k3.set_ylabel("k3 KL vs the fp32 trainer, run median (log)")
    ax_k3.set_title("mismatch given by each rung")
    for r_i, r in zip(x, order):
        s = ladder[r]
        gain = (s["pass1_end"] or 0) - (s["pass1_start"] or 0)
        ax_acc.bar(r_i, gain, color=arm_color("fp32_control" if r == "fp32" else "baseline"))
        if s["collapse_step"] is not None:
            ax_acc.annotate(f"collapsed\nstep {s['collapse_step']}", (r_i, gain), ha="center", va="bottom", fontsize=8)
    controls = [r["pass1_end"] - r["pass1_start"] for r in runs if r["arm"] == "fp32_control"
                and r["steps"] == r["steps_planned"] and r["pass1_end"] is not None]
    if controls:
        ax_acc.axhspan(min(controls), max(controls), color=arm_color("fp32_control"), alpha=0.25, lw=0, zorder=3,
                       label=f"fp32 control, {len(controls)} seed(s): min-max")
        ax_acc.legend(loc="lower left", fontsize=8)
    if control is not None:
        ax_acc.axhline(0.10, ls="--", color="k", lw=0.8)
        ax_acc.text(len(order) - 0.5, 0.10, "control must gain ≥ 0.10", ha="right", va="bottom", fontsize=8)
    ax_acc.axhline(0, color="k", lw=0.5)
    ax_acc.set_ylabel("held-out pass@1 gain (fp32 evaluator)")
    ax_acc.set_title("what training did at each rung (seed 0)")
    for ax in (ax_k3, ax_acc):
        ax.set_xlim(-0.6, len(order) - 0.4)
        ax.set_xticks(list(x), [f"{r}\n(control)" if r == "fp32" else r for r in order])
        ax.set_xlabel("rollout precision, ordered by measured mismatch")
    setups = sorted({ladder[r]["setup"] for r in order})
    steps = sorted({ladder[r]["steps_planned"] for r in order})
    fig.suptitle(f"Experiment 07: dose ladder, uncorrected arm (seed 0 per rung)\n{'; '.join(setups)}; "
                 f"{', '.join(map(str, steps))} GRPO steps", fontsize=10)
    fig.tight_layout()
    return save(fig, path)


def mitigation_figure(table: dict[str, dict], path: Path) -> Path | None:
    """One question: at each rung of the main grid, which arm ends where the control ends? Per arm, each
    seed's final held-out pass@1 minus the control's of the same seed (0 = trains like the control)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not table:
        return None
    fig, axes = plt.subplots(1, len(table), figsize=(max(8.0, 6.8 * len(table)), 4.8), sharey=True, squeeze=False)
    for ax, (rung, g) in zip(axes[0], table.items()):
        names = ["baseline"] + list(g["arms"])
        baseline = {s: r for s, r in g.get("baseline_minus_control", {}).items()}
        for i, name in enumerate(names):
            values = baseline if name == "baseline" else g["arms"][name]["minus_control"]
            ys = list(values.values())
            ax.scatter([i] * len(ys), ys, color=arm_color(name), zorder=3)
            if ys:
                ax.hlines(sum(ys) / len(ys), i - 0.25, i + 0.25, color="k", lw=1)
        ax.axhline(0, color="k", lw=0.6)
        ax.axhspan(-MATCH_MARGIN, 0, color="tab:gray", alpha=0.2, lw=0, label=f"at most {MATCH_MARGIN} below the control (trains like it)")
        counts = [len(baseline) if n == "baseline" else len(g["arms"][n]["minus_control"]) for n in names]
        # each arm's "trains like the control" verdict under its label, marked where the regime gate or a
        # rule set after the grid started decides it
        labels = [f"{n}\n{c} seed(s)" + ("" if n == "baseline" else
                  f"\n{g['arms'][n]['like_control']}{figure_mark(g['arms'][n], n)}") for n, c in zip(names, counts)]
        ax.set_xticks(range(len(names)), labels, fontsize=7)
        provisional = "" if g["regime"]["learns"] else "\nregime not met: verdicts 'not tested' (see table)"
        ax.set_title(f"rollout {rung}{provisional}", fontsize=9)
    axes[0][0].legend(loc="lower right", fontsize=7)
    axes[0][0].set_ylabel("final held-out pass@1 − control's (same seed)")
    fig.suptitle("Experiment 07: which mitigation trains like the fp32 control?\n"
                 "each seed's final held-out pass@1 (fp32 evaluator) minus the control's of the same seed; dots: seeds, "
                 "bar: mean; under each arm: its verdict, marked where gated, post hoc or provisional", fontsize=10)
    fig.tight_layout()
    return save(fig, path)


def dynamics_figure(runs: list[dict], path: Path) -> Path | None:
    """One question: does the mismatch grow before the uncorrected run collapses? Per rung (seed 0), the
    per-step k3 of the rollout against the fp32 trainer (25-step rolling median) along training, with the
    collapse step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ladder, _ = ladder_rows(runs)
    rungs = [r for r in mismatch_order(ladder) if r != "fp32"]
    if not rungs:
        return None
    fig, ax = plt.subplots(figsize=(8.5, 4.4))
    colours = plt.get_cmap("viridis")(np.linspace(0, 0.9, len(rungs)))
    for rung, colour in zip(rungs, colours):
        rows = [r for r in read_metrics(Path(ladder[rung]["run_dir"]) / "metrics.jsonl") if "mismatch/k3" in r]
        k3 = np.array([r["mismatch/k3"] for r in rows])
        smooth = rolling_median(k3, 25)
        ax.semilogy([r["step"] for r in rows], smooth, color=colour, label=rung)
        if ladder[rung]["collapse_step"] is not None:
            ax.axvline(ladder[rung]["collapse_step"], color=colour, ls=":", lw=1)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("k3 of the rollout vs the fp32 trainer (25-step rolling median)")
    ax.set_title("Does the mismatch grow before the uncorrected run collapses? (seed 0 per rung;\n"
                 "dotted: collapse step; the fp32 control's k3 is 0 up to round-off)", fontsize=10)
    ax.legend(title="rollout", fontsize=8)
    fig.tight_layout()
    return save(fig, path)


# The 4-bit rungs of the warm-start dose table, named (not matched by digit).
FOUR_BIT = ("nvfp4", "int4")


def warm_start_dose_lines(points: dict[str, dict]) -> list[str]:
    """The dose each rung gives at the warm start (dose_at_warm_start.json), the rungs ordered by k3."""
    layers = "/".join(sorted({str(len(p["moe_layers"])) for p in points.values()}))
    lines = [f"| rung | k3 | k3 with R3 | tokens re-routed in ≥ 1 of {layers} MoE layers | mean per-layer flip | F(2) | "
             "F(2) with R3 |", "|---|---|---|---|---|---|---|"]
    for rung in sorted(points, key=lambda r: points[r]["native/k3"]):
        p = points[rung]
        lines.append(f"| {rung} | {p['native/k3']:.2e} | {p['r3/k3']:.2e} | {p['all/share']:.3f} "
                     f"[{p['all/share_lo']:.3f}, {p['all/share_hi']:.3f}] | {p['all/p_mean']:.3f} | "
                     f"{p['native/extreme_gt2']:.4f} | {p['r3/extreme_gt2']:.4f} |")
    return lines


def warm_start_dose_summary(points: dict[str, dict]) -> str:
    """The ladder's order and spans, and the share of k3 R3 removes at 8-16 bits and at 4 bits."""
    order = sorted(points, key=lambda r: points[r]["native/k3"])
    k3 = [points[r]["native/k3"] for r in order]
    share = [points[r]["all/share"] for r in order]

    def removed(rungs: list[str]) -> str:
        cut = sorted(100 * (1 - points[r]["r3/k3"] / points[r]["native/k3"]) for r in rungs if r in points)
        return f"{cut[0]:.0f}–{cut[-1]:.0f} %" if cut else "—"

    four_bit = [r for r in order if r in FOUR_BIT]
    wide = [r for r in order if r not in four_bit]
    return (f"Ordered by k3, the ladder is {' < '.join(order)}: a {max(k3) / min(k3):.0f}× span in k3 and "
            f"{max(share) / min(share):.1f}× in re-routing; the 4-bit formats re-route "
            f"{100 * min(points[r]['all/share'] for r in four_bit):.0f}–{100 * max(points[r]['all/share'] for r in four_bit):.0f} % "
            f"of the tokens. R3 removes {removed(wide)} of k3 at 8 and 16 bits and {removed(four_bit)} at 4 bits.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="results/runs")
    ap.add_argument("--out", default="results/07_dose_threshold")
    ap.add_argument("--figure", default="results/figures/07_dose_ladder.png")
    ap.add_argument("--mitigation-figure", default="results/figures/07_mitigations.png")
    ap.add_argument("--dynamics-figure", default="results/figures/07_mismatch_before_collapse.png")
    ap.add_argument("--threshold-figure", default="results/figures/07_threshold_by_arm.png")
    ap.add_argument("--confirmatory-figure", default="results/figures/07_confirmatory_fp8.png")
    ap.add_argument("--drift-figure", default="results/figures/07_drift_nvfp4_600.png")
    ap.add_argument("--mechanism-figure", default="results/figures/07_mechanism.png")
    ap.add_argument("--results", default="results/RESULTS.md",
                    help="the section of this experiment in this file is rewritten ('' leaves it alone)")
    ap.add_argument("--pilots", nargs="*", help="archived regime pilots (results/pilots/07_*): print their table")
    args = ap.parse_args()
    if args.pilots:
        from moerl.analysis.pilots import regime_table
        print(regime_table([Path(p) for p in args.pilots]))
        return
    try:
        every_run = load_runs(Path(args.runs), grids="all")
    except RunReadError as err:
        sys.exit(f"report: {err}")
    # The grids recorded on the registered rollout path have their own section; never mixed with these.
    runs = [r for r in every_run if confirmatory.grid_of(r, REGISTERED) is None]
    if not runs:
        sys.exit(f"report: no runs of {EXPERIMENT} under {args.runs} (run experiments/07_dose_threshold/launch.sh pilot)")
    registration(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = grid(runs)
    shifts = thresholds(runs, table)
    registered = confirmatory.report(every_run, REGISTERED, confirmatory.rules_of(REGISTERED))["verdicts"]
    text = (markdown(runs) + grid_markdown(table) + thresholds_markdown(shifts) + "\n"
            + claims_markdown(runs, table, registered)
            + power_plan(table) + confirmatory_markdown(every_run) + fresh_seed_markdown(every_run)
            + registration_markdown(every_run))
    (out / "ladder.md").write_text(text)
    listed = [{k: v for k, v in r.items() if k != "identity"} for r in runs]  # the config is in each run's files
    (out / "ladder.json").write_text(json.dumps({"runs": listed, "grid": table, "thresholds": shifts}, indent=1,
                                                default=str) + "\n")
    drawn = [figure(runs, Path(args.figure)), mitigation_figure(table, Path(args.mitigation_figure)),
             dynamics_figure(runs, Path(args.dynamics_figure)), thresholds_figure(shifts, Path(args.threshold_figure)),
             confirmatory_figure(every_run, Path(args.confirmatory_figure)),
             drift_figure(every_run, Path(args.drift_figure)), mechanism_figure(every_run, Path(args.mechanism_figure))]
    if args.results:
        write_marked_section(args.results, "experiment 07", "experiments/07_dose_threshold/report.py", "\n".join([
            "## 07_dose_threshold", "",
            "Written by `python experiments/07_dose_threshold/report.py` from `results/runs/07_dose_threshold` "
            "(rules: `src/moerl/analysis/dose.py`, `src/moerl/analysis/verdicts.py`; regime and commands: "
            "`experiments/07_dose_threshold/README.md`). Held-out pass@1 is measured by the trained policy in fp32 "
            "for every arm; rollouts use the emulated kernels.", "", text,
            "![dose ladder](figures/07_dose_ladder.png)", ""]
            + (["![mismatch before the collapse](figures/07_mismatch_before_collapse.png)", ""] if drawn[2] else [])
            + (["![mitigations](figures/07_mitigations.png)", "",
                "![threshold by arm](figures/07_threshold_by_arm.png)", ""] if table else [])
            + (["![registered fp8 grid](figures/07_confirmatory_fp8.png)", ""] if drawn[4] else [])
            + (["![registered nvfp4 grid, 600 steps](figures/07_drift_nvfp4_600.png)", ""] if drawn[5] else [])
            + (["![registered mechanism grid](figures/07_mechanism.png)", ""] if drawn[6] else [])))
    written = [out / "ladder.md", out / "ladder.json", *(p for p in drawn if p)] + ([args.results] if args.results else [])
    print(text + "wrote " + ", ".join(map(str, written)))
