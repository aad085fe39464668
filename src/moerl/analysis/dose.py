"""Experiment 07's dose ladder: rollout precisions as doses of mismatch, one summary per run, and the
collapse threshold, all by rules fixed before the main grid.

A rung is a rollout precision (``rollout.dtype``; moerl.rollout.precision): fp32 is the control (no
mismatch), the others are real low-precision mechanisms. Rungs are *ordered by the mismatch they cause*
(the pilot's run-median k3), not by bit width: per-channel int8 rounds weights less than fp8 e4m3 does.

Rules (moerl.analysis.collapse defines a collapse):
- **the control learns** when the fp32 run does not collapse and its held-out pass@1 (fp32 evaluator)
  rises by at least ``CONTROL_GAIN`` from step 0 to the end;
- **the threshold** is the lowest rung, in mismatch order, whose uncorrected (baseline) run collapses
  while the control learns; no such rung: no threshold within the budget (a result, stated as such).

The main grid (every mitigation arm x 3 seeds at a rung) is judged per arm on *paired seeds* (seed s of
an arm against seed s of the baseline and of the control: same prompts, same initial LoRA), with
moerl.analysis.verdicts' rules (:func:`mitigation_verdicts`):
- **helps**: the arm's final held-out pass@1 minus the baseline's, every seed above 0 -> yes, every seed
  below -> no, straddling -> inconclusive;
- **trains like the control**: the arm's final pass@1 minus the control's, every seed above
  ``-MATCH_MARGIN`` -> yes, every seed below -> no, straddling -> inconclusive;
- **prevents collapse** (only where the baseline collapsed in some seed): no collapsed seed -> yes,
  as many as the baseline on the same seeds -> no, fewer -> partly;
- both gated to *not tested* when the arm acted on < 1 % of tokens in every seed (``ACTS_ON``: TIS
  reweighted by a factor of 2 or more, MIS / IcePop masked, R3 replayed a different expert set
  somewhere in the token's stack) or when the baseline did not fall behind the control in every paired
  seed (nothing to mitigate).

Every threshold, margin, measure and gate is read from the registered analysis,
``experiments/07_dose_threshold/analysis.yaml`` (moerl.analysis.registration), which also records when each
was written and every amendment; the report labels a verdict under an amended rule post hoc and prints
the verdict under the rule as first written beside it. Three rules were amended after the grid started:
TIS's "acted on" measure (its *truncated* share ρ > C, widened to both tails, ρ outside [1/C, C]:
token TIS scales down as many tokens as it caps), "prevents collapse" counted on the arm's own seeds,
and "trains like the control" (written "within 0.05", two-sided; now "at most 0.05 below").

**One gate.** A verdict that needs a learning control (the threshold, the collapse claim, "trains like
the control", "prevents collapse") is gated by :func:`regime` — the fp32 control learns in every one of
the registered number of seeds — in this one place; "helps" (arm against baseline), R3's mismatch claim
and the drift and masking rules compare arms with each other and are not.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import yaml

from moerl.analysis import power, registration
from moerl.analysis.collapse import collapse_step
from moerl.config import current_arm
from moerl.tracking import logged_seconds, read_metrics
from moerl.analysis.verdicts import (EARLY_LATE_WINDOW, INCONCLUSIVE, NO, NOT_TESTED, PARTLY, YES, acts_on, beyond_control,
                            by_threshold, gate, keeps_drifting)

EXPERIMENT = "07_dose_threshold"
REGISTERED = registration.load(registration.analysis_path(EXPERIMENT))


def registered(rule: str, first_written: bool = False):
    """A rule's registered value (``first_written``: the value it had before its first amendment)."""
    spec = REGISTERED["rules"][rule]
    amendments = spec.get("amendments") or []
    return amendments[0]["was"] if first_written and amendments else spec["value"]


def _by_current_arm(measures: dict) -> dict:
    """A registered value keyed by arm (the arms as the file wrote them then: ``mis``), keyed by current names."""
    return {current_arm(EXPERIMENT, arm): measure for arm, measure in measures.items()}


RUNGS = ("fp32", "bf16", "int8", "fp8", "nvfp4", "int4")  # every precision the ladder can run
CONTROL_GAIN = registered("control_gain")  # held-out pass@1, end minus step 0
REWARD_WINDOW = 25
GRID_SEEDS = registered("regime_seeds")  # seeds per arm and rung in the main grid; the control learns in each
# Where the 4-bit mismatch lives (moerl.rollout.precision): each 4-bit format on the routed experts only or on
# attention only, and Kimi-K2-Thinking's INT4 routed experts; run by the baseline and R3.
MECHANISM_RUNGS = tuple(REGISTERED["grids"]["mechanism"]["rungs"])
# The trainer-side mitigation of the Kimi rung: fake-quantised INT4 masters, alone, with R3, with TIS.
QAT_ARMS = tuple(a for a in REGISTERED["grids"]["mechanism"]["arms"] if a.startswith("qat_"))
GEO_MIS = current_arm(EXPERIMENT, "mis")  # geometric MIS, band [0.999, 1.001] (registered as ``mis``)
MITIGATIONS = ("tis", GEO_MIS, "icepop", "r3", "r3_tis", *QAT_ARMS)  # the grid's arms besides baseline and control
# TIS's weight departs from 1 by a factor of 2 or more: ρ outside [1/C, C] (C = loss.tis_cap).
TIS_REWEIGHTED = "is/outside_band_frac"
# What each mitigation acts on, per run (run mean of a per-step share of response tokens): the registered
# measure, and the one first written before the grid (TIS's truncated share). The fake-quantised trainer
# acts on every weight, not on a share of tokens: no floor applies to it alone; with TIS, TIS's tail counts.
_QAT_ACTS_ON = {"qat_int4_tis": TIS_REWEIGHTED}
ACTS_ON = {**_by_current_arm(registered("acts_on_measure")), **_QAT_ACTS_ON}
ACTS_ON_PREREGISTERED = {**_by_current_arm(registered("acts_on_measure", first_written=True)), **_QAT_ACTS_ON}
ACTS_ON_FLOOR = registered("acts_on_floor")
MATCH_MARGIN = registered("match_margin")["margin"]  # "trains like the control": at most this far below it
MATCH_SIDED_FIRST = registered("match_margin", first_written=True)["sided"]  # "two": within the margin either way
# The verdicts that need a learning control (moerl.analysis.dose.regime gates them, here only).
REGIME_GATED = ("threshold", "collapses", "like_control", "prevents_collapse")


def metric_values(rows: list[dict], key: str) -> np.ndarray:
    """The numeric values of ``key`` over metrics rows (TIS_REWEIGHTED: both tails of ρ, summed per step)."""
    if key == TIS_REWEIGHTED:  # derived per step from the two tails every run logs
        return np.array([r["is/below_frac"] + r["is/above_frac"] for r in rows
                         if isinstance(r.get("is/below_frac"), (int, float))
                         and isinstance(r.get("is/above_frac"), (int, float))], dtype=float)
    return np.array([r[key] for r in rows if isinstance(r.get(key), (int, float))], dtype=float)


def run_summary(rows: list[dict]) -> dict:
    """One run's dose-ladder row from its metrics rows: the mismatch it saw (run medians: per-step k3
    is heavy-tailed), what it did to training, and its collapse step."""
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/pass1" in r]
    if not train:
        return {"steps": 0}
    reward = metric_values(train, "reward/mean")
    k3 = metric_values(train, "mismatch/k3")
    grad = metric_values(train, "grad_norm")
    first, last = (evals[0], evals[-1]) if evals else ({}, {})

    def median(key):
        v = metric_values(train, key)
        return float(np.nanmedian(v)) if v.size else None

    def mean(key):
        v = metric_values(train, key)
        return float(np.nanmean(v)) if v.size else None

    return {"steps": len(train), "k3_median": median("mismatch/k3"),
            "any_layer_differs": median("routing/any_layer_differs"),
            "extreme_gt2": median("mismatch/extreme_gt2"),
            "grad_norm_median": float(np.nanmedian(grad)) if grad.size else None,
            "grad_norm_max": float(np.nanmax(grad)) if grad.size else None,
            "effective_token_frac": median("effective/token_frac"),
            # the drift: late over early median k3 (moerl.analysis.verdicts.keeps_drifting)
            "k3_growth": (float(np.nanmedian(k3[-EARLY_LATE_WINDOW:]) / np.nanmedian(k3[:EARLY_LATE_WINDOW]))
                          if k3.size >= 2 * EARLY_LATE_WINDOW and np.nanmedian(k3[:EARLY_LATE_WINDOW]) > 0 else None),
            "acts_on": {key: mean(key) for key in sorted(set(ACTS_ON.values()) | set(ACTS_ON_PREREGISTERED.values()))},
            "reward_first": float(reward[:REWARD_WINDOW].mean()), "reward_last": float(reward[-REWARD_WINDOW:].mean()),
            "pass1_start": first.get("eval/pass1"), "pass1_end": last.get("eval/pass1"),
            "pass1_start_step": first.get("step"), "pass1_end_step": last.get("step"),
            "collapse_step": collapse_step(rows),
            # the run's own logged step and evaluation times (what a grid's remaining runs are estimated from)
            "seconds": logged_seconds(rows)}


class RunReadError(ValueError):
    """A run directory of the experiment that cannot be read; the message names the file."""


def machine_kind(run: Path) -> str | None:
    """What a run's numbers depend on besides its config (its machine.json): the CPU, its vector ISA and
    AMX, the torch build and the rollout kernels. Runs of one comparison recorded on different kinds are
    still valid seeds, but a report says so (moerl.analysis.confirmatory.progress)."""
    try:
        m = json.loads((run / "machine.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    amx = "+AMX" if (m.get("isa_flags") or {}).get("amx_bf16") else ""
    return (f"{m.get('cpu_model', '?')}, {m.get('torch_cpu_capability', '?')}{amx}, torch {m.get('torch_version', '?')}, "
            f"{m.get('rollout_kernels') or '?'} kernels")


def load_runs(root: str | Path, grids: str = "recorded") -> list[dict]:
    """The experiment's runs: arm, rung (its rollout.dtype), seed and its summary. ``grids="recorded"``: the
    runs of the grids recorded before the registered rollout path was named (ladder, control, main), the
    ones every table here is about; ``"all"`` adds the runs of the grids on that path (confirmatory,
    mechanism: moerl.analysis.confirmatory), never to be mixed with them. A run directory without a
    readable config.yaml or metrics.jsonl is a RunReadError naming the file: a table that silently left a
    run out would report other seeds than it says."""
    if grids not in ("recorded", "all"):
        raise ValueError(f"load_runs: grids must be 'recorded' or 'all', got {grids!r}")
    runs = []
    for metrics in sorted((Path(root) / EXPERIMENT).glob("*/seed*/metrics.jsonl")):
        run = metrics.parent
        if not re.fullmatch(r"seed\d+", run.name):  # e.g. seed1.old-<time>, set aside by run.py --fresh
            continue
        fix = f"restore it, or move {run} out of {root}"
        try:
            cfg = yaml.safe_load((run / "config.yaml").read_text())
        except FileNotFoundError:
            raise RunReadError(f"{run / 'config.yaml'}: missing (every run writes it first); {fix}") from None
        except yaml.YAMLError as err:
            raise RunReadError(f"{run / 'config.yaml'}: not valid YAML ({' '.join(str(err).split())[:120]}); "
                               f"{fix}") from None
        if not isinstance(cfg, dict) or not isinstance(cfg.get("rollout"), dict) or "trainer" not in cfg:
            raise RunReadError(f"{run / 'config.yaml'}: not a run's config (no rollout/trainer sections); {fix}")
        try:
            summary = run_summary(read_metrics(metrics))
        except ValueError as err:  # a bad line other than a truncated last one
            raise RunReadError(f"{err}; {fix}") from None
        if summary["steps"]:
            model, rollout = cfg.get("model", {}), cfg["rollout"]
            setup = (f"{model.get('preset', '?')} {model.get('num_layers', '?')} x {model.get('num_experts', '?')} "
                     f"top-{model.get('top_k', '?')}, hidden {model.get('hidden_size', '?')}; "
                     f"{rollout.get('prompts_per_step', '?')} x {rollout.get('group_size', '?')} samples a step")
            recorded = json.loads((run / "run.json").read_text()) if (run / "run.json").exists() else {}
            trainer = cfg["trainer"]
            path_key = REGISTERED["rollout_path"]["key"]
            section, _, key = path_key.partition(".")
            runs.append({"arm": current_arm(EXPERIMENT, cfg["arm"]), "rung": rollout["dtype"], "seed": int(cfg["seed"]),
                         "registration": recorded.get("registration"), "identity": recorded.get("identity"),
                         "steps_planned": trainer["steps"], "setup": setup, "run_dir": str(run),
                         "machine": machine_kind(run),
                         # which grid a run belongs to (moerl.analysis.confirmatory.grid_of)
                         "eval_completions": int(trainer.get("eval_samples", 1)) * int(trainer.get("eval_size", 0)),
                         "path": {path_key: (cfg.get(section) or {}).get(key)}, **summary})
    if grids == "recorded":
        from moerl.analysis.confirmatory import grid_of

        runs = [r for r in runs if grid_of(r, REGISTERED) is None]
    return runs


def control_learns(summary: dict) -> bool:
    """The fp32 control did not collapse and gained at least CONTROL_GAIN held-out pass@1."""
    if summary.get("collapse_step") is not None or summary.get("pass1_start") is None:
        return False
    return summary["pass1_end"] - summary["pass1_start"] >= CONTROL_GAIN


def mismatch_order(baselines: dict[str, dict]) -> list[str]:
    """The rungs measured, fp32 first, then by the baseline's run-median k3 (the dose actually given)."""
    rest = sorted((r for r in baselines if r != "fp32"), key=lambda r: baselines[r]["k3_median"] or 0.0)
    return (["fp32"] if "fp32" in baselines else []) + rest


def threshold(baselines: dict[str, dict], control: dict, regime_ok: bool | None = None) -> str | None:
    """The lowest rung, in mismatch order, where the uncorrected run collapses while the control learns
    (``regime_ok`` False: the regime gate failed, no threshold can be read)."""
    if regime_ok is False or not control_learns(control):
        return None
    for rung in mismatch_order(baselines):
        if rung != "fp32" and baselines[rung].get("collapse_step") is not None:
            return rung
    return None


# ---------------------------------------------------------------------------------------------
# The main grid: every mitigation against the baseline and the control, on paired seeds


def _paired(arm: dict[int, dict], other: dict[int, dict], key: str) -> dict[int, float]:
    """seed -> arm[key] - other[key] on the seeds both finished with a value."""
    return {s: arm[s][key] - other[s][key] for s in sorted(set(arm) & set(other))
            if arm[s].get(key) is not None and other[s].get(key) is not None}


def _gain(runs: dict[int, dict]) -> dict[int, float]:
    return {s: r["pass1_end"] - r["pass1_start"] for s, r in runs.items()
            if r.get("pass1_end") is not None and r.get("pass1_start") is not None}


def _acted(arm: str, runs: dict[int, dict], rule: dict[str, str]) -> tuple[list[float], bool | None]:
    """Per-seed share of tokens the arm acted on under ``rule`` (ACTS_ON or ACTS_ON_PREREGISTERED), and
    whether it reached the floor in some seed (None: the arm has no such measure)."""
    if arm not in rule:
        return [], None
    fracs = [r["acts_on"].get(rule[arm]) for r in runs.values() if "acts_on" in r]
    fracs = [f for f in fracs if f is not None]
    return fracs, acts_on(fracs, ACTS_ON_FLOOR)


def regime(controls: dict[int, dict]) -> dict:
    """The one regime gate (REGIME_GATED verdicts need it): the fp32 control learns (moerl.analysis.dose.
    control_learns) in every one of its finished seeds, and at least GRID_SEEDS of them finished."""
    finished = {s: r for s, r in controls.items() if r.get("steps") == r.get("steps_planned", r.get("steps"))}
    learned = sorted(s for s, r in finished.items() if control_learns(r))
    ok = len(finished) >= GRID_SEEDS and len(learned) == len(finished)
    gains = _gain(finished)
    return {"learns": ok, "learned": learned, "seeds": sorted(finished), "gains": gains,
            "status": (f"the control learns (≥ +{CONTROL_GAIN:.2f} held-out pass@1 in {len(learned)} of "
                       f"{len(finished)} seeds)" if ok else
                       f"not met: the fp32 control learned (≥ +{CONTROL_GAIN:.2f}) in {len(learned)} of "
                       f"{len(finished)} finished seeds; {max(GRID_SEEDS, len(finished))} of "
                       f"{max(GRID_SEEDS, len(finished))} are needed")}


def comparison_power(values: dict[int, float], threshold: float, effect: float, sd: float | None) -> dict:
    """Beside a paired verdict: the mean with its 95 % t interval over seeds, and, from the noise model's
    paired sd, the power of the registered every-seed rule at ``effect`` and the seeds the t rule needs
    for 80 % power (moerl.analysis.power)."""
    interval = power.t_interval(values.values())
    out = {"interval": interval, "n": len(values), "threshold": threshold, "effect": effect}
    if sd and np.isfinite(sd) and values:
        out.update(sd=sd, power_every_seed=power.power_every_seed(effect, threshold, sd, len(values)),
                   seeds_for_80=power.seeds_needed(effect, threshold, sd))
    return out


def mitigation_verdicts(arm: str, runs: dict[int, dict], baseline: dict[int, dict],
                        control: dict[int, dict], regime_ok: bool | None = None, noise_sd: float | None = None) -> dict:
    """One mitigation arm at one rung (each argument: seed -> run_summary): its paired statistics and
    verdicts by the registered rules (module docstring). ``regime_ok`` (:func:`regime`; None: not
    applied) gates the verdicts that need a learning control; their ungated values come along under
    ``ungated``. The verdicts under every rule as first written come along under ``preregistered``;
    ``power`` holds each paired verdict's interval and power (``noise_sd``: the rung's paired sd)."""
    over_baseline = _paired(runs, baseline, "pass1_end")
    over_control = _paired(runs, control, "pass1_end")
    # Nothing to mitigate unless the baseline fell behind the control (lower gain) in every paired seed.
    effect = beyond_control(_gain(baseline), _gain(control), worse="lower")
    collapsed = [s for s, r in runs.items() if r.get("collapse_step") is not None]

    def prevents(own_seeds_only: bool) -> str:
        base_collapsed = [s for s, r in baseline.items() if r.get("collapse_step") is not None
                          and (s in runs or not own_seeds_only)]
        if not base_collapsed:
            return NOT_TESTED
        if not collapsed:
            return YES
        return NO if len(collapsed) >= len(base_collapsed) else PARTLY

    def like_control(sided: str) -> str:
        if sided == "two":  # "within the margin of the control's", either way
            return by_threshold([abs(d) for d in over_control.values()], MATCH_MARGIN, above=NO, below=YES)
        return by_threshold(over_control.values(), -MATCH_MARGIN)

    def verdicts(measures: dict[str, str], sided: str, own_seeds_only: bool) -> dict:
        fracs, acted = _acted(arm, runs, measures)
        return {"acted_measure": measures.get(arm), "acted_frac": fracs, "acted": acted,
                "helps": gate(by_threshold(over_baseline.values(), registered("helps_threshold")), acted, effect),
                "like_control": gate(like_control(sided), acted, effect),
                "prevents_collapse": gate(prevents(own_seeds_only), acted, effect)}

    def regime_gated(v: dict) -> dict:
        if regime_ok is False:
            return {**v, "ungated": {k: v[k] for k in REGIME_GATED if k in v},
                    **{k: NOT_TESTED for k in REGIME_GATED if k in v}}
        return v

    current = regime_gated(verdicts(ACTS_ON, registered("match_margin")["sided"], own_seeds_only=True))
    first = regime_gated(verdicts(ACTS_ON_PREREGISTERED, MATCH_SIDED_FIRST, own_seeds_only=False))
    out = {
        "arm": arm, "seeds": sorted(runs),
        "collapsed": len(collapsed), "collapse_steps": [runs[s]["collapse_step"] for s in collapsed],
        "pass1_end": {s: r.get("pass1_end") for s, r in runs.items()},
        "minus_baseline": over_baseline, "minus_control": over_control,
        "effective_token_frac": {s: r.get("effective_token_frac") for s, r in runs.items()},
        "baseline_behind_control": effect, "regime": regime_ok, **current,
        "k3_growth": {s: r.get("k3_growth") for s, r in runs.items()},
        "baseline_k3_growth": {s: r.get("k3_growth") for s, r in baseline.items()},
        "power": {"helps": comparison_power(over_baseline, registered("helps_threshold"),
                                            registered("helps_t")["smallest_effect"], noise_sd),
                  "like_control": comparison_power(over_control, -MATCH_MARGIN, 0.0, noise_sd)},
        "preregistered": first,
    }
    # Mind Lab's "does not stop the drift", by experiment 05's rule (applied here after the runs were read).
    out["keeps_drifting"] = keeps_drifting([g for g in out["k3_growth"].values() if g is not None],
                                           [g for g in out["baseline_k3_growth"].values() if g is not None],
                                           acted=out["acted"])
    return out


def paired_noise_sd(groups: list[dict[int, float]]) -> float | None:
    """The noise model's paired sd at one rung: the spread of paired differences (arm − control, seed by
    seed), pooled over the arms, each centred on its own mean (moerl.analysis.power.pooled_sd)."""
    sd, df = power.pooled_sd([list(g.values()) for g in groups])
    return sd if df else None


def k3_median_before(rows: list[dict], step: int | None) -> float | None:
    """Median per-step k3 of a run over its steps before ``step`` (all steps when None)."""
    k3 = [r["mismatch/k3"] for r in rows if isinstance(r.get("mismatch/k3"), (int, float))
          and (step is None or r["step"] < step)]
    return float(np.median(k3)) if k3 else None


def dose_order_uncertainty(rows_a: list[dict], rows_b: list[dict], block: int = 25, draws: int = 2000,
                           seed: int = 0) -> dict:
    """How sure the ladder is that rung b gives more mismatch than rung a (one seed each): the ratio of
    their run-median k3 with a 95 % moving-block bootstrap interval over steps (blocks of ``block`` steps
    keep the per-step k3's autocorrelation)."""
    a = np.array([r["mismatch/k3"] for r in rows_a if isinstance(r.get("mismatch/k3"), (int, float))])
    b = np.array([r["mismatch/k3"] for r in rows_b if isinstance(r.get("mismatch/k3"), (int, float))])
    rng = np.random.default_rng(seed)

    def resample(x):
        starts = rng.integers(0, len(x) - block + 1, size=(draws, -(-len(x) // block)))
        idx = (starts[..., None] + np.arange(block)).reshape(draws, -1)[:, : len(x)]
        return np.median(x[idx], axis=1)

    ratio = resample(b) / resample(a)
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    return {"ratio": float(np.median(b) / np.median(a)), "lo": float(lo), "hi": float(hi),
            "resolved": bool(lo > 1 or hi < 1)}


def arm_threshold(collapsed: dict[str, tuple[int, int]], order: list[str]) -> dict:
    """One arm's threshold over the rungs it ran (``collapsed``: rung -> (seeds collapsed, seeds finished);
    ``order``: rungs in mismatch order): the lowest rung where some seed collapsed, as "prevents collapse"
    counts it. With no collapse it lies above the highest rung run, by an amount the grid cannot say."""
    ran = [r for r in order if collapsed.get(r, (0, 0))[1]]
    for rung in ran:
        if collapsed[rung][0]:
            return {"rung": rung, "above": None, "rungs": ran}
    return {"rung": None, "above": ran[-1] if ran else None, "rungs": ran}


def threshold_shift(arm: dict, baseline: dict, order: list[str]) -> str:
    """How a mitigation moves the baseline's threshold (both from :func:`arm_threshold` on the same rungs):
    'lower' (it collapses where the baseline does not), 'unchanged', 'raised above <rung>' (no collapse up to
    the highest rung run, where the baseline collapsed), or 'not tested' (the baseline never collapsed, or
    the two ran on different rungs; 'not tested: not run at <rungs>' while the arm is still missing some)."""
    if baseline["rung"] is None:
        return NOT_TESTED
    missing = [r for r in baseline["rungs"] if r not in arm["rungs"]]
    if missing:
        return f"{NOT_TESTED}: not run at {', '.join(missing)}"
    if arm["rungs"] != baseline["rungs"]:
        return NOT_TESTED
    if arm["rung"] is None:
        return f"raised above {arm['above']}"
    position = order.index
    if position(arm["rung"]) < position(baseline["rung"]):
        return "lower"
    return "unchanged" if arm["rung"] == baseline["rung"] else f"raised to {arm['rung']}"


def r3_reduces_mismatch(r3: dict[int, dict], baseline: dict[int, dict], pre_collapse: dict[int, float] | None = None
                        ) -> dict:
    """Mind Lab's claim, paired: R3's run-median k3 over the baseline's below 1 in every seed, and its
    share of tokens keeping a gradient not below the baseline's by more than 0.01 in any seed.
    ``pre_collapse`` (seed -> R3 / baseline median k3 over the steps before the baseline's collapse step,
    :func:`k3_median_before`): a baseline that collapsed inflates its own run median, so where it did the
    k3 half is judged on the steps before its collapse."""
    ratio = {s: r3[s]["k3_median"] / baseline[s]["k3_median"] for s in sorted(set(r3) & set(baseline))
             if r3[s].get("k3_median") is not None and baseline[s].get("k3_median")}
    whole_run = dict(ratio)
    if pre_collapse:
        ratio = {s: pre_collapse.get(s, v) for s, v in ratio.items()}
    kept = _paired(r3, baseline, "effective_token_frac")
    k3_verdict = by_threshold(ratio.values(), 1.0, above=NO, below=YES)
    kept_verdict = by_threshold(kept.values(), -0.01)
    both = (YES if k3_verdict == YES and kept_verdict == YES else
            NO if NO in (k3_verdict, kept_verdict) else
            INCONCLUSIVE if INCONCLUSIVE in (k3_verdict, kept_verdict) else NOT_TESTED)
    return {"k3_ratio": ratio, "k3_ratio_whole_run": whole_run, "pre_collapse": bool(pre_collapse),
            "effective_minus_baseline": kept, "k3": k3_verdict, "kept": kept_verdict, "verdict": both}
