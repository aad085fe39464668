"""vLLM's CPU build over a checkpoint directory (model.path): the mismatch probe and two GRPO steps, on a
hub-format double written here. Routes and expert LoRA need a GPU build (moerl.rollout.vllm), so the probe
records k3 only and the adapter covers attention."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_upstream.sh vllm builds its venv")

from moerl.models.doubles import write_double, write_gsm8k_file  # noqa: E402


@pytest.fixture(scope="module")
def double(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    write_double("qwen3_moe", root / "qwen3_moe")
    write_gsm8k_file(root / "train.jsonl", 32)
    write_gsm8k_file(root / "test.jsonl", 8, seed=1)  # jsonl: vLLM's environment has no parquet reader
    return root


def test_probe_with_vllm_over_a_checkpoint(double, tmp_path):
    out = tmp_path / "probe.json"
    done = subprocess.run([sys.executable, "scripts/probe.py", "--model", str(double / "qwen3_moe"), "--data",
                           str(double / "train.jsonl"), "--engine", "vllm", "--precisions", "bf16", "--prompts", "4",
                           "--max-new-tokens", "8", "--batch", "4", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())["precisions"]["bf16"]
    assert math.isfinite(record["k3"]["value"]) and record["k3"]["value"] >= 0 and record["response_tokens"] > 0
    assert record["reroute_any"] is None  # vLLM's CPU build returns no routes
    assert "no figure: matplotlib is not installed" in done.stdout  # vLLM's environment draws nothing


def test_grpo_steps_with_vllm_over_a_checkpoint(double, tmp_path):
    from moerl.config import load_config
    from moerl.trainer.grpo import GRPOTrainer

    cfg = load_config("experiments/08_real_moe/arms/baseline.yaml", [
        f"model.path={double / 'qwen3_moe'}", f"data.train_path={double / 'train.jsonl'}",
        f"data.test_path={double / 'test.jsonl'}", "device=cpu", "rollout.engine=vllm", "rollout.kernels=native",
        "rollout.capture_routing=false", "lora.target_experts=false", "rollout.prompts_per_step=4",
        "rollout.group_size=2", "rollout.max_new_tokens=8", "trainer.steps=2", "trainer.micro_batch_size=8",
        "trainer.mini_batches=2", "trainer.eval_every=0", "trainer.eval_size=4", "trainer.checkpoint_every=0",
        "trainer.samples_every=0", "trainer.warmup_steps=0", "trainer.activation_checkpointing=false", "lora.rank=4",
        "lora.alpha=8", "data.max_prompt_tokens=256", f"tracking.output_dir={tmp_path}", "tracking.wandb_mode=disabled",
        "tracking.progress_bar=false"])
    trainer = GRPOTrainer(cfg, cfg.run_dir, progress=False)
    trainer.train()
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["mismatch/k3"]) and r["mismatch/tokens"] > 0 for r in steps)
    assert [r["refit/version"] for r in steps] == [1.0, 2.0]
