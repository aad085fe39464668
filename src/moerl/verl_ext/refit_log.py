"""Refit side log: every weight update verl hands the vLLM rollout engine, one JSON line per update and rank.

verl 0.9.1 logs nothing that says whether the rollout engine received the trainer's new LoRA weights, so a
stale or partial refit is only visible in the rollout-vs-trainer k3, which cannot tell at learning rates of
1e-6..1e-4 (``moerl.verl_ext.first_steps``). This module records, for every update a rollout worker
receives, the tensor names, their count and bytes, a content checksum and verl's ``global_steps``, and
appends it to the per-run file named by env ``MOERL_REFIT_LOG`` (the launcher sets it per run and seed,
beside the run's other logs). ``scripts/check_first_steps.py`` reads it: the LoRA must change every step
and keep step 1's tensor names. Any change of any byte changes the checksum, so this decides at every
learning rate: LoRA B starts at 0, and in the first steps each update moves B by about as much as B holds
(far above half a bf16 ulp), so an update that reached the trainer's parameters changes the bytes sent.

Where the hook sits (verl 0.9.1; file:line in site-packages/verl):

- Naive colocated sync training, experiments 01-04 (``rollout.checkpoint_engine.backend`` is verl's
  default ``naive``, ``trainer/config/rollout/rollout.yaml:282``): ``ActorRolloutRefWorker.update_weights``
  (``workers/engine_workers.py:728``) calls ``self.rollout.update_weights(per_tensor_param,
  peft_config=..., base_sync_done=..., global_steps=...)`` (``:800``, ``:804``) and drops what it returns;
  ``self.rollout`` is built from ``get_rollout_class(name, mode)`` (``:667``).
- Every other backend: ``CheckpointEngineWorker.update_weights`` (``checkpoint_engine/base.py:353-360``)
  hands ``receive_weights()`` to ``self.server_adapter.update_weights(weights, global_steps=...,
  wire_format=...)``, its adapter also built by ``get_rollout_class`` (``:342-349``).
- ``get_rollout_class`` (``workers/rollout/base.py:96-110``) reads the module-level ``_ROLLOUT_REGISTRY``
  (``:89-93``) at call time and imports the class its entry names.

So one hook covers both paths: the registry entry for ``("vllm", "async")`` points at
``LoggedVLLMServerAdapter``, a subclass of verl's ``vllm_rollout.ServerAdapter`` whose ``update_weights``
tees the weight stream (each ``(name, tensor)`` is hashed as the upstream sender pulls it and passed on
unchanged, once: nothing is materialised twice) and writes the row after the upstream call returns. No verl
function is rebound, and verl's own class is left as it is. A registered checkpoint-engine backend
(``CheckpointEngineRegistry.register`` + ``checkpoint_engine.custom_backend_module``) was the other option:
it never runs in naive mode (``engine_workers.py:758``: the engine is used only when the backend is not
``naive``), and it would replace the backend a user chose instead of observing it.

The registry entry and the wrapped signature are verl 0.9.1's (``vllm_rollout/vllm_rollout.py:209-215``:
``update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs)``). ``install``
checks both before patching (the signature read from verl's source, since that module imports vLLM), and
``LoggedVLLMServerAdapter`` checks the real class's signature again when verl first asks for it; either
refuses with one line if verl changed.

What is hashed: adapter updates (``peft_config`` given and ``base_sync_done=True``: the LoRA tensors only)
always; the one-off base-weight sync of a LoRA run, merged/full-weight updates and delta flushes are counted
(names, bytes) but hashed only with env ``MOERL_REFIT_LOG_HASH=all``, since hashing a trillion-parameter
model on every rank each step costs more than the check is worth. Hashing copies each tensor to host memory
once (``moerl.refit.checksum``: xxh3-64 per tensor, combined over sorted names, so the order of the stream
does not matter). Rows: ``global_steps``, ``rank`` (env ``RANK``), ``replica_rank``, ``rollout_rank``,
``kind`` (adapter/base/full/delta), ``wire_format``, ``count``, ``bytes``, ``names_digest``, ``checksum``
(hex, or null when not hashed), ``ok`` (false and ``error`` when the upstream call raised), and
``names_added``/``names_removed`` against the first update of that kind in the same process when the name
set changed. Each row is one ``write`` to a file opened ``O_APPEND`` under an exclusive ``lockf`` lock, then
fsynced: rows of different ranks never interleave, and a crash loses at most the row being written.

Executed here (CPU, tests/verl_ext/test_refit_log.py): the wrapper around a stand-in adapter with verl's
signature, the signature guard against verl 0.9.1's real source file, registry installation and
``get_rollout_class`` resolving to the logged class. Not executed: a verl run with vLLM's GPU engine (no
GPU, no vLLM here), so the hashing cost per step on real adapters is not measured.
"""
from __future__ import annotations

import ast
import fcntl
import importlib
import inspect
import json
import os
import socket
import sys
import time
from pathlib import Path

ENV_PATH = "MOERL_REFIT_LOG"
ENV_HASH = "MOERL_REFIT_LOG_HASH"
MODULE = __name__
LOGGED_CLASS = "LoggedVLLMServerAdapter"
SUFFIX = ".refit.jsonl"  # the side log of run log X.jsonl is X.refit.jsonl

VERL_VERSION = "0.9.1"
REGISTRY_KEY = ("vllm", "async")
UPSTREAM = "verl.workers.rollout.vllm_rollout.ServerAdapter"  # workers/rollout/base.py:90
UPSTREAM_SOURCE = "vllm_rollout/vllm_rollout.py"  # relative to workers/rollout/base.py
# ServerAdapter.update_weights in verl 0.9.1 (vllm_rollout/vllm_rollout.py:209-215): (name, kind, default)
PINNED_SIGNATURE = (
    ("self", "POSITIONAL_OR_KEYWORD", None),
    ("weights", "POSITIONAL_OR_KEYWORD", None),
    ("global_steps", "POSITIONAL_OR_KEYWORD", "None"),
    ("wire_format", "POSITIONAL_OR_KEYWORD", "'named_tensors'"),
    ("kwargs", "VAR_KEYWORD", None),
)


class RefitLogError(RuntimeError):
    """The side log cannot be installed or written; one line says why and what to do."""


# ---- the signature guard ----------------------------------------------------------------------------

def signature_of(fn) -> tuple:
    """``fn``'s parameters as ``PINNED_SIGNATURE`` writes them."""
    out = []
    for p in inspect.signature(inspect.unwrap(fn)).parameters.values():
        default = None if p.default is inspect.Parameter.empty else repr(p.default)
        out.append((p.name, p.kind.name, default))
    return tuple(out)


def signature_from_source(path: str | Path, cls: str = "ServerAdapter", method: str = "update_weights") -> tuple:
    """The same, read from a source file without importing it (verl's vLLM adapter imports vLLM)."""
    path = Path(path)
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError) as err:
        raise RefitLogError(f"{path}: cannot read verl's vLLM ServerAdapter ({err}); the refit side log needs "
                            f"verl {VERL_VERSION}") from None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.name == method:
                    return _ast_params(fn.args)
    return ()


def _ast_params(a: ast.arguments) -> tuple:
    def lit(node):
        return None if node is None else repr(ast.literal_eval(node))

    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, d) in enumerate(zip(positional, defaults)):
        kind = "POSITIONAL_ONLY" if i < len(a.posonlyargs) else "POSITIONAL_OR_KEYWORD"
        out.append((arg.arg, kind, lit(d)))
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", None))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((arg.arg, "KEYWORD_ONLY", lit(d)))
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return tuple(out)


def _fmt(sig: tuple) -> str:
    parts = []
    for name, kind, default in sig:
        text = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}.get(kind, "") + name
        parts.append(text + (f"={default}" if default is not None else ""))
    return "(" + ", ".join(parts) + ")"


def check_signature(found: tuple, where: str) -> None:
    """Refuse, in one line, an ``update_weights`` that is not verl 0.9.1's."""
    if tuple(found) != PINNED_SIGNATURE:
        raise RefitLogError(
            f"{where}: ServerAdapter.update_weights{_fmt(found) if found else ' not found'} is not verl "
            f"{VERL_VERSION}'s update_weights{_fmt(PINNED_SIGNATURE)}: the refit side log wraps only that call; "
            f"install verl=={VERL_VERSION} or run without the side log (unset {ENV_PATH}; "
            f"check_first_steps.py then judges the refit from k3)")


# ---- installation ------------------------------------------------------------------------------------

def install() -> bool:
    """Point verl's vLLM rollout registry entry at ``LoggedVLLMServerAdapter`` when ``MOERL_REFIT_LOG`` is
    set (False: not set, nothing changed). Runs when verl imports this module (env
    ``VERL_USE_EXTERNAL_MODULES``, verl/__init__.py:49-52), in every process before any worker is built."""
    if not os.environ.get(ENV_PATH):
        return False
    from moerl.verl_ext import expert_bias_log

    # the trainer's side of the same question: did anything the refit never sends (the routers' expert
    # bias) move? X.expert_bias.jsonl beside X.refit.jsonl
    expert_bias_log.install(expert_bias_log.beside(os.environ[ENV_PATH]))
    from verl.workers.rollout import base

    ours = f"{MODULE}.{LOGGED_CLASS}"
    entry = base._ROLLOUT_REGISTRY.get(REGISTRY_KEY)
    if entry == ours:
        return True
    if entry != UPSTREAM:
        raise RefitLogError(f"{base.__file__}: _ROLLOUT_REGISTRY[{REGISTRY_KEY}] is {entry!r}, not verl "
                            f"{VERL_VERSION}'s {UPSTREAM!r}: the refit side log cannot wrap it; install "
                            f"verl=={VERL_VERSION} or unset {ENV_PATH}")
    source = Path(base.__file__).resolve().parent / UPSTREAM_SOURCE
    check_signature(signature_from_source(source), str(source))
    _open(Path(os.environ[ENV_PATH]))  # an unwritable path fails now, before any model is loaded
    base._ROLLOUT_REGISTRY[REGISTRY_KEY] = ours
    return True


def logged_adapter_class(upstream: type) -> type:
    """A subclass of verl's vLLM ``ServerAdapter`` whose ``update_weights`` records each update."""
    check_signature(signature_of(upstream.update_weights), f"{upstream.__module__}.{upstream.__qualname__}")

    class LoggedVLLMServerAdapter(upstream):
        async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kwargs):
            update = Update(self, global_steps, wire_format, kwargs)
            teed = update.tee(weights)
            try:
                result = await super().update_weights(teed, global_steps=global_steps, wire_format=wire_format,
                                                      **kwargs)
            except BaseException as err:
                update.write(error=f"{type(err).__name__}: {err}")
                raise
            update.write()
            return result

    LoggedVLLMServerAdapter.__doc__ = (f"verl's {upstream.__qualname__}, recording every weight update in the "
                                       f"refit side log ({MODULE}).")
    LoggedVLLMServerAdapter.__module__ = MODULE
    return LoggedVLLMServerAdapter


_built: dict[type, type] = {}  # verl's adapter class -> its logged subclass


def __getattr__(name: str):
    """``get_rollout_class`` imports this module and asks for ``LoggedVLLMServerAdapter``: built on first
    use, so importing this module never imports vLLM."""
    if name == LOGGED_CLASS:
        upstream_module, cls = UPSTREAM.rsplit(".", 1)
        upstream = getattr(importlib.import_module(upstream_module), cls)
        if upstream not in _built:
            _built[upstream] = logged_adapter_class(upstream)
        return _built[upstream]
    raise AttributeError(f"module {MODULE!r} has no attribute {name!r}")


# ---- one update ---------------------------------------------------------------------------------------

NAMES_KEPT = 20  # a row names at most this many added/removed tensors (and counts them all)
_first_names: dict[str, frozenset] = {}  # kind -> names of this process's first update of that kind


class Update:
    """What one ``update_weights`` call hands the rollout engine, gathered while the stream is consumed."""

    def __init__(self, adapter, global_steps, wire_format: str, kwargs: dict):
        self.path = os.environ.get(ENV_PATH)
        self.global_steps = global_steps
        self.wire_format = wire_format
        peft, base_done = kwargs.get("peft_config"), kwargs.get("base_sync_done")
        if wire_format == "delta_flush":
            self.kind = "delta"
        elif peft is not None:
            self.kind = "adapter" if base_done else "base"
        else:
            self.kind = "full"
        self.hashed = self.kind == "adapter" or os.environ.get(ENV_HASH) == "all"
        self.where = {k: getattr(adapter, k, None) for k in ("replica_rank", "rollout_rank")}
        self.entries: dict[str, tuple] = {}
        self.nbytes = 0

    def see(self, name: str, tensor) -> None:
        self.nbytes += tensor.numel() * tensor.element_size()
        digest = tensor_checksum(tensor) if self.hashed else None
        self.entries[name] = (str(tensor.dtype), tuple(tensor.shape), digest)

    def _see_item(self, item):
        if self.wire_format != "delta_flush":
            self.see(*item)
            return item
        named, is_last = item  # a delta flush: (named tensors, is_last)
        if isinstance(named, (list, tuple)):
            for pair in named:
                self.see(*pair)
            return item
        return (self._pairs(named), is_last)

    def _pairs(self, named):
        for pair in named:
            self.see(*pair)
            yield pair

    def tee(self, weights):
        """``weights`` as the upstream adapter will consume it, recording each item on its way; a sync
        iterable stays sync, an async one async (verl's sender accepts both,
        vllm_rollout/bucketed_weight_transfer.py:119)."""
        if hasattr(weights, "__aiter__"):
            return self._atee(weights)
        return self._tee(weights)

    def _tee(self, weights):
        for item in weights:
            yield self._see_item(item)

    async def _atee(self, weights):
        async for item in weights:
            yield self._see_item(item)

    def row(self, error: str | None = None) -> dict:
        names = sorted(self.entries)
        row = {"global_steps": self.global_steps, "rank": _int(os.environ.get("RANK")), **self.where,
               "kind": self.kind, "wire_format": self.wire_format, "count": len(names), "bytes": self.nbytes,
               "names_digest": _hex(_xxh("\n".join(names).encode())),
               "checksum": _hex(combined_checksum(self.entries)) if self.hashed else None,
               "ok": error is None, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
        if error is not None:
            row["error"] = error
        first = _first_names.setdefault(self.kind, frozenset(names)) if error is None else None
        if first is not None and first != frozenset(names):
            added, removed = sorted(set(names) - first), sorted(first - set(names))
            row.update(names_added=added[:NAMES_KEPT], names_added_count=len(added),
                       names_removed=removed[:NAMES_KEPT], names_removed_count=len(removed))
        return row

    def write(self, error: str | None = None) -> None:
        if self.path:
            append_row(self.path, self.row(error))


def tensor_checksum(tensor) -> int:
    """xxh3-64 of a tensor's bytes (``moerl.refit.checksum``), after one copy to host memory."""
    import torch

    from moerl.refit.checksum import checksum

    flat = tensor.detach().contiguous().reshape(-1)
    return checksum(flat.view(torch.uint8).cpu() if flat.numel() else torch.empty(0, dtype=torch.uint8))


def combined_checksum(entries: dict[str, tuple]) -> int:
    """One checksum of named tensors: independent of the order they came in, sensitive to any name, dtype,
    shape or byte."""
    text = "".join(f"{n}\t{dtype}\t{shape}\t{digest:016x}\n" for n, (dtype, shape, digest) in sorted(entries.items()))
    return _xxh(text.encode())


def _xxh(data: bytes) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(data)


def _hex(value: int) -> str:
    return f"{value:016x}"


def _int(text):
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def append_row(path: str | Path, row: dict) -> None:
    """Append one JSON line: a single ``write`` under an exclusive lock on an ``O_APPEND`` file, then fsync."""
    data = (json.dumps(row, separators=(",", ":")) + "\n").encode()
    fd = _open(Path(path), keep=True)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)  # closing releases the lock


def _open(path: Path, keep: bool = False):
    """The side log opened for appending (created with its folder if missing); closed unless ``keep``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as err:
        raise RefitLogError(f"{path}: cannot open the refit side log ({err}); set {ENV_PATH} to a writable path "
                            f"every node sees") from None
    if keep:
        return fd
    os.close(fd)
    return None


def beside(run_log: str | Path) -> Path:
    """The side log that belongs to run log ``X.jsonl``: ``X.refit.jsonl`` (``refit.jsonl`` in a run dir)."""
    p = Path(run_log)
    if p.is_dir():
        return p / SUFFIX.lstrip(".")
    return p.with_name(p.name[: -len(p.suffix)] + SUFFIX if p.suffix else p.name + SUFFIX)


if "verl" in sys.modules:  # imported by verl (VERL_USE_EXTERNAL_MODULES) or in a process using verl; a process
    install()              # that only reads side logs (scripts/check_first_steps.py) changes nothing
