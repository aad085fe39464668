"""benchmarks/bench_floor.py: its FLOP count against torch's own FLOP counter on a real forward, the phase
arithmetic on a hand-sized batch, and the GEMM-rate timer."""
from __future__ import annotations

import pytest
import torch

from tests_helpers import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_floor.py", "_bench_floor")


@pytest.mark.parametrize("lora_attention", [False, True])
def test_forward_count_equals_torch_flop_counter(bench, tokenizer, lora_attention):
    """A teacher-forced forward of a real Qwen3-MoE (eager attention and experts, so every product is an
    aten matmul torch's counter sees), counted by torch.utils.flop_counter and by bench_floor, agree
    exactly when bench_floor is told the forward attends the full T x T square and takes every logit."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from moerl.config import load_config
    from moerl.lora.peft_lora import apply_lora
    from moerl.models.presets import build_hf_config

    cfg = load_config("experiments/07_dose_threshold/arms/baseline.yaml",
                      ["model.num_layers=2", "lora.target_experts=false"])
    hf = build_hf_config(cfg.model, len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id,
                         tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf, experts_implementation="eager", attn_implementation="eager")
    if lora_attention:
        model = apply_lora(model, cfg.lora, cfg.model.preset)
    n, t = 3, 11
    ids = torch.randint(5, len(tokenizer), (n, t))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False)
    dims = bench.Dims.of(cfg, len(tokenizer))
    if not lora_attention:
        dims = bench.Dims(**{**dims.__dict__, "rank": 0})
    count = bench.forward_count(dims, tokens=n * t, pairs=n * t * t, logit_positions=n * t, rows=n * t)
    # The rotary embedding's frequency table is an outer product (inv_freq x positions) torch counts as a
    # bmm: not matrix work of the model, and left out of the floor.
    rotary = sum(v for name, ops in counter.get_flop_counts().items() if name.endswith("rotary_emb")
                 for v in ops.values())
    assert 0 < rotary < 1e-3 * counter.get_total_flops()
    assert count.total == counter.get_total_flops() - rotary
    assert ("lora.attention" in count.terms) == lora_attention


def test_phase_counts_by_hand(bench):
    """One sample, prompt 3 tokens, response 2 (the second never forwarded), one layer of everything."""
    d = bench.Dims(hidden=4, layers=1, experts=2, top_k=1, inter=3, heads=1, kv_heads=1, head_dim=2, vocab=5)
    lengths = bench.Lengths(prompt=[3], response=[2], padded_prompt=3, padded_total=5)
    counts = bench.phase_counts(d, lengths, micro_batch=8, epochs=1)
    per_token = 2 * (4 * 2 + 4 * 2 + 4 * 2 + 2 * 4) + 2 * 4 * 2 + 2 * (4 * 6 + 3 * 4)  # projections, router, expert
    core_per_pair = 2 * 2 * 1 * 2
    lm_head = 2 * 4 * 5
    # rollout: 3 prefill tokens (pairs 1+2+3) and 1 decode token at position 3 (4 pairs); logits at 2 positions
    assert counts["time/rollout"].total == 4 * per_token + (6 + 4) * core_per_pair + 2 * lm_head
    # old-logprob: 4 positions (pairs 1+2+3+4), logits at the 2 response positions
    old = 4 * per_token + 10 * core_per_pair + 2 * lm_head
    assert counts["time/old_logprob"].total == old
    # update: forward + input gradients (the same) + the attention core once more (no LoRA here)
    assert counts["time/update"].total == 2 * old + 10 * core_per_pair


def test_gemm_rate_is_a_positive_rate(bench):
    rates = bench.GemmRates(repeats=2, min_seconds=0.001)
    assert rates((16, 8, 4)) > 0 and rates(("bmm", 2, 3, 4, 5)) > 0
    assert len(rates.cache) == 2
