"""Checkpoints that make an interrupted run resume exactly: LoRA weights, optimizer, RNG states,
data position and step. Written to a temp directory and renamed, so a crash mid-save leaves the
previous checkpoint intact; the newest ``keep`` are kept."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    done = [p for p in root.glob("step_*") if (p / "state.json").exists()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def save_checkpoint(run_dir: Path, step: int, trainable: dict[str, torch.Tensor], optimizer, state: dict,
                    keep: int = 2) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous() for k, v in trainable.items()}, tmp / "lora.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
               tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.replace(final)
    for old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old)
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer) -> dict:
    """Restore into ``model`` (trainable tensors by name) and ``optimizer``; return state.json."""
    tensors = load_file(path / "lora.safetensors")
    params = dict(model.named_parameters())
    unknown = [k for k in tensors if k not in params]
    if unknown:
        raise KeyError(f"{path}: checkpoint tensor '{unknown[0]}' is not a parameter of the model")
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    return json.loads((path / "state.json").read_text())
