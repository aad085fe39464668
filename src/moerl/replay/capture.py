"""Routing capture inside the embedded engine (transformers ``generate`` with a KV cache).

``generate`` runs one prefill call over the left-padded prompt ([N, T0] tokens) and then one call per
decoded token ([N, 1]); the last sampled token is never fed back, exactly as in vLLM/SGLang. The
recorder keeps each MoE call's native top-k (read in the experts pre-hook, nothing replaced) and
lays the calls side by side, so column c of the trace is the routing of the token at batch column c.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from moerl.models.routers import intercept_routing
from moerl.replay.trace import RoutingTrace, TraceError, index_dtype


class GenerationRecorder:
    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.calls: dict[int, list[torch.Tensor]] = {}  # layer -> per call [N, t_call, k]
        self.num_experts = self.top_k = 0

    def policy(self, layer, native: torch.Tensor, logits: torch.Tensor | None):
        if native.shape[0] % self.batch_size:
            raise TraceError(f"layer {layer.layer_number}: MoE call saw {native.shape[0]} tokens, not a multiple "
                             f"of the batch size {self.batch_size}")
        self.num_experts, self.top_k = layer.num_experts, layer.top_k
        self.calls.setdefault(layer.layer_number, []).append(
            native.detach().view(self.batch_size, -1, native.shape[-1]).to(index_dtype(layer.num_experts)))
        return None

    def extend(self, routes: list[torch.Tensor]) -> None:
        """Append calls made outside the hooks (moerl's decode loop): one [N, t, k] tensor per MoE layer,
        in layer order."""
        numbers = sorted(self.calls)
        if len(routes) != len(numbers):
            raise TraceError(f"{len(routes)} layers of routes for {len(numbers)} recorded MoE layers")
        for number, route in zip(numbers, routes):
            self.calls[number].append(route.view(self.batch_size, -1, route.shape[-1]).to(index_dtype(self.num_experts)))

    def to_trace(self, attention_mask: torch.Tensor) -> RoutingTrace:
        """Trace over the batch's columns; valid on real tokens except each sample's last one.

        ``attention_mask`` [N, T]: 1 on real prompt and response tokens (post-EOS padding is 0).
        """
        if not self.calls:
            raise TraceError("no MoE call was recorded (was generate run inside the recorder?)")
        n, t = attention_mask.shape
        if n != self.batch_size:
            raise TraceError(f"attention_mask has {n} samples, the recorder saw {self.batch_size}")
        numbers = tuple(sorted(self.calls))
        per_layer = [torch.cat(self.calls[x], dim=1) for x in numbers]  # [N, T0 + steps, k]
        recorded = per_layer[0].shape[1]
        if any(p.shape[1] != recorded for p in per_layer):
            raise TraceError(f"layers recorded different token counts: {[p.shape[1] for p in per_layer]}")
        if recorded > t:
            raise TraceError(f"recorded {recorded} token columns but the batch has only {t}")
        idx = torch.zeros(n, t, len(numbers), self.top_k, dtype=index_dtype(self.num_experts))
        idx[:, :recorded] = torch.stack(per_layer, dim=2).cpu()
        mask = attention_mask.bool().cpu()
        last = t - 1 - mask.flip(-1).int().argmax(-1)  # each sample's last real token
        valid = mask.clone()
        valid[torch.arange(n), last] = False
        valid[:, recorded:] = False
        return RoutingTrace(idx, valid, numbers, self.num_experts, self.top_k)


@contextmanager
def record_generation(model: nn.Module, batch_size: int) -> Iterator[GenerationRecorder]:
    """``with record_generation(model, N) as rec: out = model.generate(...)``; then ``rec.to_trace(mask)``."""
    recorder = GenerationRecorder(batch_size)
    with intercept_routing(model, recorder.policy, read_only=True):
        yield recorder
