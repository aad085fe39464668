"""moerl.analysis.verdicts: each rule reaches its verdict on a small synthetic table, and the 05 claims that
use it say "not tested" / "inconclusive" when the regime could not answer."""
import pandas as pd

from moerl.analysis import claims, verdicts


def test_by_threshold_yes_no_inconclusive_not_tested():
    assert verdicts.by_threshold([1.3, 1.5, 2.0], 1.0) == "yes"
    assert verdicts.by_threshold([0.3, 0.5, 0.9], 1.0) == "no"
    assert verdicts.by_threshold([0.8, 1.1, 1.4], 1.0) == "inconclusive"  # seeds straddle the threshold
    assert verdicts.by_threshold([1.0, 1.2], 1.0) == "inconclusive"  # touching it is not clearing it
    assert verdicts.by_threshold([], 1.0) == "not tested"
    assert verdicts.by_threshold([0.2, 0.3], 0.5, above="no", below="yes") == "yes"


def test_a_mitigation_that_hardly_acts_is_not_tested():
    assert not verdicts.acts_on([0.0001, 0.002, 0.009])
    assert verdicts.acts_on([0.002, 0.015])  # one seed reached 1 %
    assert not verdicts.acts_on([])
    assert verdicts.gate("no", acted=False) == "not tested"
    assert verdicts.gate("no", acted=True) == "no"
    assert verdicts.gate("yes", acted=None, effect_present=None) == "yes"


def test_drift_counts_only_beyond_the_control_in_every_seed():
    control = {0: -0.10, 1: -0.05, 2: -0.08}
    assert verdicts.beyond_control({0: -0.20, 1: -0.15, 2: -0.12}, control)
    assert not verdicts.beyond_control({0: -0.20, 1: -0.01, 2: -0.12}, control)  # one seed no worse
    assert not verdicts.beyond_control({5: -1.0}, control)  # no paired seed
    assert verdicts.gate("no", effect_present=False) == "not tested"


# -- the rules applied to experiment 05's claims -----------------------------------------------------
STEPS = 120


def _frames(spec: dict, seeds=(0, 1, 2)) -> tuple[pd.DataFrame, pd.DataFrame]:
    """spec: arm -> {metric: value or seed -> value or (seed, step) -> value}, plus run-level
    'final'/'initial' pass@1 per seed."""
    rows, runs = [], []
    for arm, kw in spec.items():
        for seed in seeds:
            for step in range(1, STEPS + 1):
                row = {"arm": arm, "seed": seed, "step": step, "reward/mean": 0.8, "mismatch/k3": 1e-3,
                       "effective/token_frac": 1.0}
                for k, v in kw.items():
                    if k not in ("final", "initial"):
                        row[k] = v(seed, step) if callable(v) else v
                rows.append(row)
            runs.append({"arm": arm, "seed": seed, "final_eval/eval/pass1": kw.get("final", {}).get(seed, 0.9),
                         "initial_eval/eval/pass1": kw.get("initial", {}).get(seed, 0.9)})
    return pd.DataFrame(rows), pd.DataFrame(runs)


def _growing(factor):
    """k3 that grows by ``factor`` (a number, or seed -> number) from the first to the last steps."""
    return lambda seed, step: 1e-4 * (1 + ((factor(seed) if callable(factor) else factor) - 1) * step / STEPS)


def test_tis_claim_each_verdict():
    drift = _growing(3.0)
    # TIS acts on tokens whose ratio leaves [1/2, 2] on either side (above: capped; below: scaled down).
    acts = {"is/truncated_frac": 0.01, "is/above_frac": 0.01, "is/below_frac": 0.04}
    acting = {"baseline": {"mismatch/k3": drift}, "tis": {"mismatch/k3": drift, **acts}}
    assert claims.claim_tis(*_frames(acting)).verdict == "yes"
    stopped = {"baseline": {"mismatch/k3": drift}, "tis": {"mismatch/k3": 1e-4, **acts}}
    assert claims.claim_tis(*_frames(stopped)).verdict == "no"
    idle = {"baseline": {"mismatch/k3": drift}, "tis": {"mismatch/k3": 1e-4, "is/truncated_frac": 1e-4,
                                                         "is/above_frac": 1e-4, "is/below_frac": 2e-4}}
    assert claims.claim_tis(*_frames(idle)).verdict == "not tested"  # TIS reweighted 0.03 % of tokens
    split = {"baseline": {"mismatch/k3": drift},
             "tis": {"mismatch/k3": _growing(lambda s: [1.0, 1.5, 3.0][s]), **acts}}
    assert claims.claim_tis(*_frames(split)).verdict == "inconclusive"


def test_masking_claim_is_not_tested_when_the_mask_hardly_fires():
    halting = {"baseline": {}, "seq_mis": {"effective/token_frac": lambda s, step: 1.0 - step / STEPS,
                                           "mask/token_frac": 0.4}}
    assert claims.claim_masking(*_frames(halting)).verdict == "yes"
    idle = {"baseline": {}, "seq_mis": {"effective/token_frac": 0.99, "mask/token_frac": 0.008},
            "icepop": {"effective/token_frac": 0.999, "mask/token_frac": 0.0002}}
    assert claims.claim_masking(*_frames(idle)).verdict == "not tested"


def test_collapse_claim_is_not_tested_when_the_fp32_control_loses_as_much():
    both_lose = {"baseline": {"final": {0: 0.80, 1: 0.86, 2: 0.84}}, "r3": {},
                 "fp32_rollout": {"final": {0: 0.82, 1: 0.83, 2: 0.85}}}
    assert claims.claim_collapse(*_frames(both_lose)).verdict == "not tested"
    worse = {"baseline": {"final": {0: 0.60, 1: 0.62, 2: 0.64}}, "r3": {},
             "fp32_rollout": {"final": {0: 0.82, 1: 0.83, 2: 0.85}}}
    assert claims.claim_collapse(*_frames(worse)).verdict == "no"  # drifted beyond fp32 but did not collapse


def test_rerouted_claim_compares_with_the_papers_share():
    assert claims.claim_rerouted(*_frames({"baseline": {"routing/any_layer_differs": 0.15}})).verdict == "no"
    assert claims.claim_rerouted(*_frames({"baseline": {"routing/any_layer_differs": 0.9}})).verdict == "yes"
    mixed = {"baseline": {"routing/any_layer_differs": lambda s, step: [0.3, 0.5, 0.7][s]}}
    assert claims.claim_rerouted(*_frames(mixed)).verdict == "inconclusive"
