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


class CountingEngine:
    """Answers correctly on the even-numbered generation calls: enough to check evaluate_policy's
    denominators and batching without a model."""

    def __init__(self):
        self.calls = []

    def generate(self, questions, answers, group_size, greedy=False, seed=0):
        from types import SimpleNamespace

        self.calls.append((len(questions), group_size, greedy))
        rows = [(q, a) for q, a in zip(questions, answers) for _ in range(group_size)]
        texts = [f"\\boxed{{{a}}}" if k % 2 == 0 else "\\boxed{-1}" for k, (_, a) in enumerate(rows)]
        return SimpleNamespace(texts=texts, answers=[a for _, a in rows])


def test_pass1_averages_eval_samples_per_problem():
    from moerl.trainer.warm_start import evaluate_policy

    rows = [{"question": f"q{i}", "answer": str(i + 1)} for i in range(10)]
    engine = CountingEngine()
    acc = evaluate_policy(engine, rows, seed=0, batch=8, samples=3)
    # 30 sampled completions (every other one right: 15) and 10 greedy ones (5 right)
    assert acc == {"pass1": 15 / 30, "greedy": 5 / 10}
    sampled = [c for c in engine.calls if not c[2]]
    assert all(n * k <= 8 for n, k, _ in sampled) and sum(n for n, _, _ in sampled) == 10
    assert {k for _, k, _ in sampled} == {3}
