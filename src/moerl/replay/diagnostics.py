"""Routing diagnostics logged every step in every arm.

- ``routing_agreement``: per MoE layer, the fraction of valid rows where the trainer's *native*
  top-k is the same set as the rollout's. Computed with replay off too: it is the training-inference
  routing mismatch itself (bf16 engine vs fp32 trainer flipping expert choices).
- violations: under R2/R3, valid rows where the experts the computation received differ from the
  replayed trace (counted by RoutingSession from the innermost experts module's arguments); must be 0.
"""
from __future__ import annotations

import torch

from moerl.replay.trace import RoutingTrace, TraceError


class ReplayViolation(TraceError):
    """Experts used under replay differ from the trace on a valid row (replay.strict=true)."""


def count_violations(received: torch.Tensor, trace_idx: torch.Tensor, valid: torch.Tensor) -> int:
    """Valid rows of [N, T, k] where ``received`` differs from the trace (column order included)."""
    return int(((received.long() != trace_idx.long()).any(-1) & valid).sum())


def same_set(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., k] x [..., k] -> [...] bool: the two rows select the same experts (any order)."""
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


def routing_agreement(native: dict[int, torch.Tensor], trace: RoutingTrace) -> dict[int, float]:
    """Per global layer number: fraction of the trace's valid rows where ``native`` picks the same set.

    ``native`` maps layer -> [N, T, k] (RoutingSession.native). NaN for a layer when no row is valid.
    """
    missing = [x for x in trace.moe_layers if x not in native]
    if missing:
        raise TraceError(f"no native routing recorded for MoE layers {missing} (have {sorted(native)})")
    out = {}
    for number in trace.moe_layers:
        idx, valid = trace.layer(number)
        got = native[number]
        if tuple(got.shape) != tuple(idx.shape):
            raise TraceError(f"layer {number}: native routing {tuple(got.shape)} vs trace {tuple(idx.shape)}")
        valid = valid.to(got.device)
        count = int(valid.sum())
        agree = same_set(got, idx.to(got.device))[valid].sum()
        out[number] = float(agree) / count if count else float("nan")
    return out


def routing_metrics(session, rollout: RoutingTrace | None, replayed: RoutingTrace | None,
                    prefix: str = "routing") -> dict[str, float]:
    """The step's routing metrics from one session (old-logprob or update pass).

    ``rollout``: the engine's trace (agreement with the trainer's native routing); ``replayed``: the
    trace this session replayed (R3: the rollout's; R2: the recording; None: no replay).
    """
    m: dict[str, float] = {}
    if rollout is not None:
        per_layer = routing_agreement(session.native, rollout)
        for number, value in per_layer.items():
            m[f"{prefix}/agreement/layer{number}"] = value
        vals = [v for v in per_layer.values() if v == v]
        m[f"{prefix}/agreement"] = sum(vals) / len(vals) if vals else float("nan")
        m[f"{prefix}/valid_fraction"] = float(rollout.valid.float().mean())
    if replayed is not None:
        # Agreement of what the computation received with the replayed trace: 1.0 unless violations.
        received = routing_agreement(session.received, replayed)
        vals = [v for v in received.values() if v == v]
        m[f"{prefix}/replayed_agreement"] = sum(vals) / len(vals) if vals else float("nan")
        m[f"{prefix}/violations"] = float(session.violations)
        m[f"{prefix}/replayed_rows"] = float(replayed.valid.sum())
    m[f"{prefix}/recompute_mismatches"] = float(session.recompute_mismatches)
    return m
