"""One line per logged metric key: what a row of metrics.jsonl (and wandb) means.

Notation: Δ_t = log π_trainer(y_t) − log π_rollout(y_t) for a token y_t the rollout sampled; ρ_t = e^Δ_t.
"Token mean" is over the step's response tokens, "sequence mean" over its responses. ``docs/metrics.md`` is
generated from this table (``scripts/write_readme_numbers.py``, section metrics) and a test fails when a run logs a key that
no entry matches. A key pattern may hold ``{N}`` (a layer number) or ``{tau}`` (a threshold).
"""
from __future__ import annotations

import re

METRIC_DOCS: dict[str, str] = {
    # --- the step and the task
    "step": "GRPO step (0: the evaluation before training)",
    "lr": "learning rate at this step (after warm-up and schedule)",
    "reward/mean": "mean reward of the step's sampled responses (1 = correct answer)",
    "reward/mixed_group_frac": "share of prompt groups whose rewards are not all equal: the groups that carry a GRPO gradient",
    "reward/group_solved_frac": "former name of reward/mixed_group_frac (runs recorded before the rename)",
    "response/length_mean": "mean response length in tokens",
    "eval/pass1": "held-out pass@1: share of held-out problems solved by one sample at temperature 1",
    "eval/greedy": "held-out accuracy of greedy decoding",
    "entropy": "token-mean entropy of the trainer's policy over the sampled responses",
    # --- training-inference mismatch (trainer's old logprobs vs the rollout engine's)
    "mismatch/k1": "token mean of k1 = −Δ (unbiased KL(π_rollout‖π_trainer) estimate; can be negative)",
    "mismatch/k1_seq_mean": "k1 averaged per sequence, then over sequences",
    "mismatch/k1_max": "largest per-token k1 of the step",
    "mismatch/k2": "token mean of k2 = Δ²/2 (low-variance, biased KL estimate)",
    "mismatch/k2_seq_mean": "k2 averaged per sequence, then over sequences",
    "mismatch/k2_max": "largest per-token k2 of the step",
    "mismatch/k3": "token mean of k3 = e^Δ − 1 − Δ (unbiased, ≥ 0): the mismatch headline number",
    "mismatch/k3_seq_mean": "k3 averaged per sequence, then over sequences",
    "mismatch/k3_max": "largest per-token k3 of the step (the worst token)",
    "mismatch/log_ppl_diff": "sequence mean of log(PPL_trainer / PPL_rollout) (verl's rollout_corr/log_ppl_diff)",
    "mismatch/log_ppl_abs_diff": "sequence mean of |log PPL_trainer − log PPL_rollout|",
    "mismatch/log_ppl_diff_max": "largest per-sequence log-perplexity difference",
    "mismatch/log_ppl_diff_min": "smallest per-sequence log-perplexity difference",
    "mismatch/ppl_ratio": "sequence mean of PPL_trainer / PPL_rollout",
    "mismatch/trainer_log_ppl": "sequence mean of the trainer's log perplexity of the responses",
    "mismatch/rollout_log_ppl": "sequence mean of the rollout engine's log perplexity of the responses",
    "mismatch/dp_mean": "token mean of |p_trainer − p_rollout| of the sampled token",
    "mismatch/dp_max": "largest |p_trainer − p_rollout| of the step",
    "mismatch/prob_pearson": "Pearson correlation of the two probabilities of the sampled tokens",
    "mismatch/chi2_token": "token mean of ρ² − 1 (χ² divergence estimate)",
    "mismatch/extreme_frac": "share of tokens with |Δ| > ln 2 (probabilities a factor 2 apart; AReaL's measure)",
    "mismatch/extreme_gt{tau}": "share of tokens with ρ > tau (the R3 paper counts ρ > 2)",
    "mismatch/tokens": "response tokens the mismatch statistics are computed over",
    "mismatch/seqs": "responses the mismatch statistics are computed over",
    # --- importance weights and masks of the rollout correction (TIS, MIS, IcePop, ...)
    "is/mean": "mean raw importance ratio π_old/π_rollout at the loss's level (token, or sequence for sequence-level MIS)",
    "is/std": "standard deviation of the raw importance ratio",
    "is/min": "smallest raw importance ratio",
    "is/max": "largest raw importance ratio",
    "is/p1": "1st percentile of the raw importance ratio",
    "is/p50": "median raw importance ratio",
    "is/p99": "99th percentile of the raw importance ratio",
    "is/above_frac": "share of ratios above the correction's upper bound",
    "is/below_frac": "share of ratios below the correction's lower bound",
    "is/applied_mean": "token mean of the weight the loss applied (1 where the arm applies none)",
    "is/applied_max": "largest applied weight",
    "is/ess": "effective sample size of the applied weights, as a fraction of the tokens (1 = uniform)",
    "is/raw_ess": "effective sample size of the raw ratios, as a fraction",
    "is/truncated_frac": "share of tokens whose weight TIS truncated at its cap",
    "mask/token_frac": "share of tokens a masking correction (MIS, IcePop) zeroed",
    "mask/seq_frac": "share of responses with at least one masked token",
    "mask/seq_full_frac": "share of responses with every token masked",
    "mask/veto_seq_frac": "share of responses vetoed as a whole (a token ratio past the veto bound)",
    "effective/token_frac": "share of tokens that still carry gradient after clipping and masking",
    "effective/seq_frac": "share of responses that still carry gradient",
    # --- the PPO update
    "clip/frac": "share of tokens whose PPO ratio π_θ/π_old was clipped",
    "clip/low_frac": "share clipped at the lower bound (negative advantage)",
    "clip/high_frac": "share clipped at the upper bound (positive advantage)",
    "clip/dual_frac": "share capped by the dual clip (negative advantage, ratio above its bound c)",
    "ratio/mean": "token mean of the PPO ratio π_θ/π_old during the update",
    "ratio/max": "largest PPO ratio",
    "ratio/min": "smallest PPO ratio",
    "loss/policy": "the policy loss minimised (PPO surrogate with the arm's correction)",
    "loss/pg": "the policy-gradient part of the loss",
    "loss/ppo_kl": "token-mean KL(π_old‖π_θ) estimate during the update",
    "grad_norm": "norm of the LoRA gradient before clipping",
    "updates/skipped_nonfinite": "updates skipped because the gradient was not finite",
    # --- routing and router replay
    "routing/agreement": "share of (token, MoE layer) routes the trainer chose like the rollout engine, mean over layers",
    "routing/agreement/layer{N}": "that share in MoE layer N",
    "routing/disagreement": "1 − routing/agreement",
    "routing/any_layer_differs": "share of tokens routed differently in at least one MoE layer",
    "routing/differing_layers_mean": "mean number of MoE layers per token routed differently",
    "routing/all_layers_agree": "share of tokens routed alike in every MoE layer",
    "routing/replayed_agreement": "share of replayed routes the trainer actually followed (1 under a correct R2/R3)",
    "routing/duplicate_rows": "engine routing rows with a repeated expert id (dropped from the replay trace)",
    "routing/agreement_alarm": "1 when agreement under replay fell far below its no-replay level (a wrong layer mapping)",
    "routing/agreement_reference": "the no-replay agreement the alarm compares with",
    "replay/violations": "replayed rows the trainer's router did not follow (update pass)",
    "replay/recompute_mismatches": "rows whose recompute under activation checkpointing chose other experts",
    "replay/checked_rows": "replayed rows checked",
    "replay/old_pass_violations": "replay/violations in the old-logprob pass",
    "replay/old_pass_recompute_mismatches": "replay/recompute_mismatches in the old-logprob pass",
    "replay_effect/k3_native": "k3 of the same batch scored with the trainer's own routing (paired replay check)",
    "replay_effect/k3_replayed": "k3 of that batch scored replaying the rollout's routes",
    "replay_effect/k3_ratio": "k3_native / k3_replayed: how much replay cuts the mismatch",
    "replay_effect/k3_ratio_lo": "lower end of its 95% bootstrap interval over sequences",
    "replay_effect/k3_ratio_hi": "upper end of that interval",
    "replay_effect/seqs": "sequences in the paired replay check",
    # --- refit (LoRA weights from the trainer into the rollout engine)
    "refit/bytes": "bytes sent to the rollout engine at this refit",
    "refit/seconds": "wall time of the refit",
    "refit/buckets": "buckets the refit was sent in",
    "refit/tensors": "tensors sent",
    "refit/version": "weight version the engine holds after the refit",
    # --- wall-clock time
    "time/step": "wall time of the whole step (s)",
    "time/rollout": "wall time of sampling (s)",
    "time/old_logprob": "wall time of the trainer's old-logprob pass (s)",
    "time/update": "wall time of the PPO update (s)",
    "time/refit": "wall time of the refit (s)",
    "time/eval": "wall time of the held-out evaluation (s)",
    "time/consequence_metrics": "wall time of the routing and mismatch diagnostics (s)",
}


def _pattern(key: str) -> re.Pattern:
    return re.compile("^" + re.escape(key).replace(r"\{N\}", r"\d+").replace(r"\{tau\}", r"[0-9.]+") + "$")


_PATTERNS = [(_pattern(k), k) for k in METRIC_DOCS]


def documented(key: str) -> str | None:
    """The entry of METRIC_DOCS that documents ``key`` (None: undocumented)."""
    return next((name for pattern, name in _PATTERNS if pattern.match(key)), None)


def markdown() -> str:
    """docs/metrics.md's table, one line per key."""
    lines = ["| key | meaning |", "|---|---|"]
    lines += [f"| `{k}` | {v.replace('|', '∣')} |" for k, v in METRIC_DOCS.items()]
    return "\n".join(lines)
