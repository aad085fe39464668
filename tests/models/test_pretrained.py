"""A user's checkpoint directory (model.path), exercised on hub-format doubles this repository writes itself."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from moerl.config import ConfigError, config_hash, load_config
from moerl.data.prompts import PromptFormat
from moerl.models.doubles import write_double, write_gsm8k_file
from moerl.models.families import FAMILIES
from moerl.models.pretrained import (CheckpointError, eos_token_ids, inspect_checkpoint, load_model, load_tokenizer,
                                     memory_plan, model_shape)
from moerl.trainer.probe import run_probe

ALL = sorted(FAMILIES)


@pytest.fixture(scope="module")
def doubles(tmp_path_factory):
    root = tmp_path_factory.mktemp("doubles")
    return {f: write_double(f, root / f) for f in ALL}


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return write_gsm8k_file(root / "train.jsonl", 64), write_gsm8k_file(root / "test.parquet", 16, seed=1, verl_format=True)


@pytest.mark.parametrize("family", ALL)
def test_every_family_loads_and_probes_per_layer(doubles, family):
    info = inspect_checkpoint(doubles[family])
    tok = load_tokenizer(info)
    assert len(tok) < info.vocab_size  # the double pads its vocabulary, as hub checkpoints do
    model = load_model(info)
    prompts = PromptFormat("gsm8k", checkpoint=True, stop_ids=tuple(eos_token_ids(info, tok)))
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]
    record = run_probe(model, tok, prompts, rows, ["bf16", "nvfp4"], max_new_tokens=6, batch_size=4,
                       kernels="emulated", progress=lambda line: None)
    assert record["moe_layers"] == info.moe_layers()
    for name in ("bf16", "nvfp4"):
        r = record["precisions"][name]
        # one share per MoE layer, keyed by global layer number: DeepSeek's dense first layer is absent
        assert sorted(int(k) for k in r["reroute_per_layer"]) == info.moe_layers()
        for key in ("k3", "r3_k3", "reroute_any", "ratio_gt2"):
            low, high = r[key]["ci95"]
            assert low <= r[key]["value"] <= high
        assert 0 <= r["reroute_any"]["value"] <= 1
        assert r["routed_tokens"] > r["response_tokens"] > 0
    # 4-bit weights move the engine's policy orders of magnitude further than bf16 rounding does
    assert record["precisions"]["nvfp4"]["k3"]["value"] > record["precisions"]["bf16"]["k3"]["value"]


def _run(tmp_path, ckpt, data, arm="r3", extra=()):
    from moerl.trainer.grpo import GRPOTrainer

    train, test = data
    cfg = load_config(f"experiments/08_real_moe/arms/{arm}.yaml", [
        f"model.path={ckpt}", f"data.train_path={train}", f"data.test_path={test}", "device=cpu",
        "rollout.kernels=emulated", "rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "trainer.steps=2", "trainer.micro_batch_size=8", "trainer.mini_batches=2", "trainer.eval_every=2",
        "trainer.eval_size=4", "trainer.checkpoint_every=1", "trainer.samples_every=0", "trainer.warmup_steps=0",
        "trainer.activation_checkpointing=false", "lora.rank=4", "lora.alpha=8", "data.max_prompt_tokens=256",
        f"tracking.output_dir={tmp_path}", "tracking.wandb_mode=disabled", "tracking.progress_bar=false", *extra])
    trainer = GRPOTrainer(cfg, cfg.run_dir, progress=False)
    trainer.train()
    rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    return cfg, [r for r in rows if "reward/mean" in r]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["olmoe", "granitemoe", "deepseek_v2"])
def test_r3_replays_the_engines_experts_on_a_checkpoint(tmp_path, doubles, gsm8k, family):
    """Two GRPO steps of experiment 08's r3 arm: every replayed (row, layer) took the engine's experts. The
    three families with a router read another way than the presets' (softmax gate, the router's sorted output,
    logits recomputed from the experts' input)."""
    _, steps = _run(tmp_path, doubles[family], gsm8k)
    assert len(steps) == 2
    assert all(s["routing/replayed_agreement"] == 1.0 for s in steps)
    assert all(s["replay/violations"] == 0 for s in steps)


@pytest.mark.slow
def test_resume_and_the_peft_export_loads_back_onto_the_checkpoint(tmp_path, doubles, gsm8k):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from moerl.trainer.grpo import GRPOTrainer

    cfg, steps = _run(tmp_path, doubles["olmoe"], gsm8k, arm="tis")
    adapter = cfg.run_dir / "checkpoints" / "step_2" / "adapter" / "peft"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(doubles["olmoe"]), adapter)
    assert any("lora_A" in n for n, _ in model.named_parameters())
    assert (adapter.parent / "vllm" / "adapter_model.safetensors").exists()
    # a resume picks up the finished run's last checkpoint and continues to a longer horizon
    (cfg.run_dir / "summary.json").unlink()
    longer = load_config(f"experiments/08_real_moe/arms/tis.yaml", [*_overrides_of(cfg)])
    trainer = GRPOTrainer(longer, cfg.run_dir, resume=True, progress=False)
    assert trainer.step_idx == 2


def _overrides_of(cfg):
    from moerl.config import flatten, to_dict

    flat = flatten(to_dict(cfg))
    keys = ("model.path", "data.train_path", "data.test_path", "device", "rollout.kernels", "rollout.prompts_per_step",
            "rollout.group_size", "rollout.max_new_tokens", "trainer.steps", "trainer.micro_batch_size",
            "trainer.mini_batches", "trainer.eval_every", "trainer.eval_size", "trainer.checkpoint_every",
            "trainer.samples_every", "trainer.warmup_steps", "trainer.activation_checkpointing", "lora.rank",
            "lora.alpha", "data.max_prompt_tokens", "tracking.output_dir", "tracking.wandb_mode",
            "tracking.progress_bar")
    return [f"{k}={flat[k]}" for k in keys]


# ---- bad input: one line naming the file and the fix, before a weight is read -----------------------------------

def test_a_hub_id_is_refused_with_download_it_first():
    with pytest.raises(CheckpointError, match="download it first"):
        inspect_checkpoint("allenai/OLMoE-1B-7B-0125-Instruct")


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        inspect_checkpoint(tmp_path)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_a_family_outside_the_table_is_refused_naming_the_supported_ones(tmp_path, doubles):
    d = _copy(doubles["olmoe"], tmp_path / "c")
    _edit_config(d, model_type="llama")
    with pytest.raises(CheckpointError, match=r"config.json: model_type 'llama' .*supported: .*olmoe.*granitemoe"):
        inspect_checkpoint(d)


def test_an_fp8_hub_checkpoint_is_refused(tmp_path, doubles):
    d = _copy(doubles["qwen3_moe"], tmp_path / "c")
    _edit_config(d, quantization_config={"quant_method": "fp8", "fmt": "e4m3"})
    with pytest.raises(CheckpointError, match="quant_method=fp8"):
        inspect_checkpoint(d)


def test_pickle_weights_are_refused_and_missing_weights_named(tmp_path, doubles):
    d = _copy(doubles["olmoe"], tmp_path / "c")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        inspect_checkpoint(d)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        inspect_checkpoint(d)


def test_a_missing_shard_is_named(tmp_path, doubles):
    d = _copy(doubles["olmoe"], tmp_path / "c")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors is missing"):
        inspect_checkpoint(d)


def test_no_chat_template_is_named_and_plain_prompts_go_on(tmp_path):
    d = write_double("olmoe", tmp_path / "c", chat_template=False)
    info = inspect_checkpoint(d)
    with pytest.raises(CheckpointError, match="no chat template.*data.chat_template=false"):
        load_tokenizer(info)
    tok = load_tokenizer(info, need_chat_template=False)
    ids, _ = PromptFormat("gsm8k", checkpoint=True, chat_template=False).encode(tok, ["What is 2 + 2?"])
    assert "####" in tok.decode(ids[0])


def test_a_tokenizer_longer_than_the_vocabulary_is_refused(tmp_path, doubles):
    d = _copy(doubles["olmoe"], tmp_path / "c")
    _edit_config(d, vocab_size=100)
    with pytest.raises(CheckpointError, match="tokenizer has 512 tokens but config.json vocab_size is 100"):
        load_tokenizer(inspect_checkpoint(d))


def test_a_tokenizer_without_eos_is_refused(tmp_path, doubles):
    d = _copy(doubles["olmoe"], tmp_path / "c")
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["eos_token"] = None
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "generation_config.json").unlink()
    with pytest.raises(CheckpointError, match="no EOS"):
        load_tokenizer(inspect_checkpoint(d))


# ---- config, data, reward, memory plan --------------------------------------------------------------------------

def test_size_keys_and_a_warm_start_are_refused_beside_model_path(tmp_path):
    with pytest.raises(ConfigError, match="model.hidden_size=256 has no effect: model.path=.* defines the model"):
        load_config("experiments/08_real_moe/arms/r3.yaml", ["model.hidden_size=256"])
    with pytest.raises(ConfigError, match="warm_start.enabled=false"):
        load_config("experiments/08_real_moe/arms/r3.yaml", ["warm_start.enabled=true"])


def test_the_new_keys_leave_every_earlier_run_identity_unchanged():
    """A recorded run's config hash, as its run.json holds it, is what its config hashes to today."""
    from pathlib import Path

    runs = sorted(Path("results/runs/07_dose_threshold").glob("*trainer.steps-600*/seed4/run.json"))
    assert runs
    for run in runs:
        recorded = json.loads(run.read_text())
        assert config_hash(load_config(run.parent / "config.yaml")) == recorded["config_hash"], run


def test_verl_parquet_rows_give_the_question_without_verls_instruction(tmp_path):
    import pandas as pd

    from moerl.data.datasets import load_local

    path = tmp_path / "verl.parquet"
    pd.DataFrame([{"data_source": "openai/gsm8k", "ability": "math", "prompt": [
        {"role": "user", "content": 'How many? Let\'s think step by step and output the final answer after "####".'}],
        "reward_model": {"style": "rule", "ground_truth": "1,234"}}]).to_parquet(path)
    assert load_local(path, "gsm8k") == [{"question": "How many?", "answer": "1234"}]


def test_gsm8k_answers_after_hashes_earn_the_reward_only_when_asked_for():
    from moerl.reward import batch_rewards

    assert batch_rewards(["so 6 + 36 = 42.\n#### 42"], ["42"], hashes=True) == [1.0]
    assert batch_rewards(["so 6 + 36 = 42.\n#### 42"], ["42"]) == [0.0]
    assert batch_rewards(["#### 41"], ["42"], hashes=True) == [0.0]


def test_memory_plan_counts_olmoe_exactly_and_says_whether_it_fits():
    cfg = load_config("experiments/08_real_moe/arms/r3.yaml")
    olmoe = json.loads(open("experiments/08_real_moe/model_configs/olmoe_1b_7b_0125_instruct.json").read())
    shape = model_shape(olmoe, cfg.lora)
    assert abs(shape.params / 6.92e9 - 1) < 0.01  # published: 6.9B total
    assert memory_plan(cfg, olmoe, 80).margin_gib > 0
    assert memory_plan(cfg, olmoe, 40).margin_gib < 0


def test_the_new_keys_leave_the_committed_warm_starts_found():
    """The checkpoint keys are not read by a warm start, so they do not change its cache key."""
    from moerl.trainer.warm_start import warm_start_dir

    for arm in ("experiments/00_tiny_moe_cpu/arms/baseline.yaml", "experiments/07_dose_threshold/arms/baseline.yaml"):
        assert (warm_start_dir(load_config(arm)) / "meta.json").exists(), arm


@pytest.mark.slow
def test_every_arm_of_experiment_08_runs_two_steps(tmp_path, doubles, gsm8k):
    """Each arm file of experiment 08 on one checkpoint double, with a bf16 trainer and activation checkpointing
    on (the settings a large checkpoint on one GPU takes)."""
    from pathlib import Path

    arms = sorted(p.stem for p in Path("experiments/08_real_moe/arms").glob("*.yaml"))
    assert {"baseline", "fp32_rollout", "tis", "icepop", "r3", "r3_tis", "fp8_rollout", "nvfp4_rollout"} <= set(arms)
    for arm in arms:
        _, steps = _run(tmp_path / arm, doubles["qwen2_moe"], gsm8k, arm=arm,
                        extra=("trainer.dtype=bf16", "trainer.activation_checkpointing=true", "trainer.eval_every=0",
                               "rollout.prompts_per_step=2", "rollout.max_new_tokens=4"))
        assert len(steps) == 2, arm
        assert all(s["updates/skipped_nonfinite"] == 0 for s in steps), arm
        if "r3" in arm:
            assert all(s["routing/replayed_agreement"] == 1.0 for s in steps), arm


def test_a_sharded_bf16_checkpoint_with_its_template_in_the_tokenizer_config_loads(tmp_path, doubles):
    """Another layout of the hub's files than the doubles': weights in bf16 shards with an index, the chat
    template inside tokenizer_config.json (older releases), no chat_template.jinja."""
    from transformers import AutoModelForCausalLM

    src = doubles["deepseek_v3"]
    d = tmp_path / "sharded"
    d.mkdir()
    AutoModelForCausalLM.from_pretrained(src).to(torch.bfloat16).save_pretrained(d, max_shard_size="100KB")
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(src / name, d / name)
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc["chat_template"] = (src / "chat_template.jinja").read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    info = inspect_checkpoint(d)
    assert len(info.weight_files) > 1 and (d / "model.safetensors.index.json").exists()
    tok = load_tokenizer(info)
    model = load_model(info)  # fp32 from bf16 files
    assert next(model.parameters()).dtype == torch.float32
    text = PromptFormat("math", checkpoint=True).texts(tok, ["1 + 1?"])[0]
    assert text.startswith("<|im_start|>user") and "\\boxed{}" in text


def test_print_config_shows_a_checkpoint_run_only_the_keys_it_reads():
    from moerl.config import config_yaml

    shown = config_yaml(load_config("experiments/08_real_moe/arms/r3.yaml"), only_read=True)
    assert "path: checkpoints/OLMoE-1B-7B-0125-Instruct" in shown and "chat_template: true" in shown
    assert "hidden_size" not in shown and "preset" not in shown and "max_a" not in shown
    preset = config_yaml(load_config("experiments/00_tiny_moe_cpu/arms/r3.yaml"), only_read=True)
    assert "hidden_size" in preset and "\n  path:" not in preset and "chat_template" not in preset
