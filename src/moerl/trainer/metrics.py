"""Training-inference mismatch metrics, entropy, and per-token samples for notebooks.

Convention: every estimator here is of KL(π_rollout ‖ π_trainer), estimated from tokens the rollout
policy sampled, with the per-token log ratio

    Δ_t = log π_trainer(y_t) - log π_rollout(y_t)

    k1 = -Δ            (unbiased, can be negative per token)
    k2 = ½ Δ²          (low variance, biased)
    k3 = e^Δ - 1 - Δ   (unbiased and ≥ 0; R3 paper, verl rollout_corr/k3_kl, Miles)

(Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html; papers.md §6).
The names and definitions of the perplexity metrics follow verl's ``compute_offpolicy_metrics``
(``rollout_corr/log_ppl_diff`` etc., upstream_code.md 1c) so tiny-CPU and scale runs compare 1:1:
per sequence, log_ppl_diff = mean_t log π_rollout - mean_t log π_trainer = log(PPL_trainer/PPL_rollout).

Where π_trainer is π_old (the trainer's no-grad recompute before the update) these measure the
mismatch itself; the lead's loop passes ``old_logp`` here.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from moerl.config import LossConfig
from moerl.trainer.losses import check_finite, rollout_correction

__all__ = ["mismatch_metrics", "entropy_from_logits", "token_samples", "check_finite"]

LN2 = math.log(2.0)


def _stats(name: str, x_nt: torch.Tensor, m: torch.Tensor, has: torch.Tensor) -> dict[str, float]:
    """Token mean, sequence mean (mean over sequences of the per-sequence token mean) and max."""
    mf = m.float()
    per_seq = (x_nt * mf).sum(-1) / mf.sum(-1).clamp(min=1)
    return {
        f"mismatch/{name}": float((x_nt * mf).sum() / mf.sum().clamp(min=1)),
        f"mismatch/{name}_seq_mean": float(per_seq[has].mean()),
        f"mismatch/{name}_max": float(x_nt[m].max()),
    }


@torch.no_grad()
def mismatch_metrics(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """KL estimators, perplexity gap, |Δp| and χ² between trainer and rollout logprobs ([N, T] each).

    Keys (prefix ``mismatch/``): k1, k2, k3 (token means) and their ``_seq_mean`` / ``_max``;
    log_ppl_diff (mean over sequences), log_ppl_abs_diff, log_ppl_diff_max, log_ppl_diff_min,
    ppl_ratio (mean over sequences of PPL_trainer/PPL_rollout), trainer_log_ppl, rollout_log_ppl,
    dp_mean / dp_max (|p_trainer - p_rollout| of the sampled token), prob_pearson (correlation of
    the two probabilities, verl training/rollout_actor_probs_pearson_corr), chi2_token (E[ρ²]-1 with
    ρ = π_trainer/π_rollout), extreme_frac (|Δ| > ln 2, AReaL), tokens, seqs.
    Raises ValueError naming the sample if a response token has a non-finite logprob."""
    m = mask.bool()
    check_finite("mismatch_metrics: trainer_logp", trainer_logp, m)
    check_finite("mismatch_metrics: rollout_logp", rollout_logp, m)
    has = m.any(-1)
    if not bool(has.any()):
        return {"mismatch/tokens": 0.0, "mismatch/seqs": 0.0}
    zero = torch.zeros((), dtype=torch.float32, device=trainer_logp.device)
    lt = torch.where(m, trainer_logp.detach().float(), zero)
    lr = torch.where(m, rollout_logp.detach().float(), zero)
    mf = m.float()
    delta = lt - lr
    out: dict[str, float] = {}
    out.update(_stats("k1", -delta, m, has))
    out.update(_stats("k2", 0.5 * delta * delta, m, has))
    out.update(_stats("k3", torch.expm1(delta) - delta, m, has))

    n_tok = mf.sum(-1).clamp(min=1)
    mean_lt = lt.sum(-1) / n_tok
    mean_lr = lr.sum(-1) / n_tok
    lpd = (mean_lr - mean_lt)[has]
    out.update({
        "mismatch/log_ppl_diff": float(lpd.mean()),
        "mismatch/log_ppl_abs_diff": float(lpd.abs().mean()),
        "mismatch/log_ppl_diff_max": float(lpd.max()),
        "mismatch/log_ppl_diff_min": float(lpd.min()),
        "mismatch/ppl_ratio": float(torch.exp(lpd).mean()),
        "mismatch/trainer_log_ppl": float(-mean_lt[has].mean()),
        "mismatch/rollout_log_ppl": float(-mean_lr[has].mean()),
    })

    pt, pr = torch.exp(lt[m]), torch.exp(lr[m])
    dp = (pt - pr).abs()
    out["mismatch/dp_mean"] = float(dp.mean())
    out["mismatch/dp_max"] = float(dp.max())
    if pt.numel() > 1 and float(pt.std()) > 0 and float(pr.std()) > 0:
        out["mismatch/prob_pearson"] = float(torch.corrcoef(torch.stack([pt, pr]))[0, 1])
    else:  # constant probabilities: correlation undefined
        out["mismatch/prob_pearson"] = float("nan")
    rho = torch.exp(delta[m].clamp(-20.0, 20.0))
    out["mismatch/chi2_token"] = float((rho * rho).mean() - 1)
    out["mismatch/extreme_frac"] = float((delta[m].abs() > LN2).float().mean())
    out["mismatch/tokens"] = float(mf.sum())
    out["mismatch/seqs"] = float(has.sum())
    return out


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean token entropy (nats) of softmax(logits) [N, T, V] over the response mask [N, T].
    H = logsumexp(l) - Σ softmax(l)·l, which avoids log(0) for tokens with vanishing probability."""
    m = mask.bool()
    if not bool(m.any()):
        return float("nan")
    sel = logits[m].float()  # [n, V]: only response positions, so padding logits cannot poison it
    h = torch.logsumexp(sel, -1) - (torch.softmax(sel, -1) * sel).sum(-1)
    return float(h.mean())


@torch.no_grad()
def token_samples(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor,
                  cfg: LossConfig, max_tokens: int, generator: torch.Generator | None = None) -> dict[str, np.ndarray]:
    """Up to ``max_tokens`` response tokens drawn uniformly without replacement, as numpy arrays for
    histograms and scatter plots (the trainer saves them every ``trainer.samples_every`` steps).

    Keys: sample, token (int32 positions), rollout_logp, trainer_logp (float32), raw_ratio (ρ at the
    correction's level, = π_trainer/π_rollout per token at token level), is_weight (the weight
    ``cfg.variant`` applies; 1 for variants without a correction), truncated, masked (bool).
    Sorted by (sample, token). ``trainer_logp`` should be π_old, the same input the loss's
    correction uses, so the weights here are those of the step."""
    if max_tokens < 0:
        raise ValueError(f"token_samples: max_tokens must be >= 0, got {max_tokens}")
    m = mask.bool()
    check_finite("token_samples: rollout_logp", rollout_logp, m)
    check_finite("token_samples: trainer_logp", trainer_logp, m)
    corr = rollout_correction(trainer_logp, rollout_logp, m, cfg)
    pos = torch.nonzero(m)  # [n, 2] in row-major order
    n = pos.shape[0]
    if n > max_tokens:
        gen_device = generator.device if generator is not None else "cpu"
        pick = torch.randperm(n, generator=generator, device=gen_device)[:max_tokens]
        pos = pos[pick.sort().values.to(pos.device)]
    r, t = pos[:, 0], pos[:, 1]

    def f32(x):
        return x[r, t].detach().float().cpu().numpy()

    return {
        "sample": r.cpu().numpy().astype(np.int32),
        "token": t.cpu().numpy().astype(np.int32),
        "rollout_logp": f32(rollout_logp),
        "trainer_logp": f32(trainer_logp),
        "raw_ratio": f32(corr.raw),
        "is_weight": f32(corr.weight),
        "truncated": corr.truncated[r, t].cpu().numpy(),
        "masked": corr.masked[r, t].cpu().numpy(),
    }

