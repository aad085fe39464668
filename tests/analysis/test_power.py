"""The power module on synthetic data with known answers."""
import numpy as np
import pytest
from scipy import stats

from moerl.analysis.power import (binomial_sd, completions_for, paired_correlation, pooled_sd, power_every_seed,
                                  power_t, seeds_needed, t_interval, t_verdict)


def test_binomial_and_completions():
    assert binomial_sd(0.5, 1024) == pytest.approx(0.015625)
    n = completions_for(0.05, 0.6)
    assert np.sqrt(2 * 0.24 / n) <= 0.05 / 3 < np.sqrt(2 * 0.24 / (n - 1))


def test_t_interval_has_n_minus_1_degrees_of_freedom():
    mean, lo, hi = t_interval([0.0, 1.0, 2.0])
    assert mean == 1.0 and hi - mean == pytest.approx(stats.t.ppf(0.975, 2) * 1.0 / np.sqrt(3))
    assert t_interval([1.0]) is None


def test_pooled_sd_and_correlation_recover_simulated_values():
    rng = np.random.default_rng(0)
    groups = [rng.normal(mu, 0.02, 50) for mu in (0.0, 0.3, -0.1)]
    sd, df = pooled_sd(groups)
    assert df == 147 and sd == pytest.approx(0.02, rel=0.15)
    shared = rng.normal(0, 1, 4000)
    pairs = np.stack([shared + rng.normal(0, 1, 4000), shared + rng.normal(0, 1, 4000)], 1)
    assert paired_correlation(pairs) == pytest.approx(0.5, abs=0.05)


def test_power_matches_simulation():
    rng = np.random.default_rng(1)
    effect, threshold, sd, n = 0.0, -0.05, 0.04, 6
    draws = rng.normal(effect, sd, (20000, n))
    every = (draws > threshold).all(1).mean()
    assert power_every_seed(effect, threshold, sd, n) == pytest.approx(every, abs=0.01)
    lower = draws.mean(1) - stats.t.ppf(0.95, n - 1) * draws.std(1, ddof=1) / np.sqrt(n)
    assert power_t(effect, threshold, sd, n) == pytest.approx((lower > threshold).mean(), abs=0.01)
    # the every-seed rule loses power with seeds; the t rule gains it
    assert power_every_seed(effect, threshold, sd, 10) < power_every_seed(effect, threshold, sd, 3)
    assert power_t(effect, threshold, sd, 10) > power_t(effect, threshold, sd, 3)
    # no spread at all (identical seeds): the limit of the t rule, without a division by zero
    assert power_t(effect, threshold, 0.0, n) == 1.0 and power_t(threshold, effect, 0.0, n) == 0.0


def test_seeds_needed_is_the_first_n_reaching_80_percent():
    n = seeds_needed(0.0, -0.05, 0.04)
    assert power_t(0.0, -0.05, 0.04, n) >= 0.8 > power_t(0.0, -0.05, 0.04, n - 1)
    assert seeds_needed(0.0, -0.05, 10.0, most=50) is None


def test_t_verdict():
    assert t_verdict([0.01, 0.02, 0.0, 0.015], -0.05) == "yes"
    assert t_verdict([-0.2, -0.21, -0.19], -0.05) == "no"
    assert t_verdict([0.05, -0.15, 0.02], -0.05) == "inconclusive"
    assert t_verdict([0.1], 0.0) == "not tested"
