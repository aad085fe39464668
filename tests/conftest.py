"""Shared fixtures: tiny configs that run in seconds on 2 CPU cores, with nothing downloaded."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


def tiny_overrides(tmp_path) -> list[str]:
    """A random-init policy (no warm start), 8 prompts x 4 samples, 3 GRPO steps."""
    return [
        "warm_start.enabled=false", "model.init_std=0.1", "rollout.prompts_per_step=8", "rollout.group_size=4",
        "trainer.steps=3", "trainer.micro_batch_size=16", "trainer.eval_every=2", "trainer.eval_size=16",
        "trainer.checkpoint_every=1", "trainer.samples_every=2", "trainer.samples_per_save=64",
        f"tracking.output_dir={tmp_path}", "tracking.wandb_mode=disabled", "tracking.progress_bar=false",
        "data.train_size=512", "data.test_size=16",
    ]


@pytest.fixture
def tiny_cfg(tmp_path):
    from moerl.config import load_config

    return load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml", tiny_overrides(tmp_path))


@pytest.fixture(scope="session")
def tokenizer():
    from moerl.data.tokenizer import build_tokenizer

    return build_tokenizer()
