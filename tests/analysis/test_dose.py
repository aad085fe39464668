"""The dose ladder's rules on crafted runs: the control's learning test, the mismatch order of rungs and
the threshold."""
import pytest

from moerl.analysis.dose import control_learns, mismatch_order, run_summary, threshold


def rows(rewards, k3=1e-4, pass1=(0.3, 0.45)):
    out = [{"step": 0, "eval/pass1": pass1[0]}]
    out += [{"step": i + 1, "reward/mean": r, "mismatch/k3": k3, "grad_norm": 1.0} for i, r in enumerate(rewards)]
    out.append({"step": len(rewards), "eval/pass1": pass1[1]})
    return out


LEARNS = [0.3] * 40 + [0.5] * 60
COLLAPSES = [0.3] * 30 + [0.6] * 30 + [0.05] * 40


def test_run_summary_reads_the_collapse_and_the_gain():
    s = run_summary(rows(COLLAPSES, k3=2e-3, pass1=(0.3, 0.1)))
    assert s["collapse_step"] is not None and s["k3_median"] == 2e-3 and s["pass1_end"] == 0.1
    assert run_summary(rows(LEARNS))["collapse_step"] is None


def test_control_learns_needs_the_gain_and_no_collapse():
    assert control_learns(run_summary(rows(LEARNS, pass1=(0.30, 0.41))))
    assert not control_learns(run_summary(rows(LEARNS, pass1=(0.30, 0.38))))
    assert not control_learns(run_summary(rows(COLLAPSES, pass1=(0.30, 0.45))))


def test_threshold_is_the_lowest_collapsing_rung_in_mismatch_order():
    control = run_summary(rows(LEARNS, k3=0.0, pass1=(0.3, 0.45)))
    ladder = {"fp32": control, "bf16": run_summary(rows(LEARNS, k3=1e-4)),
              "fp8": run_summary(rows(COLLAPSES, k3=3e-3)), "int8": run_summary(rows(LEARNS, k3=5e-4)),
              "int4": run_summary(rows(COLLAPSES, k3=2e-2))}
    assert mismatch_order(ladder) == ["fp32", "bf16", "int8", "fp8", "int4"]
    assert threshold(ladder, control) == "fp8"
    ladder["fp8"] = run_summary(rows(LEARNS, k3=3e-3))
    assert threshold(ladder, control) == "int4"
    assert threshold({k: v for k, v in ladder.items() if k != "int4"}, control) is None
    # A control that does not learn: no threshold can be claimed, whatever collapses.
    assert threshold(ladder, run_summary(rows(LEARNS, pass1=(0.3, 0.31)))) is None


def summaries(pass1_ends, collapse=(), acts=0.05, key="is/outside_band_frac", k3=1e-3, effective=0.99, start=0.55,
              truncated=None):
    """seed -> a crafted run_summary with the given final pass@1 (collapsed seeds listed in ``collapse``)."""
    return {s: {"pass1_start": start, "pass1_end": end, "collapse_step": 120 if s in collapse else None,
                "acts_on": {key: acts, **({} if truncated is None else {"is/truncated_frac": truncated})},
                "k3_median": k3, "effective_token_frac": effective}
            for s, end in enumerate(pass1_ends)}


def test_mitigation_verdicts_on_paired_seeds():
    from moerl.analysis.dose import GEO_MIS, mitigation_verdicts

    control = summaries([0.66, 0.67, 0.65])
    baseline = summaries([0.40, 0.45, 0.30], collapse=(2,))
    v = mitigation_verdicts("tis", summaries([0.64, 0.66, 0.62]), baseline, control)
    assert (v["helps"], v["like_control"], v["prevents_collapse"]) == ("yes", "yes", "yes")
    assert v["minus_baseline"] == {0: 0.64 - 0.40, 1: 0.66 - 0.45, 2: 0.62 - 0.30}
    # One seed better, one worse than the baseline: the seed interval straddles 0.
    v = mitigation_verdicts("tis", summaries([0.45, 0.40, 0.35], collapse=(2,)), baseline, control)
    assert (v["helps"], v["like_control"], v["prevents_collapse"]) == ("inconclusive", "no", "no")
    v = mitigation_verdicts("tis", summaries([0.50, 0.60, 0.20], collapse=(1, 2)), baseline, control)
    assert v["prevents_collapse"] == "no" and v["collapsed"] == 2
    # Two seeds finished, both collapsed, where the baseline collapsed in both: no (not "partly" against
    # the baseline's three seeds).
    all_collapse = summaries([0.40, 0.45, 0.30], collapse=(0, 1, 2))
    two = summaries([0.2, 0.2], collapse=(0, 1), key="mask/token_frac", acts=0.8)
    assert mitigation_verdicts(GEO_MIS, two, all_collapse, control)["prevents_collapse"] == "no"


def test_mitigation_verdicts_say_not_tested_when_the_regime_cannot_show_it():
    from moerl.analysis.dose import mitigation_verdicts

    control = summaries([0.66, 0.67, 0.65])
    baseline = summaries([0.40, 0.45, 0.30])
    # TIS reweighted (ρ outside [1/2, 2]) 0.2 % of tokens in every seed: it hardly acted.
    v = mitigation_verdicts("tis", summaries([0.64, 0.66, 0.62], acts=0.002), baseline, control)
    assert v["acted"] is False and v["helps"] == v["like_control"] == "not tested"
    # The baseline kept up with the control in one seed: nothing attributable to the mismatch.
    v = mitigation_verdicts("tis", summaries([0.64, 0.66, 0.62]), summaries([0.40, 0.70, 0.30]), control)
    assert v["baseline_behind_control"] is False and v["helps"] == "not tested"
    # No baseline seed collapsed: "prevents collapse" cannot be tested either way.
    v = mitigation_verdicts("r3", summaries([0.64, 0.66, 0.62], key="routing/any_layer_differs", acts=0.3),
                            baseline, control)
    assert v["acted"] is True and v["prevents_collapse"] == "not tested" and v["helps"] == "yes"


def test_tis_verdicts_under_the_amended_and_the_preregistered_acted_on_rule():
    from moerl.analysis.dose import mitigation_verdicts

    control = summaries([0.66, 0.67, 0.65])
    baseline = summaries([0.40, 0.45, 0.30], collapse=(0, 1, 2))
    # 1.2 % of tokens reweighted by a factor of 2 or more, of which 0.2 % capped (truncated).
    v = mitigation_verdicts("tis", summaries([0.64, 0.66, 0.62], acts=0.012, truncated=0.002), baseline, control)
    assert v["acted_measure"] == "is/outside_band_frac" and v["acted"] is True and v["helps"] == "yes"
    pre = v["preregistered"]
    assert pre["acted_measure"] == "is/truncated_frac" and pre["acted_frac"] == [0.002] * 3
    assert pre["acted"] is False and pre["helps"] == pre["like_control"] == pre["prevents_collapse"] == "not tested"
    # R3's measure was not amended: the same measure under the rules as first written.
    r3 = mitigation_verdicts("r3", summaries([0.6] * 3, key="routing/any_layer_differs", acts=0.3), baseline, control)
    assert r3["preregistered"]["acted_measure"] == r3["acted_measure"] == "routing/any_layer_differs"


def test_trains_like_the_control_as_first_written_is_two_sided():
    from moerl.analysis.dose import mitigation_verdicts, registered

    assert registered("match_margin") == {"margin": 0.05, "sided": "below"}
    assert registered("match_margin", first_written=True) == {"margin": 0.05, "sided": "two"}
    control = summaries([0.60, 0.60, 0.60])
    baseline = summaries([0.50, 0.50, 0.50])
    # one seed ends 0.056 above the control: "at most 0.05 below" says yes, "within 0.05" cannot
    v = mitigation_verdicts("r3_tis", summaries([0.602, 0.627, 0.656], key="routing/any_layer_differs", acts=0.3),
                            baseline, control)
    assert v["like_control"] == "yes" and v["preregistered"]["like_control"] == "inconclusive"


def test_the_regime_gate_turns_control_verdicts_into_not_tested_and_keeps_the_rest():
    from moerl.analysis.dose import mitigation_verdicts, regime

    control = summaries([0.66, 0.67, 0.65])
    for seed, gain in zip(control, (0.106, 0.105, 0.0986)):
        control[seed].update(pass1_start=0.546, pass1_end=0.546 + gain, steps=300, steps_planned=300)
    state = regime(control)
    assert not state["learns"] and state["learned"] == [0, 1] and "2 of 3" in state["status"]
    baseline = summaries([0.40, 0.45, 0.30], collapse=(0, 1, 2))
    v = mitigation_verdicts("tis", summaries([0.64, 0.66, 0.62]), baseline, control, regime_ok=state["learns"])
    assert v["like_control"] == v["prevents_collapse"] == "not tested" and v["helps"] == "yes"
    assert v["ungated"] == {"like_control": "yes", "prevents_collapse": "yes"}
    control[2]["pass1_end"] = 0.546 + 0.101
    assert regime(control)["learns"]


def test_power_and_interval_beside_each_paired_verdict():
    from moerl.analysis.dose import mitigation_verdicts
    from moerl.analysis.power import power_every_seed

    control = summaries([0.60, 0.62, 0.61])
    baseline = summaries([0.50, 0.52, 0.50])
    v = mitigation_verdicts("tis", summaries([0.58, 0.61, 0.60]), baseline, control, noise_sd=0.025)
    like = v["power"]["like_control"]
    mean, lo, hi = like["interval"]
    assert mean == pytest.approx(-0.0133, abs=1e-3) and lo < mean < hi
    assert like["power_every_seed"] == pytest.approx(power_every_seed(0.0, -0.05, 0.025, 3))
    assert like["seeds_for_80"] >= 2


def test_k3_before_the_collapse_and_the_dose_order_uncertainty():
    from moerl.analysis.dose import dose_order_uncertainty, k3_median_before

    rows_ = [{"step": i, "mismatch/k3": 0.01 if i < 100 else 1.0} for i in range(1, 301)]
    assert k3_median_before(rows_, 100) == pytest.approx(0.01) and k3_median_before(rows_, None) == 1.0
    import numpy as np

    rng = np.random.default_rng(0)
    a = [{"step": i, "mismatch/k3": float(x)} for i, x in enumerate(rng.lognormal(0, 1, 300))]
    b = [{"step": i, "mismatch/k3": float(x)} for i, x in enumerate(rng.lognormal(0.05, 1, 300))]
    tied = dose_order_uncertainty(a, b)
    assert tied["lo"] < 1 < tied["hi"] and not tied["resolved"]
    far = [{"step": i, "mismatch/k3": float(x)} for i, x in enumerate(rng.lognormal(2, 1, 300))]
    assert dose_order_uncertainty(a, far)["resolved"] and dose_order_uncertainty(a, far)["lo"] > 1


def test_r3_reduces_mismatch_needs_both_halves():
    from moerl.analysis.dose import r3_reduces_mismatch

    baseline = summaries([0.4] * 3, k3=1e-3, effective=0.99)
    assert r3_reduces_mismatch(summaries([0.6] * 3, k3=3e-4, effective=0.99), baseline)["verdict"] == "yes"
    # Less mismatch, but far fewer tokens keep a gradient: the claim's second half fails.
    assert r3_reduces_mismatch(summaries([0.6] * 3, k3=3e-4, effective=0.90), baseline)["verdict"] == "no"
    mixed = summaries([0.6] * 3, k3=3e-4)
    mixed[1]["k3_median"] = 2e-3
    assert r3_reduces_mismatch(mixed, baseline)["k3"] == "inconclusive"


def test_run_summary_carries_what_each_mitigation_acted_on():
    rs = rows(LEARNS)
    for r in rs:
        if "reward/mean" in r:
            r.update({"is/truncated_frac": 0.02, "is/above_frac": 0.02, "is/below_frac": 0.03,
                      "mask/token_frac": 0.0, "routing/any_layer_differs": 0.3})
    s = run_summary(rs)
    assert s["acts_on"] == pytest.approx({"is/truncated_frac": 0.02, "is/outside_band_frac": 0.05,
                                          "mask/token_frac": 0.0, "routing/any_layer_differs": 0.3})


def test_a_mitigations_threshold_and_how_it_moves_the_baselines():
    from moerl.analysis.dose import arm_threshold, threshold_shift

    order = ["fp8", "nvfp4"]
    baseline = arm_threshold({"fp8": (0, 3), "nvfp4": (3, 3)}, order)
    assert baseline["rung"] == "nvfp4"
    never = arm_threshold({"fp8": (0, 3), "nvfp4": (0, 3)}, order)
    assert (never["rung"], never["above"]) == (None, "nvfp4")
    assert threshold_shift(never, baseline, order) == "raised above nvfp4"
    # One collapsed seed of three is enough to place the threshold at that rung.
    assert threshold_shift(arm_threshold({"fp8": (0, 3), "nvfp4": (1, 3)}, order), baseline, order) == "unchanged"
    assert threshold_shift(arm_threshold({"fp8": (1, 3), "nvfp4": (3, 3)}, order), baseline, order) == "lower"
    # Not yet run at fp8, or a baseline that never collapsed: nothing to compare.
    assert threshold_shift(arm_threshold({"nvfp4": (0, 2)}, order), baseline, order) == "not tested: not run at fp8"
    assert threshold_shift(never, never, order) == "not tested"


def test_drift_under_a_mitigation_by_experiment_05s_rule():
    from moerl.analysis.dose import mitigation_verdicts

    control = summaries([0.66, 0.67, 0.65])
    baseline = summaries([0.40, 0.45, 0.30], collapse=(0, 1, 2))
    tis = summaries([0.64, 0.66, 0.62], acts=0.012)
    for s, (b, t) in enumerate([(12.0, 1.4), (14.0, 1.6), (10.0, 1.1)]):
        baseline[s]["k3_growth"], tis[s]["k3_growth"] = b, t
    v = mitigation_verdicts("tis", tis, baseline, control)
    assert v["k3_growth"] == {0: 1.4, 1: 1.6, 2: 1.1} and v["keeps_drifting"] == "inconclusive"
    tis[2]["k3_growth"] = 1.3
    assert mitigation_verdicts("tis", tis, baseline, control)["keeps_drifting"] == "yes"
    baseline[1]["k3_growth"] = 1.1  # one uncorrected seed without drift: nothing to stop
    assert mitigation_verdicts("tis", tis, baseline, control)["keeps_drifting"] == "not tested"


def test_run_summary_measures_the_drift_as_late_over_early_median_k3():
    rs = rows(LEARNS)
    train = [r for r in rs if "reward/mean" in r]
    for i, r in enumerate(train):
        r["mismatch/k3"] = 1e-3 if i < len(train) // 2 else 3e-3
    assert run_summary(rs)["k3_growth"] == pytest.approx(3.0)
