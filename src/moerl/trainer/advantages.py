"""GRPO advantages: each reward normalised within its group of samples for the same prompt."""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, eps: float = 1e-6,
                     scale_by_std: bool = True) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) (Shao et al. 2024); a group whose samples all got the same
    reward carries no signal and gets A = 0. ``scale_by_std=False`` is Dr. GRPO's unbiased variant."""
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for g in group.unique():
        rows = group == g
        r = rewards[rows].float()
        centred = r - r.mean()
        adv[rows] = centred / (r.std(unbiased=False) + eps) if scale_by_std else centred
    return adv
