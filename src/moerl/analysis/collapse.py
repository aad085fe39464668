"""Operational definition of a training collapse, fixed before experiment 05's runs.

A run collapses at step t when
  (a) an update goes non-finite (a skipped non-finite update, or a non-finite grad-norm), or
  (b) the 20-step mean training reward r̄_t falls below half its running peak max_{s<=t} r̄_s and stays
      below half of that peak for every later step of the run (it does not recover).
The first such t is the collapse step; a run without one has not collapsed (within its length).
Half of the running peak, not of the start: a run that learned and then lost it counts, a run that
never learned does not.
"""
from __future__ import annotations

import math

import numpy as np

WINDOW = 20
FRACTION = 0.5


def rolling_mean(values: list[float], window: int = WINDOW) -> np.ndarray:
    """Mean over the last ``window`` values at each step (NaN until the window is full)."""
    x = np.asarray(values, dtype=float)
    out = np.full(len(x), np.nan)
    if len(x) >= window:
        c = np.cumsum(np.insert(x, 0, 0.0))
        out[window - 1:] = (c[window:] - c[:-window]) / window
    return out


def collapse_step(rows: list[dict], window: int = WINDOW, fraction: float = FRACTION) -> int | None:
    """The collapse step of a run's training rows (metrics.jsonl rows with ``reward/mean``), or None."""
    train = [r for r in rows if "reward/mean" in r]
    for r in train:
        skipped = r.get("updates/skipped_nonfinite", 0) or 0
        grad = r.get("grad_norm", 0.0)
        if skipped > 0 or (isinstance(grad, float) and not math.isfinite(grad)):
            return int(r["step"])
    steps = [int(r["step"]) for r in train]
    mean = rolling_mean([float(r["reward/mean"]) for r in train], window)
    peak = np.fmax.accumulate(np.where(np.isnan(mean), -np.inf, mean))
    below = mean < fraction * peak
    for i in np.flatnonzero(below):
        if np.all(mean[i:] < fraction * peak[i]):
            return steps[i]
    return None
