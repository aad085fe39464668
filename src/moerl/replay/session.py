"""One forward's routing session: record the trainer's native top-k and optionally replay a trace.

R3 replays the rollout engine's trace; R2 replays the trainer's own routing recorded in the
old-logprob pass. Replayed rows take the trace's experts in the trace's column order; rows the
trace marks invalid (padding, the last generated token, uncaptured rows) keep the native top-k.
Replay is keyed by global layer number, never by position, and is idempotent per layer, so an
activation-checkpointing recompute inside the session reuses exactly the same experts.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from moerl.models.routers import MoELayer, intercept_routing
from moerl.replay.trace import RoutingTrace, TraceError, index_dtype


class RoutingSession:
    """What one forward (or forward + backward with recompute) routed, per MoE layer."""

    def __init__(self, batch_shape: tuple[int, int], replay: RoutingTrace | None, strict: bool):
        self.batch_shape = batch_shape
        self.replay_trace = replay
        self.strict = strict
        self.native: dict[int, torch.Tensor] = {}  # layer -> [N, T, k] native top-k (first forward)
        self.used: dict[int, torch.Tensor] = {}  # layer -> [N, T, k] experts actually used
        self.violations = 0  # valid rows where the experts used differ from the replayed trace
        self.layers: list[MoELayer] = []

    def policy(self, layer: MoELayer, native: torch.Tensor, logits: torch.Tensor):
        n, t = self.batch_shape
        if native.shape[0] != n * t:
            raise TraceError(f"layer {layer.layer_number}: MoE call saw {native.shape[0]} tokens, expected "
                             f"{n}x{t} (the session's batch shape)")
        first = layer.layer_number not in self.native
        if first:
            self.native[layer.layer_number] = native.detach().view(n, t, -1).clone()
        if self.replay_trace is None:
            if first:
                self.used[layer.layer_number] = self.native[layer.layer_number]
            return None
        trace_idx, valid = self.replay_trace.layer(layer.layer_number)
        flat_valid = valid.reshape(-1, 1)
        chosen = torch.where(flat_valid, trace_idx.reshape(n * t, -1).to(native.device), native)
        if first:
            self.used[layer.layer_number] = chosen.detach().view(n, t, -1).clone()
        return chosen

    def to_trace(self, valid: torch.Tensor, num_experts: int, top_k: int) -> RoutingTrace:
        """The recorded native routing as a trace (R2 records this in the old-logprob pass)."""
        numbers = tuple(sorted(self.native))
        idx = torch.stack([self.native[k] for k in numbers], dim=2).to(index_dtype(num_experts))
        return RoutingTrace(idx, valid.bool(), numbers, num_experts, top_k)


@contextmanager
def routing_session(model: nn.Module, input_shape: tuple[int, int], replay: RoutingTrace | None = None,
                    strict: bool = False) -> Iterator[RoutingSession]:
    session = RoutingSession(tuple(input_shape), replay, strict)
    with intercept_routing(model, session.policy) as layers:
        session.layers = layers
        if replay is not None:
            first = layers[0]
            replay.check_fits(torch.empty(input_shape), tuple(lay.layer_number for lay in layers),
                              first.num_experts, first.top_k)
        yield session
