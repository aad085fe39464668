"""Training-inference mismatch metrics, entropy, and per-token samples for notebooks.

Convention: every estimator here is of KL(π_rollout ‖ π_trainer), estimated from tokens the rollout
policy sampled, with the per-token log ratio

    Δ_t = log π_trainer(y_t) - log π_rollout(y_t)

    k1 = -Δ            (unbiased, can be negative per token)
    k2 = ½ Δ²          (low variance, biased)
    k3 = e^Δ - 1 - Δ   (unbiased and ≥ 0; R3 paper, verl rollout_corr/k3_kl, Miles)

(Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html).
The names and definitions of the perplexity metrics follow verl's ``compute_offpolicy_metrics``
(``rollout_corr/log_ppl_diff`` etc., verl 0.9.1 ``trainer/ppo/rollout_corr_helper.py``) so tiny-CPU and
scale runs compare 1:1:
per sequence, log_ppl_diff = mean_t log π_rollout - mean_t log π_trainer = log(PPL_trainer/PPL_rollout).

Where π_trainer is π_old (the trainer's no-grad recompute before the update) these measure the
mismatch itself; the GRPO loop passes ``old_logp`` here.
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



# -- what the mismatch does to routing and to the IS ratios (experiment 05's questions) -------------
EXTREME_TAUS = (1.5, 2.0, 5.0, 10.0)


@torch.no_grad()
def routing_divergence(native, rollout) -> dict[str, float]:
    """How many tokens the mismatch re-routes, counted per token rather than per layer.

    ``native`` and ``rollout`` are RoutingTraces over the same rows (the trainer's native top-k and the
    engine's). Over the rollout's valid rows: ``routing/any_layer_differs`` is the share of tokens whose
    top-k *set* differs in at least one MoE layer (the R3 paper's "~94 % of tokens differ in >= 1
    router"), ``routing/differing_layers_mean`` the mean number of such layers per token."""
    from moerl.replay.diagnostics import same_set

    if native.moe_layers != rollout.moe_layers:
        raise ValueError(f"routing_divergence: native layers {native.moe_layers} != rollout layers "
                         f"{rollout.moe_layers}")
    if tuple(native.indices.shape) != tuple(rollout.indices.shape):
        raise ValueError(f"routing_divergence: native {tuple(native.indices.shape)} vs rollout "
                         f"{tuple(rollout.indices.shape)}")
    valid = rollout.valid
    if not bool(valid.any()):
        return {"routing/any_layer_differs": float("nan"), "routing/differing_layers_mean": float("nan")}
    differs = ~same_set(native.indices, rollout.indices)  # [N, T, L]
    per_token = differs[valid].sum(-1).float()
    return {"routing/any_layer_differs": float((per_token > 0).float().mean()),
            "routing/differing_layers_mean": float(per_token.mean())}


@torch.no_grad()
def extreme_token_curve(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                        taus=EXTREME_TAUS) -> dict[str, float]:
    """F(tau) = share of response tokens with max(rho, 1/rho) > tau, rho = pi_trainer/pi_rollout.

    The tail the IS corrections act on: TIS truncates above its cap, IcePop/MIS mask outside their band;
    the R3 paper reports tokens with ratio > 2 dropping ~10x under replay. Keys ``mismatch/extreme_gt{tau}``."""
    m = mask.bool()
    if not bool(m.any()):
        return {f"mismatch/extreme_gt{tau:g}": float("nan") for tau in taus}
    delta = (trainer_logp.detach().float() - rollout_logp.detach().float())[m].abs()
    return {f"mismatch/extreme_gt{tau:g}": float((delta > math.log(tau)).float().mean()) for tau in taus}


def _k3_per_sequence(trainer_logp, rollout_logp, m) -> torch.Tensor:
    delta = torch.where(m, trainer_logp.float() - rollout_logp.float(), torch.zeros(()))
    k3 = torch.expm1(delta) - delta
    return (k3 * m).sum(-1), m.sum(-1).float()


@torch.no_grad()
def paired_replay_effect(replayed_logp: torch.Tensor, native_logp: torch.Tensor, rollout_logp: torch.Tensor,
                         mask: torch.Tensor, resamples: int = 1000, seed: int = 0,
                         level: float = 0.95) -> dict[str, float]:
    """k3 of the same rollout batch with and without replay, as a ratio with a bootstrap interval.

    Both old-logprob passes see the same weights, tokens and rollout logprobs, so the ratio
    k3(native) / k3(replayed) isolates what replay does to the mismatch; comparing seeds or batches
    instead mixes in batch-to-batch variance (1-38x per batch in experiment 00). The interval
    resamples sequences (tokens within a sequence are not independent). Keys ``replay_effect/``."""
    m = mask.bool()
    has = m.any(-1)
    if not bool(has.any()):
        return {}
    k3_rep, tokens = _k3_per_sequence(replayed_logp, rollout_logp, m)
    k3_nat, _ = _k3_per_sequence(native_logp, rollout_logp, m)
    k3_rep, k3_nat, tokens = k3_rep[has].double(), k3_nat[has].double(), tokens[has].double()

    def ratio(idx):
        return k3_nat[idx].sum(-1) / k3_rep[idx].sum(-1).clamp(min=1e-30)

    n = int(tokens.numel())
    gen = torch.Generator().manual_seed(seed)
    boots = ratio(torch.randint(0, n, (resamples, n), generator=gen))
    lo, hi = torch.quantile(boots, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=boots.dtype))
    total = tokens.sum()
    return {"replay_effect/k3_replayed": float(k3_rep.sum() / total),
            "replay_effect/k3_native": float(k3_nat.sum() / total),
            "replay_effect/k3_ratio": float(ratio(torch.arange(n))),
            "replay_effect/k3_ratio_lo": float(lo), "replay_effect/k3_ratio_hi": float(hi),
            "replay_effect/seqs": float(n)}


class AgreementAlarm:
    """Warns when routing agreement under R3 falls far below its no-replay level.

    A trace fed to the wrong layers still gives ``violations=0`` and ``replayed_agreement=1.0``: the
    experts received equal the trace, it is just the wrong trace. What shows it is the trainer's own
    native top-k against the trace: replaying the right routes keeps the disagreement at or below its
    no-replay level (the hidden states become the rollout's); routes of another layer push it far above.
    Fires when ``1 - agreement > factor * (1 - reference) + margin``. The no-replay reference is measured
    on the same batches by the paired pass (``trainer.paired_replay_every``)."""

    margin = 0.01  # absolute slack: a reference disagreement near 0 must not make noise an alarm

    def __init__(self, factor: float):
        self.factor, self.reference = factor, None

    def observe_reference(self, agreement: float) -> None:
        if agreement == agreement:
            self.reference = agreement

    def check(self, agreement: float, step: int) -> dict[str, float]:
        if self.reference is None or agreement != agreement:
            return {}
        fired = 1.0 - agreement > self.factor * (1.0 - self.reference) + self.margin
        if fired:
            import logging

            logging.getLogger(__name__).warning(
                "step %d: routing agreement under replay %.3f is far below its no-replay level %.3f: the "
                "replayed routes do not belong to these layers (check the layer mapping)", step, agreement,
                self.reference)
        return {"routing/agreement_alarm": float(fired), "routing/agreement_reference": self.reference}
