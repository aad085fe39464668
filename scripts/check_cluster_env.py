"""Check one cluster node before a scale job starts: versions, CUDA, imports, the moerl plug-in.

    python scripts/check_cluster_env.py                  # on one node
    srun --ntasks-per-node=1 python scripts/check_cluster_env.py --gpus 8   # on every node of a job

Why: a multi-node job that dies after Ray start-up on an import error in one worker, or trains with
the wrong library version, wastes the whole allocation. Every pin in requirements/gpu.txt is compared
with what is installed, the packages built from source on the node are imported, CUDA and the GPU
count are checked, and moerl's verl plug-ins (policy losses, reward function) are imported the way
verl's Ray workers import them. Prints one line per check and ``fix:`` for each failure; exits 1 if
any check fails, 0 otherwise.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Built from source on the node (requirements/gpu.txt header): import name, distribution, version.
SOURCE_BUILT = (("megatron.bridge", "megatron-bridge", "0.6.2"),
                ("transformer_engine.pytorch", "transformer-engine", "2.20.2"),
                ("flash_attn", "flash-attn", "2.8.3"),
                ("fast_hadamard_transform", "fast-hadamard-transform", None))
IMPORTS = ("torch", "vllm", "verl", "megatron.core", "ray", "math_verify")


@dataclass
class Result:
    name: str
    ok: bool
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} [{self.name}] {self.detail}" + ("" if self.ok else f"; fix: {self.fix}")


def pins(requirements: Path) -> list[tuple[str, str]]:
    """(distribution, version) for every ``name==version`` line."""
    out = []
    for raw in requirements.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s;#]+)", raw)
        if m:
            out.append((m.group(1), m.group(2)))
    return out


def installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def check_python() -> Result:
    ok = sys.version_info[:2] == (3, 12)
    return Result("python", ok, f"Python {sys.version.split()[0]} (requirements/gpu.txt targets 3.12: "
                  f"Megatron-Bridge needs >=3.12,<3.13)", "use a Python 3.12 environment")


def _shown(path: Path) -> str:
    """A requirements file as a user types it from the checkout (requirements/gpu.txt)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def check_pins(requirements: Path) -> list[Result]:
    out = []
    for dist, want in pins(requirements):
        have = installed(dist)
        ok = have is not None and have.split("+")[0] == want
        out.append(Result(f"pin:{dist}", ok, f"{dist} {have or 'not installed'} (pinned {want})",
                          f"pip install -r {_shown(requirements)}"))
    return out


def check_source_built() -> list[Result]:
    out = []
    for module, dist, want in SOURCE_BUILT:
        have = installed(dist)
        try:
            importlib.import_module(module)
            err = None
        except Exception as e:  # an ImportError or a CUDA/ABI error from a bad build
            err = f"{type(e).__name__}: {e}"
        ok = err is None and (want is None or (have or "").split("+")[0] == want)
        how = (f"pip install --no-deps {dist}=={want}" if dist == "megatron-bridge" else
               f"pip install --no-build-isolation {dist}{'==' + want if want else ''}")
        out.append(Result(f"built:{dist}", ok, f"import {module}: {err or 'ok'}; {dist} {have or 'not installed'}"
                          + (f" (want {want})" if want else ""), how))
    return out


def check_imports() -> list[Result]:
    out = []
    for module in IMPORTS:
        try:
            importlib.import_module(module)
            out.append(Result(f"import:{module}", True, "ok"))
        except Exception as e:
            out.append(Result(f"import:{module}", False, f"{type(e).__name__}: {e}",
                              "pip install -r requirements/gpu.txt"))
    return out


def check_cuda(gpus: int | None) -> list[Result]:
    try:
        import torch
    except Exception as e:
        return [Result("cuda", False, f"torch does not import: {e}", "pip install -r requirements/gpu.txt")]
    avail = torch.cuda.is_available()
    n = torch.cuda.device_count() if avail else 0
    out = [Result("cuda", avail, f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                  f"cuda available={avail}", "a CUDA build of torch (requirements/gpu.txt) and a working driver")]
    if gpus is not None:
        out.append(Result("gpus", n >= gpus, f"{n} GPUs visible, the job wants {gpus} per node",
                          "check CUDA_VISIBLE_DEVICES and the SLURM --gpus-per-node request"))
    return out


def check_moerl_plugin() -> list[Result]:
    """moerl as verl's Ray workers see it: importable from the environment (not only from the
    driver's cwd), its losses registered with verl, the reward function loadable by path."""
    out = []
    try:
        import moerl

        where = Path(moerl.__file__).resolve().parent
        out.append(Result("moerl.installed", True, f"moerl from {where}"))
    except Exception as e:
        return [Result("moerl.installed", False, f"{type(e).__name__}: {e}",
                       "pip install --no-deps -e . in the repository, on every node (or the shared env)")]
    try:
        os.environ.setdefault("VERL_USE_EXTERNAL_MODULES", "moerl.verl_ext.losses")
        import moerl.verl_ext.losses  # noqa: F401  registers moerl_* with verl
        from verl.trainer.ppo.core_algos import get_policy_loss_fn

        get_policy_loss_fn("moerl_tis")
        out.append(Result("moerl.losses", True, "moerl_* policy losses registered with verl"))
    except Exception as e:
        out.append(Result("moerl.losses", False, f"{type(e).__name__}: {e}",
                          "install verl==0.9.1 and moerl in the same environment"))
    reward = Path(os.environ.get("MOERL_REPO", REPO)) / "src" / "moerl" / "verl_ext" / "reward_fn.py"
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location("moerl_reward_fn", reward)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert callable(mod.compute_score)
        out.append(Result("moerl.reward_fn", True, f"{reward} loads (verl reward.custom_reward_function.path)"))
    except Exception as e:
        out.append(Result("moerl.reward_fn", False, f"{reward}: {type(e).__name__}: {e}",
                          "set MOERL_REPO to the repository path visible on every node"))
    return out


def run_checks(requirements: Path, gpus: int | None, cuda: bool = True) -> list[Result]:
    res = [check_python(), *check_pins(requirements), *check_source_built(), *check_imports()]
    if cuda:
        res += check_cuda(gpus)
    return res + check_moerl_plugin()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requirements", type=Path, default=REPO / "requirements/gpu.txt")
    ap.add_argument("--gpus", type=int, help="GPUs this node must expose")
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA checks (e.g. on a login node)")
    args = ap.parse_args(argv)
    if not args.requirements.exists():
        print(f"error: {args.requirements} not found", file=sys.stderr)
        return 2
    results = run_checks(args.requirements, args.gpus, cuda=not args.no_cuda)
    host = os.uname().nodename
    for r in results:
        print(f"{host}: {r.line()}")
    failed = [r for r in results if not r.ok]
    print(f"{host}: {len(results) - len(failed)}/{len(results)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
