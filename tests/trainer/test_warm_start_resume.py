"""A killed warm start continues from its saved SFT progress and ends on the same weights, bit for bit, as
one that ran through (experiment 06's wide geometries train for hours on one thread)."""
from __future__ import annotations

import logging

import pytest

from moerl import faults
from moerl.config import load_config
from moerl.trainer import warm_start


def _cfg(tmp_path, **extra):
    overrides = ["model.init_std=0.1", "data.train_size=64", "data.test_size=4", "warm_start.steps=6",
                 "warm_start.batch_size=4", "rollout.max_new_tokens=4", f"warm_start.cache_dir={tmp_path}",
                 *[f"{k}={v}" for k, v in extra.items()]]
    return load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml", overrides)


class Killed(Exception):
    pass


def test_a_killed_sft_continues_to_the_same_weights(tmp_path, monkeypatch, caplog):
    cfg = _cfg(tmp_path / "through")
    through = warm_start.warm_start_dir(cfg)
    warm_start.train_warm_start(cfg, through, progress=False)

    cfg = _cfg(tmp_path / "killed")
    out = warm_start.warm_start_dir(cfg)
    monkeypatch.setattr(warm_start, "PROGRESS_EVERY_SECONDS", 0.0)  # save after every step
    saves = []

    def kill_at_third_save(point):
        saves.append(point)
        if len(saves) == 3:
            raise Killed

    monkeypatch.setattr(faults, "hit", kill_at_third_save)
    with pytest.raises(Killed):
        warm_start.train_warm_start(cfg, out, progress=False)
    progress = warm_start._progress_path(out)
    assert progress.exists() and not out.exists()
    monkeypatch.setattr(faults, "hit", lambda point: None)
    with caplog.at_level(logging.INFO, logger="moerl.trainer.warm_start"):
        meta = warm_start.train_warm_start(cfg, out, progress=False)
    assert meta["steps"] == 6
    # without a progress bar, each save is a log line a reader of a sweep's log can follow
    assert "warm start: step 4 of 6 saved" in caplog.text and "min to go" in caplog.text
    assert (out / "model.safetensors").read_bytes() == (through / "model.safetensors").read_bytes()
    assert not progress.exists()  # the finished warm start replaces its progress


def test_progress_of_another_configuration_is_not_used(tmp_path, monkeypatch, caplog):
    cfg = _cfg(tmp_path)
    out = warm_start.warm_start_dir(cfg)
    other = _cfg(tmp_path, **{"warm_start.lr": 0.01})
    monkeypatch.setattr(warm_start, "PROGRESS_EVERY_SECONDS", 0.0)
    monkeypatch.setattr(faults, "hit", lambda point: (_ for _ in ()).throw(Killed))
    with pytest.raises(Killed):
        warm_start.train_warm_start(other, out, progress=False)  # progress saved under another key
    monkeypatch.setattr(faults, "hit", lambda point: None)
    reference = warm_start.warm_start_dir(_cfg(tmp_path / "ref"))
    warm_start.train_warm_start(_cfg(tmp_path / "ref"), reference, progress=False)
    with caplog.at_level(logging.WARNING, logger="moerl.trainer.warm_start"):
        warm_start.train_warm_start(cfg, out, progress=False)
    assert "another configuration" in caplog.text
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
