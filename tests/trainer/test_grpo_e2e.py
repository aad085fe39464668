"""End to end: a few GRPO steps on CPU, the run directory, metrics rows, resume and bad steps."""
import json

import pytest
import torch
from safetensors.torch import load_file

from moerl import faults
from moerl.config import load_config
from moerl.tracking import read_metrics
from moerl.trainer.grpo import GRPOTrainer
from tests_helpers import tiny_overrides_for


def run_dir_of(cfg):
    from pathlib import Path

    return Path(cfg.tracking.output_dir) / cfg.experiment / cfg.arm / f"seed{cfg.seed}"


def crash_after_checkpoint(cfg, step: int, monkeypatch) -> None:
    """Train ``cfg`` until the checkpoint of ``step`` is written, then die as a killed process would."""
    cut = GRPOTrainer(cfg, run_dir_of(cfg), progress=False)

    class Crash(BaseException):
        pass

    def crash(point):
        if point == "after_checkpoint" and cut.step_idx == step:
            raise Crash

    monkeypatch.setattr(faults, "hit", crash)
    with pytest.raises(Crash):
        cut.train()
    monkeypatch.undo()
    cut.tracker.close()


@pytest.mark.slow
def test_run_directory_metrics_and_exact_resume(tmp_path, monkeypatch):
    full_cfg = load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml", tiny_overrides_for(tmp_path / "a"))
    summary = GRPOTrainer(full_cfg, run_dir_of(full_cfg), progress=False).train()
    run = run_dir_of(full_cfg)
    for name in ("config.yaml", "git_sha.txt", "metrics.jsonl", "summary.json"):
        assert (run / name).exists(), name
    rows = read_metrics(run / "metrics.jsonl")
    # step-0 evaluation, three training rows (step 2 carries its evaluation), a final evaluation row
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 3]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    for key in ("reward/mean", "loss/policy", "clip/frac", "grad_norm", "entropy", "response/length_mean",
                "mismatch/k3", "routing/agreement/layer0", "routing/agreement/layer3", "time/step"):
        assert key in train_rows[0], key
    assert any("eval/pass1" in r for r in rows)
    assert summary["steps"] == 3 and json.loads((run / "summary.json").read_text())["steps"] == 3
    assert list((run / "samples").glob("step_*.npz"))
    # the final checkpoint carries the LoRA as a stock PEFT adapter holding exactly the trained tensors
    from peft import PeftModel

    from moerl.data.tokenizer import build_tokenizer
    from moerl.models.presets import build_model

    last = sorted((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    assert (last / "adapter" / "vllm" / "adapter_model.safetensors").exists()
    loaded = PeftModel.from_pretrained(build_model(full_cfg.model, build_tokenizer(), seed=full_cfg.data.seed),
                                       str(last / "adapter" / "peft"))
    params = dict(loaded.named_parameters())
    trained = load_file(str(last / "lora.safetensors"))
    assert trained and all(torch.equal(params[name], value) for name, value in trained.items())

    # Interrupted after step 2's checkpoint, then resumed to step 3: same weights, no duplicated rows.
    resumed_cfg = load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml", tiny_overrides_for(tmp_path / "b"))
    crash_after_checkpoint(resumed_cfg, 2, monkeypatch)
    with open(run_dir_of(resumed_cfg) / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 3, "reward/mean": 0.5, "partial": tr')  # a row the crash left half-written
    GRPOTrainer(resumed_cfg, run_dir_of(resumed_cfg), resume=True, progress=False).train()
    resumed_rows = [r for r in read_metrics(run_dir_of(resumed_cfg) / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in resumed_rows] == [1, 2, 3]
    for a, b in zip(train_rows, resumed_rows):
        assert a["reward/mean"] == b["reward/mean"]
    final_a = load_file(run / "checkpoints/step_3/lora.safetensors")
    final_b = load_file(run_dir_of(resumed_cfg) / "checkpoints/step_3/lora.safetensors")
    for name in final_a:
        torch.testing.assert_close(final_a[name], final_b[name], rtol=0, atol=1e-6)


def test_non_finite_loss_skips_the_update(tmp_path, monkeypatch):
    cfg = load_config("experiments/00_tiny_moe_cpu/arms/baseline.yaml",
                      tiny_overrides_for(tmp_path) + ["trainer.steps=1"])
    trainer = GRPOTrainer(cfg, run_dir_of(cfg), progress=False)
    before = {k: v.detach().clone() for k, v in trainer.trainable.items()}
    import moerl.trainer.grpo as grpo

    real = grpo.policy_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(grpo, "policy_loss", nan_loss)
    metrics = trainer.step()
    assert metrics["updates/skipped_nonfinite"] == cfg.trainer.mini_batches
    for k, v in trainer.trainable.items():
        assert torch.equal(v, before[k]), k
    assert read_metrics(run_dir_of(cfg) / "metrics.jsonl")[-1]["updates/skipped_nonfinite"] > 0


def test_resume_keeps_the_r3_agreement_alarm_reference(tmp_path, monkeypatch):
    """The alarm's no-replay reference is measured every paired_replay_every steps; a run resumed between
    two measurements logs the same alarm rows as the uninterrupted run."""
    def cfg_in(sub):
        return load_config("experiments/00_tiny_moe_cpu/arms/r3.yaml",
                           tiny_overrides_for(tmp_path / sub) + ["trainer.paired_replay_every=3",
                                                                 "rollout.capture_routing=true"])

    full = cfg_in("a")
    GRPOTrainer(full, run_dir_of(full), progress=False).train()
    keys = ("routing/agreement_alarm", "routing/agreement_reference")
    want = [{k: r.get(k) for k in keys} for r in read_metrics(run_dir_of(full) / "metrics.jsonl") if "reward/mean" in r]
    assert want[2]["routing/agreement_reference"] is not None  # step 3 checks against step 1's reference

    cut_cfg = cfg_in("b")
    crash_after_checkpoint(cut_cfg, 2, monkeypatch)
    GRPOTrainer(cut_cfg, run_dir_of(cut_cfg), resume=True, progress=False).train()
    got = [{k: r.get(k) for k in keys} for r in read_metrics(run_dir_of(cut_cfg) / "metrics.jsonl") if "reward/mean" in r]
    assert got == want
