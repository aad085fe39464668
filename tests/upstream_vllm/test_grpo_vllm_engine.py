"""The embedded GRPO loop with ``rollout.engine: vllm``: vLLM (CPU build) samples, the fp32 trainer
learns, adapter-only refit after every step. Arms without routing capture only (see moerl.rollout.vllm)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_upstream.sh vllm builds its venv")

from tests_helpers import tiny_overrides_for  # noqa: E402

from moerl.config import ConfigError, load_config  # noqa: E402
from moerl.tracking import read_metrics  # noqa: E402
from moerl.trainer.grpo import GRPOTrainer  # noqa: E402

ARM = "experiments/00_tiny_moe_cpu/arms/baseline.yaml"
VLLM = ["rollout.engine=vllm", "rollout.kernels=native", "rollout.capture_routing=false", "lora.target_experts=false"]


def test_grpo_steps_with_the_vllm_engine(tmp_path):
    cfg = load_config(ARM, tiny_overrides_for(tmp_path) + VLLM + ["trainer.steps=2", "trainer.eval_every=0"])
    run = Path(cfg.tracking.output_dir) / cfg.experiment / cfg.arm / f"seed{cfg.seed}"
    trainer = GRPOTrainer(cfg, run, progress=False)
    served = []
    original = trainer.engine.load_adapter

    def record(canonical):
        original(canonical)
        served.append(trainer.engine.lora_request.lora_int_id)

    trainer.engine.load_adapter = record
    summary = trainer.train()
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
    for r in rows:
        assert math.isfinite(r["mismatch/k3"]) and r["mismatch/k3"] >= 0 and r["mismatch/tokens"] > 0
        assert "routing/agreement" not in r  # no routing capture on vLLM's CPU build
    assert [r["refit/version"] for r in rows] == [1.0, 2.0] and served == [1, 2]


@pytest.mark.parametrize("override, key", [("refit.mode=merged", "refit.mode=adapter"),
                                           ("refit.engine=process", "refit.engine=inprocess")])
def test_vllm_engine_config_rules_name_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(ARM, tiny_overrides_for(tmp_path) + VLLM + [override])
