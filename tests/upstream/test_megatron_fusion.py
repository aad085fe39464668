"""Gradient-accumulation fusion without APEX, on megatron-core itself (CPU, gloo, world size 1).

Megatron-Bridge's DeepSeek-V3 and Kimi bridges force ``gradient_accumulation_fusion=True`` and its GPT
provider turns it on whenever Transformer Engine imports; verl never overrides it. megatron-core then
needs APEX's ``fused_weight_gradient_mlp_cuda`` and, without it, refuses in
``ColumnParallelLinear.__init__`` (megatron/core/tensor_parallel/layers.py): the output layer and every
LoRA adapter linear are built there, so such a run stops at model construction. The cluster image
installs no APEX, which is why the scale experiments turn fusion off. Runs on whichever megatron-core
the environment has: 0.16.1 in the main venv, the cluster's 0.19.2 in the upstream-mcore venv
(``scripts/test_upstream.sh mcore``).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (requirements/cpu.txt)")
pytest.importorskip("verl.utils.megatron.router_replay_utils", reason="verl is not installed")

from megatron_harness import megatron_on_cpu  # noqa: E402


@pytest.fixture(scope="module")
def megatron():
    with megatron_on_cpu():
        yield


def _column_parallel_linear(fusion: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.float32, gradient_accumulation_fusion=fusion)
    return ColumnParallelLinear(32, 64, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                                gather_output=False)


def test_fusion_without_apex_refuses_at_construction(megatron):
    assert importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None, "APEX's extension is installed here"
    with pytest.raises(RuntimeError, match="gradient_accumulation_fusion set to True but the custom CUDA "
                                           "extension fused_weight_gradient_mlp_cuda module is not found"):
        _column_parallel_linear(fusion=True)


def test_fusion_off_builds_and_runs(megatron):
    layer = _column_parallel_linear(fusion=False)
    out, _ = layer(torch.randn(3, 2, 32))
    assert out.shape == (3, 2, 64)
