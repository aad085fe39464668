"""Tasks: the synthetic arithmetic task, real math dataset loaders and the verl parquet converter."""
from __future__ import annotations

from moerl.config import DataConfig
from moerl.data.datasets import load_hub, load_local
from moerl.data.synthetic import arith_splits, worked_splits


def load_splits(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train, test) rows ``{"question", "answer"}`` for the configured task."""
    if cfg.task == "arith":
        return arith_splits(cfg.train_size, cfg.test_size, cfg.seed, cfg.max_a, cfg.max_bc)
    if cfg.task == "arith_steps":
        return worked_splits(cfg.train_size, cfg.test_size, cfg.seed, cfg.max_a, cfg.max_bc)
    if cfg.train_path:
        train = load_local(cfg.train_path, cfg.task)
        test = load_local(cfg.test_path, cfg.task) if cfg.test_path else []
    elif cfg.hub_id:
        train, test = load_hub(cfg.hub_id, "train", cfg.task), load_hub(cfg.hub_id, "test", cfg.task)
    else:
        raise ValueError(f"data.task={cfg.task} needs data.train_path (local parquet/jsonl) or data.hub_id")
    return train[: cfg.train_size], test[: cfg.test_size]
