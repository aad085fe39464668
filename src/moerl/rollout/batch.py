"""RolloutBatch: what every rollout engine returns and every trainer consumes (DESIGN.md contract)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from moerl.replay.trace import RoutingTrace


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [N, T] long: prompt left-padded to T0, response right-padded
    attention_mask: torch.Tensor  # [N, T] long/bool: 1 on real tokens
    response_mask: torch.Tensor  # [N, T] bool: sampled tokens up to and including EOS
    rollout_logprobs: torch.Tensor  # [N, T] float32: engine's logprob of each sampled token, 0 elsewhere
    prompt_length: int  # T0: response tokens start at this column
    group: torch.Tensor  # [N] long: which prompt each sample answers (GRPO groups)
    routing: RoutingTrace | None = None
    rewards: torch.Tensor | None = None  # [N] float32
    texts: list[str] = field(default_factory=list)  # decoded responses (for rewards and logs)
    answers: list[str] = field(default_factory=list)  # gold answer per sample

    def __post_init__(self) -> None:
        n, t = self.input_ids.shape
        for name in ("attention_mask", "response_mask", "rollout_logprobs"):
            shape = tuple(getattr(self, name).shape)
            if shape != (n, t):
                raise ValueError(f"RolloutBatch.{name} has shape {shape}, expected {(n, t)}")
        if tuple(self.group.shape) != (n,):
            raise ValueError(f"RolloutBatch.group has shape {tuple(self.group.shape)}, expected ({n},)")
        if self.routing is not None and tuple(self.routing.indices.shape[:2]) != (n, t):
            raise ValueError(f"RolloutBatch.routing covers {tuple(self.routing.indices.shape[:2])}, "
                             f"expected {(n, t)}")

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions as transformers' generate assigns them under left padding: cumsum(mask) - 1."""
        pos = self.attention_mask.long().cumsum(-1) - 1
        return pos.clamp(min=0)

    def select(self, rows: torch.Tensor | slice | list) -> "RolloutBatch":
        """A sub-batch (micro-batch) of samples, with its slice of the routing trace."""
        if isinstance(rows, slice):
            rows = torch.arange(self.size)[rows]
        rows = torch.as_tensor(rows, dtype=torch.long)

        def pick(items: list) -> list:
            return [items[int(i)] for i in rows]

        return replace(
            self,
            input_ids=self.input_ids[rows],
            attention_mask=self.attention_mask[rows],
            response_mask=self.response_mask[rows],
            rollout_logprobs=self.rollout_logprobs[rows],
            group=self.group[rows],
            routing=None if self.routing is None else self.routing[rows],
            rewards=None if self.rewards is None else self.rewards[rows],
            texts=pick(self.texts) if self.texts else [],
            answers=pick(self.answers) if self.answers else [],
        )

    def to(self, device) -> "RolloutBatch":
        """The batch with its tensors (and routing trace) on ``device``; itself when they are already there
        (a trainer on a GPU reads what the engine returned on the CPU)."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            response_mask=self.response_mask.to(device),
            rollout_logprobs=self.rollout_logprobs.to(device),
            group=self.group.to(device),
            routing=None if self.routing is None else self.routing.to(device),
            rewards=None if self.rewards is None else self.rewards.to(device),
        )
