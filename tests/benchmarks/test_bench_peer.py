"""benchmarks/bench_peer.py: its batch mapping onto TRL, argument parsing and result summary (no TRL needed),
and a two-step smoke run against TRL that is skipped where TRL is not installed (the main venv; it runs
in .venv-peer, built by scripts/setup_peer_env.sh)."""
from __future__ import annotations

import json

import pytest
import torch

from tests_helpers import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_peer.py", "_bench_peer")


def test_trl_batch_matches_moerl_step(bench):
    # The baseline arm: 32 prompts x 8 samples, 2 mini-batches, micro-batches of 128.
    matched = bench.trl_batch(256, 8, 128, 2, 1, "matched")
    assert matched == {"per_device_train_batch_size": 128, "gradient_accumulation_steps": 1,
                       "steps_per_generation": 2, "num_generations": 8, "optimizer_steps_per_generation": 2,
                       "old_logprob_pass": True}
    default = bench.trl_batch(256, 8, 128, 2, 1, "default")
    assert default["gradient_accumulation_steps"] == default["steps_per_generation"] == 2
    assert default["optimizer_steps_per_generation"] == 1 and not default["old_logprob_pass"]
    # 4 mini-batches of 2 micro-batches: 4 optimizer steps, each accumulating 2 micro-batches.
    four = bench.trl_batch(1024, 8, 128, 4, 1, "matched")
    assert (four["gradient_accumulation_steps"], four["steps_per_generation"],
            four["optimizer_steps_per_generation"], four["old_logprob_pass"]) == (2, 8, 4, True)
    with pytest.raises(ValueError):
        bench.trl_batch(256, 8, 96, 2, 1, "matched")  # 128 is not whole micro-batches of 96
    with pytest.raises(ValueError):
        bench.trl_batch(256, 8, 128, 2, 2, "matched")
    with pytest.raises(ValueError):
        bench.trl_batch(256, 8, 128, 2, 1, "other")


def test_parse_args(bench):
    args = bench.parse_args([])
    assert (args.rounds, args.per_round, args.warmup, args.threads) == (8, 2, 1, 1)
    assert args.structures == ["matched", "default"] and args.arm == bench.DEFAULT_ARM
    args = bench.parse_args(["--rounds", "2", "--structures", "matched", "rollout.group_size=4"])
    assert bench.parse_args(["--structures", "default,matched"]).structures == ["default", "matched"]
    assert args.rounds == 2 and args.structures == ["matched"] and args.overrides == ["rollout.group_size=4"]
    for bad in (["--rounds", "0"], ["--threads", "0"], ["--warmup", "-1"], ["--structures", "x"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_summarise_and_report(bench):
    rounds = [{"moerl": [2.0, 2.0], "trl_matched": [4.0, 4.0], "trl_default": [1.0, 1.0]},
              {"moerl": [3.0, 3.0], "trl_matched": [2.0, 2.0], "trl_default": [3.0, 3.0]}]
    s = bench.summarise(rounds, target=0.8)
    assert s["sides"]["moerl"] == {"median": 2.5, "min": 2.0, "max": 3.0, "n": 4}
    assert s["structures"]["matched"]["ratio"] == pytest.approx(2.5 / 3.0)
    assert s["structures"]["matched"]["paired_ratio"] == pytest.approx((0.5 + 1.5) / 2)
    assert s["structures"]["default"]["ratio"] == pytest.approx(2.5 / 2.0)
    assert not s["target_met"] and not s["structures"]["default"]["target_met"]
    text = bench.report(s)
    assert "moerl / TRL (matched): 0.83" in text and "NOT met" in text
    fast = bench.summarise([{"moerl": [1.0], "trl_matched": [2.0]}])
    assert fast["target_met"] and "target <= 0.8: met" in bench.report(fast)
    with pytest.raises(ValueError):
        bench.summarise([{"trl_matched": [1.0]}])


@pytest.mark.slow
def test_smoke_against_trl(bench, tmp_path):
    """Two generation rounds per side on a small batch of the baseline arm's warm start: every check passes
    (N completions of <= 8 tokens, TRL's old-logprob pass as planned, both LoRAs trained)."""
    pytest.importorskip("trl", reason="TRL is only in .venv-peer (scripts/setup_peer_env.sh)")
    from moerl.config import load_config
    from moerl.trainer.warm_start import warm_start_dir

    small = ["rollout.prompts_per_step=8", "rollout.group_size=4", "trainer.micro_batch_size=16"]
    if not (warm_start_dir(load_config(bench.DEFAULT_ARM, small)) / "meta.json").exists():
        pytest.skip("no cached warm start (results/warm_start): a random policy earns no reward to train on")
    threads = torch.get_num_threads()
    try:
        result = bench.main(["--rounds", "1", "--per-round", "1", "--warmup", "1", "--out", str(tmp_path), *small])
    finally:
        torch.set_num_threads(threads)  # the bench sets --threads (1) process-wide
    assert result["checks"]["problems"] == []
    assert set(result["structures"]) == {"matched", "default"}
    assert all(s["n"] == 1 for s in result["sides"].values())
    assert result["checks"]["same_base_weights"] == {"trl_matched": True, "trl_default": True}
    saved = json.loads((tmp_path / "bench_peer.json").read_text())
    assert saved["versions"]["trl"] and saved["structures"]["matched"]["ratio"] > 0
