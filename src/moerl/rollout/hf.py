"""The embedded rollout engine: its own copy of the policy, in its own precision, over `generate`.

It plays vLLM's role on a CPU: sampling in bf16 (by default; fp8, int8, nvfp4 and int4 round the weights
through their formats as quantised rollouts do) while the trainer computes in fp32, which is exactly the training-inference
mismatch the repo studies. It records every token's
experts with hooks on the routers while generating (prefill calls see [B*T0] tokens, each decode
step [B]); like every real engine it never forwards the last sampled token, so that token has no
route.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from moerl.config import RolloutConfig
from moerl.data.prompts import PromptFormat, prompt_format
from moerl.lora.peft_lora import expert_lora_materialised
from moerl.replay.capture import record_generation
from moerl.rollout.batch import RolloutBatch
from moerl.rollout.decode import decode, unsupported
from moerl.rollout.precision import compute_dtype, quantize_model
from moerl.rollout.kernels import rollout_kernels


@contextmanager
def torch_threads(threads: int | None):
    """Run the block on ``threads`` torch threads (None: leave them), then restore the count."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class HFEngine:
    """The engine runs on the device its policy's weights are on; what ``generate`` returns is on the CPU
    (the RolloutBatch contract). On a GPU with ``rollout.kernels=native`` its bf16 products are the GPU's own
    kernels (cuBLAS, FlashAttention, the grouped-GEMM experts)."""

    def __init__(self, policy: nn.Module, tokenizer, cfg: RolloutConfig, task: str | PromptFormat = "arith"):
        """``task``: the tiny presets' task name, or a checkpoint's PromptFormat (chat template, stop ids)."""
        self.cfg, self.tokenizer = cfg, tokenizer
        self.prompts = prompt_format(task)
        self.task = self.prompts.task
        self.stop_ids = self.prompts.stops(tokenizer)
        # what generate and the decode loop are given: one id as an int, as the presets always ran
        self.eos_arg = self.stop_ids[0] if len(self.stop_ids) == 1 else self.stop_ids
        self.dtype = compute_dtype(cfg.dtype)
        self.model = copy.deepcopy(policy).to(self.dtype).eval()
        self.device = next(self.model.parameters()).device
        for p in self.model.parameters():
            p.requires_grad_(False)
        # fp8 / int8 / nvfp4 / int4: base weights rounded through the format, computed in bf16 (W*A16).
        self.quantised_weights = quantize_model(self.model, cfg.dtype)
        # native bf16 kernels, or fp32 kernels with bf16 rounding points (moerl.rollout.kernels); one
        # context per engine, so emulation's fp32 weight copies last until the weights change.
        self.kernels = rollout_kernels(cfg.kernels, self.dtype)
        # moerl's decode loop (moerl.rollout.decode): generate's numbers without its per-token overhead,
        # where it covers the model; generate otherwise.
        self.decode_loop_unsupported = unsupported(self.model, self.dtype, cfg.kernels)
        self.decode_loop = cfg.decode == "loop" and self.decode_loop_unsupported is None

    def _decode_loop(self, prompt_ids, prompt_mask, greedy: bool, recorder):
        """Sequences and raw step logits from moerl's decode loop; its routes go to ``recorder``."""
        cfg, tok = self.cfg, self.tokenizer

        @contextmanager
        def engine_context():
            with self.kernels, expert_lora_materialised(self.model):
                yield

        seqs, step_logits, routes = decode(
            self.model, self.dtype, engine_context, prompt_ids, prompt_mask, max_new_tokens=cfg.max_new_tokens,
            eos_token_id=self.eos_arg, pad_token_id=tok.pad_token_id, greedy=greedy,
            temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, record_routes=recorder is not None)
        if recorder is not None and routes is not None:
            recorder.extend(routes)
        return seqs, step_logits

    # -- weights ------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Adapter refit: copy LoRA tensors by name into the engine's resident PEFT copy."""
        params = dict(self.model.named_parameters())
        missing = [name for name in tensors if name not in params]
        if missing:
            raise KeyError(f"engine has no parameter '{missing[0]}' (and {len(missing) - 1} more)")
        for name, tensor in tensors.items():
            if params[name].shape != tensor.shape:
                raise ValueError(f"refit tensor '{name}': shape {tuple(tensor.shape)} != engine "
                                 f"{tuple(params[name].shape)}")
            params[name].copy_(tensor.to(self.dtype))

    @torch.no_grad()
    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Full-weight refit (merged baseline): overwrite named parameters/buffers."""
        state = self.model.state_dict()
        for name, tensor in tensors.items():
            if name not in state:
                raise KeyError(f"engine has no tensor '{name}'")
            state[name].copy_(tensor.to(state[name].dtype))
        if self.quantised_weights:  # new base weights: quantised again, as a quantised engine's refit does
            quantize_model(self.model, self.cfg.dtype)

    # -- generation ---------------------------------------------------------------------------------
    def encode_prompts(self, questions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prompts.encode(self.tokenizer, questions)

    @torch.no_grad()
    def generate(self, questions: list[str], answers: list[str], group_size: int, *, greedy: bool = False,
                 seed: int | None = None) -> RolloutBatch:
        """Sample ``group_size`` completions per question (rows grouped: q0 x G, q1 x G, ...)."""
        cfg, tok = self.cfg, self.tokenizer
        prompt_ids, prompt_mask = self.encode_prompts(questions)
        prompt_ids = prompt_ids.repeat_interleave(group_size, 0)
        prompt_mask = prompt_mask.repeat_interleave(group_size, 0)
        n, t0 = prompt_ids.shape
        ids_in, mask_in = prompt_ids.to(self.device), prompt_mask.to(self.device)
        if seed is not None:
            torch.manual_seed(seed)
        sampling = dict(do_sample=False) if greedy else dict(
            do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
        capture = record_generation(self.model, n) if cfg.capture_routing else nullcontext()
        with capture as recorder, torch_threads(cfg.threads):
            if self.decode_loop:
                seqs, step_logits = self._decode_loop(ids_in, mask_in, greedy, recorder)
            else:
                with self.kernels, expert_lora_materialised(self.model):
                    out = self.model.generate(
                        input_ids=ids_in, attention_mask=mask_in, max_new_tokens=cfg.max_new_tokens,
                        pad_token_id=tok.pad_token_id, eos_token_id=self.eos_arg, output_logits=True,
                        return_dict_in_generate=True, **sampling)
                seqs, step_logits = out.sequences, torch.stack(out.logits, dim=1)
        seqs, step_logits = seqs.cpu(), step_logits.cpu()
        total = seqs.shape[1]
        new = seqs[:, t0:]
        # Response runs up to and including the first EOS; generate pads finished rows afterwards.
        is_eos = torch.isin(new, torch.tensor(self.stop_ids))
        after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
        response = ~after_eos
        response_mask = torch.cat([torch.zeros(n, t0, dtype=torch.bool), response], dim=1)
        attention_mask = torch.cat([prompt_mask.bool(), response], dim=1)
        # Logprob of each sampled token under the engine's (temperature-scaled) distribution.
        temperature = 1.0 if greedy else cfg.temperature
        step_logits = step_logits.float() / temperature  # [N, n_new, V]
        logp_new = torch.log_softmax(step_logits, -1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        rollout_logprobs = torch.zeros(n, total)
        rollout_logprobs[:, t0:] = torch.where(response, logp_new, torch.zeros_like(logp_new))

        # Valid routes: real tokens except each sample's last (never forwarded), as vLLM returns them.
        routing = recorder.to_trace(attention_mask) if cfg.capture_routing else None
        texts = tok.batch_decode(torch.where(response, new, torch.full_like(new, tok.pad_token_id)),
                                 skip_special_tokens=True)
        return RolloutBatch(
            input_ids=seqs, attention_mask=attention_mask.long(), response_mask=response_mask,
            rollout_logprobs=rollout_logprobs, prompt_length=t0,
            group=torch.arange(len(questions)).repeat_interleave(group_size), routing=routing, texts=texts,
            answers=[a for a in answers for _ in range(group_size)])
