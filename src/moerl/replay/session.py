"""One forward's routing session: record the trainer's native top-k and optionally replay a trace.

R3 replays the rollout engine's trace; R2 replays the trainer's own routing recorded in the
old-logprob pass. Replayed rows take the trace's experts in the trace's column order; rows the
trace marks invalid (padding, the last generated token, uncaptured rows) keep the native top-k.
Replay is keyed by global layer number, never by position.

A session covers one forward *and its backward*: under activation checkpointing the MoE blocks run
again during backward, and every call after the first for a layer reuses exactly the experts the
first call used (what Megatron's REPLAY_BACKWARD and slime's backward cursor do). So keep the
backward inside the ``with`` block.

The experts the computation actually received are read by a forward hook on the innermost experts
module (below any PEFT wrapper), which sees the arguments after every pre-hook ran, ours and anyone
else's; violations are counted against the trace from those, so a wrong layer mapping or a foreign
hook that changes the indices is caught, not assumed away.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from moerl.models.routers import MoELayer, intercept_routing
from moerl.replay.diagnostics import ReplayViolation, count_violations
from moerl.replay.trace import RoutingTrace, TraceError, index_dtype


def innermost_experts(block: nn.Module) -> nn.Module:
    """The module that computes the experts: ``block.experts`` below any PEFT ``base_layer`` chain."""
    module = block.experts
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        module = module.base_layer
    return module


class RoutingSession:
    """What one forward (plus its checkpoint recompute) routed, per MoE layer (global layer number)."""

    def __init__(self, batch_shape: tuple[int, int], replay: RoutingTrace | None, strict: bool,
                 layer_mapping: str = "layer_number"):
        if layer_mapping not in ("layer_number", "position"):
            raise ValueError(f"replay.layer_mapping: unknown mapping '{layer_mapping}' (layer_number or position)")
        self.batch_shape = batch_shape
        self.replay_trace = replay
        self.strict = strict
        self.layer_mapping = layer_mapping
        self.native: dict[int, torch.Tensor] = {}  # layer -> [N, T, k] native top-k (first call)
        self.used: dict[int, torch.Tensor] = {}  # layer -> [N, T, k] experts the session chose (first call)
        self.received: dict[int, torch.Tensor] = {}  # layer -> [N, T, k] experts the module got (first call)
        self.calls: dict[int, int] = {}  # layer -> MoE calls seen (2 per layer under checkpointing)
        self.violations = 0  # valid (row, layer)s whose first-call experts differ from the trace
        self.layer_violations: dict[int, int] = {}
        self.recompute_mismatches = 0  # rows where a recompute received other experts than the first call
        self.layers: list[MoELayer] = []
        # The replayed trace as the policy and the check read it, built once per session (see
        # ``replay_columns``): all layers in int64, the valid mask, and per layer the views of them.
        self._replay_long: torch.Tensor | None = None
        self._replay_valid: tuple[torch.Tensor, torch.Tensor] | None = None
        self._replay_columns: dict[int, tuple[torch.Tensor, ...]] = {}

    # -- the routing policy (runs in the experts pre-hook) -----------------------------------------
    def policy(self, layer: MoELayer, native: torch.Tensor, logits: torch.Tensor):
        n, t = self.batch_shape
        number = layer.layer_number
        if native.shape[0] != n * t:
            raise TraceError(f"layer {number}: MoE call saw {native.shape[0]} tokens, expected "
                             f"{n}x{t} (the session's batch shape)")
        self.calls[number] = self.calls.get(number, 0) + 1
        if self.calls[number] > 1:
            # Recompute (activation checkpointing): the first call's experts, whatever native says now,
            # and by the same code path. A replaying first call substituted (index, weights), so the
            # recompute substitutes too, even when the recomputed native top-k happens to equal it:
            # returning None there would skip the weight recomputation, save fewer tensors than the
            # first forward did, and torch.utils.checkpoint raises CheckpointError.
            first = self.used[number].view(n * t, -1).to(native.device)
            if self.replay_trace is None and torch.equal(first, native):
                return None  # the first call kept native routing too: same path
            return first
        self.native[number] = native.detach().view(n, t, -1).clone()
        if self.replay_trace is None:
            self.used[number] = self.native[number]
            return None
        _, _, flat_idx, flat_valid = self.replay_columns(number, native.device)
        chosen = torch.where(flat_valid, flat_idx, native)
        self.used[number] = chosen.detach().view(n, t, -1).clone()
        return chosen

    def replay_columns(self, number: int, device) -> tuple[torch.Tensor, ...]:
        """``replayed(number)`` on ``device`` as (indices [N, T, k], valid [N, T], indices [N*T, k],
        valid [N*T, 1]), built on the layer's first call and kept: the check reads it again.

        Under the layer-number mapping the whole trace is converted to int64 once, in one contiguous
        pass, and each layer's indices are a view of it: converting layer by layer would read a strided
        column per layer, several times slower per element."""
        cols = self._replay_columns.get(number)
        if cols is None:
            n, t = self.batch_shape
            trace = self.replay_trace
            if self.layer_mapping == "layer_number":
                if self._replay_long is None:
                    self._replay_long = trace.indices.to(device=device, dtype=torch.long)
                    valid = trace.valid.to(device)
                    self._replay_valid = (valid, valid.reshape(n * t, 1))
                idx = self._replay_long[:, :, trace.column(number)]  # = trace.layer(number)[0]
                valid, flat_valid = self._replay_valid
            else:
                idx, valid = (x.to(device) for x in self.replayed(number))
                flat_valid = valid.reshape(n * t, 1)
            cols = self._replay_columns[number] = (idx, valid, idx.reshape(n * t, -1), flat_valid)
        return cols

    def replayed(self, number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices [N, T, k], valid [N, T]) this session feeds to MoE layer ``number``.

        ``layer_number`` (always, outside a bug reproduction): the trace's column for that global layer.
        ``position`` reproduces the bug that broke R3 on models with dense first layers: the i-th MoE
        router read the engine's column i, i.e. global layer i, which for DeepSeek-V3-style models is a
        dense layer (zero-filled by vLLM: expert 0 k times) for the first MoE layers and another layer's
        routes for the rest (old verl's per-router slicing, fixed by verl PR 5037 / Mind Lab's R3 fix).
        Violations are counted against this, so the bug shows ``violations=0`` as it did."""
        trace = self.replay_trace
        if self.layer_mapping == "layer_number":
            return trace.layer(number)
        source = trace.moe_layers.index(number)  # this router's position among the MoE layers
        if source in trace.moe_layers:
            return trace.layer(source)
        return torch.zeros_like(trace.layer(number)[0]), trace.valid  # a dense layer's zero-filled column

    # -- the check (runs in a forward hook on the innermost experts module) --------------------------
    def check(self, number: int, received: torch.Tensor) -> None:
        n, t = self.batch_shape
        got = received.detach().long().view(n, t, -1)
        if number in self.received:
            # A recompute: compared with the first call, not with the trace again, so each valid
            # (row, layer) is checked against the trace exactly once (what ``checked_rows`` counts).
            self.recompute_mismatches += int((got != self.received[number].to(got.device)).any(-1).sum())
            return
        self.received[number] = got.clone()
        if self.replay_trace is None:
            return
        trace_idx, valid, _, _ = self.replay_columns(number, got.device)
        bad = count_violations(got, trace_idx, valid)
        if bad:
            self.violations += bad
            self.layer_violations[number] = self.layer_violations.get(number, 0) + bad
            if self.strict:
                mism = ((got != trace_idx).any(-1) & valid).nonzero()[0]
                s, tok = int(mism[0]), int(mism[1])
                raise ReplayViolation(
                    f"layer {number}, sample {self.replay_trace.sample(s)}, token {tok}: "
                    f"experts received {got[s, tok].tolist()} but the "
                    f"replayed trace says {trace_idx[s, tok].tolist()} ({bad} rows in this call)")

    # -- results ------------------------------------------------------------------------------------
    def to_trace(self, valid: torch.Tensor, num_experts: int | None = None, top_k: int | None = None) -> RoutingTrace:
        """The recorded native routing as a trace (R2 records this in the old-logprob pass)."""
        if not self.native:
            raise TraceError("the session recorded no MoE call (was the forward run inside it?)")
        num_experts = self.layers[0].num_experts if num_experts is None else num_experts
        top_k = self.layers[0].top_k if top_k is None else top_k
        numbers = tuple(sorted(self.native))
        idx = torch.stack([self.native[k] for k in numbers], dim=2).to(index_dtype(num_experts))
        return RoutingTrace(idx.cpu(), valid.bool().cpu(), numbers, num_experts, top_k)

    def stacked(self, which: str = "received") -> torch.Tensor:
        """[N, T, L_moe, k] of ``native``, ``used`` or ``received`` in global-layer order."""
        table = getattr(self, which)
        return torch.stack([table[k] for k in sorted(table)], dim=2)


@contextmanager
def routing_session(model: nn.Module, input_shape: tuple[int, int], replay: RoutingTrace | None = None,
                    strict: bool = False, layer_mapping: str = "layer_number") -> Iterator[RoutingSession]:
    """Hooks for one forward (+ backward) on a batch of ``input_shape`` = (N, T).

    ``replay``: a trace to replay (R3: the rollout's; R2: ``to_trace`` of the old-logprob session),
    already sliced to this micro-batch and to the forwarded token columns. ``strict`` raises
    ReplayViolation on the first valid row whose received experts differ from the trace.
    ``layer_mapping="position"`` reproduces the R3 layer-mapping bug (``RoutingSession.replayed``);
    never use it for anything else.
    """
    session = RoutingSession(tuple(int(x) for x in input_shape), replay, strict, layer_mapping)
    # Every row the session substitutes holds distinct experts (a RoutingTrace's valid rows are checked
    # for repeats when it is built; other rows keep the native top-k), except under the position
    # mapping, whose zero-filled dense-layer columns name expert 0 k times.
    with intercept_routing(model, session.policy, may_repeat=layer_mapping == "position") as layers:
        session.layers = layers
        if replay is not None:
            first = layers[0]
            replay.check_fits(torch.empty(tuple(input_shape)), tuple(lay.layer_number for lay in layers),
                              first.num_experts, first.top_k)
        handles = []
        for layer in layers:
            watch = getattr(layer.family, "watch_received", None)
            if watch is not None:  # a family whose block hands its experts no top-k (Granite-MoE)
                handles.append(watch(layer, lambda index, number=layer.layer_number: session.check(number, index)))
                continue

            def received(module, args, kwargs, output, number=layer.layer_number):
                index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
                if index is None:
                    raise TraceError(f"layer {number}: cannot read the experts' top-k index argument")
                session.check(number, index)

            handles.append(innermost_experts(layer.block).register_forward_hook(received, with_kwargs=True))
        try:
            yield session
        finally:
            for h in handles:
                h.remove()
