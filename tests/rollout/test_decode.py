"""moerl's decode loop against transformers' generate: the same tokens, logprobs and routes, bit for bit."""
import pytest
import torch
import torch.nn.functional as F

from moerl.config import LoraConfig, ModelConfig, RolloutConfig
from moerl.lora.peft_lora import apply_lora
from moerl.models.presets import build_model
from moerl.rollout.decode import unsupported
from moerl.rollout.hf import HFEngine
from tests_helpers import lora_policy

QUESTIONS = ["1+2*3=", "45+6*7=", "99+9*9=", "3+4*5-6="]  # different lengths -> left padding
ANSWERS = ["7", "87", "180", "17"]


def both_paths(engine: HFEngine, questions=QUESTIONS, **kwargs):
    assert engine.decode_loop, engine.decode_loop_unsupported
    engine.decode_loop = False
    reference = engine.generate(questions, ANSWERS[: len(questions)], group_size=6, **kwargs)
    engine.decode_loop = True
    return reference, engine.generate(questions, ANSWERS[: len(questions)], group_size=6, **kwargs)


def assert_identical(reference, loop):
    assert torch.equal(reference.input_ids, loop.input_ids)
    assert torch.equal(reference.attention_mask, loop.attention_mask)
    assert torch.equal(reference.rollout_logprobs, loop.rollout_logprobs)
    assert torch.equal(reference.routing.indices, loop.routing.indices)
    assert torch.equal(reference.routing.valid, loop.routing.valid)
    assert reference.texts == loop.texts


@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp8", "nvfp4", "int4_kimi"])
def test_loop_is_generate_bit_for_bit(tokenizer, dtype):
    engine = HFEngine(lora_policy(tokenizer, num_heads=4, num_kv_heads=2), tokenizer,
                      RolloutConfig(dtype=dtype, max_new_tokens=14, temperature=1.5))
    reference, loop = both_paths(engine, seed=5)
    assert_identical(reference, loop)
    # The run exercised both ways a row stops: EOS before the limit, and the limit.
    finished_early = (loop.input_ids[:, loop.prompt_length:] == tokenizer.eos_token_id).any(-1)
    assert finished_early.any() and not finished_early.all()


def test_loop_matches_generate_greedy_and_with_warpers(tokenizer):
    engine = HFEngine(lora_policy(tokenizer), tokenizer,
                      RolloutConfig(dtype="bf16", max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9))
    assert_identical(*both_paths(engine, seed=2))
    assert_identical(*both_paths(engine, greedy=True))


def test_loop_without_padding_or_capture(tokenizer):
    """Prompts of one length give transformers no attention mask (and sdpa shares key/value heads)."""
    for dtype in ("fp32", "bf16"):
        engine = HFEngine(lora_policy(tokenizer, num_heads=4, num_kv_heads=2), tokenizer,
                          RolloutConfig(dtype=dtype, max_new_tokens=8, capture_routing=False))
        reference, loop = both_paths(engine, questions=["1+2*3=", "4+5*6="], seed=1)
        assert loop.routing is None
        assert torch.equal(reference.input_ids, loop.input_ids)
        assert torch.equal(reference.rollout_logprobs, loop.rollout_logprobs)


def test_loop_follows_a_refit(tokenizer):
    """The loop reads the weights at every call: an adapter refit changes what it samples, as in generate."""
    peft = lora_policy(tokenizer)
    engine = HFEngine(peft, tokenizer, RolloutConfig(dtype="bf16", max_new_tokens=8))
    before = engine.generate(QUESTIONS, ANSWERS, group_size=6, seed=0)
    with torch.no_grad():
        engine.load_adapter({name: p.detach() * 3 for name, p in peft.named_parameters() if "lora_B" in name})
    reference, loop = both_paths(engine, seed=0)
    assert_identical(reference, loop)
    assert not torch.equal(before.rollout_logprobs, loop.rollout_logprobs)


def test_unsupported_models_fall_back_to_generate(tokenizer):
    engine = HFEngine(lora_policy(tokenizer, "deepseek_v3"), tokenizer, RolloutConfig(dtype="bf16", max_new_tokens=4))
    assert not engine.decode_loop and "deepseek_v3" in engine.decode_loop_unsupported
    native = HFEngine(lora_policy(tokenizer), tokenizer, RolloutConfig(dtype="bf16", kernels="native", max_new_tokens=4))
    assert not native.decode_loop and "native" in native.decode_loop_unsupported
    chosen = HFEngine(lora_policy(tokenizer), tokenizer, RolloutConfig(dtype="bf16", decode="generate", max_new_tokens=4))
    assert not chosen.decode_loop and chosen.decode_loop_unsupported is None
    assert native.generate(QUESTIONS, ANSWERS, group_size=2, seed=0).input_ids.shape[0] == 8
    shared = apply_lora(build_model(ModelConfig(preset="qwen3_moe"), tokenizer),
                        LoraConfig(expert_mode="shared"), "qwen3_moe")
    assert "shared" in unsupported(shared, torch.bfloat16, "emulated")


def test_fp32_silu_rounds_like_the_bf16_kernel():
    """The loop computes a bf16 SiLU in fp32 and rounds once: the same bits for every finite bf16 input
    (silu(-inf) is NaN either way, with another sign bit)."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    native, rounded = F.silu(x), F.silu(x.float()).to(torch.bfloat16)
    assert x.numel() == 65280 and torch.equal(native.view(torch.int16), rounded.view(torch.int16))
