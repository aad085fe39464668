"""Family-wise verdicts: each registered verdict's raw one-sided p, its Holm-adjusted p within its family (the
comparisons one registered grid makes), and the verdict read under the correction -- a *yes* stands only
when its adjusted p is below alpha.

Why: a grid that judges seven comparisons at alpha = 0.05 each has up to a 30 % chance of one false *yes*;
Holm's step-down keeps that chance at alpha for the family, uniformly more powerful than Bonferroni and
valid under any dependence between the comparisons. Holm's adjustment is written here (a dozen lines):
scipy has only Benjamini-Hochberg (``false_discovery_control``), and statsmodels' ``multipletests``, which
has Holm, is not a dependency of this repo; the tests check it against Holm's definition by enumeration.
Shared by every experiment beside ``power`` and ``verdicts``.

The p of each kind of rule, each the one-sided test of the direction its *yes* claims:
- a t rule (mean over paired seeds above a threshold): the one-sided t test of the mean against the threshold;
- an every-seed rule (an event in every seed: collapses, keeps drifting): the sign test, P(at least k of n
  seeds | each seed a fair coin) -- the "p = 1/32 at 5 of 5" the mechanism grid was registered with;
- two cells' collapse counts (prevents collapse, the crossover): Fisher's exact test, one-sided;
- two groups of per-seed values (the drift null): Welch's t test, one-sided.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from scipy import stats

ALPHA = 0.05
METHOD = "holm"
YES, INCONCLUSIVE = "yes", "inconclusive"


def _finite(values: Iterable[float]) -> np.ndarray:
    return np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)


def t_p(values: Iterable[float], threshold: float = 0.0) -> float | None:
    """One-sided p of "the mean exceeds ``threshold``" (t test over seeds); None with fewer than 2 values."""
    v = _finite(values)
    if v.size < 2:
        return None
    if v.std(ddof=1) == 0:
        return 0.0 if v.mean() > threshold else 1.0
    return float(stats.ttest_1samp(v, threshold, alternative="greater").pvalue)


def sign_p(events: int, n: int) -> float | None:
    """One-sided sign-test p of ``events`` of ``n`` seeds under a fair coin per seed; None without seeds."""
    if n < 1:
        return None
    return float(stats.binomtest(events, n, 0.5, alternative="greater").pvalue)


def fisher_p(events_a: int, n_a: int, events_b: int, n_b: int) -> float | None:
    """One-sided Fisher exact p of "cell a has the event more often than cell b"; None when a cell is empty."""
    if n_a < 1 or n_b < 1:
        return None
    table = [[events_a, n_a - events_a], [events_b, n_b - events_b]]
    return float(stats.fisher_exact(table, alternative="greater").pvalue)


def welch_p(a: Iterable[float], b: Iterable[float]) -> float | None:
    """One-sided Welch t p of "mean(a) exceeds mean(b)"; None with fewer than 2 values in either."""
    x, y = _finite(a), _finite(b)
    if x.size < 2 or y.size < 2:
        return None
    return float(stats.ttest_ind(x, y, equal_var=False, alternative="greater").pvalue)


def holm(pvalues: Mapping[str, float | None]) -> dict[str, float | None]:
    """Holm-adjusted p of each comparison of one family (None stays None and does not count in the family)."""
    named = sorted(((p, k) for k, p in pvalues.items() if p is not None), key=lambda pk: pk[0])
    out: dict[str, float | None] = {k: None for k in pvalues}
    m, running = len(named), 0.0
    for i, (p, k) in enumerate(named):  # step-down: the i-th smallest p times (m - i), kept monotone, capped at 1
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return out


def corrected(verdict: str, p_adjusted: float | None, alpha: float = ALPHA) -> str:
    """The verdict under the family-wise rule: a *yes* whose adjusted p is not below alpha reads inconclusive;
    every other verdict (no, partly, not tested, inconclusive) is kept as it was read."""
    if verdict == YES and (p_adjusted is None or p_adjusted >= alpha):
        return INCONCLUSIVE
    return verdict


def apply(verdicts: dict[str, dict], alpha: float = ALPHA) -> dict[str, dict]:
    """Each verdict of one family with ``p_holm`` and ``verdict_holm`` added (from its ``p``), and the size of
    the family it was corrected within."""
    adjusted = holm({name: v.get("p") for name, v in verdicts.items()})
    size = sum(p is not None for p in adjusted.values())
    return {name: {**v, "p_holm": adjusted[name], "family_size": size,
                   "verdict_holm": corrected(v["verdict"], adjusted[name], alpha)}
            for name, v in verdicts.items()}


def p_note(v: dict) -> str:
    """'p 0.012, Holm 0.048 (of 7)' for a table's notes; '' without a p."""
    if v.get("p") is None:
        return ""
    holm_part = f", Holm {v['p_holm']:.3g} (of {v['family_size']})" if v.get("p_holm") is not None else ""
    return f"p {v['p']:.3g}{holm_part}"
