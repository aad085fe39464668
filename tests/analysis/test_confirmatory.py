"""Experiment 07's confirmatory grids: membership, progress, and the registered t rules on synthetic runs."""
import re

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
    assert out["progress"]["confirmatory_control"] == {"planned": 12, "finished": 11, "started": 11, "complete": False,
                                                       "machines": {"not recorded": 11}, "seconds_left": None}
    assert out["verdicts"] == {}
    unfinished = run("fp32_control", "fp32", 11, end=0.80)
    unfinished["steps"] = 120
    assert confirmatory.report(controls + [unfinished], REGISTERED, RULES)["verdicts"] == {}
    assert "after the last registered run" in confirmatory.markdown(out)


def test_progress_estimates_the_run_time_a_grid_has_left():
    # three finished control runs at 2, 3 and 9 s a step (median 3 s: the slow one shared its CPU), one
    # stopped at step 100 of 300, counted whole (its steps are not committed until it finishes)
    controls = [run("fp32_control", "fp32", 0, seconds=600.0), run("fp32_control", "fp32", 1, seconds=900.0),
                run("fp32_control", "fp32", 3, seconds=2700.0), run("fp32_control", "fp32", 2, steps=100, seconds=900.0)]
    controls[3]["steps_planned"] = 300
    progress = confirmatory.report(controls, REGISTERED, RULES)["progress"]
    assert progress["confirmatory_control"]["seconds_left"] == pytest.approx(3.0 * 9 * 300)
    # a grid with no finished run yet is estimated at every path grid's finished runs: 20 runs x 600 steps
    assert progress["confirmatory_nvfp4_600"]["seconds_left"] == pytest.approx(3.0 * 20 * 600)
    text = confirmatory.markdown(confirmatory.report(controls, REGISTERED, RULES))
    assert f"| confirmatory_control | 12 | 3 | {3.0 * 2700 / 3600:.1f} h |" in text
    # no run that logged its time: nothing to estimate from
    assert confirmatory.report([run("fp32_control", "fp32", 0)], REGISTERED,
                               RULES)["progress"]["confirmatory_control"]["seconds_left"] is None


def test_progress_names_the_machine_kinds_a_grid_was_recorded_on(tmp_path):
    from moerl.analysis.dose import machine_kind

    xeon = "Intel(R) Xeon(R) Processor, AVX512+AMX, torch 2.13.0+cpu, emulated kernels"
    epyc = "AMD EPYC 7B13, AVX2, torch 2.13.0+cpu, emulated kernels"
    controls = [run("fp32_control", "fp32", s, machine=xeon) for s in range(12)]
    text = confirmatory.markdown(confirmatory.report(controls, REGISTERED, RULES))
    assert f"| confirmatory_control | 12 | 12 | none | computed below | {xeon} |" in text
    controls[3]["machine"] = epyc
    progress = confirmatory.report(controls, REGISTERED, RULES)["progress"]["confirmatory_control"]
    assert progress["machines"] == {xeon: 11, epyc: 1}
    assert f"**2 machine kinds**: {xeon} (11); {epyc} (1) |" in confirmatory.markdown(
        confirmatory.report(controls, REGISTERED, RULES))
    # from a run's machine.json; none recorded reads None
    (tmp_path / "machine.json").write_text('{"cpu_model": "AMD EPYC 7B13", "isa_flags": {"avx2": true}, '
                                           '"torch_cpu_capability": "AVX2", "torch_version": "2.13.0+cpu", '
                                           '"rollout_kernels": "emulated"}')
    assert machine_kind(tmp_path) == epyc
    assert machine_kind(tmp_path / "nowhere") is None


def test_regime_rule_against_its_noise():
    rng = np.random.default_rng(0)
    learns = [run("fp32_control", "fp32", s, end=0.55 + 0.10 + rng.normal(0, 0.02)) for s in range(12)]
    out = confirmatory.report(learns, REGISTERED, RULES)["verdicts"]["confirmatory_control"]["regime"]
    assert out["verdict"] == "yes" and out["gain"]["n"] == 12 and out["gain"]["low"] > 0.05
    flat = [run("fp32_control", "fp32", s, end=0.55 + 0.02 + rng.normal(0, 0.02)) for s in range(12)]
    assert confirmatory.report(flat, REGISTERED, RULES)["verdicts"]["confirmatory_control"]["regime"]["verdict"] == "no"
    at = out["power"]
    assert at["effect"] == RULES["control_gain"] and at["threshold"] == 0.05
    # the t rule's power from the seeds' own sd (~0.02 here): a 0.05 lead over 12 seeds is detected almost surely
    assert at["value"] == pytest.approx(confirmatory.power.power_t(0.10, 0.05, np.std(
        [r["pass1_end"] - r["pass1_start"] for r in learns], ddof=1), 12, 0.05))
    assert "power 1.00 at a true +0.100 (true mean gain, the earlier grids' control_gain); reaches 80 %" in \
        confirmatory.markdown(confirmatory.report(learns, REGISTERED, RULES), registered=REGISTERED)
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
    assert 0 < out["r3 helps"]["power"]["value"] <= 1 and out["r3 helps"]["power"]["effect"] == 0.025
    like = out["r3 like_control"]["power"]
    assert like["effect"] == 0.0 and like["threshold"] == -0.05 and like["value"] > 0.99  # sd ~0.014, 12 seeds
    assert out["r3 helps"]["n"] == 12 and out["r3 helps"]["low"] < 0.07 < out["r3 helps"]["high"]
    text = confirmatory.markdown(confirmatory.report(runs, REGISTERED, RULES))
    assert "r3 helps | yes" in text and "tis helps | not tested" in text
    behind = next(line for line in text.splitlines() if line.startswith("| baseline behind control |"))
    assert "power 1.00 at a true +0.025 (the registered smallest effect); reaches 80 %" in behind


def test_a_verdict_is_printed_with_the_bounds_its_rule_reads():
    """The t rules are one-sided at 95 %: the printed bounds are those (the two-sided 90 % interval), so a
    "yes" never sits beside an interval that crosses its threshold. Here the two-sided 95 % interval of
    r3 - baseline reaches below 0 while the one-sided bound clears it."""
    from scipy import stats

    diffs = np.array([0.05, -0.01, 0.04, 0.00, 0.03, -0.02, 0.06, 0.01, 0.02, -0.03, 0.05, 0.02])
    half = lambda q: stats.t.ppf(q, 11) * diffs.std(ddof=1) / np.sqrt(12)  # noqa: E731
    assert diffs.mean() - half(0.975) < 0 < diffs.mean() - half(0.95)  # the case this test is about
    runs = fp8_grid(np.random.default_rng(3), {}, {})
    baseline = {r["seed"]: r["pass1_end"] for r in runs if r["arm"] == "baseline"}
    for r in runs:
        if r["arm"] == "r3":
            r["pass1_end"] = baseline[r["seed"]] + diffs[r["seed"]]
    helps = confirmatory.report(runs, REGISTERED, RULES)["verdicts"]["confirmatory_fp8"]["r3 helps"]
    assert helps["verdict"] == "yes" and helps["one_sided"] == 0.95
    assert helps["low"] == pytest.approx(diffs.mean() - half(0.95)) and helps["low"] > 0
    assert helps["high"] == pytest.approx(diffs.mean() + half(0.95))
    text = confirmatory.markdown(confirmatory.report(runs, REGISTERED, RULES), registered=REGISTERED)
    assert ("| comparison | verdict | mean [one-sided 95 % t bounds] | seeds | p (one-sided) | Holm-adjusted p | "
            "verdict under Holm | notes |") in text
    assert f"| r3 helps | yes | {helps['mean']:+.3f} [{helps['low']:+.3f}, {helps['high']:+.3f}] | 12 |" in text
    assert "helps\" is yes when the lower bound is above 0" in text


def test_a_verdict_below_the_acts_on_floor_keeps_its_ungated_value():
    """TIS that touched too few tokens reads "not tested", yet what the t rule alone says is printed beside it."""
    floor = RULES["acts_on_per_mechanism"]["floor"]
    acts = {"tis": {RULES["acts_on_per_mechanism"]["ratio_tail"]: floor / 4}}
    runs = fp8_grid(np.random.default_rng(1), {"tis": 0.07}, acts)
    tis = confirmatory.report(runs, REGISTERED, RULES)["verdicts"]["confirmatory_fp8"]["tis helps"]
    assert tis["verdict"] == "not tested" and tis["floor_ungated"] == "yes"
    line = next(x for x in confirmatory.markdown(confirmatory.report(runs, REGISTERED, RULES)).splitlines()
                if x.startswith("| tis helps |"))
    assert f"{floor / 4:.3f} in its lowest seed (below the {floor:g} floor: not tested; ungated: yes)" in line


def test_fp8_like_control_needs_a_learning_control():
    """"Trains like the control" means nothing when the control does not learn: gated by its regime, as the
    mechanism grid's verdicts; "helps" compares two arms and is not."""
    rng = np.random.default_rng(1)
    runs = [r for r in fp8_grid(rng, {"r3": 0.07}, {}) if r["arm"] != "fp32_control"]
    runs += [run("fp32_control", "fp32", s, end=0.56 + rng.normal(0, 0.01)) for s in range(12)]  # gains ~0.01
    out = confirmatory.report(runs, REGISTERED, RULES)["verdicts"]
    assert out["confirmatory_control"]["regime"]["verdict"] == "no"
    like = out["confirmatory_fp8"]["r3 like_control"]
    assert like["verdict"] == "not tested" and like["ungated"] == "yes" and like["regime"] == "no"
    assert out["confirmatory_fp8"]["r3 helps"]["verdict"] == "yes"


def test_drift_at_600_steps():
    base = [run("baseline", "nvfp4", s, steps=600, k3_growth=g, end=0.05, collapse=180 + 10 * s)
            for s, g in enumerate([8.0, 12.0, 9.0, 15.0, 10.0])]
    tis_ratio = RULES["acts_on_per_mechanism"]["ratio_tail"]
    arms = [run("tis", "nvfp4", s, steps=600, k3_growth=1.5, acts_on={tis_ratio: 0.05}) for s in range(5)]
    arms += [run("icepop", "nvfp4", s, steps=600, k3_growth=1.05,
                 acts_on={RULES["acts_on_per_mechanism"]["masked"]: 0.1}) for s in range(5)]
    arms += [run("r3_tis", "nvfp4", s, steps=600, k3_growth=g) for s, g in enumerate([1.5, 1.0, 1.3, 1.1, 1.6])]
    controls = [run("fp32_control", "fp32", s, end=0.70) for s in range(12)]
    arms[0]["collapse_step"] = 520  # one TIS seed collapses late: the correction only delayed it there
    result = confirmatory.report(base + arms + controls, REGISTERED, RULES)
    drift = result["verdicts"]["confirmatory_nvfp4_600"]
    assert drift["tis keeps_drifting"]["verdict"] == "yes" and drift["tis keeps_drifting"]["power"]["n"] == 5
    assert drift["icepop keeps_drifting"]["verdict"] == "no"
    assert drift["r3_tis keeps_drifting"]["verdict"] == "inconclusive"
    # the registered-exploratory description beside the verdicts: each arm's collapses and when they came
    rows = {r["arm"]: r for r in result["exploratory"]["confirmatory_nvfp4_600"]}
    assert rows["baseline"]["collapse_steps"] == [180, 190, 200, 210, 220] and rows["tis"]["collapse_steps"] == [520]
    text = confirmatory.markdown(result)
    assert "| tis | nvfp4 | 1 of 5 (520) |" in text and "| icepop | nvfp4 | 0 of 5 |" in text


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
        return "post hoc (regime_t: set by abc1234)" if "regime_t" in rules else ""

    text = confirmatory.markdown(confirmatory.report(runs, REGISTERED, RULES), label=label, registered=REGISTERED)
    assert (("regime_t", "collapse"), "confirmatory_control") in seen
    assert "*post hoc (regime_t: set by abc1234)*" in text and "post hoc*: post hoc" not in text


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



# --- the mechanism grid: where the 4-bit mismatch lives ----------------------------------------------------

MECHANISM = REGISTERED["grids"]["mechanism"]
# rung -> the baseline's collapsed seeds; the r3 arm's collapsed seeds
BASELINE_COLLAPSED = {"nvfp4_experts": {0, 1, 2, 3, 4}, "nvfp4_attention": set(), "int4_experts": {0, 1},
                      "int4_attention": set(), "int4_kimi": {0, 1, 2, 3, 4}}
R3_COLLAPSED = {"nvfp4_experts": set(), "nvfp4_attention": set(), "int4_experts": {0},
                "int4_attention": set(), "int4_kimi": {0, 1, 2, 3, 4}}


def mechanism_grid(rng, *, control_gain=0.15, qat_behind_control=0.01, qat_r3_over_r3=0.10) -> list[dict]:
    """A complete mechanism grid with the confirmatory control (12 seeds, final pass@1 0.55 + control_gain)."""
    control_end = {s: 0.55 + control_gain + rng.normal(0, 0.01) for s in range(12)}
    runs = [run("fp32_control", "fp32", s, end=e) for s, e in control_end.items()]
    for rung in MECHANISM["rungs"]:
        for arm, collapsed in (("baseline", BASELINE_COLLAPSED[rung]), ("r3", R3_COLLAPSED[rung])):
            runs += [run(arm, rung, s, end=0.05 if s in collapsed else 0.62 + rng.normal(0, 0.01),
                         collapse=150 if s in collapsed else None, k3_median=0.02 if arm == "baseline" else 0.01)
                     for s in MECHANISM["seeds"]]
    r3_kimi = {r["seed"]: r["pass1_end"] for r in runs if r["arm"] == "r3" and r["rung"] == "int4_kimi"}
    for s in MECHANISM["seeds"]:
        runs.append(run("qat_int4", "int4_kimi", s, end=control_end[s] - qat_behind_control + rng.normal(0, 0.005)))
        runs.append(run("qat_int4_r3", "int4_kimi", s, end=r3_kimi[s] + qat_r3_over_r3 + rng.normal(0, 0.01)))
        runs.append(run("qat_int4_tis", "int4_kimi", s, end=0.60, k3_median=0.004))
    return runs


def test_no_mechanism_verdict_before_its_last_registered_run():
    runs = mechanism_grid(np.random.default_rng(3))
    last = next(r for r in runs if r["arm"] == "qat_int4_tis" and r["seed"] == 4)
    partial = [r for r in runs if r is not last]
    out = confirmatory.report(partial, REGISTERED, RULES)
    assert {k: v for k, v in out["progress"]["mechanism"].items() if k not in ("machines", "seconds_left")} == {
        "planned": 65, "finished": 64, "started": 64, "complete": False}
    assert "confirmatory_control" in out["verdicts"] and "mechanism" not in out["verdicts"]
    assert out["exploratory"] == {}
    assert "| mechanism | 65 | 64 | — | after the last registered run |" in confirmatory.markdown(out)
    out = confirmatory.report(partial + [last], REGISTERED, RULES)
    assert "mechanism" in out["verdicts"] and out["exploratory"]["mechanism"]
    # the mechanism grid complete but the control not: its exploratory table only, no verdict
    no_control = [r for r in runs if not (r["arm"] == "fp32_control" and r["seed"] == 11)]
    out = confirmatory.report(no_control, REGISTERED, RULES)
    assert out["verdicts"] == {} and len(out["exploratory"]["mechanism"]) == 2 * 5 + 3
    assert "| mechanism | 65 | 65 | none | waits for confirmatory_control |" in confirmatory.markdown(out)


def test_mechanism_comparisons_follow_the_registered_rules():
    out = confirmatory.report(mechanism_grid(np.random.default_rng(4)), REGISTERED, RULES)
    assert out["verdicts"]["confirmatory_control"]["regime"]["verdict"] == "yes"
    mech = out["verdicts"]["mechanism"]
    collapses = {rung: mech[f"baseline collapses at {rung}"]["verdict"] for rung in MECHANISM["rungs"]}
    assert collapses == {"nvfp4_experts": "yes", "nvfp4_attention": "no", "int4_experts": "partly (2 of 5)",
                         "int4_attention": "no", "int4_kimi": "yes"}
    assert mech["baseline collapses at int4_experts"]["collapsed_seeds"] == [0, 1]
    prevents = {rung: mech[f"r3 prevents collapse at {rung}"]["verdict"] for rung in MECHANISM["rungs"]}
    assert prevents == {"nvfp4_experts": "yes", "nvfp4_attention": "not tested", "int4_experts": "partly",
                        "int4_attention": "not tested", "int4_kimi": "no"}
    assert mech["qat_int4 prevents collapse"]["verdict"] == "yes"
    assert mech["qat_int4 prevents collapse"]["baseline_collapsed_seeds"] == [0, 1, 2, 3, 4]
    assert mech["qat_int4 like_control"]["verdict"] == "yes"  # 0.01 below the control: within the 0.05 margin
    assert mech["qat_int4 like_control"]["n"] == 5 and mech["qat_int4 like_control"]["low"] > -0.05
    helps = mech["qat_int4_r3 helps over r3 at int4_kimi"]
    assert helps["verdict"] == "yes" and helps["difference"] == "qat_int4_r3 - r3"
    assert helps["n"] == 5 and 0 < helps["low"] < 0.10 < helps["high"]
    assert 0 < helps["power"]["value"] <= 1
    # every verdict carries its power: an every-seed rule's is q ** n at the assumed per-seed chances
    assert all(v.get("power") for v in mech.values())
    assert mech["baseline collapses at int4_experts"]["power"]["every_seed"] == {0.9: pytest.approx(0.9 ** 5),
                                                                               0.95: pytest.approx(0.95 ** 5)}
    assert mech["qat_int4 like_control"]["power"]["effect"] == 0.0
    assert not any("ungated" in v for v in mech.values())  # the regime holds: nothing gated
    far = confirmatory.report(mechanism_grid(np.random.default_rng(4), qat_behind_control=0.15), REGISTERED, RULES)
    assert far["verdicts"]["mechanism"]["qat_int4 like_control"]["verdict"] == "no"  # 0.15 below the control
    rows = {(r["arm"], r["rung"]): r for r in out["exploratory"]["mechanism"]}
    assert set(rows) == {(a, r) for a, r, _ in confirmatory.path_grids(REGISTERED)["mechanism"].planned()}
    assert rows[("baseline", "int4_experts")]["collapsed"] == 2 and rows[("baseline", "int4_experts")]["n"] == 5
    assert rows[("qat_int4_tis", "int4_kimi")]["pass1_end"]["mean"] == pytest.approx(0.60)
    assert rows[("qat_int4_tis", "int4_kimi")]["k3_median"] == pytest.approx(0.004)


def test_mechanism_verdicts_need_a_learning_control():
    out = confirmatory.report(mechanism_grid(np.random.default_rng(5), control_gain=0.0), REGISTERED, RULES)
    assert out["verdicts"]["confirmatory_control"]["regime"]["verdict"] == "no"
    mech = out["verdicts"]["mechanism"]
    for name, ungated in (("baseline collapses at nvfp4_experts", "yes"),
                          ("r3 prevents collapse at int4_experts", "partly"),
                          ("qat_int4 prevents collapse", "yes"), ("qat_int4 like_control", "yes")):
        assert mech[name]["verdict"] == "not tested" and mech[name]["ungated"] == ungated, name
        assert mech[name]["regime"] == "no"
    # "helps" compares two arms with each other: no learning control needed
    assert mech["qat_int4_r3 helps over r3 at int4_kimi"]["verdict"] == "yes"
    text = confirmatory.markdown(out)
    # raw p (5 of 5 seeds under a fair coin: 1/32) and the family's Holm p beside the gated verdict
    assert re.search(re.escape("| baseline collapses at nvfp4_experts | not tested | — | 5 | 0.0312 | ") + r"[\d.e-]+ \(of 13\)"
                     + re.escape(" | not tested | collapsed seeds [0, 1, 2, 3, 4]; gated: the control's regime verdict is "
                                 "no (ungated: yes); power (every seed of 5) 0.59 at a per-seed chance of 0.9, 0.77 at a "
                                 "per-seed chance of 0.95; below 80 % |"), text)


def test_mechanism_markdown_with_its_post_hoc_labels():
    out = confirmatory.report(mechanism_grid(np.random.default_rng(6)), REGISTERED, RULES)
    seen = []

    def label(rules, grid):
        seen.append((tuple(rules), grid))
        return "post hoc (collapse: set by abc1234)" if grid == "mechanism" and "collapse" in rules else ""

    text = confirmatory.markdown(out, label=label, registered=REGISTERED)
    assert "**mechanism**" in text
    assert re.search(re.escape("| baseline collapses at int4_experts | partly (2 of 5) | — | 5 | 0.812 | ") + r"[\d.e-]+ \(of 13\)"
                     + re.escape(" | partly (2 of 5) | collapsed seeds [0, 1]; power (every seed of 5) 0.59 at a per-seed "
                                 "chance of 0.9, 0.77 at a per-seed chance of 0.95; below 80 %; *post hoc (collapse: set "
                                 "by abc1234)* |"), text)
    assert "| qat_int4_r3 helps over r3 at int4_kimi | yes | +0.1" in text
    # each kind of verdict is labelled under every rule it is computed with
    assert (("collapse", "regime_t"), "mechanism") in seen and (("helps_t",), "mechanism") in seen
    assert (("like_control_t", "regime_t", "collapse"), "mechanism") in seen
    assert (("prevents_collapse_seeds", "collapse", "regime_t"), "mechanism") in seen
    assert "**mechanism — exploratory** (no verdict" in text
    assert "| baseline | int4_experts | 2 of 5 (150, 150) |" in text and "| qat_int4_tis | int4_kimi | 0 of 5 | 0.600" in text


def test_a_mechanism_comparison_the_grid_cannot_judge_is_one_clear_error():
    runs = mechanism_grid(np.random.default_rng(7))
    for bad, says in (("qat_int4 is better", "is not"), ("qat_int4 collapses at nvfp4_experts", "names no rung"),
                      ("r3 like_control", "names no rung"), ("qat_int4 helps over r3 at nvfp4_experts", "no rung"),
                      ("r3 helps over qat_int4 at nvfp4_experts", "share \\['int4_kimi'\\]"),
                      ("r3 helps over fp32_control at each rung", "share no rung")):
        rules = {**RULES, "confirmatory_comparisons": {**RULES["confirmatory_comparisons"], "mechanism": [bad]}}
        with pytest.raises(ValueError, match="experiments/07_dose_threshold/analysis.yaml: "
                                             f"rules.confirmatory_comparisons.mechanism: .*{says}"):
            confirmatory.report(runs, REGISTERED, rules)


# --- the registered grids' figures: none while a grid is sealed, then one question each --------------------

def test_the_mechanism_figure_waits_for_the_grid_then_draws_every_cell(tmp_path):
    from moerl.analysis import registered_figures

    runs = mechanism_grid(np.random.default_rng(5))
    assert registered_figures.mechanism_figure(runs[:-1], tmp_path / "partial.png") is None
    assert not (tmp_path / "partial.png").exists()
    drawn = registered_figures.mechanism_figure(runs, tmp_path / "mechanism.png")
    assert drawn is not None and drawn.stat().st_size > 10_000
    spec = confirmatory.path_grids(REGISTERED)["mechanism"]
    verdicts = confirmatory.report(runs, REGISTERED, RULES)["verdicts"]["mechanism"]
    # every verdict is drawn at the (arm, rung) it is about, and every such cell is one the grid ran
    cells = {registered_figures._mechanism_rung(name, spec) for name in verdicts}
    assert ("qat_int4", "int4_kimi") in cells and ("baseline", "nvfp4_attention") in cells
    assert all(rung in spec.only.get(arm, spec.rungs) for arm, rung in cells)


def test_the_drift_figure_waits_for_the_grid_then_draws_each_arm(tmp_path):
    import json

    from moerl.analysis import registered_figures

    spec = confirmatory.path_grids(REGISTERED)["confirmatory_nvfp4_600"]
    rng = np.random.default_rng(6)
    runs = [run("fp32_control", "fp32", s, end=0.72 + rng.normal(0, 0.01)) for s in range(12)]
    for arm in spec.arms:
        growth = 12.0 if arm == "baseline" else 1.4
        k3 = np.geomspace(0.01, 0.01 * growth, spec.steps)
        metrics = tmp_path / arm / "metrics.jsonl"
        metrics.parent.mkdir()
        rows = [{"step": i + 1, "mismatch/k3": float(v)} for i, v in enumerate(k3)]
        rows += [{"step": step, "eval/pass1": 0.55 + (0.05 if arm != "baseline" else -0.25) * step / spec.steps}
                 for step in range(0, spec.steps + 1, 50)]
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs += [run(arm, "nvfp4", s, steps=spec.steps, run_dir=str(metrics.parent), k3_growth=growth,
                     collapse=400 if arm == "baseline" else None,
                     acts_on={"is/outside_band_frac": 0.05, "mask/token_frac": 0.05, "routing/any_layer_differs": 0.3})
                 for s in spec.seeds]
    assert registered_figures.drift_figure(runs[:-1], tmp_path / "partial.png") is None
    verdicts = confirmatory.report(runs, REGISTERED, RULES)["verdicts"]["confirmatory_nvfp4_600"]
    assert {v["verdict"] for v in verdicts.values()} == {"yes"}  # 1.4x > 1.2 in every seed: still drifting
    drawn = registered_figures.drift_figure(runs, tmp_path / "drift.png")
    assert drawn is not None and drawn.stat().st_size > 10_000


def test_rolling_median_trails_and_ignores_a_spike():
    from moerl.analysis.registered_figures import rolling_median

    values = np.array([1.0, 1.0, 100.0, 1.0, 1.0])
    assert rolling_median(values, window=3).tolist() == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert rolling_median(np.array([1.0, 3.0, 5.0]), window=2).tolist() == [1.0, 2.0, 4.0]


@pytest.mark.parametrize("grid, kinds", [("confirmatory_control", ["regime"]),
                                         ("confirmatory_fp8", ["behind", "like_control_gated", "helps"]),
                                         ("confirmatory_nvfp4_600", ["keeps_drifting"]),
                                         ("mechanism", ["collapses", "prevents_collapse", "like_control_gated",
                                                        "helps_over"])])
def test_every_rule_a_grids_verdicts_use_is_registered_for_that_grid(grid, kinds):
    """A rule a verdict is computed under but whose ``grids`` omit the verdict's grid would escape the post-hoc
    label there: a later change of its value would go unmarked."""
    missing = [(kind, rule) for kind in kinds for rule in confirmatory.RULES_USED[kind]
               if grid not in REGISTERED["rules"][rule]["grids"]]
    assert missing == []
