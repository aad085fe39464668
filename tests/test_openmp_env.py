"""The OpenMP wait policy: recorded with every run and bench, and warned about where it slows a run."""
import logging

import pytest

from moerl.tracking import machine_info
from moerl.trainer.grpo import warn_passive_openmp


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
