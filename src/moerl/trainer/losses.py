"""Policy-loss variants, shared by the embedded loop and the verl plug-in: each is a PPO surrogate
times a rollout correction, listed in one table (``VARIANTS``) next to the functions it names.

Signature (DESIGN.md): ``policy_loss(logp, old_logp, rollout_logp, adv, mask, cfg) -> (loss, metrics)``
with every tensor [N, T] (``adv`` may also be [N], broadcast over a sequence's tokens), ``mask`` the
response mask, and ``loss`` this micro-batch's loss under ``cfg.aggregation``. The trainer weights
micro-batches with ``aggregation_weight`` so a mini-batch's loss is the same however it is split.

Three policies meet in one step (decoupled PPO, verl ``docs/algo/rollout_corr_math.md``):
π_rollout sampled the tokens (``rollout_logp``, from the engine, e.g. bf16), π_old is the trainer's
recompute of the same weights (``old_logp``, fp32, no grad) and π_θ is the policy being updated
(``logp``). The PPO ratio r_t = π_θ/π_old handles the policy change across mini-batches; the
rollout-correction weight w_t, a function of ρ_t = π_old/π_rollout only, handles the
training-inference mismatch. w is detached (it changes the sampling measure, not the objective) and
multiplies the per-token PPO-clip loss:

    L = agg_t( w_t · max(-A_t·r_t, -A_t·clip(r_t, 1-ε_low, 1+ε_high)) )

| variant  | w_t (detached)                                                        | source |
|----------|-----------------------------------------------------------------------|--------|
| ppo_clip | 1 (no correction; dual clip optional)                                 | Schulman 2017; DAPO clip-higher; Ye et al. 2020 dual clip |
| tis      | token: min(ρ_t, C); sequence: min(∏_t ρ_t, C)                         | Yao et al. "Your efficient RL framework secretly brings you off-policy RL" (fengyao.notion.site/off-policy-rl), verl rollout_is=token/sequence |
| mis      | token: ρ_t·1[lo≤ρ_t≤hi]; sequence: ρ·1[lo≤ρ≤hi], ρ=∏ρ_t;             | Liu, Li et al. "When Speed Kills Stability" (MIS / Geo-RS / veto), verl rollout_rs |
|          | geometric: 1[lo≤(∏ρ_t)^(1/|y|)≤hi] (× min(ρ_t, C) if mis_token_tis); |        |
|          | every level: whole sequence 0 if some ρ_t < veto                      |        |
| icepop   | ρ_t·1[α≤ρ_t≤β]                                                        | Ring-1T arXiv 2510.18855, ringtech.notion.site/icepop |
| gspo     | 1; the PPO ratio is the sequence ratio s_i=(π_θ(y)/π_old(y))^(1/|y|)  | Zheng et al. arXiv 2507.18071 (GSPO-token form, as verl's ``gspo``) |
| bypass   | 1; π_old := π_rollout (no recompute), r_t = π_θ/π_rollout              | verl ``bypass_mode`` with loss_type=ppo_clip |

Masked (w=0) tokens stay in the aggregation's denominator: the estimator is E_rollout[w·term] over
*all* sampled tokens, as in IcePop's J = (1/Σ|y|) Σ_t M(ρ_t)·term and verl's IcePop weights. This
also keeps ``aggregation_weight`` (computed from the response mask before the loss) exact.

Products over a sequence are computed in log space and clamped to ±20 before ``exp`` (verl's
SAFETY_BOUND), so weights stay finite; a sequence that far out is truncated/masked either way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from moerl.config import LossConfig

SAFETY_BOUND = 20.0  # |log ratio| clamp before exp, as verl's rollout_corr_helper.SAFETY_BOUND
GSPO_LOG_RATIO_MAX = 10.0  # verl's compute_policy_loss_gspo clamps the combined log ratio at 10


# ---------------------------------------------------------------------------------------------
# Aggregation


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """token_mean (default): every token counts once, so long answers are not down-weighted as in
    seq-mean (DAPO; verl's default ``token-mean``); seq_mean_token_mean: mean per sequence, then over
    sequences (GRPO paper, GSPO paper); seq_sum_constant: sum over tokens / (rows × T), a constant
    (Dr. GRPO: no length bias in either direction)."""
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


# ---------------------------------------------------------------------------------------------
# Input checks


def check_finite(name: str, tensor: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise ValueError naming the samples (rows) with a non-finite value on a response token.

    Padding positions are not checked (engines put anything there). A NaN averaged into a loss or
    a metric would silently poison a whole step, so the batch is refused instead."""
    bad = ~torch.isfinite(tensor.detach()) & mask.bool()
    if not bool(bad.any()):
        return
    rows = torch.nonzero(bad.any(-1)).flatten().tolist()
    r0 = rows[0]
    t0 = int(torch.nonzero(bad[r0]).flatten()[0])
    shown = rows[:10] + (["..."] if len(rows) > 10 else [])
    raise ValueError(
        f"{name}: non-finite value on response tokens of sample(s) {shown} ({len(rows)} of "
        f"{tensor.shape[0]}); first at sample {r0}, token {t0}: {float(tensor[r0, t0])}. "
        f"Expected finite log-probabilities on every response token.")


# ---------------------------------------------------------------------------------------------
# Rollout correction: w_t from ρ_t = π_old / π_rollout


@dataclass
class Correction:
    """What a rollout correction did to a batch, for the loss and for its metrics."""

    weight: torch.Tensor  # [N, T] applied weight w_t, detached, 0 off-response and where masked
    raw: torch.Tensor  # [N, T] raw ratio at `level` (ρ_t, or the sequence's ratio on each token)
    unit_raw: torch.Tensor  # 1-D raw ratio per unit: response tokens, or sequences at sequence levels
    truncated: torch.Tensor  # [N, T] bool: response tokens whose weight was capped
    masked: torch.Tensor  # [N, T] bool: response tokens whose weight was zeroed (mask or veto)
    vetoed: torch.Tensor  # [N] bool: sequences dropped by the veto
    level: str  # "token" | "sequence" | "geometric" | "none"
    lower: float  # the bounds that is/below_frac and is/above_frac refer to
    upper: float


def token_log_ratio(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log ρ_t = log π_old - log π_rollout on response tokens (0 elsewhere), fp32, detached."""
    d = old_logp.detach().float() - rollout_logp.detach().float()
    return torch.where(mask.bool(), d, torch.zeros_like(d))


def _seq_units(values_nt: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence value (constant along T) for the sequences that have a response token."""
    has = mask.bool().any(-1)
    return values_nt[:, 0][has] if values_nt.dim() == 2 else values_nt[has]


class _Ratios:
    """ρ on a batch, in the forms the corrections need (all detached, fp32)."""

    def __init__(self, old_logp, rollout_logp, mask):
        self.m = mask.bool()
        self.mf = self.m.float()
        self.d = token_log_ratio(old_logp, rollout_logp, self.m)  # log ρ_t
        self.rho_t = torch.exp(self.d.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * self.mf
        self.seq_sum = self.d.sum(-1)  # log ∏_t ρ_t
        self.n_tok = self.mf.sum(-1)
        self.none_n = torch.zeros(self.m.shape[0], dtype=torch.bool, device=self.m.device)
        self.none_nt = torch.zeros_like(self.m)


def no_correction(r: _Ratios, cfg: LossConfig) -> Correction:
    """w_t = 1. ρ is still reported (against the TIS bounds) so every arm logs the same keys."""
    C = cfg.tis_cap
    return Correction(r.mf, r.rho_t, r.rho_t[r.m], r.none_nt, r.none_nt, r.none_n, "none", 1.0 / C, C)


def tis_correction(r: _Ratios, cfg: LossConfig) -> Correction:
    """Truncated IS: token min(ρ_t, C), or sequence min(∏_t ρ_t, C) on every token of the sequence."""
    C, m = cfg.tis_cap, r.m
    if cfg.is_level == "token":
        return Correction(r.rho_t.clamp(max=C), r.rho_t, r.rho_t[m], (r.rho_t > C) & m, r.none_nt, r.none_n,
                          "token", 1.0 / C, C)
    if cfg.is_level == "sequence":
        rho_s = torch.exp(r.seq_sum.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        raw = rho_s[:, None] * r.mf
        return Correction(raw.clamp(max=C), raw, _seq_units(rho_s, m), (rho_s > C)[:, None] & m, r.none_nt,
                          r.none_n, "sequence", 1.0 / C, C)
    raise ValueError(f"loss.is_level: '{cfg.is_level}' is not valid for loss.variant=tis "
                     f"(allowed: ['token', 'sequence'])")


def icepop_correction(r: _Ratios, cfg: LossConfig) -> Correction:
    """IcePop: w_t = ρ_t inside [α, β], 0 outside (masked, not clipped)."""
    keep = (r.rho_t >= cfg.icepop_alpha) & (r.rho_t <= cfg.icepop_beta) & r.m
    return Correction(r.rho_t * keep, r.rho_t, r.rho_t[r.m], r.none_nt, r.m & ~keep, r.none_n, "token",
                      cfg.icepop_alpha, cfg.icepop_beta)


def mis_correction(r: _Ratios, cfg: LossConfig) -> Correction:
    """Masked IS at token, sequence or geometric level, with the optional catastrophic-token veto."""
    lo, hi, C, m, mf = cfg.mis_lower, cfg.mis_upper, cfg.tis_cap, r.m, r.mf
    vetoed = ((r.d < math.log(cfg.mis_veto)) & m).any(-1) if cfg.mis_veto is not None else r.none_n
    trunc = r.none_nt
    if cfg.is_level == "token":
        raw, units = r.rho_t, r.rho_t[m]
        keep = (r.rho_t >= lo) & (r.rho_t <= hi) & m
        weight = r.rho_t
    elif cfg.is_level in ("sequence", "geometric"):
        # sequence: ∏_t ρ_t; geometric: its |y|-th root, exp(mean_t log ρ_t)
        log_s = r.seq_sum if cfg.is_level == "sequence" else r.seq_sum / r.n_tok.clamp(min=1)
        rho_s = torch.exp(log_s.clamp(-SAFETY_BOUND, SAFETY_BOUND))
        raw, units = rho_s[:, None] * mf, _seq_units(rho_s, m)
        keep = ((rho_s >= lo) & (rho_s <= hi))[:, None] & m
        if cfg.is_level == "sequence":
            weight = raw
        elif cfg.mis_token_tis:
            weight = r.rho_t.clamp(max=C)
            trunc = (r.rho_t > C) & m
        else:  # rejection only: the geometric mean is a filter, not an unbiased weight
            weight = mf
    else:
        raise ValueError(f"loss.is_level: unknown level '{cfg.is_level}'")
    keep = keep & ~vetoed[:, None]
    return Correction(weight * keep, raw, units, trunc & keep, m & ~keep, vetoed, cfg.is_level, lo, hi)


def rollout_correction(old_logp, rollout_logp, mask, cfg: LossConfig, variant: str | None = None) -> Correction:
    """The detached rollout-correction weights of ``variant`` (default ``cfg.variant``)."""
    return variant_of(variant or cfg.variant).correction(_Ratios(old_logp, rollout_logp, mask), cfg)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.float()
    return float((x.float() * m).sum() / m.sum().clamp(min=1))


def quantiles(x: torch.Tensor, qs: list[float]) -> list[float]:
    """Linear-interpolated quantiles of a 1-D tensor. torch.quantile refuses more than 2**24
    elements, so bigger inputs go through numpy."""
    if x.numel() == 0:
        return [float("nan")] * len(qs)
    x = x.detach().float()
    if x.numel() <= 2**24:
        return [float(v) for v in torch.quantile(x, torch.tensor(qs, device=x.device))]
    return [float(v) for v in np.quantile(x.cpu().numpy(), qs)]


def ess_fraction(w: torch.Tensor) -> float:
    """Kish effective sample size over n samples, as a fraction of n: (Σw)² / (n·Σw²) ∈ [0, 1].
    Equals verl's rollout_is_eff_sample_size (1 / mean((w/mean w)²))."""
    w = w.detach().float()
    if w.numel() == 0:
        return float("nan")
    den = w.numel() * (w * w).sum()
    return float(w.sum() ** 2 / den) if float(den) > 0 else 0.0


def correction_metrics(corr: Correction, mask: torch.Tensor) -> dict[str, float]:
    """is/* (raw ratio distribution at the correction's level, applied-weight mean and ESS) and
    mask/* (tokens and sequences zeroed by masking or veto)."""
    m = mask.bool()
    has = m.any(-1)
    units = corr.unit_raw.float()
    p1, p50, p99 = quantiles(units, [0.01, 0.5, 0.99])
    n_units = max(units.numel(), 1)
    seqs = max(int(has.sum()), 1)
    out = {
        "is/mean": float(units.mean()) if units.numel() else float("nan"),
        "is/std": float(units.std(unbiased=False)) if units.numel() else float("nan"),
        "is/min": float(units.min()) if units.numel() else float("nan"),
        "is/max": float(units.max()) if units.numel() else float("nan"),
        "is/p1": p1,
        "is/p50": p50,
        "is/p99": p99,
        "is/above_frac": float((units > corr.upper).sum()) / n_units,
        "is/below_frac": float((units < corr.lower).sum()) / n_units,
        "is/applied_mean": masked_mean(corr.weight, m),
        "is/applied_max": float(corr.weight[m].max()) if bool(m.any()) else float("nan"),
        "is/ess": ess_fraction(corr.weight[m]),
        "is/raw_ess": ess_fraction(units),
        "is/truncated_frac": masked_mean(corr.truncated.float(), m),
        "mask/token_frac": masked_mean(corr.masked.float(), m),
        "mask/seq_frac": float((corr.masked.any(-1) & has).sum()) / seqs,
        "mask/seq_full_frac": float(((corr.masked | ~m).all(-1) & has).sum()) / seqs,
        "mask/veto_seq_frac": float((corr.vetoed & has).sum()) / seqs,
    }
    return out


# ---------------------------------------------------------------------------------------------
# Surrogates


@dataclass
class _Surrogate:
    per_token: torch.Tensor  # [N, T] loss before the correction weight
    ratio: torch.Tensor  # [N, T] detached PPO ratio (token r_t, or the sequence ratio s_i for GSPO)
    low: torch.Tensor  # [N, T] bool: clipped at 1-ε_low with A<0 (no gradient)
    high: torch.Tensor  # [N, T] bool: clipped at 1+ε_high with A>0 (no gradient)
    dual: torch.Tensor  # [N, T] bool: capped by the dual clip, A<0 and ratio > c (no gradient)


def _ppo_clip_surrogate(logp, old_logp, adv, eps_low, eps_high, dual_clip_c) -> _Surrogate:
    """max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high)); with dual clip, min(that, -c·A) for A<0.
    log r is clamped to ±20 before exp, as in verl's compute_policy_loss_vanilla."""
    ratio = torch.exp((logp - old_logp).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    surr1 = -adv * ratio
    surr2 = -adv * ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = torch.maximum(surr1, surr2)
    r = ratio.detach()
    dual = torch.zeros_like(r, dtype=torch.bool)
    if dual_clip_c is not None:
        cap = -adv * dual_clip_c
        dual = (adv < 0) & (per_token.detach() > cap)
        per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)
    return _Surrogate(per_token, r, (adv < 0) & (r < 1 - eps_low), (adv > 0) & (r > 1 + eps_high), dual)


def _gspo_surrogate(logp, old_logp, adv, mask, eps_low, eps_high) -> _Surrogate:
    """GSPO-token: s_{i,t} = sg[s_i]·π_θ(y_t)/sg[π_θ(y_t)], s_i = exp(mean_t log(π_θ/π_old)), so the
    value is the sequence ratio and the gradient is s_i·∇log π_θ(y_t) (Zheng et al. eq. for GSPO-token;
    verl compute_policy_loss_gspo)."""
    mf = mask.float()
    seq_log = ((logp - old_logp) * mf).sum(-1) / mf.sum(-1).clamp(min=1)
    log_s = logp - logp.detach() + seq_log.detach()[:, None]
    s = torch.exp(log_s.clamp(max=GSPO_LOG_RATIO_MAX))
    surr1 = -adv * s
    surr2 = -adv * s.clamp(1 - eps_low, 1 + eps_high)
    r = s.detach()
    none = torch.zeros_like(r, dtype=torch.bool)
    return _Surrogate(torch.maximum(surr1, surr2), r, (adv < 0) & (r < 1 - eps_low),
                      (adv > 0) & (r > 1 + eps_high), none)


# ---------------------------------------------------------------------------------------------
# The variants: a surrogate, a rollout correction, and which policy plays π_old


def ppo_clip_surrogate(logp, old_logp, adv, mask, cfg: LossConfig) -> _Surrogate:
    return _ppo_clip_surrogate(logp, old_logp, adv, cfg.eps_low, cfg.eps_high, cfg.dual_clip_c)


def gspo_surrogate(logp, old_logp, adv, mask, cfg: LossConfig) -> _Surrogate:
    return _gspo_surrogate(logp, old_logp, adv, mask, cfg.gspo_eps_low, cfg.gspo_eps_high)


@dataclass(frozen=True)
class Variant:
    """A policy-loss variant is a PPO surrogate times a rollout correction (module docstring)."""

    surrogate: Callable[..., _Surrogate]  # (logp, old_logp, adv, mask, cfg) -> per-token loss and clip flags
    correction: Callable[[_Ratios, LossConfig], Correction]  # ρ = π_old/π_rollout -> w_t
    old_is_rollout: bool = False  # bypass: π_old := π_rollout, the trainer's recompute is unused


VARIANTS: dict[str, Variant] = {
    "ppo_clip": Variant(ppo_clip_surrogate, no_correction),
    "tis": Variant(ppo_clip_surrogate, tis_correction),
    "mis": Variant(ppo_clip_surrogate, mis_correction),
    "icepop": Variant(ppo_clip_surrogate, icepop_correction),
    "gspo": Variant(gspo_surrogate, no_correction),
    "bypass": Variant(ppo_clip_surrogate, no_correction, old_is_rollout=True),
}


def variant_of(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"loss.variant: unknown variant '{name}' (have: {sorted(VARIANTS)})") from None


def _prepare(logp, old_logp, rollout_logp, adv, mask):
    """Check the inputs and zero everything off the response, so padding garbage (inf/NaN) can
    reach neither the loss nor the gradient."""
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logp)
    for name, t in (("old_logp", old_logp), ("rollout_logp", rollout_logp), ("adv", adv), ("mask", mask)):
        if tuple(t.shape) != tuple(logp.shape):
            raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)}, expected {tuple(logp.shape)} like logp")
    m = mask.bool()
    check_finite("policy_loss: logp (trainer, current policy)", logp, m)
    check_finite("policy_loss: old_logp (trainer recompute)", old_logp, m)
    check_finite("policy_loss: rollout_logp (rollout engine)", rollout_logp, m)
    check_finite("policy_loss: advantages", adv, m)
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    logp = torch.where(m, logp.float(), zero)
    old_logp = torch.where(m, old_logp.detach().float(), zero)
    rollout_logp = torch.where(m, rollout_logp.detach().float(), zero)
    adv = torch.where(m, adv.detach().float(), zero)
    return logp, old_logp, rollout_logp, adv, m


def policy_loss_terms(logp, old_logp, rollout_logp, adv, mask, cfg: LossConfig, variant: str | None = None):
    """Per-token loss [N, T] (correction weight applied, 0 off-response) and metrics, before
    aggregation. The verl plug-in aggregates this with verl's own ``agg_loss``."""
    spec = variant_of(variant or cfg.variant)
    logp, old_logp, rollout_logp, adv, m = _prepare(logp, old_logp, rollout_logp, adv, mask)
    if spec.old_is_rollout:
        old_logp = rollout_logp  # whatever the trainer passed as π_old is unused
    corr = spec.correction(_Ratios(old_logp, rollout_logp, m), cfg)
    surr = spec.surrogate(logp, old_logp, adv, m, cfg)
    per_token = torch.where(m, surr.per_token * corr.weight, torch.zeros_like(surr.per_token))

    with torch.no_grad():
        metrics = correction_metrics(corr, m)
        clipped = surr.low | surr.high | surr.dual
        effective = m & (corr.weight > 0) & ~clipped
        has = m.any(-1)
        metrics.update({
            "clip/low_frac": masked_mean(surr.low.float(), m),
            "clip/high_frac": masked_mean(surr.high.float(), m),
            "clip/dual_frac": masked_mean(surr.dual.float(), m),
            "clip/frac": masked_mean((surr.low | surr.high).float(), m),
            "ratio/mean": masked_mean(surr.ratio, m),
            "ratio/max": float(surr.ratio[m].max()) if bool(m.any()) else float("nan"),
            "ratio/min": float(surr.ratio[m].min()) if bool(m.any()) else float("nan"),
            "loss/ppo_kl": masked_mean(old_logp - logp.detach(), m),
            "effective/token_frac": masked_mean(effective.float(), m),
            "effective/seq_frac": float((effective.any(-1) & has).sum()) / max(int(has.sum()), 1),
        })
    return per_token, metrics


def policy_loss(logp, old_logp, rollout_logp, adv, mask, cfg: LossConfig):
    """The ``cfg.variant`` loss of one micro-batch, aggregated under ``cfg.aggregation``. Returns
    (scalar loss, metrics with clip/ is/ mask/ effective/ ratio/ loss/ prefixes)."""
    per_token, metrics = policy_loss_terms(logp, old_logp, rollout_logp, adv, mask, cfg)
    loss = aggregate(per_token, mask, cfg.aggregation)
    metrics["loss/pg"] = float(loss.detach())
    return loss, metrics
