"""Every experiment composes against verl's real Hydra config with the keys it must set."""
from pathlib import Path

import pytest
import yaml

from moerl.verl_ext.compose import (ExperimentError, compose_experiment, flatten_overrides,
                                    load_experiment, select)

EXP = Path(__file__).resolve().parents[2] / "experiments"
KIMI_TARGETS = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_proj", "linear_fc1",
                "linear_fc2"]


def composed(name, arm=None):
    return compose_experiment(load_experiment(EXP / name, arm))


def lora(cfg):
    return select(cfg, "actor_rollout_ref.model.lora")


def test_kimi_without_and_with_r3():
    c1, c2 = composed("01_kimi_k2_lora_grpo"), composed("02_kimi_k2_lora_grpo_r3")
    for c in (c1, c2):
        assert lora(c).rank == 32 and lora(c).alpha == 64 and list(lora(c).target_modules) == KIMI_TARGETS
        assert lora(c).share_expert_adapters is True and lora(c).merge is False
        assert select(c, "trainer.nnodes") * select(c, "trainer.n_gpus_per_node") == 64
        assert select(c, "actor_rollout_ref.rollout.name") == "vllm"
        assert select(c, "actor_rollout_ref.rollout.expert_parallel_size") == 64
        assert select(c, "actor_rollout_ref.rollout.data_parallel_size") == 1
        assert "fully_sharded_loras" not in lora(c)
        assert select(c, "actor_rollout_ref.actor.megatron.override_transformer_config"
                      ".num_layers_in_last_pipeline_stage") == 5
        assert select(c, "actor_rollout_ref.actor.megatron.use_mbridge") is True
        assert select(c, "algorithm.adv_estimator") == "grpo"
        assert "wandb" in select(c, "trainer.logger")
    assert select(c1, "actor_rollout_ref.actor.megatron.router_replay.mode") == "disabled"
    assert select(c1, "actor_rollout_ref.rollout.enable_rollout_routing_replay") is False
    assert select(c2, "actor_rollout_ref.actor.megatron.router_replay.mode") == "R3"
    assert select(c2, "actor_rollout_ref.rollout.enable_rollout_routing_replay") is True


ARMS = {  # arm: (router replay mode, rollout flag, rollout_is, rollout_rs)
    "baseline": ("disabled", False, None, None),
    "tis": ("disabled", False, "token", None),
    "seq_mis": ("disabled", False, "sequence", "seq_sum_k1"),
    "icepop": ("disabled", False, "token", None),
    "r2": ("R2", False, None, None),
    "r3": ("R3", True, None, None),
    "r3_tis": ("R3", True, "token", None),
}


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_qwen_arms(arm):
    c = composed("03_qwen3_30b_a3b_lora_mitigations", arm)
    mode, flag, is_, rs = ARMS[arm]
    assert select(c, "actor_rollout_ref.actor.megatron.router_replay.mode") == mode
    assert select(c, "actor_rollout_ref.rollout.enable_rollout_routing_replay") is flag
    rc = select(c, "algorithm.rollout_correction")
    assert rc.rollout_is == is_ and rc.rollout_rs == rs
    assert lora(c).rank == 32 and list(lora(c).target_modules) == ["linear_qkv", "linear_proj", "linear_fc1",
                                                                    "linear_fc2"]
    assert select(c, "trainer.n_gpus_per_node") == 8 and select(c, "trainer.nnodes") == 1
    if arm == "icepop":  # verl's decoupled_token_icepop preset
        assert rc.rollout_is_threshold == "0.5_5.0"


def test_moonlight_r3():
    c = composed("04_moonlight_16b_a3b_r3")
    assert select(c, "actor_rollout_ref.actor.megatron.router_replay.mode") == "R3"
    assert select(c, "actor_rollout_ref.rollout.enable_rollout_routing_replay") is True
    assert "linear_q_proj" in lora(c).target_modules  # Moonlight has no q LoRA


def test_unknown_override_fails_with_verl_message_and_file(tmp_path):
    exp = tmp_path / "99_bad"
    exp.mkdir()
    (exp / "experiment.yaml").write_text(yaml.safe_dump(
        {"moerl": {"model": "qwen3_30b_a3b"},
         "verl": {"actor_rollout_ref": {"rollout": {"enable_rollout_routing_reply": True}}}}))
    with pytest.raises(ExperimentError) as err:
        compose_experiment(load_experiment(exp))
    msg = str(err.value)
    assert "enable_rollout_routing_reply" in msg and "experiment.yaml" in msg
    assert "not in struct" in msg or "Could not override" in msg  # Hydra/OmegaConf's own words


def test_arm_required_and_unknown_arm():
    with pytest.raises(ExperimentError, match="--arm"):
        load_experiment(EXP / "03_qwen3_30b_a3b_lora_mitigations")
    with pytest.raises(ExperimentError, match="unknown arm"):
        load_experiment(EXP / "03_qwen3_30b_a3b_lora_mitigations", "r4")


def test_flatten_overrides_quotes_and_additions():
    pairs = dict(flatten_overrides({"a": {"b": 1, "+c": True, "d": "0.5_2.0", "e": ["x", "y z"], "f": None}}))
    assert pairs == {"a.b": "1", "+a.c": "true", "a.d": "'0.5_2.0'", "a.e": "[x,'y z']", "a.f": "null"}


def test_a_former_arm_name_composes_the_arm_it_became():
    from moerl.verl_ext.compose import load_experiment

    directory = Path(__file__).resolve().parents[2] / "experiments" / "03_qwen3_30b_a3b_lora_mitigations"
    former, current = load_experiment(directory, arm="mis"), load_experiment(directory, arm="seq_mis")
    assert former.arm == current.arm == "seq_mis" and former.overrides == current.overrides
    with pytest.raises(ExperimentError, match="unknown arm 'mix'"):
        load_experiment(directory, arm="mix")
