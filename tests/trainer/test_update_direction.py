"""The GRPO update moves the policy the way the advantages say: after one update, sequences with a
positive advantage are more likely and those with a negative one less likely (the surrogate
sum_i A_i * sum_t [log pi_new - log pi_old] rises), and flipping every advantage flips the direction.
A sign or alignment slip anywhere between the engine's batch and the optimiser step breaks this."""
import pytest
import torch

from moerl.config import load_config
from moerl.trainer.grpo import GRPOTrainer
from moerl.trainer.logprobs import forward_logprobs
from tests_helpers import tiny_overrides_for

BASE = "experiments/00_tiny_moe_cpu/arms/baseline.yaml"


def surrogate_change(tmp_path, sign: float, mini_batches: int) -> tuple[float, float]:
    cfg = load_config(BASE, tiny_overrides_for(tmp_path) + [
        "rollout.dtype=fp32", f"trainer.mini_batches={mini_batches}", "trainer.lr=0.001",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.eval_every=0", "threads=1"])
    trainer = GRPOTrainer(cfg, tmp_path / "run", progress=False)
    try:
        rows = trainer.sampler.next(cfg.rollout.prompts_per_step)
        batch = trainer.engine.generate([r["question"] for r in rows], [r["answer"] for r in rows],
                                        cfg.rollout.group_size, seed=0)
        mask = batch.response_mask.float()
        # Half of each group is "right", half "wrong": zero-mean advantages within every group.
        per_seq = sign * torch.tensor([1.0, -1.0] * (batch.input_ids.shape[0] // 2))
        advantages = per_seq[:, None].expand_as(mask).contiguous()
        old = trainer.old_logprobs(batch, replay=None).logp
        trainer.update(batch, old, advantages, None, seed=0)
        with torch.no_grad():
            trainer.policy.eval()
            new, _ = forward_logprobs(trainer.policy, batch, cfg.rollout.temperature)
        seq_delta = ((new - old) * mask).sum(-1)
        return float((per_seq * seq_delta).sum()), float(seq_delta.abs().sum())
    finally:
        trainer.close()


@pytest.mark.parametrize("mini_batches", [1, 4])
def test_update_raises_the_advantage_weighted_logprob(tmp_path, mini_batches):
    gain, moved = surrogate_change(tmp_path / "plus", 1.0, mini_batches)
    flipped, moved_flipped = surrogate_change(tmp_path / "minus", -1.0, mini_batches)
    assert moved > 0 and moved_flipped > 0  # the update changed the policy at all
    assert gain > 0.1 * moved, (gain, moved)  # and mostly in the advantages' direction
    assert flipped > 0.1 * moved_flipped, (flipped, moved_flipped)
