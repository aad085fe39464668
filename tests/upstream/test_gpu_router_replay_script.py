"""The prepared GPU check (scripts/gpu_router_replay.sh) where it can run without a GPU.

All in the cluster-pin venv only (Python 3.12, megatron-core 0.19.2, the versions the GPU machine gets; run
by ``scripts/test_upstream.sh mcore``, not in CI, where a fresh interpreter importing megatron-core and verl
would add ~25 s):
- verl's replay modules import without Ray (tests/upstream/verl_without_ray.py), as they must on the GPU
  machine, which cannot carry Ray's wheel;
- a CUDA request where torch sees none is refused in one line before anything is written;
- ``MOERL_TEST_DEVICE=cpu`` runs the same steps as on the GPU: the carried wheels verified and installed
  offline, the replay tests, the JSON and the PNG.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_router_replay.sh"
WHEELS = REPO / ".whl"
PLOT_PYTHON = Path(os.environ.get("MOERL_PLOT_PYTHON", REPO / ".venv" / "bin" / "python"))


def _torch_sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


cluster_pins = pytest.mark.skipif(
    sys.version_info[:2] != (3, 12) or importlib.util.find_spec("megatron") is None,
    reason="the cluster-pin venv only (Python 3.12 with megatron-core; scripts/test_upstream.sh mcore)")


@cluster_pins
def test_verls_replay_modules_import_without_ray():
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import verl_without_ray
verl_without_ray.install()
import verl.utils.megatron.router_replay_patch as patch, verl.utils.megatron.router_replay_utils as utils
import verl.models.mcore.util as util
assert not any(m == "ray" or m.startswith("ray.") for m in sys.modules), "ray was imported"
assert utils.RouterReplay is patch.RouterReplay and callable(util.preprocess_thd_engine)
try:
    import ray
except ImportError as err:
    print("refused:", err)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: import 'ray' refused" in done.stdout


def _run(out: Path, device: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MOERL_TEST_DEVICE": device, "PYTHON": sys.executable,
           "MOERL_MCORE_VENV": str(Path(sys.executable).parents[1]), "MOERL_PLOT_PYTHON": str(PLOT_PYTHON),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO)


@cluster_pins
def test_a_cuda_request_without_cuda_is_refused_in_one_line(tmp_path):
    if _torch_sees_cuda():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "out"
    done = _run(out, "cuda")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"[gpu-router-replay] error: MOERL_TEST_DEVICE=cuda but {sys.executable}'s torch sees no CUDA device; "
        "use MOERL_TEST_DEVICE=cpu to rehearse"]
    assert not out.exists()


@cluster_pins
@pytest.mark.slow
def test_the_cpu_rehearsal_writes_the_report_and_the_figure(tmp_path):
    if not (WHEELS / "SHA256SUMS").exists() or not PLOT_PYTHON.exists():
        pytest.skip("needs .whl (scripts/device_wheels.sh) and a Python with matplotlib (.venv)")
    done = _run(tmp_path, "cpu")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads((tmp_path / "router_replay.json").read_text())
    assert report["complete"] and report["device"]["type"] == "cpu" and report["process_group"] == "gloo"
    assert report["versions"]["megatron-core"] == "0.19.2" and report["versions"]["verl"] == "0.9.1"
    assert report["passed"] == 4 and report["failed"] == 0
    assert "ray" not in report["loaded_distributions"]
    r3 = next(t for t in report["tests"] if "test_r3_" in t["nodeid"])["properties"]["r3_replay_counts"]
    assert all(c["router_followed"] == c["replayed_rows"] > c["native_agreed"] for c in r3)
    assert (tmp_path / "router_replay.png").read_bytes()[:4] == b"\x89PNG"
    assert "4 passed" in (tmp_path / "router_replay.log").read_text()
