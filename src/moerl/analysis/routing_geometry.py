"""How often the bf16-vs-fp32 mismatch re-routes a token, measured at one routing geometry.

One measurement point: a policy (random init, warm-started or after GRPO), a low-precision rollout
engine sampling P prompts x G completions of the task, and the fp32 trainer's teacher-forced pass over
the same tokens twice, routing natively and with the rollout's experts replayed (R3). From them:

- p_l, the per-layer flip probability: the share of valid positions whose trainer top-k set differs
  from the rollout's at MoE layer l (1 - ``routing/agreement/layerN`` of the GRPO loop);
- the share of positions with at least one differing layer (``routing/any_layer_differs``, the R3
  paper's "~94 % of tokens") next to the independence prediction 1 - prod_l (1 - p_l);
- k3 and the extreme-token fraction F(tau) without and with R3.

Positions are the GRPO loop's: every real token of prompt and response except each sample's last
(no engine forwards it). ``response`` variants count only the positions that score a response token.
Intervals resample whole sequences (tokens of one sequence are not independent).

The statistics reuse the GRPO loop's functions (``routing_metrics``, ``routing_divergence``,
``mismatch_metrics``, ``extreme_token_curve``, ``paired_replay_effect``), so a point here and a
training step report the same quantities.
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import torch
from torch import nn

from moerl.config import ExperimentConfig
from moerl.replay.diagnostics import same_set
from moerl.rollout.hf import HFEngine
from moerl.trainer.grpo import routing_metrics
from moerl.trainer.logprobs import forward_logprobs, session_trace, trainer_routing
from moerl.trainer.metrics import (EXTREME_TAUS, extreme_token_curve, mismatch_metrics, paired_replay_effect,
                                   routing_divergence)


def independence_prediction(p_layers) -> float:
    """Share of tokens with >= 1 flipped layer if layers flipped independently: 1 - prod(1 - p_l)."""
    p = np.asarray(list(p_layers), dtype=float)
    return float(1.0 - np.exp(np.log1p(-np.clip(p, 0.0, 1.0 - 1e-15)).sum()))


def _per_sequence_counts(native, rollout, positions: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sequence: counted positions [N], positions with >= 1 differing layer [N], flips per layer [N, L]."""
    differs = ~same_set(native.indices, rollout.indices)  # [N, T, L]
    keep = positions & rollout.valid
    tokens = keep.sum(-1)
    any_layer = (differs.any(-1) & keep).sum(-1)
    per_layer = (differs & keep.unsqueeze(-1)).sum(1)
    return tokens.numpy().astype(float), any_layer.numpy().astype(float), per_layer.numpy().astype(float)


def bootstrap_shares(tokens: np.ndarray, any_layer: np.ndarray, per_layer: np.ndarray, resamples: int = 2000,
                     seed: int = 0, level: float = 0.95) -> dict[str, float]:
    """The >= 1-layer share, mean p_l and the independence prediction, each with a bootstrap interval
    over sequences (every resample draws N sequences with replacement and recomputes all three)."""
    n = len(tokens)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    tot = tokens[idx].sum(1)
    share = any_layer[idx].sum(1) / tot
    p = per_layer[idx].sum(1) / tot[:, None]  # [B, L]
    indep = 1.0 - np.exp(np.log1p(-np.clip(p, 0, 1 - 1e-15)).sum(1))
    lo_q, hi_q = (1 - level) / 2, (1 + level) / 2
    point_p = per_layer.sum(0) / tokens.sum()
    out = {"share": float(any_layer.sum() / tokens.sum()), "independence": independence_prediction(point_p),
           "p_mean": float(point_p.mean()), "tokens": float(tokens.sum()), "seqs": float(n)}
    for name, boots in (("share", share), ("independence", indep), ("p_mean", p.mean(1))):
        out[f"{name}_lo"], out[f"{name}_hi"] = (float(x) for x in np.quantile(boots, [lo_q, hi_q]))
    return out


@torch.no_grad()
def trainer_passes(policy: nn.Module, batch, temperature: float):
    """The fp32 trainer's logprobs routing natively (with the experts it chose) and replaying the
    rollout's experts (R3), with the seconds each pass took. The passes run on the device of the policy's
    weights; the logprobs and the trace come back on the CPU, where ``batch`` is."""
    policy.eval()
    batch = batch.to(next(policy.parameters()).device)
    start = time.perf_counter()
    with trainer_routing(policy, batch) as session:
        native_logp, _ = forward_logprobs(policy, batch, temperature)
    native_logp = native_logp.cpu()  # (on a GPU this waits for the pass: the seconds are its own)
    native = session_trace(session, batch)
    native_seconds = time.perf_counter() - start
    start = time.perf_counter()
    with trainer_routing(policy, batch, replay=batch.routing) as session:
        replayed_logp, _ = forward_logprobs(policy, batch, temperature)
    replayed_logp = replayed_logp.cpu()
    violations = session.violations
    return dict(native_logp=native_logp, native=native, replayed_logp=replayed_logp, violations=violations,
                native_seconds=native_seconds, replay_seconds=time.perf_counter() - start)


def measure(policy: nn.Module, tokenizer, cfg: ExperimentConfig, rows: list[dict], dtype: str = "bf16",
            seed: int = 0, resamples: int = 2000) -> dict:
    """One point's statistics for a rollout engine of ``dtype`` against the fp32 ``policy``.

    ``rows``: the prompts (``question``/``answer``); each is sampled ``cfg.rollout.group_size`` times.
    Engine and trainer run on the device of ``policy``'s weights (on a GPU with ``rollout.kernels=native``
    the rollout's bf16 products are the GPU's own kernels); the statistics are computed on the CPU.
    Returns a flat JSON-able dict; ``p_layer`` maps global MoE layer number -> flip probability."""
    rollout_cfg = dataclasses.replace(cfg.rollout, dtype=dtype, capture_routing=True)
    start = time.perf_counter()
    engine = HFEngine(policy, tokenizer, rollout_cfg, cfg.data.task)
    build_seconds = time.perf_counter() - start
    start = time.perf_counter()
    batch = engine.generate([r["question"] for r in rows], [r["answer"] for r in rows], rollout_cfg.group_size,
                            seed=seed)
    rollout_seconds = time.perf_counter() - start
    del engine
    passes = trainer_passes(policy, batch, rollout_cfg.temperature)
    native = passes["native"]
    rollout = batch.routing.truncate_tokens(native.indices.shape[1])  # the trainer's T-1 positions
    mask = batch.response_mask

    out: dict = {"dtype": dtype, "kernels": rollout_cfg.kernels, "prompts": len(rows),
                 "group_size": rollout_cfg.group_size, "moe_layers": list(native.moe_layers),
                 "num_experts": native.num_experts, "top_k": native.top_k,
                 "response_length_mean": float(batch.response_lengths.float().mean()),
                 "replay_violations": int(passes["violations"])}
    per_layer = routing_metrics(native, batch.routing)
    out["p_layer"] = {str(n): 1.0 - per_layer[f"routing/agreement/layer{n}"] for n in native.moe_layers}
    out.update(routing_divergence(native, rollout))
    everywhere = torch.ones_like(rollout.valid)
    scoring = mask[:, 1:].bool()  # position t-1 scores response token t
    for name, positions in (("all", everywhere), ("response", scoring)):
        stats = bootstrap_shares(*_per_sequence_counts(native, rollout, positions), resamples=resamples, seed=seed)
        out.update({f"{name}/{k}": v for k, v in stats.items()})
    tokens, any_layer, per_layer_counts = _per_sequence_counts(native, rollout, scoring)
    out["p_layer_response"] = {str(n): float(v) for n, v in
                               zip(native.moe_layers, per_layer_counts.sum(0) / max(tokens.sum(), 1))}

    for tag, logp in (("native", passes["native_logp"]), ("r3", passes["replayed_logp"])):
        mm = mismatch_metrics(logp, batch.rollout_logprobs, mask)
        out[f"{tag}/k3"] = mm["mismatch/k3"]
        out[f"{tag}/k3_max"] = mm["mismatch/k3_max"]
        out[f"{tag}/extreme_frac_ln2"] = mm["mismatch/extreme_frac"]
        for key, value in extreme_token_curve(logp, batch.rollout_logprobs, mask, taus=EXTREME_TAUS).items():
            out[f"{tag}/{key.split('/')[-1]}"] = value
    effect = paired_replay_effect(passes["replayed_logp"], passes["native_logp"], batch.rollout_logprobs, mask,
                                  resamples=resamples, seed=seed)
    out.update({f"r3/{k.split('/')[-1]}": v for k, v in effect.items()})
    out["seconds"] = {"engine_build": build_seconds, "rollout": rollout_seconds,
                      "trainer_native": passes["native_seconds"], "trainer_replay": passes["replay_seconds"]}
    return out


# -- extrapolation ----------------------------------------------------------------------------------
def fit_loglinear(x, y) -> dict:
    """Least-squares fit log(y) = a + b log(x), with the residual standard error of log(y) and the
    parameter covariance; x and y positive. The functional form is a choice, not a law: it is stated
    next to every number it produces."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = (x > 0) & (y > 0)
    lx, ly = np.log(x[keep]), np.log(y[keep])
    design = np.stack([np.ones_like(lx), lx], 1)
    coef, *_ = np.linalg.lstsq(design, ly, rcond=None)
    resid = ly - design @ coef
    dof = max(len(ly) - 2, 1)
    s2 = float(resid @ resid / dof)
    cov = s2 * np.linalg.pinv(design.T @ design)
    return {"a": float(coef[0]), "b": float(coef[1]), "s": math.sqrt(s2), "cov": cov.tolist(), "n": int(len(ly))}


def predict_loglinear(fit: dict, x: float, z: float = 1.96) -> tuple[float, float, float]:
    """(prediction, lo, hi) of a ``fit_loglinear`` fit at ``x``: the interval adds the parameter
    uncertainty and the residual scatter (a prediction interval in log space)."""
    v = np.array([1.0, math.log(x)])
    mean = fit["a"] + fit["b"] * math.log(x)
    var = float(v @ np.asarray(fit["cov"]) @ v) + fit["s"] ** 2
    sd = math.sqrt(max(var, 0.0))
    return math.exp(mean), math.exp(mean - z * sd), math.exp(mean + z * sd)
