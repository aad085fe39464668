"""Fixtures of the fault suite (imported by its test files; a conftest.py here would shadow
tests/conftest.py, which tests import by name): a simulated kill and the uninterrupted reference run."""
from __future__ import annotations

import pytest


class Killed(BaseException):
    """Stands for SIGKILL inside this process: a BaseException, so no ``except Exception`` cleans up
    after it (the subprocess tests in test_kill_resume.py send the real signal)."""


@pytest.fixture
def kill_at(monkeypatch):
    """``kill_at("prune", 2)``: the 2nd time the trainer passes fault point ``prune``, raise Killed."""
    from moerl import faults

    def arm(point: str, n: int) -> None:
        seen = {"n": 0}

        def hit(name: str) -> None:
            if name == point:
                seen["n"] += 1
                if seen["n"] == n:
                    monkeypatch.setattr(faults, "hit", lambda name: None)
                    raise Killed(f"{point}:{n}")

        monkeypatch.setattr(faults, "hit", hit)

    return arm


def killed_run(tmp_path, kill_at, point: str, n: int):
    """The config of experiment 00's baseline (the fault suite's overrides) trained until ``kill_at``
    stops it at the ``n``-th pass of fault ``point``; its directory is left as the kill left it."""
    from kill_harness import overrides
    from moerl.config import load_config
    from moerl.trainer.grpo import GRPOTrainer

    cfg = load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml", overrides(tmp_path))
    kill_at(point, n)
    trainer = GRPOTrainer(cfg, cfg.run_dir, progress=False)
    with pytest.raises(Killed):
        trainer.train()
    trainer.tracker.close()
    return cfg


_REFERENCE: dict = {}  # one reference run per session, whichever module asks first


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """A 4-step run from the committed warm start, never interrupted."""
    if "run" not in _REFERENCE:
        from kill_harness import overrides
        from moerl.config import load_config
        from moerl.trainer.grpo import GRPOTrainer

        cfg = load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml", overrides(tmp_path_factory.mktemp("ref")))
        GRPOTrainer(cfg, cfg.run_dir, progress=False).train()
        _REFERENCE["run"] = cfg.run_dir
    return _REFERENCE["run"]
