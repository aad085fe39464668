"""Helpers importable from any test file (pytest puts tests/ on sys.path via rootdir conftest)."""
from conftest import tiny_overrides as tiny_overrides_for  # noqa: F401


def lora_policy(tokenizer, preset: str = "qwen3_moe", **model):
    """A tiny random-init policy with non-zero LoRA on attention and every expert (B is zero at init,
    which would hide a missed adapter or a refit bug)."""
    import torch

    from moerl.config import LoraConfig, ModelConfig
    from moerl.lora.peft_lora import apply_lora
    from moerl.models.presets import build_model

    policy = apply_lora(build_model(ModelConfig(preset=preset, init_std=0.1, **model), tokenizer), LoraConfig(), preset)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return policy
