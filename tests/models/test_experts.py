"""moerl's local grouped-experts forward against transformers' grouped_mm: the same numbers, forward and backward."""
import pytest
import torch

from moerl.config import LoraConfig, ModelConfig
from moerl.lora.peft_lora import apply_lora
from moerl.models.experts import NAME, implementation
from moerl.models.presets import build_model


@pytest.mark.parametrize("preset", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_local_experts_match_transformers_grouped_mm_bit_for_bit(tokenizer, preset):
    model = build_model(ModelConfig(preset=preset, init_std=0.1), tokenizer)
    assert model.config._experts_implementation == NAME  # what grouped_mm builds
    policy = apply_lora(model, LoraConfig(), preset)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    ids = torch.randint(3, len(tokenizer), (6, 11))

    def forward_backward(experts: str):
        model.config._experts_implementation = experts
        policy.zero_grad(set_to_none=True)
        logits = policy(input_ids=ids).logits
        (logits.float().log_softmax(-1)[..., 5].sum() + logits.pow(2).mean()).backward()
        return logits.detach(), {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}

    reference, local = forward_backward("grouped_mm"), forward_backward(NAME)
    assert torch.equal(reference[0], local[0])
    assert reference[1].keys() == local[1].keys() and any("experts" in k for k in local[1])
    assert all(torch.equal(reference[1][k], local[1][k]) for k in reference[1])


def test_only_grouped_mm_maps_to_the_local_forward():
    assert implementation("grouped_mm") == NAME
    assert implementation("eager") == "eager" and implementation("batched_mm") == "batched_mm"
