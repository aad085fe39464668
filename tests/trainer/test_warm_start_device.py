"""The warm start on a chosen device: on the CPU it is the same computation as before, bit for bit."""
import random

import torch

from moerl.config import WARM_START_PCT_START, load_config
from moerl.data import load_splits
from moerl.data.tokenizer import build_tokenizer
from moerl.models.presets import build_model
from moerl.trainer.warm_start import sft_batch, supervised_warm_start

TINY = ["data.train_size=64", "data.test_size=4", "warm_start.steps=4", "warm_start.batch_size=4",
        "rollout.max_new_tokens=4", "model.num_layers=2", "model.num_experts=4", "model.top_k=2"]


def reference_sft(cfg, seed=None):
    """The warm start's training loop as written before it took a device (one inline loop on the CPU); ``seed``
    in place of the data seed for the initial weights and the batch order (the data split stays the config's)."""
    seed = cfg.data.seed if seed is None else seed
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    train_rows, _ = load_splits(cfg.data)
    model = build_model(cfg.model, tokenizer, seed=seed)
    model.config.output_router_logits = True
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.warm_start.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.warm_start.lr, total_steps=cfg.warm_start.steps,
                                                pct_start=WARM_START_PCT_START)
    rng = random.Random(seed)
    for _ in range(cfg.warm_start.steps):
        ids, mask, labels = sft_batch(rng.sample(train_rows, cfg.warm_start.batch_size), tokenizer, cfg.data.task)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return model


def test_cpu_warm_start_is_the_inline_loop_bit_for_bit():
    cfg = load_config("experiments/00_tiny_moe_cpu/base.yaml", TINY)
    model, _, meta = supervised_warm_start(cfg, progress=False)
    reference = reference_sft(cfg).state_dict()
    got = model.state_dict()
    assert got.keys() == reference.keys()
    assert all(torch.equal(got[k], reference[k]) for k in got)
    assert "device" not in meta and meta["steps"] == 4 and set(meta["test_accuracy"]) == {"pass1", "greedy"}
    assert all(p.grad is None for p in model.parameters())  # the optimiser state and gradients are released


def test_build_model_creates_the_weights_on_the_device_asked_for():
    cfg = load_config("experiments/00_tiny_moe_cpu/base.yaml", TINY).model
    tokenizer = build_tokenizer()
    meta = build_model(cfg, tokenizer, device="meta")
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    default, cpu = build_model(cfg, tokenizer, seed=3), build_model(cfg, tokenizer, seed=3, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(default.state_dict().values(), cpu.state_dict().values()))


def test_a_warm_start_without_a_bar_logs_its_progress_when_asked(caplog):
    """A borrowed GPU runs the SFT under a hard time limit with no bar: the log shows each step's rate and
    what is left, so a point cut off by the limit still says how far it got; the weights are unchanged."""
    import logging

    cfg = load_config("experiments/00_tiny_moe_cpu/base.yaml", TINY)
    with caplog.at_level(logging.INFO, logger="moerl.trainer.warm_start"):
        model, _, _ = supervised_warm_start(cfg, progress=False, log_every_s=0.0)
    lines = [r.getMessage() for r in caplog.records]
    steps = [line for line in lines if line.startswith("warm start: step ")]
    assert [line.split(",")[0] for line in steps] == [f"warm start: step {k} of 4" for k in (1, 2, 3, 4)]
    assert all(" s a step, about " in line for line in steps)
    assert any(line.startswith("warm start: 4 steps in ") and "evaluating on 4 held-out prompts" in line
               for line in lines)
    reference = reference_sft(cfg).state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moerl.trainer.warm_start"):
        supervised_warm_start(cfg, progress=False)  # not asked: no step lines (a sweep's log stays short)
    assert not [r for r in caplog.records if r.getMessage().startswith("warm start: step ")]


def test_another_sft_seed_changes_the_init_and_batch_order_not_the_data(tmp_path):
    """``init_seed``: a second SFT of the same data (the spread between SFTs, measured on a GPU by
    scripts/gpu_width_geometry.py --sft-seed); the default is the data seed, bit for bit."""
    import pytest

    cfg = load_config("experiments/00_tiny_moe_cpu/base.yaml", TINY)
    other, _, meta = supervised_warm_start(cfg, progress=False, init_seed=cfg.data.seed + 7)
    reference = reference_sft(cfg, seed=cfg.data.seed + 7).state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in other.state_dict().items())
    default = reference_sft(cfg).state_dict()
    assert not all(torch.equal(v, default[k]) for k, v in other.state_dict().items())
    assert meta["init_seed"] == cfg.data.seed + 7
    with pytest.raises(ValueError, match="init_seed with a progress_file"):
        supervised_warm_start(cfg, progress=False, init_seed=1, progress_file=tmp_path / "progress.pt")
