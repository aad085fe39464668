"""A crafted file a user receives runs no code: a pickle whose ``__reduce__`` would create a marker file is
refused wherever this repository reads state (a checkpoint's optimizer and RNG state, a warm start's saved
SFT progress, a distributed checkpoint's metadata), and the marker is never created. Checkpoints written
before the pickle-free format still resume, through the restricted unpickler."""
from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest
import torch

from moerl.trainer import checkpoint as ckpt
from moerl.trainer.state_files import StateFileError, load_state, save_state, unpickle_legacy_state


class Payload:
    """Unpickling this opens ``marker`` for writing (creating it): the stand-in for any command."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _checkpoint(tmp_path, step=1):
    w = torch.nn.Parameter(torch.arange(4.0))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.ones_like(w)
    opt.step()
    return ckpt.save_checkpoint(tmp_path / "run", step, {"w": w}, opt, {"sampler": {}}, config_hash="h"), w, opt


def _as_legacy(path, optimizer_state, rng_state):
    """Rewrite a checkpoint in the format written before state files (torch.save pickles), manifest
    recomputed: what a checkpoint of an older version, or a crafted one, looks like."""
    (path / ckpt.OPTIMIZER).unlink()
    (path / ckpt.RNG).unlink()
    torch.save(optimizer_state, path / ckpt.LEGACY_OPTIMIZER)
    torch.save(rng_state, path / ckpt.LEGACY_RNG)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["files"] = ckpt._digests(path)
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


def _old_rng():
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


@pytest.mark.parametrize("crafted", ["optimizer", "rng"])
def test_a_crafted_pickle_in_a_checkpoint_is_refused_and_runs_nothing(tmp_path, crafted):
    path, w, opt = _checkpoint(tmp_path)
    marker = tmp_path / "marker"
    evil = {"state": Payload(marker)} if crafted == "optimizer" else {"torch": Payload(marker)}
    _as_legacy(path, evil if crafted == "optimizer" else opt.state_dict(),
               evil if crafted == "rng" else _old_rng())
    with pytest.raises(ckpt.DamagedCheckpointError, match=rf"{crafted}\.pt: cannot be read \(.*refused"):
        ckpt.verify_checkpoint(path, "h")  # the manifest matches: integrity is not origin
    with pytest.raises(ckpt.DamagedCheckpointError):
        ckpt.load_checkpoint(path, torch.nn.Module(), opt)
    assert not marker.exists()


def test_a_checkpoint_of_the_pickled_format_still_resumes_exactly(tmp_path):
    path, w, opt = _checkpoint(tmp_path)
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    rng = _old_rng()
    expected = (random.random(), np.random.rand(), torch.rand(1))
    _as_legacy(path, opt.state_dict(), rng)
    ckpt.verify_checkpoint(path, "h")
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4))
    fresh = torch.optim.AdamW([model.w], lr=0.1)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    ckpt.load_checkpoint(path, model, fresh)
    assert torch.equal(model.w, w)
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg_sq"], opt.state_dict()["state"][0]["exp_avg_sq"])
    assert fresh.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_the_new_format_holds_no_pickle_and_restores_the_rng_exactly(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path, w, opt = _checkpoint(tmp_path)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    assert not list(path.glob("*.pt"))
    json.loads((path / ckpt.RNG).read_text())  # plain JSON
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4))
    fresh = torch.optim.AdamW([model.w], lr=0.1)
    ckpt.load_checkpoint(path, model, fresh)
    assert fresh.state_dict()["param_groups"][0]["betas"] == (0.9, 0.999)  # a tuple again, as AdamW made it
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_state_files_round_trip_nested_state_and_refuse_other_files(tmp_path):
    tree = {"a": (1, 2.5, None, "x"), 3: [torch.ones(2), {"b": torch.zeros(1, dtype=torch.int64)}], "t": True}
    save_state(tmp_path / "s.safetensors", tree)
    back = load_state(tmp_path / "s.safetensors")
    assert back["a"] == (1, 2.5, None, "x") and back["t"] is True
    assert torch.equal(back[3][0], torch.ones(2)) and back[3][1]["b"].dtype == torch.int64
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(StateFileError, match="bad.safetensors: not a state file"):
        load_state(tmp_path / "bad.safetensors")


def test_a_crafted_warm_start_progress_file_is_refused_and_runs_nothing(tmp_path, caplog):
    from moerl.trainer import warm_start

    out = tmp_path / "qwen3_moe-abc"
    marker = tmp_path / "marker"
    with open(warm_start._legacy_progress_path(warm_start._progress_path(out)), "wb") as fh:
        pickle.dump({"key": Payload(marker)}, fh)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4)
    done = warm_start._load_progress(warm_start._progress_path(out), "k", 4, model, opt, sched, random.Random(0))
    assert done == (0, 0.0) and "refused" in caplog.text
    assert not marker.exists()


def test_legacy_warm_start_progress_still_continues(tmp_path):
    from moerl.trainer import warm_start

    out = tmp_path / "qwen3_moe-abc"
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=4)
    legacy = warm_start._legacy_progress_path(warm_start._progress_path(out))
    torch.save({"key": "k", "step": 2, "seconds": 1.5, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "rng": random.Random(7).getstate(),
                "torch_rng": torch.get_rng_state()}, legacy)
    rng = random.Random(0)
    done = warm_start._load_progress(warm_start._progress_path(out), "k", 4, model, opt, sched, rng)
    assert done == (2, 1.5) and rng.random() == random.Random(7).random()


def test_a_crafted_distributed_checkpoint_is_refused_and_runs_nothing(tmp_path):
    from moerl.verl_ext.checkpoint_check import read_checkpoint
    from moerl.verl_ext.first_steps import RunReadError

    marker = tmp_path / "marker"
    ckpt_dir = tmp_path / "dcp"
    ckpt_dir.mkdir()
    (ckpt_dir / ".metadata").write_bytes(pickle.dumps(Payload(marker), protocol=4))
    with pytest.raises(RunReadError, match=r"\.metadata: refused .*open is not a checkpoint-metadata type"):
        read_checkpoint(ckpt_dir)
    assert not marker.exists()
    torch.save({"w": Payload(marker)}, tmp_path / "crafted.pt")
    with pytest.raises(RunReadError, match="crafted.pt: not a torch.save checkpoint of tensors"):
        read_checkpoint(tmp_path / "crafted.pt")
    assert not marker.exists()


def test_a_megatron_core_015_checkpoint_metadata_reads_through_stand_ins(tmp_path, monkeypatch):
    """megatron-core 0.15 pickled its own MCoreMetadata class into ``.metadata``: it is read as an empty
    stand-in (megatron-core itself keeps the class empty for this), without megatron installed."""
    import sys
    import types

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata

    from moerl.verl_ext.checkpoint_check import read_checkpoint

    weights = {"decoder.layers.0.mlp.experts.linear_fc1.adapter.linear_in.weight": torch.arange(6.0).reshape(2, 3)}
    dcp.save(weights, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    name = "megatron.core.dist_checkpointing.strategies.torch"
    fake = types.ModuleType(name)

    class MCoreMetadata(Metadata):
        pass

    MCoreMetadata.__module__, MCoreMetadata.__qualname__ = name, "MCoreMetadata"
    fake.MCoreMetadata = MCoreMetadata
    monkeypatch.setitem(sys.modules, name, fake)
    with open(tmp_path / "ckpt" / ".metadata", "rb") as fh:
        metadata = pickle.load(fh)  # this test's own file
    metadata.__class__ = MCoreMetadata
    metadata.mcore_data = {"decoder": {"nd_reformulated_orig_global_shape": (2, 3)}}
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata, protocol=4))
    monkeypatch.delitem(sys.modules, name)  # no megatron when it is read
    tensors = read_checkpoint(tmp_path / "ckpt")
    assert torch.equal(tensors[next(iter(weights))], next(iter(weights.values())))
