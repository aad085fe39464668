"""Checkpoints that make an interrupted run resume exactly: LoRA weights, optimizer, RNG states,
data position, refit version and step. Written to a temp directory and renamed, so a crash
mid-save leaves the previous checkpoint intact; the newest ``keep`` are kept. Pruning renames a
checkpoint aside before deleting it, and leftovers of a crash (temp or half-deleted directories)
are removed at the next save, so a kill at any moment leaves nothing that looks like a checkpoint
but is not one, and nothing that is never cleaned up."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from moerl import faults


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or resumed from; the message names the path."""


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints (``state.json`` is written last, inside the temp directory), oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    done = [p for p in root.glob("step_*") if (p / "state.json").exists()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def incomplete_dirs(run_dir: Path) -> list[Path]:
    """What a crash can leave behind: temp writes, directories being pruned, step dirs without
    state.json (pruned by an older version that deleted in place)."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    return sorted([p for p in root.glob(".step_*") if p.is_dir()]
                  + [p for p in root.glob("step_*") if p.is_dir() and not (p / "state.json").exists()])


def _first_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def save_checkpoint(run_dir: Path, step: int, trainable: dict[str, torch.Tensor], optimizer, state: dict,
                    keep: int = 2, export=None) -> Path:
    """Write ``checkpoints/step_<step>`` atomically (temp dir, then rename) and prune to ``keep``.
    ``export(dir)``, if given, writes extra files into the checkpoint before it is published (the
    trainer writes the LoRA there as PEFT / vLLM adapters)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for junk in incomplete_dirs(run_dir):
        shutil.rmtree(junk, ignore_errors=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    current = tmp / "lora.safetensors"
    try:
        tmp.mkdir()
        save_file({k: v.detach().contiguous() for k, v in trainable.items()}, current)
        faults.hit("checkpoint_write")
        current = tmp / "optimizer.pt"
        torch.save(optimizer.state_dict(), current)
        current = tmp / "rng.pt"
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                    "numpy": np.random.get_state()}, current)
        if export is not None:
            current = tmp / "adapter"
            export(current)
        current = tmp / "state.json"
        current.write_text(json.dumps({"step": step, **state}, indent=2) + "\n")
    except Exception as err:  # noqa: BLE001 - disk full surfaces as OSError, SafetensorError or RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        saved = checkpoint_dirs(run_dir)
        kept = f"kept {saved[-1]}" if saved else "no earlier checkpoint exists"
        raise CheckpointError(f"could not write checkpoint {final} ({current.name}: {_first_line(err)}); "
                              f"{kept}; free space and continue with --resume") from err
    if final.exists():
        _remove(final)
    tmp.replace(final)
    for old in checkpoint_dirs(run_dir)[:-keep]:
        _remove(old)
    return final


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


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer) -> dict:
    """Restore into ``model`` (trainable tensors by name) and ``optimizer``; return state.json."""
    tensors = load_file(path / "lora.safetensors")
    params = dict(model.named_parameters())
    unknown = [k for k in tensors if k not in params]
    if unknown:
        raise CheckpointError(f"{path}: checkpoint tensor '{unknown[0]}' is not a parameter of the model")
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    return json.loads((path / "state.json").read_text())


class RunFinishedError(CheckpointError):
    """``--resume`` of a run that already wrote summary.json: resuming would only add rows."""


def resumable_checkpoint(run_dir: Path, cfg) -> Path:
    """The checkpoint a ``--resume`` continues from, after checking the run can be continued:
    not finished, recorded with the same config, and checkpointed at least once."""
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
    return saved[-1]
