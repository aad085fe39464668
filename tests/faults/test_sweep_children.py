"""scripts/sweep.py owns its runs: a sweep ended by SIGTERM, SIGINT or SIGKILL leaves no run of it
training (a re-run would otherwise put a second writer into its directory)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kill_harness import REPO

# A stand-in for scripts/run.py and scripts/warm_start.py: says who it is, then trains "forever".
SLEEPER = '''
import os, sys, time
from pathlib import Path
Path(sys.argv[0]).with_name("pids").joinpath(str(os.getpid())).write_text(" ".join(sys.argv))
time.sleep(300)
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has ended (in a container nobody may reap it)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.faults)],
                         ids=["kill", "term", "int"])
def test_a_stopped_sweep_leaves_no_run_training(tmp_path, sig):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    (tmp_path / "pids").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    sweep = subprocess.Popen([sys.executable, str(REPO / "scripts" / "sweep.py"), "experiments/00_tiny_moe_cpu",
                              "--arms", "baseline", "--seeds", "1", "--jobs", "1", "--output-dir", str(tmp_path / "runs"),
                              "--run-script", str(script), "--warm-start-script", str(script)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not any((tmp_path / "pids").iterdir()):
            assert sweep.poll() is None and time.monotonic() < deadline, sweep.stdout.read()
            time.sleep(0.1)
        child = int(next((tmp_path / "pids").iterdir()).name)
        assert _alive(child)
        sweep.send_signal(sig)
        sweep.wait(timeout=30)
        deadline = time.monotonic() + 15
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), f"the sweep's run {child} outlived the sweep ({sig.name})"
    finally:
        sweep.kill()
        for pid in [int(p.name) for p in (tmp_path / "pids").iterdir()]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_no_seeds_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "sweep.py"), "experiments/00_tiny_moe_cpu",
                           "--seeds", "0", "--output-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == "--seeds 0: expected at least one seed, none negative (--seeds N runs seeds 0..N-1)"
    assert not any(tmp_path.iterdir())
