"""scripts/check_reproducible.py: what counts as the trajectory (exact) and what as float statistics."""
from __future__ import annotations

from tests_helpers import REPO, load_script

check = load_script("scripts/check_reproducible.py", "check_reproducible")

RECORDED = [{"step": 0, "eval/pass1": 0.35},
            {"step": 1, "reward/mean": 0.3, "mismatch/k3": 1e-13, "loss/policy": 0.5, "time/step": 1.0},
            {"step": 2, "reward/mean": 0.4, "mismatch/k3": 2e-13, "loss/policy": 0.6, "time/step": 1.0}]


def test_identical_runs_and_wall_clock_are_not_differences():
    fresh = [dict(r) for r in RECORDED]
    fresh[1]["time/step"] = 9.0
    fresh[2]["new/metric"] = 1.0  # a metric only the newer code logs
    assert check.compare(RECORDED, fresh) == []


def test_trajectory_and_float_differences_are_told_apart():
    fresh = [dict(r) for r in RECORDED]
    fresh[1]["mismatch/k3"] = 3e-13
    fresh[1]["loss/policy"] = 0.5000001
    diffs = check.compare(RECORDED, fresh)
    assert len(diffs) == 2 and not any(check.is_trajectory(d.split("'")[1]) for d in diffs)
    rel, rel_key, absolute, abs_key = check.float_deviation(RECORDED, fresh, None)
    assert rel_key == "loss/policy" and abs(rel - 2e-7) < 1e-9 and abs_key == "mismatch/k3" and absolute > 1e-13
    fresh[2]["reward/mean"] = 0.41
    assert any(check.is_trajectory(d.split("'")[1]) and "step 2" in d for d in check.compare(RECORDED, fresh))


def test_a_missing_row_or_key_is_a_difference_and_max_step_limits_the_rows():
    fresh = [dict(RECORDED[0]), {k: v for k, v in RECORDED[1].items() if k != "loss/policy"}]
    diffs = check.compare(RECORDED, fresh)
    assert any("'loss/policy'" in d and "not logged" in d for d in diffs)
    assert any(d.startswith("step 2 (train): recorded, not logged") for d in diffs)
    assert not any(d.startswith("step 2") for d in check.compare(RECORDED, fresh, max_step=1))


def test_keys_added_since_a_recording_are_rerun_as_recorded():
    """A run recorded before rollout.kernels existed ran the native kernels; one that names its kernels
    is re-run with them, whatever today's default is."""
    old = check.recorded_settings({"rollout": {"dtype": "bf16"}, "trainer": {"steps": 60}})
    assert "rollout.kernels=native" in old and "trainer.eval_precision=rollout" in old
    new = check.recorded_settings({"rollout": {"kernels": "emulated"}, "trainer": {"eval_precision": "fp32"}})
    assert "rollout.kernels=emulated" in new and "trainer.eval_precision=fp32" in new


def test_a_renamed_metric_is_compared_under_its_current_name():
    recorded = [dict(r) for r in RECORDED]
    recorded[1]["reward/group_solved_frac"] = 0.75  # the name experiment 00's first recordings used
    fresh = [dict(r) for r in RECORDED]
    fresh[1]["reward/mixed_group_frac"] = 0.75
    assert check.compare(recorded, fresh) == []
    fresh[1]["reward/mixed_group_frac"] = 0.5
    assert check.compare(recorded, fresh) == ["step 1 (train): 'reward/mixed_group_frac' recorded 0.75, now 0.5"]


def test_check_other_cpu_refuses_an_unknown_part_before_running_anything(tmp_path):
    import subprocess

    script = REPO / "scripts" / "check_other_cpu.sh"
    proc = subprocess.run(["bash", str(script), "--only", "everything"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--only takes reproduce or speed, not 'everything'" in proc.stderr


RECORDING_MACHINE = {"cpu_model": "Intel(R) Xeon(R) Processor", "torch_cpu_capability": "AVX512",
                     "isa_flags": {"avx512f": True, "avx512_bf16": True, "amx_bf16": True, "amx_tile": True,
                                   "avx2": True}, "onednn_max_cpu_isa": None, "torch_threads": 1}
# What an AMD EPYC without bf16 instructions records: the "other CPU kind", simulated by its machine record.
AVX2_MACHINE = {"cpu_model": "AMD EPYC 7B13 64-Core Processor", "torch_cpu_capability": "AVX2",
                "isa_flags": {"avx512f": False, "avx512_bf16": False, "amx_bf16": False, "amx_tile": False,
                              "avx2": True}, "onednn_max_cpu_isa": None, "torch_threads": 1}


def _write_run(path, rows, threads, machine=RECORDING_MACHINE):
    import json

    import yaml

    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "config.yaml").write_text(yaml.safe_dump({"arm": "fp32_rollout", "threads": threads}))
    if machine is not None:
        (path / "machine.json").write_text(json.dumps(machine))


def test_an_existing_run_is_compared_without_rerunning_and_a_thread_count_change_is_named(tmp_path, capsys):
    recorded = tmp_path / "recorded" / "00_tiny_moe_cpu" / "fp32_rollout" / "seed0"
    _write_run(recorded, RECORDED, threads=1)
    same = tmp_path / "same"
    _write_run(same, [{**r, "time/step": 7.0} if "time/step" in r else r for r in RECORDED], threads=1)
    argv = ["--arm", "fp32_rollout", "--steps", "0", "--recorded", str(tmp_path / "recorded"),
            "--experiment", str(REPO / "experiments" / "00_tiny_moe_cpu")]
    assert check.main([*argv, "--run", str(same)]) == 0
    out = capsys.readouterr().out
    assert "check applied: bitwise (same CPU kind as the recording)" in out
    assert "reproduced bit for bit: 3 recorded rows" in out
    other = tmp_path / "two_threads"
    _write_run(other, [RECORDED[0], RECORDED[1], {**RECORDED[2], "reward/mean": 0.45}], threads=2)
    assert check.main([*argv, "--run", str(other)]) == 1
    out = capsys.readouterr().out
    assert "ran on 2 thread(s), the recorded run on 1" in out and "NOT reproduced (the trajectory differs)" in out


def _trajectory(seed: int, reward_shift: float = 0.0, steps: int = 20) -> list[dict]:
    """A run whose values wobble from seed to seed like recorded seeds do."""
    import random

    rnd = random.Random(seed)
    rows = [{"step": 0, "eval/pass1": 0.35}]
    for step in range(1, steps + 1):
        rows.append({"step": step, "reward/mean": 0.35 + 0.002 * step + reward_shift + rnd.uniform(-0.02, 0.02),
                     "mismatch/k3": 4e-4 * (1 + rnd.uniform(-0.1, 0.1)),
                     "routing/agreement": 0.983 + rnd.uniform(-0.002, 0.002), "time/step": 1.0})
        if step % 10 == 0:  # a held-out evaluation logs in its step's row
            rows[-1]["eval/pass1"] = 0.36 + reward_shift + rnd.uniform(-0.01, 0.01)
    return rows


def _recorded_seeds(tmp_path, n=3):
    root = tmp_path / "recorded" / "00_tiny_moe_cpu" / "baseline"
    for seed in range(n):
        _write_run(root / f"seed{seed}", _trajectory(seed), threads=1)
    return ["--arm", "baseline", "--steps", "0", "--recorded", str(tmp_path / "recorded"),
            "--experiment", str(REPO / "experiments" / "00_tiny_moe_cpu")]


def test_another_cpu_kind_gets_the_statistical_check_and_passes_inside_the_seeds_spread(tmp_path, capsys):
    """On an AVX2-only CPU the trajectory departs from the recording (here: a new seed's wobble), which the
    bitwise check calls a failure; the statistical check judges it against the recorded seeds."""
    argv = _recorded_seeds(tmp_path)
    other = tmp_path / "epyc"
    _write_run(other, _trajectory(7), threads=1, machine=AVX2_MACHINE)
    assert check.main([*argv, "--run", str(other)]) == 0
    out = capsys.readouterr().out
    assert "check applied: statistical (another CPU kind than the recording (cpu_model: recorded" in out
    assert "reproduced statistically: all 6 judged quantities" in out
    assert "not judged, for information: the trajectory departs from" in out and "at step 1 (train)" in out
    assert check.main([*argv, "--run", str(other), "--check", "bitwise"]) == 1
    assert "NOT reproduced (the trajectory differs)" in capsys.readouterr().out


def test_the_statistical_check_fails_a_shifted_run_and_cannot_judge_one_seed(tmp_path, capsys):
    argv = _recorded_seeds(tmp_path)
    shifted = tmp_path / "shifted"
    _write_run(shifted, _trajectory(7, reward_shift=0.1), threads=1, machine=AVX2_MACHINE)
    assert check.main([*argv, "--run", str(shifted)]) == 1
    out = capsys.readouterr().out
    assert "NOT reproduced statistically: reward, first half, reward, second half" in out
    assert "OUTSIDE the seeds' interval" in out
    lonely = tmp_path / "one_seed"
    argv_one = _recorded_seeds(lonely, n=1)
    assert check.main([*argv_one, "--run", str(shifted)]) == 2
    assert "CANNOT JUDGE statistically" in capsys.readouterr().out


def test_a_recording_without_a_machine_record_is_judged_statistically(tmp_path, capsys):
    argv = _recorded_seeds(tmp_path)
    (tmp_path / "recorded" / "00_tiny_moe_cpu" / "baseline" / "seed0" / "machine.json").unlink()
    same = tmp_path / "same"
    _write_run(same, _trajectory(0), threads=1)
    assert check.main([*argv, "--run", str(same)]) == 0
    assert "check applied: statistical (another CPU kind than the recording (the recorded run has no machine.json))" \
        in capsys.readouterr().out


def test_the_onednn_isa_cap_makes_another_kind():
    from moerl.analysis.reproduction import kind_difference

    assert kind_difference(RECORDING_MACHINE, dict(RECORDING_MACHINE, torch_threads=2)) == []
    capped = dict(RECORDING_MACHINE, onednn_max_cpu_isa="AVX2")
    assert kind_difference(RECORDING_MACHINE, capped) == ["onednn_max_cpu_isa: recorded None, here 'AVX2'"]


def test_the_prediction_interval_is_the_t_interval_of_one_more_seed():
    from moerl.analysis.reproduction import prediction_interval

    low, high = prediction_interval([1.0, 2.0, 3.0])
    # mean 2, sd 1, t(0.995, 2) = 9.925, sqrt(1 + 1/3) = 1.1547
    assert abs(high - 2 - 9.925 * 1.1547) < 1e-2 and abs((low + high) / 2 - 2) < 1e-12
