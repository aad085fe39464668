"""The cluster install path: requirements/gpu.txt, the Dockerfile, the sbatch template, the
launch scripts and scripts/check_cluster_env.py agree with one another and fail with a fix."""
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import check_cluster_env as cce  # noqa: E402

REQ = (REPO / "requirements/gpu.txt").read_text()
DOCKER = (REPO / "docker" / "Dockerfile").read_text()
SBATCH = (REPO / "scripts" / "slurm_verl.sbatch").read_text()


def _header_steps():
    return [m.group(1).strip() for m in re.finditer(r"^#   (pip install .*?)(?:\s+#.*)?$", REQ, re.M)]


def test_source_only_packages_are_not_resolver_requirements():
    """fast-hadamard-transform and flash-attn have no wheels: as plain lines they break the resolver."""
    lines = [x.split("#")[0].strip() for x in REQ.splitlines()]
    names = {re.split(r"[=<>\[ ]", x)[0].lower() for x in lines if x}
    assert not names & {"fast-hadamard-transform", "flash-attn", "transformer-engine", "transformer_engine",
                        "megatron-bridge"}
    assert "nvidia-resiliency-ext==0.4.1" in lines  # the manylinux_2_31 wheel


def test_dockerfile_runs_the_header_steps_in_order():
    steps = _header_steps()
    assert len(steps) == 6 and steps[-1] == "pip install --no-deps -e ."
    runs = [m.group(1).strip() for m in re.finditer(r"^RUN python -m (pip install .*)$", DOCKER, re.M)]
    assert runs == steps
    for src in re.findall(r"^COPY (.+) \./?\S*$", DOCKER, re.M):
        for part in src.split():
            assert (REPO / part).exists(), part
    assert "check_cluster_env.py --no-cuda" in DOCKER


def test_source_built_packages_match_the_checker():
    built = {s.split()[-1].strip('"').split("==")[0].replace("transformer_engine[pytorch]", "transformer-engine")
             for s in _header_steps() if "--no-build-isolation" in s or "megatron-bridge" in s}
    assert built == {dist for _, dist, _ in cce.SOURCE_BUILT}


def test_sbatch_output_dir_exists_and_nodes_are_checked_before_ray():
    out = re.search(r"^#SBATCH --output=(\S+)", SBATCH, re.M).group(1)
    assert "/" not in out  # SLURM opens it before the script could create a directory
    assert SBATCH.index("check_cluster_env.py") < SBATCH.index("ray start")
    assert "--ntasks-per-node=1" in SBATCH.split("check_cluster_env.py")[0].splitlines()[-1]


@pytest.mark.parametrize("exp", ["01_kimi_k2_lora_grpo", "02_kimi_k2_lora_grpo_r3",
                                 "03_qwen3_30b_a3b_lora_mitigations", "04_moonlight_16b_a3b_r3"])
def test_launch_scripts_require_installed_moerl(exp, tmp_path):
    """Run under a Python without moerl (an empty venv-less interpreter stand-in), each launcher stops with
    the fix, naming the Python it was given, before composing anything."""
    import subprocess

    fake = tmp_path / "python-without-moerl"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")  # -S: no site-packages, no moerl
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "experiments" / exp / "launch.sh"), "--dry-run"],
                          env={"PATH": "/usr/bin:/bin", "PYTHON": str(fake)}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1
    assert "moerl is not installed" in proc.stderr and f"{fake} -m pip install --no-deps -e ." in proc.stderr


def test_check_cluster_env_names_the_fix(tmp_path, capsys):
    import yaml  # installed in every environment that runs the tests

    req = tmp_path / "req.txt"
    req.write_text(f"pyyaml=={yaml.__version__}\nverl==0.0.1\n")
    res = {r.name: r for r in cce.check_pins(req)}
    assert res["pin:pyyaml"].ok
    assert not res["pin:verl"].ok and "pinned 0.0.1" in res["pin:verl"].detail
    assert f"fix: pip install -r {req}" in res["pin:verl"].line()  # outside the checkout: the full path
    repo_pins = {r.name: r for r in cce.check_pins(REPO / "requirements" / "gpu.txt")}
    assert all("pip install -r requirements/gpu.txt" in r.line() for r in repo_pins.values() if not r.ok)
    plugin = {r.name: r for r in cce.check_moerl_plugin()}
    assert plugin["moerl.installed"].ok and plugin["moerl.losses"].ok and plugin["moerl.reward_fn"].ok
    assert cce.main(["--requirements", str(req), "--no-cuda"]) == 1  # verl 0.0.1 is not installed here
    assert "FAIL [pin:verl]" in capsys.readouterr().out


def test_transformer_engines_runtime_requirements_resolve_with_the_rest():
    """TE's setup_requirements + build_tools/pytorch.py install_requirements are resolver lines, and the
    [megatron] extra's apex / nvidia-mathdx are explained rather than silently missing."""
    lines = {re.split(r"[=<>\[ ]", x.split("#")[0].strip())[0].lower() for x in REQ.splitlines()
             if x.split("#")[0].strip()}
    assert {"pydantic", "importlib-metadata", "onnxscript", "onnx", "nvdlfw-inspect", "nvidia-cudnn-frontend",
            "einops"} <= lines
    assert "apex" not in lines and "nvidia-mathdx" not in lines
    assert "build-pytorch-wheel/build.sh:14" in REQ and "not NVIDIA Apex" in REQ
