"""The constraint layer's rules on hand-built specs (no Hydra): upstream's own code decides where it
runs on CPU, and the IcePop band is what verl's helper computes."""
import math
import re

import pytest

from moerl import planner
from moerl.verl_ext import constraints as C

K2 = planner.load_public_config("kimi_k2")
QWEN = planner.load_public_config("qwen3_30b_a3b")


def _rules(spec, prefix):
    return {f.rule: f for f in C.check_all(spec, only=(prefix,))}


@pytest.mark.parametrize("first,last,ok", [(None, None, False), (None, 5, True), (4, 1, False), (5, 0, False),
                                           (4, 9, True)])
def test_megatron_layer_distribution_for_61_layers_is_megatron_cores(first, last, ok):
    """61 layers over PP8: an even split asserts; 7x8 + 5 and 4 + 6x8 + 9 work; 4 + 56/6 + 1 leaves a
    middle that does not divide; a stage of 0 layers is refused."""
    spec = C.LaunchSpec(model=K2, n_gpus=64, tp=8, pp=8, ep=8, etp=1, sequence_parallel=True,
                        first_stage_layers=first, last_stage_layers=last)
    found = _rules(spec, "megatron.")
    verdict = found["megatron.transformer_config"].ok and found.get(
        "megatron.layer_distribution", found["megatron.transformer_config"]).ok
    assert verdict is ok, [f.line() for f in found.values()]


def test_megatron_messages_quote_megatron_core():
    spec = C.LaunchSpec(model=K2, n_gpus=64, tp=8, pp=8, ep=8, etp=1, sequence_parallel=True)
    f = _rules(spec, "megatron.layer_distribution")["megatron.layer_distribution"]
    assert not f.ok and "num_layers should be divisible by pipeline_model_parallel_size" in f.detail
    assert "num_layers_in_last_pipeline_stage=5" in f.detail  # the suggested fix
    assert "transformer_block.py" in f.source


def test_megatron_query_groups_rule_is_megatron_cores():
    spec = C.LaunchSpec(model=QWEN, n_gpus=48, tp=3, pp=1, ep=1, etp=1, sequence_parallel=True)
    f = _rules(spec, "megatron.transformer_config")["megatron.transformer_config"]
    assert not f.ok and "must be a multiple of tensor_model_parallel_size (3)" in f.detail


def _vllm_spec(tp, dp, ep, fs, rank=32):
    return C.LaunchSpec(model=K2, n_gpus=64, rollout=dict(name="vllm", tp=tp, dp=dp, ep=ep, pp=1),
                        lora=dict(rank=rank, fully_sharded_loras=fs, target_modules=["linear_fc1", "linear_fc2"]))


@pytest.mark.parametrize("tp,dp,ep,fs,ok", [
    (64, 1, 64, False, True),    # EP with DP=1: no MoE sequence parallel
    (1, 64, 64, False, True),    # EP with TP=1
    (8, 8, 64, False, False),    # TP>1 and DP>1 with EP: sequence-parallel MoE
    (64, 1, 64, True, False),    # EP + fully-sharded LoRA
    (64, 1, 1, False, None),     # no EP: rule does not apply
])
def test_vllm_moe_lora_expert_parallel(tp, dp, ep, fs, ok):
    f = _rules(_vllm_spec(tp, dp, ep, fs), "vllm.moe_lora_expert_parallel").get("vllm.moe_lora_expert_parallel")
    assert (f.ok if f else None) is ok


@pytest.mark.parametrize("tp,ok", [(64, False), (32, True), (16, True), (8, True)])
def test_vllm_fully_sharded_rank_must_divide_by_tp(tp, ok):
    f = _rules(_vllm_spec(tp, 1, 1, True), "vllm.fully_sharded")["vllm.fully_sharded_rank_divides_tp"]
    assert f.ok is ok


def test_verl_icepop_preset_band_and_the_token_k1_misreading():
    """verl's own helper: the decoupled_token_icepop preset keeps rho in [0.5, 5]; rollout_rs=token_k1
    with the same string thresholds -log rho and keeps [0.2, 2]."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    preset = RolloutCorrectionConfig.decoupled_token_icepop()
    lo, hi = C.verl_kept_ratio_band({"rollout_is": preset.rollout_is, "rollout_is_threshold": preset.rollout_is_threshold,
                                     "rollout_rs": preset.rollout_rs})
    assert math.isclose(lo, 0.5, rel_tol=0.01) and math.isclose(hi, 5.0, rel_tol=0.01)
    lo, hi = C.verl_kept_ratio_band({"rollout_is": "token", "rollout_is_threshold": 5.0, "rollout_rs": "token_k1",
                                     "rollout_rs_threshold": "0.5_5.0"})
    assert math.isclose(lo, 0.2, rel_tol=0.01) and math.isclose(hi, 2.0, rel_tol=0.01)


def test_epochs_rule_counts_verl_steps():
    spec = C.LaunchSpec(model=K2, n_gpus=64, verl=dict(train_batch_size=64, total_epochs=1, total_training_steps=200,
                                                        train_prompts=7500))
    f = _rules(spec, "verl.epochs")["verl.epochs_reach_steps"]
    assert not f.ok and "stops at step 117" in f.detail and "total_epochs=2" in f.detail
    assert "V1 trainer" in f.detail and "v1/trainer_base.py" in f.source  # the loop verl 0.9.1 runs


def test_epochs_rule_cites_the_loop_main_ppo_runs():
    """verl 0.9.1's main_ppo runs the V1 trainer when trainer.use_v1, which ppo_megatron_trainer sets."""
    import inspect

    from verl.trainer import main_ppo

    from moerl.verl_ext.compose import compose_overrides, select

    assert "if config.trainer.use_v1:" in inspect.getsource(main_ppo)
    assert select(compose_overrides([]), "trainer.use_v1") is True


def test_every_rule_names_an_upstream_source():
    for name, source, _ in C.RULES:
        assert re.search(r"(megatron-core|vllm|verl|megatron-bridge)", source), name




# Megatron layouts whose verdicts must not depend on the Megatron-Core version: the repo's own,
# upstream recipes, and the broken ones of the known-bad corpus.
LAYOUTS = [
    dict(model="kimi_k2", n_gpus=64, tp=8, pp=8, ep=8, etp=1, sequence_parallel=True, last_stage_layers=5),
    dict(model="kimi_k2", n_gpus=64, tp=8, pp=8, ep=8, etp=1, sequence_parallel=True),
    dict(model="kimi_k2", n_gpus=64, tp=8, pp=8, ep=8, etp=1, sequence_parallel=True, first_stage_layers=4,
         last_stage_layers=1),
    dict(model="kimi_k2", n_gpus=1024, tp=8, pp=16, vpp=2, ep=64, etp=1, sequence_parallel=True,
         pipeline_layout="Et|(tt|)*30L"),
    dict(model="deepseek_v3", n_gpus=1024, tp=2, pp=8, vpp=4, ep=64, etp=1, sequence_parallel=True,
         pipeline_layout="Et|(tt|)*30mL", mtp_layers=1),
    dict(model="deepseek_v3", n_gpus=256, tp=1, pp=16, ep=16, etp=1, first_stage_layers=4, last_stage_layers=1),
    dict(model="moonlight_16b_a3b", n_gpus=24, tp=4, pp=3, ep=4, etp=1, sequence_parallel=True),
    dict(model="moonlight_16b_a3b", n_gpus=24, tp=2, pp=3, vpp=2, ep=8, etp=1, sequence_parallel=True),
    dict(model="moonlight_16b_a3b", n_gpus=32, tp=32, pp=1, ep=8, etp=1, sequence_parallel=True),
    dict(model="qwen3_30b_a3b", n_gpus=8, tp=2, pp=2, cp=2, ep=4, etp=1, sequence_parallel=True),
]


def _specs():
    return [C.LaunchSpec(model=planner.load_public_config(d["model"]),
                         **{k: v for k, v in d.items() if k != "model"}) for d in LAYOUTS]


def test_megatron_rules_agree_under_the_clusters_megatron_core():
    """The same rules under Megatron-Core 0.19.2 (the requirements/gpu.txt pin), run in a separate
    process on the wheel unpacked by scripts/setup_upstream_mcore.sh; skipped where it is absent."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    site = os.environ.get("MOERL_UPSTREAM_MCORE", "/tmp/moerl-upstream-mcore/site")
    if not (Path(site) / "megatron" / "core").is_dir():
        pytest.skip(f"Megatron-Core 0.19.2 not unpacked at {site}: run scripts/setup_upstream_mcore.sh")
    here = C.megatron_verdicts(_specs())
    src = str(Path(C.__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-m", "moerl.verl_ext.constraints"], input=json.dumps(LAYOUTS),
                         capture_output=True, text=True, timeout=300, check=True,
                         env={**os.environ, "PYTHONPATH": f"{site}:{src}", "OMP_NUM_THREADS": "1"})
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert theirs["megatron_core"] == "0.19.2"
    assert theirs["verdicts"] == here
    assert [v["megatron.transformer_config"] and v.get("megatron.layer_distribution", True) for v in here] == [
        True, False, False, True, True, True, True, False, False, True]


_VLLM_PROBE = r'''
import json, sys, types, typing
import vllm
from vllm.config import ParallelConfig
from vllm.config.lora import LoRAConfig, MaxLoRARanks
from vllm.lora.layers.fused_moe import FusedMoEWithLoRA
verdicts = []
for tp, dp, ep, fs in json.loads(sys.argv[1]):
    pc = ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep > 1)
    layer = types.SimpleNamespace(use_ep=ep > 1, moe_config=types.SimpleNamespace(
        moe_parallel_config=types.SimpleNamespace(all2all_backend=pc.all2all_backend,
                                                  is_sequence_parallel=pc.use_sequence_parallel_moe)))
    try:  # vLLM's own checks, with the EP / sequence-parallel flags vLLM's ParallelConfig derives
        FusedMoEWithLoRA._ep_check(layer)
        FusedMoEWithLoRA._verify_ep_fs(layer, LoRAConfig(max_lora_rank=32, fully_sharded_loras=fs))
        verdicts.append(True)
    except AssertionError:
        verdicts.append(False)
print(json.dumps({"vllm": vllm.__version__, "ranks": list(typing.get_args(MaxLoRARanks)), "verdicts": verdicts}))
'''


def test_vllm_moe_lora_ep_rule_matches_vllms_own_checks():
    """FusedMoEWithLoRA._ep_check/_verify_ep_fs and ParallelConfig.use_sequence_parallel_moe from a
    vLLM CPU build (an optional environment: MOERL_VLLM_PYTHON, default .venv-vllm/bin/python) decide
    the same cases as the encoded rule; skipped where that environment is absent. That environment
    may hold a newer vLLM than the cluster's 0.24.0 pin; the two checks read the same in 0.24.0's wheel."""
    import json
    import os
    import subprocess
    from pathlib import Path

    repo = Path(C.__file__).resolve().parents[3]
    py = Path(os.environ.get("MOERL_VLLM_PYTHON", repo / ".venv-vllm" / "bin" / "python"))
    if not py.exists():
        pytest.skip(f"no vLLM CPU environment at {py} (set MOERL_VLLM_PYTHON)")
    cases = [(64, 1, 64, False), (1, 64, 64, False), (8, 8, 64, False), (64, 1, 64, True), (32, 2, 64, False)]
    out = subprocess.run([str(py), "-c", _VLLM_PROBE, json.dumps(cases)], capture_output=True, text=True,
                         timeout=600, check=True, cwd="/", env={**os.environ, "OMP_NUM_THREADS": "1"})
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    ours = [_rules(_vllm_spec(tp, dp, ep, fs), "vllm.moe_lora")["vllm.moe_lora_expert_parallel"].ok
            for tp, dp, ep, fs in cases]
    assert theirs["verdicts"] == ours == [True, True, False, False, False]
    assert tuple(theirs["ranks"]) == planner.VLLM_MAX_LORA_RANKS
