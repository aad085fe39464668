"""The trainer's view of a RolloutBatch: per-token logprobs (and entropy) of the sampled tokens."""
from __future__ import annotations

import torch
from torch import nn

from moerl.rollout.batch import RolloutBatch


def forward_logprobs(model: nn.Module, batch: RolloutBatch, temperature: float = 1.0,
                     with_entropy: bool = False):
    """Teacher-forced forward over ``input_ids[:, :-1]`` with the engine's position ids.

    Returns ``logp [N, T]`` where ``logp[:, t]`` is the log-probability of token t (column 0 is 0),
    aligned with ``batch.rollout_logprobs``; and optionally the entropy [N, T] of the same
    distributions. Logits are divided by the sampling temperature, as the engine's were. Positions must be passed explicitly: under left padding `generate` numbers
    tokens by cumsum(attention_mask) - 1, and the default arange would shift every prompt.
    """
    ids = batch.input_ids
    out = model(input_ids=ids[:, :-1], attention_mask=batch.attention_mask[:, :-1],
                position_ids=batch.position_ids[:, :-1], use_cache=False)
    logits = out.logits.float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    pad = logp.new_zeros(ids.shape[0], 1)
    logp = torch.cat([pad, logp], dim=1)
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, torch.cat([pad, entropy], dim=1)
