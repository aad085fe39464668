"""Arms renamed for their estimator and band (moerl.config.RENAMED_ARMS): the former name still loads
everywhere a user or a recorded run uses it -- arm files on the command line, launchers, sweeps, run
directories and their config.yaml, the registered analyses -- and resolves to the same arm."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from moerl.config import (RENAMED_ARMS, ConfigError, config_diff, config_hash, config_hashes, config_yaml,
                          current_arm, former_arms, identity_dict, load_config, to_dict)
from tests_helpers import load_script

REPO = Path(__file__).resolve().parents[1]
# The CPU experiments' arms (moerl configs); a cluster experiment's former names compose through verl
# (tests/verl_ext/test_compose.py).
RENAMES = [(exp, old, new) for exp, table in RENAMED_ARMS.items() for old, new in table.items()
           if "verl" not in yaml.safe_load((REPO / "experiments" / exp / "base.yaml").read_text())]


def _script(name: str):
    return load_script(f"scripts/{name}.py", f"moerl_{name}_script")


@pytest.mark.parametrize("experiment, old, new", RENAMES)
def test_the_former_and_the_current_name_load_the_same_arm(experiment, old, new):
    arms = REPO / "experiments" / experiment / "arms"
    assert not (arms / f"{old}.yaml").exists() and (arms / f"{new}.yaml").exists()
    assert re.fullmatch(r"[A-Za-z0-9_-]+", new)  # a shell and a glob take it as it is
    by_old, by_new = load_config(arms / f"{old}.yaml"), load_config(arms / f"{new}.yaml")
    assert by_old.arm == by_new.arm == new and to_dict(by_old) == to_dict(by_new)
    assert current_arm(experiment, old) == current_arm(experiment, new) == new
    assert former_arms(experiment, new) == former_arms(experiment, old) == [old]
    assert current_arm(experiment, f"{old}+rollout.dtype=fp8") == f"{new}+rollout.dtype=fp8"
    assert current_arm("some_other_experiment", old) == old  # the table is per experiment


def test_the_three_mis_arms_say_their_estimator_and_band():
    loss = {new: load_config(REPO / "experiments" / exp / "arms" / f"{new}.yaml").loss for exp, _, new in RENAMES}
    assert (loss["geo_mis_3pct"].is_level, loss["geo_mis_3pct"].mis_lower, loss["geo_mis_3pct"].mis_upper) \
        == ("geometric", 0.97, 1.03)
    assert (loss["seq_mis"].is_level, loss["seq_mis"].mis_lower, loss["seq_mis"].mis_upper) == ("sequence", 0.5, 2.0)
    assert (loss["geo_mis_0p1pct"].is_level, loss["geo_mis_0p1pct"].mis_lower, loss["geo_mis_0p1pct"].mis_upper) \
        == ("geometric", 0.999, 1.001)
    assert all(lo.variant == "mis" for lo in loss.values())  # the loss variant keeps its name


def test_an_unknown_arm_file_names_the_arms_there():
    with pytest.raises(ConfigError, match=r"config file not found: .*arms/nope\.yaml \(arms there: .*geo_mis_3pct"):
        load_config(REPO / "experiments/00_tiny_moe_cpu/arms/nope.yaml")


def _recorded_under_former_name(root: Path, arm_file: str, overrides: list[str], old_dir: str):
    """A finished run as recorded before the rename: directory, config.yaml and run.json under the old name."""
    cfg = load_config(REPO / arm_file, [f"tracking.output_dir={root}", *overrides])
    cfg.arm = former_arms(cfg.experiment, cfg.arm)[0]
    run = root / cfg.experiment / old_dir / "seed0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(config_yaml(cfg))
    (run / "run.json").write_text(json.dumps({"run": cfg.run_name, "config_hash": config_hash(cfg),
                                              "identity": identity_dict(cfg)}))
    rows = [{"step": 0, "eval/pass1": 0.5}, {"step": 1, "reward/mean": 0.25, "mismatch/k3": 1e-3}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"steps": 1}))
    return cfg, run


def test_a_run_recorded_under_the_former_name_is_found_skipped_and_loaded_under_the_current_one(tmp_path):
    from moerl.analysis.results import find_runs, load_metrics, load_run
    from moerl.tracking import check_same_config

    old, run = _recorded_under_former_name(tmp_path, "experiments/07_dose_threshold/arms/geo_mis_0p1pct.yaml",
                                           ["rollout.dtype=fp8"], "mis+rollout.dtype=fp8")
    for arm_file in ("geo_mis_0p1pct.yaml", "mis.yaml"):  # asked for by either name
        cfg = load_config(REPO / "experiments/07_dose_threshold/arms" / arm_file,
                          [f"tracking.output_dir={tmp_path}", "rollout.dtype=fp8"])
        assert cfg.arm == "geo_mis_0p1pct" and cfg.run_dir == run  # skipped or resumed, never run again
        check_same_config(run, cfg, "skip")  # the former name is the same arm, not another config
        assert config_diff(identity_dict(old), identity_dict(cfg)) == []
    # the arm's name is part of the run's identity: a new run of the arm hashes under its current name
    assert config_hash(cfg) != config_hash(old) and config_hashes(cfg) == [config_hash(cfg), config_hash(old)]
    assert {k.arm for k in find_runs(tmp_path)} == {"geo_mis_0p1pct+rollout.dtype=fp8"}
    assert set(load_metrics(tmp_path, "07_dose_threshold", arms=["mis+rollout.dtype=fp8"])["arm"]) \
        == {"geo_mis_0p1pct+rollout.dtype=fp8"}
    for name in ("mis+rollout.dtype=fp8", "mis+rollout.dtype-fp8", "geo_mis_0p1pct+rollout.dtype-fp8"):
        loaded = load_run(tmp_path, "07_dose_threshold", name, 0)  # either name, either spelling of the overrides
        assert list(loaded["step"]) == [0, 1] and loaded["arm"].str.startswith("geo_mis_0p1pct+rollout.dtype").all()
    # the same run under both names cannot be chosen between: both directories are named
    shutil.copytree(run, tmp_path / "07_dose_threshold" / "geo_mis_0p1pct+rollout.dtype=fp8" / "seed0")
    with pytest.raises(ValueError, match=r"mis\+rollout.dtype=fp8/seed0 are the same run"):
        find_runs(tmp_path)


def test_a_checkpoint_written_under_the_former_name_resumes_under_the_current_one(tmp_path):
    from moerl.trainer.checkpoint import resumable_checkpoint, save_checkpoint
    from moerl.tracking import RunMismatchError

    old, run = _recorded_under_former_name(tmp_path, "experiments/00_tiny_moe_cpu/arms/geo_mis_3pct.yaml", [], "mis")
    (run / "summary.json").unlink()  # interrupted: checkpointed, not finished
    w = torch.nn.Parameter(torch.zeros(2))
    saved = save_checkpoint(run, 1, {"w": w}, torch.optim.AdamW([w]), {"sampler": {}}, config_hash=config_hash(old))
    cfg = load_config(REPO / "experiments/00_tiny_moe_cpu/arms/mis.yaml", [f"tracking.output_dir={tmp_path}"])
    assert cfg.run_dir == run and resumable_checkpoint(run, cfg) == saved
    other = load_config(REPO / "experiments/00_tiny_moe_cpu/arms/geo_mis_3pct.yaml",
                        [f"tracking.output_dir={tmp_path}", "loss.mis_upper=1.05"])
    with pytest.raises(RunMismatchError):  # a checkpoint of another config is still refused
        resumable_checkpoint(run, other)


def test_the_registered_grids_count_a_renamed_arms_runs_under_either_name():
    """07's analysis.yaml is left as registered (its main grid lists ``mis``); a run of the arm, loaded
    under its current name, still belongs to the grid, so no grid start and no post-hoc label moves."""
    from moerl.analysis.registration import Registration, analysis_path

    early = {"rung": "fp8", "registration": {"started": "2026-11-25T05:00:00+00:00", "sha256": "0" * 64}}
    path = analysis_path("07_dose_threshold")
    assert "mis" in yaml.safe_load(path.read_text())["grids"]["main"]["arms"]
    for arm in ("geo_mis_0p1pct", "mis"):
        reg = Registration(path, runs=[{"arm": arm, **early}])
        assert reg.grid_started("main").isoformat() == "2026-11-25T05:00:00+00:00"
        assert "geo_mis_0p1pct" in reg.grid_arms("main")
    untouched = Registration(path)
    assert untouched.grid_started("main").isoformat() == "2026-11-25T05:35:46+00:00"


def test_the_dose_and_claims_code_name_the_current_arms():
    from moerl.analysis import claims, dose

    assert dose.GEO_MIS == "geo_mis_0p1pct" and dose.GEO_MIS in dose.MITIGATIONS and "mis" not in dose.MITIGATIONS
    assert dose.ACTS_ON[dose.GEO_MIS] == dose.ACTS_ON_PREREGISTERED[dose.GEO_MIS] == "mask/token_frac"
    assert claims.MASKING_ARMS == ("seq_mis", "icepop")


def test_a_sweep_and_check_reproducible_take_the_former_name(tmp_path, monkeypatch):
    sweep = _script("sweep")
    out = tmp_path / "runs"
    _, _, jobs = sweep.plan(REPO / "experiments/00_tiny_moe_cpu", [0], ["mis"], [f"tracking.output_dir={out}"], 1)
    assert [(j.arm, Path(j.config).name) for j in jobs] == [("geo_mis_3pct", "geo_mis_3pct.yaml")]

    check = _script("check_reproducible")
    recorded = tmp_path / "recorded"
    _, run = _recorded_under_former_name(recorded, "experiments/00_tiny_moe_cpu/arms/geo_mis_3pct.yaml", [], "mis")
    from moerl.tracking import machine_info

    machine = json.dumps(machine_info())  # recorded on this CPU kind: the bitwise check applies
    (run / "machine.json").write_text(machine)
    rows = (recorded / "00_tiny_moe_cpu/mis/seed0/metrics.jsonl").read_text()
    commands = []

    def fake_run(cmd, **kwargs):  # stands in for the re-run: writes what the recorded run logged
        commands.append(cmd)
        where = Path(next(a for a in cmd if a.startswith("tracking.output_dir=")).split("=", 1)[1])
        fresh = where / "00_tiny_moe_cpu" / "geo_mis_3pct" / "seed0"
        fresh.mkdir(parents=True)
        (fresh / "metrics.jsonl").write_text(rows)
        (fresh / "machine.json").write_text(machine)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(check.subprocess, "run", fake_run)
    assert check.main(["--arm", "mis", "--steps", "1", "--recorded", str(recorded)]) == 0
    assert Path(commands[0][2]).name == "geo_mis_3pct.yaml"


@pytest.mark.parametrize("experiment, old, new", RENAMES)
def test_a_launcher_given_the_former_name_runs_the_current_arm(experiment, old, new, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled"}
    done = subprocess.run(["bash", str(REPO / "experiments" / experiment / "launch.sh"), old, "--print-config",
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"# run directory: {tmp_path}/{experiment}/{new}/seed0" in done.stdout and f"\narm: {new}\n" in done.stdout
    bad = subprocess.run(["bash", str(REPO / "experiments" / experiment / "launch.sh"), "nope", "--print-config",
                          "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "arms there: " in bad.stderr and new in bad.stderr
