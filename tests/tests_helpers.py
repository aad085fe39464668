"""Helpers importable from any test file (pytest puts tests/ on sys.path via rootdir conftest)."""
from pathlib import Path

from conftest import tiny_overrides as tiny_overrides_for  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str):
    """A repository script (``scripts/x.py``, ``benchmarks/bench_x.py``) imported as a module, for the tests of
    its functions; registered in ``sys.modules`` under ``name`` (dataclasses and pickling need it there)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, REPO / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


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


def verl_adapter_tensors(step: int, lr: float = 1e-6, drop: str | None = None) -> dict:
    """Two LoRA pairs as verl's export sends them to the rollout, bf16: A from a fixed init, B = step x lr
    (B starts at 0); ``drop`` leaves one tensor out (a partial refit)."""
    import torch

    g = torch.Generator().manual_seed(0)
    out = {}
    for layer in (0, 1):
        stem = f"base_model.model.model.layers.{layer}.mlp.experts.down_proj"
        out[f"{stem}.lora_A.weight"] = (torch.randn(8, 32, generator=g) * 0.02).to(torch.bfloat16)
        out[f"{stem}.lora_B.weight"] = torch.full((32, 8), step * lr).to(torch.bfloat16)
    if drop:
        out.pop(drop)
    return out
