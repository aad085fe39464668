"""moerl.analysis.claims: each verdict follows its stated rule from the runs, and flips when the runs do."""
import pandas as pd

from moerl.analysis import claims

STEPS = 120


def run_rows(arm, seed, reward=0.8, collapse_at=None, k3=1e-3, effective=1.0, **extra):
    rows = []
    for step in range(1, STEPS + 1):
        r = reward if collapse_at is None or step < collapse_at else 0.0
        rows.append({"arm": arm, "seed": seed, "step": step, "reward/mean": r, "mismatch/k3": k3,
                     "effective/token_frac": effective(step) if callable(effective) else effective,
                     "grad_norm": 0.5, **extra})
    return rows


def frames(spec: dict) -> tuple[pd.DataFrame, pd.DataFrame]:
    """spec: arm -> kwargs of run_rows; three seeds each."""
    rows = [r for arm, kw in spec.items() for seed in range(3) for r in run_rows(arm, seed, **kw)]
    metrics = pd.DataFrame(rows)
    runs = pd.DataFrame([{"arm": a, "seed": s} for a in spec for s in range(3)])
    return metrics, runs


def by_claim(spec, fn):
    metrics, runs = frames(spec)
    return fn(metrics, runs)


def test_collapse_verdict_follows_the_runs():
    collapsing = {"baseline": dict(collapse_at=60), "r3": {}, "fp32_rollout": {}}
    assert by_claim(collapsing, claims.claim_collapse).verdict == "yes"
    steady = {"baseline": {}, "r3": {}, "fp32_rollout": {}}
    assert by_claim(steady, claims.claim_collapse).verdict == "no"
    control_too = {"baseline": dict(collapse_at=60), "r3": {}, "fp32_rollout": dict(collapse_at=50)}
    assert by_claim(control_too, claims.claim_collapse).verdict == "partly"
    assert by_claim({"r3": {}}, claims.claim_collapse).verdict == "not tested"


def test_r3_and_position_bug_verdicts():
    fixed = {"deepseek_baseline": dict(k3=2e-3), "deepseek_r3": dict(k3=2e-4),
             "deepseek_r3_position_bug": dict(k3=2.0, collapse_at=40)}
    assert by_claim(fixed, claims.claim_r3).verdict == "yes"
    assert by_claim(fixed, claims.claim_position_bug).verdict == "yes"
    no_gain = {"deepseek_baseline": dict(k3=2e-3), "deepseek_r3": dict(k3=1.9e-3),
               "deepseek_r3_position_bug": dict(k3=1e-3)}
    assert by_claim(no_gain, claims.claim_r3).verdict == "no"
    assert by_claim(no_gain, claims.claim_position_bug).verdict == "no"
    # R3 that lowers k3 but masks samples away does not count.
    shrinking = {"deepseek_baseline": dict(k3=2e-3), "deepseek_r3": dict(k3=2e-4, effective=0.9)}
    assert by_claim(shrinking, claims.claim_r3).verdict == "no"


def test_masking_and_tis_verdicts():
    halting = {"baseline": {}, "seq_mis": dict(effective=lambda step: 1.0 - step / STEPS)}
    assert by_claim(halting, claims.claim_masking).verdict == "yes"
    flat = {"baseline": {}, "seq_mis": dict(effective=0.97), "icepop": dict(effective=0.999)}
    assert by_claim(flat, claims.claim_masking).verdict == "no"
    # No drift in the baseline: the TIS claim cannot be tested, and the table says so.
    tis = by_claim({"baseline": {}, "tis": {"is/truncated_frac": 0.05}}, claims.claim_tis)
    assert tis.verdict == "not tested" and "baseline 1×" in tis.repo


def test_tis_acts_on_tokens_it_scales_down_as_well_as_those_it_caps():
    drifting = dict(k3=lambda step: 1e-3 * (1 + step / 20))  # the baseline's k3 grows 7x along the run
    rows = [r for arm, kw in {"baseline": drifting, "tis": {}}.items() for seed in range(3)
            for r in run_rows(arm, seed, **kw)]
    metrics = pd.DataFrame(rows)
    metrics["mismatch/k3"] = [r["mismatch/k3"](r["step"]) if callable(r["mismatch/k3"]) else r["mismatch/k3"]
                              for r in rows]
    runs = pd.DataFrame([{"arm": a, "seed": s} for a in ("baseline", "tis") for s in range(3)])
    tis = metrics["arm"] == "tis"
    # 0.2 % of tokens capped (rho > 2) but 2 % scaled down by more than half (rho < 1/2): TIS acted.
    metrics.loc[tis, "is/truncated_frac"], metrics.loc[tis, "is/above_frac"] = 0.002, 0.002
    metrics.loc[tis, "is/below_frac"] = 0.02
    acted = claims.claim_tis(metrics, runs)
    assert acted.verdict == "no" and "reweighted 2.20% of tokens" in acted.repo  # TIS's k3 stays flat
    metrics.loc[tis, "is/below_frac"] = 0.001  # both tails together under 1 %: not tested
    assert claims.claim_tis(metrics, runs).verdict == "not tested"


def test_unfinished_runs_are_left_out():
    metrics, runs = frames({"baseline": dict(collapse_at=60), "r3": {}, "fp32_rollout": {}})
    partial = runs[~((runs["arm"] == "baseline") & (runs["seed"] > 0))]
    kept = claims.finished(metrics, partial)
    assert set(kept[kept["arm"] == "baseline"]["seed"]) == {0}
    assert "baseline 1/1" in claims.claim_collapse(kept, partial).repo
    table = claims.collapse_markdown(kept)
    # Reward drops to 0 at step 60: its 20-step mean falls below half its peak 9 steps later.
    assert "| baseline | 69 | not run | not run |" in table


def test_k3_is_compared_by_run_medians_so_one_spike_does_not_decide():
    metrics, runs = frames({"baseline": dict(k3=1e-4), "r2": dict(k3=1e-4)})
    metrics.loc[(metrics["arm"] == "baseline") & (metrics["step"] == 7), "mismatch/k3"] = 1.0  # one spike
    ratios, text = claims.k3_ratio(metrics, "r2", "baseline")
    assert ratios == [1.0, 1.0, 1.0] and "ratio of means" in text
    assert claims.claim_r2(metrics, runs).verdict == "yes"  # by the means R2 would look 80x better


def test_the_readme_facts_name_the_heavy_step_and_the_two_routing_measures():
    metrics, _ = frames({"baseline": dict(k3=1e-4, **{"routing/agreement": 0.97, "routing/any_layer_differs": 0.2}),
                         "ppo_tight_clip": dict(k3=1e-4),
                         "deepseek_r3_position_bug": dict(collapse_at=60, **{"eval/pass1": 0.004})})
    metrics.loc[(metrics["arm"] == "ppo_tight_clip") & (metrics["step"] == 7), "mismatch/k3"] = 0.6  # one spike
    text = claims.facts_markdown(metrics)
    assert "deepseek_r3_position_bug at the end: training reward (last 20 steps) 0.00, held-out pass@1 0.004" in text
    assert "routing agreement averaged over layers 0.9700; tokens agreeing in all 8 MoE layers 80.0 %" in text
    # the spike carries the mean to 6e-1 / 120 + 1e-4 = 51x the baseline's; the median does not move
    assert "largest per-step k3 0.60 (6,000× its median step); run mean 51× the baseline's, run median 1.0×" in text
