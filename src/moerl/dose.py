"""Experiment 07's dose ladder: rollout precisions as doses of mismatch, one summary per run, and the
collapse threshold, all by rules fixed before the main grid.

A rung is a rollout precision (``rollout.dtype``; moerl.rollout.precision): fp32 is the control (no
mismatch), the others are real low-precision mechanisms. Rungs are *ordered by the mismatch they cause*
(the pilot's run-median k3), not by bit width: per-channel int8 rounds weights less than fp8 e4m3 does.

Rules (moerl.collapse defines a collapse):
- **the control learns** when the fp32 run does not collapse and its held-out pass@1 (fp32 evaluator)
  rises by at least ``CONTROL_GAIN`` from step 0 to the end;
- **the threshold** is the lowest rung, in mismatch order, whose uncorrected (baseline) run collapses
  while the control learns; no such rung: no threshold within the budget (a result, stated as such).
"""
from __future__ import annotations

import numpy as np

from moerl.collapse import collapse_step

RUNGS = ("fp32", "bf16", "int8", "fp8", "nvfp4", "int4")  # every precision the ladder can run
CONTROL_GAIN = 0.10  # held-out pass@1, end minus step 0
REWARD_WINDOW = 25


def _values(rows: list[dict], key: str) -> np.ndarray:
    return np.array([r[key] for r in rows if isinstance(r.get(key), (int, float))], dtype=float)


def run_summary(rows: list[dict]) -> dict:
    """One run's dose-ladder row from its metrics rows: the mismatch it saw (run medians: per-step k3
    is heavy-tailed), what it did to training, and its collapse step."""
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/pass1" in r]
    if not train:
        return {"steps": 0}
    reward = _values(train, "reward/mean")
    grad = _values(train, "grad_norm")
    first, last = (evals[0], evals[-1]) if evals else ({}, {})

    def median(key):
        v = _values(train, key)
        return float(np.nanmedian(v)) if v.size else None

    return {"steps": len(train), "k3_median": median("mismatch/k3"),
            "any_layer_differs": median("routing/any_layer_differs"),
            "extreme_gt2": median("mismatch/extreme_gt2"),
            "grad_norm_median": float(np.nanmedian(grad)) if grad.size else None,
            "grad_norm_max": float(np.nanmax(grad)) if grad.size else None,
            "effective_token_frac": median("effective/token_frac"),
            "reward_first": float(reward[:REWARD_WINDOW].mean()), "reward_last": float(reward[-REWARD_WINDOW:].mean()),
            "pass1_start": first.get("eval/pass1"), "pass1_end": last.get("eval/pass1"),
            "pass1_start_step": first.get("step"), "pass1_end_step": last.get("step"),
            "collapse_step": collapse_step(rows)}


def control_learns(summary: dict) -> bool:
    """The fp32 control did not collapse and gained at least CONTROL_GAIN held-out pass@1."""
    if summary.get("collapse_step") is not None or summary.get("pass1_start") is None:
        return False
    return summary["pass1_end"] - summary["pass1_start"] >= CONTROL_GAIN


def mismatch_order(baselines: dict[str, dict]) -> list[str]:
    """The rungs measured, fp32 first, then by the baseline's run-median k3 (the dose actually given)."""
    rest = sorted((r for r in baselines if r != "fp32"), key=lambda r: baselines[r]["k3_median"] or 0.0)
    return (["fp32"] if "fp32" in baselines else []) + rest


def threshold(baselines: dict[str, dict], control: dict) -> str | None:
    """The lowest rung, in mismatch order, where the uncorrected run collapses while the control learns."""
    if not control_learns(control):
        return None
    for rung in mismatch_order(baselines):
        if rung != "fp32" and baselines[rung].get("collapse_step") is not None:
            return rung
    return None
