"""vLLM rollout engine (GPU): the same interface as moerl.rollout.hf.HFEngine.

``vllm.LLM`` with LoRA enabled (``max_lora_rank`` rounded up to a value vLLM accepts), tensor
tensor parallel, optionally expert parallel (vLLM 0.24's fused-MoE LoRA allows EP with its default
all2all backend, without fully-sharded LoRA, and one engine has no data parallel, so no MoE sequence
parallel: ``FusedMoEWithLoRA._ep_check``/``_verify_ep_fs``), ``enable_return_routed_experts`` for
R3, adapter refit through a tmpfs adapter directory (stock vLLM loads adapters only from a path) and
``reset_prefix_cache()`` after every refit: routes are read back by KV slot, so a cached prefix
would otherwise return the routes of the previous weights.

Install: ``pip install -r requirements-gpu.txt`` (vllm with CUDA). This module imports without
vLLM; only ``VLLMEngine(...)`` needs it. Executed here (CPU, no vLLM): everything except
``VLLMEngine.__init__``/``generate``/``load_adapter`` bodies that call vLLM — request and engine
argument building, adapter naming/layout conversion and the parsing of vLLM-shaped outputs into a
RolloutBatch are tested in tests/rollout/test_vllm_engine.py.
"""
from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch

from moerl.config import RolloutConfig
from moerl.replay.engine_output import trace_from_vllm
from moerl.rollout.batch import RolloutBatch

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks
INSTALL_HINT = "vLLM is not installed: pip install -r requirements-gpu.txt (CUDA build of vllm)"
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds ``rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"lora.rank={rank}: vLLM supports LoRA ranks up to {VLLM_LORA_RANKS[-1]}")


def engine_kwargs(model_path: str, cfg: RolloutConfig, lora_rank: int, tensor_parallel_size: int = 1,
                  expert_parallel: bool = False, capture_routing: bool | None = None,
                  gpu_memory_utilization: float = 0.5, max_model_len: int | None = None, seed: int = 0) -> dict:
    """Arguments for ``vllm.LLM``. Expert parallel is allowed with MoE LoRA because these arguments
    never set ``fully_sharded_loras`` or data parallel (vLLM's two exclusions)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"rollout: tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    kw = dict(model=model_path, dtype=_DTYPES[cfg.dtype], tensor_parallel_size=tensor_parallel_size,
              enable_expert_parallel=bool(expert_parallel), enable_lora=True, max_loras=1,
              max_lora_rank=vllm_max_lora_rank(lora_rank), enable_prefix_caching=True,
              gpu_memory_utilization=gpu_memory_utilization, seed=seed)
    if capture_routing if capture_routing is not None else cfg.capture_routing:
        kw["enable_return_routed_experts"] = True
    if max_model_len is not None:
        kw["max_model_len"] = max_model_len
    return kw


def sampling_kwargs(cfg: RolloutConfig, group_size: int, greedy: bool = False, seed: int | None = None) -> dict:
    """Arguments for ``vllm.SamplingParams``: n samples per prompt, the sampled token's logprob."""
    kw = dict(n=group_size, max_tokens=cfg.max_new_tokens, logprobs=0, seed=seed)
    if greedy:
        kw.update(temperature=0.0)
    else:
        kw.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k if cfg.top_k > 0 else -1)
    return kw


def build_requests(prompt_token_ids: Sequence[Sequence[int]]) -> list[dict]:
    """vLLM token prompts (``{"prompt_token_ids": [...]}``), one per question; SamplingParams.n = G."""
    out = []
    for i, ids in enumerate(prompt_token_ids):
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"prompt {i}: empty token list")
        out.append({"prompt_token_ids": ids})
    return out


def _token_logprob(entry: dict, token: int, sample: int, pos: int) -> float:
    if token not in entry:
        raise ValueError(f"vLLM output sample {sample}, token {pos}: logprobs has no entry for the sampled "
                         f"token {token} (SamplingParams.logprobs must be >= 0)")
    lp = entry[token]
    return float(getattr(lp, "logprob", lp))


def outputs_to_batch(request_outputs: Sequence[Any], pad_id: int, eos_id: int, group_size: int,
                     moe_layers: Sequence[int] | None = None, num_experts: int = 0, top_k: int = 0,
                     num_hidden_layers: int = 0, answers: Sequence[str] = (), tokenizer=None) -> RolloutBatch:
    """vLLM ``RequestOutput``s (``prompt_token_ids``, ``outputs[j]``: CompletionOutput with ``token_ids``,
    ``logprobs`` = list of ``{token_id: Logprob(logprob=...)}``, ``routed_experts`` ndarray
    ``[prompt + response - 1, num_hidden_layers, top_k]``) -> RolloutBatch (prompt left-padded,
    response right-padded; rows q0 x G, q1 x G, ...)."""
    rows = []
    for q, req in enumerate(request_outputs):
        if len(req.outputs) != group_size:
            raise ValueError(f"vLLM request {q}: {len(req.outputs)} completions, expected group_size={group_size}")
        for comp in req.outputs:
            rows.append((q, list(req.prompt_token_ids), list(comp.token_ids), comp))
    n = len(rows)
    t0 = max(len(p) for _, p, _, _ in rows)
    t1 = max((len(r) for _, _, r, _ in rows), default=0)
    input_ids = torch.full((n, t0 + t1), pad_id, dtype=torch.long)
    attention = torch.zeros(n, t0 + t1, dtype=torch.long)
    response_mask = torch.zeros(n, t0 + t1, dtype=torch.bool)
    logprobs = torch.zeros(n, t0 + t1)
    routes = []
    for i, (q, prompt, resp, comp) in enumerate(rows):
        if comp.logprobs is None or len(comp.logprobs) != len(resp):
            raise ValueError(f"vLLM output sample {i}: {0 if comp.logprobs is None else len(comp.logprobs)} "
                             f"logprob entries for {len(resp)} tokens")
        input_ids[i, t0 - len(prompt):t0] = torch.tensor(prompt)
        attention[i, t0 - len(prompt):t0 + len(resp)] = 1
        if resp:
            input_ids[i, t0:t0 + len(resp)] = torch.tensor(resp)
            response_mask[i, t0:t0 + len(resp)] = True
            logprobs[i, t0:t0 + len(resp)] = torch.tensor(
                [_token_logprob(e, tok, i, p) for p, (e, tok) in enumerate(zip(comp.logprobs, resp))])
        routes.append(getattr(comp, "routed_experts", None))
    routing = None
    if moe_layers is not None and any(r is not None for r in routes):
        missing = [i for i, r in enumerate(routes) if r is None]
        if missing:
            raise ValueError(f"vLLM output sample {missing[0]}: no routed_experts (enable_return_routed_experts "
                             f"was on for the others)")
        routing = trace_from_vllm(routes, attention, t0, moe_layers, num_experts, top_k, num_hidden_layers)
    texts = []
    if tokenizer is not None:
        texts = tokenizer.batch_decode([r for _, _, r, _ in rows], skip_special_tokens=True)
    return RolloutBatch(input_ids=input_ids, attention_mask=attention, response_mask=response_mask,
                        rollout_logprobs=logprobs, prompt_length=t0,
                        group=torch.tensor([q for q, _, _, _ in rows], dtype=torch.long), routing=routing,
                        texts=texts, answers=[a for a in answers for _ in range(group_size)])


class VLLMEngine:
    """``generate(questions, answers, group_size) -> RolloutBatch``, ``load_adapter(canonical tensors)``.

    GPU only; not executed in this repository's CPU test-suite (see the module docstring)."""

    def __init__(self, model_path: str, tokenizer, cfg: RolloutConfig, lora_cfg, preset: str, num_experts: int,
                 top_k: int, moe_layers: Sequence[int], num_hidden_layers: int, task: str = "arith",
                 tensor_parallel_size: int = 1, adapter_dir: str = "/dev/shm/moerl_lora", **llm_kwargs):
        try:
            import vllm
        except ImportError as err:
            raise ImportError(INSTALL_HINT) from err
        self._vllm = vllm
        self.cfg, self.tokenizer, self.task, self.lora_cfg, self.preset = cfg, tokenizer, task, lora_cfg, preset
        self.num_experts, self.top_k = num_experts, top_k
        self.moe_layers, self.num_hidden_layers = tuple(moe_layers), num_hidden_layers
        self.adapter_root = Path(adapter_dir)
        self.llm = vllm.LLM(**engine_kwargs(model_path, cfg, lora_cfg.rank, tensor_parallel_size), **llm_kwargs)
        self._ids = itertools.count(1)
        self.lora_request = None

    def load_adapter(self, canonical: dict[str, torch.Tensor]) -> None:
        """Write the adapter (PEFT per-expert names) to tmpfs, swap it in, reset the prefix cache."""
        from vllm.lora.request import LoRARequest

        from moerl.refit.adapter_format import save_hf_adapter

        lora_id = next(self._ids)
        path = save_hf_adapter(self.adapter_root / str(lora_id), canonical, self.preset, self.num_experts,
                               self.lora_cfg.rank, self.lora_cfg.alpha)
        old = self.lora_request
        self.lora_request = LoRARequest(f"moerl-{lora_id}", lora_id, str(path))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()  # cached prefixes hold routes (and KV) of the old weights

    def generate(self, questions, answers, group_size: int, *, greedy: bool = False,
                 seed: int | None = None) -> RolloutBatch:
        from moerl.data.prompts import render_prompt
        from moerl.data.tokenizer import BOS

        prompts = [self.tokenizer(BOS + render_prompt(self.task, q), add_special_tokens=False).input_ids
                   for q in questions]
        params = self._vllm.SamplingParams(**sampling_kwargs(self.cfg, group_size, greedy, seed))
        outs = self.llm.generate(build_requests(prompts), params, lora_request=self.lora_request)
        return outputs_to_batch(outs, self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, group_size,
                                self.moe_layers if self.cfg.capture_routing else None, self.num_experts,
                                self.top_k, self.num_hidden_layers, answers, self.tokenizer)
