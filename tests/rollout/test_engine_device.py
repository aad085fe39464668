"""Device plumbing of the engine and the batch: what a GPU run relies on, checked where a CPU can."""
import torch

from moerl.config import RolloutConfig
from moerl.models.presets import build_model
from moerl.rollout.decode import unsupported
from moerl.rollout.hf import HFEngine
from tests_helpers import lora_policy


def test_batch_moves_every_tensor_and_its_trace(tokenizer):
    engine = HFEngine(lora_policy(tokenizer), tokenizer, RolloutConfig(dtype="bf16", max_new_tokens=4))
    batch = engine.generate(["1+2*3=", "45+6*7="], ["7", "87"], group_size=2, seed=0)
    assert engine.device.type == "cpu" and batch.input_ids.device.type == "cpu"
    assert batch.to("cpu") is batch  # already there: the same object, nothing copied
    batch.rewards = torch.ones(batch.size)
    moved = batch.to("meta")
    for name in ("input_ids", "attention_mask", "response_mask", "rollout_logprobs", "group", "rewards"):
        assert getattr(moved, name).device.type == "meta", name
    assert moved.routing.indices.device.type == "meta" and moved.routing.valid.device.type == "meta"
    assert moved.texts == batch.texts and moved.prompt_length == batch.prompt_length


def test_decode_loop_is_the_cpu_labs_and_a_gpu_engine_runs_generate(tokenizer):
    from moerl.config import ModelConfig

    cfg = ModelConfig(preset="qwen3_moe", hidden_size=32, num_layers=2, num_experts=4, top_k=2,
                      moe_intermediate_size=16, num_heads=1, num_kv_heads=1, head_dim=32)
    assert unsupported(build_model(cfg, tokenizer), torch.float32, "emulated") is None
    reason = unsupported(build_model(cfg, tokenizer, device="meta"), torch.float32, "emulated")
    assert reason is not None and "device meta" in reason
