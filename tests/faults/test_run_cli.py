"""scripts/run.py as a user meets it: one-line errors, runs that know their config, no run resumed
into new rows, no run of one config continued with another."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import fault_fixtures
from kill_harness import REPO, fails_with, overrides, run_script
from moerl.config import identity_dict, load_config

reference_run = fault_fixtures.reference_run  # the fixture, bound here so pytest finds it

ARM = "experiments/00_tiny_moe_cpu/arms/baseline.yaml"


def test_contradictory_flags(tmp_path):
    msg = fails_with([ARM, "--resume", "--fresh", f"tracking.output_dir={tmp_path}"])
    assert "--resume and --fresh contradict each other" in msg
    assert not any(tmp_path.iterdir())


def test_resume_without_checkpoint(tmp_path):
    run = load_config(ARM, overrides(tmp_path)).run_dir
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0, "eval/pass1": 0.5}\n')  # killed before step 1 ended
    msg = fails_with([ARM, "--resume", *overrides(tmp_path)])
    assert f"{run}: no checkpoint to resume from" in msg and "start it over with --fresh" in msg
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_finished_run_is_not_resumed(reference_run, capsys):
    out = reference_run.parents[2]
    before = (reference_run / "metrics.jsonl").read_text()
    summary = run_script.main([ARM, "--resume", *overrides(out)])
    assert summary["steps"] == 4 and "is finished (summary.json): nothing to do" in capsys.readouterr().out
    assert (reference_run / "metrics.jsonl").read_text() == before


def test_resume_with_another_config_is_refused(tmp_path):
    cfg = load_config(ARM, overrides(tmp_path))
    (cfg.run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    (cfg.run_dir / "checkpoints" / "step_2" / "state.json").write_text("{}")
    recorded = {**identity_dict(cfg), "trainer.lr": 0.001}
    (cfg.run_dir / "run.json").write_text(json.dumps({"identity": recorded}))
    msg = fails_with([ARM, "--resume", *overrides(tmp_path)])
    assert "holds a run of another config, cannot resume it (trainer.lr: 0.001 -> 0.0003)" in msg
    # a run recorded before run.json existed: its config.yaml is compared
    (cfg.run_dir / "run.json").unlink()
    (cfg.run_dir / "config.yaml").write_text((REPO / ARM).read_text().replace("arm: baseline", "arm: baseline\n"
                                             "rollout:\n  group_size: 16").replace("base: ../base.yaml",
                                             f"base: {REPO / 'experiments/00_tiny_moe_cpu/base.yaml'}"))
    assert "rollout.group_size: 16 -> 4" in fails_with([ARM, "--resume", *overrides(tmp_path)])


def test_overrides_name_their_own_run(tmp_path):
    plain = load_config("experiments/00_tiny_moe_cpu/arms/tis.yaml", [f"tracking.output_dir={tmp_path}", "threads=1"])
    changed = load_config("experiments/00_tiny_moe_cpu/arms/tis.yaml",
                          [f"tracking.output_dir={tmp_path}", "threads=1", "loss.tis_cap=3.0"])
    assert plain.run_dir == tmp_path / "00_tiny_moe_cpu" / "tis" / "seed0"
    assert changed.run_dir == tmp_path / "00_tiny_moe_cpu" / "tis+loss.tis_cap-3.0" / "seed0"
    assert changed.run_name == "00_tiny_moe_cpu/tis+loss.tis_cap-3.0/seed0"


def test_print_config_writes_nothing(tmp_path, capsys):
    assert run_script.main([ARM, "--print-config", "trainer.lr=0.001", f"tracking.output_dir={tmp_path}"]) is None
    text = capsys.readouterr().out
    assert "# run directory: " + str(tmp_path / "00_tiny_moe_cpu" / "baseline+trainer.lr-0.001" / "seed0") in text
    assert "  lr: 0.001\n" in text and "# config hash: " in text
    assert not any(tmp_path.iterdir())


def test_run_says_where_it_writes_and_how_to_sync(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the suite disables wandb; this run asks for offline
    tiny = ["warm_start.enabled=false", "rollout.prompts_per_step=2", "rollout.group_size=2", "trainer.steps=1",
            "trainer.mini_batches=1", "trainer.eval_size=4", "trainer.eval_every=0", "data.train_size=64",
            "data.test_size=4", "tracking.wandb_mode=offline", f"tracking.output_dir={tmp_path / 'my runs'}",
            "threads=1"]
    summary = run_script.main([ARM, "--no-progress", *tiny])
    run = load_config(ARM, tiny).run_dir
    out = capsys.readouterr().out
    assert f"writing {run} (config hash " in out and f"run directory: {run}" in out
    sync = next(line for line in out.splitlines() if "wandb sync" in line)
    command = shlex.split(sync.split("`")[1])  # a path with a space is quoted for the shell
    assert command[:2] == ["wandb", "sync"] and len(command) == 3 and Path(command[2]).parent == run / "wandb"
    machine = json.loads((run / "machine.json").read_text())
    assert summary["steps"] == 1 and json.loads((run / "summary.json").read_text())["machine"] == machine
    assert set(machine["isa_flags"]) >= {"avx512_bf16", "amx_bf16"} and machine["torch_threads"] == 1
    assert machine["torch_version"] and machine["cpu_model"]


def test_errors_are_one_line_and_debug_shows_the_traceback(tmp_path):
    msg = fails_with([ARM, "trainer.stpes=3", f"tracking.output_dir={tmp_path}"])
    assert msg.startswith("config error: command-line override 'trainer.stpes=3': unknown config key") \
        and msg.endswith("(--debug shows the traceback)")
    from moerl.config import ConfigError

    with pytest.raises(ConfigError):
        run_script.main([ARM, "--debug", "trainer.stpes=3"])


def test_a_live_run_has_one_writer(tmp_path):
    """A second start or a --resume of a run that is live is refused, naming the live process, also after
    its lock file was deleted; the live run's rows are untouched (no truncation under its writer, no
    second writer)."""
    import os
    import subprocess
    import sys
    import time

    from kill_harness import RUN
    from moerl.tracking import read_metrics

    args = overrides(tmp_path, steps=40)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"), "WANDB_MODE": "disabled"}
    env.pop("MOERL_FAULT", None)
    live = subprocess.Popen([sys.executable, str(RUN), "--no-progress", ARM, *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = load_config(ARM, args).run_dir
    try:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "step_1" / "state.json").exists():
            assert live.poll() is None and time.monotonic() < deadline, "the live run never checkpointed"
            time.sleep(0.2)
        for extra in (["--resume"], []):
            msg = fails_with([ARM, *extra, *args])
            assert f"{run} is in use by process {live.pid}" in msg, msg
        # A cleanup deletes the lock file under the live run: the run directory's own lock still holds.
        from moerl.runlock import lock_path

        lock_path(run).unlink()
        for extra in (["--resume"], []):
            msg = fails_with([ARM, *extra, *args])
            assert f"{run} is in use by process {live.pid}" in msg, msg
        assert live.poll() is None
    finally:
        live.kill()
        live.wait()
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    assert steps == list(range(len(steps))) and len(steps) >= 2


def test_wandb_disabled_in_the_environment_is_honoured(tmp_path, monkeypatch, caplog):
    import logging

    from moerl.tracking import Tracker

    monkeypatch.setenv("WANDB_MODE", "disabled")
    with caplog.at_level(logging.INFO):
        tracker = Tracker(tmp_path / "run", load_config(None, ["tracking.wandb_mode=offline"]))
    mirror = tracker.wandb
    tracker.close()
    assert mirror is None and not (tmp_path / "run" / "wandb").exists()
    assert "wandb disabled by WANDB_MODE=disabled in the environment (tracking.wandb_mode=offline ignored)" \
        in caplog.text
