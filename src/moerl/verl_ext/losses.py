"""moerl's policy losses in verl's policy-loss registry, so scale runs select them by name.

Importing this module registers ``moerl_ppo_clip``, ``moerl_tis``, ``moerl_mis``, ``moerl_icepop``,
``moerl_gspo`` and ``moerl_bypass`` with ``verl.trainer.ppo.core_algos.register_policy_loss``
(verl 0.9.1). Each computes exactly ``moerl.trainer.losses.policy_loss_terms`` (the function the
embedded loop uses) and aggregates with verl's own ``agg_loss`` and ``config.global_batch_info``,
so data-parallel normalisation stays verl's.

How verl reaches the functions (all of it is in ``verl_overrides``):
- ``actor_rollout_ref.actor.policy_loss.loss_mode=moerl_<variant>``;
- the workers import this module: env ``VERL_USE_EXTERNAL_MODULES=moerl.verl_ext.losses``
  (``import verl`` imports it in every process), forwarded to Ray workers via
  ``ray_kwargs.ray_init.runtime_env.env_vars``;
- the moerl knobs (tis_cap, mis bounds, veto, icepop band, gspo range, dual clip) travel as JSON in
  env ``MOERL_LOSS_CONFIG`` (verl's ``PolicyLossConfig`` is a closed dataclass, so they cannot ride
  in the actor config). ``configure(loss_cfg)`` sets them in-process instead (tests, notebooks).
  PPO clip ranges and aggregation are verl's own keys (``actor.clip_ratio_low/high``,
  ``actor.loss_agg_mode``; for moerl_gspo the clip range is GSPO's, as in verl's ``gspo``); a clip
  range that disagrees with the moerl config is an error, not a silent choice.
- verl 0.9.1 hands the loss ``rollout_is_weights`` but not ``rollout_log_probs``. With
  ``algorithm.rollout_correction.rollout_is=token``, ``rollout_is_threshold=1e9`` (above e^20, so
  verl truncates nothing) and batch normalisation and rejection off, those weights are the raw
  ρ_t = π_old/π_rollout = exp(clamp(log π_old - log π_rollout, ±20)), and
  log π_rollout = log π_old - log ρ_t is recovered exactly wherever |log ρ_t| < 20 (beyond that
  every moerl correction truncates or masks the token anyway). A keyword ``rollout_log_probs``, if a
  caller passes one, is used directly.

Executed here: registration, lookup through ``get_policy_loss_fn`` and computation on CPU tensors
shaped as verl's ``workers/utils/losses.py::ppo_loss`` passes them (tests/verl_ext). Not executed
here: a verl training run (needs GPUs, vLLM/SGLang and Ray workers).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss

from moerl.config import ConfigError, LossConfig, from_dict, loss_checks, to_dict
from moerl.trainer.losses import SAFETY_BOUND, policy_loss_terms

VARIANTS = ("ppo_clip", "tis", "mis", "icepop", "gspo", "bypass")
VERL_NAMES = {f"moerl_{v}": v for v in VARIANTS}
ENV_CONFIG = "MOERL_LOSS_CONFIG"
# moerl aggregation <-> verl loss_agg_mode. seq_sum_constant is verl's seq-mean-token-sum-norm
# with loss_scale_factor = T (sum over tokens / T, mean over sequences; the same unless a row of
# the micro-batch has no response token).
AGG_TO_VERL = {"token_mean": "token-mean", "seq_mean_token_mean": "seq-mean-token-mean",
               "seq_sum_constant": "seq-mean-token-sum-norm"}
AGG_FROM_VERL = {v: k for k, v in AGG_TO_VERL.items()}
NO_TRUNCATION = 1e9  # > e^20: verl's own TIS clamp never binds, so the weights it passes are raw
# Variants whose weights need π_rollout; the others run on verl's old_log_prob alone.
NEEDS_ROLLOUT = {"tis", "mis", "icepop"}

_configured: LossConfig | None = None


def configure(loss_cfg: LossConfig | None) -> None:
    """Set the moerl loss knobs for this process (None: fall back to env MOERL_LOSS_CONFIG)."""
    global _configured
    if loss_cfg is not None:
        _check(loss_cfg, "configure()")
    _configured = loss_cfg


def _check(cfg: LossConfig, source: str) -> None:
    for ok, message in loss_checks(cfg):
        if not ok:
            raise ConfigError(f"{source}: {message}")


def moerl_loss_config() -> LossConfig:
    """configure() > env MOERL_LOSS_CONFIG (JSON of the ``loss:`` section) > LossConfig defaults."""
    if _configured is not None:
        return _configured
    raw = os.environ.get(ENV_CONFIG)
    if not raw:
        return LossConfig()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ConfigError(f"env {ENV_CONFIG}: not valid JSON ({err}); expected the loss section as a JSON object") from None
    cfg = from_dict(LossConfig, data, "loss")
    _check(cfg, f"env {ENV_CONFIG}")
    return cfg


def _get(config: Any, key: str, default=None):
    if config is None:
        return default
    getter = getattr(config, "get", None)
    return getter(key, default) if getter is not None else getattr(config, key, default)


def loss_config_for_verl(variant: str, config: Any, loss_agg_mode: str) -> LossConfig:
    """The LossConfig a ``moerl_<variant>`` call runs with: moerl knobs, verl's aggregation; the
    clip range of verl's actor config must equal the moerl one."""
    base = moerl_loss_config()
    if loss_agg_mode not in AGG_FROM_VERL:
        raise ValueError(f"actor.loss_agg_mode={loss_agg_mode!r} is not supported by moerl_{variant} "
                         f"(allowed: {sorted(AGG_FROM_VERL)})")
    clip = _get(config, "clip_ratio", None)
    # verl's actor clip range is the PPO range, or GSPO's sequence-ratio range for gspo (as verl's gspo)
    names = ("gspo_eps_low", "gspo_eps_high") if variant == "gspo" else ("eps_low", "eps_high")
    for verl_key, ours in zip(("clip_ratio_low", "clip_ratio_high"), names):
        theirs = _get(config, verl_key, None)
        theirs = clip if theirs is None else theirs
        if theirs is not None and abs(float(theirs) - getattr(base, ours)) > 1e-12:
            raise ValueError(
                f"actor.{verl_key}={theirs} but the moerl loss config has loss.{ours}={getattr(base, ours)}; "
                f"set them equal (moerl.verl_ext.losses.verl_overrides writes both)")
    return dataclasses.replace(base, variant=variant, aggregation=AGG_FROM_VERL[loss_agg_mode])


def rollout_logp_for_verl(variant: str, old_log_prob: torch.Tensor, response_mask: torch.Tensor,
                          rollout_is_weights: torch.Tensor | None,
                          rollout_log_probs: torch.Tensor | None) -> torch.Tensor:
    """log π_rollout from what verl passes (see the module docstring)."""
    if rollout_log_probs is not None:
        return rollout_log_probs
    m = response_mask.bool()
    if rollout_is_weights is None:
        if variant in NEEDS_ROLLOUT:
            raise ValueError(
                f"moerl_{variant} needs the rollout logprobs, and verl passed no rollout_is_weights: set "
                f"actor_rollout_ref.rollout.calculate_log_probs=true, algorithm.rollout_correction.rollout_is=token, "
                f"algorithm.rollout_correction.rollout_is_threshold={NO_TRUNCATION:g} (see verl_overrides)")
        return old_log_prob  # ppo_clip/gspo: no correction; bypass: verl already set old = rollout
    w = rollout_is_weights.detach().float()
    bad = m & ~(torch.isfinite(w) & (w > 0))
    if bool(bad.any()):
        rows = torch.nonzero(bad.any(-1)).flatten().tolist()[:10]
        raise ValueError(
            f"moerl_{variant}: rollout_is_weights is zero or non-finite on response tokens of sample(s) {rows}; "
            f"verl masked or truncated them, so π_rollout cannot be recovered. Use raw token weights: "
            f"rollout_is=token, rollout_is_threshold={NO_TRUNCATION:g}, rollout_rs=null, rollout_is_batch_normalize=false")
    log_w = torch.log(torch.where(m, w, torch.ones_like(w))).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return old_log_prob.detach().float() - log_w


def _make(variant: str):
    def loss_fn(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                rollout_is_weights: torch.Tensor | None = None,
                rollout_log_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        cfg = loss_config_for_verl(variant, config, loss_agg_mode)
        rollout = rollout_logp_for_verl(variant, old_log_prob, response_mask, rollout_is_weights, rollout_log_probs)
        per_token, metrics = policy_loss_terms(log_prob, old_log_prob, rollout, advantages, response_mask,
                                               cfg, variant=variant)
        batch_info = dict(_get(config, "global_batch_info", None) or {})
        loss = agg_loss(loss_mat=per_token, loss_mask=response_mask.to(per_token.dtype),
                        loss_agg_mode=loss_agg_mode, **batch_info)
        out: dict[str, Any] = {f"moerl/{k}": v for k, v in metrics.items()}
        # verl's own dashboard keys, same definitions as compute_policy_loss_vanilla
        out["actor/pg_clipfrac"] = metrics["clip/frac"]
        out["actor/pg_clipfrac_lower"] = metrics["clip/dual_frac"]
        out["actor/ppo_kl"] = metrics["loss/ppo_kl"]
        return loss, out

    loss_fn.__name__ = loss_fn.__qualname__ = f"moerl_{variant}"
    loss_fn.__doc__ = f"verl policy loss running moerl.trainer.losses variant '{variant}'."
    return loss_fn


def register_all() -> dict[str, Any]:
    """(Re-)register every moerl loss with verl; returns {verl name: function}."""
    return {name: register_policy_loss(name)(_make(variant)) for name, variant in VERL_NAMES.items()}


REGISTERED = register_all()


def verl_overrides(loss_cfg: LossConfig) -> list[str]:
    """Hydra overrides for verl's ``main_ppo`` that select ``moerl_<variant>`` with these knobs."""
    _check(loss_cfg, "verl_overrides")
    payload = json.dumps(to_dict(loss_cfg), separators=(",", ":"))
    if loss_cfg.variant == "gspo":
        lo, hi = loss_cfg.gspo_eps_low, loss_cfg.gspo_eps_high
    else:
        lo, hi = loss_cfg.eps_low, loss_cfg.eps_high
    env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    out = [
        f"actor_rollout_ref.actor.policy_loss.loss_mode=moerl_{loss_cfg.variant}",
        f"actor_rollout_ref.actor.clip_ratio_low={lo}",
        f"actor_rollout_ref.actor.clip_ratio_high={hi}",
        f"actor_rollout_ref.actor.loss_agg_mode={AGG_TO_VERL[loss_cfg.aggregation]}",
        # verl's own losses always apply the dual clip; 1e9 is "off" for them (moerl reads dual_clip_c)
        f"actor_rollout_ref.actor.clip_ratio_c={loss_cfg.dual_clip_c or NO_TRUNCATION:g}",
        f"{env}.VERL_USE_EXTERNAL_MODULES=moerl.verl_ext.losses",
        f"{env}.{ENV_CONFIG}='{payload}'",
    ]
    if loss_cfg.aggregation == "seq_sum_constant":
        out.append("actor_rollout_ref.actor.loss_scale_factor=null")  # null = response length T
    if loss_cfg.variant in NEEDS_ROLLOUT:
        out += [
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "algorithm.rollout_correction.rollout_is=token",
            f"algorithm.rollout_correction.rollout_is_threshold={NO_TRUNCATION:g}",
            "algorithm.rollout_correction.rollout_is_batch_normalize=false",
            "algorithm.rollout_correction.rollout_rs=null",
            "algorithm.rollout_correction.bypass_mode=false",
        ]
    elif loss_cfg.variant == "bypass":
        # verl's bypass_mode skips the old-logprob recompute and then forces loss_mode=bypass_mode,
        # its own function; with loss_type=ppo_clip and no IS/RS that is the moerl_bypass formula
        # (tests/verl_ext check the two agree), so the moerl loss_mode above is replaced by verl.
        out += ["actor_rollout_ref.rollout.calculate_log_probs=true",
                "algorithm.rollout_correction.bypass_mode=true",
                "algorithm.rollout_correction.loss_type=ppo_clip",
                "algorithm.rollout_correction.rollout_is=null",
                "algorithm.rollout_correction.rollout_rs=null"]
    return out
