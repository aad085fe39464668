"""The vLLM engine without vLLM: engine/sampling args, requests, output parsing on vLLM's shapes (the engine
itself runs on vLLM's CPU build in tests/upstream_vllm)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from moerl.config import RolloutConfig
from moerl.rollout import vllm as V


@dataclass
class Logprob:  # vllm.sequence.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput (fields used)
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    routed_experts: np.ndarray | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list


def test_max_lora_rank_rounding_and_limits():
    assert [V.vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 32, 100, 300, 512)] == [1, 8, 8, 16, 32, 128, 320, 512]
    with pytest.raises(ValueError, match="up to 512"):
        V.vllm_max_lora_rank(600)


def test_engine_kwargs_tp_only_and_r3():
    cfg = RolloutConfig(dtype="bf16", capture_routing=True)
    kw = V.engine_kwargs("/m", cfg, lora_rank=24, tensor_parallel_size=4)
    assert kw["max_lora_rank"] == 32 and kw["enable_lora"] and kw["enable_return_routed_experts"]
    assert kw["tensor_parallel_size"] == 4 and kw["enable_expert_parallel"] is False and kw["dtype"] == "bfloat16"
    ep = V.engine_kwargs("/m", cfg, 8, tensor_parallel_size=4, expert_parallel=True)
    assert ep["enable_expert_parallel"] is True and "fully_sharded_loras" not in ep
    assert "enable_return_routed_experts" not in V.engine_kwargs("/m", RolloutConfig(capture_routing=False), 8)
    s = V.sampling_kwargs(RolloutConfig(top_k=0, temperature=0.7, max_new_tokens=5), group_size=4)
    assert s["n"] == 4 and s["top_k"] == -1 and s["logprobs"] == 0 and s["max_tokens"] == 5
    assert V.build_requests([[1, 2], [3]]) == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    with pytest.raises(ValueError, match="prompt 1: empty"):
        V.build_requests([[1], []])


def _completion(j, prompt_len, resp, layers, k, moe_layers, rng):
    routes = np.zeros((prompt_len + len(resp) - 1, layers, k), dtype=np.int32)  # dense layers stay 0
    for layer in moe_layers:
        routes[:, layer] = np.stack([rng.permutation(8)[:k] for _ in range(routes.shape[0])])
    lps = [{t: Logprob(logprob=-0.1 * (p + 1)), 99: Logprob(logprob=-9.0)} for p, t in enumerate(resp)]
    return CompletionOutput(j, "", resp, None, lps, routes)


def test_outputs_to_batch_parses_vllm_shapes_into_rollout_batch():
    rng = np.random.default_rng(0)
    layers, k, moe_layers = 3, 2, (1, 2)  # layer 0 dense, as DeepSeek-V3/Kimi-K2's first layers
    prompts = [[5, 6, 7], [8, 9]]
    resps = [[[10, 11, 2], [12]], [[13, 2], [14, 15, 16]]]
    outs = [RequestOutput(str(q), prompts[q], [_completion(j, len(prompts[q]), r, layers, k, moe_layers, rng)
                                               for j, r in enumerate(resps[q])]) for q in range(2)]
    b = V.outputs_to_batch(outs, pad_id=0, eos_id=2, group_size=2, moe_layers=moe_layers, num_experts=8, top_k=k,
                           num_hidden_layers=layers, answers=["a", "b"])
    assert b.input_ids.shape == (4, 3 + 3) and b.prompt_length == 3
    assert b.input_ids[2].tolist() == [0, 8, 9, 13, 2, 0]  # prompt left-padded, response right-padded
    assert b.response_mask[1].tolist() == [False] * 3 + [True, False, False]
    assert torch.allclose(b.rollout_logprobs[0, 3:], torch.tensor([-0.1, -0.2, -0.3]))
    assert b.rollout_logprobs[0, :3].abs().sum() == 0
    assert b.group.tolist() == [0, 0, 1, 1] and b.answers == ["a", "a", "b", "b"]
    tr = b.routing
    assert tr.moe_layers == moe_layers and tr.indices.shape == (4, 6, 2, 2)
    # sample 2: prompt [8, 9] sits in columns 1-2; its first route row belongs to column 1
    r0 = outs[1].outputs[0].routed_experts
    assert tr.indices[2, 1].long().tolist() == r0[0, list(moe_layers)].tolist()
    assert not tr.valid[2, 4] and tr.valid[2, 3]  # the last generated token has no route


def test_outputs_to_batch_errors_name_the_sample():
    rng = np.random.default_rng(0)
    comp = _completion(0, 2, [4, 2], 2, 2, (0, 1), rng)
    comp.logprobs = comp.logprobs[:1]
    with pytest.raises(ValueError, match="sample 0: 1 logprob entries for 2 tokens"):
        V.outputs_to_batch([RequestOutput("0", [1, 3], [comp])], 0, 2, 1)
    with pytest.raises(ValueError, match="request 0: 1 completions, expected group_size=2"):
        V.outputs_to_batch([RequestOutput("0", [1, 3], [comp])], 0, 2, 2)


def test_engine_without_vllm_says_what_to_install():
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="requirements/gpu.txt"):
        V.VLLMEngine("/m", None, RolloutConfig(), None, "qwen3_moe", 8, 2, (0,), 1)
