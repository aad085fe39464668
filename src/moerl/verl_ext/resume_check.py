"""Before a verl run is launched again, verify what it would resume: the same run, a complete
checkpoint, one writer.

verl 0.9.1 resumes blindly. Under ``trainer.resume_mode: auto`` its trainer
(``verl/trainer/ppo/v1/trainer_base.py`` ``_load_checkpoint``; the legacy ``verl/trainer/ppo/
ray_trainer.py`` ``RayPPOTrainer._load_checkpoint`` is the same) asks ``find_latest_ckpt_path``
(``verl/utils/checkpoint/checkpoint_manager.py``) for the ``global_step_<N>`` named by
``latest_checkpointed_iteration.txt`` and loads it into whatever this launch configured. When the
tracker names a folder that is gone, ``find_latest_ckpt_path`` returns None and the run trains from
scratch in the same folder; when ``data.pt`` is missing ``_load_checkpoint`` warns and the data
restarts at the first batch. ``_save_checkpoint`` writes the tracker last, after the actor's shards
and ``data.pt``, so a ``global_step_<M>`` newer than the tracker's N is a save cut short.

So before ``main_ppo`` starts, the launcher (``moerl.verl_ext.launch.main``):

1. compares this launch with ``<checkpoint dir>/moerl_run.json``, written at the run's first launch
   (``IDENTITY``: base model fingerprint, LoRA, arm, seed, rollout dtype, replay mode, loss): a
   resume under another identity is refused with one line naming the key;
2. checks that the step it would resume holds every file verl's loader reads (``files_verl_loads``);
3. holds ``moerl.runlock``'s lock on the checkpoint directory for the life of ``main_ppo``, so a
   second launch of the same run and seed is refused naming the holder's PID. flock is per host
   unless the shared file system carries it across nodes (Lustre mounted with ``flock``, NFSv4; not
   ``localflock`` nor NFSv3 without a lock manager): elsewhere a second launch from another node is
   not stopped.

``inspect`` only reads, which is what a dry run reports; ``ResumeCheck.record_launch`` is the one
write, done by a real launch under the lock.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from moerl.verl_ext.compose import select

MANIFEST = "moerl_run.json"
FORMAT = 1
TRACKER = "latest_checkpointed_iteration.txt"  # verl: checkpoint_manager.py get_checkpoint_tracker_filename
STEP_DIR = re.compile(r"global_step_(\d+)")
REPO = Path(__file__).resolve().parents[3]

# What makes a checkpoint belong to this run, compared on every resume. A checkpoint holds LoRA
# factors and their Adam moments trained against one base model, with one adapter shape and scale,
# under one treatment (the arm: replay mode, loss, rollout precision) and one seed. Resuming it under
# another base, rank, alpha, target set or expert sharing either fails deep inside Megatron's loader
# or, worse, loads and silently continues a different function; under another arm, seed, rollout dtype
# or replay mode it loads fine and splices two treatments into one curve.
# Not identity, so a relaunch may change them: the model *path* (storage moves; its fingerprint is
# compared), the parallel layout (Megatron's dist checkpoints reshard on load), the step budget,
# learning-rate schedule, save and log settings, and the repository's git commit (fixes between
# relaunches are normal; each launch's commit is recorded in ``launches``).
IDENTITY_CONFIG_KEYS = (
    "actor_rollout_ref.model.lora.rank",
    "actor_rollout_ref.model.lora.alpha",
    "actor_rollout_ref.model.lora.target_modules",
    "actor_rollout_ref.model.lora.share_expert_adapters",
    "actor_rollout_ref.rollout.dtype",
    "actor_rollout_ref.actor.megatron.router_replay.mode",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay",
    "actor_rollout_ref.actor.policy_loss.loss_mode",
)
START_OVER = "start over with trainer.resume_mode=disable or a new trainer.experiment_name"


class ResumeRefused(RuntimeError):
    """A launch that would resume something other than this run's own complete checkpoint."""


def base_model_fingerprint(path: str | Path) -> dict[str, str]:
    """A cheap fingerprint of the base weights: the sha256 of ``config.json``, and the names and sizes
    of the ``*.safetensors`` shards plus the sha256 of their index, never the shards' bytes (Kimi-K2's
    are 2 TB). A hub id or a folder not on this machine is named as not fingerprinted."""
    p = Path(str(path))
    if not p.is_dir():
        missing = f"not fingerprinted: {path} is not a directory on this machine"
        return {"base_model.config_json": missing, "base_model.weights": missing}
    config = p / "config.json"
    config_id = (f"sha256 {hashlib.sha256(config.read_bytes()).hexdigest()[:16]}" if config.is_file()
                 else "no config.json")
    listing = hashlib.sha256()
    for index in sorted(p.glob("*.safetensors.index.json")):
        listing.update(f"{index.name}\0{hashlib.sha256(index.read_bytes()).hexdigest()}\n".encode())
    shards = sorted((f.name, f.stat().st_size) for f in p.glob("*.safetensors") if f.is_file())
    for name, size in shards:
        listing.update(f"{name}\0{size}\n".encode())
    weights = (f"{len(shards)} safetensors files, {sum(s for _, s in shards)} bytes, listing sha256 "
               f"{listing.hexdigest()[:16]}")
    return {"base_model.config_json": config_id, "base_model.weights": weights}


def run_identity(cfg, arm: str | None, seed: int | None) -> dict:
    """This launch's identity (``IDENTITY_CONFIG_KEYS`` by their verl config names, the base model's
    fingerprint, the arm and the launcher's ``--seed``), as JSON values."""
    from omegaconf import OmegaConf

    out = base_model_fingerprint(select(cfg, "actor_rollout_ref.model.path"))
    for key in IDENTITY_CONFIG_KEYS:
        value = select(cfg, key)
        out[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    out["moerl.arm"] = arm
    out["moerl.seed"] = seed
    return out


def files_verl_loads(cfg) -> list[str]:
    """What verl's loader reads from ``global_step_<N>``, relative to it, for this config.

    ``_load_checkpoint`` loads ``actor/`` and ``data.pt``; the actor's
    ``MegatronCheckpointManager.load_checkpoint`` (``verl/utils/checkpoint/megatron_checkpoint_manager.py``)
    reads, per ``actor.checkpoint.load_contents``: ``model`` from ``actor/model/dist_ckpt`` for a LoRA
    run (PEFT adapter shards) or with ``use_dist_checkpointing``, else the HF tree
    ``actor/model/huggingface``; ``optimizer`` from ``actor/optimizer/dist_ckpt``; ``extra`` (RNG
    states) from ``actor/extra/dist_ckpt``. A Megatron-Core dist checkpoint is complete once its
    ``metadata.json`` exists: ``dist_checkpointing.save`` writes it last and ``load`` refuses a folder
    without it (``megatron/core/dist_checkpointing/serialization.py`` ``save``, ``validation.py``
    ``verify_checkpoint_and_load_strategy``). Megatron-FSDP keeps one DTensor checkpoint at
    ``actor/model/dist_ckpt`` read through its ``.metadata``. ``data.pt`` is optional to verl (it
    warns and restarts the data) but required here: without it the resumed run repeats its first
    batches. GRPO trains no critic, so none is looked for."""
    a = "actor_rollout_ref.actor."
    contents = list(select(cfg, a + "checkpoint.load_contents") or [])
    if select(cfg, a + "megatron.use_megatron_fsdp"):
        return ["actor/model/dist_ckpt/.metadata", "data.pt"]
    lora = int(select(cfg, "actor_rollout_ref.model.lora.rank") or 0) > 0
    dist = bool(select(cfg, a + "megatron.use_dist_checkpointing"))
    meta = "dist_ckpt/metadata.json"
    out = []
    if "model" in contents:
        out.append(f"actor/model/{meta}" if lora or dist else "actor/model/huggingface")
    if "hf_model" in contents:
        out.append("actor/model/huggingface")
    out += [f"actor/{part}/{meta}" for part in ("optimizer", "extra") if part in contents]
    return out + ["data.pt"]


def _missing(step_dir: Path, needed: list[str]) -> list[str]:
    return [rel for rel in needed if not (step_dir / rel).exists()]


def _steps(run_dir: Path) -> dict[int, Path]:
    if not run_dir.is_dir():
        return {}
    return {int(m.group(1)): p for p in run_dir.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()}


@dataclass
class ResumeCheck:
    """What a launch would do with its checkpoint directory (found by ``inspect``, nothing written)."""

    run_dir: Path
    identity: dict
    resumes: Path | None = None  # the global_step_<N> verl would load; None: the run starts from scratch
    recorded: dict | None = None  # the manifest beside it, when it was compared
    adopted: bool = False  # resumed without a manifest because --adopt-checkpoint said so
    notes: list[str] = field(default_factory=list)
    starts_over: bool = False  # trainer.resume_mode=disable: the earlier run's files move aside at launch

    @property
    def manifest(self) -> Path:
        return self.run_dir / MANIFEST

    def summary(self, dry_run: bool = False) -> str:
        if self.resumes is None:
            return (f"{self.run_dir}: starts from scratch; {'a launch records' if dry_run else 'recorded'} this run "
                    f"in {MANIFEST}")
        how = ("identity not verified (--adopt-checkpoint): this launch's is recorded" if self.adopted
               else f"same run as {MANIFEST} records ({len(self.identity)} identity keys)")
        return f"{self.run_dir}: resumes {self.resumes.name}, complete; {how}"

    def record_launch(self, now: datetime | None = None) -> Path:
        """Write ``moerl_run.json`` (atomically: temp file, then rename): the identity and this launch
        appended to ``launches`` on a resume of the same folder; a fresh record otherwise."""
        launch = {"utc": (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ"),
                  "git_commit": _git_commit(), "host": socket.gethostname(), "pid": os.getpid(),
                  "resumes": str(self.resumes) if self.resumes else None}
        if self.adopted:
            launch["adopted_unverified_checkpoint"] = True
        same_folder = self.resumes is not None and self.resumes.parent == self.run_dir
        if self.recorded is not None and same_folder:
            data = {**self.recorded, "launches": list(self.recorded.get("launches", [])) + [launch]}
        else:
            data = {"format": FORMAT, "identity": self.identity, "launches": [launch]}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.manifest.with_name(f".{MANIFEST}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(self.manifest)
        return self.manifest


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def run_dir_of(cfg) -> Path:
    """``trainer.default_local_dir``, absolute (the launcher writes it so; a relative one given on the
    command line is taken from the repository, the launcher's working directory for main_ppo)."""
    p = Path(str(select(cfg, "trainer.default_local_dir")))
    return p if p.is_absolute() else (REPO / p).resolve()


def inspect(cfg, arm: str | None = None, seed: int | None = None, adopt: bool = False) -> ResumeCheck:
    """What this launch would resume, verified; raises ResumeRefused with one line otherwise. Reads only."""
    run_dir = run_dir_of(cfg)
    check = ResumeCheck(run_dir, run_identity(cfg, arm, seed))
    mode = str(select(cfg, "trainer.resume_mode"))
    steps = _steps(run_dir)
    if mode == "disable":
        check.starts_over = True
        earlier = _entries(run_dir)
        if earlier:
            check.notes.append(f"trainer.resume_mode=disable: starts over in {run_dir}; a launch moves its "
                               f"{len(earlier)} earlier entries ({', '.join(p.name for p in earlier[:4])}"
                               f"{', ...' if len(earlier) > 4 else ''}) aside to {run_dir.name}.before-<UTC time>, "
                               f"so a later resume_mode=auto relaunch cannot resume the earlier run")
        return check
    needed = files_verl_loads(cfg)
    if mode == "resume_path":
        step_dir = Path(str(select(cfg, "trainer.resume_from_path")))
        step_dir = step_dir if step_dir.is_absolute() else (REPO / step_dir).resolve()
        if not step_dir.is_dir():
            raise ResumeRefused(f"trainer.resume_from_path={step_dir}: no such folder; verl would fail to load it; "
                                f"name an existing global_step_<N> or {START_OVER}")
    elif mode == "auto":
        step_dir = _tracked_step(run_dir, steps, needed, check)
        if step_dir is None:
            return check
    else:
        raise ResumeRefused(f"trainer.resume_mode={mode}: verl knows auto, resume_path and disable")
    lacking = _missing(step_dir, needed)
    if lacking:
        raise ResumeRefused(f"{step_dir}: lacks {', '.join(lacking)}, which verl's loader reads to resume it (a save "
                            f"cut short or files removed since); {START_OVER}")
    check.resumes = step_dir
    _compare_identity(check, step_dir.parent / MANIFEST, adopt)
    return check


def _entries(run_dir: Path) -> list[Path]:
    return sorted(run_dir.iterdir()) if run_dir.is_dir() else []


def move_earlier_run_aside(check: ResumeCheck, now: datetime | None = None) -> Path | None:
    """Under ``trainer.resume_mode=disable``, move everything in the run's folder (steps, verl's tracker,
    ``moerl_run.json``) into the sibling ``<run>.before-<UTC time>/``; return it (None: nothing to move).

    verl 0.9.1 starting over leaves the earlier steps and ``latest_checkpointed_iteration.txt`` in place
    until its own saves overwrite them, so a start-over that fails before its first save, relaunched
    with ``resume_mode: auto``, would resume the earlier run's last step under the new run's logs. The
    entries move one by one, not the folder: the launch holds a lock on the folder itself (moerl.runlock).
    Call under that lock; nothing is deleted."""
    if not check.starts_over:
        return None
    earlier = _entries(check.run_dir)
    if not earlier:
        return None
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    n = 0
    while (dest := check.run_dir.with_name(f"{check.run_dir.name}.before-{stamp}" + (f"-{n}" if n else ""))).exists():
        n += 1
    dest.mkdir()
    for entry in earlier:
        entry.rename(dest / entry.name)  # same file system: atomic per entry
    return dest


def _tracked_step(run_dir: Path, steps: dict[int, Path], needed: list[str], check: ResumeCheck) -> Path | None:
    """The step ``resume_mode: auto`` loads (None: verl starts from scratch), as ``find_latest_ckpt_path``
    finds it, and a note on the folders it leaves alone."""
    tracker = run_dir / TRACKER
    if not tracker.is_file():
        complete = [p for _, p in sorted(steps.items()) if not _missing(p, needed)]
        if complete:
            raise ResumeRefused(f"{run_dir}: {complete[-1].name} is complete but {TRACKER} is missing, so verl would "
                                f"train from scratch over it; restore the tracker (echo "
                                f"{STEP_DIR.fullmatch(complete[-1].name).group(1)} > {tracker}) or {START_OVER}")
        if steps:
            check.notes.append(f"left alone: {', '.join(p.name for _, p in sorted(steps.items()))} in {run_dir} "
                               f"(saves cut short before any {TRACKER}); verl starts from scratch and overwrites "
                               f"them as it saves")
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ResumeRefused(f"{tracker}: holds {text[:40]!r}, expected a step number (verl's find_latest_ckpt_path "
                            f"reads int(...)); {START_OVER}")
    step = int(text)
    step_dir = run_dir / f"global_step_{step}"
    if not step_dir.is_dir():
        raise ResumeRefused(f"{tracker}: names step {step} but {step_dir.name} is missing, so verl would train from "
                            f"scratch in this folder; {START_OVER}")
    newer = [p.name for n, p in sorted(steps.items()) if n > step]
    if newer:
        check.notes.append(f"left alone: {', '.join(newer)} in {run_dir}, newer than {TRACKER}'s step {step} "
                           f"(a save cut short); verl resumes {step_dir.name} and overwrites them as it saves")
    return step_dir


def _compare_identity(check: ResumeCheck, manifest: Path, adopt: bool) -> None:
    if not manifest.is_file():
        if adopt:
            check.adopted = True
            return
        raise ResumeRefused(f"{manifest}: missing, so nothing says {check.resumes.name} was trained with this base "
                            f"model, LoRA, arm and seed; pass --adopt-checkpoint to resume it and record this "
                            f"launch's identity, or {START_OVER}")
    try:
        recorded = json.loads(manifest.read_text())
        old = recorded["identity"]
        assert isinstance(old, dict)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise ResumeRefused(f"{manifest}: not a {MANIFEST} this launcher wrote (JSON with an 'identity' mapping "
                            f"expected); {START_OVER}") from None
    differ = [k for k in check.identity if k in old and old[k] != check.identity[k]]
    if differ:
        key, more = differ[0], differ[1:]
        also = f" (and {len(more)} more: {', '.join(more)})" if more else ""
        raise ResumeRefused(f"{manifest}: {key} was {json.dumps(old[key])} when this run started, this launch has "
                            f"{json.dumps(check.identity[key])}{also}; resuming {check.resumes.name} would continue "
                            f"that run under another setting; {START_OVER}")
    unrecorded = [k for k in check.identity if k not in old]
    if unrecorded:
        check.notes.append(f"not compared (the run's first launch did not record them): {', '.join(unrecorded)}")
    check.recorded = recorded
