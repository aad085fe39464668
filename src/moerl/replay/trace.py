"""RoutingTrace: which experts each token was routed to, per MoE layer, as the rollout engine saw it.

Layers are identified by their *global* layer number (``moe_layers``), never by position:
DeepSeek-V3, Kimi-K2 and Moonlight start with dense layers, and mapping an engine's per-layer
output by position onto the trainer's MoE layers is the bug that broke R3 for those models.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def index_dtype(num_experts: int) -> torch.dtype:
    """Smallest integer type holding expert ids 0..E-1 (uint8 up to 256 experts, int16 above)."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


class TraceError(ValueError):
    """A trace that does not fit the batch or model it is meant for; names sample and mismatch."""


@dataclass
class RoutingTrace:
    indices: torch.Tensor  # [N, T, L_moe, k], index_dtype(num_experts)
    valid: torch.Tensor  # [N, T] bool: False on padding, the last generated token, uncaptured rows
    moe_layers: tuple[int, ...]  # global layer number of each of the L_moe columns
    num_experts: int
    top_k: int
    # Batch-level index of each row when this trace is a slice (a micro-batch) of a batch's trace:
    # errors name the sample of the batch, not its position inside the micro-batch.
    rows: torch.Tensor | None = None
    # Rows an engine reported with a repeated expert id, turned invalid (native routing) by the parser.
    duplicate_rows: int = 0

    def __post_init__(self) -> None:
        self.moe_layers = tuple(int(x) for x in self.moe_layers)
        self.validate()

    @classmethod
    def _derived(cls, indices: torch.Tensor, valid: torch.Tensor, moe_layers: tuple[int, ...], num_experts: int,
                 top_k: int, rows: torch.Tensor | None = None) -> "RoutingTrace":
        """A trace made of whole validated traces (a concatenation, a copy to another device, invalid
        rows zeroed): every valid row it holds had its expert ids checked when its source was built, so
        only its shapes are checked again."""
        trace = cls.__new__(cls)
        trace.indices, trace.valid, trace.moe_layers = indices, valid, tuple(moe_layers)
        trace.num_experts, trace.top_k, trace.rows, trace.duplicate_rows = num_experts, top_k, rows, 0
        trace.check_structure()
        return trace

    def sample(self, i: int) -> int:
        """Batch-level index of row ``i``."""
        return int(i) if self.rows is None else int(self.rows[int(i)])

    # -- checks ---------------------------------------------------------------------------------
    def validate(self) -> None:
        """Shapes, dtype and layer list, then the expert ids of every valid row (range, no repeats)."""
        self.check_structure()
        self.check_expert_ids()

    def check_structure(self) -> None:
        idx, valid = self.indices, self.valid
        if idx.dim() != 4:
            raise TraceError(f"routing indices must be [N, T, L_moe, k], got shape {tuple(idx.shape)}")
        n, t, layers, k = idx.shape
        if tuple(valid.shape) != (n, t):
            raise TraceError(f"routing valid mask has shape {tuple(valid.shape)}, expected {(n, t)}")
        if valid.dtype != torch.bool:
            raise TraceError(f"routing valid mask must be bool, got {valid.dtype}")
        if layers != len(self.moe_layers):
            raise TraceError(f"trace has {layers} layer columns but moe_layers lists {len(self.moe_layers)}")
        if len(set(self.moe_layers)) != len(self.moe_layers):
            raise TraceError(f"moe_layers has repeated layer numbers: {self.moe_layers}")
        if k != self.top_k:
            raise TraceError(f"trace top-k is {k} but top_k={self.top_k}")
        if idx.dtype != index_dtype(self.num_experts):
            raise TraceError(f"indices dtype {idx.dtype}, expected {index_dtype(self.num_experts)} "
                             f"for {self.num_experts} experts")

    def check_expert_ids(self) -> None:
        idx, valid = self.indices, self.valid
        if valid.any():
            used = idx[valid].long()
            bad = (used < 0) | (used >= self.num_experts)
            if bad.any():
                row = bad.flatten(1).any(1).nonzero()[0, 0]
                sample, token = (int(x) for x in valid.nonzero()[row])
                col = int(bad[row].any(-1).nonzero()[0, 0])
                raise TraceError(f"sample {self.sample(sample)}, token {token}, layer {self.moe_layers[col]}: "
                                 f"expert id "
                                 f"{int(used[row, col][bad[row, col]][0])} out of range [0, {self.num_experts})")
            srt = used.sort(dim=-1).values
            dup = (srt[..., 1:] == srt[..., :-1]).flatten(1).any(1)
            if dup.any():
                row = valid.nonzero()[dup.nonzero()[0, 0]]
                col = int((srt[dup.nonzero()[0, 0], :, 1:] == srt[dup.nonzero()[0, 0], :, :-1]).any(-1)
                          .nonzero()[0, 0])
                raise TraceError(f"sample {self.sample(row[0])}, token {int(row[1])}, layer {self.moe_layers[col]}: "
                                 f"duplicate experts in a valid row "
                                 f"{idx[int(row[0]), int(row[1]), col].tolist()}")

    def check_fits(self, input_ids: torch.Tensor, moe_layers: tuple[int, ...], num_experts: int,
                   top_k: int) -> None:
        """Raise if this trace cannot be replayed on ``input_ids`` through a model with these layers."""
        if tuple(self.indices.shape[:2]) != tuple(input_ids.shape):
            raise TraceError(f"trace covers {tuple(self.indices.shape[:2])} (samples, tokens) but the batch "
                             f"is {tuple(input_ids.shape)}")
        if tuple(moe_layers) != self.moe_layers:
            raise TraceError(f"trace MoE layers {self.moe_layers} != model MoE layers {tuple(moe_layers)}")
        if num_experts != self.num_experts or top_k != self.top_k:
            raise TraceError(f"trace is for {self.num_experts} experts top-{self.top_k}, model has "
                             f"{num_experts} experts top-{top_k}")

    # -- views ------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.indices.shape)

    def __getitem__(self, rows) -> "RoutingTrace":
        """Slice samples (a micro-batch): ``trace[idx]`` with a slice, list or index tensor."""
        batch_rows = torch.arange(self.indices.shape[0]) if self.rows is None else self.rows
        # Checked in full (expert ids too): a slice costs ~0.1 % of a step to check, and a trace altered
        # after it was built is caught at the micro-batch that holds the altered row, named by its sample.
        return RoutingTrace(self.indices[rows], self.valid[rows], self.moe_layers, self.num_experts, self.top_k,
                            batch_rows[rows])

    def truncate_tokens(self, length: int) -> "RoutingTrace":
        """First ``length`` token positions (the trainer forwards ``input_ids[:, :-1]``)."""
        return RoutingTrace(self.indices[:, :length], self.valid[:, :length], self.moe_layers,
                            self.num_experts, self.top_k, self.rows)

    @classmethod
    def cat(cls, traces: "list[RoutingTrace]") -> "RoutingTrace":
        """Concatenate micro-batch traces along samples (R2 records the old-logprob pass per micro-batch)."""
        if not traces:
            raise TraceError("cannot concatenate an empty list of traces")
        first = traces[0]
        for i, tr in enumerate(traces[1:], start=1):
            if (tr.moe_layers, tr.num_experts, tr.top_k) != (first.moe_layers, first.num_experts, first.top_k):
                raise TraceError(f"trace {i} is for layers {tr.moe_layers}, {tr.num_experts} experts top-{tr.top_k}; "
                                 f"trace 0 for {first.moe_layers}, {first.num_experts} experts top-{first.top_k}")
            if tr.indices.shape[1] != first.indices.shape[1]:
                raise TraceError(f"trace {i} has {tr.indices.shape[1]} token positions, trace 0 has "
                                 f"{first.indices.shape[1]}")
        rows = torch.cat([t.rows for t in traces]) if all(t.rows is not None for t in traces) else None
        return cls._derived(torch.cat([t.indices for t in traces]), torch.cat([t.valid for t in traces]),
                            first.moe_layers, first.num_experts, first.top_k, rows)

    def to(self, device) -> "RoutingTrace":
        return RoutingTrace._derived(self.indices.to(device), self.valid.to(device), self.moe_layers,
                                     self.num_experts, self.top_k, self.rows)

    def zero_invalid(self) -> "RoutingTrace":
        """Same routes with invalid rows set to expert 0 (their content is never used; packing drops it)."""
        idx = self.indices.masked_fill(~self.valid[:, :, None, None], 0)
        return RoutingTrace._derived(idx, self.valid, self.moe_layers, self.num_experts, self.top_k, self.rows)

    def column(self, layer_number: int) -> int:
        """Which of the L_moe columns holds global layer ``layer_number``."""
        try:
            return self.moe_layers.index(layer_number)
        except ValueError:
            raise TraceError(f"layer {layer_number} is not an MoE layer of this trace {self.moe_layers}") from None

    def layer(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices [N, T, k] as int64, valid [N, T]) for one global layer number."""
        return self.indices[:, :, self.column(layer_number)].long(), self.valid

    @property
    def bytes_per_token(self) -> int:
        """Unpacked size of one token's routes (all MoE layers)."""
        return len(self.moe_layers) * self.top_k * self.indices.element_size()
