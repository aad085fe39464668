"""Every experiment's launcher does what its usage line says: new runs go to runs/ (or --out), only
--record writes into results/, key=value overrides reach the runs, and --smoke trains for real."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CLUSTER = ["01_kimi_k2_lora_grpo", "02_kimi_k2_lora_grpo_r3", "03_qwen3_30b_a3b_lora_mitigations",
           "04_moonlight_16b_a3b_r3"]


def launch(script: str, *args: str, python: str = sys.executable, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": python, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1",
           "WANDB_MODE": "disabled"}
    return subprocess.run(["bash", str(REPO / script), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def fake_python(tmp_path) -> tuple[str, Path]:
    """A stand-in interpreter that logs each command line it is given (one per line) and succeeds; it has
    every dependency (the launchers' check for missing packages prints nothing and is not logged)."""
    log = tmp_path / "calls.log"
    script = tmp_path / "python"
    script.write_text(f'#!/usr/bin/env bash\ncase "$*" in *find_spec*) exit 0;; esac\necho "$*" >> {log}\n')
    script.chmod(0o755)
    return str(script), log


@pytest.mark.slow
@pytest.mark.parametrize("script", ["experiments/00_tiny_moe_cpu/launch.sh",
                                    "experiments/05_mismatch_consequences/launch.sh",
                                    "experiments/07_dose_threshold/launch.sh"])
def test_smoke_mode_trains_two_steps_into_the_chosen_output(script, tmp_path):
    done = launch(script, "--smoke", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summaries = list((tmp_path / "smoke").glob("*/*/seed0/summary.json"))
    assert len(summaries) == 1, done.stdout[-2000:]
    assert json.loads(summaries[0].read_text())["steps"] == 2


@pytest.mark.slow
def test_geometry_smoke_measures_into_the_chosen_output(tmp_path):
    done = launch("experiments/06_routing_geometry/run.sh", "--smoke", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert len(list((tmp_path / "smoke" / "geometry").glob("smoke_*.json"))) == 2


def test_geometry_draws_its_figures_from_where_it_measured(fake_python, tmp_path):
    python, log = fake_python
    assert launch("experiments/06_routing_geometry/run.sh", "--out", str(tmp_path), "--only", "depth",
                  "model.init_std=0.05", python=python).returncode == 0
    measure, figures = log.read_text().splitlines()
    out = f"{tmp_path}/geometry"
    assert measure == f"scripts/measure_geometry.py --out {out} --only depth model.init_std=0.05"
    assert figures == f"scripts/geometry_figures.py --points {out} --figures {out}/figures --results {out}/RESULTS.md"
    log.unlink()
    assert launch("experiments/06_routing_geometry/run.sh", "--record", python=python).returncode == 0
    assert "--points results/geometry --figures results/figures" in log.read_text()


@pytest.mark.parametrize("script", ["experiments/00_tiny_moe_cpu/launch.sh",
                                    "experiments/05_mismatch_consequences/launch.sh"])
def test_sweep_and_one_arm_write_to_runs_and_pass_overrides(script, fake_python):
    python, log = fake_python
    assert launch(script, "trainer.steps=5", "--arms", "r3", python=python).returncode == 0
    assert launch(script, "r3", "--seed", "1", "trainer.lr=1e-4", python=python).returncode == 0
    assert launch(script, "--record", "r3", python=python).returncode == 0
    sweep, one, recorded = log.read_text().splitlines()
    assert sweep.startswith("scripts/sweep.py") and "--output-dir runs " in sweep and \
        sweep.endswith("trainer.steps=5 --arms r3")
    assert one.startswith("scripts/run.py") and one.endswith("tracking.output_dir=runs --seed 1 trainer.lr=1e-4")
    assert recorded.endswith("tracking.output_dir=results/runs")


def test_dose_launcher_writes_to_runs_unless_recording():
    """The fp32 control is recorded in results/runs: the default launch must train it anew in runs/,
    not find the recorded seeds and skip them."""
    fresh = launch("experiments/07_dose_threshold/launch.sh", "control", "--dry-run", "trainer.steps=5")
    assert fresh.returncode == 0, fresh.stderr
    assert "tracking.output_dir=runs" in fresh.stdout and "results/runs" not in fresh.stdout
    assert "fp32_control+trainer.steps-5 seed2: fresh" in fresh.stdout
    recorded = launch("experiments/07_dose_threshold/launch.sh", "--record", "control", "--dry-run")
    assert "tracking.output_dir=results/runs" in recorded.stdout or "(3 finished" in recorded.stdout


def test_record_does_not_combine_with_smoke():
    done = launch("experiments/00_tiny_moe_cpu/launch.sh", "--record", "--smoke")
    assert done.returncode == 2 and "--record writes into results/" in done.stderr


@pytest.mark.parametrize("experiment", CLUSTER)
def test_cluster_launchers_use_the_chosen_python(experiment, fake_python):
    python, log = fake_python
    text = (REPO / "experiments" / experiment / "launch.sh").read_text()
    assert not any(line.lstrip().startswith("python ") or " python " in line or "exec python" in line
                   for line in text.splitlines() if not line.lstrip().startswith("#"))
    done = launch(f"experiments/{experiment}/launch.sh", "--dry-run", python=python)
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines()[-1] == f"-m moerl.entry moerl.verl_ext.launch experiments/{experiment} --dry-run"


def test_cluster_launcher_names_a_missing_experiment():
    done = launch("scripts/cluster_launch.sh", "05_nope", "--dry-run")
    assert done.returncode == 2 and "expected an experiment folder name under experiments/, got '05_nope'" in done.stderr


@pytest.mark.parametrize("system_python3", ["exit 1",  # a system python3 without moerl
                                            'case "$*" in *torch*) exit 1;; esac'])  # moerl on its path, no torch
def test_cluster_launcher_falls_back_to_the_checkouts_venv(tmp_path, fake_python, system_python3):
    """After the README's set-up (.venv, no PYTHON), a cluster launcher's --dry-run runs on the checkout's
    .venv when python3 has no moerl or no torch; before, it stopped with "moerl is not installed", or with a
    traceback from the missing torch."""
    python, log = fake_python
    experiment = CLUSTER[-1]
    for script in (f"experiments/{experiment}/launch.sh", "scripts/cluster_launch.sh"):
        (tmp_path / script).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / script).write_text((REPO / script).read_text())
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(python)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python3").write_text(f"#!/bin/sh\n{system_python3}\n")
    (tmp_path / "bin" / "python3").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(tmp_path / "experiments" / experiment / "launch.sh"), "--dry-run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == ("launch.sh: python3 has no moerl or no torch; using .venv/bin/python "
                                   "(set PYTHON to choose another)")
    assert log.read_text().splitlines()[-1] == f"-m moerl.entry moerl.verl_ext.launch experiments/{experiment} --dry-run"


@pytest.mark.parametrize("script", ["experiments/01_kimi_k2_lora_grpo/launch.sh", "experiments/00_tiny_moe_cpu/launch.sh"])
def test_help_is_the_launchers_own(script):
    done = launch(script, "--help", python="/nonexistent/python")  # --help needs no interpreter
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1].lstrip().startswith(("./launch.sh", "experiments/00_tiny_moe_cpu/launch.sh"))
    assert "usage: sweep.py" not in done.stdout and "usage: launch.py" not in done.stdout


def test_cluster_launcher_names_a_missing_package_in_one_line(tmp_path):
    """An interpreter that imports moerl but has no torch (a bare cluster image's python3)."""
    shadow = tmp_path / "torch"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\", name='torch')\n")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": f"{tmp_path}:{REPO / 'src'}"}
    done = subprocess.run(["bash", str(REPO / "experiments/01_kimi_k2_lora_grpo/launch.sh"), "--dry-run"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1:] == [
        f"error: {sys.executable} lacks the Python package 'torch', which moerl.verl_ext.launch imports; install the "
        "cluster environment (requirements/gpu.txt, docs/cluster.md) or set PYTHON to an interpreter that has it"]


def test_cpu_launcher_names_missing_packages_in_one_line(tmp_path):
    bare = tmp_path / "python"
    bare.write_text('#!/usr/bin/env bash\ncase "$*" in *find_spec*) echo torch peft; exit 0;; esac\necho ran >> '
                    f'{tmp_path}/ran.log\n')
    bare.chmod(0o755)
    done = launch("experiments/00_tiny_moe_cpu/launch.sh", "r3", python=str(bare))
    assert done.returncode == 1 and not (tmp_path / "ran.log").exists()
    assert done.stderr.strip().splitlines() == [
        f"error: {bare} lacks torch peft; run bash scripts/setup_env.sh (or set PYTHON to an interpreter with "
        "requirements/cpu.txt)"]
