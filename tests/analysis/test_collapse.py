import math

from moerl.analysis.collapse import collapse_step, rolling_mean


def rows(rewards, **extra):
    return [{"step": i + 1, "reward/mean": r, **({k: v[i] for k, v in extra.items()})} for i, r in enumerate(rewards)]


def test_rolling_mean():
    m = rolling_mean([1, 2, 3, 4], window=2)
    assert math.isnan(m[0]) and list(m[1:]) == [1.5, 2.5, 3.5]


def test_learned_then_lost_is_a_collapse_at_the_first_step_below_half_the_peak():
    rewards = [0.3] * 20 + [0.6] * 40 + [0.1] * 60
    step = collapse_step(rows(rewards))
    # 20-step mean of 0.6 peaks at step 60; it drops below 0.3 once 13 of the last 20 are 0.1: step 73.
    assert step == 73


def test_a_dip_that_recovers_and_a_run_that_never_learned_are_not_collapses():
    assert collapse_step(rows([0.6] * 40 + [0.1] * 30 + [0.6] * 50)) is None
    assert collapse_step(rows([0.05] * 100)) is None


def test_a_non_finite_update_is_a_collapse():
    r = rows([0.5] * 30, **{"updates/skipped_nonfinite": [0] * 12 + [1] + [0] * 17})
    assert collapse_step(r) == 13
    assert collapse_step(rows([0.5] * 30, grad_norm=[1.0] * 5 + [float("nan")] + [1.0] * 24)) == 6
