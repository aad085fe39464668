"""The dose ladder's rules on crafted runs: the control's learning test, the mismatch order of rungs and
the threshold."""
from moerl.dose import control_learns, mismatch_order, run_summary, threshold


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
