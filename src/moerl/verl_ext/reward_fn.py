"""math-verify reward for verl (``reward.custom_reward_function.path`` points here).

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` in reward
workers; this forwards to ``moerl.reward.math_reward`` so the scale path scores exactly like the
embedded path (same parsing, same thread-safe timeouts).
"""
from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    from moerl.reward import math_reward

    return float(math_reward(solution_str or "", str(ground_truth)))
