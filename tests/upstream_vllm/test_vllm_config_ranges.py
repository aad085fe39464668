"""The launcher's vLLM value ranges against vLLM's own config classes, where vLLM imports.

The main environment has no vLLM, so ``moerl.verl_ext.constraints`` encodes vLLM 0.24.0's
``CacheConfig.gpu_memory_utilization`` range with its citation; here (vLLM's CPU build) the
launcher reads it from vLLM's class, and the encoded values must agree with what vLLM declares.
"""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_upstream.sh vllm builds its venv")

from moerl.verl_ext import constraints  # noqa: E402


def test_gpu_memory_utilization_range_is_read_from_vllm_and_matches_the_encoded_one():
    lo, hi, src = constraints.vllm_gpu_memory_utilization_range()
    assert "(read)" in src
    assert (lo, hi) == constraints.VLLM_GPU_MEMORY_UTILIZATION


def test_vllm_refuses_what_the_rule_refuses():
    from vllm.config.cache import CacheConfig

    for bad in (0.0, 1.5):
        with pytest.raises(Exception):
            CacheConfig(gpu_memory_utilization=bad)
    assert CacheConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
