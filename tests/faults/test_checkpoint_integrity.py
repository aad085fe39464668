"""Checkpoints verified before a resume: a damaged file (a flipped bit, a truncated copy, an empty
state.json) is named and the previous intact checkpoint is used; a checkpoint of another config is
refused even when run.json and config.yaml are gone; no crash leftover survives a finished run."""
from __future__ import annotations

import logging

import pytest
import torch

import fault_fixtures
from fault_fixtures import killed_run
from kill_harness import REPO, assert_identical_runs, fails_with, overrides
from moerl.config import load_config
from moerl.trainer.checkpoint import CheckpointError, checkpoint_dirs, resumable_checkpoint, save_checkpoint
from moerl.trainer.grpo import GRPOTrainer

kill_at = fault_fixtures.kill_at  # the fixture, bound here so pytest finds it
reference_run = fault_fixtures.reference_run  # the fixture, bound here so pytest finds it

ARM = "experiments/00_tiny_moe_cpu/arms/baseline.yaml"
MANIFEST = "manifest.json"  # written last into every checkpoint (moerl.trainer.checkpoint.MANIFEST)


def test_a_flipped_bit_in_a_checkpoint_is_caught(tmp_path, kill_at, reference_run, caplog):
    cfg = killed_run(tmp_path, kill_at, "step", 4)  # checkpoints step_2 and step_3 kept
    newest = checkpoint_dirs(cfg.run_dir)[-1]
    assert newest.name == "step_3"
    lora = newest / "lora.safetensors"
    data = bytearray(lora.read_bytes())
    data[-1] ^= 0x40  # one exponent bit of the last stored weight
    lora.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        GRPOTrainer(cfg, cfg.run_dir, resume=True, progress=False).train()
    assert f"damaged checkpoint {newest} ({lora}: checksum mismatch" in caplog.text
    assert f"resuming from the previous complete checkpoint {cfg.run_dir / 'checkpoints' / 'step_2'}" in caplog.text
    assert_identical_runs(reference_run, cfg.run_dir)


def _save(run, step):
    weight = torch.nn.Parameter(torch.full((64,), float(step)))
    return save_checkpoint(run, step, {"w": weight}, torch.optim.AdamW([weight]), {"sampler": {}})


def test_unreadable_checkpoints_are_named_and_skipped(tmp_path, caplog):
    cfg = load_config(ARM, overrides(tmp_path))
    run = cfg.run_dir
    first, second = _save(run, 1), _save(run, 2)
    for saved in (first, second):  # as written before checkpoints carried checksums
        (saved / MANIFEST).unlink()
    (second / "state.json").write_text("")
    with caplog.at_level(logging.WARNING):
        assert resumable_checkpoint(run, cfg) == first
    assert f"damaged checkpoint {second} ({second / 'state.json'}: cannot be read (" in caplog.text
    lora = first / "lora.safetensors"
    lora.write_bytes(lora.read_bytes()[:100])  # a truncated copy
    msg = fails_with([ARM, "--resume", *overrides(tmp_path)])
    assert msg.startswith(f"error: {run}: no intact checkpoint to resume from ({second / 'state.json'}: cannot be "
                          f"read ("), msg
    assert msg.endswith(f"start the run over with --fresh (it moves the run aside), or delete the damaged "
                        f"checkpoint(s) {second}, {first} (--debug shows the traceback)"), msg


def test_a_run_that_predates_manifests_still_resumes(tmp_path, caplog):
    cfg = load_config(ARM, overrides(tmp_path))
    for step in (1, 2):  # no run.json format, no checkpoint with a manifest: written by an older version
        (_save(cfg.run_dir, step) / MANIFEST).unlink()
    legacy = checkpoint_dirs(cfg.run_dir)[-1]
    with caplog.at_level(logging.WARNING):
        assert resumable_checkpoint(cfg.run_dir, cfg) == legacy
    assert f"{legacy} has no {MANIFEST} (written before checkpoints carried checksums)" in caplog.text


def test_a_checkpoint_without_manifest_is_not_loaded_unverified(tmp_path, caplog):
    """A run that writes manifests writes one into every checkpoint: one without is damaged, and the
    resume falls back to the previous verified checkpoint (or loads it with --unverified-checkpoint)."""
    cfg = load_config(ARM, overrides(tmp_path))
    first = _save(cfg.run_dir, 1)
    second = _save(cfg.run_dir, 2)
    (second / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING):
        assert resumable_checkpoint(cfg.run_dir, cfg) == first
    assert f"damaged checkpoint {second} ({second / MANIFEST}: missing (this run writes one into every " \
           f"checkpoint" in caplog.text
    assert f"resuming from the previous complete checkpoint {first}" in caplog.text
    assert resumable_checkpoint(cfg.run_dir, cfg, unverified_ok=True) == second
    # run.json of this version records the format: with no other checkpoint left, nothing is loaded unchecked
    (first / MANIFEST).unlink()
    (cfg.run_dir / "run.json").write_text('{"format": 2, "identity": null}')
    with pytest.raises(CheckpointError, match=f"no intact checkpoint to resume from .*{MANIFEST}: missing"):
        resumable_checkpoint(cfg.run_dir, cfg)
    msg = fails_with([ARM, "--resume", *overrides(tmp_path)])
    assert f"{cfg.run_dir}: no intact checkpoint to resume from ({second / MANIFEST}: missing" in msg, msg


def test_a_checkpoint_of_another_config_is_refused_without_run_json(tmp_path, kill_at):
    cfg = killed_run(tmp_path, kill_at, "step", 3)
    (cfg.run_dir / "run.json").unlink()
    (cfg.run_dir / "config.yaml").unlink()
    other = tmp_path / "baseline.yaml"  # the same experiment and arm name, another learning rate
    other.write_text(f"base: {REPO / 'experiments/00_tiny_moe_cpu/base.yaml'}\narm: baseline\ntrainer:\n  lr: 0.002\n")
    assert load_config(other, overrides(tmp_path)).run_dir == cfg.run_dir
    before = (cfg.run_dir / "metrics.jsonl").read_text()
    msg = fails_with([str(other), "--resume", *overrides(tmp_path)])
    assert f"{checkpoint_dirs(cfg.run_dir)[-1]} was written by a run of config hash " in msg
    assert "cannot resume it with another config" in msg
    assert (cfg.run_dir / "metrics.jsonl").read_text() == before


def test_no_leftover_after_a_kill_while_pruning_the_last_checkpoint(tmp_path, kill_at, reference_run):
    cfg = killed_run(tmp_path, kill_at, "prune", 2)  # deleting step_2 after step_4, the last, was saved
    assert (cfg.run_dir / "checkpoints" / ".step_2.deleting").exists()
    GRPOTrainer(cfg, cfg.run_dir, resume=True, progress=False).train()
    assert sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir()) == ["step_3", "step_4"]
    assert_identical_runs(reference_run, cfg.run_dir)


def test_keep_zero_keeps_every_checkpoint(tmp_path):
    """trainer.keep_checkpoints=0: a run measured along its whole length afterwards (07's drift null) keeps
    every checkpoint; the default prunes to the newest two."""
    from moerl.trainer.checkpoint import checkpoint_dirs

    for step in (1, 2, 3):
        weight = torch.nn.Parameter(torch.full((4,), float(step)))
        save_checkpoint(tmp_path / "all", step, {"w": weight}, torch.optim.AdamW([weight]), {}, keep=0)
        save_checkpoint(tmp_path / "two", step, {"w": weight}, torch.optim.AdamW([weight]), {})
    assert [p.name for p in checkpoint_dirs(tmp_path / "all")] == ["step_1", "step_2", "step_3"]
    assert [p.name for p in checkpoint_dirs(tmp_path / "two")] == ["step_2", "step_3"]
    # a config key that says how a run is kept, not what it computes: the run's identity is unchanged
    from moerl.config import config_hash

    kept = load_config(ARM, overrides(tmp_path) + ["trainer.keep_checkpoints=0"])
    assert kept.trainer.keep_checkpoints == 0
    assert config_hash(kept) == config_hash(load_config(ARM, overrides(tmp_path)))
