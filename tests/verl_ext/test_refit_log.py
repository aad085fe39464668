"""The refit side log's hook: verl's vLLM adapter wrapped so every weight update is recorded, the stream
passed through untouched, and a verl whose adapter differs from 0.9.1's refused.

No vLLM here: the wrapper runs around a stand-in adapter with verl 0.9.1's ``update_weights`` signature,
checked against verl's real source file."""
from __future__ import annotations

import asyncio
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from moerl.verl_ext import refit_log
from tests_helpers import verl_adapter_tensors


def verl_adapter_source() -> Path:
    from verl.workers.rollout import base

    return Path(base.__file__).resolve().parent / refit_log.UPSTREAM_SOURCE


class FakeAdapter:
    """verl 0.9.1's vLLM ServerAdapter.update_weights as far as the stream goes: it consumes the
    ``(name, tensor)`` generator (the real one packs it into IPC buckets)."""

    replica_rank, rollout_rank = 0, 1

    def __init__(self, fail: bool = False):
        self.received, self.kwargs, self.fail = [], [], fail

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
        self.kwargs.append({"global_steps": global_steps, "wire_format": wire_format, **kwargs})
        for name, tensor in weights:
            self.received.append((name, tensor))
            if self.fail:
                raise RuntimeError("ipc socket closed")


class Counted:
    """A generator of (name, tensor) that counts how often each item is produced."""

    def __init__(self, tensors):
        self.tensors, self.produced = tensors, 0

    def __iter__(self):
        for item in self.tensors.items():
            self.produced += 1
            yield item


@pytest.fixture
def side_log(tmp_path, monkeypatch):
    path = tmp_path / "run.refit.jsonl"
    monkeypatch.setenv(refit_log.ENV_PATH, str(path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv(refit_log.ENV_HASH, raising=False)
    monkeypatch.setattr(refit_log, "_first_names", {})
    return path


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_update_is_one_row_and_the_stream_passes_through_once_unchanged(side_log):
    cls = refit_log.logged_adapter_class(FakeAdapter)
    adapter = cls()
    base = Counted({"model.embed_tokens.weight": torch.ones(4, 2)})
    asyncio.run(adapter.update_weights(base, peft_config={"r": 8}, base_sync_done=False, global_steps=0))
    sent = {}
    for step in (0, 1, 2):
        sent[step] = Counted(verl_adapter_tensors(step))
        asyncio.run(adapter.update_weights(sent[step], peft_config={"r": 8}, base_sync_done=True, global_steps=step))
    # the upstream call got the very tensors, in order, each produced once, and its keywords untouched
    expected = list(base.tensors.items()) + [kv for s in (0, 1, 2) for kv in sent[s].tensors.items()]
    assert len(adapter.received) == len(expected)
    assert all(n == en and t is et for (n, t), (en, et) in zip(adapter.received, expected))
    assert [c.produced for c in (base, *sent.values())] == [1, 4, 4, 4]
    assert adapter.kwargs[1] == {"global_steps": 0, "wire_format": "named_tensors", "peft_config": {"r": 8},
                                 "base_sync_done": True}
    rows = _rows(side_log)
    assert [(r["kind"], r["global_steps"], r["count"], r["rank"], r["rollout_rank"]) for r in rows] == [
        ("base", 0, 1, 3, 1), ("adapter", 0, 4, 3, 1), ("adapter", 1, 4, 3, 1), ("adapter", 2, 4, 3, 1)]
    assert rows[0]["checksum"] is None  # the base weights are counted, not hashed
    assert rows[1]["bytes"] == 4 * 8 * 32 * 2
    # B moves by 1e-6 per step (a 1e-6 learning rate): every byte counts, so the checksum changes
    checks = [r["checksum"] for r in rows[1:]]
    assert len(set(checks)) == 3 and len({r["names_digest"] for r in rows[1:]}) == 1
    # the same tensors give the same checksum, whatever order they come in
    again = dict(reversed(list(verl_adapter_tensors(2).items())))
    asyncio.run(adapter.update_weights(iter(again.items()), peft_config={"r": 8}, base_sync_done=True,
                                       global_steps=3))
    assert _rows(side_log)[-1]["checksum"] == checks[-1]


def test_a_changed_name_set_and_a_failed_update_are_recorded(side_log):
    adapter = refit_log.logged_adapter_class(FakeAdapter)()
    asyncio.run(adapter.update_weights(iter(verl_adapter_tensors(0).items()), peft_config={}, base_sync_done=True,
                                       global_steps=0))
    lost = "base_model.model.model.layers.1.mlp.experts.down_proj.lora_B.weight"
    asyncio.run(adapter.update_weights(iter(verl_adapter_tensors(1, drop=lost).items()), peft_config={},
                                       base_sync_done=True, global_steps=1))
    failing = refit_log.logged_adapter_class(FakeAdapter)(fail=True)
    with pytest.raises(RuntimeError, match="ipc socket closed"):
        asyncio.run(failing.update_weights(iter(verl_adapter_tensors(2).items()), peft_config={}, base_sync_done=True,
                                           global_steps=2))
    rows = _rows(side_log)
    assert rows[1]["names_removed"] == [lost] and rows[1]["names_added"] == [] and rows[1]["count"] == 3
    assert rows[2]["ok"] is False and "ipc socket closed" in rows[2]["error"]


def test_async_streams_stay_async(side_log):
    async def stream():
        for item in verl_adapter_tensors(1).items():
            yield item

    class AsyncConsumer(FakeAdapter):
        async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
            assert hasattr(weights, "__aiter__")
            self.received = [item async for item in weights]

    adapter = refit_log.logged_adapter_class(AsyncConsumer)()
    asyncio.run(adapter.update_weights(stream(), peft_config={}, base_sync_done=True, global_steps=1))
    assert len(adapter.received) == 4 and _rows(side_log)[0]["count"] == 4


def test_the_guard_accepts_verl_091_and_refuses_a_changed_signature(tmp_path):
    src = verl_adapter_source()
    real = refit_log.signature_from_source(src)
    refit_log.check_signature(real, str(src))
    assert refit_log.signature_of(FakeAdapter.update_weights) == real  # the stand-in is verl's shape
    changed = tmp_path / "vllm_rollout.py"
    text = src.read_text()
    assert "global_steps: int = None,\n" in text
    changed.write_text(text.replace("global_steps: int = None,\n",
                                    "global_steps: int = None,\n        version=0,\n", 1))
    with pytest.raises(refit_log.RefitLogError) as err:
        refit_log.check_signature(refit_log.signature_from_source(changed), str(changed))
    assert str(changed) in str(err.value) and "\n" not in str(err.value) and "version=0" in str(err.value)

    class Renamed:  # the shape an older adapter had: peft_config and base_sync_done as named parameters
        async def update_weights(self, weights, peft_config=None, base_sync_done=False, global_steps=None):
            pass

    with pytest.raises(refit_log.RefitLogError, match="is not verl 0.9.1's"):
        refit_log.logged_adapter_class(Renamed)


def test_install_points_verls_registry_at_the_logged_adapter(tmp_path, monkeypatch):
    from verl.workers.rollout import base

    monkeypatch.setattr(base, "_ROLLOUT_REGISTRY", dict(base._ROLLOUT_REGISTRY))
    import megatron.core.distributed as mcd

    monkeypatch.setattr(mcd, "finalize_model_grads", mcd.finalize_model_grads)  # restored after the test
    monkeypatch.delenv(refit_log.ENV_PATH, raising=False)
    assert refit_log.install() is False
    assert base._ROLLOUT_REGISTRY[refit_log.REGISTRY_KEY] == refit_log.UPSTREAM  # nothing changed

    monkeypatch.setenv(refit_log.ENV_PATH, str(tmp_path / "x.refit.jsonl"))
    fake = types.ModuleType("verl.workers.rollout.vllm_rollout")  # vLLM is not installed here
    fake.ServerAdapter = FakeAdapter
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.vllm_rollout", fake)
    assert refit_log.install() is True
    cls = base.get_rollout_class("vllm", "async")
    assert cls.__name__ == "LoggedVLLMServerAdapter" and issubclass(cls, FakeAdapter)
    assert refit_log.install() is True  # a second import changes nothing
    # the trainer's expert-bias side log is installed with it, once, beside the refit side log
    assert mcd.finalize_model_grads.moerl_wrapped.__module__ == "megatron.core.distributed.finalize_model_grads"

    blocked = tmp_path / "a_file"
    blocked.write_text("")
    monkeypatch.setenv(refit_log.ENV_PATH, str(blocked / "x.refit.jsonl"))  # its folder is a file
    monkeypatch.setitem(base._ROLLOUT_REGISTRY, refit_log.REGISTRY_KEY, refit_log.UPSTREAM)
    with pytest.raises(refit_log.RefitLogError, match="cannot open the refit side log"):
        refit_log.install()
    assert base._ROLLOUT_REGISTRY[refit_log.REGISTRY_KEY] == refit_log.UPSTREAM  # refused before patching

    monkeypatch.setitem(base._ROLLOUT_REGISTRY, refit_log.REGISTRY_KEY, "somewhere.else.Adapter")
    with pytest.raises(refit_log.RefitLogError, match="somewhere.else.Adapter"):
        refit_log.install()


def test_beside_a_run_log():
    assert refit_log.beside("logs/bringup/04_rung1.jsonl") == Path("logs/bringup/04_rung1.refit.jsonl")
