"""Experiment 07's confirmatory grids: membership, progress, and the registered t rules on synthetic runs."""
import numpy as np
import pytest

from moerl.analysis import confirmatory, registration

REGISTERED = registration.load(registration.analysis_path("07_dose_threshold"))
RULES = confirmatory.rules_of(REGISTERED)
PATH = {REGISTERED["rollout_path"]["key"]: REGISTERED["rollout_path"]["value"]}


def run(arm, rung, seed, *, start=0.55, end=0.65, steps=300, completions=2048, path=PATH, collapse=None, **extra):
    return {"arm": arm, "rung": rung, "seed": seed, "steps": steps, "steps_planned": steps,
            "eval_completions": completions, "path": dict(path), "pass1_start": start, "pass1_end": end,
            "collapse_step": collapse, "acts_on": extra.pop("acts_on", {}), **extra}


def test_membership_keeps_the_recorded_grids_apart():
    assert confirmatory.grid_of(run("fp32_control", "fp32", 3), REGISTERED) == "confirmatory_control"
    assert confirmatory.grid_of(run("baseline", "fp8", 11), REGISTERED) == "confirmatory_fp8"
    assert confirmatory.grid_of(run("tis", "nvfp4", 4, steps=600), REGISTERED) == "confirmatory_nvfp4_600"
    assert confirmatory.grid_of(run("qat_int4", "int4_kimi", 0), REGISTERED) == "mechanism"
    # a recorded run of the earlier grids (1,024 completions, no path), or one off the registered plan
    assert confirmatory.grid_of(run("fp32_control", "fp32", 0, completions=1024, path={}), REGISTERED) is None
    assert confirmatory.grid_of(run("fp32_control", "fp32", 0, path={}), REGISTERED) is None
    assert confirmatory.grid_of(run("qat_int4", "nvfp4_experts", 0), REGISTERED) is None
    assert confirmatory.grid_of(run("tis", "nvfp4", 4), REGISTERED) is None  # 300 steps: not the 600-step grid
    assert confirmatory.grid_of(run("fp32_control", "fp32", 12), REGISTERED) is None  # an unregistered seed


def test_no_verdict_before_the_last_registered_run():
    controls = [run("fp32_control", "fp32", s, end=0.80) for s in range(11)]
    out = confirmatory.report(controls, REGISTERED, RULES)
    assert out["progress"]["confirmatory_control"] == {"planned": 12, "finished": 11, "started": 11, "complete": False}
    assert out["verdicts"] == {}
    unfinished = run("fp32_control", "fp32", 11, end=0.80)
    unfinished["steps"] = 120
    assert confirmatory.report(controls + [unfinished], REGISTERED, RULES)["verdicts"] == {}
    assert "after the last registered run" in confirmatory.markdown(out)


def test_regime_rule_against_its_noise():
    rng = np.random.default_rng(0)
    learns = [run("fp32_control", "fp32", s, end=0.55 + 0.10 + rng.normal(0, 0.02)) for s in range(12)]
    out = confirmatory.report(learns, REGISTERED, RULES)["verdicts"]["confirmatory_control"]["regime"]
    assert out["verdict"] == "yes" and out["gain"]["n"] == 12 and out["gain"]["low"] > 0.05
    flat = [run("fp32_control", "fp32", s, end=0.55 + 0.02 + rng.normal(0, 0.02)) for s in range(12)]
    assert confirmatory.report(flat, REGISTERED, RULES)["verdicts"]["confirmatory_control"]["regime"]["verdict"] == "no"
    learns[3]["collapse_step"] = 210
    out = confirmatory.report(learns, REGISTERED, RULES)["verdicts"]["confirmatory_control"]["regime"]
    assert out["verdict"] == "no" and out["collapsed_seeds"] == [3]


def fp8_grid(rng, effects: dict[str, float], acts: dict[str, dict]) -> list[dict]:
    runs = [run("fp32_control", "fp32", s, end=0.70 + rng.normal(0, 0.01)) for s in range(12)]
    for arm in REGISTERED["grids"]["confirmatory_fp8"]["arms"]:
        runs += [run(arm, "fp8", s, end=0.62 + effects.get(arm, 0.0) + rng.normal(0, 0.01), acts_on=acts.get(arm, {}))
                 for s in range(12)]
    return runs


def test_fp8_comparisons_follow_the_registered_rules():
    rng = np.random.default_rng(1)
    floor = RULES["acts_on_per_mechanism"]["floor"]
    acts = {"tis": {RULES["acts_on_per_mechanism"]["ratio_tail"]: floor / 10},  # hardly acted: not tested
            "icepop": {RULES["acts_on_per_mechanism"]["masked"]: 0.2},
            "r3": {RULES["acts_on_per_mechanism"]["rerouted"]: 0.001},  # reported, never floored
            "r3_tis": {RULES["acts_on_per_mechanism"]["rerouted"]: 0.3}}
    runs = fp8_grid(rng, {"r3": 0.07, "tis": 0.07, "icepop": 0.0, "r3_tis": 0.0}, acts)
    out = confirmatory.report(runs, REGISTERED, RULES)["verdicts"]["confirmatory_fp8"]
    assert out["baseline behind control"]["verdict"] == "yes"
    assert out["r3 like_control"]["verdict"] == "yes"  # 0.69 vs 0.70: well within 0.05
    assert out["r3 helps"]["verdict"] == "yes" and out["r3 helps"]["acts_on"]["floored"] is False
    assert out["tis helps"]["verdict"] == "not tested"
    assert out["icepop helps"]["verdict"] in ("no", "inconclusive")
    assert out["r3_tis like_control"]["verdict"] == "no"  # 0.62 vs 0.70: below by more than the margin
    assert 0 < out["r3 helps"]["power_at_smallest_effect"] <= 1
    assert out["r3 helps"]["n"] == 12 and out["r3 helps"]["low"] < 0.07 < out["r3 helps"]["high"]
    text = confirmatory.markdown(confirmatory.report(runs, REGISTERED, RULES))
    assert "r3 helps | yes" in text and "tis helps | not tested" in text


def test_drift_at_600_steps():
    base = [run("baseline", "nvfp4", s, steps=600, k3_growth=g) for s, g in enumerate([8.0, 12.0, 9.0, 15.0, 10.0])]
    tis_ratio = RULES["acts_on_per_mechanism"]["ratio_tail"]
    arms = [run("tis", "nvfp4", s, steps=600, k3_growth=1.5, acts_on={tis_ratio: 0.05}) for s in range(5)]
    arms += [run("icepop", "nvfp4", s, steps=600, k3_growth=1.05,
                 acts_on={RULES["acts_on_per_mechanism"]["masked"]: 0.1}) for s in range(5)]
    arms += [run("r3_tis", "nvfp4", s, steps=600, k3_growth=g) for s, g in enumerate([1.5, 1.0, 1.3, 1.1, 1.6])]
    controls = [run("fp32_control", "fp32", s, end=0.70) for s in range(12)]
    out = confirmatory.report(base + arms + controls, REGISTERED, RULES)["verdicts"]
    drift = out["confirmatory_nvfp4_600"]
    assert drift["tis keeps_drifting"]["verdict"] == "yes"
    assert drift["icepop keeps_drifting"]["verdict"] == "no"
    assert drift["r3_tis keeps_drifting"]["verdict"] == "inconclusive"


@pytest.mark.parametrize("grid", confirmatory.PATH_GRIDS)
def test_every_path_grid_is_registered_with_a_plan(grid):
    g = confirmatory.path_grids(REGISTERED)[grid]
    assert g.planned() and g.eval_completions == 2048


def test_verdicts_carry_the_post_hoc_label_of_their_rules():
    rng = np.random.default_rng(2)
    runs = [run("fp32_control", "fp32", s, end=0.70 + rng.normal(0, 0.02)) for s in range(12)]
    seen = []

    def label(rules, grid):
        seen.append((tuple(rules), grid))
        return "regime_t (abc1234)" if "regime_t" in rules else ""

    text = confirmatory.markdown(confirmatory.report(runs, REGISTERED, RULES), label=label, registered=REGISTERED)
    assert (("regime_t", "collapse"), "confirmatory_control") in seen
    assert "*post hoc*: regime_t (abc1234)" in text


def test_the_recorded_tables_never_load_a_path_grid_run(tmp_path):
    """dose.load_runs gives the recorded grids' tables (README, notebook 08, the report's) only their runs."""
    import shutil
    from pathlib import Path

    import yaml

    from moerl.analysis import dose

    recorded = Path(__file__).resolve().parents[2] / "results" / "runs" / "07_dose_threshold" / "fp32_control" / "seed0"
    root = tmp_path / "runs" / "07_dose_threshold"
    shutil.copytree(recorded, root / "fp32_control" / "seed0", ignore=shutil.ignore_patterns("checkpoints", "samples"))
    grid_run = root / "fp32_control+trainer.eval_samples-8" / "seed0"
    shutil.copytree(recorded, grid_run, ignore=shutil.ignore_patterns("checkpoints", "samples"))
    cfg = yaml.safe_load((grid_run / "config.yaml").read_text())
    cfg["trainer"]["eval_samples"] = 8
    cfg["rollout"]["decode"] = "loop"
    (grid_run / "config.yaml").write_text(yaml.safe_dump(cfg))
    every = dose.load_runs(tmp_path / "runs", grids="all")
    assert len(every) == 2 and sum(confirmatory.grid_of(r, REGISTERED) == "confirmatory_control" for r in every) == 1
    assert [r["run_dir"] for r in dose.load_runs(tmp_path / "runs")] == [str(root / "fp32_control" / "seed0")]
    with pytest.raises(ValueError, match="grids must be"):
        dose.load_runs(tmp_path / "runs", grids="some")

