"""Run tracking: metrics.jsonl is the source of truth (appended and flushed every step); wandb
mirrors it (offline by default, online when configured, ``disabled`` works).

A run directory holds everything needed to understand the run: the resolved config, its identity
(run.json: the config hash a resume or a sweep must match), the machine it ran on (machine.json),
the git SHA, metrics.jsonl, summary.json and checkpoints. Nothing in it is ever rewritten in place: files are
replaced atomically (temporary file, fsync, rename), and on resume the rows after the restored checkpoint
are dropped (they would otherwise be logged twice) after a copy of the old file is kept as metrics.jsonl.bak.
A kill at any moment leaves metrics.jsonl with either all its old rows or exactly the kept ones. Before
that, a resume checks the rows it keeps (``check_logged_steps``): every step up to the checkpoint logged
exactly once, or the resume is refused naming the first step missing or logged twice.
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import subprocess
import sys
import uuid
import warnings
from pathlib import Path

from moerl import faults
from moerl.config import (ConfigError, ExperimentConfig, config_diff, config_hash, config_yaml, identity_dict,
                          load_config, to_dict, usable_cores)

log = logging.getLogger(__name__)

# CPU flags that select torch's bf16 kernels (oneDNN AMX / AVX512-BF16 paths): bf16 results differ
# between machines with and without them, while fp32 runs reproduce bit for bit.
BF16_FLAGS = ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx2")


# OpenMP settings that change CPU speed (not numerics): thread count and how idle threads wait.
OPENMP_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def machine_info() -> dict:
    """CPU model, bf16-relevant ISA flags, torch build, thread counts and the OpenMP settings of this
    process (``OMP_WAIT_POLICY=PASSIVE`` alone makes a 2-thread step about 1.9x slower on a small model)."""
    import torch

    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("unknown", "x86_64", ""):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu_model": model, "isa_flags": {f: f in flags for f in BF16_FLAGS},
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_version": torch.__version__, "torch_git": torch.version.git_version,
            "torch_cuda": torch.version.cuda, "mkldnn": torch.backends.mkldnn.is_available(),
            "torch_threads": torch.get_num_threads(), "usable_cores": usable_cores(),
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "platform": platform.platform(),
            "openmp_env": {k: os.environ.get(k) for k in OPENMP_ENV},
            # oneDNN's ISA cap: AVX2 makes an AMX CPU run the bf16 kernels an AVX2-only CPU has.
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
            # the GPUs this process sees (a checkpoint run with device=cuda computes on the first)
            "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else []}


def wandb_sync_command(run_dir: Path) -> str | None:
    """The one ``wandb sync`` command that uploads every offline wandb directory of a run as one wandb run.

    A resumed run keeps its wandb id (``wandb_id.txt``) but offline wandb starts a new directory per process
    (``wandb/offline-run-<time>-<id>``); ``wandb sync --id <id>`` syncs them in order of start time into
    that one run. None when the run has no offline wandb directory."""
    import shlex

    run_dir = Path(run_dir)
    id_file = run_dir / "wandb_id.txt"
    if not id_file.exists():
        return None
    run_id = id_file.read_text().strip()
    dirs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    if not dirs:
        return None
    paths = " ".join(shlex.quote(str(d)) for d in dirs)
    return f"wandb sync {paths}" if len(dirs) == 1 else f"wandb sync --id {run_id} {paths}"


class RunMismatchError(RuntimeError):
    """A run directory that holds a run of another config than the one asked for."""


def recorded_identity(run_dir: Path) -> dict | None:
    """The identity (flattened config without operational keys) a run directory was made with."""
    run_dir = Path(run_dir)
    if (run_dir / "run.json").exists():
        return json.loads((run_dir / "run.json").read_text())["identity"]
    if (run_dir / "config.yaml").exists():  # runs recorded before run.json existed
        try:
            return identity_dict(load_config(run_dir / "config.yaml"))
        except ConfigError:
            return None
    return None


def check_same_config(run_dir: Path, cfg: ExperimentConfig, action: str) -> None:
    """Refuse to ``action`` (resume, skip) a run recorded with another config, naming the keys."""
    recorded = recorded_identity(run_dir)
    if recorded is None:
        return
    diff = config_diff(recorded, identity_dict(cfg))
    if diff:
        shown = "; ".join(diff[:5]) + (f"; and {len(diff) - 5} more" if len(diff) > 5 else "")
        raise RunMismatchError(f"{run_dir} holds a run of another config, cannot {action} it ({shown}); "
                               f"use other overrides (they name the run), another tracking.output_dir, or --fresh")


def recorded_inputs(run_dir: Path) -> dict:
    """The content hashes of the inputs a run was made from (run.json ``inputs``; {} for a run that
    predates them)."""
    try:
        recorded = json.loads((Path(run_dir) / "run.json").read_text()).get("inputs")
    except (OSError, ValueError, AttributeError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def check_same_inputs(run_dir: Path, current: dict, action: str, recorded: dict | None = None,
                      where: str | None = None) -> None:
    """Refuse to ``action`` (resume, skip) a run made from inputs whose content has changed since, naming
    each changed input with its recorded and current sha256 (``recorded``: a checkpoint manifest's record;
    default the run's run.json)."""
    from moerl.identity import inputs_diff

    diff = inputs_diff(recorded_inputs(run_dir) if recorded is None else recorded, current)
    if diff:
        raise RunMismatchError(f"{where or run_dir} was made from inputs whose content changed since, cannot "
                               f"{action} it ({'; '.join(diff)}; sha256 recorded -> now): restore the file(s) it "
                               f"was made from, or start over with --fresh")


def git_sha() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).parent).stdout.strip()
        # "-dirty" when code or configs that shape a run differ from the commit (docs do not count).
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/src", ":/experiments",
                                ":/scripts/run.py", ":/scripts/sweep.py", ":/requirements/cpu.txt"],
                               capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that a kill leaves either the old or the new file, never a part."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (the directory entry itself), where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _jsonable(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


def read_metrics(path: Path, warn: bool = False) -> list[dict]:
    """Rows of a metrics.jsonl; a truncated last line (a killed run) is dropped (with a warning
    naming the file when ``warn``); a bad line anywhere else is an error naming file and line."""
    rows = []
    if not path.exists():
        return rows
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
            if warn:
                warnings.warn(f"{path}: last line {i + 1} is truncated (killed run?); ignored", stacklevel=3)
    return rows


def logged_seconds(rows: list[dict]) -> float:
    """A run's own logged run time: its steps' times plus its evaluations' (time/step leaves evaluation
    out), summed over its metrics rows."""
    return float(sum(row.get("time/step", 0.0) + row.get("time/eval", 0.0) for row in rows))


class MetricsLogError(RuntimeError):
    """A metrics.jsonl that does not hold the rows its checkpoint covers (a missing or duplicated step)."""


def check_logged_steps(path: Path, step: int, final_step: int) -> None:
    """metrics.jsonl of a run resumed from checkpoint ``step``: step 0's row (the initial evaluation) and
    one training row for each step 1..step, each once; besides, one evaluation-only row may follow the
    training row of ``final_step`` (the final evaluation). A MetricsLogError names the first step missing
    or logged twice: continuing would leave a hole or a duplicate in the run's record. A truncated last
    line is a row lost when it belongs to one of these steps, and then named too."""
    path = Path(path)
    text = path.read_text() if path.exists() else ""
    truncated = bool(text.strip()) and _last_line_is_broken(text)
    fix = (f"restore {path.name} (a resume keeps the file it replaced as {path.name}.bak) or start over with "
           f"--fresh")
    try:
        rows = read_metrics(path)
    except ValueError as err:
        raise MetricsLogError(f"{err}; {fix}") from None
    train, evals = {}, {}
    for i, row in enumerate(rows):
        s = row.get("step") if isinstance(row, dict) else None
        if not isinstance(s, int) or isinstance(s, bool):
            raise MetricsLogError(f"{path}: row {i + 1} has no integer 'step' ({str(row)[:80]}); expected one JSON "
                                  f"object per step")
        if s > step:
            continue
        kind = train if (s > 0 and "reward/mean" in row) else evals
        kind[s] = kind.get(s, 0) + 1
    for s in range(step + 1):
        n = evals.get(0, 0) if s == 0 else train.get(s, 0)
        if n == 0:
            hint = "; its last line is truncated (a kill while writing it?)" if truncated else ""
            raise MetricsLogError(f"{path}: no row for step {s}, which checkpoint step_{step} covers (steps 0..{step} "
                                  f"must each be logged once){hint}; {fix}")
        extra = evals.get(s, 0) if s > 0 else 0
        allowed = 1 if s == final_step else 0
        if n > 1 or extra > allowed:
            raise MetricsLogError(f"{path}: step {s} is logged {n + extra} times (steps 0..{step} must each be logged "
                                  f"once); {fix}")


def _last_line_is_broken(text: str) -> bool:
    try:
        json.loads([line for line in text.splitlines() if line.strip()][-1])
        return False
    except json.JSONDecodeError:
        return True


RUN_FORMAT = 2  # run.json "format": 2 = every checkpoint carries a manifest and the base-weights hash


class Tracker:
    def __init__(self, run_dir: Path, cfg: ExperimentConfig, resume_step: int | None = None,
                 base_hash: str | None = None, legacy_run: bool = False, inputs: dict | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        if resume_step is not None:
            self._truncate_after(resume_step)
        atomic_write_text(self.run_dir / "config.yaml", config_yaml(cfg))
        # base_hash: the content of the base weights the LoRA trains on; format: what the run's checkpoints
        # carry (a run continued from checkpoints written before manifests keeps reading as such).
        # inputs: the sha256 of each file the run reads (moerl.identity.inputs_record).
        record = {"run": cfg.run_name, "config_hash": config_hash(cfg), "base_hash": base_hash,
                  **({} if legacy_run else {"format": RUN_FORMAT}), "inputs": inputs or {},
                  "identity": identity_dict(cfg),
                  "registration": self._registration(cfg)}
        atomic_write_text(self.run_dir / "run.json", json.dumps(record, indent=1) + "\n")
        # The rollout's kernels decide whether its bf16 numbers depend on this machine (native) or not.
        self.machine = {**machine_info(), "rollout_dtype": cfg.rollout.dtype, "rollout_kernels": cfg.rollout.kernels}
        atomic_write_text(self.run_dir / "machine.json", json.dumps(self.machine, indent=2) + "\n")
        atomic_write_text(self.run_dir / "git_sha.txt", git_sha() + "\n")
        self._fh = open(self.metrics_path, "a")
        self.wandb = self._init_wandb(cfg)

    def _registration(self, cfg: ExperimentConfig) -> dict | None:
        """The experiment's registered-analysis file (hash, start time) as of the run's first start: a
        resume keeps what the run started under (moerl.analysis.registration)."""
        path = self.run_dir / "run.json"
        if path.exists():
            try:
                kept = json.loads(path.read_text()).get("registration")
            except json.JSONDecodeError:
                kept = None
            if kept or self.metrics_path.exists():
                return kept  # a run recorded before runs carried it stays without one
        from moerl.analysis.registration import registration_record

        return registration_record(cfg.experiment)

    @property
    def wandb_sync_dir(self) -> Path | None:
        """The offline wandb run directory (``wandb sync <it>`` uploads it), None when not offline."""
        if self.wandb is None or self.wandb.settings.mode != "offline":
            return None
        return Path(self.wandb.dir).parent

    def _truncate_after(self, step: int) -> None:
        if not self.metrics_path.exists():
            return
        text = self.metrics_path.read_text()
        rows = read_metrics(self.metrics_path)
        keep = [r for r in rows if r.get("step", -1) <= step]
        # Rewrite when rows follow the checkpoint or the crash left a half-written last line.
        if len(keep) != len(rows) or (text and not text.endswith("\n")):
            # The old file is copied, not moved: until the kept rows replace it (one rename), it stays whole.
            atomic_write_text(self.metrics_path.with_suffix(".jsonl.bak"), text)
            faults.hit("truncate")
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in keep))

    def _init_wandb(self, cfg: ExperimentConfig):
        if cfg.tracking.wandb_mode == "disabled":
            return None
        if os.environ.get("WANDB_MODE", "").strip().lower() == "disabled":
            # wandb.init(mode=...) would override the environment: the user's switch-off wins here.
            log.info("wandb disabled by WANDB_MODE=disabled in the environment "
                     "(tracking.wandb_mode=%s ignored)", cfg.tracking.wandb_mode)
            return None
        import wandb

        id_file = self.run_dir / "wandb_id.txt"
        # A stable id kept in the run directory: a resumed run continues the same wandb run.
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        atomic_write_text(id_file, run_id + "\n")
        os.environ.setdefault("WANDB_SILENT", "true")
        return wandb.init(project=cfg.tracking.wandb_project, entity=cfg.tracking.wandb_entity,
                          name=cfg.run_name, group=f"{cfg.experiment}/{cfg.arm}", id=run_id, resume="allow",
                          mode=cfg.tracking.wandb_mode, dir=str(self.run_dir), config=to_dict(cfg))

    def log(self, row: dict) -> None:
        clean = {k: _jsonable(v) for k, v in row.items()}
        try:
            self._fh.write(json.dumps(clean) + "\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except OSError as err:
            raise OSError(err.errno, f"could not append step {row.get('step')} to {self.metrics_path} "
                                     f"({err.strerror}); rows up to the last checkpoint resume with --resume") from err
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=row["step"])

    def write_summary(self, summary: dict) -> None:
        summary = {**summary, "machine": self.machine}
        atomic_write_text(self.run_dir / "summary.json",
                          json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2) + "\n")

    def close(self) -> None:
        self._fh.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
