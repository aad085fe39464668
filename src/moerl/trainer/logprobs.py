"""The trainer's view of a RolloutBatch: per-token logprobs (and entropy) of the sampled tokens."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from moerl.replay.session import RoutingSession, routing_session
from moerl.replay.trace import RoutingTrace
from moerl.rollout.batch import RolloutBatch


def forward_logprobs(model: nn.Module, batch: RolloutBatch, temperature: float = 1.0,
                     with_entropy: bool = False):
    """Teacher-forced forward over ``input_ids[:, :-1]`` with the engine's position ids.

    Returns ``logp [N, T]`` where ``logp[:, t]`` is the log-probability of token t (column 0 is 0),
    aligned with ``batch.rollout_logprobs``; and optionally the entropy [N, T] of the same
    distributions. Logits are divided by the sampling temperature, as the engine's were. Positions must be passed explicitly: under left padding `generate` numbers
    tokens by cumsum(attention_mask) - 1, and the default arange would shift every prompt.
    """
    device = next(model.parameters()).device  # a GPU trainer: the batch goes there, its results come back
    ids = batch.input_ids.to(device)
    out = model(input_ids=ids[:, :-1], attention_mask=batch.attention_mask[:, :-1].to(device),
                position_ids=batch.position_ids[:, :-1].to(device), use_cache=False)
    logits = out.logits.float() / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    pad = logp.new_zeros(ids.shape[0], 1)
    logp = torch.cat([pad, logp], dim=1).cpu()  # differentiable: the loss is computed beside the batch
    if not with_entropy:
        return logp, None
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, torch.cat([pad, entropy], dim=1).cpu()


# The trainer's forward reads input_ids[:, :-1]: the last sampled token is never an input (no
# engine forwards it either), so routing covers the first T-1 positions of a batch.
@contextmanager
def trainer_routing(model: nn.Module, batch: RolloutBatch, replay: RoutingTrace | None = None,
                    strict: bool = False, layer_mapping: str = "layer_number") -> Iterator[RoutingSession]:
    """The routing session of one ``forward_logprobs`` of ``batch`` (and its backward): records the
    trainer's experts and, with ``replay`` (a trace over the batch's T positions), replays them
    (``layer_mapping``: see moerl.config.ReplayConfig; ``position`` reproduces a bug)."""
    n, t = batch.input_ids.shape
    trace = None if replay is None else replay.truncate_tokens(t - 1)
    with routing_session(model, (n, t - 1), replay=trace, strict=strict, layer_mapping=layer_mapping) as session:
        yield session


def session_trace(session: RoutingSession, batch: RolloutBatch) -> RoutingTrace:
    """The experts the trainer's routers chose natively in ``trainer_routing`` as a trace over its
    T-1 forward positions; padding is invalid."""
    return session.to_trace(batch.attention_mask[:, :-1].bool())
