"""Overrides that compose, start and train the wrong thing with no error: each has a named rule that
refuses it before the job is queued (hand-built specs, no Hydra), and the scale experiments compose with
the expert bias frozen."""
import json

import pytest
from omegaconf import OmegaConf

from moerl import planner
from moerl.verl_ext import constraints as C
from moerl.verl_ext.compose import compose_experiment, load_experiment
from moerl.verl_ext.launch import REPO, rung_file

K2 = planner.load_public_config("kimi_k2")
MOON = planner.load_public_config("moonlight_16b_a3b")
QWEN = planner.load_public_config("qwen3_30b_a3b")
LORA = dict(rank=32, alpha=64, merge=False, target_modules=["linear_fc1", "linear_fc2"])
ROLLOUT = dict(name="vllm", tp=8, dp=1, ep=8, pp=1, dtype="bfloat16")


def _spec(model=K2, lora=None, otc=None, rollout=None, **verl):
    return C.LaunchSpec(model=model, n_gpus=64, tp=8, pp=8, ep=8, etp=1, sequence_parallel=True,
                        rollout={**ROLLOUT, **(rollout or {})}, lora={**LORA, **(lora or {})},
                        verl={"otc": otc or {}, **verl})


def _one(spec, name):
    return {f.rule: f for f in C.check_all(spec, only=(name,))}.get(name)


@pytest.mark.parametrize("model", [K2, MOON])
def test_expert_bias_left_updating_under_adapter_refit_is_refused(model):
    f = _one(_spec(model), "megatron.expert_bias_frozen_under_lora")
    assert not f.ok and "moe_router_bias_update_rate=0" in f.detail and "0.001" in f.detail
    assert "finalize_model_grads.py" in f.source and "kimi_bridge.py:62" in f.source
    on_again = _one(_spec(model, otc={"moe_router_bias_update_rate": 1e-3}), "megatron.expert_bias_frozen_under_lora")
    assert not on_again.ok
    assert _one(_spec(model, otc={"moe_router_bias_update_rate": 0}), "megatron.expert_bias_frozen_under_lora").ok


def test_expert_bias_switched_off_is_refused_and_the_rule_skips_models_without_it():
    off = _one(_spec(otc={"moe_router_enable_expert_bias": False, "moe_router_bias_update_rate": 0}),
               "megatron.expert_bias_frozen_under_lora")
    assert not off.ok and "e_score_correction_bias" in off.detail
    assert _one(_spec(QWEN), "megatron.expert_bias_frozen_under_lora") is None       # Qwen3 routers have no bias
    assert _one(_spec(lora={"merge": True}), "megatron.expert_bias_frozen_under_lora") is None


@pytest.mark.parametrize("alpha,ok", [(0, False), (-16, False), (None, False), (64, True)])
def test_lora_alpha_must_be_positive(alpha, ok):
    f = _one(_spec(lora={"alpha": alpha}), "lora.alpha_positive")
    assert f.ok is ok
    if not ok:
        assert "nothing learns" in f.detail and "alpha=" in f.detail


@pytest.mark.parametrize("p,ok", [(0.0, True), (None, True), (0.05, False)])
def test_lora_dropout_is_refused(p, ok):
    assert _one(_spec(lora={"dropout": p}), "lora.no_dropout").ok is ok


@pytest.mark.parametrize("rollout,trainer,ok", [("bfloat16", "bfloat16", True), ("float16", "bfloat16", False),
                                                ("bf16", "bfloat16", True), ("float32", "bfloat16", False)])
def test_rollout_dtype_must_be_the_trainers(rollout, trainer, ok):
    f = _one(_spec(rollout={"dtype": rollout}, trainer_dtype=trainer), "verl.rollout_dtype_matches_trainer")
    assert f.ok is ok
    if not ok:
        assert f"rollout.dtype={trainer}" in f.detail


def test_token_budget_below_one_sequence_is_refused():
    base = dict(use_dynamic_bsz=True, prompt_len=1024, response_len=4096)
    low = _one(_spec(**base, **{"actor.ppo_max_token_len_per_gpu": 4096,
                                "rollout.log_prob_max_token_len_per_gpu": 8192}), "verl.token_budget_holds_one_sequence")
    assert not low.ok and "ppo_max_token_len_per_gpu >= 5120" in low.detail and "seqlen_balancing.py:384" in low.source
    fine = _one(_spec(**base, **{"actor.ppo_max_token_len_per_gpu": 5120,
                                 "rollout.log_prob_max_token_len_per_gpu": 5120}), "verl.token_budget_holds_one_sequence")
    assert fine.ok
    static = dict(base, use_dynamic_bsz=False)
    assert _one(_spec(**static, **{"actor.ppo_max_token_len_per_gpu": 10}), "verl.token_budget_holds_one_sequence") is None


def test_a_quantized_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k2", "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    f = _one(_spec(model_path=str(tmp_path)), "model.checkpoint_not_quantized")
    assert not f.ok and "quant_method='fp8'" in f.detail and "bf16 checkpoint" in f.detail
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k2"}))
    assert _one(_spec(model_path=str(tmp_path)), "model.checkpoint_not_quantized").ok


SCALE = ["01_kimi_k2_lora_grpo", "02_kimi_k2_lora_grpo_r3", "04_moonlight_16b_a3b_r3"]


@pytest.mark.parametrize("experiment,rung", [(e, None) for e in SCALE] + [
    ("01_kimi_k2_lora_grpo", 1), ("01_kimi_k2_lora_grpo", 3), ("02_kimi_k2_lora_grpo_r3", 1),
    ("02_kimi_k2_lora_grpo_r3", 3), ("04_moonlight_16b_a3b_r3", 1), ("04_moonlight_16b_a3b_r3", 2)])
def test_scale_experiments_and_rungs_freeze_the_expert_bias(experiment, rung):
    """The key reaches verl's override_transformer_config, which verl hands to Bridge's provider
    (transformer_impl.py:371-372, 400-403) and so to megatron-core's TransformerConfig."""
    where = REPO / "experiments" / experiment
    cfg = compose_experiment(load_experiment(rung_file(where, rung) if rung else where))
    otc = OmegaConf.select(cfg, "actor_rollout_ref.actor.megatron.override_transformer_config")
    assert otc["moe_router_bias_update_rate"] == 0


def test_a_path_missing_where_the_job_starts_fails_a_launch_and_is_named_in_a_dry_run(tmp_path):
    there = tmp_path / "model"
    there.mkdir()
    gone = str(tmp_path / "lustre" / "kimi_k2_bf16")
    for launching in (True, False):
        f = _one(_spec(model_path=gone, train_files=[str(there)], launching=launching), "paths.exist_where_the_job_runs")
        assert f.ok is not launching and gone in f.detail
        tok = _one(_spec(model_path=gone, launching=launching), "model.tokenizer_loads")
        assert (tok is None) if not launching else (not tok.ok and "does not exist where the job starts" in tok.detail)
    hub = _one(_spec(model_path="moonshotai/Kimi-K2-Instruct", train_files=str(there), launching=True),
               "paths.exist_where_the_job_runs")
    assert hub.ok  # a hub id is the hub's to find


def test_the_fp8_hub_release_is_refused_at_launch_and_named_in_a_dry_run():
    """Kimi-K2-Instruct's published config.json carries block-FP8 quantization; a launch whose model path is
    the hub id (or a missing directory) is refused, a dry run off the cluster says so and goes on."""
    assert K2["quantization_config"]["quant_method"] == "fp8"
    hub = dict(model_path="moonshotai/Kimi-K2-Instruct")
    launch = _one(_spec(**hub, launching=True), "model.checkpoint_not_quantized")
    assert not launch.ok and "published config.json of Kimi-K2" in launch.detail
    dry = _one(_spec(**hub, launching=False), "model.checkpoint_not_quantized")
    assert dry.ok and dry.detail.startswith("dry run:") and "a launch refuses it" in dry.detail
    assert _one(_spec(MOON, **{"model_path": "moonshotai/Moonlight-16B-A3B"}, launching=True),
                "model.checkpoint_not_quantized").ok


def test_turning_the_bias_update_back_on_from_the_command_line_is_refused(capsys):
    from moerl.verl_ext import launch

    argv = [str(REPO / "experiments" / "04_moonlight_16b_a3b_r3"), "--dry-run",
            "actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_bias_update_rate=0.001"]
    assert launch.main(argv) == 2
    err = capsys.readouterr().err
    assert "[megatron.expert_bias_frozen_under_lora] expert-bias update rate 0.001" in err and "Traceback" not in err
