"""transformers' grouped-experts forward without the work a single-process model never needs.

``grouped_mm_experts_forward`` (transformers.integrations.moe) serves expert parallelism too: it masks
"sentinel" rows of tokens routed to another rank, before and after the expert products, and puts the
token-expert pairs back in token order with a gather whose backward is an accumulating scatter. Here every
expert is local, so the masks never mask anything, and the reordering is a permutation. This forward runs
the same products, activation, weighting and reduction in the same order, drops the masks and reorders
with ``index_copy`` (whose backward is a plain gather): the same numbers, forward and backward, bit for
bit (``tests/models/test_experts.py``), in about a tenth less time per trainer step at experiment 07's sizes.

Registered with transformers' experts interface as ``moerl_grouped_mm``; a model configured with
``experts_implementation: grouped_mm`` is built with it (moerl.models.presets).
"""
from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _grouped_linear

NAME = "moerl_grouped_mm"


def local_grouped_mm_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """``grouped_mm_experts_forward`` for experts that are all on this process (no sentinel rows)."""
    num_top_k = top_k_index.size(-1)
    num_tokens = hidden_states.size(0)
    hidden_dim = hidden_states.size(-1)
    sample_weights = top_k_weights.reshape(-1)
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids)
    selected_hidden_states_g = hidden_states[perm // num_top_k]
    sample_weights_g = sample_weights[perm]
    histc_input = expert_ids_g.float() if hidden_states.device.type in ("cpu", "mps") else expert_ids_g.int()
    tokens_per_expert = torch.histc(histc_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
    if self.has_gate:
        weights, biases = self.gate_up_proj, (self.gate_up_proj_bias[expert_ids_g] if self.has_bias else None)
    else:
        weights, biases = self.up_proj, (self.up_proj_bias[expert_ids_g] if self.has_bias else None)
    proj_out = _grouped_linear(selected_hidden_states_g, weights, offsets, bias=biases,
                               is_transposed=self.is_transposed)
    proj_out = self._apply_gate(proj_out) if self.has_gate else self.act_fn(proj_out)
    biases = self.down_proj_bias[expert_ids_g] if self.has_bias else None
    proj_out = _grouped_linear(proj_out, self.down_proj, offsets, bias=biases, is_transposed=self.is_transposed)
    weighted_out = proj_out * sample_weights_g.unsqueeze(-1)
    # Back to token order: row perm[i] of the result is row i (transformers: weighted_out[inverse of perm]).
    weighted_out = weighted_out.new_empty(weighted_out.shape).index_copy(0, perm, weighted_out)
    return weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden_states.dtype)


def implementation(requested: str) -> str:
    """The experts implementation a model is built with for the configured one."""
    return NAME if requested == "grouped_mm" else requested


ALL_EXPERTS_FUNCTIONS.register(NAME, local_grouped_mm_experts_forward)
