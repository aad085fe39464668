"""The aux-loss-free expert bias drifts under LoRA training unless its update rate is 0: megatron-core's
own ``_update_router_expert_bias`` on a tiny DeepSeek-style MoE (sigmoid router with expert bias, as
Megatron-Bridge's DeepSeek-V3 / Kimi bridges build it), CPU, gloo, world size 1.

megatron-core calls it from ``finalize_model_grads`` after every step when
``moe_router_enable_expert_bias`` is on (0.19.2 distributed/finalize_model_grads.py:665-670; verl
registers finalize_model_grads as the model's hook, utils/megatron_utils.py:1738). The bias is a buffer,
not a LoRA parameter: the adapter-only refit never sends it again and the LoRA checkpoint drops it, so
any movement here is routing that the trainer has and vLLM does not. The rate the experiments set is
read from their own YAML. Runs on whichever megatron-core the environment has: 0.16.1 in the main venv,
0.19.2 via ``scripts/test_upstream.sh mcore``.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (requirements.txt)")
pytest.importorskip("verl.utils.megatron.router_replay_utils", reason="verl is not installed")

from megatron_harness import NUM_EXPERTS, VOCAB, megatron_on_cpu, packed_causal_mask  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OTC = "actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_bias_update_rate"


@pytest.fixture(scope="module")
def megatron():
    with megatron_on_cpu():
        yield


def experiment_rate(experiment: str) -> float:
    """The update rate an experiment's YAML (with its base chain) hands verl's override_transformer_config."""
    from moerl.verl_ext.compose import flatten_overrides, read_yaml_chain

    data, _ = read_yaml_chain(REPO / "experiments" / experiment / "experiment.yaml")
    found = dict((k.lstrip("+"), v) for k, v in flatten_overrides(data["verl"]))
    return float(found[OTC])


def _model(rate: float | None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    extra = {} if rate is None else {"moe_router_bias_update_rate": rate}  # None: megatron-core's default
    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=NUM_EXPERTS,
        moe_router_topk=2, moe_ffn_hidden_size=16, moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none", moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, init_method_std=0.5, **extra)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64), cfg


def _biases(model) -> list[torch.Tensor]:
    return [m.expert_bias.detach().clone() for m in model.modules() if getattr(m, "expert_bias", None) is not None]


def train_steps(model, cfg, steps: int = 3) -> float:
    """``steps`` forward/backward passes, each closed by megatron-core's expert-bias update as
    finalize_model_grads closes a step; returns the largest |bias - bias at load| over every router."""
    from megatron.core import parallel_state as mpu
    import importlib

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    update = fmg._update_router_expert_bias
    kwargs = {}
    if "tp_dp_cp_group" in inspect.signature(update).parameters:  # 0.19.2 passes the group explicitly
        kwargs["tp_dp_cp_group"] = mpu.get_tensor_and_data_parallel_group(with_context_parallel=True)
    loaded = _biases(model)
    model.train()
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (1, 32), generator=gen)
        pos = torch.arange(32).unsqueeze(0)
        loss = model(tokens, pos, attention_mask=packed_causal_mask([32]), labels=tokens).float().mean()
        loss.backward()
        update([model], cfg, **kwargs)
        fmg.reset_model_temporary_tensors(cfg, [model])
        model.zero_grad(set_to_none=True)
    return max(float((now - then).abs().max()) for now, then in zip(_biases(model), loaded))


def test_megatron_cores_default_rate_moves_the_expert_bias_every_step(megatron):
    model, cfg = _model(None)
    assert cfg.moe_router_bias_update_rate == pytest.approx(1e-3)  # what the bridges leave in place
    drift = train_steps(model, cfg, steps=3)
    assert drift == pytest.approx(3e-3, rel=1e-4)  # sign update: one rate per step for an unbalanced expert


@pytest.mark.parametrize("experiment", ["01_kimi_k2_lora_grpo", "04_moonlight_16b_a3b_r3"])
def test_the_experiments_rate_keeps_the_expert_bias_at_the_checkpoints(megatron, experiment):
    rate = experiment_rate(experiment)
    model, cfg = _model(rate)
    assert train_steps(model, cfg, steps=3) == 0.0


def test_the_side_log_fails_a_run_whose_bias_moved_and_passes_a_frozen_one(megatron, tmp_path):
    """moerl's wrapper around finalize_model_grads, here around a finalisation that runs megatron-core's
    own bias update: it records the drift from the loaded bias and check_first_steps' verdict reads it."""
    import importlib

    from moerl.verl_ext import expert_bias_log

    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    for rate, ok in ((None, False), (experiment_rate("01_kimi_k2_lora_grpo"), True)):
        model, cfg = _model(rate)
        log = tmp_path / f"rate{rate}.expert_bias.jsonl"
        finalize = expert_bias_log.wrap(lambda m, *a, **k: fmg._update_router_expert_bias(m, cfg, **k), log)
        kwargs = {}
        if "tp_dp_cp_group" in inspect.signature(fmg._update_router_expert_bias).parameters:
            from megatron.core import parallel_state as mpu
            kwargs["tp_dp_cp_group"] = mpu.get_tensor_and_data_parallel_group(with_context_parallel=True)
        model.train()
        tokens = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(1))
        model(tokens, torch.arange(32).unsqueeze(0), attention_mask=packed_causal_mask([32]),
              labels=tokens).float().mean().backward()
        finalize([model], **kwargs)  # step 1
        verdict = expert_bias_log.check(log)
        assert verdict.ok is ok, verdict.detail
        if not ok:
            assert "moved 0.001" in verdict.detail and "by gradient step 1" in verdict.detail
