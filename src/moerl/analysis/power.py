"""Power of a paired comparison of final held-out pass@1 between two arms on shared seeds, from a noise
model measured on recorded runs, and the interval printed beside every verdict.

The noise of a paired difference d_s = a_s − b_s (seed s of two arms: same prompts, same initial LoRA)
has two sources, both measured here:
- **evaluation sampling**: pass@1 over n completions is binomial, variance p(1 − p) / n per evaluation
  (completions of one problem are correlated, so this is a lower bound on the evaluation's noise);
- **seed-to-seed spread** of each arm's final pass@1, partly shared between the two arms of a pair (the
  paired correlation ρ): var(d) = σ_a² + σ_b² − 2 ρ σ_a σ_b.
The spread of the paired differences, pooled over the comparisons of one rung (each centred on its own
mean), estimates σ_d directly; the binomial term says how much of it the evaluation alone explains.

Two decision rules are scored:
- **every seed** (the rule experiments 05 and 07 registered): yes when every paired difference is on the
  yes side of the threshold. Its power *falls* with more seeds: P(all n above) = Φ((δ − θ) / σ_d)ⁿ;
- **t** (the confirmatory grid's rule): yes when the one-sided 95 % t bound of the mean difference clears
  the threshold; power from the noncentral t, rising with n.
Pure numpy / scipy; every function is tested on synthetic data with a known answer.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from scipy import stats

ALPHA = 0.05  # one-sided
TARGET_POWER = 0.80


def binomial_sd(p: float, n: int) -> float:
    """Sampling sd of a pass@1 measured on ``n`` completions at true rate ``p``."""
    return float(np.sqrt(p * (1 - p) / n))


def completions_for(margin: float, p: float, fraction: float = 1 / 3) -> int:
    """Completions per evaluation so the paired difference's evaluation noise, sqrt(2 p (1 − p) / n),
    is below ``fraction`` of ``margin``."""
    return int(np.ceil(2 * p * (1 - p) / (fraction * margin) ** 2))


def t_interval(values: Iterable[float], level: float = 0.95) -> tuple[float, float, float] | None:
    """(mean, low, high): the two-sided t interval of the mean over seeds (n − 1 degrees of freedom);
    None with fewer than 2 values."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size < 2:
        return None
    half = stats.t.ppf(0.5 + level / 2, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size)
    return float(v.mean()), float(v.mean() - half), float(v.mean() + half)


def pooled_sd(groups: Iterable[Iterable[float]]) -> tuple[float, int]:
    """(sd, degrees of freedom) pooled over groups, each centred on its own mean (groups of < 2 skipped)."""
    ss, df = 0.0, 0
    for g in groups:
        v = np.asarray(list(g), dtype=float)
        if v.size >= 2:
            ss += float(((v - v.mean()) ** 2).sum())
            df += v.size - 1
    return (float(np.sqrt(ss / df)) if df else float("nan")), df


def paired_correlation(pairs: Iterable[tuple[float, float]]) -> float:
    """Pearson correlation of the two arms' values over paired seeds (NaN with fewer than 3 pairs)."""
    a = np.asarray(list(pairs), dtype=float)
    if len(a) < 3 or a[:, 0].std() == 0 or a[:, 1].std() == 0:
        return float("nan")
    return float(np.corrcoef(a[:, 0], a[:, 1])[0, 1])


def power_every_seed(effect: float, threshold: float, sd: float, n: int) -> float:
    """P(every one of n paired differences exceeds ``threshold``) when they are N(effect, sd²)."""
    return float(stats.norm.cdf((effect - threshold) / sd) ** n)


def power_t(effect: float, threshold: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the one-sided t test of mean > ``threshold`` at true mean ``effect``, n paired seeds."""
    if n < 2:
        return float("nan")
    if sd == 0:  # no spread: every sample sits at the true effect, so the test always or never passes
        return 1.0 if effect > threshold else 0.0
    ncp = (effect - threshold) / (sd / np.sqrt(n))
    return float(stats.nct.sf(stats.t.ppf(1 - alpha, n - 1), n - 1, ncp))


def seeds_needed(effect: float, threshold: float, sd: float, power: float = TARGET_POWER,
                 alpha: float = ALPHA, most: int = 1000) -> int | None:
    """The fewest paired seeds giving the t rule ``power`` (None: more than ``most``)."""
    for n in range(2, most + 1):
        if power_t(effect, threshold, sd, n, alpha) >= power:
            return n
    return None


def t_verdict(values: Iterable[float], threshold: float, alpha: float = ALPHA) -> str:
    """The confirmatory rule: 'yes' when the one-sided (1 − alpha) lower t bound of the mean exceeds
    ``threshold``, 'no' when the upper bound is below it, 'inconclusive' otherwise; 'not tested' with
    fewer than 2 seeds."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if v.size < 2:
        return "not tested"
    half = stats.t.ppf(1 - alpha, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size)
    if v.mean() - half > threshold:
        return "yes"
    if v.mean() + half < threshold:
        return "no"
    return "inconclusive"
