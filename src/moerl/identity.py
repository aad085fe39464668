"""What a run computes from, by content: the sha256 of each file it reads, so that a data file or a base
model's config edited in place (same path, other content) is not taken for the one a run was made with.

A run's config names its inputs by path; the config hash therefore says nothing about what is behind the
path. ``inputs_record`` hashes each input a run reads (``data.train_path``, ``data.test_path``, the base
model's ``config.json`` and its directory); run.json and every checkpoint manifest carry it, a resume or a sweep's skip
refuses a run whose inputs changed (``check_same_inputs``), and the analysis refuses to pool runs of one
comparison made from different inputs.

A directory (a model checkpoint: config, tokenizer, weights) is hashed by ``inputs_hash``: the sha256 of
the list of its relevant files, each with its size and own sha256. Relevant: ``config.json``,
``generation_config.json``, the tokenizer files (``tokenizer*``, ``special_tokens_map.json``, vocab /
merges files, ``added_tokens.json``, chat templates), the safetensors index and the ``*.safetensors``
shards. Other files (READMEs, caches, a ``meta.json`` of how it was trained) do not change what the model
computes and are left out, so copying or annotating a checkpoint keeps its hash. Weight shards can be
tens of GB; a caller that already identifies the weights by content (the trainer's ``base_hash``) passes
``weights=False`` and the shards enter by name and size only.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

CHUNK = 1 << 20

# A model directory's files that change what it computes (see the module docstring); matched by name.
MODEL_FILES = ("config.json", "generation_config.json", "special_tokens_map.json", "added_tokens.json",
               "vocab.json", "vocab.txt", "merges.txt", "model.safetensors.index.json")
MODEL_FILE_PREFIXES = ("tokenizer", "chat_template")


def content_hash(path: str | Path) -> str:
    """The sha256 (hex) of a file's bytes, read in 1 MiB chunks; of a directory, ``inputs_hash``."""
    path = Path(path)
    if path.is_dir():
        return inputs_hash(path)
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def relevant_model_files(path: str | Path) -> list[Path]:
    """The files of a model directory that ``inputs_hash`` covers, in name order."""
    path = Path(path)
    return sorted(p for p in path.iterdir() if p.is_file() and (
        p.name in MODEL_FILES or p.name.startswith(MODEL_FILE_PREFIXES) or p.suffix == ".safetensors"))


def inputs_hash(path: str | Path, weights: bool = True) -> str:
    """The sha256 (hex) of a model directory's relevant files: each file's name, size and sha256 (the
    ``*.safetensors`` shards by name and size only when ``weights`` is False)."""
    entries = []
    for file in relevant_model_files(path):
        size = file.stat().st_size
        digest = content_hash(file) if weights or file.suffix != ".safetensors" else "not hashed"
        entries.append([file.name, size, digest])
    if not entries:
        raise FileNotFoundError(f"{path}: no model files to hash (expected config.json, tokenizer files or "
                                f"*.safetensors)")
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()


def inputs_record(cfg, base_dir: str | Path | None = None, weights: bool = True) -> dict[str, str]:
    """``{input: sha256}`` for each file the run reads: ``data.train_path`` / ``data.test_path`` when set,
    and, when there is a base model directory ``base_dir`` with a config.json, ``base.config`` (that file)
    and ``base.files`` (``inputs_hash`` of the directory, weights hashed unless ``weights`` is False)."""
    record = {}
    for key in ("train_path", "test_path"):
        value = getattr(cfg.data, key, None)
        if value:
            if not Path(value).is_file():
                raise FileNotFoundError(f"data.{key}={value}: no such file (expected the dataset file the run reads)")
            record[f"data.{key}"] = content_hash(value)
    if base_dir is not None and (Path(base_dir) / "config.json").is_file():
        record["base.config"] = content_hash(Path(base_dir) / "config.json")
        record["base.files"] = inputs_hash(base_dir, weights=weights)
    return record


def inputs_diff(recorded: dict | None, current: dict) -> list[str]:
    """``'<input>: <recorded hash> -> <current hash>'`` for each input both records name and that differs
    (a record without an input, such as a run that predates input hashes, has nothing to compare)."""
    recorded = recorded or {}
    return [f"{key}: {recorded[key]} -> {current[key]}" for key in sorted(set(recorded) & set(current))
            if recorded[key] != current[key]]
