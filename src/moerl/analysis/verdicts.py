"""Verdict rules shared by the experiments' claims tables (experiment 05's moerl.analysis.claims, and any
later experiment that answers a paper's claim from recorded runs).

A verdict is one of ``yes`` / ``partly`` / ``no`` / ``not tested`` / ``inconclusive``:

- **not tested**: the regime could not show the effect, whatever the numbers say:
  (a) the mitigation under test acted on fewer than ``ACTS_ON_MIN`` (1 %) of the tokens in every
      seed (TIS truncated, MIS / IcePop masked, a clip clipped fewer than 1 % of tokens): a
      correction that hardly fires cannot show what it does (:func:`acts_on`);
  (b) no arm drifted or collapsed beyond what its fp32 control (no rollout mismatch) does on its
      own: with nothing to attribute to the mismatch, there is nothing to stop or cause
      (:func:`beyond_control`).
- **inconclusive**: the seed interval (min-max over paired seeds) of the quantity the rule
  compares straddles the rule's threshold: some seeds say yes, others no (:func:`by_threshold`).
- otherwise **yes** / **no** (or **partly**) by the rule's threshold, stated beside the verdict.

These rules were added after experiment 05's runs had been read (see its README): they decide
when a number can answer a claim, not which answer it gives.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

ACTS_ON_MIN = 0.01  # a mitigation acting on fewer tokens than this (share of response tokens) is not tested
EARLY_LATE_WINDOW = 50  # steps: "early" / "late" are a run's first / last this many steps
DRIFT_GROWTH = 1.2  # the mismatch "drifts" when its late median k3 exceeds the early one by more than this

YES, PARTLY, NO, NOT_TESTED, INCONCLUSIVE = "yes", "partly", "no", "not tested", "inconclusive"
VERDICTS = (YES, PARTLY, NO, NOT_TESTED, INCONCLUSIVE)


def seed_interval(values: Iterable[float]) -> tuple[float, float] | None:
    """(min, max) over seeds of the finite values; None when there are none."""
    v = [float(x) for x in values if x is not None and np.isfinite(x)]
    return (min(v), max(v)) if v else None


def by_threshold(values: Iterable[float], threshold: float, above: str = YES, below: str = NO) -> str:
    """``above`` if every seed's value exceeds ``threshold``, ``below`` if every seed's is under it,
    ``inconclusive`` if the seed interval straddles (or touches) it; ``not tested`` without values."""
    interval = seed_interval(values)
    if interval is None:
        return NOT_TESTED
    lo, hi = interval
    if lo > threshold:
        return above
    if hi < threshold:
        return below
    return INCONCLUSIVE


def acts_on(fractions: Iterable[float], floor: float = ACTS_ON_MIN) -> bool:
    """Whether a mitigation acted on at least ``floor`` of the tokens in some seed (``fractions``:
    its per-run share of tokens truncated / masked / clipped). False without values."""
    interval = seed_interval(fractions)
    return interval is not None and interval[1] >= floor


def beyond_control(arm: dict[int, float], control: dict[int, float], worse: str = "lower") -> bool:
    """Whether an arm drifted beyond its control in every paired seed: ``arm`` and ``control`` map
    seed -> a per-run quantity (e.g. held-out pass@1 gain); ``worse`` says which direction is the
    drift. A single contrary seed, or no paired seed, means not beyond."""
    seeds = sorted(set(arm) & set(control))
    diffs = [arm[s] - control[s] for s in seeds if np.isfinite(arm[s] - control[s])]
    if not diffs:
        return False
    return max(diffs) < 0 if worse == "lower" else min(diffs) > 0


def gate(verdict: str, acted: bool | None = None, effect_present: bool | None = None) -> str:
    """``verdict`` unless the regime could not test it: ``not tested`` when the mitigation did not
    act (``acted`` False) or there was no effect beyond the control (``effect_present`` False).
    None means the condition does not apply to the claim."""
    if acted is False or effect_present is False:
        return NOT_TESTED
    return verdict


def keeps_drifting(arm_growth: Iterable[float], baseline_growth: Iterable[float], acted: bool | None) -> str:
    """Mind Lab's "<mitigation> does not stop the drift", per seed from each run's late / early median k3:
    yes when the arm's grows > DRIFT_GROWTH in every seed, no in none, inconclusive when the seeds
    disagree; not tested when the mitigation hardly acted or the uncorrected arm's k3 did not grow
    > DRIFT_GROWTH in every seed (no drift to stop)."""
    drift = by_threshold(baseline_growth, DRIFT_GROWTH)
    return gate(by_threshold(arm_growth, DRIFT_GROWTH), acted=acted, effect_present=drift == YES)
