"""The launcher rules that keep a cluster run alive and training the right thing in its first hour:
each upstream defect found by reading verl 0.9.1, Megatron-Bridge 0.6.x, Megatron-Core and vLLM 0.24.0
is refused by a named rule, and the experiments' defaults avoid it. The runtime-env path runs through
a real local Ray and verl's own FileLogger."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

from moerl import planner
from moerl.verl_ext import constraints as C
from moerl.verl_ext import launch
from moerl.verl_ext.compose import compose_experiment, load_experiment, select

EXP = Path(__file__).resolve().parents[2] / "experiments"
K2 = planner.load_public_config("kimi_k2")
MOON = planner.load_public_config("moonlight_16b_a3b")
QWEN = planner.load_public_config("qwen3_30b_a3b")
LORA = dict(rank=32, target_modules=["linear_proj", "linear_fc1", "linear_fc2"], share_expert_adapters=True)
ROLLOUT = dict(name="vllm", tp=8, dp=1, ep=8, pp=1, max_model_len=5120, calculate_log_probs=True)


def _rule(spec, name):
    return next((f for f in C.check_all(spec, only=(name,)) if f.rule == name), None)


def _spec(model=MOON, otc=None, bridge="0.6.2", **kw):
    base = dict(model=model, n_gpus=8, tp=2, ep=8, etp=1, sequence_parallel=True, lora=dict(LORA),
                rollout=dict(ROLLOUT), verl=dict(bridge_version=bridge, otc=otc or {}))
    base.update(kw)
    return C.LaunchSpec(**base)


# --- finding 2: gradient-accumulation fusion without APEX ------------------------------------------

def test_fusion_is_on_unless_the_experiment_turns_it_off():
    """Bridge's DeepSeek-V3/Kimi bridges force fusion on and gpt_provider turns it on with TE: unset means on."""
    assert C.grad_accumulation_fusion(_spec())[0] is True
    assert C.grad_accumulation_fusion(_spec(model=QWEN))[0] is True
    assert C.grad_accumulation_fusion(_spec(otc={"gradient_accumulation_fusion": False}))[0] is False
    # verl's own converter (vanilla mbridge) leaves Megatron-Core's default, off
    assert C.grad_accumulation_fusion(_spec(verl=dict(otc={}, use_mbridge=True, vanilla_mbridge=True)))[0] is False


def test_fusion_without_apex_is_refused(monkeypatch):
    monkeypatch.setattr(C, "apex_fused_wgrad_available", lambda: False)
    f = _rule(_spec(model=QWEN, ep=1), "bridge.grad_accumulation_fusion_needs_apex")
    assert not f.ok and "ColumnParallelLinear" in f.detail and "gradient_accumulation_fusion=false" in f.detail
    assert _rule(_spec(model=QWEN, ep=1, otc={"gradient_accumulation_fusion": False}),
                 "bridge.grad_accumulation_fusion_needs_apex").ok
    monkeypatch.setattr(C, "apex_fused_wgrad_available", lambda: True)  # an image that builds APEX
    assert _rule(_spec(model=QWEN, ep=1), "bridge.grad_accumulation_fusion_needs_apex").ok


def test_fusion_turned_back_on_from_the_command_line_is_refused(capsys):
    assert launch.main([str(EXP / "03_qwen3_30b_a3b_lora_mitigations"), "--arm", "r3", "--dry-run",
                        "actor_rollout_ref.actor.megatron.override_transformer_config.gradient_accumulation_fusion=true"]
                       ) == 2
    err = capsys.readouterr().err
    assert "[bridge.grad_accumulation_fusion_needs_apex]" in err and "Traceback" not in err


# --- finding 3: the shared expert adapter under EP -------------------------------------------------

@pytest.mark.parametrize("bridge,fusion,ok,words", [
    ("0.5.1", False, False, "nothing broadcasts"),            # hook, but no broadcast: copies start apart
    ("0.6.2", True, False, "dummy"),                  # broadcast, but the hook sums a dummy grad under fusion
    ("0.6.2", False, True, "fusion off"),
    ("0.6.0", False, True, "fusion off"),
    ("0.7.0", True, True, "assumes it carries PR #6009"),
])
def test_shared_expert_adapter_under_ep_by_bridge_version_and_fusion(bridge, fusion, ok, words):
    f = _rule(_spec(bridge=bridge, otc={"gradient_accumulation_fusion": fusion}),
              "bridge.shared_expert_adapter_under_ep")
    assert f.ok is ok and words in f.detail


def test_shared_expert_adapter_needs_no_rule_at_ep1():
    assert _rule(_spec(ep=1), "bridge.shared_expert_adapter_under_ep") is None


# --- finding 4: shared-expert overlap with shared-expert LoRA at TP > 1 -----------------------------

def test_shared_expert_overlap_forced_by_the_bridge_is_refused_at_tp_above_1():
    f = _rule(_spec(model=K2, tp=8), "bridge.shared_expert_overlap_with_lora")
    assert not f.ok and "8 times" in f.detail and "moe_shared_expert_overlap=false" in f.detail
    assert _rule(_spec(model=K2, tp=8, otc={"moe_shared_expert_overlap": False}),
                 "bridge.shared_expert_overlap_with_lora").ok
    assert _rule(_spec(model=K2, tp=1), "bridge.shared_expert_overlap_with_lora") is None   # summed once
    assert _rule(_spec(model=QWEN, tp=2), "bridge.shared_expert_overlap_with_lora") is None  # no shared experts


# --- the accepted-although-broken list ---------------------------------------------------------------

def test_expert_tensor_parallel_with_expert_lora_is_refused():
    f = _rule(_spec(etp=2), "bridge.expert_tensor_parallel_with_expert_lora")
    assert not f.ok and "#5634" in f.source and "expert_tensor_parallel_size=1" in f.detail
    f = _rule(_spec(etp=None), "bridge.expert_tensor_parallel_with_expert_lora")  # unset: ETP = TP = 2
    assert not f.ok
    assert _rule(_spec(etp=1), "bridge.expert_tensor_parallel_with_expert_lora").ok


@pytest.mark.parametrize("chunked,mnbt,ok", [(False, 4096, False), (False, 8192, True), (True, 4096, None)])
def test_no_chunked_prefill_needs_a_whole_sequence_per_step(chunked, mnbt, ok):
    r = dict(ROLLOUT, enable_chunked_prefill=chunked, max_num_batched_tokens=mnbt)
    f = _rule(_spec(rollout=r), "vllm.batched_tokens_hold_one_sequence")
    assert (f.ok if f else None) is ok
    if ok is False:
        assert "max_num_batched_tokens=4096 < max_model_len=5120" in f.detail


def test_rollout_logprobs_off_and_r3_off_vllm_are_refused(capsys):
    moon = str(EXP / "04_moonlight_16b_a3b_r3")
    assert launch.main([moon, "--dry-run", "actor_rollout_ref.rollout.calculate_log_probs=false"]) == 2
    assert "[verl.rollout_logprobs_for_mismatch]" in capsys.readouterr().err
    f = _rule(_spec(rollout=dict(ROLLOUT, name="sglang", routing_replay=True)), "verl.r3_needs_vllm_rollout")
    assert not f.ok and "rollout.name=vllm" in f.detail


def test_moe_layer_freq_as_an_int_is_evaluated_not_a_crash(capsys):
    """04 with moe_layer_freq=1: Megatron would make layer 0 an MoE layer; the rule says so by name."""
    assert launch.main([str(EXP / "04_moonlight_16b_a3b_r3"), "--dry-run",
                        "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_layer_freq=1"]) == 2
    err = capsys.readouterr().err
    assert "[replay.dense_first_layer_mapping]" in err and "could not be evaluated" not in err
    assert "moe_layer_freq=1 makes the MoE layers [1, 1," in err
    assert launch.megatron_moe_pattern(2, 5) == [1, 0, 1, 0, 1]


# --- finding 5: seeds never share a checkpoint directory or a wandb name ------------------------------

def test_two_seeds_get_their_own_names_and_checkpoint_dirs(monkeypatch, tmp_path):
    monkeypatch.setenv(launch.CHECKPOINT_ROOT_ENV, str(tmp_path / "ckpt"))
    d = EXP / "03_qwen3_30b_a3b_lora_mitigations"
    got = {}
    for seed in (1, 2):
        _, cfg, _, _ = launch.prepare(d, "r3", seed=seed)
        got[seed] = (select(cfg, "trainer.experiment_name"), select(cfg, "trainer.default_local_dir"),
                     select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars.WANDB_TAGS"))
    # verl names the wandb run trainer.experiment_name (verl/utils/tracking.py Tracking: wandb.init(name=...))
    assert got[1][0] == "03_qwen3_30b_a3b_r3_seed1" and got[2][0] == "03_qwen3_30b_a3b_r3_seed2"
    assert got[1][1] == str(tmp_path / "ckpt" / "moerl" / "03_qwen3_30b_a3b_r3_seed1")
    assert got[2][1] == str(tmp_path / "ckpt" / "moerl" / "03_qwen3_30b_a3b_r3_seed2")
    assert "seed:1" in got[1][2] and "seed:2" in got[2][2]


def test_a_checkpoint_dir_given_on_the_command_line_wins(tmp_path):
    _, cfg, _, _ = launch.prepare(EXP / "04_moonlight_16b_a3b_r3", seed=3,
                                  extra=[f"trainer.default_local_dir={tmp_path}/mine"])
    assert select(cfg, "trainer.default_local_dir") == f"{tmp_path}/mine"
    assert select(cfg, "trainer.experiment_name") == "04_moonlight_16b_a3b_r3_seed3"


# --- finding 1: the runtime env reaches Ray workers resolved ------------------------------------------

RUNG = EXP / "04_moonlight_16b_a3b_r3" / "bringup" / "rung1.yaml"


def test_unresolved_runtime_env_is_refused_and_the_launcher_resolves_it(monkeypatch, tmp_path):
    monkeypatch.setenv("MOERL_REPO", str(tmp_path))
    bare = compose_experiment(load_experiment(RUNG))  # the rung file as verl would get it without the launcher
    assert set(C.unresolved_runtime_env(bare)) == {"VERL_FILE_LOGGER_PATH"}
    f = _rule(C.LaunchSpec(model=MOON, n_gpus=1, verl={"_cfg": bare}), "verl.runtime_env_resolved")
    assert not f.ok and "VERL_FILE_LOGGER_PATH" in f.detail and "update_envs" in f.source
    _, cfg, checks, _ = launch.prepare(RUNG)
    assert C.unresolved_runtime_env(cfg) == {}
    assert any(c.name == "verl.runtime_env_resolved" and c.ok for c in checks)
    assert select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH") == \
        str(tmp_path / "logs" / "bringup" / "04_rung1.jsonl")


def ray_init_kwargs_as_main_ppo(config) -> dict:
    """What verl 0.9.1's ``run_ppo`` (verl/trainer/main_ppo.py) hands to ``ray.init``, line for line."""
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    default_runtime_env = get_ppo_ray_runtime_env(config)
    ray_init_kwargs = config.ray_kwargs.get("ray_init", {})
    runtime_env_kwargs = ray_init_kwargs.get("runtime_env", {})
    runtime_env = OmegaConf.merge(default_runtime_env, runtime_env_kwargs)
    ray_init_kwargs = OmegaConf.create({**ray_init_kwargs, "runtime_env": runtime_env})
    return OmegaConf.to_container(ray_init_kwargs)


@pytest.mark.slow
def test_verls_file_logger_opens_its_path_inside_a_ray_worker(monkeypatch, tmp_path):
    """A real local Ray started with the kwargs main_ppo builds; verl's FileLogger constructed in an actor.
    The launcher's config logs to the resolved path; the rung file as written (the runtime env that
    main_ppo passes on unresolved) makes the same actor raise FileNotFoundError."""
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("MOERL_REPO", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    bare = compose_experiment(load_experiment(RUNG))
    _, cfg, _, _ = launch.prepare(RUNG)
    kwargs = ray_init_kwargs_as_main_ppo(cfg)
    path = Path(kwargs["runtime_env"]["env_vars"]["VERL_FILE_LOGGER_PATH"])
    path.parent.mkdir(parents=True)  # as launch.main does before it starts verl
    kwargs.update(num_cpus=1, include_dashboard=False)

    @ray.remote(num_cpus=0)
    class Logger:
        def log_once(self):
            from verl.utils.tracking import FileLogger

            logger = FileLogger("moerl", "04_rung1")
            logger.log({"x": 1.0}, step=1)
            logger.finish()
            return logger.filepath

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ray.init(**kwargs)
    try:
        assert ray.get(Logger.remote().log_once.remote()) == str(path)
        bare_env = ray_init_kwargs_as_main_ppo(bare)["runtime_env"]
        assert bare_env["env_vars"]["VERL_FILE_LOGGER_PATH"].startswith("${oc.env:MOERL_REPO")
        with pytest.raises(FileNotFoundError):  # Ray re-raises the worker's error as its type
            ray.get(Logger.options(runtime_env={"env_vars": bare_env["env_vars"]}).remote().log_once.remote())
    finally:
        ray.shutdown()
        for sig, h in handlers.items():
            signal.signal(sig, h)
    assert '"step":1' in path.read_text()
