"""The facts experiment 07's README prose cites: computed from runs, never typed."""
import json

import pytest
import yaml

from moerl.analysis import dose_facts as facts
from moerl.analysis.dose import load_runs


def write_run(root, arm, rung, seed, pass1_end, k3_start=0.01, k3_end=0.01, collapse=False, steps=120,
              outside=(0.01, 0.01), effective=(0.99, 0.99), eval_samples=4):
    name = arm if rung in ("bf16", "fp32") else f"{arm}+rollout.dtype={rung}"
    run = root / "07_dose_threshold" / name / f"seed{seed}"
    run.mkdir(parents=True)
    cfg = {"arm": arm, "seed": seed, "rollout": {"dtype": rung},
           "trainer": {"steps": steps, "eval_samples": eval_samples, "eval_size": 256}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"step": 0, "eval/pass1": 0.5, "eval/greedy": 0.8}]
    for i in range(steps):
        late = i >= steps // 2
        rows.append({"step": i + 1, "reward/mean": 0.02 if collapse and late else 0.5,
                     "mismatch/k3": k3_end if late else k3_start, "grad_norm": 50.0 if collapse else 0.5,
                     "effective/token_frac": effective[late], "routing/any_layer_differs": 0.0,
                     "is/truncated_frac": 0.001, "is/above_frac": 0.0, "is/below_frac": outside[late]})
    rows.append({"step": steps, "eval/pass1": pass1_end, "eval/greedy": 0.82})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_calibration_table_bolds_the_chosen_length_and_shows_the_saturated_one():
    table = {350: {"pass1": 0.2, "greedy": 0.3, "entropy_per_token": 0.17, "answer_tokens": 28.7, "in_regime": False,
                   "pass1_at_temperature": {"0.8": 0.24, "0.6": 0.27}},
             375: {"pass1": 0.56, "greedy": 0.84, "entropy_per_token": 0.11, "answer_tokens": 28.8, "in_regime": False,
                   "pass1_at_temperature": {"0.8": 0.72, "0.6": 0.75}}}
    lines = facts.calibration_lines(table, chosen=375, saturated=(600, {"pass1": 0.93, "greedy": 1.0}))
    assert lines[3].startswith("| **375** | **0.560** | **0.720 / 0.750** |")
    assert lines[2].startswith("| 350 | 0.200 |") and lines[-1].startswith("| 600 (experiment 05) | 0.930 |")
    summary = facts.calibration_summary(table, 375)
    assert "0.010 above the band" in summary and "350 steps +0.07, 375 steps +0.19" in summary
    assert "0.050 below the band" in facts.calibration_summary(table, 350)


def test_control_facts_count_the_shortfall_in_completions(tmp_path):
    # 1,024 completions: +0.0986 is 101 more correct where ceil(0.10 * 1024) = 103 were needed
    write_run(tmp_path, "fp32_control", "fp32", 0, 0.5 + 0.1064)
    write_run(tmp_path, "fp32_control", "fp32", 1, 0.5 + 101 / 1024)
    text = facts.control_facts(load_runs(tmp_path))
    assert "gains +0.106, +0.099" in text and "greedy 0.800 → 0.82" in text
    assert "Seed 1 gains 0.0986: 101 more correct completions of 1,024, where 103 were needed." in text
    assert "Seed 0 gains" not in text


def test_grid_facts_read_the_tail_and_the_drift_from_the_runs(tmp_path):
    for seed in (0, 1):
        write_run(tmp_path, "fp32_control", "fp32", seed, 0.6)
        write_run(tmp_path, "baseline", "nvfp4", seed, 0.05, k3_start=0.01, k3_end=0.12, collapse=True,
                  outside=(0.012, 0.06))
        write_run(tmp_path, "tis", "nvfp4", seed, 0.55, outside=(0.012, 0.012))
        write_run(tmp_path, "r3", "nvfp4", seed, 0.2, k3_start=0.003, k3_end=0.003)
    text = facts.grid_facts(load_runs(tmp_path), "nvfp4")
    baseline = text.splitlines()[0]
    assert "k3 late / early 50 steps 12.0×" in baseline and "1.2 % → 6.0 %, 1.2 % → 6.0 %" in baseline
    assert "tis: share of tokens with ρ outside [1/2, 2], first → last 50 steps: 1.2 % → 1.2 %" in text
    # R3's k3 against the baseline's: 0.003 / median(0.01 ... 0.12) over the whole run, 0.3 before the collapse
    assert "over the steps before the baseline's collapse: 0.30×" in text
    assert "tis − r3, mean final gain over seeds: +0.350" in text
    assert facts.grid_facts(load_runs(tmp_path), "fp8") == "The main grid at fp8 has not run yet."


def test_weight_errors_order_the_formats_as_the_ladder_does():
    errors = facts.weight_errors()
    assert errors["bf16"] < errors["int8"] < errors["fp8"] < min(errors["nvfp4"], errors["int4"])
    assert facts.weight_error_line().startswith("Relative weight error on a seeded Gaussian 64 × 256 matrix: bf16 0.167 %")


@pytest.mark.parametrize("shortfall", [False, True])
def test_ladder_facts_name_the_collapsed_rungs_and_the_threshold_rungs_k3_growth(tmp_path, shortfall):
    write_run(tmp_path, "fp32_control", "fp32", 0, 0.6 if not shortfall else 0.59)
    write_run(tmp_path, "baseline", "bf16", 0, 0.58)
    write_run(tmp_path, "baseline", "nvfp4", 0, 0.02, k3_start=0.02, k3_end=0.2, collapse=True)
    text = facts.ladder_facts(load_runs(tmp_path))
    assert "collapsed (seed 0): nvfp4: held-out pass@1 0.500 → 0.020" in text
    assert "25-step median k3 2.0e-02 at the start" in text and "2.0e-01 at the end (10×)" in text
    assert "no collapse: bf16 gains +0.080" in text


def test_drift_facts_split_the_600_step_runs_at_their_midpoint(tmp_path):
    from moerl.analysis import confirmatory, registration

    registered = registration.load(registration.analysis_path("07_dose_threshold"))
    path = {registered["rollout_path"]["key"]: registered["rollout_path"]["value"]}
    spec = confirmatory.path_grids(registered)["confirmatory_nvfp4_600"]

    def run(arm, rung, seed, steps, end, run_dir=None, collapse=None):
        return {"arm": arm, "rung": rung, "seed": seed, "steps": steps, "steps_planned": steps,
                "eval_completions": 2048, "path": dict(path), "pass1_start": 0.55, "pass1_end": end,
                "collapse_step": collapse, "acts_on": {}, "run_dir": run_dir,
                "k3_growth": 20.0 if arm == "baseline" else 2.0}  # as the rows below give

    runs = [run("fp32_control", "fp32", s, 300, 0.65) for s in range(12)]
    assert facts.drift_facts(runs, registered).startswith("The 600-step grid's facts are written once")
    for arm in spec.arms:
        # k3 doubles after the first 50 steps; in the second half the baseline's grows tenfold, the others' holds
        late = 0.2 if arm == "baseline" else 0.02
        for seed in spec.seeds:
            k3 = [0.01] * 50 + [0.02] * 250 + [late] * 300
            end = 0.05 if arm == "baseline" else 0.62 + 0.01 * seed
            rows = [{"step": 0, "eval/pass1": 0.55}]
            rows += [{"step": i + 1, "reward/mean": 0.5, "mismatch/k3": v} for i, v in enumerate(k3)]
            rows += [{"step": 300, "eval/pass1": 0.60}, {"step": 600, "eval/pass1": end}]
            d = tmp_path / arm / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            runs.append(run(arm, "nvfp4", seed, 600, end, str(d), 350 if arm == "baseline" else None))
    lines = facts.drift_facts(runs, registered).splitlines()
    assert lines[0] == "- the confirmatory control (300 steps) ends at held-out pass@1 0.650 (mean of 12 seeds)"
    baseline = next(line for line in lines if line.startswith("- baseline"))
    assert ("late / early 50 steps k3 (the drift rule's measure) 20.00×; k3 over steps 251–300 ÷ the first 50: "
            "2.00×; the last 50 ÷ steps 251–300: 10.00×; collapse steps [350, 350, 350, 350, 350]") in baseline
    assert "at step 300 0.600, at step 600 0.050" in baseline and "change -0.550 [-0.550, -0.550]" in baseline
    tis = next(line for line in lines if line.startswith("- tis"))
    # the seeds end 0.62-0.66: the change from step 300 is +0.04 on average, its t interval from their spread
    assert "the last 50 ÷ steps 251–300: 1.00×; collapse steps none" in tis and "change +0.040 [+0.020, +0.060]" in tis
