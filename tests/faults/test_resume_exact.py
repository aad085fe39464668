"""Resume is exact (in-process kills at the trainer's fault points; real SIGKILLs are in
test_kill_resume.py): a resumed run logs what the uninterrupted one logs, nothing twice."""
from __future__ import annotations

import json

import pytest
import torch

import fault_fixtures
from fault_fixtures import Killed, killed_run
from kill_harness import assert_identical_runs, logged_rows, overrides
from moerl.config import load_config
from moerl.trainer.checkpoint import checkpoint_dirs, incomplete_dirs, save_checkpoint
from moerl.trainer.grpo import GRPOTrainer

kill_at = fault_fixtures.kill_at  # the fixture, bound here so pytest finds it
reference_run = fault_fixtures.reference_run  # the fixture, bound here so pytest finds it

ARM = "experiments/00_tiny_moe_cpu/arms/baseline.yaml"


def killed_then_resumed(tmp_path, kill_at, point: str, n: int):
    cfg = killed_run(tmp_path, kill_at, point, n)
    GRPOTrainer(cfg, cfg.run_dir, resume=True, progress=False).train()
    return cfg.run_dir


def test_resumed_rows_equal_uninterrupted_rows(tmp_path, kill_at, reference_run):
    run = killed_then_resumed(tmp_path, kill_at, "step", 3)  # inside step 3: resumes from step 2
    versions = [r["refit/version"] for r in logged_rows(run) if "refit/version" in r]
    assert versions == [1.0, 2.0, 3.0, 4.0]
    assert_identical_runs(reference_run, run)


def test_resume_at_the_end_logs_nothing_twice(tmp_path, kill_at, reference_run):
    # Killed right after checkpoints/step_4 appeared; step 4's row carries the final evaluation.
    run = killed_then_resumed(tmp_path, kill_at, "after_checkpoint", 4)
    assert [r["step"] for r in logged_rows(run)] == [0, 1, 2, 3, 4]
    assert_identical_runs(reference_run, run)
    assert json.loads((run / "summary.json").read_text())["steps"] == 4


def _save(run, step):
    weight = torch.nn.Parameter(torch.full((2,), float(step)))
    opt = torch.optim.AdamW([weight])
    return save_checkpoint(run, step, {"w": weight}, opt, {"sampler": {}})


def test_crash_leftovers_are_cleaned(tmp_path, kill_at):
    root = tmp_path / "checkpoints"
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    kill_at("prune", 1)
    with pytest.raises(Killed):  # killed while deleting step_1 (one file already gone)
        _save(tmp_path, 3)
    assert (root / ".step_1.deleting").exists() and [p.name for p in checkpoint_dirs(tmp_path)] == ["step_2", "step_3"]
    (root / ".step_9.tmp").mkdir()                  # killed inside a checkpoint write
    (root / "step_0").mkdir()                       # pruned in place by an older version, state.json gone
    (root / "step_0" / "lora.safetensors").write_bytes(b"x")
    assert len(incomplete_dirs(tmp_path)) == 3
    _save(tmp_path, 4)
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]


def test_a_kill_inside_the_truncation_loses_no_row(tmp_path, kill_at, reference_run, monkeypatch):
    """Killed while a resume drops the rows after its checkpoint (the backup written, the kept rows not
    yet): metrics.jsonl still holds every old row, and the next resume ends as the uninterrupted run."""
    from moerl import tracking
    from moerl.tracking import read_metrics

    cfg = load_config(ARM, overrides(tmp_path))
    kill_at("checkpoint_write", 2)  # step 2's row logged, its checkpoint not: a resume drops that row
    trainer = GRPOTrainer(cfg, cfg.run_dir, progress=False)
    with pytest.raises(Killed):
        trainer.train()
    trainer.tracker.close()
    metrics = cfg.run_dir / "metrics.jsonl"
    before = read_metrics(metrics)
    assert [r["step"] for r in before] == [0, 1, 2]
    real = tracking.atomic_write_text

    def killed_before_the_kept_rows(path, text):
        if path.name == "metrics.jsonl":
            raise Killed("inside the truncation")
        real(path, text)

    monkeypatch.setattr(tracking, "atomic_write_text", killed_before_the_kept_rows)
    with pytest.raises(Killed):
        GRPOTrainer(cfg, cfg.run_dir, resume=True, progress=False)
    monkeypatch.setattr(tracking, "atomic_write_text", real)
    assert read_metrics(metrics) == before
    GRPOTrainer(cfg, cfg.run_dir, resume=True, progress=False).train()
    assert_identical_runs(reference_run, cfg.run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["qat_int4_r3"])
def test_a_fake_int4_trainer_resumes_exactly(tmp_path, kill_at, arm):
    """Experiment 07's trainer-side fake-INT4 arms (frozen masters rounded onto the engine's grid when the
    trainer is built, replayed routes) are recorded across sessions, each session's end a kill: the resumed
    run must log what the uninterrupted one logs."""
    path = f"experiments/07_dose_threshold/arms/{arm}.yaml"
    reference = load_config(path, overrides(tmp_path / "reference"))
    GRPOTrainer(reference, reference.run_dir, progress=False).train()
    cfg = load_config(path, overrides(tmp_path / "killed"))
    kill_at("step", 3)  # inside step 3: resumes from step 2's checkpoint
    trainer = GRPOTrainer(cfg, cfg.run_dir, progress=False)
    with pytest.raises(Killed):
        trainer.train()
    trainer.tracker.close()
    GRPOTrainer(cfg, cfg.run_dir, resume=True, progress=False).train()
    assert_identical_runs(reference.run_dir, cfg.run_dir)
