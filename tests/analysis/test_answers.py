"""A notebook's closing answer is computed from its runs: change the runs and the answer changes."""
from __future__ import annotations

import pandas as pd
import pytest

from moerl.analysis import answers


def _train(k3: dict[str, list[float]], steps: int = 4) -> pd.DataFrame:
    rows = []
    for arm, per_seed in k3.items():
        for seed, value in enumerate(per_seed):
            for step in range(1, steps + 1):
                rows.append({"arm": arm, "seed": seed, "step": step, "reward/mean": 0.5, "mismatch/k3": value})
    return pd.DataFrame(rows)


def test_mismatch_answer_sorts_arms_by_where_every_seed_falls():
    train = _train({"baseline": [1e-3, 2e-3], "r3": [5e-4, 1e-3], "tis": [2e-3, 4e-3], "mis": [8e-4, 3e-3],
                    "fp32_rollout": [1e-12, 1e-12]})
    refs = {a: "baseline" for a in ("baseline", "r3", "tis", "mis", "fp32_rollout")}
    text = answers.mismatch(train, refs)
    assert "every seed: r3 0.5× baseline" in text
    assert "Higher on every seed: tis 2× baseline" in text
    assert "not told apart from the baseline): mis" in text
    assert "numerical floor (no rollout mismatch): fp32_rollout" in text
    flipped = answers.mismatch(_train({"baseline": [1e-3, 2e-3], "r3": [2e-3, 4e-3]}), {"r3": "baseline"})
    assert "Higher on every seed: r3" in flipped and "Lower than its family baseline on every seed: none" in flipped
    assert "nothing to compare" in answers.mismatch(train, {})


def test_run_names_with_overrides_are_paired_with_the_baseline_at_the_same_rung():
    from moerl.analysis.results import family_references

    runs = pd.DataFrame({"arm": ["baseline+rollout.dtype=fp8", "baseline+rollout.dtype=int4", "tis+rollout.dtype=fp8",
                                 "fp32_control"], "cfg/preset": ["qwen3_moe"] * 4})
    refs = family_references(runs)
    assert refs["tis+rollout.dtype=fp8"] == "baseline+rollout.dtype=fp8" and "fp32_control" not in refs
    renamed = runs.assign(arm=runs["arm"].str.replace("=", "-"))  # the newer spelling: key-value
    assert family_references(renamed)["tis+rollout.dtype-fp8"] == "baseline+rollout.dtype-fp8"


def test_touched_and_routing_answers_follow_the_data():
    train = _train({"baseline": [1e-3], "mis": [1e-3]})
    train["mask/token_frac"] = train["arm"].map({"baseline": 0.0, "mis": 0.04})
    train["effective/token_frac"] = 1 - train["mask/token_frac"]
    text = answers.touched(train)
    assert "masked (MIS/IcePop): mis 4.0 %" in text and "keeping a gradient: mis 96.0 %" in text
    for layer, share in enumerate((0.01, 0.02, 0.03)):
        train[f"routing/agreement/layer{layer}"] = 1 - share * train["arm"].map({"baseline": 1.0, "mis": 0.0})
    text = answers.routing(train)
    assert "rises with depth (rank correlation > 0.5) in 1 of 1 arms: baseline 1.0 % (layer 0) → 3.0 % (layer 2)" in text


def test_dose_answer_names_the_threshold_from_the_runs():
    def run(arm, rung, seed, collapse, end, start=0.3):
        return {"arm": arm, "rung": rung, "seed": seed, "collapse_step": collapse, "pass1_start": start,
                "pass1_end": end, "k3_median": {"fp32": 0.0, "bf16": 1e-3, "nvfp4": 1e-1}[rung]}

    runs = [run("fp32_control", "fp32", 0, None, 0.6), run("baseline", "bf16", 0, None, 0.55),
            run("baseline", "nvfp4", 0, 120, 0.05), run("tis", "nvfp4", 0, None, 0.58)]
    text = answers.dose_ladder(runs)
    assert "first collapses at rollout nvfp4" in text and "tis -0.020 (n=1)" in text
    registered = {"confirmatory_fp8": {"r3 like_control": {"verdict": "inconclusive"}, "r3 helps": {"verdict": "yes"}}}
    assert text.endswith("(n=1).")  # no registered grid complete: nothing said of one
    assert answers.dose_ladder(runs, registered).endswith(
        "Registered grid confirmatory_fp8: r3 like_control inconclusive; r3 helps yes.")
    runs[2]["collapse_step"] = None
    assert "no threshold" in answers.dose_ladder(runs)


@pytest.mark.parametrize("bad", ["geometry", "summaries", "configs", "metrics"])
def test_a_loader_that_finds_nothing_names_where_it_looked(tmp_path, bad):
    from moerl.analysis.geometry_report import load_points
    from moerl.analysis.results import MissingRunError, load_arm_configs, load_metrics, load_summaries

    run = tmp_path / "exp" / "arm" / "seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')  # no summary.json, no config.yaml
    call = {"geometry": lambda: load_points(tmp_path), "summaries": lambda: load_summaries(tmp_path, "exp"),
            "configs": lambda: load_arm_configs(tmp_path, "exp"), "metrics": lambda: load_metrics(tmp_path, "other")}[bad]
    with pytest.raises(FileNotFoundError, match=str(tmp_path)) as err:
        call()
    assert bad == "geometry" or isinstance(err.value, MissingRunError)


def test_results_root_names_every_place_it_looked(tmp_path, monkeypatch):
    from moerl.analysis.results import MissingRunError, results_root

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOERL_X", "no/such/runs")
    with pytest.raises(MissingRunError, match=rf"{tmp_path}/no/such/runs does not exist, nor does .*/no/such/runs \(set \$MOERL_X"):
        results_root("MOERL_X")


@pytest.mark.parametrize("written", ["baseline+rollout.dtype=nvfp4_experts+trainer.eval_samples=8",
                                     "baseline+rollout.dtype-nvfp4_experts+trainer.eval_samples-8",
                                     "baseline+rollout.dtype=nvfp4_experts,trainer.eval_samples=8"])
def test_a_run_is_found_under_every_spelling_of_its_overrides(written):
    """A sweep records ``arm+key-value+key-value``; a user types the overrides with '=' (as on run.py's
    command line, joined by '+' or ','): every spelling names the recorded directory."""
    from moerl.analysis.results import run_names

    assert "baseline+rollout.dtype-nvfp4_experts+trainer.eval_samples-8" in run_names(written, "07_dose_threshold")


def test_geometry_answer_states_the_widest_gpu_point_against_the_paper():
    preds = pd.DataFrame([{"model": "Qwen3-30B-A3B", "L": 48, "E": 128, "k": 8, "H": 2048, "measured_share": 0.997,
                           "sft_real_share": 0.57}])
    gpu = pd.DataFrame([{"device": "NVIDIA H200", "L": 48, "E": 128, "k": 8, "H": h, "share": s, "share_lo": s - 0.01,
                         "share_hi": s + 0.01} for h, s in ((256, 0.72), (2048, 0.738))])
    text = answers.geometry(preds, 0.94, gpu)
    assert ("Measured on NVIDIA H200 with trained routers at Qwen3-30B-A3B's real width (hidden 2048): "
            "73.8 % [72.8 %, 74.8 %], below the paper's 94.0 %.") in text
    # with two SFT lengths at the widest width, the answer takes the longer one (the CPU ladder's recipe)
    longer = pd.concat([gpu.assign(sft_steps=100), pd.DataFrame([{**gpu.iloc[1].to_dict(), "share": 0.748,
                                                                  "share_lo": 0.738, "share_hi": 0.758, "sft_steps": 400}])])
    assert ("Measured on NVIDIA H200 with trained routers (400-step SFT) at Qwen3-30B-A3B's real width "
            "(hidden 2048): 74.8 % [73.8 %, 75.8 %]") in answers.geometry(preds, 0.94, longer)
    assert "Measured on" not in answers.geometry(preds, 0.94)  # no GPU points: nothing said of them
    assert "at or above the paper's" in answers.geometry(preds, 0.7, gpu)
