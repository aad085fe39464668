"""Optimizer, RNG and training-progress state in files that run no code when they are read.

A ``torch.save`` file is a pickle: reading it with ``weights_only=False`` runs whatever its author put in
it, and a checkpoint's manifest proves that its files are unchanged since they were written, not who wrote
them (a crafted ``optimizer.pt`` with a recomputed manifest ran a shell command on ``--resume``). So state is
written as one safetensors file: the tensors as tensors, everything else (the nesting, the integers,
floats, strings and tuples of an optimizer's or scheduler's ``state_dict``) as JSON in the file's header
metadata. Reading it parses a header and copies bytes; nothing is constructed by name.

safetensors stores flat name -> tensor maps only, and ``state_dict``s are nested trees with integer keys
and tuples (AdamW's ``betas``), which JSON alone cannot tell from lists: ``encode_tree`` / ``decode_tree``
carry them across exactly, so a resumed optimizer is the saved one bit for bit.

Files written before this format (``optimizer.pt``, ``rng.pt``, a warm start's ``.progress.pt``) are read
by one function only, ``unpickle_legacy_state``, whose unpickler builds nothing but tensors, containers,
numbers, strings and numpy's plain arrays (torch's ``weights_only=True`` allow-list plus the three numpy
names an array needs): a file that asks for anything else is refused without running it.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

METADATA_KEY = "moerl_state"  # the safetensors header entry holding the JSON part of the state


class StateFileError(ValueError):
    """A state file that cannot be read as what it claims to be; the message names the file."""


def encode_tree(tree, tensors: dict[str, torch.Tensor], path: str = "s"):
    """``tree`` as JSON-able data, each tensor replaced by ``{"$tensor": name}`` and stored in ``tensors``;
    tuples and dicts whose keys are not plain strings are tagged so that ``decode_tree`` restores them."""
    if isinstance(tree, torch.Tensor):
        tensors[path] = tree.detach().cpu().contiguous().clone()  # clone: safetensors refuses shared storage
        return {"$tensor": path}
    if isinstance(tree, tuple):
        return {"$tuple": [encode_tree(v, tensors, f"{path}.{i}") for i, v in enumerate(tree)]}
    if isinstance(tree, list):
        return [encode_tree(v, tensors, f"{path}.{i}") for i, v in enumerate(tree)]
    if isinstance(tree, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in tree):
            return {k: encode_tree(v, tensors, f"{path}.{k}") for k, v in tree.items()}
        for k in tree:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"{path}: dict key {k!r} of type {type(k).__name__} cannot be stored")
        return {"$dict": [[k, encode_tree(v, tensors, f"{path}.{k}")] for k, v in tree.items()]}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    raise TypeError(f"{path}: a {type(tree).__name__} cannot be stored as a tensor or JSON value")


def decode_tree(data, tensors: dict[str, torch.Tensor]):
    """The inverse of ``encode_tree``."""
    if isinstance(data, list):
        return [decode_tree(v, tensors) for v in data]
    if isinstance(data, dict):
        if set(data) == {"$tensor"}:
            return tensors[data["$tensor"]]
        if set(data) == {"$tuple"}:
            return tuple(decode_tree(v, tensors) for v in data["$tuple"])
        if set(data) == {"$dict"}:
            return {k: decode_tree(v, tensors) for k, v in data["$dict"]}
        return {k: decode_tree(v, tensors) for k, v in data.items()}
    return data


def save_state(path: Path, tree) -> None:
    """Write ``tree`` (nested dicts, lists, tuples of tensors, numbers and strings) to one safetensors file."""
    tensors: dict[str, torch.Tensor] = {}
    record = encode_tree(tree, tensors)
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(record)})


def load_state(path: Path):
    """The tree ``save_state`` wrote to ``path``; StateFileError naming the file if it is not one."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            header = fh.metadata() or {}
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
        if METADATA_KEY not in header:
            raise ValueError(f"no '{METADATA_KEY}' entry in its header")
        return decode_tree(json.loads(header[METADATA_KEY]), tensors)
    except StateFileError:
        raise
    except Exception as err:  # noqa: BLE001 - safetensors, JSON and missing-name errors name no file
        raise StateFileError(f"{path}: not a state file of this repository "
                             f"({' '.join(str(err).split()) or type(err).__name__})") from None


def rng_state() -> dict:
    """torch's, Python's and numpy's global random state, as JSON-able data."""
    kind, key, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state().tolist(), "python": _jsonable(random.getstate()),
            "numpy": [kind, key.tolist(), int(pos), int(has_gauss), float(cached)]}


def set_rng_state(state: dict) -> None:
    """Restore what ``rng_state`` returned (or a legacy ``rng.pt``'s dict of the same three states)."""
    torch_state = state["torch"]
    torch.set_rng_state(torch_state if isinstance(torch_state, torch.Tensor)
                        else torch.tensor(torch_state, dtype=torch.uint8))
    random.setstate(_tuples(state["python"]))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))


def _jsonable(value):
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _tuples(value):
    """random.setstate wants the nested tuples getstate gave (JSON returns lists)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (tuple, list)) else value


# numpy's own names for rebuilding a plain array (np.random.get_state()'s key is a uint32 array): nothing
# else numpy could be asked to construct is allowed.
_NUMPY_ARRAY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType,
                        (np._core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct")]  # numpy 1.x's name


def unpickle_legacy_state(path: Path):
    """Read a ``torch.save`` file written before state was stored as safetensors, through torch's
    restricted unpickler (``weights_only=True``: tensors, containers, numbers, strings) plus numpy's plain
    arrays; a file that asks for any other object is refused (StateFileError naming the file), and nothing
    in it runs. The only place this repository unpickles a file it may have received."""
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - refused globals, truncated zips: one answer naming the file
        reason = " ".join(str(err).split()).split(" Check the documentation")[0][:300]
        raise StateFileError(f"{path}: refused (a legacy torch.save file may hold tensors, numbers, strings, "
                             f"containers and numpy arrays only: {reason or type(err).__name__})") from None

