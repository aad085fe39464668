"""Real SIGKILLs (MOERL_FAULT) of scripts/run.py at the trainer's fault points, then --resume until
the run finishes: the result is the uninterrupted run, bit for bit, wall-clock times aside."""
from __future__ import annotations

import signal

import pytest

import fault_fixtures
from kill_harness import assert_identical_runs, run_dir, run_with_kills, seeded_schedule

reference_run = fault_fixtures.reference_run  # the fixture, bound here so pytest finds it


def test_killed_run_resumes_identically(tmp_path, reference_run):
    # 1: killed writing checkpoint 2 (step 2's row is logged, its checkpoint is not: the row goes);
    # 2: resumed from step 1, killed deleting checkpoint 2 after checkpoint 4 was complete;
    # 3: resumed at the end (step 4's row carries the final evaluation): finishes, logs nothing twice.
    codes = run_with_kills(tmp_path, ["checkpoint_write:2", "prune:2"])
    assert codes == [-signal.SIGKILL, -signal.SIGKILL, 0]
    assert_identical_runs(reference_run, run_dir(tmp_path))


@pytest.mark.faults
@pytest.mark.parametrize("schedule", [
    # every point once; truncate:1 kills the resume that drops the row checkpoint_write:2 left behind
    ["step:2", "checkpoint_write:2", "truncate:1", "prune:1", "after_checkpoint:1", "final_eval:1"],
    *[seeded_schedule(seed, steps=4, kills=4) for seed in range(3)],
], ids=["every-point", "seed0", "seed1", "seed2"])
def test_kill_schedules(tmp_path, reference_run, schedule):
    codes = run_with_kills(tmp_path, schedule)
    assert codes[-1] == 0 and all(c in (0, -signal.SIGKILL) for c in codes)
    if schedule[0] == "step:2":  # the hand-made schedule reaches every point: each kill happens
        assert codes == [-signal.SIGKILL] * len(schedule) + [0]
    assert_identical_runs(reference_run, run_dir(tmp_path))
