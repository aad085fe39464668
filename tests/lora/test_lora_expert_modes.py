"""Expert LoRA variants on the fused expert tensors: delta math, sharing, training, router hooks."""
from __future__ import annotations

import pytest
import torch

from moerl.config import ExperimentConfig
from moerl.data.tokenizer import build_tokenizer
from moerl.lora.expert_modes import (ExpertLoRADelta, expert_lora_modules, peft_expert_factors,
                                     peft_expert_tensors)
from moerl.lora.peft_lora import apply_lora, lora_state_dict
from moerl.models.presets import build_model
from moerl.models.routers import intercept_routing
from moerl.refit.weights import effective_state_dict


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _model(tok, preset, mode, target_attention=True):
    cfg = ExperimentConfig()
    cfg.model.preset, cfg.lora.expert_mode, cfg.lora.target_attention = preset, mode, target_attention
    return cfg, apply_lora(build_model(cfg.model, tok), cfg.lora, preset)


@pytest.mark.parametrize("preset,mode", [("qwen3_moe", "shared"), ("qwen3_moe", "shared_outer"),
                                         ("mixtral", "shared"), ("deepseek_v3", "shared_outer")])
def test_expert_modes_shapes_merge_and_router_hooks(tok, preset, mode):
    cfg, model = _model(tok, preset, mode)
    mods = expert_lora_modules(model)
    assert mods, "no expert LoRA attached"
    num_e, r = cfg.model.num_experts, cfg.lora.rank
    for name, m in mods.items():
        a_shared, b_shared = m.lora_A.shape[0] == 1, m.lora_B.shape[0] == 1
        if mode == "shared":
            assert a_shared and b_shared, name
        elif name.endswith("gate_up_proj"):  # fc1: A shared, B per expert
            assert a_shared and m.lora_B.shape[0] == num_e, name
        else:  # fc2: A per expert, B shared
            assert m.lora_A.shape[0] == num_e and b_shared, name
        assert m.lora_A.shape[1] == r and m.lora_B.shape[2] == r
        assert torch.count_nonzero(m.lora_B) == 0  # starts equal to the base
    ids = torch.randint(3, 30, (2, 6))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        for m in mods.values():
            m.lora_B.normal_(0, 0.1)
        after = model(input_ids=ids).logits
    assert not torch.allclose(before, after)  # the delta reaches every experts implementation
    # merged plain model computes the same thing
    plain = build_model(cfg.model, tok)
    plain.load_state_dict(effective_state_dict(model))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, after, atol=1e-5)
    # router hooks still see every MoE call (block.experts is still the called module)
    seen = []
    with torch.no_grad(), intercept_routing(model, lambda layer, idx, logits: seen.append(layer.layer_number)):
        model(input_ids=ids)
    assert len(set(seen)) == len(mods) // 2  # two fused tensors per MoE layer


def test_only_adapters_train_and_get_gradients(tok):
    _, model = _model(tok, "qwen3_moe", "shared_outer")
    trainable = lora_state_dict(model)
    assert all("lora_" in n for n in trainable)
    assert any("parametrizations.gate_up_proj.0.lora_A" in n for n in trainable)
    model(input_ids=torch.randint(3, 30, (2, 6))).logits.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "parametrizations" in n and "lora_B" in n)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_expert_lora_without_attention_targets(tok):
    _, model = _model(tok, "qwen3_moe", "shared", target_attention=False)
    names = list(lora_state_dict(model))
    assert names and all("parametrizations" in n for n in names)


def test_peft_per_expert_layout_round_trip_matches_peft_delta(tok):
    _, model = _model(tok, "qwen3_moe", "per_expert")
    from peft.tuners.lora.layer import ParamWrapper

    wrapper = next(m for m in model.modules() if isinstance(m, ParamWrapper))
    with torch.no_grad():
        wrapper.lora_B["default"].weight.normal_()
    a_w, b_w = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
    a, b = peft_expert_factors(a_w, b_w, wrapper.num_experts)
    ours = torch.matmul(b, a) * wrapper.scaling["default"]
    assert torch.allclose(ours, wrapper.get_delta_weight("default"), atol=1e-6)
    a2, b2 = peft_expert_tensors(a, b)
    assert torch.equal(a2, a_w) and torch.equal(b2, b_w)


def test_delta_broadcasts_shared_factor():
    d = ExpertLoRADelta(4, 6, 5, 2, 4.0, share_a=True, share_b=False)
    with torch.no_grad():
        d.lora_B.normal_()
    w = torch.zeros(4, 6, 5)
    out = d(w)
    for e in range(4):
        assert torch.allclose(out[e], d.lora_B[e] @ d.lora_A[0] * 2.0)
