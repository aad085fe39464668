"""The bring-up ladder: every rung composes and passes the launcher's rules as one command, rung 1
runs the experiment's own family with R3 on, and the rung checkpoints are real HF checkpoints."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from moerl import planner
from moerl.verl_ext import first_steps, launch
from moerl.verl_ext.compose import read_yaml_chain
from tests_helpers import load_script

REPO = Path(__file__).resolve().parents[2]
EXP = REPO / "experiments"
RUNGS = sorted(p.relative_to(EXP) for p in EXP.glob("0[1-4]_*/bringup/rung*.yaml"))

ckpt = load_script("scripts/make_bringup_checkpoint.py", "make_bringup_checkpoint")


def test_each_scale_experiment_has_its_rungs():
    names = {str(p) for p in RUNGS}
    for exp in ("01_kimi_k2_lora_grpo", "02_kimi_k2_lora_grpo_r3"):
        assert {f"{exp}/bringup/rung1.yaml", f"{exp}/bringup/rung3.yaml"} <= names
    for exp in ("03_qwen3_30b_a3b_lora_mitigations", "04_moonlight_16b_a3b_r3"):
        assert {f"{exp}/bringup/rung1.yaml", f"{exp}/bringup/rung2.yaml"} <= names


@pytest.mark.parametrize("rung", RUNGS, ids=str)
def test_rung_is_one_command_that_passes_every_rule(rung, capsys):
    n = int(rung.stem[-1])
    assert launch.main([str(EXP / rung.parts[0]), "--rung", str(n), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "trainer.total_training_steps=5" in out and "trainer.save_freq=5" in out and "for this bring-up rung" in out
    assert f"logs/bringup/{rung.parts[0][:2]}_rung{n}.jsonl" in out  # what check_first_steps reads
    data, _ = read_yaml_chain(EXP / rung)
    model = planner.load_public_config(data["moerl"]["model"])
    full = planner.load_public_config(read_yaml_chain(EXP / rung.parts[0] / (
        "base.yaml" if rung.parts[0].startswith("03") else "experiment.yaml"))[0]["moerl"]["model"])
    assert model["family"] == full["family"]  # the experiment's family, scaled down
    fam, r3 = first_steps.family_and_r3("x", EXP / rung)
    assert fam == full["family"] and (r3 or n != 1)  # rung 1: R3 on


def test_missing_rung_names_the_ones_there_are(capsys):
    assert launch.main([str(EXP / "01_kimi_k2_lora_grpo"), "--rung", "2", "--dry-run"]) == 2
    assert "has no bring-up rung 2" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny_kimi_k2", "tiny_qwen3_moe"])  # tiny_moonlight: same family as K2
def test_bringup_checkpoint_is_a_hub_layout_checkpoint_of_the_planned_size(tmp_path, name):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = ckpt.write(name, tmp_path / name)
    cfg = planner.load_public_config(name)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in keys)  # one tensor per expert, as vLLM loads
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    n += sum(b.numel() for nm, b in model.named_buffers() if nm.endswith("e_score_correction_bias"))
    assert n == planner.count_params(cfg).total
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "1+1=?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all() and logits.shape[-1] == cfg["vocab_size"]
    assert json.loads((out / "moerl_bringup.json").read_text())["public_config"] == name
    rope = model.config.rope_parameters  # what vLLM and Megatron-Bridge read back from config.json
    assert rope["rope_theta"] == cfg["rope_theta"]
    assert rope["rope_type"] == ("yarn" if cfg["rope_scaling"] else "default")
    assert model.model.rotary_emb.rope_type == rope["rope_type"]


@pytest.mark.parametrize("tiny,full", [("tiny_kimi_k2", "kimi_k2"), ("kimi_k2_5layers", "kimi_k2"),
                                       ("tiny_moonlight", "moonlight_16b_a3b"), ("tiny_qwen3_moe", "qwen3_30b_a3b")])
def test_bringup_models_carry_their_familys_rope(tiny, full):
    """Rung 1/3 exercise the full model's RoPE: Kimi-K2's YaRN (factor 32 over 4096 original positions)
    reaches the tiny checkpoint, and transformers' rotary embedding built from it is YaRN's."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    t, f = planner.load_public_config(tiny), planner.load_public_config(full)
    assert (t["rope_theta"], t["rope_scaling"]) == (f["rope_theta"], f["rope_scaling"])
    if f["rope_scaling"] is None:
        return
    # transformers derives YaRN's factor from max_position_embeddings / original_max_position_embeddings
    assert t["max_position_embeddings"] == f["max_position_embeddings"] == 4096 * 32
    hf = ckpt.hf_config(t)
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 32.0
    yarn = DeepseekV3RotaryEmbedding(hf)
    plain = ckpt.hf_config({**t, "rope_scaling": None})
    assert yarn.rope_type == "yarn" and not torch.allclose(yarn.inv_freq, DeepseekV3RotaryEmbedding(plain).inv_freq)


@pytest.mark.parametrize("exp", ["01_kimi_k2_lora_grpo", "02_kimi_k2_lora_grpo_r3", "03_qwen3_30b_a3b_lora_mitigations",
                                 "04_moonlight_16b_a3b_r3"])
def test_readme_ladder_names_files_that_exist(exp):
    import re

    text = (EXP / exp / "README.md").read_text()
    ladder = text[text.index("## Bring-up ladder"):text.index("## Results")]
    for n in range(1, 5):
        assert f"\n| {n}" in ladder, (exp, n)
    for path in re.findall(r"experiments/[\w./-]+\.yaml", ladder):
        assert (REPO / path).exists(), path
    for m in re.finditer(r"experiments/(\w+)/launch\.sh --rung (\d)", ladder):
        assert (EXP / m.group(1) / "bringup" / f"rung{m.group(2)}.yaml").exists(), m.group(0)
