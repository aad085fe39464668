"""A trained LoRA exported as adapters that stock PEFT (and vLLM) load, for every expert mode."""
from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel

from moerl.config import ExperimentConfig
from moerl.lora.export import export_adapter
from moerl.lora.peft_lora import apply_lora
from moerl.models.presets import build_model
from moerl.refit.adapter_format import canonical_adapter, load_hf_adapter


@pytest.mark.parametrize("preset,mode", [("qwen3_moe", "per_expert"), ("qwen3_moe", "shared_outer"),
                                         ("deepseek_v3", "shared")])
def test_exported_adapter_loads_with_peft_and_matches_the_policy(tokenizer, tmp_path, preset, mode):
    cfg = ExperimentConfig()
    cfg.model.preset, cfg.lora.expert_mode = preset, mode
    policy = apply_lora(build_model(cfg.model, tokenizer, seed=0), cfg.lora, preset)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    paths = export_adapter(policy, cfg, tmp_path / "adapter", base_model="results/warm_start/x")
    ids = torch.randint(3, 30, (2, 9))
    loaded = PeftModel.from_pretrained(build_model(cfg.model, tokenizer, seed=0), str(paths["peft"]))
    bare = build_model(cfg.model, tokenizer, seed=0)
    with torch.no_grad():
        want = policy(input_ids=ids).logits
        assert torch.equal(loaded(input_ids=ids).logits, want)
        assert (bare(input_ids=ids).logits - want).abs().max() > 1e-3  # the adapter does change the model
    assert json.loads((paths["peft"] / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "results/warm_start/x"  # not a local directory: kept as a model name
    # the vLLM (per-expert names) copy converts back to the same factors
    back, config = load_hf_adapter(paths["vllm"], preset, mode)
    mine = canonical_adapter(policy)
    assert set(back) == set(mine) and all(torch.equal(back[k], mine[k].float()) for k in mine)
    assert config["r"] == cfg.lora.rank


def test_exported_base_model_resolves_from_anywhere(tokenizer, tmp_path, monkeypatch):
    """A base model given as a path relative to the working directory is stored absolute, so the
    adapter finds its base from wherever it is loaded; a hub name is kept as it is."""
    from transformers import AutoModelForCausalLM

    cfg = ExperimentConfig()
    policy = apply_lora(build_model(cfg.model, tokenizer, seed=0), cfg.lora, cfg.model.preset)
    build_model(cfg.model, tokenizer, seed=0).save_pretrained(tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    paths = export_adapter(policy, cfg, "adapter", base_model="base")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for kind in ("peft", "vllm"):
        stored = json.loads((tmp_path / paths[kind] / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert stored == str(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(stored)
    PeftModel.from_pretrained(base, str(tmp_path / paths["peft"]))
    hub = export_adapter(policy, cfg, tmp_path / "hub", base_model="Qwen/Qwen3-30B-A3B")
    assert json.loads((hub["peft"] / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "Qwen/Qwen3-30B-A3B"
