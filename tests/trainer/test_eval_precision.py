"""One evaluator for every arm: with ``trainer.eval_precision=fp32`` the held-out accuracy of a bf16 arm
and of the fp32 control is measured by the same fp32 policy, so the two agree before training (no
step-0 offset from the evaluator's precision)."""
from moerl.config import load_config
from moerl.trainer.grpo import GRPOTrainer

ARM = "experiments/00_tiny_moe_cpu/arms/baseline.yaml"


def step0_eval(tmp_path, name, extra):
    """Held-out accuracy at step 0, from experiment 00's committed warm start (64 held-out problems)."""
    cfg = load_config(ARM, ["trainer.eval_size=64", "rollout.prompts_per_step=4", f"tracking.output_dir={tmp_path}",
                            "tracking.wandb_mode=disabled", "tracking.progress_bar=false", *extra])
    trainer = GRPOTrainer(cfg, tmp_path / name, progress=False)
    try:
        return trainer.evaluate()
    finally:
        trainer.close()


def test_fp32_evaluator_removes_the_precision_offset(tmp_path):
    control = step0_eval(tmp_path, "fp32", ["rollout.dtype=fp32"])
    bf16_by_fp32 = step0_eval(tmp_path, "bf16_fp32eval", ["trainer.eval_precision=fp32"])
    bf16_by_engine = step0_eval(tmp_path, "bf16", [])
    assert 0 < control["eval/pass1"] < 1
    assert bf16_by_fp32 == control
    # The bf16 engine is another evaluator: it samples other completions from the same seed.
    assert bf16_by_engine != control
