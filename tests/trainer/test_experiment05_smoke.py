"""Experiment 05 at CI size: every arm loads; one GRPO step of each new mechanism runs and logs the
metrics the claims need; the R3 layer-mapping bug reproduction trips the agreement alarm and the fixed
R3 does not."""
from pathlib import Path

import pytest

from moerl.config import load_config
from moerl.trainer.grpo import GRPOTrainer
from tests_helpers import tiny_overrides_for

ARMS = Path(__file__).resolve().parents[2] / "experiments" / "05_mismatch_consequences" / "arms"
TINY = ["model.hidden_size=32", "model.num_layers=6", "model.num_experts=8", "model.top_k=2",
        "model.moe_intermediate_size=16", "model.num_heads=2", "model.num_kv_heads=2", "model.n_group=2",
        "model.topk_group=1", "rollout.max_new_tokens=10", "rollout.prompts_per_step=4",
        "trainer.paired_replay_every=1", "trainer.eval_every=0", "trainer.mini_batches=2", "threads=1"]


def test_every_arm_loads_and_the_bug_reproduction_is_labelled():
    arms = {p.stem: load_config(p) for p in ARMS.glob("*.yaml")}
    assert len(arms) >= 13 and all(c.experiment == "05_mismatch_consequences" for c in arms.values())
    mapped = {name for name, c in arms.items() if c.replay.layer_mapping == "position"}
    assert mapped == {"deepseek_r3_position_bug"}
    assert "REPRODUCTION OF A BUG" in (ARMS / "deepseek_r3_position_bug.yaml").read_text()
    assert arms["fp32_rollout"].rollout.dtype == "fp32" and arms["baseline_fp8"].rollout.dtype == "fp8"
    assert all(c.trainer.steps >= 300 and c.data.task == "arith_steps" for c in arms.values())


def one_step(arm, tmp_path):
    cfg = load_config(ARMS / f"{arm}.yaml", tiny_overrides_for(tmp_path) + TINY)
    trainer = GRPOTrainer(cfg, tmp_path / arm, progress=False)
    try:
        return trainer.step()
    finally:
        trainer.close()


@pytest.mark.parametrize("arm", ["baseline_fp8", "seq_mis"])
def test_one_step_logs_the_consequence_metrics(arm, tmp_path):
    m = one_step(arm, tmp_path)
    for key in ("routing/any_layer_differs", "routing/differing_layers_mean", "mismatch/extreme_gt2",
                "mismatch/extreme_gt10", "effective/seq_frac", "replay_effect/k3_ratio",
                "replay_effect/k3_ratio_lo", "replay_effect/k3_ratio_hi"):
        assert key in m, key
    assert 0.0 <= m["routing/any_layer_differs"] <= 1.0


def test_position_mapped_r3_trips_the_alarm_and_layer_number_r3_does_not(tmp_path):
    bug = one_step("deepseek_r3_position_bug", tmp_path)
    fixed = one_step("deepseek_r3", tmp_path)
    assert bug["replay/violations"] == 0 and bug["routing/replayed_agreement"] == 1.0  # invisible there
    assert bug["routing/agreement_alarm"] == 1.0 and fixed["routing/agreement_alarm"] == 0.0
    assert bug["routing/agreement"] < fixed["routing/agreement"]
