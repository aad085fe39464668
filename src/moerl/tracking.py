"""Run tracking: metrics.jsonl is the source of truth (appended and flushed every step); wandb
mirrors it (offline by default, online when configured, ``disabled`` works).

A run directory holds everything needed to understand the run: the resolved config, the git SHA,
metrics.jsonl, summary.json and checkpoints. Nothing in it is ever rewritten in place: files are
replaced atomically, and on resume the rows after the restored checkpoint are dropped (they would
otherwise be logged twice) after the old file is kept as metrics.jsonl.bak.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import uuid
import warnings
from pathlib import Path

from moerl.config import ExperimentConfig, save_config, to_dict


def git_sha() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).parent).stdout.strip()
        # "-dirty" when code or configs that shape a run differ from the commit (docs do not count).
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/src", ":/experiments",
                                ":/scripts/run.py", ":/scripts/sweep.py", ":/requirements.txt"],
                               capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


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


class Tracker:
    def __init__(self, run_dir: Path, cfg: ExperimentConfig, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        if resume_step is not None:
            self._truncate_after(resume_step)
        save_config(cfg, self.run_dir / "config.yaml")
        atomic_write_text(self.run_dir / "git_sha.txt", git_sha() + "\n")
        self._fh = open(self.metrics_path, "a")
        self.wandb = self._init_wandb(cfg)

    def _truncate_after(self, step: int) -> None:
        if not self.metrics_path.exists():
            return
        text = self.metrics_path.read_text()
        rows = read_metrics(self.metrics_path)
        keep = [r for r in rows if r.get("step", -1) <= step]
        # Rewrite when rows follow the checkpoint or the crash left a half-written last line.
        if len(keep) != len(rows) or (text and not text.endswith("\n")):
            self.metrics_path.replace(self.metrics_path.with_suffix(".jsonl.bak"))
            atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in keep))

    def _init_wandb(self, cfg: ExperimentConfig):
        if cfg.tracking.wandb_mode == "disabled":
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
        self._fh.write(json.dumps(clean) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=row["step"])

    def write_summary(self, summary: dict) -> None:
        atomic_write_text(self.run_dir / "summary.json",
                          json.dumps({k: _jsonable(v) for k, v in summary.items()}, indent=2) + "\n")

    def close(self) -> None:
        self._fh.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
