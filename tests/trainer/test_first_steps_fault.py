"""A fault-injected embedded run fails the first-step checker by step 5; the same run without the fault passes.

The fault is the one Megatron-Bridge's shared-expert overlap makes at TP > 1 (its adapter sees the base
linear with TP communication off and the later reduction sums the delta TP times): the trainer applies
an adapter delta twice while the rollout engine, fed by refit with the very same LoRA tensors, applies it
once. Here the delta is the DeepSeek-V3 preset's shared expert adapter (one LoRA pair per fused expert
tensor for all experts, Bridge's ``share_expert_adapters``), doubled in the trainer's copy only. LoRA B starts at 0,
so step 1 is clean and the k3 floor passes; the gap grows with B from step 2 on. An entropy bonus moves
the random-init policy although its rewards give no advantage, so B leaves 0 in five steps.
"""
from __future__ import annotations

import pytest

from conftest import tiny_overrides

pytestmark = pytest.mark.slow


def _run(tmp_path, fault: bool):
    from moerl.config import load_config
    from moerl.lora.expert_modes import expert_lora_modules
    from moerl.trainer.grpo import GRPOTrainer
    from moerl.verl_ext import first_steps as fs

    keep = ("trainer.steps", "trainer.eval_every", "trainer.checkpoint_every", "trainer.samples_every")
    overrides = [o for o in tiny_overrides(tmp_path) if not o.startswith(keep)] + [
        "trainer.steps=5", "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.samples_every=0",
        "lora.expert_mode=shared", "loss.entropy_coef=0.05", "trainer.lr=0.02"]
    cfg = load_config("experiments/00_tiny_moe_cpu/arms/deepseek_baseline.yaml", overrides)
    trainer = GRPOTrainer(cfg, tmp_path / "run", progress=False)
    if fault:  # the trainer's copy only: the engine was copied at construction and gets plain refits
        doubled = list(expert_lora_modules(trainer.policy).values())
        assert doubled and all(d.lora_A.shape[0] == d.lora_B.shape[0] == 1 for d in doubled)  # shared pairs
        for d in doubled:
            d.forward = lambda weight, d=d: weight + 2 * d.delta().to(weight.dtype)
    trainer.train()
    fam, r3 = fs.family_and_r3(tmp_path / "run")
    return {v.name: v for v in fs.check(fs.read_rows(tmp_path / "run"), fam, r3)}


def test_healthy_run_passes_every_first_step_invariant(tmp_path):
    verdicts = _run(tmp_path, fault=False)
    assert all(v.ok for v in verdicts.values()), verdicts


def test_shared_expert_delta_applied_twice_fails_mismatch_growth_by_step_5(tmp_path):
    verdicts = _run(tmp_path, fault=True)
    failed = {n for n, v in verdicts.items() if not v.ok}
    assert failed == {"mismatch_growth"}, verdicts
    assert verdicts["k3_floor"].ok  # step 1 (B = 0) is clean: only the growth shows the fault
