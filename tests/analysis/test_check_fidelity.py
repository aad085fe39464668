"""scripts/check_fidelity.py: its comparison rule on recorded-run fixtures (a run against itself passes, a
shifted copy does not), its table, and its refusal of a rung override."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
from tests_helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "runs_07"


@pytest.fixture(scope="module")
def fidelity():
    return load_script("scripts/check_fidelity.py", "_check_fidelity")


def _two_seeds(fidelity):
    runs = fidelity.cell_runs(FIXTURES, "baseline", "nvfp4")
    assert runs, "fixture run missing"
    second = copy.deepcopy(runs[0])
    second["seed"], second["k3_median"] = 1, runs[0]["k3_median"] * 1.1
    return [runs[0], second]


def test_same_runs_pass(fidelity):
    runs = _two_seeds(fidelity)
    cell = fidelity.compare_cell(runs, runs)
    assert cell["passed"]
    measures = [r["measure"] for r in cell["rows"]]
    assert measures[:2] == ["k3 (run median)", "re-routing share (run median)"]
    assert any(m.startswith("pass@1 at step") for m in measures) and measures[-1].startswith("collapsed")


def test_shifted_dose_fails(fidelity):
    runs = _two_seeds(fidelity)
    shifted = copy.deepcopy(runs)
    for r in shifted:
        r["k3_median"] *= 3
    cell = fidelity.compare_cell(runs, shifted)
    assert not cell["passed"]
    assert cell["rows"][0]["overlap"] is False
    text = fidelity.table("rollout.path=static", {"baseline @ nvfp4": cell})
    assert "**no**" in text and "not passed" in text


def test_one_seed_is_not_a_pass(fidelity):
    runs = _two_seeds(fidelity)
    assert not fidelity.compare_cell(runs, runs[:1])["passed"]


def test_rung_override_refused(fidelity, capsys):
    with pytest.raises(SystemExit):
        fidelity.main(["rollout.dtype=fp8", "--compare-only"])
    assert "must not set rollout.dtype" in capsys.readouterr().err


def test_control_k3_is_judged_as_no_mismatch(fidelity):
    runs = fidelity.cell_runs(FIXTURES, "fp32_control", "fp32")
    assert runs
    a, b = copy.deepcopy(runs[0]), copy.deepcopy(runs[0])
    a["k3_median"], b["k3_median"] = 1.8e-13, 9e-14  # fp32 noise on both sides: intervals apart, both no mismatch
    second_a, second_b = dict(a, seed=1), dict(b, seed=1)
    row = fidelity.compare_cell([a, second_a], [b, second_b], control=True)["rows"][0]
    assert row["overlap"] is True and "no mismatch" in row["measure"]
    b["k3_median"] = second_b["k3_median"] = 1e-3  # the control with a mismatch: fails
    assert fidelity.compare_cell([a, second_a], [b, second_b], control=True)["rows"][0]["overlap"] is False
