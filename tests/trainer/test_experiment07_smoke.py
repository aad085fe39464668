"""Experiment 07 at CI size: every arm loads with the regime's settings, and one GRPO step runs at every
rung of the dose ladder (the new quantised rollouts included) and with every mitigation arm."""
from pathlib import Path

import pytest

from moerl.config import load_config
from moerl.analysis.dose import MECHANISM_RUNGS, QAT_ARMS, RUNGS
from moerl.trainer.grpo import GRPOTrainer
from tests_helpers import load_script, tiny_overrides_for

ARMS = Path(__file__).resolve().parents[2] / "experiments" / "07_dose_threshold" / "arms"
TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_experts=8", "model.top_k=2",
        "model.moe_intermediate_size=16", "model.num_heads=2", "model.num_kv_heads=1",
        "rollout.max_new_tokens=6", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "trainer.paired_replay_every=1", "trainer.eval_every=0", "trainer.mini_batches=2", "threads=1"]


def test_every_arm_loads_in_the_regime():
    arms = {p.stem: load_config(p) for p in ARMS.glob("*.yaml")}
    assert set(arms) == {"baseline", "fp32_control", "tis", "geo_mis_0p1pct", "icepop", "r3", "r3_tis",
                         *QAT_ARMS}
    for name, cfg in arms.items():
        assert cfg.experiment == "07_dose_threshold" and cfg.arm == name
        assert cfg.trainer.eval_precision == "fp32" and cfg.rollout.kernels == "emulated"
        rung = "fp32" if name == "fp32_control" else "int4_kimi" if name in QAT_ARMS else "bf16"
        assert cfg.data.task == "arith_steps" and cfg.rollout.dtype == rung
        assert cfg.trainer.fake_quant == ("int4_kimi" if name in QAT_ARMS else "none")


def one_step(tmp_path, arm, extra=()):
    cfg = load_config(ARMS / f"{arm}.yaml", tiny_overrides_for(tmp_path) + TINY + list(extra))
    trainer = GRPOTrainer(cfg, tmp_path / "run", progress=False)
    try:
        return trainer.step()
    finally:
        trainer.close()


@pytest.mark.parametrize("rung", [r for r in RUNGS if r != "bf16"])
def test_one_step_at_every_rung(rung, tmp_path):
    m = one_step(tmp_path, "baseline", [f"rollout.dtype={rung}"])
    assert m["mismatch/k3"] >= 0 and 0 <= m["routing/any_layer_differs"] <= 1
    if rung == "fp32":
        assert m["mismatch/k3"] < 1e-9


@pytest.mark.parametrize("rung", MECHANISM_RUNGS)
def test_one_step_at_every_mechanism_rung(rung, tmp_path):
    m = one_step(tmp_path, "baseline", [f"rollout.dtype={rung}"])
    assert m["mismatch/k3"] > 0 and 0 <= m["routing/any_layer_differs"] <= 1


@pytest.mark.parametrize("arm", ["tis", "geo_mis_0p1pct", "icepop", "r3_tis", *QAT_ARMS])
def test_one_step_of_every_mitigation(arm, tmp_path):
    m = one_step(tmp_path, arm)
    assert 0 <= m["effective/token_frac"] <= 1


def test_reevaluate_control_reproduces_the_recorded_evaluation_first(tmp_path, monkeypatch):
    import json
    import sys

    script = load_script("experiments/07_dose_threshold/reevaluate_control.py", "reevaluate07")
    runs = tmp_path / "runs"
    cfg = load_config(ARMS / "fp32_control.yaml", tiny_overrides_for(tmp_path) + TINY + ["trainer.eval_every=3"])
    trainer = GRPOTrainer(cfg, runs / "07_dose_threshold" / "fp32_control" / "seed0", progress=False)
    try:
        trainer.train()
    finally:
        trainer.close()
    out = tmp_path / "again.json"
    monkeypatch.setattr(sys, "argv", ["reevaluate_control.py", "--runs", str(runs), "--samples", "3", "--out", str(out)])
    script.main()  # exits if the restored policy does not give the recorded pass@1 with the recorded samples
    seed = json.loads(out.read_text())["seeds"]["seed0"]
    assert seed["step"] == 3 and seed["remeasured"]["completions"] == 3 * 16
    assert seed["remeasured"]["gain"] == pytest.approx(seed["remeasured"]["end"] - seed["remeasured"]["start"])
    # The run's log disagrees with what its last checkpoint gives: refused, nothing written.
    metrics = runs / "07_dose_threshold" / "fp32_control" / "seed0" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows[-1]["eval/pass1"] = 0.5
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out.unlink()
    with pytest.raises(SystemExit, match="not the same policy or evaluator"):
        script.main()
    assert not out.exists()


def test_registered_grids_run_every_run_on_the_registered_rollout_path(mode="confirm"):
    """``launch.sh confirm`` (and ``mechanism``, the same code) passes analysis.yaml's rollout_path to every run
    it plans."""
    import os
    import subprocess
    import sys

    import yaml

    path = yaml.safe_load((ARMS.parent / "analysis.yaml").read_text())["rollout_path"]
    assert (path["key"], path["value"]) == ("rollout.decode", "loop")
    out = subprocess.run(["bash", str(ARMS.parent / "launch.sh"), mode, "--dry-run"], capture_output=True, text=True,
                         env={**os.environ, "PYTHON": sys.executable}, cwd=ARMS.parents[2])
    assert out.returncode == 0, out.stderr
    planned = [line for line in out.stdout.splitlines() if "scripts/run.py" in line]
    assert len(planned) == 12 + 5 * 12 + 4 * 5
    assert all(" rollout.decode=loop " in line and " trainer.eval_samples=8" in line for line in planned)


def test_registered_grids_start_seed_by_seed(tmp_path):
    """A registered grid that stops early leaves every arm, and every mechanism rung, with the same seeds:
    ``launch.sh`` asks its sweeps for seed-by-seed order (``sweep.py --order seed``, tested in
    tests/analysis/test_sweep.py) and runs the mechanism rungs inside a loop over seeds. Read from the sweep
    commands launch.sh issues, through a stand-in python that prints them (the real plans are slow to build)."""
    import os
    import re
    import subprocess
    import sys

    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = -c ]; then exec {sys.executable} "$@"; fi\necho "SWEEP $*"\n')
    fake.chmod(0o755)

    def sweeps(mode):
        out = subprocess.run(["bash", str(ARMS.parent / "launch.sh"), mode], capture_output=True, text=True,
                             env={**os.environ, "PYTHON": str(fake)}, cwd=ARMS.parents[2])
        assert out.returncode == 0, out.stderr
        return [line for line in out.stdout.splitlines() if line.startswith("SWEEP scripts/sweep.py")]

    confirm = sweeps("confirm")
    assert len(confirm) == 3 and all("--order seed" in line for line in confirm[1:])
    mechanism = sweeps("mechanism")
    assert len(mechanism) == 5 * (len(MECHANISM_RUNGS) + 1)
    seeds = [int(re.search(r"--seed-list (\d+)", line).group(1)) for line in mechanism]
    assert seeds == sorted(seeds) == [s for s in range(5) for _ in range(len(MECHANISM_RUNGS) + 1)]
    first = mechanism[:len(MECHANISM_RUNGS) + 1]
    assert [re.search(r"rollout\.dtype=(\w+)", line).group(1) for line in first[:-1]] == list(MECHANISM_RUNGS)
    assert all(arm in first[-1] for arm in QAT_ARMS)
    # sealed until complete: no sweep of a registered grid prints an outcome while it runs
    assert all(" --blind" in line for line in confirm + mechanism)


def test_registered_mechanism_grid_names_configs_that_load():
    import yaml

    grid = yaml.safe_load((ARMS.parent / "analysis.yaml").read_text())["grids"]["mechanism"]
    assert set(grid["rungs"]) == set(MECHANISM_RUNGS) and set(QAT_ARMS) <= set(grid["arms"])
    for rung in MECHANISM_RUNGS:
        assert load_config(ARMS / "baseline.yaml", [f"rollout.dtype={rung}"]).rollout.dtype == rung
