"""Tasks: the synthetic arithmetic task, real math dataset loaders and the verl parquet converter."""
from __future__ import annotations

from moerl.config import DataConfig
from moerl.data.datasets import DataError, load_hub, load_local
from moerl.data.synthetic import arith_splits, worked_splits


def _named(load, key: str, path: str, task: str) -> list[dict]:
    """``load(path, task)``, its DataError prefixed with the config key (train or test split) it came from."""
    try:
        return load(path, task)
    except DataError as err:
        raise DataError(f"{key}: {err}") from None


def load_splits(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train, test) rows ``{"question", "answer"}`` for the configured task; a DataError (naming
    the file) when a split read from a file has no usable row. Without data.test_path the test
    split is empty (a converter may need only the training rows; the trainer refuses it)."""
    if cfg.task == "arith":
        return arith_splits(cfg.train_size, cfg.test_size, cfg.seed, cfg.max_a, cfg.max_bc)
    if cfg.task == "arith_steps":
        return worked_splits(cfg.train_size, cfg.test_size, cfg.seed, cfg.max_a, cfg.max_bc)
    if cfg.train_path:
        train = _named(load_local, "data.train_path", cfg.train_path, cfg.task)
        test = _named(load_local, "data.test_path", cfg.test_path, cfg.task) if cfg.test_path else None
        sources = (cfg.train_path, cfg.test_path)
    elif cfg.hub_id:
        train, test = load_hub(cfg.hub_id, "train", cfg.task), load_hub(cfg.hub_id, "test", cfg.task)
        sources = (f"{cfg.hub_id}[train]", f"{cfg.hub_id}[test]")
    else:
        raise DataError(f"data.task={cfg.task} needs data.train_path (local parquet/jsonl) or data.hub_id")
    for rows, source, split in ((train, sources[0], "training"), (test, sources[1], "test")):
        if rows is not None and not rows:
            raise DataError(f"{source}: no usable {split} rows (every row lacks a question or a valid answer; "
                            f"the log names the first ones)")
    return train[: cfg.train_size], (test or [])[: cfg.test_size]
