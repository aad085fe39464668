"""Checkpoints that make an interrupted run resume exactly: LoRA weights, optimizer, RNG states,
data position, refit version and step. Written to a temp directory and renamed, so a crash
mid-save leaves the previous checkpoint intact; the newest ``keep`` are kept. Pruning renames a
checkpoint aside before deleting it, and leftovers of a crash (temp or half-deleted directories)
are removed at the next save or resume, so a kill at any moment leaves nothing that looks like a
checkpoint but is not one, and nothing that is never cleaned up.

Each checkpoint ends with ``manifest.json``, written last: the xxh3-64 checksum of every file, the
config hash of the run and the content hash of the base weights the LoRA was trained on. A resume
verifies it and, when a file was damaged afterwards (a flipped bit, a truncated copy, a lost
manifest), falls back to the previous intact checkpoint with a warning naming the damaged one. A
checkpoint without a manifest loads unverified only in a run that predates manifests (its run.json
records no ``format`` and none of its checkpoints has one) or when asked to (``--unverified-checkpoint``).
Only ``step_<N>`` directories are checkpoints; anything else under ``checkpoints/`` is left alone.

No file of a checkpoint is unpickled: the optimizer state is a safetensors file (its non-tensor part as
JSON in the header) and the RNG states are JSON (``moerl.trainer.state_files``), since a manifest proves
integrity, not origin. Checkpoints written before that (``optimizer.pt``, ``rng.pt``) are read by torch's
restricted unpickler, which refuses any file that asks to construct something other than tensors,
containers, numbers, strings or numpy arrays.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file, save_file

from moerl import faults
from moerl.trainer.state_files import load_state, rng_state, save_state, set_rng_state, unpickle_legacy_state


log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
OPTIMIZER, RNG = "optimizer.safetensors", "rng.json"  # no pickle: reading a checkpoint runs no code
LEGACY_OPTIMIZER, LEGACY_RNG = "optimizer.pt", "rng.pt"  # older checkpoints: restricted unpickler only
_STEP = re.compile(r"step_(\d+)")
_LEFTOVER = re.compile(r"\.step_\d+\.(tmp|deleting)")
_WARNED: set[Path] = set()  # stray names already reported by this process


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or resumed from; the message names the path."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files differ from its manifest or cannot be read."""


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints (``state.json`` is written last, inside the temp directory), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    done = [p for p in _step_entries(root) if (p / "state.json").exists()]
    return sorted(done, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    """N of ``checkpoints/step_N``."""
    return int(_STEP.fullmatch(Path(path).name).group(1))


def _step_entries(root: Path) -> list[Path]:
    """The ``step_<N>`` directories under ``root``; any other ``step_*`` entry (a user's ``step_9.bak``)
    is named once in a warning and neither loaded nor deleted."""
    out = []
    for p in root.glob("step_*"):
        if _STEP.fullmatch(p.name) and p.is_dir():
            out.append(p)
        elif p not in _WARNED:
            _WARNED.add(p)
            log.warning("%s is not a checkpoint (checkpoints are directories named step_<N>): ignored, left as it is",
                        p)
    return out


def incomplete_dirs(run_dir: Path) -> list[Path]:
    """What a crash can leave behind: temp writes, directories being pruned, step dirs without
    state.json (pruned by an older version that deleted in place)."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    return sorted([p for p in root.glob(".step_*") if p.is_dir() and _LEFTOVER.fullmatch(p.name)]
                  + [p for p in _step_entries(root) if not (p / "state.json").exists()])


def _first_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def save_checkpoint(run_dir: Path, step: int, trainable: dict[str, torch.Tensor], optimizer, state: dict,
                    keep: int = 2, export=None, config_hash: str | None = None, base_hash: str | None = None,
                    inputs: dict | None = None) -> Path:
    """Write ``checkpoints/step_<step>`` atomically (temp dir, then rename) and prune to the newest ``keep``
    (0: keep every one).
    ``export(dir)``, if given, writes extra files into the checkpoint before it is published (the
    trainer writes the LoRA there as PEFT / vLLM adapters). ``config_hash`` goes into the manifest:
    a resume with another config is refused even when run.json and config.yaml are gone; ``base_hash`` (the
    content hash of the base weights, ``moerl.trainer.warm_start.weights_hash``) too: a resume on another
    base is refused; ``inputs`` (moerl.identity.inputs_record: the sha256 of each data file and of the
    base model's config.json) too: a resume on changed inputs is refused."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    remove_incomplete(run_dir)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    current = tmp / "lora.safetensors"
    try:
        tmp.mkdir()
        save_file({k: v.detach().contiguous() for k, v in trainable.items()}, current)
        faults.hit("checkpoint_write")
        current = tmp / OPTIMIZER
        save_state(current, optimizer.state_dict())
        current = tmp / RNG
        current.write_text(json.dumps(rng_state()) + "\n")
        if export is not None:
            current = tmp / "adapter"
            export(current)
        current = tmp / "state.json"
        current.write_text(json.dumps({"step": step, **state}, indent=2) + "\n")
        current = tmp / MANIFEST  # last: it vouches for every file above
        current.write_text(json.dumps({"config_hash": config_hash, "base_hash": base_hash, "inputs": inputs or {},
                                       "checksum": "xxh3_64",
                                       "files": _digests(tmp)}, indent=1) + "\n")
    except Exception as err:  # noqa: BLE001 - disk full surfaces as OSError, SafetensorError or RuntimeError
        reason = _first_line(err) + _no_space_hint(err, root)
        shutil.rmtree(tmp, ignore_errors=True)
        saved = checkpoint_dirs(run_dir)
        kept = f"kept {saved[-1]}" if saved else "no earlier checkpoint exists"
        raise CheckpointError(f"could not write checkpoint {final} ({current.name}: {reason}); "
                              f"{kept}; free space and continue with --resume") from err
    if final.exists():
        _remove(final)
    tmp.replace(final)
    for old in (checkpoint_dirs(run_dir)[:-keep] if keep else []):  # keep=0: every checkpoint stays
        _remove(old)
    return final


def remove_incomplete(run_dir: Path) -> None:
    """Delete what a killed save or prune left behind (see ``incomplete_dirs``)."""
    for junk in incomplete_dirs(run_dir):
        shutil.rmtree(junk, ignore_errors=True)


def _no_space_hint(err: BaseException, root: Path) -> str:
    """Torch's writer reports a full disk as 'file write failed': say what happened when it did."""
    if "no space left" in str(err).lower():
        return ""
    chain, errnos = err, set()
    while chain is not None:
        errnos.add(getattr(chain, "errno", None))
        chain = chain.__cause__ or chain.__context__
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = None
    if 28 in errnos or (free is not None and free < 1 << 20):  # ENOSPC, or under 1 MiB left
        return f"; no space left on device ({free} bytes free on the checkpoint's filesystem)"
    return ""


def _file_digest(path: Path) -> str:
    """xxh3-64 of a file's bytes (as the refit buckets use: faster than reading it from disk)."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): _file_digest(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MANIFEST}


def _remove(path: Path) -> None:
    """Rename aside first: a kill mid-delete leaves a ``.step_N.deleting`` the next save removes."""
    aside = path.with_name(f".{path.name}.deleting")
    shutil.rmtree(aside, ignore_errors=True)
    path.replace(aside)
    for i, child in enumerate(sorted(aside.iterdir())):
        if child.is_dir():
            shutil.rmtree(child)
        else:
            child.unlink()
        if i == 0:
            faults.hit("prune")
    aside.rmdir()


def _read(path: Path) -> tuple[dict, dict, dict, dict]:
    """(LoRA tensors, optimizer state, RNG states, state.json) of a checkpoint; a file that cannot be
    read is a DamagedCheckpointError naming it."""
    current = path / "lora.safetensors"
    try:
        tensors = load_file(current)
        if (path / OPTIMIZER).exists() or not (path / LEGACY_OPTIMIZER).exists():
            current = path / OPTIMIZER
            optimizer = load_state(current)
            current = path / RNG
            rng = json.loads(current.read_text())
        else:  # written before state files: read without running anything they might hold
            current = path / LEGACY_OPTIMIZER
            optimizer = unpickle_legacy_state(current)
            current = path / LEGACY_RNG
            rng = unpickle_legacy_state(current)
        current = path / "state.json"
        state = json.loads(current.read_text())
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError("expected a JSON object with a 'step'")
    except Exception as err:  # noqa: BLE001 - safetensors, pickle, zip and JSON errors name no path
        raise DamagedCheckpointError(f"{current}: cannot be read ({_first_line(err)})") from err
    return tensors, optimizer, rng, state


def verify_checkpoint(path: Path, config_hash: str | list[str] | None = None, unverified_ok: bool = False) -> None:
    """Check a checkpoint against its manifest (every file's checksum, and the config hash when
    given: one hash, or the hashes one run may carry, moerl.config.config_hashes), then that every file reads. DamagedCheckpointError names the file; a checkpoint of
    another config is a RunMismatchError. A checkpoint without a manifest is damaged, unless
    ``unverified_ok`` (a run that predates manifests, or asked for): then only the reading is checked,
    with a warning."""
    from moerl.tracking import RunMismatchError

    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        if not unverified_ok:
            raise DamagedCheckpointError(f"{manifest_path}: missing (this run writes one into every checkpoint, "
                                         f"last: the checkpoint is incomplete or was changed; "
                                         f"--unverified-checkpoint loads it unchecked)")
        log.warning("%s has no %s (written before checkpoints carried checksums): loading it unverified",
                    path, MANIFEST)
    else:
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest["files"]
        except (ValueError, KeyError, TypeError) as err:
            raise DamagedCheckpointError(f"{manifest_path}: cannot be read ({_first_line(err)})") from err
        recorded = manifest.get("config_hash")
        accepted = [config_hash] if isinstance(config_hash, str) else list(config_hash or [])
        if accepted and recorded is not None and recorded not in accepted:
            raise RunMismatchError(f"{path} was written by a run of config hash {recorded}, this config's hash is "
                                   f"{accepted[0]}: cannot resume it with another config; use the run's own config "
                                   f"(see --print-config), or --fresh")
        for name, digest in files.items():
            file = path / name
            if not file.is_file():
                raise DamagedCheckpointError(f"{file}: missing (listed in {MANIFEST})")
            if _file_digest(file) != digest:
                raise DamagedCheckpointError(f"{file}: checksum mismatch (written {digest}, now "
                                             f"{_file_digest(file)}): the file changed after it was saved")
    _read(path)


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer) -> dict:
    """Restore into ``model`` (trainable tensors by name) and ``optimizer``; return state.json."""
    tensors, optimizer_state, rng, state = _read(path)
    params = dict(model.named_parameters())
    unknown = [k for k in tensors if k not in params]
    if unknown:
        raise CheckpointError(f"{path}: checkpoint tensor '{unknown[0]}' is not a parameter of the model")
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
    optimizer.load_state_dict(optimizer_state)
    set_rng_state(rng)
    return state


class RunFinishedError(CheckpointError):
    """``--resume`` of a run that already wrote summary.json: resuming would only add rows."""


def predates_manifests(run_dir: Path) -> bool:
    """A run written before checkpoints carried manifests: its run.json records no ``format`` and none of
    its checkpoints has a manifest (a version that writes manifests writes one into every checkpoint)."""
    run_json = Path(run_dir) / "run.json"
    try:
        recorded = json.loads(run_json.read_text()) if run_json.exists() else {}
    except ValueError:
        recorded = {}
    if isinstance(recorded, dict) and recorded.get("format") is not None:
        return False
    return not any((p / MANIFEST).exists() for p in checkpoint_dirs(run_dir))


def base_hash_of(path: Path) -> str | None:
    """The base-weights hash a checkpoint's manifest records (None: none recorded)."""
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("base_hash")
    except (OSError, ValueError, AttributeError):
        return None


def inputs_of(path: Path) -> dict | None:
    """The input hashes a checkpoint's manifest records (None: none recorded)."""
    try:
        recorded = json.loads((Path(path) / MANIFEST).read_text()).get("inputs")
    except (OSError, ValueError, AttributeError):
        return None
    return recorded if isinstance(recorded, dict) else None


def check_same_inputs(path: Path, run_dir: Path, inputs: dict) -> None:
    """Refuse to continue checkpoint ``path`` when a file it was trained from (a data file, the base
    model's config.json) has other content now; its manifest's record, else the run's run.json."""
    from moerl.tracking import check_same_inputs as check

    recorded = inputs_of(path)
    check(run_dir, inputs, "resume", recorded=recorded, where=path if recorded is not None else run_dir)


def check_same_base(path: Path, base_hash: str, where: str) -> None:
    """Refuse to continue checkpoint ``path`` on base weights other than those it was trained on."""
    from moerl.tracking import RunMismatchError

    recorded = base_hash_of(path)
    if recorded is not None and recorded != base_hash:
        raise RunMismatchError(f"{path} was trained on base weights {recorded}, but this run loaded {base_hash} "
                               f"from {where}: continuing its LoRA on another base would mix two runs; restore the "
                               f"warm start it was trained on (warm_start.cache_dir), or start over with --fresh")


def resumable_checkpoint(run_dir: Path, cfg, unverified_ok: bool = False) -> Path:
    """The checkpoint a ``--resume`` continues from, after checking the run can be continued:
    not finished, recorded with the same config, and checkpointed at least once. A checkpoint
    without a manifest counts as damaged unless the run predates manifests or ``unverified_ok``."""
    from moerl.tracking import check_same_config

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: no such run to resume (its name carries the overrides that change it); "
                              f"start it without --resume")
    if (run_dir / "summary.json").exists():
        raise RunFinishedError(f"{run_dir} is finished (summary.json); nothing to resume "
                               f"(--fresh moves it aside and starts over)")
    check_same_config(run_dir, cfg, "resume")
    saved = checkpoint_dirs(run_dir)
    if not saved:
        every = cfg.trainer.checkpoint_every
        when = f"its first checkpoint at step {every}" if every else "its only checkpoint, at the end"
        raise CheckpointError(f"{run_dir}: no checkpoint to resume from (the run stopped before {when}); "
                              f"start it over with --fresh")
    from moerl.config import config_hashes

    damaged = []
    unverified_ok = unverified_ok or predates_manifests(run_dir)
    for path in reversed(saved):
        try:
            verify_checkpoint(path, config_hashes(cfg), unverified_ok)
        except DamagedCheckpointError as err:
            damaged.append((path, err))
            continue
        for bad, err in damaged:
            log.warning("damaged checkpoint %s (%s): resuming from the previous complete checkpoint %s",
                        bad, err, path)
        return path
    names = ", ".join(str(p) for p, _ in damaged)
    raise CheckpointError(f"{run_dir}: no intact checkpoint to resume from ({damaged[0][1]}); start the run over "
                          f"with --fresh (it moves the run aside), or delete the damaged checkpoint(s) {names}")
