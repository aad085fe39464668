"""The mismatch probe: how far a rollout engine's policy is from the trainer's on one checkpoint, per MoE layer.

No training. For each rollout precision the engine (its own copy of the weights, in that precision) samples a
response to each prompt and records every token's experts; the trainer (the checkpoint in its own dtype, fp32
by default) scores the same tokens teacher-forced twice: routing natively, and replaying the engine's experts
(R3). Per precision it reports

- ``k3``: token mean of exp(d) - 1 - d, d = log pi_trainer - log pi_rollout, over response tokens (the
  estimator the training loop logs as ``mismatch/k3``), and ``r3_k3`` the same with the engine's routes replayed;
- ``reroute_any``: the share of tokens (prompt and response, every token the engine routed) whose top-k
  expert set differs between trainer and engine in at least one MoE layer, and ``reroute_per_layer`` that
  share for each MoE layer by its global number (dense layers have none);
- ``ratio_gt2`` / ``r3_ratio_gt2``: the share of response tokens with max(rho, 1/rho) > 2, rho = pi_trainer / pi_rollout;

each with a 95 % percentile bootstrap interval over prompts (tokens of one response are not independent).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np
import torch

from moerl.config import RolloutConfig
from moerl.replay.diagnostics import same_set
from moerl.rollout.hf import HFEngine
from moerl.trainer.logprobs import forward_logprobs, session_trace, trainer_routing

log = logging.getLogger(__name__)
BOOTSTRAP_RESAMPLES = 2000


@dataclasses.dataclass
class PromptStats:
    """Per prompt: sums over its tokens, so a bootstrap over prompts can resample them."""

    k3: list = dataclasses.field(default_factory=list)  # [sum, tokens]
    r3_k3: list = dataclasses.field(default_factory=list)
    ratio_gt2: list = dataclasses.field(default_factory=list)
    r3_ratio_gt2: list = dataclasses.field(default_factory=list)
    reroute_any: list = dataclasses.field(default_factory=list)  # [rerouted tokens, routed tokens]
    reroute_layer: list = dataclasses.field(default_factory=list)  # [[rerouted per layer], routed tokens]


def bootstrap_ratio(num: np.ndarray, den: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """sum(num) / sum(den) and its 95 % percentile interval, resampling prompts."""
    num, den = np.asarray(num, float), np.asarray(den, float)
    if den.sum() == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(num), size=(BOOTSTRAP_RESAMPLES, len(num)))
    d = den[picks].sum(1)
    ratios = num[picks].sum(1) / np.where(d > 0, d, np.nan)
    low, high = np.nanpercentile(ratios, [2.5, 97.5])
    return float(num.sum() / den.sum()), float(low), float(high)


def _token_terms(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor):
    delta = (trainer_logp.float() - rollout_logp.float()).masked_fill(~mask, 0)
    k3 = (torch.expm1(delta) - delta).masked_fill(~mask, 0)
    extreme = (delta.abs() > math.log(2)) & mask
    return k3.sum(-1), extreme.sum(-1)


@torch.no_grad()
def probe_batch(trainer: torch.nn.Module, engine: HFEngine, questions: list[str], answers: list[str], seed: int,
                temperature: float, stats: PromptStats, progress=lambda line: None) -> None:
    """Sample one response per question with ``engine``, score it with ``trainer`` natively and under R3."""
    start = time.time()
    batch = engine.generate(questions, answers, 1, seed=seed)
    mask = batch.response_mask.bool()
    progress(f"[probe]   sampled {len(questions)} responses ({int(mask.sum())} tokens) in {time.time() - start:.0f} s; "
             f"scoring them")
    with trainer_routing(trainer, batch) as session:
        native_logp, _ = forward_logprobs(trainer, batch, temperature)
    native = session_trace(session, batch)
    k3, extreme = _token_terms(native_logp, batch.rollout_logprobs, mask)
    tokens = mask.sum(-1)
    for i in range(len(questions)):
        stats.k3.append([float(k3[i]), float(tokens[i])])
        stats.ratio_gt2.append([float(extreme[i]), float(tokens[i])])
    if batch.routing is None:  # an engine that returns no routes (vLLM's CPU build): k3 only
        return
    with trainer_routing(trainer, batch, batch.routing):
        r3_logp, _ = forward_logprobs(trainer, batch, temperature)
    r3_k3, r3_extreme = _token_terms(r3_logp, batch.rollout_logprobs, mask)
    rollout = batch.routing.truncate_tokens(native.indices.shape[1])
    differs = ~same_set(native.indices, rollout.indices) & rollout.valid[..., None]  # [N, T, L]
    routed = rollout.valid.sum(-1)
    for i in range(len(questions)):
        n = float(tokens[i])
        stats.r3_k3.append([float(r3_k3[i]), n])
        stats.r3_ratio_gt2.append([float(r3_extreme[i]), n])
        stats.reroute_any.append([float(differs[i].any(-1).sum()), float(routed[i])])
        stats.reroute_layer.append([differs[i].sum(0).tolist(), float(routed[i])])


def summarise(stats: PromptStats, moe_layers: tuple[int, ...], seed: int = 0) -> dict:
    """The per-precision record of the probe's JSON (values and 95 % intervals over prompts)."""
    def entry(pairs):
        if not pairs:  # the engine returned no routes: nothing to re-route or replay
            return None
        arr = np.asarray(pairs, float)
        value, low, high = bootstrap_ratio(arr[:, 0], arr[:, 1], seed)
        return {"value": value, "ci95": [low, high]}

    layers, routed = None, np.zeros(0)
    if stats.reroute_layer:
        per_layer = np.asarray([row[0] for row in stats.reroute_layer], float)  # [prompts, L]
        routed = np.asarray([row[1] for row in stats.reroute_layer], float)
        layers = {}
        for j, number in enumerate(moe_layers):
            value, low, high = bootstrap_ratio(per_layer[:, j], routed, seed)
            layers[str(number)] = {"value": value, "ci95": [low, high]}
    return {"k3": entry(stats.k3), "r3_k3": entry(stats.r3_k3), "ratio_gt2": entry(stats.ratio_gt2),
            "r3_ratio_gt2": entry(stats.r3_ratio_gt2), "reroute_any": entry(stats.reroute_any),
            "reroute_per_layer": layers, "prompts": len(stats.k3),
            "response_tokens": int(sum(n for _, n in stats.k3)), "routed_tokens": int(routed.sum())}


def hf_engine(trainer, tokenizer, cfg: RolloutConfig, prompts):
    """The embedded engine: a copy of the trainer's weights in ``cfg.dtype``."""
    return HFEngine(trainer, tokenizer, cfg, prompts)


def vllm_engine(checkpoint: str, **llm_kwargs):
    """An engine factory for vLLM over the checkpoint's own files (no LoRA: the probe trains nothing).
    Routes come back where vLLM can capture them (a GPU); on its CPU build the record has k3 only."""
    def make(trainer, tokenizer, cfg: RolloutConfig, prompts):
        from moerl.config import LoraConfig
        from moerl.rollout.vllm import VLLMEngine, running_on_cpu

        cfg = dataclasses.replace(cfg, capture_routing=not running_on_cpu())
        lora = LoraConfig(target_experts=False)
        return VLLMEngine.from_checkpoint(trainer, tokenizer, cfg, lora, checkpoint, "/dev/shm/moerl_probe", prompts,
                                          **llm_kwargs)
    return make


def run_probe(trainer: torch.nn.Module, tokenizer, prompts, rows: list[dict], precisions: list[str], *,
              max_new_tokens: int, batch_size: int = 8, kernels: str = "native", temperature: float = 1.0,
              seed: int = 0, progress=print, make_engine=hf_engine) -> dict:
    """The probe's ``precisions`` record for ``rows`` (``question``/``answer`` dicts), printing progress.
    ``make_engine(trainer, tokenizer, rollout_cfg, prompts)``: the embedded engine, or ``vllm_engine(path)``."""
    from moerl.models.routers import moe_layer_numbers

    moe_layers = moe_layer_numbers(trainer)
    out, start = {}, time.time()
    total = len(precisions) * math.ceil(len(rows) / batch_size)
    done = 0
    for precision in precisions:
        cfg = RolloutConfig(dtype=precision, kernels=kernels if precision != "fp32" else "native",
                            max_new_tokens=max_new_tokens, temperature=temperature, top_p=1.0, top_k=0,
                            capture_routing=True, prompts_per_step=batch_size, group_size=2)
        engine = make_engine(trainer, tokenizer, cfg, prompts)
        stats = PromptStats()
        for i in range(0, len(rows), batch_size):
            chunk = rows[i: i + batch_size]
            probe_batch(trainer, engine, [r["question"] for r in chunk], [r["answer"] for r in chunk], seed + i,
                        temperature, stats, progress)
            done += 1
            rate = (time.time() - start) / done
            progress(f"[probe] {precision}: {min(i + batch_size, len(rows))}/{len(rows)} prompts, "
                     f"{time.time() - start:.0f} s, about {rate * (total - done):.0f} s to go")
        out[precision] = summarise(stats, moe_layers, seed)
        if hasattr(engine, "close"):
            engine.close()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"precisions": out, "moe_layers": list(moe_layers)}
