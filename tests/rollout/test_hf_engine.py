"""The embedded rollout engine: RolloutBatch layout, routing capture, and the fp32 sanity check."""
import pytest
import torch

from moerl.config import RolloutConfig
from moerl.replay.session import routing_session
from moerl.rollout.hf import HFEngine
from moerl.trainer.logprobs import forward_logprobs
from moerl.trainer.metrics import mismatch_metrics
from tests_helpers import lora_policy

QUESTIONS = ["1+2*3=", "45+6*7=", "99+9*9="]  # different lengths -> left padding
ANSWERS = ["7", "87", "180"]


def test_batch_layout_and_trace(tokenizer):
    engine = HFEngine(lora_policy(tokenizer), tokenizer, RolloutConfig(dtype="bf16", max_new_tokens=6))
    batch = engine.generate(QUESTIONS, ANSWERS, group_size=2, seed=0)
    n, t = batch.input_ids.shape
    assert n == 6 and t == batch.prompt_length + 6
    assert batch.group.tolist() == [0, 0, 1, 1, 2, 2] and batch.answers[:2] == ["7", "7"]
    # Left padding: the shortest prompt starts with pad tokens that are masked out.
    assert batch.attention_mask[0, 0] == 0 and batch.input_ids[0, 0] == tokenizer.pad_token_id
    assert not batch.response_mask[:, : batch.prompt_length].any()
    assert (batch.rollout_logprobs[~batch.response_mask] == 0).all()
    assert (batch.rollout_logprobs[batch.response_mask] < 0).all()
    trace = batch.routing
    assert trace.indices.shape == (n, t, 4, 2) and trace.indices.dtype == torch.uint8
    assert trace.moe_layers == (0, 1, 2, 3)
    assert not trace.valid[~batch.attention_mask.bool()].any()  # padding has no route
    last = batch.response_mask.long().cumsum(-1).argmax(-1)
    assert not trace.valid[torch.arange(n), last].any()  # the last generated token has no route
    assert trace.valid[0, batch.prompt_length - 1]  # the last prompt token does


@pytest.mark.parametrize("preset", ["qwen3_moe", "deepseek_v3"])
def test_fp32_engine_matches_trainer_exactly(tokenizer, preset):
    """Sanity: fp32 rollout + non-zero LoRA -> rollout and trainer logprobs agree and no token's
    routing differs. If this fails, refit or alignment (positions under left padding, last token) is wrong."""
    policy = lora_policy(tokenizer, preset)
    engine = HFEngine(policy, tokenizer, RolloutConfig(dtype="fp32", max_new_tokens=6))
    engine.load_adapter({k: v.detach() for k, v in policy.named_parameters() if v.requires_grad})
    batch = engine.generate(QUESTIONS, ANSWERS, group_size=4, seed=3)
    n, t = batch.input_ids.shape
    with torch.no_grad(), routing_session(policy, (n, t - 1)) as session:
        logp, _ = forward_logprobs(policy.eval(), batch)
    m = mismatch_metrics(logp, batch.rollout_logprobs, batch.response_mask)
    assert m["mismatch/k3"] < 1e-6 and m["mismatch/k3_max"] < 1e-6
    ratio = (logp - batch.rollout_logprobs)[batch.response_mask].exp()
    assert (ratio - 1).abs().max() < 1e-5  # importance weights pi_trainer / pi_rollout are all 1
    trace = batch.routing.truncate_tokens(t - 1)
    for number in trace.moe_layers:
        idx, valid = trace.layer(number)
        same = (session.native[number].sort(-1).values == idx.sort(-1).values).all(-1)
        assert same[valid].all(), f"layer {number}: routing differs on {(~same[valid]).sum()} tokens"


def test_bf16_engine_shows_a_real_mismatch(tokenizer):
    policy = lora_policy(tokenizer)
    engine = HFEngine(policy, tokenizer, RolloutConfig(dtype="bf16", max_new_tokens=6))
    batch = engine.generate(QUESTIONS * 4, ANSWERS * 4, group_size=4, seed=3)
    with torch.no_grad():
        logp, _ = forward_logprobs(policy.eval(), batch)
    m = mismatch_metrics(logp, batch.rollout_logprobs, batch.response_mask)
    assert m["mismatch/k3"] > 1e-7 and m["mismatch/dp_max"] > 1e-4


def test_refit_rejects_unknown_or_misshapen_tensors(tokenizer):
    policy = lora_policy(tokenizer)
    engine = HFEngine(policy, tokenizer, RolloutConfig())
    name, p = next((k, v) for k, v in policy.named_parameters() if v.requires_grad)
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.load_adapter({"nope": p})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        engine.load_adapter({name: p[:1]})


@pytest.mark.parametrize("preset,dtype", [("qwen3_moe", "bf16"), ("qwen3_moe", "fp32"), ("qwen3_moe", "fp8"),
                                          ("deepseek_v3", "bf16")])
def test_materialised_expert_lora_is_bit_identical_to_peft_per_forward(tokenizer, preset, dtype, monkeypatch):
    """The engine folds each expert LoRA into its weight once per generate; PEFT folds it on every
    forward. Same sequences, same logprobs, same routes, bit for bit; and a refit still shows."""
    import moerl.rollout.hf as hf
    from contextlib import nullcontext

    policy = lora_policy(tokenizer, preset)
    engine = HFEngine(policy, tokenizer, RolloutConfig(dtype=dtype, max_new_tokens=6, capture_routing=True,
                                                       decode="generate"))

    def both():
        fast = engine.generate(QUESTIONS * 2, ANSWERS * 2, group_size=4, seed=5)
        with monkeypatch.context() as m:
            m.setattr(hf, "expert_lora_materialised", lambda model: nullcontext())
            slow = engine.generate(QUESTIONS * 2, ANSWERS * 2, group_size=4, seed=5)
        return fast, slow

    fast, slow = both()
    assert torch.equal(fast.input_ids, slow.input_ids)
    assert torch.equal(fast.rollout_logprobs, slow.rollout_logprobs)
    assert torch.equal(fast.routing.indices, slow.routing.indices)
    # After the context the wrappers fold per forward again (no parametrization left behind).
    experts = [m for n, m in engine.model.named_modules() if n.endswith("mlp.experts")]
    assert experts and not any(hasattr(m, "parametrizations") for m in experts)
    # A refit that changes the expert LoRA changes what the next generate computes.
    new = {k: v.detach() * 3 for k, v in policy.named_parameters() if v.requires_grad and "experts" in k}
    engine.load_adapter(new)
    refitted, slow_refitted = both()
    assert torch.equal(refitted.rollout_logprobs, slow_refitted.rollout_logprobs)
    assert not torch.equal(refitted.rollout_logprobs, fast.rollout_logprobs)


def test_materialised_expert_lora_refuses_autograd(tokenizer):
    from moerl.lora.peft_lora import expert_lora_materialised

    with pytest.raises(RuntimeError, match="inference"):
        with expert_lora_materialised(lora_policy(tokenizer)):
            pass


@pytest.mark.parametrize("decode", ["loop", "generate"])
def test_engine_generates_on_its_own_thread_count(tokenizer, monkeypatch, decode):
    """rollout.threads applies while the engine generates and the process's count comes back after."""
    import moerl.rollout.hf as hf

    seen = []
    engine = HFEngine(lora_policy(tokenizer), tokenizer, RolloutConfig(max_new_tokens=3, threads=1, decode=decode))
    owner, name = (hf, "decode") if decode == "loop" else (engine.model, "generate")
    generate = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: seen.append(torch.get_num_threads()) or generate(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine.generate(QUESTIONS, ANSWERS, group_size=2, seed=0)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
