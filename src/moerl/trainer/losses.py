"""Policy-loss variants, one function each, shared by the embedded loop and the verl plug-in.

Signature (DESIGN.md): ``policy_loss(logp, old_logp, rollout_logp, adv, mask, cfg) -> (loss, metrics)``
with every tensor [N, T] (``adv`` broadcast over a sequence's tokens), ``mask`` the response mask,
and ``loss`` this micro-batch's loss under ``cfg.aggregation``. The trainer weights micro-batches
with ``aggregation_weight`` so a mini-batch's loss is the same however it is split.
"""
from __future__ import annotations

from typing import Callable

import torch

from moerl.config import LossConfig

LossFn = Callable[..., tuple[torch.Tensor, dict]]
POLICY_LOSSES: dict[str, LossFn] = {}


def register(name: str):
    def wrap(fn: LossFn) -> LossFn:
        POLICY_LOSSES[name] = fn
        return fn

    return wrap


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """token_mean (default: every token counts once, as in DAPO); seq_mean_token_mean (GRPO paper);
    seq_sum_constant (Dr. GRPO: sum over tokens / a constant, no length bias)."""
    mask = mask.float()
    if mode == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if mode == "seq_mean_token_mean":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        has = (mask.sum(-1) > 0).float()
        return (per_seq * has).sum() / has.sum().clamp(min=1)
    if mode == "seq_sum_constant":
        return (per_token * mask).sum() / (mask.shape[0] * mask.shape[1])
    raise ValueError(f"loss.aggregation: unknown mode '{mode}'")


def aggregation_weight(mask: torch.Tensor, mode: str) -> float:
    """This micro-batch's share of its mini-batch's normaliser (tokens, sequences or rows)."""
    if mode == "token_mean":
        return float(mask.sum())
    if mode == "seq_mean_token_mean":
        return float((mask.sum(-1) > 0).sum())
    if mode == "seq_sum_constant":
        return float(mask.shape[0])
    raise ValueError(f"loss.aggregation: unknown mode '{mode}'")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.float()
    return float((x * m).sum() / m.sum().clamp(min=1))


@register("ppo_clip")
def ppo_clip(logp, old_logp, rollout_logp, adv, mask, cfg: LossConfig):
    """PPO clipped surrogate with asymmetric clip [1-eps_low, 1+eps_high] (DAPO clip-higher),
    optional dual clip c (Ye et al. 2020): for negative advantages the loss is capped at -c*A."""
    ratio = torch.exp(logp - old_logp)
    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    per_token = torch.maximum(surr1, surr2)
    metrics = {
        "clip/low_frac": _masked_mean(((ratio < 1 - cfg.eps_low) & (adv < 0)).float(), mask),
        "clip/high_frac": _masked_mean(((ratio > 1 + cfg.eps_high) & (adv > 0)).float(), mask),
    }
    if cfg.dual_clip_c is not None:
        dual = -adv * cfg.dual_clip_c
        use_dual = (adv < 0) & (dual < per_token)
        per_token = torch.where(adv < 0, torch.minimum(per_token, dual), per_token)
        metrics["clip/dual_frac"] = _masked_mean(use_dual.float(), mask)
    metrics["clip/frac"] = metrics["clip/low_frac"] + metrics["clip/high_frac"]
    metrics["ratio/mean"] = _masked_mean(ratio.detach(), mask)
    return aggregate(per_token, mask, cfg.aggregation), metrics


def policy_loss(logp, old_logp, rollout_logp, adv, mask, cfg: LossConfig):
    try:
        fn = POLICY_LOSSES[cfg.variant]
    except KeyError:
        raise ValueError(f"loss.variant: unknown variant '{cfg.variant}' (have: {sorted(POLICY_LOSSES)})") from None
    return fn(logp, old_logp, rollout_logp, adv, mask, cfg)
