"""The trainer checkpoint's shared expert adapter: one adapter per MoE layer, so the same on every EP rank.

Megatron-Bridge with ``share_expert_adapters=True`` keeps one copy of a grouped expert linear's LoRA
(``...mlp.experts.linear_fc1.adapter.linear_in.weight`` and its ``linear_out``) on *each* EP rank. Its
checkpoint exposes the global expert axis: every rank writes its copy into the slots of its own experts
(megatron-bridge 0.6.2 ``peft/utils.py`` ``ParallelLinearAdapter.sharded_state_dict`` ->
``_apply_expert_axis_factory``), the same layout its export to vLLM uses (``moerl.lora.sharding.
bridge_export_expert_factor``). Healthy, all ``E`` slots are equal. Copies that drifted apart show as
the slots of one EP rank differing from another's: Bridge before 0.6.0 has no initial broadcast (each
EP rank starts from its own expert-parallel seed), and in 0.6.2 the EP gradient sum is an autograd hook
that, under gradient-accumulation fusion, sums the dummy gradient megatron-core hands autograd while
the real one goes to ``main_grad``. Then vLLM serves rank r's copy for rank r's experts while each
trainer rank trains its own: a silent mis-training that no loss curve shows.

Reads a PyTorch distributed checkpoint directory (Megatron-Core's ``torch_dist`` format is one: a
``.metadata`` file and ``*.distcp`` shards), a ``torch.save`` file or a ``.safetensors`` file. Only
tensors whose name matches ``SHARED_ADAPTER`` are checked; run it only where the adapters are shared
(``share_expert_adapters=True``, what every scale experiment sets).
"""
from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path

import torch

from moerl.verl_ext.first_steps import RunReadError, Verdict

# Megatron-Bridge's grouped-expert adapter factors (TEGroupedMLP's linear_fc1 / linear_fc2)
SHARED_ADAPTER = re.compile(r"(^|\.)experts\.linear_fc[12]\.adapter\.linear_(in|out)\.weight$")


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, by name (nested dicts flattened with dots)."""
    p = Path(path)
    if not p.exists():
        raise RunReadError(f"{p}: no such checkpoint (give a torch_dist / DCP directory, a .pt or a .safetensors file)")
    if p.is_dir():
        if not (p / ".metadata").exists():
            raise RunReadError(f"{p}: not a distributed checkpoint (no .metadata; Megatron's torch_dist format "
                               f"has one)")
        state = _read_dcp_tensors(p)
    elif p.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(p)
    else:
        try:
            state = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file gets the same one-line answer
            raise RunReadError(f"{p}: not a torch.save checkpoint of tensors ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict):
        raise RunReadError(f"{p}: expected a dict of tensors, got {type(state).__name__}")
    return dict(_flatten(state))


_MCORE_TORCH_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch"


def _stand_ins():
    """Empty stand-ins for the classes megatron-core 0.15 pickled into ``.metadata`` (megatron-core itself
    keeps them as empty classes for loading such checkpoints): the unpickler fills their attributes, and
    no megatron code is imported or run."""
    from torch.distributed.checkpoint.metadata import Metadata

    class MCoreMetadata(Metadata):
        pass

    class MCoreSavePlan:
        pass

    return MCoreMetadata, MCoreSavePlan


_MCoreMetadata, _MCoreSavePlan = _stand_ins()


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file constructing torch's checkpoint-metadata dataclasses and enums,
    ``torch.Size`` and torch's dtype / layout / memory-format constants, and nothing else (the
    "restricting globals" recipe of Python's pickle documentation; torch's own ``weights_only``
    unpickler cannot read DCP's protocol-4 frames)."""

    def find_class(self, module, name):
        import torch.distributed.checkpoint.filesystem as fs
        import torch.distributed.checkpoint.metadata as md

        allowed = {(m.__name__, n) for m, names in ((md, ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                         "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                         "StorageMeta", "_MEM_FORMAT_ENCODING")),
                                                    (fs, ("_StorageInfo", "_StoragePrefix", "SerializationFormat")))
                   for n in names}
        if (module, name) in allowed:
            return getattr(sys.modules[module], name)
        if (module, name) == (_MCORE_TORCH_STRATEGY, "MCoreMetadata"):  # megatron-core 0.15's metadata class
            return _MCoreMetadata
        if (module, name) == (_MCORE_TORCH_STRATEGY, "MCoreSavePlan"):
            return _MCoreSavePlan
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return getattr(sys.modules["pathlib"], name)  # the checkpoint's own path (StorageMeta): a name only
        if (module, name) == ("torch.serialization", "_get_layout"):  # a layout by its name, from torch's table
            return torch.serialization._get_layout
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint-metadata type")


def _read_dcp_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a distributed checkpoint, without running anything it holds: torch's reader unpickles
    ``.metadata`` unrestricted and its planner unpickles non-tensor entries (``weights_only=False``), so the
    metadata goes through ``_MetadataUnpickler`` and only the tensor entries are requested (their shards
    are read with ``weights_only=True``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata as StorageMetadataType
    from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata

    class RestrictedMetadataReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / ".metadata", "rb") as fh:
                metadata = _MetadataUnpickler(fh).load()
            if not isinstance(metadata, StorageMetadataType):
                raise pickle.UnpicklingError(f"expected a Metadata object, got {type(metadata).__name__}")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    reader = RestrictedMetadataReader(path)
    try:
        metadata = reader.read_metadata()
    except Exception as err:  # noqa: BLE001 - refused globals and broken pickles: one line naming the file
        reason = " ".join(str(err).split()).split(" Check the documentation")[0][:300]
        raise RunReadError(f"{path / '.metadata'}: refused (a distributed checkpoint's metadata may name "
                           f"torch's checkpoint metadata classes only: {reason or type(err).__name__})") from None
    state = {name: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for name, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _flatten(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, f"{name}.")
        elif isinstance(value, torch.Tensor):
            yield name, value


def check_shared_expert_copies(tensors: dict[str, torch.Tensor], ep: int | None = None) -> Verdict:
    """``shared_expert_ep_copies``: every expert slot of each shared adapter factor equals slot 0.
    ``ep`` (the run's expert-parallel size) only names the EP rank owning each differing slot."""
    checked = {n: t for n, t in tensors.items() if SHARED_ADAPTER.search(n)}
    if not checked:
        return Verdict("shared_expert_ep_copies", False,
                       f"no shared expert adapter in the checkpoint (expected names matching "
                       f"{SHARED_ADAPTER.pattern}; {len(tensors)} tensors read)")
    problems = []
    for name, t in sorted(checked.items()):
        if t.ndim < 2:
            problems.append(f"{name}: shape {tuple(t.shape)} has no expert axis")
            continue
        experts = t.shape[0]
        differ = [e for e in range(1, experts) if not torch.equal(t[e], t[0])]
        if differ:
            worst = max(float((t[e].float() - t[0].float()).abs().max()) for e in differ)
            owner = "" if not ep or experts % ep else \
                f" (EP ranks {sorted({e // (experts // ep) for e in differ})} vs EP rank 0)"
            problems.append(f"{name}: expert slots {_ranges(differ)} differ from slot 0{owner}, max |diff| {worst:.3g}")
    if problems:
        return Verdict("shared_expert_ep_copies", False,
                       "the shared expert adapter's copies drifted apart across EP ranks, so vLLM serves a "
                       "different adapter per EP rank: " + "; ".join(problems[:3]) +
                       (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))
    return Verdict("shared_expert_ep_copies", True,
                   f"{len(checked)} shared expert adapter factor(s): every expert slot holds the same copy")


def _ranges(ids: list[int]) -> str:
    out, start = [], ids[0]
    for prev, cur in zip(ids, ids[1:] + [None]):
        if cur != prev + 1:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(out)
