"""Experiment 07's confirmatory and mechanism grids: which run belongs to which registered grid, how far
each grid has come, and -- once every registered run of a grid has finished -- its registered verdicts.

The grids, their rules and the rollout path they are recorded on are registered in
``experiments/07_dose_threshold/analysis.yaml`` before their first run. A run belongs to one of these
grids when its arm, rung, seed, evaluation size (``trainer.eval_samples`` x ``trainer.eval_size``
completions) and step count are the grid's and it ran on the registered rollout path. Runs of the
earlier grids (ladder, control, main: 1,024 evaluation completions, recorded before the path was named)
never match, so the two sets are never mixed within a comparison.

No verdict is printed for a grid before its registered seeds are all in: looking at a partial grid and
stopping when it reads well is the optional stopping that pre-registration exists to rule out. Until
then the report prints the grid's progress only.

The rules (all one-sided 95 % t bounds over seeds, moerl.analysis.power.t_verdict):
- ``regime_t`` (confirmatory_control): the fp32 control learns when the lower bound of its mean held-out
  pass@1 gain is above 0.05 and no seed collapsed;
- ``like_control_t``: arm - control (paired by seed) has its lower bound above -0.05 (yes) or its upper
  bound below (no); it needs a learning control, so it reads "not tested" unless ``regime_t`` says yes;
- ``helps_t``: arm - baseline has its lower bound above 0; its power is computed at the registered
  smallest effect (+0.025) from the grid's own paired spread;
- ``acts_on_per_mechanism``: TIS's ratio-tail share and MIS / IcePop's masked share must reach the floor
  in every seed for their "helps" to be tested; R3's re-routed share is reported beside it, not floored;
- ``keeps_drifting`` (confirmatory_nvfp4_600): experiment 05's drift rule, late / early median k3 per seed.

The mechanism grid (where the 4-bit mismatch lives: each 4-bit format on the routed experts only or on
attention only, and Kimi-K2-Thinking's INT4 experts with the trainer-side fake-INT4 arms) is judged by
counting collapsed seeds -- collapse against no collapse is a large effect, and 5 seeds of one kind make
"every seed" p = 1/32 under a fair coin:
- ``<arm> collapses``: yes when every seed collapsed, no when none, otherwise ``partly (k of n)``;
- ``<arm> prevents collapse``: against the baseline at the same rung, counted on the arm's own seeds
  (``prevents_collapse_seeds``, first written for the main grid): not tested where the baseline collapsed
  in no seed, yes when no seed of the arm collapsed, no when as many did, partly when fewer;
- ``like_control_t`` against the confirmatory control and ``helps_t`` between two arms at one rung, as above,
  the latter with its power at the registered smallest effect from the grid's own pooled paired spread.
Every verdict carries its power beside its interval: a t rule's at an assumed true effect named beside it
(the registered smallest effect for "helps" and "behind", no true difference for "like the control", the
earlier grids' ``control_gain`` for the regime) from the grid's own paired spread; an every-seed rule's as
q ** n at assumed per-seed chances q (EVENT_PROBABILITIES); each says whether it reaches the registered 80 %.
The verdicts that need a learning control (collapses, prevents collapse, like the control -- here and at
fp8) read "not tested" unless the confirmatory control's ``regime_t`` verdict is yes; the ungated verdict is kept beside
them. Every registered (arm, rung) also gets an exploratory row (collapsed seeds, mean final pass@1 with its
t interval, median run k3) with no verdict; so does every arm of the 600-step nvfp4 grid, with its collapse
steps (does a correction stop the collapse or only delay it?). Like the fp8 verdicts, the mechanism verdicts
wait for both the mechanism grid and the confirmatory control to be complete; a grid's exploratory rows for
the grid alone.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from moerl.analysis import familywise, power
from moerl.analysis.verdicts import NO, NOT_TESTED, PARTLY, YES, keeps_drifting

# The grids analysis.yaml says are recorded on its rollout path (its comment above ``rollout_path``).
PATH_GRIDS = ("confirmatory_control", "confirmatory_fp8", "confirmatory_nvfp4_600", "mechanism", "crossover")
DEFAULT_STEPS = 300
# The registered rules each kind of verdict is computed under (for its post-hoc label); only those whose
# ``grids`` list the verdict's grid are looked up.
RULES_USED = {"regime": ("regime_t", "collapse"), "like_control": ("like_control_t",),
              "helps": ("helps_t", "acts_on_per_mechanism"), "behind": ("helps_t",),
              "keeps_drifting": ("drift", "acts_on_per_mechanism"),
              # the mechanism grid's verdicts; the gated ones also under the control's regime rule
              "collapses": ("collapse", "regime_t"),
              "prevents_collapse": ("prevents_collapse_seeds", "collapse", "regime_t"),
              "like_control_gated": ("like_control_t", "regime_t", "collapse"),
              "helps_over": ("helps_t",)}
RATIO_TAIL_ARMS = ("tis",)
MASKED_ARMS = ("mis", "icepop")
REROUTED_ARMS = ("r3", "r3_tis")


@dataclass(frozen=True)
class Grid:
    name: str
    arms: tuple[str, ...]
    rungs: tuple[str, ...]
    seeds: tuple[int, ...]
    eval_completions: int
    steps: int
    only: dict  # arm -> the rungs it runs at, where an arm does not run at every rung

    @classmethod
    def from_registered(cls, name: str, spec: dict) -> "Grid":
        only = {}
        if name == "mechanism":  # "qat_* at int4_kimi only" (analysis.yaml, grids.mechanism.runs)
            only = {arm: ("int4_kimi",) for arm in spec["arms"] if arm.startswith("qat_")}
        if name == "crossover":  # "baseline at the four quantised rungs; fp32_control at fp32" (grids.crossover.runs)
            only = {"fp32_control": ("fp32",), "baseline": tuple(r for r in spec["rungs"] if r != "fp32")}
        return cls(name, tuple(spec["arms"]), tuple(spec["rungs"]), tuple(spec["seeds"]),
                   int(spec["eval_completions"]), int(spec.get("steps", DEFAULT_STEPS)), only)

    def planned(self) -> list[tuple[str, str, int]]:
        """Every registered (arm, rung, seed) of the grid."""
        return [(a, r, s) for a in self.arms for r in self.only.get(a, self.rungs) for s in self.seeds]


# An every-seed verdict (collapses, prevents collapse, keeps drifting) needs its event in each of n seeds:
# its power is q ** n for a per-seed probability q of the event. No q is registered, so the power is shown
# at these two, each named beside it.
EVENT_PROBABILITIES = (0.9, 0.95)


def t_power(effect: float, threshold: float, sd: float, n: int, alpha: float, assumed: str) -> dict | None:
    """Power of a t-rule verdict (moerl.analysis.power.power_t) at an assumed true ``effect``, from the
    grid's own paired sd; None where the sd or the seeds are too few to say."""
    if not sd == sd or n < 2:
        return None
    return {"value": power.power_t(effect, threshold, sd, n, alpha), "effect": effect, "threshold": threshold,
            "assumed": assumed}


def every_seed_power(n: int) -> dict:
    """Power of an every-seed verdict over ``n`` seeds at each of EVENT_PROBABILITIES."""
    return {"every_seed": {q: q ** n for q in EVENT_PROBABILITIES}, "n": n}


def _pooled_sd(groups: list[dict[int, float]]) -> float:
    """The pooled paired sd of several arms' per-seed differences (each centred on its own mean)."""
    return power.pooled_sd([list(d.values()) for d in groups if len(d) >= 2])[0]


def rules_of(registered: dict) -> dict:
    """Every registered rule's current value."""
    return {name: spec["value"] for name, spec in registered["rules"].items()}


def path_grids(registered: dict) -> dict[str, Grid]:
    return {name: Grid.from_registered(name, registered["grids"][name]) for name in PATH_GRIDS
            if name in registered["grids"]}


def on_path(run: dict, registered: dict) -> bool:
    """The run ran on the registered rollout path (its config names the path's key and value)."""
    path = registered["rollout_path"]
    return run.get("path", {}).get(path["key"]) == path["value"]


def grid_of(run: dict, registered: dict) -> str | None:
    """The path grid ``run`` belongs to, or None (a run of the earlier grids, or of none)."""
    if not on_path(run, registered):
        return None
    for grid in path_grids(registered).values():
        if ((run["arm"], run["rung"], run["seed"]) in grid.planned()
                and run.get("eval_completions") == grid.eval_completions and run["steps_planned"] == grid.steps):
            return grid.name
    return None


def finished(run: dict) -> bool:
    return run.get("steps") == run.get("steps_planned")


def progress(runs: list[dict], registered: dict) -> dict[str, dict]:
    """Per path grid: registered runs, finished runs, whether the grid is complete, the machine kinds its
    finished runs were recorded on (``machines``: kind -> runs; moerl.analysis.dose.machine_kind), and the
    run time its unfinished runs need (``seconds_left``) at the median over its finished runs of their logged
    time per step (a median: runs that shared the CPU with other work log slower steps), over every path
    grid's finished runs where the grid has none yet; None where no run has finished."""
    grids = path_grids(registered)
    members = {name: {(r["arm"], r["rung"], r["seed"]): r for r in runs if grid_of(r, registered) == name}
               for name in grids}
    done = {name: [members[name][key] for key in grid.planned() if key in members[name]
                   and finished(members[name][key])] for name, grid in grids.items()}
    pooled = _seconds_per_step([r for runs_done in done.values() for r in runs_done])
    out = {}
    for name, grid in grids.items():
        mine = members[name]
        machines: dict[str, int] = {}
        for r in done[name]:
            kind = r.get("machine") or "not recorded"
            machines[kind] = machines.get(kind, 0) + 1
        # unfinished runs count whole: a partial run is not committed, so the estimate is the same in any clone
        steps_left = grid.steps * (len(grid.planned()) - len(done[name]))
        rate = _seconds_per_step(done[name]) or pooled
        out[name] = {"planned": len(grid.planned()), "finished": len(done[name]), "started": len(mine),
                     "complete": len(done[name]) == len(grid.planned()), "machines": machines,
                     "seconds_left": 0.0 if not steps_left else None if rate is None else rate * steps_left}
    return out


def _seconds_per_step(runs: list[dict]) -> float | None:
    """Median over runs of each run's logged seconds per step; None where no run logged its time."""
    rates = [r["seconds"] / r["steps"] for r in runs if r.get("seconds") and r.get("steps")]
    return float(np.median(rates)) if rates else None


def cell_by_seed(runs: list[dict], grid: str, arm: str, rung: str, registered: dict) -> dict[int, dict]:
    """A registered grid's finished runs of one arm at one rung, by seed (its paired comparisons' unit)."""
    return {r["seed"]: r for r in runs
            if grid_of(r, registered) == grid and r["arm"] == arm and r["rung"] == rung and finished(r)}


def _gain(run: dict) -> float | None:
    if run.get("pass1_start") is None or run.get("pass1_end") is None:
        return None
    return run["pass1_end"] - run["pass1_start"]


def _paired(a: dict[int, dict], b: dict[int, dict], value) -> dict[int, float]:
    pairs = {s: (value(a[s]), value(b[s])) for s in sorted(set(a) & set(b))}
    return {s: x - y for s, (x, y) in pairs.items() if x is not None and y is not None}


def _interval(values: dict[int, float], alpha: float | None = None) -> dict:
    """The mean over seeds with an interval: for a verdict (``alpha`` given) the rule's own one-sided
    (1 - alpha) t bounds -- the two-sided (1 - 2 alpha) interval -- so that the printed bounds are the ones
    the verdict compares with its threshold; without ``alpha`` (no verdict) the two-sided 95 % interval."""
    level = 0.95 if alpha is None else 1 - 2 * alpha
    interval = power.t_interval(values.values(), level=level)
    return {"n": len(values), "mean": interval[0] if interval else None,
            "low": interval[1] if interval else None, "high": interval[2] if interval else None,
            "one_sided": None if alpha is None else 1 - alpha}


def regime(controls: dict[int, dict], rule: dict, assumed_gain: float | None = None) -> dict:
    """``regime_t``: the control's mean gain has its one-sided lower bound above the registered value and
    no seed collapsed; its power at a true mean gain of ``assumed_gain`` (the earlier grids' ``control_gain``)
    from the seeds' own spread."""
    gains = {s: g for s, r in controls.items() if (g := _gain(r)) is not None}
    collapsed = sorted(s for s, r in controls.items() if r.get("collapse_step") is not None)
    alpha = 1 - rule["level"]
    verdict = power.t_verdict(gains.values(), rule["lower_bound_above"], alpha=alpha)
    if rule.get("no_collapse") and collapsed:
        verdict = "no"
    sd = float(np.std(list(gains.values()), ddof=1)) if len(gains) >= 2 else float("nan")
    at = None if assumed_gain is None else t_power(assumed_gain, rule["lower_bound_above"], sd, len(gains), alpha,
                                                   "true mean gain, the earlier grids' control_gain")
    return {"verdict": verdict, "gain": _interval(gains, alpha), "collapsed_seeds": collapsed, "power": at,
            "p": familywise.t_p(gains.values(), rule["lower_bound_above"])}


def _acted(arm: str, runs: dict[int, dict], rule: dict) -> tuple[str | None, list[float], bool | None]:
    """(measure, per-seed shares, acted) under ``acts_on_per_mechanism``: floored for the ratio tail and the
    masked share, reported for re-routing (acted None)."""
    measure = (rule["ratio_tail"] if arm in RATIO_TAIL_ARMS else rule["masked"] if arm in MASKED_ARMS
               else rule["rerouted"] if arm in REROUTED_ARMS else None)
    if measure is None:
        return None, [], None
    shares = [r["acts_on"].get(measure) for r in runs.values() if r.get("acts_on", {}).get(measure) is not None]
    if arm in REROUTED_ARMS:
        return measure, shares, None
    return measure, shares, bool(shares) and len(shares) == len(runs) and min(shares) >= rule["floor"]


def fp8_verdicts(runs: list[dict], registered: dict, rules: dict, regime_verdict: str) -> dict:
    """The registered fp8 comparisons (``confirmatory_comparisons``), each with its t interval and power;
    "like the control" needs a learning control and is gated by the control's ``regime_verdict``."""
    grid = "confirmatory_fp8"
    control = cell_by_seed(runs, "confirmatory_control", "fp32_control", "fp32", registered)
    baseline = cell_by_seed(runs, grid, "baseline", "fp8", registered)
    like, helps, acts = rules["like_control_t"], rules["helps_t"], rules["acts_on_per_mechanism"]
    alpha = 1 - helps["level"]
    final = lambda r: r.get("pass1_end")  # noqa: E731 - the compared quantity, named once
    out = {}
    arms = registered["grids"][grid]["arms"]
    # the noise model's paired sds (moerl.analysis.power): every arm - baseline, every arm - control
    sd = _pooled_sd([_paired(cell_by_seed(runs, grid, arm, "fp8", registered), baseline, final)
                     for arm in arms if arm != "baseline"])
    sd_control = _pooled_sd([_paired(cell_by_seed(runs, grid, arm, "fp8", registered), control, final) for arm in arms])
    behind = _paired(control, baseline, final)
    out["baseline behind control"] = {"verdict": power.t_verdict(behind.values(), 0.0, alpha=alpha),
                                      "p": familywise.t_p(behind.values(), 0.0),
                                      "difference": "control - baseline", **_interval(behind, alpha),
                                      "power": t_power(helps["smallest_effect"], 0.0, sd_control, len(behind), alpha,
                                                       "the registered smallest effect")}
    for comparison in rules["confirmatory_comparisons"][grid]:
        arm, kind = comparison.split(" ", 1)
        if arm == "baseline":
            continue
        mine = cell_by_seed(runs, grid, arm, "fp8", registered)
        if kind == "like_control":
            diff = _paired(mine, control, final)
            verdict = power.t_verdict(diff.values(), -like["margin"], alpha=1 - like["level"])
            out[comparison] = _regime_gated({"kind": "like_control_gated", "verdict": verdict,
                                             "p": familywise.t_p(diff.values(), -like["margin"]),
                                             "difference": f"{arm} - control",
                                             **_interval(diff, 1 - like["level"]),
                                             "power": t_power(0.0, -like["margin"], sd_control, len(diff),
                                                              1 - like["level"], "no true difference")},
                                            regime_verdict)
        elif kind == "helps":
            diff = _paired(mine, baseline, final)
            measure, shares, acted = _acted(arm, mine, acts)
            verdict = power.t_verdict(diff.values(), helps["threshold"], alpha=alpha)
            n = len(diff)
            out[comparison] = {"verdict": verdict, "p": familywise.t_p(diff.values(), helps["threshold"]),
                               "difference": f"{arm} - baseline", **_interval(diff, alpha),
                               "acts_on": {"measure": measure, "min": min(shares) if shares else None,
                                           "floored": acted is not None, "floor": acts["floor"]},
                               "power": t_power(helps["smallest_effect"], helps["threshold"], sd, n, alpha,
                                                "the registered smallest effect")}
            if acted is False:  # the mechanism touched too few tokens for an effect to be put down to it
                out[comparison] = {**out[comparison], "verdict": NOT_TESTED, "floor_ungated": verdict}
    return out


def minus_control(runs: list[dict], registered: dict, grid: str = "confirmatory_fp8") -> dict[str, dict[int, float]]:
    """Per arm of ``grid`` (at its one rung), each seed's final held-out pass@1 minus the confirmatory
    control's of the same seed: the quantity the "like the control" rule reads, for every arm."""
    spec = path_grids(registered)[grid]
    control = cell_by_seed(runs, "confirmatory_control", "fp32_control", "fp32", registered)
    final = lambda r: r.get("pass1_end")  # noqa: E731 - the compared quantity, named once
    return {arm: _paired(cell_by_seed(runs, grid, arm, spec.rungs[0], registered), control, final) for arm in spec.arms}


def drift_verdicts(runs: list[dict], registered: dict, rules: dict) -> dict:
    """``keeps_drifting`` at nvfp4 over 600 steps: does the correction stop the drift or only delay it."""
    grid = "confirmatory_nvfp4_600"
    baseline = cell_by_seed(runs, grid, "baseline", "nvfp4", registered)
    base_growth = [r["k3_growth"] for r in baseline.values() if r.get("k3_growth") is not None]
    out = {}
    for comparison in rules["confirmatory_comparisons"][grid]:
        arm = comparison.split(" ", 1)[0]
        mine = cell_by_seed(runs, grid, arm, "nvfp4", registered)
        _, _, acted = _acted(arm, mine, rules["acts_on_per_mechanism"])
        growth = [r["k3_growth"] for r in mine.values() if r.get("k3_growth") is not None]
        out[comparison] = {"verdict": keeps_drifting(growth, base_growth, acted), "k3_growth": growth,
                           "p": familywise.sign_p(sum(g > rules["drift"]["growth"] for g in growth), len(growth)),
                           "baseline_k3_growth": base_growth, "power": every_seed_power(len(growth))}
    return out


def _collapsed(runs: dict[int, dict]) -> list[int]:
    return sorted(s for s, r in runs.items() if r.get("collapse_step") is not None)


def collapses(runs: dict[int, dict]) -> dict:
    """``<arm> collapses``: yes when every seed collapsed, no when none, ``partly (k of n)`` otherwise."""
    collapsed, n = _collapsed(runs), len(runs)
    verdict = (NOT_TESTED if not n else YES if len(collapsed) == n else NO if not collapsed
               else f"{PARTLY} ({len(collapsed)} of {n})")
    return {"verdict": verdict, "n": n, "collapsed_seeds": collapsed, "power": every_seed_power(n),
            "p": familywise.sign_p(len(collapsed), n)}


def prevents_collapse(arm: dict[int, dict], baseline: dict[int, dict]) -> dict:
    """``<arm> prevents collapse`` against the baseline at the same rung, the baseline's collapses counted on
    the arm's own seeds (``prevents_collapse_seeds``): not tested where the baseline collapsed in none of
    them, yes when no seed of the arm collapsed, no when as many did, partly when fewer."""
    own = _collapsed(arm)
    base = [s for s in _collapsed(baseline) if s in arm]
    verdict = NOT_TESTED if not base else YES if not own else NO if len(own) >= len(base) else PARTLY
    return {"verdict": verdict, "n": len(arm), "collapsed_seeds": own, "baseline_collapsed_seeds": base,
            "power": every_seed_power(len(arm)),
            # the baseline collapsing more often than the arm, on the arm's own seeds
            "p": familywise.fisher_p(len(base), len(arm), len(own), len(arm))}


def _regime_gated(verdict: dict, regime_verdict: str) -> dict:
    """A verdict that needs a learning control: not tested unless the control's regime verdict is yes (the
    ungated verdict kept under ``ungated``)."""
    if regime_verdict == YES:
        return {**verdict, "regime": regime_verdict}
    return {**verdict, "verdict": NOT_TESTED, "ungated": verdict["verdict"], "regime": regime_verdict}


# A registered mechanism comparison: "<arm> collapses | prevents collapse | like_control | helps over <arm>",
# optionally "at each rung" or "at <rung>" (without: the one rung the arm runs at).
_MECHANISM_COMPARISON = re.compile(r"(?P<arm>\w+) (?P<kind>collapses|prevents collapse|like_control|helps over "
                                   r"(?P<other>\w+))(?: at (?P<at>each rung|\w+))?")


def _comparison_rungs(comparison: str, arms: list[str], at: str | None, grid: Grid, where: str
                      ) -> list[tuple[str, str]]:
    """(verdict name, rung) for each rung a registered comparison is judged at (every one of ``arms`` runs
    there); ``where`` names the comparison's key for the error."""
    ran = [r for r in grid.rungs if all(a in grid.arms and r in grid.only.get(a, grid.rungs) for a in arms)]
    if at == "each rung" and ran:
        return [(f"{comparison.removesuffix(' at each rung')} at {rung}", rung) for rung in ran]
    if at is not None and at in ran:
        return [(comparison, at)]
    if at is None and len(ran) == 1:
        return [(comparison, ran[0])]
    raise ValueError(f"{where}: {comparison!r} names no rung where {' and '.join(arms)} run in grids.{grid.name} "
                     f"(they share {ran or 'no rung'})")


def mechanism_verdicts(runs: list[dict], registered: dict, rules: dict, regime_verdict: str) -> dict:
    """The registered mechanism comparisons (``confirmatory_comparisons``), one verdict per rung each is
    judged at; collapses, prevents collapse and like the control gated by the control's ``regime_verdict``."""
    name = "mechanism"
    grid = path_grids(registered)[name]
    control = cell_by_seed(runs, "confirmatory_control", "fp32_control", "fp32", registered)
    like, helps = rules["like_control_t"], rules["helps_t"]
    final = lambda r: r.get("pass1_end")  # noqa: E731 - the compared quantity, named once
    arm_at = lambda arm, rung: cell_by_seed(runs, name, arm, rung, registered)  # noqa: E731
    where = f"experiments/{registered.get('experiment', '?')}/analysis.yaml: rules.confirmatory_comparisons.{name}"
    out = {}
    for comparison in rules["confirmatory_comparisons"][name]:
        match = _MECHANISM_COMPARISON.fullmatch(comparison)
        if match is None:
            raise ValueError(f"{where}: {comparison!r} is not '<arm> collapses | prevents collapse | like_control | "
                             "helps over <arm>' [at each rung | at <rung>]")
        arm, kind, other = match["arm"], match["kind"], match["other"]
        compared = [arm, "baseline"] if kind == "prevents collapse" else [arm, other] if other else [arm]
        for key, rung in _comparison_rungs(comparison, compared, match["at"], grid, where):
            mine = arm_at(arm, rung)
            if kind == "collapses":
                out[key] = _regime_gated({"kind": "collapses", **collapses(mine)}, regime_verdict)
            elif kind == "prevents collapse":
                out[key] = _regime_gated({"kind": "prevents_collapse",
                                          **prevents_collapse(mine, arm_at("baseline", rung))}, regime_verdict)
            elif kind == "like_control":
                diff = _paired(mine, control, final)
                verdict = power.t_verdict(diff.values(), -like["margin"], alpha=1 - like["level"])
                sd_control = _pooled_sd([_paired(arm_at(a, rung), control, final) for a in grid.arms
                                         if rung in grid.only.get(a, grid.rungs)])
                out[key] = _regime_gated({"kind": "like_control_gated", "verdict": verdict,
                                          "p": familywise.t_p(diff.values(), -like["margin"]),
                                          "difference": f"{arm} - control",
                                          **_interval(diff, 1 - like["level"]),
                                          "power": t_power(0.0, -like["margin"], sd_control, len(diff),
                                                           1 - like["level"], "no true difference")},
                                         regime_verdict)
            else:  # helps over another arm at the same rung, paired by seed
                alpha = 1 - helps["level"]
                diff = _paired(mine, arm_at(other, rung), final)
                # the noise model's paired sd at this rung (moerl.analysis.power): every arm - baseline,
                # each centred on its own mean, as for the fp8 grid
                baseline = arm_at("baseline", rung)
                sd = _pooled_sd([_paired(arm_at(a, rung), baseline, final) for a in grid.arms
                                 if a != "baseline" and rung in grid.only.get(a, grid.rungs)])
                out[key] = {"kind": "helps_over", "verdict": power.t_verdict(diff.values(), helps["threshold"], alpha),
                            "p": familywise.t_p(diff.values(), helps["threshold"]),
                            "difference": f"{arm} - {other}", **_interval(diff, alpha),
                            "power": t_power(helps["smallest_effect"], helps["threshold"], sd, len(diff), alpha,
                                             "the registered smallest effect")}
    return out


def exploratory_table(runs: list[dict], registered: dict, grid_name: str) -> list[dict]:
    """Exploratory, no verdict: per registered (arm, rung) of a grid, the seeds that collapsed and their
    collapse steps (at 600 steps: does a correction only delay the collapse?), the mean final pass@1 with its
    95 % t interval, and the median over seeds of the run-median k3."""
    grid = path_grids(registered)[grid_name]
    rows = []
    for arm in grid.arms:
        for rung in grid.only.get(arm, grid.rungs):
            mine = cell_by_seed(runs, grid.name, arm, rung, registered)
            finals = {s: r["pass1_end"] for s, r in mine.items() if r.get("pass1_end") is not None}
            k3 = [r["k3_median"] for r in mine.values() if r.get("k3_median") is not None]
            rows.append({"arm": arm, "rung": rung, "n": len(mine), "collapsed": len(_collapsed(mine)),
                         "collapse_steps": [mine[s]["collapse_step"] for s in _collapsed(mine)],
                         "pass1_end": _interval(finals), "k3_median": float(np.median(k3)) if k3 else None})
    return rows


# The grids whose every (arm, rung) is also described, without a verdict, once the grid is complete: the
# mechanism grid's cells, and the 600-step grid's pass@1 and collapse steps (registered as exploratory).
EXPLORATORY_GRIDS = ("confirmatory_nvfp4_600", "mechanism")


def report(runs: list[dict], registered: dict, rules: dict) -> dict:
    """Progress of every path grid; the verdicts of each grid once it and the confirmatory control are
    complete (the control's alone once it is); the mechanism grid's exploratory table once that grid is
    complete (``exploratory``; also the 600-step grid's)."""
    status = progress(runs, registered)
    out = {"progress": status, "verdicts": {}, "exploratory": {}}
    for grid in EXPLORATORY_GRIDS:
        if status.get(grid, {}).get("complete"):
            out["exploratory"][grid] = exploratory_table(runs, registered, grid)
    if status.get("confirmatory_control", {}).get("complete"):
        controls = cell_by_seed(runs, "confirmatory_control", "fp32_control", "fp32", registered)
        control_regime = regime(controls, rules["regime_t"], rules.get("control_gain"))
        if rules.get("control_gain") is not None:
            # regime_t replaced the rule first written (a gain >= control_gain in every seed) after that rule
            # failed on the 3-seed control: the first rule's reading on these seeds is printed beside it
            gains = [r["pass1_end"] - r["pass1_start"] for r in controls.values()
                     if r.get("pass1_end") is not None and r.get("pass1_start") is not None]
            control_regime["first_rule"] = {"threshold": rules["control_gain"], "met": sum(g >= rules["control_gain"]
                                                                                          for g in gains), "n": len(gains)}
        out["verdicts"]["confirmatory_control"] = {"regime": control_regime}
        if status.get("confirmatory_fp8", {}).get("complete"):
            out["verdicts"]["confirmatory_fp8"] = fp8_verdicts(runs, registered, rules, control_regime["verdict"])
        if status.get("confirmatory_nvfp4_600", {}).get("complete"):
            out["verdicts"]["confirmatory_nvfp4_600"] = drift_verdicts(runs, registered, rules)
        if status.get("mechanism", {}).get("complete"):
            out["verdicts"]["mechanism"] = mechanism_verdicts(runs, registered, rules, control_regime["verdict"])
    # family-wise: each registered family's verdicts with raw and Holm-adjusted p (moerl.analysis.familywise)
    fw = rules.get("family_wise")
    for grid, verdicts in out["verdicts"].items():
        if fw is not None:
            out["verdicts"][grid] = (familywise.apply(verdicts, fw["alpha"]) if grid in fw["families"] else
                                     {name: {**v, "p_holm": v.get("p"), "family_size": 1, "verdict_holm": v["verdict"]}
                                      for name, v in verdicts.items()})
    return out


def _kind(comparison: str) -> str:
    return ("regime" if comparison == "regime" else "behind" if comparison.endswith("behind control")
            else comparison.split(" ", 1)[1])


def rules_used(name: str, verdict: dict, grid: str, registered: dict) -> list[str]:
    """The registered rules of ``grid`` that verdict ``name`` is computed under (for its post-hoc label)."""
    return [r for r in RULES_USED[verdict.get("kind") or _kind(name)] if grid in registered["rules"][r]["grids"]]


def power_note(at: dict, target: float) -> str:
    """'power 0.97 at a true +0.025 (why); reaches 80 %' for a t rule; for an every-seed rule its power at
    each assumed per-seed probability, and whether the registered target is reached."""
    if "every_seed" in at:
        values = at["every_seed"]
        reach = ("reaches" if min(values.values()) >= target else
                 "below" if max(values.values()) < target else "reaches only at the higher")
        return (f"power (every seed of {at['n']}) " + ", ".join(f"{p:.2f} at a per-seed chance of {q:g}"
                                                                 for q, p in values.items())
                + f"; {reach} {target * 100:.0f} %")
    reach = "reaches" if at["value"] >= target else "below"
    return f"power {at['value']:.2f} at a true {at['effect']:+.3f} ({at['assumed']}); {reach} {target * 100:.0f} %"


def markdown(result: dict, label: Callable[[list[str], str], str] | None = None,
             registered: dict | None = None) -> str:
    """The report's section: a progress table, then each complete grid's verdicts, each followed by its
    post-hoc label (``label(rules, grid)``, e.g. ``Registration.labels``) where one applies, then the
    mechanism grid's exploratory table (no verdict)."""
    lines = ["", "### Confirmatory and mechanism grids (registered before their first run)", "",
             "Recorded on the registered rollout path; no verdict before a grid's registered runs are all in "
             "(finished runs are committed as they land). Run time left: the unfinished runs, at the median "
             "logged time per step of the grid's finished runs, in core-hours (one core per run).", "",
             "| grid | registered runs | finished | run time left (estimated) | verdicts | finished runs recorded on |",
             "|---|---|---|---|---|---|"]
    for name, p in result["progress"].items():
        state = "computed below" if name in result["verdicts"] else (
            "waits for confirmatory_control" if p["complete"] else "after the last registered run")
        machines = p.get("machines") or {}
        where = ("—" if not machines else next(iter(machines)) if len(machines) == 1 else
                 f"**{len(machines)} machine kinds**: " + "; ".join(f"{k} ({n})" for k, n in machines.items()))
        left = p.get("seconds_left")
        left = "—" if left is None else "none" if left == 0 else f"{left / 3600:.1f} h"
        lines.append(f"| {name} | {p['planned']} | {p['finished']} | {left} | {state} | {where} |")
    target = (registered or {}).get("rules", {}).get("power", {}).get("value", {}).get("target", power.TARGET_POWER)
    if result["verdicts"] and registered is not None:
        rules = rules_of(registered)
        lines += ["", "Each t-rule verdict is printed with the bounds its rule reads: the one-sided 95 % t bounds "
                  "of the mean over seeds (together the two-sided 90 % interval). \"helps\" is yes when the lower "
                  f"bound is above {rules['helps_t']['threshold']:g}; \"like the control\" yes when it is above "
                  f"−{rules['like_control_t']['margin']:g} and no when the upper bound is below; the regime yes when "
                  f"the control's mean gain has its lower bound above {rules['regime_t']['lower_bound_above']:g}."]
    for grid, verdicts in result["verdicts"].items():
        levels = {x["one_sided"] for v in verdicts.values() for x in (v.get("gain", v),) if x.get("one_sided")}
        bounds = " / ".join(f"{100 * q:g} %" for q in sorted(levels)) or "95 %"
        holm = any("p_holm" in v for v in verdicts.values())
        family = ("| p (one-sided) | Holm-adjusted p | verdict under Holm " if holm else "")
        if holm and label is not None and registered is not None and grid in registered["rules"].get(
                "family_wise", {}).get("grids", []):
            late = label(["family_wise"], grid)
            lines += ["", f"Holm within {grid}'s {len(verdicts)} comparisons: "
                      + (f"a new reading of a grid already read (*{late}*); the verdict column is each verdict as "
                         "first read" if late else "registered before the grid's first run")]
        lines += ["", f"**{grid}**", "", f"| comparison | verdict | mean [one-sided {bounds} t bounds] | seeds "
                  f"{family}| notes |", "|---|---|---|---|" + ("---|---|---|" if holm else "") + "---|"]
        for name, v in verdicts.items():
            interval = v.get("gain", v)
            mean = (f"{interval['mean']:+.3f} [{interval['low']:+.3f}, {interval['high']:+.3f}]"
                    if interval.get("mean") is not None and interval.get("low") is not None else "—")
            notes = []
            if v.get("collapsed_seeds"):
                notes.append(f"collapsed seeds {v['collapsed_seeds']}")
            if "baseline_collapsed_seeds" in v:
                notes.append(f"the baseline's collapsed seeds {v['baseline_collapsed_seeds'] or 'none'}")
            if "ungated" in v:
                notes.append(f"gated: the control's regime verdict is {v['regime']} (ungated: {v['ungated']})")
            if v.get("first_rule"):
                first = v["first_rule"]
                notes.append(f"*post hoc: this rule relaxed the one first written (a gain ≥ {first['threshold']:g} in "
                             f"every seed) after that failed on the 3-seed control; under it: met in {first['met']} "
                             f"of {first['n']} seeds*")
            if v.get("power"):
                notes.append(power_note(v["power"], target))
            if v.get("acts_on", {}).get("min") is not None:
                acts = v["acts_on"]
                notes.append(f"{acts['measure']} {acts['min']:.3f} in its lowest seed"
                             + (" (reported, not floored)" if not acts["floored"] else
                                f" (below the {acts['floor']:g} floor: not tested; ungated: {v['floor_ungated']})"
                                if "floor_ungated" in v else f" (floor {acts['floor']:g}: met)"))
            if "k3_growth" in v:
                notes.append("late / early k3 " + ", ".join(f"{g:.2f}" for g in v["k3_growth"]))
            if label is not None and registered is not None:
                rules = rules_used(name, v, grid, registered)
                late = label(rules, grid)
                if late:
                    notes.append(f"*{late}*")
            seeds = interval.get('n', len(v.get('k3_growth', [])))
            corrected = ""
            if holm:
                fmt = lambda p: "—" if p is None else f"{p:.3g}"  # noqa: E731
                size = f" (of {v['family_size']})" if v.get("family_size", 1) > 1 else ""
                changed = v["verdict_holm"] != v["verdict"]
                corrected = (f"{fmt(v.get('p'))} | {fmt(v.get('p_holm'))}{size} | "
                             f"{'**' + v['verdict_holm'] + '**' if changed else v['verdict_holm']} | ")
            lines.append(f"| {name} | {v['verdict']} | {mean} | {seeds} | {corrected}{'; '.join(notes)} |")
    for grid, rows in result.get("exploratory", {}).items():
        lines += ["", f"**{grid} — exploratory** (no verdict: described, not tested)", "",
                  "| arm | rung | collapsed (at steps) | final pass@1 mean [95 % t interval] | median run k3 |",
                  "|---|---|---|---|---|"]
        for row in rows:
            p = row["pass1_end"]
            mean = (f"{p['mean']:.3f} [{p['low']:.3f}, {p['high']:.3f}]" if p["mean"] is not None else "—")
            k3 = "—" if row["k3_median"] is None else f"{row['k3_median']:.2e}"
            steps = f" ({', '.join(map(str, row['collapse_steps']))})" if row.get("collapse_steps") else ""
            lines.append(f"| {row['arm']} | {row['rung']} | {row['collapsed']} of {row['n']}{steps} | {mean} | {k3} |")
    return "\n".join(lines) + "\n"
