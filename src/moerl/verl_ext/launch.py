"""Launch a scale experiment: compose against verl's config, validate, print, run main_ppo.

    python -m moerl.verl_ext.launch experiments/02_kimi_k2_lora_grpo_r3 [--arm X] [--seed N] [--dry-run] [k=v ...]

Every check here exists because the mistake it catches costs a multi-node job: it names the
constraint that broke. The upstream rules (Megatron-Core, vLLM, verl, LoRA targets) live in
``moerl.verl_ext.constraints``; this module adds moerl's own and the capacity plan. The run itself is ``python -m verl.trainer.main_ppo`` with the composed
overrides; verl starts Ray itself, or joins the cluster in ``RAY_ADDRESS`` (multi-node, see
scripts/slurm_verl.sbatch). Before it starts, ``moerl.verl_ext.resume_check`` verifies what verl would
resume (the same run, a complete step) and the run's lock is taken for the life of main_ppo.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from moerl import planner, runlock
from moerl.config import LossConfig, from_dict
from moerl.verl_ext import constraints, losses, refit_log, resume_check
from moerl.verl_ext.compose import (VERL_CONFIG_NAME, Experiment, ExperimentError, compose_experiment,
                                    env_for, load_experiment, select)

R3_MIN_VLLM = constraints.R3_MIN_VLLM
REPO = Path(__file__).resolve().parents[3]


class ConstraintError(ValueError):
    """A composed experiment that violates a layout/feature constraint; names the constraint."""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def pinned_version(package: str, requirements: Path = REPO / "requirements/gpu.txt") -> str | None:
    """The ``package==X`` pin in requirements/gpu.txt (what the cluster installs)."""
    if not requirements.exists():
        return None
    for line in requirements.read_text().splitlines():
        m = re.match(rf"^\s*{re.escape(package)}(\[[^\]]*\])?==([^\s;#]+)", line, re.I)
        if m:
            return m.group(2)
    return None


def _installed_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def vllm_version_for_run() -> tuple[str, str]:
    """(version, where it came from): the installed vLLM if any, else the requirements/gpu.txt pin."""
    try:
        from importlib.metadata import version

        return version("vllm"), "installed"
    except Exception:
        pin = pinned_version("vllm")
        return (pin or "0"), "requirements/gpu.txt pin" if pin else "not installed and not pinned"


def bridge_version_for_run() -> str | None:
    """The installed Megatron-Bridge, else the version requirements/gpu.txt installs (its install
    line is a comment: Bridge goes in with --no-deps)."""
    ver = _installed_version("megatron-bridge")
    if ver:
        return ver
    req = REPO / "requirements/gpu.txt"
    m = re.search(r"megatron-bridge==([0-9][^\s;#]*)", req.read_text()) if req.exists() else None
    return m.group(1) if m else None


def layout_from_cfg(cfg, moerl: dict) -> planner.Layout:
    a = "actor_rollout_ref.actor.megatron."
    r = "actor_rollout_ref.rollout."
    otc = select(cfg, a + "override_transformer_config") or {}
    lora = select(cfg, "actor_rollout_ref.model.lora") or {}
    etp = select(cfg, a + "expert_tensor_parallel_size")
    micro = select(cfg, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu") or 8192
    return planner.Layout(
        n_gpus=int(select(cfg, "trainer.nnodes")) * int(select(cfg, "trainer.n_gpus_per_node")),
        gpu_mem_gib=float(moerl.get("gpu_mem_gib", 80)),
        gpus_per_node=int(select(cfg, "trainer.n_gpus_per_node")),
        host_mem_gib=float(moerl["host_mem_gib"]) if moerl.get("host_mem_gib") else None,
        tp=int(select(cfg, a + "tensor_model_parallel_size")),
        pp=int(select(cfg, a + "pipeline_model_parallel_size")),
        ep=int(select(cfg, a + "expert_model_parallel_size")),
        etp=int(etp) if etp is not None else int(select(cfg, a + "tensor_model_parallel_size")),
        cp=int(select(cfg, a + "context_parallel_size")),
        rollout_tp=int(select(cfg, r + "tensor_model_parallel_size")),
        rollout_ep=int(select(cfg, r + "expert_parallel_size")),
        rollout_dp=int(select(cfg, r + "data_parallel_size")),
        gpu_memory_utilization=float(select(cfg, r + "gpu_memory_utilization")),
        param_offload=bool(select(cfg, a + "param_offload")),
        optimizer_offload=bool(select(cfg, a + "optimizer_offload")),
        recompute_full=otc.get("recompute_granularity") == "full",
        lora_rank=int(lora.get("rank", 0) or 0),
        lora_targets=tuple(lora.get("target_modules") or ()),
        expert_mode="shared" if lora.get("share_expert_adapters", True) else "per_expert",
        lora_merge=bool(lora.get("merge", False)),
        fully_sharded_loras=bool(lora.get("fully_sharded_loras", False)),
        prompt_len=int(select(cfg, "data.max_prompt_length")),
        response_len=int(select(cfg, "data.max_response_length")),
        micro_batch_tokens=int(micro),
        train_batch_size=int(select(cfg, "data.train_batch_size")),
        rollout_n=int(select(cfg, r + "n")),
        refit_bucket_mib=int(select(cfg, r + "checkpoint_engine.update_weights_bucket_megabytes", 2048)),
    )


def experiment_lora_rank(exp: Experiment) -> int | None:
    """The LoRA rank the experiment's own files set (None: the experiment is not a LoRA one). The
    files' overrides come first in ``exp.overrides``, before launcher and command-line ones."""
    key = "actor_rollout_ref.model.lora.rank"
    if key not in exp.origin:
        return None
    for o in exp.overrides:
        k, _, v = o.partition("=")
        if k.lstrip("+") == key:
            try:
                return int(v)
            except ValueError:
                return None
    return None


def _guarded(checks: list[Check], name: str, fn) -> None:
    """Run one group of moerl's checks; an exception inside it is that check's failure, so every
    other rule still runs and is reported."""
    try:
        fn()
    except Exception as err:  # a crash on odd input must not hide the other rules' verdicts
        checks.append(Check(name, False, f"could not be evaluated on this config ({type(err).__name__}: {err}); "
                                         f"see the other failed rules"))


def validate(cfg, exp: Experiment, launching: bool = False) -> tuple[list[Check], planner.Plan | None]:
    """Every constraint on a composed config: the upstream rules of ``constraints`` (Megatron-Core,
    vLLM, verl, LoRA targets, Megatron-Bridge) plus moerl's own (R3/R2 flags, replay layer mapping,
    losses, the capacity plan). Every rule runs even when another fails or crashes. Returns the
    checks and the capacity plan (None when the layout cannot be planned)."""
    moerl = exp.moerl
    if "model" not in moerl:
        raise ExperimentError(f"{exp.files[-1]}: moerl.model is required (a public config name, "
                              f"e.g. kimi_k2)")
    mcfg = planner.load_public_config(moerl["model"])
    checks: list[Check] = []
    state: dict = {"plan": None}

    def check(name, ok, detail):
        checks.append(Check(name, bool(ok), detail))

    def capacity():
        state["plan"] = planner.plan(mcfg, layout_from_cfg(cfg, moerl))

    _guarded(checks, "memory.fits", capacity)
    p = state["plan"]

    def upstream():
        ver, _ = vllm_version_for_run()
        spec = constraints.spec_from_verl(cfg, moerl, mcfg, plan=p, vllm_version=ver,
                                          lora_experiment_rank=experiment_lora_rank(exp),
                                          bridge_version=bridge_version_for_run())
        spec.verl["launching"] = launching  # paths must exist here only when the job starts from here
        checks.extend(Check(f.rule, f.ok, f"{f.detail} (source: {f.source})") for f in constraints.check_all(spec))

    _guarded(checks, "constraints", upstream)

    def basics():
        check("strategy", select(cfg, "actor_rollout_ref.actor.strategy") == "megatron",
              f"actor.strategy={select(cfg, 'actor_rollout_ref.actor.strategy')} (Megatron backend expected)")
        check("algorithm.grpo", select(cfg, "algorithm.adv_estimator") == "grpo",
              f"algorithm.adv_estimator={select(cfg, 'algorithm.adv_estimator')} (GRPO expected)")
        check("rollout.group_size", int(select(cfg, "actor_rollout_ref.rollout.n")) > 1,
              "GRPO needs rollout.n > 1 samples per prompt")

    _guarded(checks, "basics", basics)
    _guarded(checks, "replay", lambda: _replay_checks(cfg, mcfg, check))
    _guarded(checks, "loss", lambda: _loss_checks(cfg, check))
    _guarded(checks, "refit.side_log_reaches_workers", lambda: _refit_log_check(cfg, check))
    _guarded(checks, "verl.ref_settings_need_a_reference_model", lambda: _ref_check(cfg, exp, check))

    if p is not None:
        check("memory.fits", not p.problems, "; ".join(p.problems) or
              f"trainer {p.trainer_gib:.1f} GiB, rollout {p.rollout_gib:.1f} GiB of {float(moerl.get('gpu_mem_gib', 80)):.0f} GiB")
    return checks, p


def _replay_checks(cfg, mcfg, check) -> None:
    """Router replay: R3 needs both flags and a rollout that returns routes; R2/R3 rows must reach
    the right router (dense-first-layer models)."""
    mode = str(select(cfg, "actor_rollout_ref.actor.megatron.router_replay.mode"))
    flag = bool(select(cfg, "actor_rollout_ref.rollout.enable_rollout_routing_replay"))
    if mode == "R3" or flag:
        check("r3.flags", mode == "R3" and flag,
              f"R3 needs actor.megatron.router_replay.mode=R3 AND rollout.enable_rollout_routing_replay=True "
              f"(got mode={mode}, flag={flag})")
    if mode in ("R2", "R3"):
        check("replay.no_pad_to_length", not select(cfg, "actor_rollout_ref.actor.megatron.pad_to_length"),
              "verl raises on router replay with megatron.pad_to_length=True")
        moe = planner.moe_layer_indices(mcfg)
        if moe and moe[0] > 0:  # dense layers first: the Moonlight/DeepSeek mapping hazard
            ok, detail = verl_maps_replay_by_layer_number()
            freq = planner.megatron_moe_layer_freq(mcfg)
            otc = select(cfg, "actor_rollout_ref.actor.megatron.override_transformer_config") or {}
            set_freq = otc.get("moe_layer_freq")
            pattern = None if set_freq is None else megatron_moe_pattern(set_freq, mcfg["num_hidden_layers"])
            freq_ok = set_freq is None or pattern == freq
            check("replay.dense_first_layer_mapping", ok and freq_ok,
                  f"{mcfg['name']} has {moe[0]} dense layer(s) before the first MoE layer; replay rows must be "
                  f"indexed by global layer number (MoE layers {moe[0]}..{moe[-1]}). {detail}"
                  + ("" if freq_ok else f" override moe_layer_freq={set_freq!r} makes the MoE layers {pattern}, the "
                     f"model's are {freq}: Megatron would build routers the checkpoint and vLLM do not have; fix: "
                     f"drop the moe_layer_freq override (Bridge derives it from first_k_dense_replace)"))
    if mode == "R2":
        check("r2.no_rollout_flag", not flag, "R2 records in the trainer; rollout.enable_rollout_routing_replay "
              "must stay False")


def megatron_moe_pattern(freq, num_layers: int) -> list[int] | str:
    """Megatron-Core's per-layer MoE pattern for a ``moe_layer_freq`` value (TransformerConfig
    accepts an int N, every N-th layer from layer 0 is MoE, or a list of 0/1 per layer); anything else
    is returned as text so the rule can name it."""
    if isinstance(freq, bool):
        return repr(freq)
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(num_layers)] if freq > 0 else repr(freq)
    try:
        return [int(x) for x in freq]
    except (TypeError, ValueError):
        return repr(freq)


def _loss_checks(cfg, check) -> None:
    """Rollout correction needs rollout logprobs; a moerl loss must reach the Ray workers."""
    rc = select(cfg, "algorithm.rollout_correction") or {}
    if rc.get("rollout_is") or rc.get("rollout_rs") or rc.get("bypass_mode"):
        check("rollout_correction.logprobs", bool(select(cfg, "actor_rollout_ref.rollout.calculate_log_probs")),
              "algorithm.rollout_correction needs actor_rollout_ref.rollout.calculate_log_probs=True")
    loss_mode = str(select(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode"))
    if loss_mode.startswith("moerl_"):
        env_vars = select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars") or {}
        mods = str(env_vars.get("VERL_USE_EXTERNAL_MODULES", "")).split(",")
        check("loss.moerl_reaches_workers", "moerl.verl_ext.losses" in mods and losses.ENV_CONFIG in env_vars,
              f"loss_mode={loss_mode}: Ray workers only see ray_kwargs.ray_init.runtime_env.env_vars, which must "
              f"carry VERL_USE_EXTERNAL_MODULES=moerl.verl_ext.losses and {losses.ENV_CONFIG} (got "
              f"{sorted(env_vars)}); fix: declare the loss as moerl.loss in the experiment so the launcher "
              f"applies moerl.verl_ext.losses.verl_overrides (source: verl 0.9.1: verl/__init__.py imports "
              f"VERL_USE_EXTERNAL_MODULES; verl/trainer/main_ppo.py passes ray_init.runtime_env to ray.init)")


def _refit_log_check(cfg, check) -> None:
    """The refit side log reaches every verl process: its path and module ride in the Ray runtime env,
    and the rollout is the vLLM server adapter it wraps. An empty MOERL_REFIT_LOG set on the command
    line turns it off (the first-step check then judges the refit from k3)."""
    env_vars = select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars") or {}
    path = env_vars.get(refit_log.ENV_PATH)
    if path is not None and str(path) == "":
        check("refit.side_log_reaches_workers", True, f"{refit_log.ENV_PATH} set empty: no refit side log, "
              f"check_first_steps.py judges the refit from k3 (undecided at lr 1e-6..1e-4)")
        return
    mods = str(env_vars.get("VERL_USE_EXTERNAL_MODULES", "")).split(",")
    rollout = (select(cfg, "actor_rollout_ref.rollout.name"), select(cfg, "actor_rollout_ref.rollout.mode"))
    problems = []
    if not path or not Path(str(path)).is_absolute():
        problems.append(f"{refit_log.ENV_PATH}={path!r} (an absolute path every node sees expected)")
    if refit_log.MODULE not in mods:
        problems.append(f"VERL_USE_EXTERNAL_MODULES={env_vars.get('VERL_USE_EXTERNAL_MODULES')!r} lacks "
                        f"{refit_log.MODULE}")
    if rollout != refit_log.REGISTRY_KEY:
        problems.append(f"rollout name/mode {rollout} (the side log wraps verl's {refit_log.REGISTRY_KEY} adapter)")
    check("refit.side_log_reaches_workers", not problems,
          "; ".join(problems) + ": Ray workers see only ray_kwargs.ray_init.runtime_env.env_vars, so without both "
          "no update is recorded and check_first_steps.py cannot decide the refit at lr 1e-6..1e-4; fix: launch "
          "through moerl.verl_ext.launch, which sets them per run and seed (or set "
          f"+ray_kwargs.ray_init.runtime_env.env_vars.{refit_log.ENV_PATH}='' to run without it)"
          if problems else f"every update the vLLM rollout receives is recorded in {path} "
          f"(scripts/check_first_steps.py --refit-log)")


def _ref_check(cfg, exp: Experiment, check) -> None:
    """Reference-model settings in one of this repo's LoRA experiments are dead config that reads as
    if a separate KL anchor existed. verl 0.9.1 builds a reference worker only when
    need_reference_policy (a KL term) and not ref_in_actor (LoRA rank > 0: reference logprobs come
    from the actor with its adapter off), and reads actor_rollout_ref.ref only in that worker
    (verl/trainer/ppo/utils.py, verl/trainer/ppo/v1/trainer_base.py, verl/workers/engine_workers.py
    init_model). verl's own examples carry such settings harmlessly, so only experiments under
    experiments/ are held to it."""
    ref_keys = sorted(k for k in exp.origin if k.startswith("actor_rollout_ref.ref."))
    ours = any((REPO / "experiments") in f.parents for f in exp.files)
    if not ref_keys or not ours or experiment_lora_rank(exp) is None:
        return
    check("verl.ref_settings_need_a_reference_model", False,
          f"{exp.origin[ref_keys[0]]} sets {ref_keys}, but verl builds no reference worker for a LoRA run "
          f"(ref_in_actor: reference logprobs come from the actor with its adapter off, and only a reference "
          f"worker reads actor_rollout_ref.ref; verl 0.9.1 verl/trainer/ppo/v1/trainer_base.py, "
          f"verl/workers/engine_workers.py); fix: drop the actor_rollout_ref.ref settings")


def verl_maps_replay_by_layer_number() -> tuple[bool, str]:
    """Whether the installed verl indexes replay rows by each router's global ``layer_number``
    (verl PR #5037 and later) rather than by position. Read from source: importing the module
    needs Megatron-Core, which is not installed on CPU."""
    spec = importlib.util.find_spec("verl")
    path = Path(spec.origin).parent / "utils" / "megatron" / "router_replay_utils.py"
    if not path.exists():
        return False, f"{path} missing: this verl has no Megatron router replay"
    src = path.read_text()
    ok = "layer_number - 1" in src and "is_moe_layer" in src
    return ok, ("installed verl's set_router_replay_data maps rows by router layer_number"
                if ok else f"{path}: no layer_number mapping found; upgrade verl")


def verl_validate(cfg) -> Check:
    """verl's own ``validate_config`` (the one main_ppo runs first), on CPU.

    Its last check imports ``verl.workers.rollout.vllm_rollout.utils`` (which imports vLLM) only to
    call ``get_vllm_max_lora_rank``. Where vLLM is not installed (CPU CI) that module is replaced,
    for this call only, by planner.vllm_max_lora_rank (same allowed ranks, same error on >512);
    every other check is verl's, unchanged."""
    import types
    import warnings

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    shim_name = "verl.workers.rollout.vllm_rollout.utils"
    shim = None
    if _installed_version("vllm") is None and shim_name not in sys.modules:  # verl asks the same way
        shim = types.ModuleType(shim_name)
        shim.get_vllm_max_lora_rank = planner.vllm_max_lora_rank
        sys.modules[shim_name] = shim
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Disabled critic as adv_estimator != gae" is expected
            validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    except Exception as err:  # verl raises assert/ValueError/TypeError; anything else is its failure too
        return Check("verl.validate_config", False, f"{type(err).__name__}: {err}")
    finally:
        if shim is not None:
            sys.modules.pop(shim_name, None)
    return Check("verl.validate_config", True,
                 "passed" + (" (vLLM absent: max_lora_rank check by moerl.planner)" if shim else ""))


def build_command(exp: Experiment, python: str = "python3") -> list[str]:
    return [python, "-m", "verl.trainer.main_ppo", "--config-name", VERL_CONFIG_NAME, *exp.overrides]


def format_command(cmd: list[str], env: dict[str, str]) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    head = " ".join(shlex.quote(c) for c in cmd[:5])  # python -m verl.trainer.main_ppo --config-name X
    body = " \\\n    ".join([head] + [shlex.quote(c) for c in cmd[5:]])
    return (prefix + " \\\n  " if prefix else "") + body


SEED_KEYS = ("actor_rollout_ref.actor.megatron.seed", "actor_rollout_ref.actor.data_loader_seed",
             "actor_rollout_ref.rollout.seed", "data.seed")
ENV_VARS = "ray_kwargs.ray_init.runtime_env.env_vars"
RUNTIME_ENV = "+" + ENV_VARS
FILE_LOG_ENV = "VERL_FILE_LOGGER_PATH"  # verl's FileLogger writes here (trainer.logger: [..., file])


def launch_overrides(exp: Experiment, seed: int | None = None, extra: list[str] = ()) -> list[str]:
    """What the launcher adds to the experiment's own overrides: the moerl loss (``moerl.loss``,
    through ``losses.verl_overrides``, so its env reaches Ray workers and verl's clip keys match),
    the wandb group and tags of the experiment/arm (wandb reads WANDB_RUN_GROUP/WANDB_TAGS in the
    Ray actor that logs, so they travel in the runtime_env), and the seed."""
    out = []
    loss = exp.moerl.get("loss")
    if loss is not None:
        if not isinstance(loss, dict):
            raise ExperimentError(f"{exp.files[-1]}: moerl.loss must be a mapping of LossConfig fields")
        out += losses.verl_overrides(from_dict(LossConfig, loss, where=f"{exp.files[-1]}: moerl.loss"))
    group = exp.name.split("/")[0]
    # "arm:<arm>" / "seed:<n>": the form moerl.analysis.results.load_wandb_runs reads a run's key from
    tags = [group] + ([f"arm:{exp.arm}"] if exp.arm else []) + ([f"seed:{seed}"] if seed is not None else [])
    ep = _experiment_ep(exp.overrides + list(extra))
    if ep is not None:  # shared expert adapters clip at an EP-dependent norm: runs compare at one EP only
        tags.append(f"ep:{ep}")
    out += [f"{RUNTIME_ENV}.WANDB_RUN_GROUP={group}",
            f"{RUNTIME_ENV}.WANDB_TAGS='{','.join(tags)}'"]
    if seed is not None:
        out += [f"{k}={int(seed)}" for k in SEED_KEYS]
    return out


def _experiment_ep(overrides: list[str]) -> int | None:
    key = "actor_rollout_ref.actor.megatron.expert_model_parallel_size"
    vals = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == key]
    return int(vals[-1]) if vals and vals[-1].isdigit() else None


CHECKPOINT_ROOT_ENV = "MOERL_CHECKPOINT_DIR"  # where run checkpoints live (shared storage on a cluster)


def checkpoint_root() -> Path:
    """``$MOERL_CHECKPOINT_DIR``, else ``<repo>/checkpoints``: every node must see it (a shared file system)."""
    return Path(os.environ.get(CHECKPOINT_ROOT_ENV) or REPO / "checkpoints").resolve()


def _override_keys(overrides) -> set[str]:
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


def run_identity_overrides(cfg, exp: Experiment, seed: int | None, extra: list[str] = ()) -> list[str]:
    """Overrides that make a composed run safe to hand to verl, written as resolved values:

    - ``trainer.experiment_name`` gets ``_seed<N>`` (verl names the wandb run and the default
      checkpoint folder after it, so seed 2 never resumes seed 1's checkpoint under
      ``resume_mode: auto`` and every seed logs as its own run);
    - ``trainer.default_local_dir`` is the absolute ``<checkpoint root>/<project>/<experiment_name>``
      (verl's default is relative to the Ray worker's working directory);
    - every ``ray_kwargs.ray_init.runtime_env.env_vars`` value written with an OmegaConf
      interpolation (``${oc.env:MOERL_REPO,.}/...``) is replaced by its value here: verl passes the
      runtime env to Ray as text and Ray expands only ``${NAME}`` (rule verl.runtime_env_resolved);
    - verl's file log (``VERL_FILE_LOGGER_PATH``, a bring-up rung's) gets ``_seed<N>`` in its name
      (``file_log_path``): verl's FileLogger truncates its path, so two seeds sharing one file
      would keep only the last seed's rows;
    - the refit side log (``moerl.verl_ext.refit_log``): ``MOERL_REFIT_LOG`` names this run's file
      (``refit_log_path``) and ``VERL_USE_EXTERNAL_MODULES`` gains the module, so every verl process
      installs it (rule refit.side_log_reaches_workers).

    A key set on the command line (``extra``) is left as the user wrote it."""
    from omegaconf import OmegaConf

    from moerl.verl_ext.compose import _format_value

    mine = _override_keys(extra)
    out = []
    name = str(select(cfg, "trainer.experiment_name"))
    if seed is not None and "trainer.experiment_name" not in mine and not name.endswith(f"_seed{seed}"):
        name = f"{name}_seed{int(seed)}"
        out.append(f"trainer.experiment_name={_format_value(name)}")
    if "trainer.default_local_dir" not in mine and "trainer.default_local_dir" not in exp.origin:
        project = str(select(cfg, "trainer.project_name"))
        out.append(f"trainer.default_local_dir={_format_value(str(checkpoint_root() / project / name))}")
    env_node = select(cfg, ENV_VARS)
    file_log_given = f"{ENV_VARS}.{FILE_LOG_ENV}" in mine
    file_log = file_log_path(cfg, None if file_log_given else seed)
    for key in constraints.unresolved_runtime_env(cfg):
        full = f"{ENV_VARS}.{key}"
        if full in mine or key == FILE_LOG_ENV:
            continue
        try:
            value = OmegaConf.select(env_node, key, throw_on_resolution_failure=True)
        except Exception:  # e.g. ${oc.env:X} with X unset here: left as is, rule verl.runtime_env_resolved names it
            continue
        out.append(f"{full}={_format_value(str(value))}")
    if file_log is not None and not file_log_given:
        out.append(f"{ENV_VARS}.{FILE_LOG_ENV}={_format_value(str(file_log))}")
    out += _refit_log_overrides(cfg, name, mine, file_log)
    return out


def file_log_path(cfg, seed: int | None) -> Path | None:
    """verl's file log for this run: ``VERL_FILE_LOGGER_PATH`` resolved, with ``_seed<N>`` added to
    its name as to the experiment name (``logs/bringup/03_rung1.jsonl`` -> ``03_rung1_seed0.jsonl``).
    None when the config sets no file log or its path cannot be resolved here (rule
    verl.runtime_env_resolved then names it)."""
    from omegaconf import OmegaConf

    env_node = select(cfg, ENV_VARS)
    try:
        value = OmegaConf.select(env_node, FILE_LOG_ENV, throw_on_resolution_failure=True) \
            if env_node is not None else None
    except Exception:
        return None
    if not value:
        return None
    path = Path(str(value))
    if seed is None:
        return path
    stem = path.name[: -len(path.suffix)] if path.suffix else path.name
    tag = f"_seed{int(seed)}"
    return path if stem.endswith(tag) else path.with_name(stem + tag + path.suffix)


def refit_log_path(cfg, experiment_name: str, file_log: Path | None) -> Path:
    """This run's refit side log: ``refit_log.beside(file_log)`` when verl writes a file log (a
    bring-up rung's ``logs/bringup/NN_rungN_seed<S>.refit.jsonl`` beside ``NN_rungN_seed<S>.jsonl``,
    the very name check_first_steps.py looks for), else ``<repo>/logs/<project>/<experiment_name>.refit.jsonl``.
    Both carry the seed (the file log's name and the experiment name get ``_seed<N>``), so seeds never
    share a file. The repository is on storage every node sees (the sbatch installs it on each node), as
    the rows of every node's workers land in this one file."""
    if file_log is not None:
        return refit_log.beside(file_log).resolve()
    folder = REPO / "logs" / str(select(cfg, "trainer.project_name"))
    return (folder / f"{experiment_name}{refit_log.SUFFIX}").resolve()


def _refit_log_overrides(cfg, experiment_name: str, mine: set[str], file_log: Path | None) -> list[str]:
    from moerl.verl_ext.compose import _format_value

    prefix = ENV_VARS
    env_vars = select(cfg, prefix) or {}
    out = []
    if f"{prefix}.{refit_log.ENV_PATH}" not in mine:
        add = "" if refit_log.ENV_PATH in env_vars else "+"
        path = refit_log_path(cfg, experiment_name, file_log)
        out.append(f"{add}{prefix}.{refit_log.ENV_PATH}={_format_value(str(path))}")
    mods = [m for m in str(env_vars.get("VERL_USE_EXTERNAL_MODULES", "") or "").split(",") if m]
    if f"{prefix}.VERL_USE_EXTERNAL_MODULES" not in mine and refit_log.MODULE not in mods:
        add = "" if "VERL_USE_EXTERNAL_MODULES" in env_vars else "+"
        out.append(f"{add}{prefix}.VERL_USE_EXTERNAL_MODULES={_format_value(','.join(mods + [refit_log.MODULE]))}")
    return out


def prepare(directory: str | Path, arm: str | None = None, extra: list[str] = (), seed: int | None = None,
            launching: bool = False):
    """Compose + validate; raise ConstraintError listing every failed constraint.

    ``extra`` are Hydra overrides from the command line (applied last, so they win). The
    experiment's ``${oc.env:MOERL_REPO,.}`` paths resolve to this checkout unless MOERL_REPO is set."""
    os.environ.setdefault("MOERL_REPO", str(REPO))
    exp = load_experiment(directory, arm)
    exp.overrides = exp.overrides + launch_overrides(exp, seed, extra) + list(extra)
    cfg = compose_experiment(exp)
    identity = run_identity_overrides(cfg, exp, seed, extra)
    if identity:
        exp.overrides = exp.overrides + identity
        cfg = compose_experiment(exp)
    checks, p = validate(cfg, exp, launching=launching)
    checks.append(verl_validate(cfg))
    failed = [c for c in checks if not c.ok]
    if failed or p is None:
        lines = "\n".join(f"  [{c.name}] {c.detail}" for c in failed)
        raise ConstraintError(f"{exp.name} ({exp.files[-1]}): {len(failed)} constraint(s) broke:\n{lines}")
    return exp, cfg, checks, p


def earlier_logs_aside(env: dict[str, str], now: datetime | None = None) -> list[tuple[Path, Path]]:
    """(log, where it goes) for each of this run's logs that already holds rows: verl's file log and
    the refit side log, each to ``<name>.before-<UTC time>`` with its suffix kept, e.g.
    ``04_rung1_seed0.before-20261127T164500Z.jsonl`` and ``...before-20261127T164500Z.refit.jsonl``.

    verl's FileLogger opens its path with ``open(path, "wb")``, so a re-launch or a verl resume
    (``trainer.resume_mode``) would erase the rows logged before it. Moving them aside, rather than
    refusing to start, keeps a resume one command, and one time stamp for both files keeps the pair
    that check_first_steps.py reads together (``X.refit.jsonl`` beside ``X.jsonl``). Nothing moves
    here: ``main`` moves them just before a real launch; a dry run only reports them."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    logs = [Path(p) for p in (env.get(FILE_LOG_ENV), env.get(refit_log.ENV_PATH)) if p]
    full = [p for p in logs if p.is_file() and p.stat().st_size > 0]
    n = 0
    while True:  # two launches within one second: a counter keeps each earlier file
        tag = f"before-{stamp}" + (f"-{n}" if n else "")
        moves = [(p, _with_tag(p, tag)) for p in full]
        if not any(dst.exists() for _, dst in moves):
            return moves
        n += 1


def _with_tag(path: Path, tag: str) -> Path:
    suffix = refit_log.SUFFIX if path.name.endswith(refit_log.SUFFIX) else path.suffix
    head = path.name[: len(path.name) - len(suffix)] if suffix else path.name
    return path.with_name(f"{head}.{tag}{suffix}")


def rung_file(experiment: str | Path, rung: int) -> Path:
    """``<experiment>/bringup/rung<N>.yaml``, or an error naming the rungs this experiment has."""
    d = Path(experiment)
    f = d / "bringup" / f"rung{rung}.yaml"
    if not f.exists():
        have = sorted(p.stem for p in (d / "bringup").glob("rung*.yaml"))
        raise ExperimentError(f"{d.name} has no bring-up rung {rung} (has {have}; rung 4 is the full run without "
                              f"--rung); its README's bring-up ladder says which experiment's rung to run instead")
    return f


def gpu_hours(exp: Experiment, cfg) -> str:
    """GPU-hours of the full run from ``moerl.est_step_minutes`` (an assumption the experiment states,
    not a measurement): GPUs x total_training_steps x minutes/step / 60."""
    minutes = exp.moerl.get("est_step_minutes")
    steps = select(cfg, "trainer.total_training_steps")
    n = int(select(cfg, "trainer.nnodes")) * int(select(cfg, "trainer.n_gpus_per_node"))
    if exp.moerl.get("rung_minutes"):
        m = float(exp.moerl["rung_minutes"])
        return (f"GPU-hours ~ {n * m / 60:.1f} for this bring-up rung ({n} GPUs x ~{m:g} min wall, start-up "
                f"included; moerl.rung_minutes is an estimate, not measured)")
    if not steps:
        return "GPU-hours: trainer.total_training_steps unset"
    per_minute = n * int(steps) / 60
    if not minutes:
        return (f"GPU-hours = {n} GPUs x {steps} steps x (minutes/step) / 60 = {per_minute:,.0f} per minute of step "
                f"time (set moerl.est_step_minutes for a total)")
    return (f"GPU-hours ~ {n * int(steps) * float(minutes) / 60:,.0f} ({n} GPUs x {steps} steps x "
            f"{minutes} min/step assumed by moerl.est_step_minutes / 60; not measured)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", help="experiment directory (or one experiment YAML file), "
                    "e.g. experiments/02_kimi_k2_lora_grpo_r3")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides applied last, e.g. trainer.total_training_steps=10")
    ap.add_argument("--arm", help="arm name for experiments with an arms/ folder")
    ap.add_argument("--rung", type=int, help="bring-up rung: runs <experiment>/bringup/rung<N>.yaml (see the "
                    "experiment README's bring-up ladder)")
    ap.add_argument("--seed", type=int, help=f"seed for {', '.join(SEED_KEYS)}")
    ap.add_argument("--dry-run", action="store_true", help="compose, validate and print; do not run")
    ap.add_argument("--adopt-checkpoint", action="store_true", help="resume a checkpoint folder that has no "
                    f"{resume_check.MANIFEST} (a run launched without this launcher): this launch's identity is "
                    "recorded, not verified")
    ap.add_argument("--python", default=sys.executable, help="interpreter on the cluster (default: this one)")
    args = ap.parse_intermixed_args(argv)  # overrides may come before or after the flags
    if args.rung is not None:
        try:
            args.experiment = str(rung_file(args.experiment, args.rung))
        except ExperimentError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        print(f"error: overrides must be key=value, got {bad}", file=sys.stderr)
        return 2
    try:
        exp, cfg, checks, p = prepare(args.experiment, args.arm, args.overrides, args.seed,
                                      launching=not args.dry_run)
    except (ExperimentError, ConstraintError, planner.PlanError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for c in checks:
        print(f"ok  [{c.name}] {c.detail}")
    print(f"plan: trainer {p.trainer_gib:.1f} GiB/GPU, rollout {p.rollout_gib:.1f} GiB/GPU "
          f"(python scripts/plan.py {args.experiment}{' --arm ' + exp.arm if exp.arm else ''} for detail)")
    print(gpu_hours(exp, cfg))
    env = env_for(cfg)
    cmd = build_command(exp, args.python)
    ray = os.environ.get("RAY_ADDRESS")
    print(f"# ray: {'joins ' + ray if ray else 'verl starts a local Ray instance (single node)'}")
    print(format_command(cmd, env))
    if env.get(FILE_LOG_ENV):
        print(f"# verl file log: {env[FILE_LOG_ENV]} (scripts/check_first_steps.py reads it and the refit side "
              f"log beside it)")
    if env.get(refit_log.ENV_PATH):
        print(f"# refit side log: {env[refit_log.ENV_PATH]} (python scripts/check_first_steps.py LOG --refit-log "
              f"{env[refit_log.ENV_PATH]})")
    try:  # read-only: a refused relaunch writes nothing
        resume = resume_check.inspect(cfg, exp.arm, args.seed, adopt=args.adopt_checkpoint)
    except resume_check.ResumeRefused as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        _report(resume, env, dry_run=True)
        holder = runlock.lock_holder(resume.run_dir)
        print(f"# one writer: {resume.run_dir} is in use by process {holder}: a launch now would be refused" if holder
              else f"# one writer: a launch holds {runlock.lock_path(resume.run_dir)} while main_ppo runs")
        return 0
    try:
        runlock.lock_run(resume.run_dir, create=True)
    except runlock.RunLockedError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        try:  # again under the lock: a launch that held it until now may have saved a step since
            resume = resume_check.inspect(cfg, exp.arm, args.seed, adopt=args.adopt_checkpoint)
        except resume_check.ResumeRefused as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        moved = resume_check.move_earlier_run_aside(resume)
        resume.record_launch()
        _report(resume, env, dry_run=False)
        if moved is not None:
            print(f"# trainer.resume_mode=disable: moved the earlier run's files from {resume.run_dir} aside to {moved}")
        for log in (env.get(FILE_LOG_ENV), env.get(refit_log.ENV_PATH)):
            if log:  # verl's FileLogger opens its path without creating the folder
                Path(log).parent.mkdir(parents=True, exist_ok=True)
        # main_ppo inherits the lock's descriptors: the lock lasts as long as it runs, even past this process
        return subprocess.call(cmd, env={**os.environ, **env}, cwd=REPO,
                               pass_fds=runlock.held_fds(resume.run_dir))
    finally:
        runlock.unlock_run(resume.run_dir)


def _report(resume: resume_check.ResumeCheck, env: dict[str, str], dry_run: bool) -> None:
    """The checkpoint lines, then the earlier logs a launch moves aside (a dry run moves nothing)."""
    for note in resume.notes:
        print(f"# {note}")
    print(f"# checkpoints: {resume.summary(dry_run)}")
    for src, dst in earlier_logs_aside(env):
        size = src.stat().st_size
        if not dry_run:
            src.rename(dst)  # same folder: an atomic rename, to a name earlier_logs_aside found free
        print(f"# {src} {'holds' if dry_run else 'held'} {size} bytes of an earlier launch: "
              f"{'a launch would move' if dry_run else 'moved'} it aside to {dst.name}, so no row is lost")


if __name__ == "__main__":
    sys.exit(main())
