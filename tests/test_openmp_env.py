"""The OpenMP wait policy: recorded with every run and bench, and warned about where it slows a run."""
import logging

import pytest

from moerl.tracking import machine_info
from moerl.trainer.grpo import warn_busy_cores, warn_passive_openmp


def test_machine_info_records_the_openmp_settings(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = machine_info()["openmp_env"]
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["GOMP_SPINCOUNT"] is None


@pytest.mark.parametrize("policy, threads, warned", [
    ("PASSIVE", 2, True), ("passive", 4, True), ("PASSIVE", 1, False), ("ACTIVE", 2, False), (None, 2, False)])
def test_passive_wait_on_several_threads_is_warned_about(monkeypatch, caplog, policy, threads, warned):
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    with caplog.at_level(logging.WARNING, logger="moerl.trainer.grpo"):
        warn_passive_openmp(threads)
    assert ("OMP_WAIT_POLICY=PASSIVE" in caplog.text) is warned


@pytest.mark.parametrize("threads, load, cores, warned", [
    (2, 1.0, 2, True), (2, 0.1, 2, False), (1, 3.0, 2, False), (4, 0.2, 16, False), (8, 10.0, 16, True)])
def test_threads_on_busy_cores_are_warned_about(caplog, threads, load, cores, warned):
    with caplog.at_level(logging.WARNING, logger="moerl.trainer.grpo"):
        warn_busy_cores(threads, load=load, cores=cores)
    assert ("threads will share cores" in caplog.text) is warned
