"""Launcher: dry-run prints a main_ppo command per experiment; broken constraints are named."""
from pathlib import Path

import pytest
import yaml

from moerl.verl_ext import launch

EXP = Path(__file__).resolve().parents[2] / "experiments"
RUNS = [("01_kimi_k2_lora_grpo", None), ("02_kimi_k2_lora_grpo_r3", None), ("04_moonlight_16b_a3b_r3", None)] + [
    ("03_qwen3_30b_a3b_lora_mitigations", a) for a in ("baseline", "tis", "mis", "icepop", "r2", "r3", "r3_tis")]


@pytest.mark.parametrize("name,arm", RUNS)
def test_dry_run_prints_command(name, arm, capsys):
    argv = [str(EXP / name), "--dry-run"] + (["--arm", arm] if arm else [])
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert "-m verl.trainer.main_ppo" in out and "--config-name ppo_megatron_trainer" in out
    assert "actor_rollout_ref.model.lora.rank=32" in out
    assert "ok  [verl.validate_config]" in out


def _bad(tmp_path, base, verl, moerl=None):
    """An experiment that inherits a real one and breaks one thing."""
    d = tmp_path / "98_bad"
    d.mkdir()
    (d / "experiment.yaml").write_text(yaml.safe_dump({"base": str(base), "verl": verl, **({"moerl": moerl} if moerl else {})}))
    return d


def _failed(d):
    with pytest.raises(launch.ConstraintError) as err:
        launch.prepare(d)
    return str(err.value)


K2 = EXP / "01_kimi_k2_lora_grpo" / "experiment.yaml"
MOON = EXP / "04_moonlight_16b_a3b_r3" / "experiment.yaml"


def test_layout_not_dividing_gpus_names_constraint(tmp_path):
    msg = _failed(_bad(tmp_path, K2, {"actor_rollout_ref": {"actor": {"megatron": {"pipeline_model_parallel_size": 3}}}}))
    assert "[layout.dense_divides_gpus]" in msg and "64 GPUs" in msg


def test_ep_not_dividing_experts(tmp_path):
    msg = _failed(_bad(tmp_path, MOON, {"actor_rollout_ref": {"actor": {"megatron": {"expert_model_parallel_size": 3}}}}))
    assert "[layout.ep_divides_experts]" in msg and "64 experts" in msg


def test_tp_not_dividing_heads(tmp_path):
    msg = _failed(_bad(tmp_path, MOON, {"actor_rollout_ref": {"actor": {"megatron": {"tensor_model_parallel_size": 32}}},
                                         "trainer": {"nnodes": 4}}))
    assert "[layout.tp_divides_heads]" in msg and "16 attention heads" in msg


def test_rollout_expert_parallel_rejected_with_moe_lora(tmp_path):
    msg = _failed(_bad(tmp_path, MOON, {"actor_rollout_ref": {"rollout": {"expert_parallel_size": 2}}}))
    assert "[lora.vllm_moe_lora_no_ep]" in msg


def test_r3_needs_both_flags(tmp_path):
    msg = _failed(_bad(tmp_path, MOON, {"actor_rollout_ref": {"rollout": {"enable_rollout_routing_replay": False}}}))
    assert "[r3.flags]" in msg


def test_mla_model_rejects_qkv_target(tmp_path):
    msg = _failed(_bad(tmp_path, K2, {"actor_rollout_ref": {"model": {"lora": {"target_modules": [
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}}}}))
    assert "[lora.targets_match_model]" in msg and "linear_qkv" in msg


def test_lora_rank_above_vllm_max(tmp_path):
    msg = _failed(_bad(tmp_path, MOON, {"actor_rollout_ref": {"model": {"lora": {"rank": 640}}}}))
    assert "[lora.vllm_max_lora_rank]" in msg


def test_layout_that_cannot_fit_is_rejected(tmp_path):
    msg = _failed(_bad(tmp_path, K2, {"trainer": {"nnodes": 1},
                                      "actor_rollout_ref": {"actor": {"megatron": {"pipeline_model_parallel_size": 1}},
                                                            "rollout": {"tensor_model_parallel_size": 8}}}))
    assert "[memory.fits]" in msg and "over by" in msg


def test_unknown_override_exits_2_with_file(tmp_path, capsys):
    d = _bad(tmp_path, MOON, {"actor_rollout_ref": {"actor": {"megatron": {"router_replay": {"mdoe": "R3"}}}}})
    assert launch.main([str(d), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "mdoe" in err and "98_bad/experiment.yaml" in err


def test_moerl_loss_sets_external_modules_env(tmp_path, capsys):
    from moerl.verl_ext.compose import compose_experiment, env_for, load_experiment

    d = _bad(tmp_path, MOON, {"actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "moerl_icepop"}}}})
    cfg = compose_experiment(load_experiment(d))
    assert "moerl.verl_ext.losses" in env_for(cfg)["VERL_USE_EXTERNAL_MODULES"]
