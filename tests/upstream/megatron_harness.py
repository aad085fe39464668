"""A tiny megatron-core GPTModel with verl's router-replay patch applied, on the CPU (gloo) or on one
CUDA device (NCCL), world size 1. ``MOERL_TEST_DEVICE=cuda`` picks the GPU (scripts/gpu_router_replay.sh);
unset or ``cpu``, everything runs on the CPU, as in CI.

megatron-core (0.16.1, 0.19.2) with verl 0.9.1's replay runs on CPU once these CUDA-only lookups are
redirected; none of them is on the routing or replay path, and each is listed here with the upstream line
it works around. On CUDA none is redirected: megatron-core seeds its own CUDA RNG tracker instead.

- ``torch.cuda.current_device()``: ``GlobalMemoryBuffer.get_tensor`` (megatron/core/utils.py, the
  attention's matmul buffer) and ``TopKRouter.gating`` (moe/router.py, moves a CPU router weight
  "to GPU") allocate on it -> the CPU device.
- ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``: activation recompute
  (``CheckpointFunction``) saves and restores the CUDA RNG -> no-ops (no CUDA RNG exists; dropout is 0).
- the CUDA RNG tracker's ``model-parallel-rng`` state, which ``model_parallel_cuda_manual_seed`` would
  create with ``torch.cuda.manual_seed`` -> an empty placeholder (dropout is 0, nothing is drawn).
- verl's ``router_replay_utils.device_name``: verl's platform detection knows CUDA/NPU/ROCm only and
  answers ``"cuda"``, where the route tensors are moved before replay -> ``"cpu"``.

On both devices, where Transformer Engine is absent: ``moe_utils.te_general_gemm`` is imported only when
Transformer Engine is present, yet read unconditionally by ``RouterGatingLinearFunction`` (moe_utils.py,
``NameError: name 'te_general_gemm' is not defined`` without TE) -> ``None``, the value its own fallback
branch expects.
"""
from __future__ import annotations

import os
import socket
from contextlib import contextmanager

import pytest
import torch

NUM_LAYERS = 4
MOE_LAYER_FREQ = [0, 1, 1, 1]  # layer 0 dense, as DeepSeek-V3 / Kimi-K2 / Moonlight (first_k_dense_replace)
NUM_EXPERTS, TOP_K, VOCAB = 8, 2, 64
DEVICE_ENV = "MOERL_TEST_DEVICE"


def requested_device() -> torch.device:
    """The device ``MOERL_TEST_DEVICE`` asks for (``cpu`` when unset). A request for CUDA where torch sees
    none is refused, never run on the CPU instead: a GPU check must not pass without a GPU."""
    name = os.environ.get(DEVICE_ENV, "").strip().lower() or "cpu"
    if name not in ("cpu", "cuda"):
        raise RuntimeError(f"{DEVICE_ENV}={name!r}: expected 'cpu' or 'cuda'")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"{DEVICE_ENV}=cuda but torch {torch.__version__} sees no CUDA device "
                           f"(torch.cuda.is_available() is False); unset it or set {DEVICE_ENV}=cpu")
    return torch.device(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def megatron_on(device: torch.device):
    """A world-size-1 process group (gloo on the CPU, NCCL on CUDA) + megatron parallel state
    (TP=PP=EP=CP=1); on the CPU also the redirections above."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import verl.utils.megatron.router_replay_utils as verl_replay_utils

    on_cuda = device.type == "cuda"
    mp = pytest.MonkeyPatch()
    owns_group = not dist.is_initialized()
    if on_cuda:
        torch.cuda.set_device(device.index or 0)
    if owns_group:
        dist.init_process_group("nccl" if on_cuda else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    try:
        if not hasattr(moe_utils, "te_general_gemm"):
            mp.setattr(moe_utils, "te_general_gemm", None, raising=False)
        if on_cuda:
            model_parallel_cuda_manual_seed(0)
        else:
            mp.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
            mp.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.empty(0, dtype=torch.uint8))
            mp.setattr(mrandom, "_set_cuda_rng_state", lambda *a, **k: None)
            mp.setattr(verl_replay_utils, "device_name", "cpu")
            get_cuda_rng_tracker().states_["model-parallel-rng"] = torch.empty(0, dtype=torch.uint8)
        yield
    finally:
        mp.undo()
        get_cuda_rng_tracker().reset()
        mpu.destroy_model_parallel()
        if owns_group:
            dist.destroy_process_group()


def megatron_on_cpu():
    return megatron_on(torch.device("cpu"))


def build_replay_model(seed: int = 0, device: torch.device = torch.device("cpu")):
    """verl's ``apply_router_replay_patch()`` then a 4-layer MoE GPTModel (local spec, allgather
    dispatcher, full activation recompute of every layer) with ``enable_routing_replay=True``:
    exactly how verl's MegatronEngine builds its actor when ``router_replay.mode`` is R2/R3. Initialised
    on the CPU, then moved to ``device``: the same weights on every device."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    apply_router_replay_patch()  # clears RouterReplay.router_instances, patches TopKRouter/TransformerConfig
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=TOP_K, moe_ffn_hidden_size=16, moe_layer_freq=MOE_LAYER_FREQ,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", add_bias_linear=False,
        attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        init_method_std=0.5, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
        enable_routing_replay=True)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=128)
    return model.to(device), cfg


def packed_causal_mask(lengths, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    """Block-diagonal causal mask over the packed (THD) row, True = masked (megatron's convention):
    what TE's THD attention does with cu_seqlens, written as a dense mask for the local attention."""
    total = sum(lengths)
    allowed = torch.zeros(total, total, dtype=torch.bool)
    start = 0
    for n in lengths:
        allowed[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        start += n
    return (~allowed)[None, None].to(device)


def packed_position_ids(lengths, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).to(device)
