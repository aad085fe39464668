"""Typed experiment config: YAML in, dataclasses out, unknown keys and out-of-range values rejected.

Every number a user may want to change lives here, not in code. An experiment is a base YAML plus
one YAML per arm (``base: base.yaml`` at the top of an arm file pulls the base in), plus optional
``key.path=value`` overrides from the command line. OmegaConf merges the layers and parses the
dot-list overrides; the schema check is ours, because OmegaConf's structured configs neither
suggest the key that was meant for a typo nor say which file (base, arm or command line) holds the
bad value. Every numeric field declares its allowed range next to its default (``num(...)``), and
``tests/test_config.py`` fails for a numeric field that declares none.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config file or override that does not fit the schema; the message names file and key."""


@dataclass(frozen=True)
class Range:
    """Allowed interval of a numeric field; ``None`` bounds are open-ended."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    why: str = ""

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.open_low else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.open_high else value > self.high):
            return False
        return True

    def describe(self) -> str:
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        interval = f"{'(' if self.open_low or self.low is None else '['}{low}, {high}" \
                   f"{')' if self.open_high or self.high is None else ']'}"
        return interval + (f"; {self.why}" if self.why else "")


def num(default, low=None, high=None, *, open_low=False, open_high=False, why: str = ""):
    """A numeric config field with its allowed range (checked when a config is loaded)."""
    return field(default=default, metadata={"range": Range(low, high, open_low, open_high, why)})


@dataclass
class ModelConfig:
    """A tiny MoE built from a transformers config with random init (no download), or, with ``path``, a
    checkpoint directory on disk (moerl.models.pretrained)."""

    preset: Literal["qwen3_moe", "deepseek_v3", "mixtral"] = "qwen3_moe"
    # A local Hugging Face checkpoint directory (config.json, safetensors weights, tokenizer, chat template) of
    # a family in moerl.models.families. When set, the checkpoint defines the model: the size keys below and
    # ``preset`` are not used, and there is no warm start. Nothing is downloaded: a hub id is refused.
    path: str | None = None
    # Run the checkpoint's own Python (its auto_map modeling or tokenizer code). Off: transformers' classes only.
    trust_remote_code: bool = False
    hidden_size: int = num(128, 1)
    num_layers: int = num(4, 1)
    num_experts: int = num(8, 1)
    top_k: int = num(2, 1)
    moe_intermediate_size: int = num(128, 1)
    num_heads: int = num(4, 1)
    num_kv_heads: int = num(2, 1)
    head_dim: int = num(32, 1)
    # DeepSeek-V3 / Kimi-K2 family only: leading dense layers, shared experts, group-limited routing.
    first_k_dense: int = num(1, 0)
    n_shared_experts: int = num(1, 0)
    n_group: int = num(2, 1)
    topk_group: int = num(1, 1)
    init_std: float = num(0.02, 0, open_low=True)
    experts_implementation: Literal["grouped_mm", "eager", "batched_mm"] = "grouped_mm"
    router_aux_loss_coef: float = num(0.01, 0)
    # Extra keys passed verbatim to the transformers config (escape hatch for ablations).
    overrides: dict = field(default_factory=dict)


@dataclass
class DataConfig:
    """Which task the policy learns; the synthetic task needs no files at all."""

    # arith: a+b*c= -> \boxed{n}; arith_steps: a+b*c-d= worked step by step (answers of 25-33 tokens).
    task: Literal["arith", "arith_steps", "gsm8k", "math"] = "arith"
    # Local parquet/jsonl file(s) for real datasets (raw columns or verl's parquet); a hub id when online.
    train_path: str | None = None
    test_path: str | None = None
    hub_id: str | None = None
    train_size: int = num(20000, 1)
    test_size: int = num(512, 1)
    # Synthetic arithmetic ``a + b * c``: ranges of the operands.
    max_a: int = num(99, 0)
    max_bc: int = num(9, 0)
    seed: int = num(1234, 0)
    # With a checkpoint (model.path): render each prompt with its tokenizer's chat template (false: the
    # instruction and question as plain text), asking for the answer as ``instruction`` says (null: verl's
    # instruction for the task: GSM8K "####", MATH \boxed{}). Prompts longer than max_prompt_tokens are dropped
    # (counted and logged), as verl's filter_overlong_prompts does.
    chat_template: bool = True
    instruction: str | None = None
    max_prompt_tokens: int = num(1024, 1)


@dataclass
class WarmStartConfig:
    """Supervised pre-training so GRPO starts from a policy with non-trivial accuracy."""

    enabled: bool = True
    steps: int = num(300, 1)
    batch_size: int = num(256, 1)
    lr: float = num(2e-3, 0, open_low=True)
    # Directory searched for a cached checkpoint (keyed by a hash of model config, task and seed); a
    # relative path is taken from the repository root, not the working directory, so a run resumed from
    # another directory finds the base it was trained on.
    cache_dir: str = "results/warm_start"


# Share of warm-start steps that OneCycleLR spends warming up (moerl.trainer.warm_start).
WARM_START_PCT_START = 0.05


@dataclass
class RolloutConfig:
    """The rollout engine: its own copy of the policy, in its own precision."""

    engine: Literal["hf", "vllm"] = "hf"
    # Quantised rollouts (moerl.rollout.precision), weights rounded through their format, computed in
    # bf16: fp8 (e4m3, per-channel), int8 (per-channel, FlashRL), nvfp4 (e2m1, 16-blocks), int4 (group 128);
    # nvfp4 / int4 on the routed experts only (``_experts``) or attention only (``_attention``); int4_kimi:
    # Kimi-K2-Thinking's INT4 routed experts (group 32, scale amax / 7), everything else bf16.
    # The dose-matched halves (experiment 07's crossover): int3 / int2 on the routed experts, int5 / int6 /
    # int8 / fp8 on attention only.
    dtype: Literal["bf16", "fp16", "fp32", "fp8", "int8", "nvfp4", "int4", "nvfp4_experts", "nvfp4_attention",
                   "int4_experts", "int4_attention", "int4_kimi", "int3_experts", "int3n_experts", "int2_experts",
                   "int5_attention", "int5g32_attention", "int6_attention", "int8_attention",
                   "fp8_attention"] = "bf16"
    # How a low-precision engine computes its matrix products (moerl.rollout.kernels): ``native`` runs
    # torch's bf16 kernels (fast with AVX512-BF16/AMX, 6-20x slower on AVX2-only CPUs, numerics that
    # differ between CPU models); ``emulated`` runs fp32 kernels on the bf16 values and rounds each
    # output to bf16, as a GPU's fp32-accumulating kernels do: the same numbers on every CPU, measured to
    # give the same mismatch statistics as native (README, "Rollout kernels"). Part of the run's identity.
    kernels: Literal["native", "emulated"] = "emulated"
    # How the embedded engine decodes: ``loop``, moerl's decode loop (moerl.rollout.decode; bit-identical
    # to generate on the same machine, several times faster), or transformers' ``generate``. Models the
    # loop does not cover use generate either way. How a run is executed, not what it computes.
    decode: Literal["loop", "generate"] = "loop"
    prompts_per_step: int = num(32, 1)
    group_size: int = num(8, 2, why="GRPO normalises within a group")
    max_new_tokens: int = num(8, 1)
    temperature: float = num(1.0, 0, open_low=True)
    top_p: float = num(1.0, 0, 1, open_low=True)
    # 0 disables top-k filtering (transformers' generate defaults to 50 otherwise).
    top_k: int = num(0, 0)
    capture_routing: bool = True
    # Torch threads while the embedded engine generates (null: the process's ``threads``). Decode steps
    # are many tiny kernels; on a small model a second thread can cost more than it gives (see README,
    # Benchmarks). How a run is executed, not what it computes: not part of the run's identity.
    threads: int | None = num(None, 1)


@dataclass
class LoraConfig:
    rank: int = num(8, 1)
    alpha: float = num(16.0, 0, open_low=True)
    target_attention: bool = True
    target_experts: bool = True
    # per_expert: PEFT target_parameters on the fused expert tensors; shared / shared_outer: see moerl.lora.
    expert_mode: Literal["per_expert", "shared", "shared_outer"] = "per_expert"
    init_seed: int = num(0, 0)


@dataclass
class LossConfig:
    """Policy-loss variant and its knobs; formulas and sources are in moerl/trainer/losses.py.

    Ratios: r = pi_theta/pi_old (PPO clip), rho = pi_old/pi_rollout (rollout correction weight)."""

    variant: Literal["ppo_clip", "tis", "mis", "icepop", "gspo", "bypass"] = "ppo_clip"
    # PPO clip range [1 - eps_low, 1 + eps_high] on r (DAPO clip-higher: 0.2 / 0.28).
    eps_low: float = num(0.2, 0, 1, open_high=True, why="the clip floor is 1 - eps_low")
    eps_high: float = num(0.28, 0)
    # Dual-clip constant c > 1 bounds the ratio for negative advantages; null disables it.
    dual_clip_c: float | None = num(None, 1, open_low=True, why="null disables the dual clip")
    # token_mean (default, as DAPO and verl): every response token counts once, no length bias
    # towards short answers; seq_mean_token_mean (GRPO/GSPO papers); seq_sum_constant (Dr. GRPO).
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_sum_constant"] = "token_mean"
    # Truncated IS (tis): weight min(rho, tis_cap); C=2 as in Yao et al. Also the cap of mis_token_tis.
    tis_cap: float = num(2.0, 0, open_low=True, why="C in min(rho, C); 2.0 is typical")
    # Level of the rho used by tis (token | sequence) and mis (token | sequence | geometric).
    is_level: Literal["token", "sequence", "geometric"] = "token"
    # Masked IS (mis): zero tokens/sequences whose rho falls outside [mis_lower, mis_upper].
    mis_lower: float = num(0.5, 0)
    mis_upper: float = num(2.0, 0, open_low=True)
    # Veto: drop a whole sequence if any token has rho below this (catastrophic token); null = off.
    mis_veto: float | None = num(1e-4, 0, 1, open_low=True, open_high=True, why="null disables the veto")
    # mis with is_level=geometric: also weight kept tokens by min(rho_t, tis_cap) (Miles, verl
    # decoupled_geo_rs_token_tis); false = pure rejection (weight 1 on kept sequences).
    mis_token_tis: bool = False
    # IcePop: token mask outside [icepop_alpha, icepop_beta] (Ring-1T defaults 0.5 / 5).
    icepop_alpha: float = num(0.5, 0)
    icepop_beta: float = num(5.0, 0, open_low=True)
    # GSPO: clip range of the sequence ratio (pi_theta/pi_old)^(1/|y|) (paper: 3e-4 / 4e-4).
    gspo_eps_low: float = num(3e-4, 0, 1, open_high=True)
    gspo_eps_high: float = num(4e-4, 0)
    entropy_coef: float = num(0.0, 0)


@dataclass
class ReplayConfig:
    """Router Replay: none, R2 (replay the trainer's own old-pass routing) or R3 (the rollout's)."""

    mode: Literal["none", "R2", "R3"] = "none"
    # Raise when an expert used under replay differs from the trace on a valid row.
    strict: bool = False
    # Warn (and log routing/agreement_alarm=1) when the trainer's native-vs-trace disagreement under R3
    # exceeds this many times its no-replay level (+0.01), measured by trainer.paired_replay_every's pass.
    agreement_alarm: float = num(3.0, 1.0, why="a multiple of the no-replay disagreement")
    # How a trace column is matched to an MoE router. layer_number is the only correct mapping;
    # position REPRODUCES A BUG (the i-th MoE router reads global layer i: on models with dense first
    # layers the first MoE layers get zero rows and the others another layer's routes). Experiment 05 only.
    layer_mapping: Literal["layer_number", "position"] = "layer_number"


@dataclass
class RefitConfig:
    # adapter: only LoRA tensors travel (engine keeps its base resident); merged: full merged weights.
    mode: Literal["adapter", "merged"] = "adapter"
    bucket_mb: float = num(4.0, 0, open_low=True)
    # inprocess: the engine is a separate copy in this process; process: its own process, fed through
    # shared-memory buckets, as vLLM is fed by verl.
    engine: Literal["inprocess", "process"] = "inprocess"


@dataclass
class TrainerConfig:
    steps: int = num(60, 1)
    lr: float = num(1e-3, 0, open_low=True)
    # Linear learning-rate warm-up: Adam's first updates are sign-like at full lr, which on freshly
    # zero-initialised LoRA B matrices is a large, mostly random perturbation of the warm start.
    warmup_steps: int = num(0, 0)
    weight_decay: float = num(0.0, 0)
    betas: tuple = field(default=(0.9, 0.999), metadata={"range": Range(0, 1, open_high=True), "length": 2})
    # Each step's rollouts are split into this many optimizer updates (PPO mini-batches).
    mini_batches: int = num(2, 1)
    epochs: int = num(1, 1)
    micro_batch_size: int = num(64, 1)
    grad_clip: float = num(1.0, 0, open_low=True)
    activation_checkpointing: bool = False
    # The trainer's weights and compute: fp32 (the lab's reference) or bf16 (a large checkpoint on one GPU;
    # the LoRA weights and the optimizer stay fp32).
    dtype: Literal["fp32", "bf16"] = "fp32"
    eval_every: int = num(10, 0, why="0 evaluates only at the start and the end")
    eval_size: int = num(512, 1)
    # Who measures held-out accuracy: ``rollout`` (the arm's own engine, in the arm's precision) or
    # ``fp32`` (the trained policy itself, in fp32, the same evaluator for every arm): comparing arms
    # of different rollout precisions by their own engines mixes the evaluator's precision into the gap.
    eval_precision: Literal["rollout", "fp32"] = "rollout"
    # Samples per held-out problem for pass@1 (at the rollout temperature): with one, the sampling noise
    # alone is ~0.03 on 256 problems; k samples average it down by sqrt(k). Greedy accuracy is one pass.
    eval_samples: int = num(1, 1)
    checkpoint_every: int = num(10, 0, why="0 checkpoints only at the end")
    # How many checkpoints a run keeps (the newest); 0 keeps every one: a policy measured along its run
    # after it ends (experiment 07's drift null scores the fp32 control's own checkpoints).
    keep_checkpoints: int = num(2, 0, why="0 keeps every checkpoint")
    # Every N steps save per-token (rollout logprob, trainer logprob, IS weight, flags) samples.
    samples_every: int = num(10, 0, why="0 saves no token samples")
    samples_per_save: int = num(2048, 1)
    # Every N steps recompute the old logprobs of the same batch with the other replay setting (R3 arms:
    # without replay; others: with the rollout trace) for a paired k3 ratio; 0 = off.
    paired_replay_every: int = num(0, 0, why="0 turns the paired replay measurement off")
    # The trainer computes with its weights on the rollout's quantised grid (moerl.rollout.precision.
    # fake_quantize_masters; SkyRL's fake-INT4 QAT): ``none``, or the rollout's own quantised precision.
    fake_quant: Literal["none", "fp8", "int8", "nvfp4", "int4", "nvfp4_experts", "nvfp4_attention", "int4_experts",
                        "int4_attention", "int4_kimi"] = "none"


@dataclass
class TrackingConfig:
    # runs/ is gitignored; the recorded ablation lives in results/runs and is written only on request.
    output_dir: str = "runs"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "moerl"
    wandb_entity: str | None = None
    progress_bar: bool = True


@dataclass
class ExperimentConfig:
    experiment: str = "00_tiny_moe_cpu"
    arm: str = "baseline"
    seed: int = num(0, 0)
    # Torch/OMP threads; null: $OMP_NUM_THREADS when set, else the cores this process may use
    # (os.sched_getaffinity), so two runs started side by side on a shared machine do not each claim
    # every core.
    threads: int | None = num(None, 1, why="null uses $OMP_NUM_THREADS, else the cores this process may use")
    # Where the trainer and the embedded engine run: cpu, cuda, or auto (cuda when a GPU is visible). How a
    # run is executed (the machine is recorded in machine.json), not part of its identity.
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    # Command-line overrides that change the run (set by load_config): part of the run's name and
    # directory, so an override never lands in, skips or resumes the run of the plain arm.
    variant: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def run_name(self) -> str:
        return f"{self.experiment}/{self.arm}{'+' + self.variant if self.variant else ''}/seed{self.seed}"

    @property
    def run_dir(self) -> Path:
        """``<tracking.output_dir>/<experiment>/<arm>[+<variant>]/seed<k>``; a run recorded under the
        older spelling of the same overrides (``key=value,...``) or under the arm's former name
        (RENAMED_ARMS) is found there, so it is skipped or resumed instead of started again."""
        path = Path(self.tracking.output_dir) / self.run_name
        if path.exists():
            return path
        legacy = getattr(self, "legacy_variant", "")
        variants = [self.variant] + ([legacy] if legacy and legacy != self.variant else [])
        # A run recorded under the arm's former name (RENAMED_ARMS) or the older spelling of its overrides.
        for arm in (self.arm, *former_arms(self.experiment, self.arm)):
            for variant in variants:
                old = Path(self.tracking.output_dir) / self.experiment / f"{arm}{'+' + variant if variant else ''}" \
                    / f"seed{self.seed}"
                if old.exists():
                    return old
        return path


# Arms renamed so that a name says its estimator and band: ``mis`` was three estimators (experiment 00:
# geometric-mean ratio in [0.97, 1.03]; 05: verl's Seq-MIS, the sequence product in [0.5, 2]; 07: geometric
# in [0.999, 1.001]). Per experiment, former name -> current name: the one table of renamed arms. An arm file
# named by its former name (``arms/mis.yaml``) loads the current one (arm_file), and a run recorded under the
# former name (its directory and its config.yaml's ``arm:``) is found, skipped, resumed and loaded under the
# current one (ExperimentConfig.run_dir, config_diff, moerl.analysis.results). Recorded runs keep their names.
RENAMED_ARMS = {
    "00_tiny_moe_cpu": {"mis": "geo_mis_3pct"},
    "03_qwen3_30b_a3b_lora_mitigations": {"mis": "seq_mis"},
    "05_mismatch_consequences": {"mis": "seq_mis"},
    "07_dose_threshold": {"mis": "geo_mis_0p1pct"},
}


def current_arm(experiment: str, label: str) -> str:
    """A run label ``arm[+overrides]`` with its arm under its current name (RENAMED_ARMS)."""
    arm, sep, rest = str(label).partition("+")
    return RENAMED_ARMS.get(experiment, {}).get(arm, arm) + sep + rest


def former_arms(experiment: str, arm: str) -> list[str]:
    """The former names of ``arm`` (given by its current or a former name) in ``experiment``."""
    current = current_arm(experiment, arm)
    return [old for old, new in RENAMED_ARMS.get(experiment, {}).items() if new == current]


def arm_file(path: str | Path) -> Path:
    """``path``; or, when it is ``<experiment>/arms/<former name>.yaml`` of a renamed arm and not there, the
    file of the arm's current name (so commands written with the old name keep working)."""
    path = Path(path)
    if path.exists() or path.parent.name != "arms" or path.suffix != ".yaml":
        return path
    renamed = RENAMED_ARMS.get(path.parent.parent.name, {}).get(path.stem)
    if renamed is None:
        return path
    log.info("%s: former name of arm %r, loading %s", path, renamed, path.with_name(f"{renamed}.yaml"))
    return path.with_name(f"{renamed}.yaml")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity, which a scheduler or taskset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolved_threads(cfg: ExperimentConfig) -> int:
    """``threads``, else ``$OMP_NUM_THREADS`` (the setting a user of OpenMP programs expects to be
    honoured), else the cores this process may use."""
    if cfg.threads is not None:
        return cfg.threads
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not env:
        return usable_cores()
    first = env.split(",")[0].strip()  # OpenMP's nested form "4,2": the outer level is ours
    if not first.isdigit() or int(first) < 1:
        raise ConfigError(f"OMP_NUM_THREADS={env!r}: expected a positive integer (or unset it, or set threads=N)")
    return int(first)


# Keys that change how a run is executed or recorded, never what it computes: left out of the
# run's identity (a resumed run may use other threads or another wandb mode).
OPERATIONAL_KEYS = ("threads", "device", "rollout.threads", "rollout.decode", "tracking", "variant", "trainer.checkpoint_every",
                    "trainer.keep_checkpoints", "warm_start.cache_dir")


# Keys that enter a run's identity only when set to something else than this value: the keys of a
# checkpoint path, its data and its trainer dtype, added after runs were recorded, leave every earlier
# run's hash (and so its resume and its registration) unchanged.
OMITTED_AT_DEFAULT = {"model.path": None, "model.trust_remote_code": False, "trainer.dtype": "fp32",
                      "data.chat_template": True, "data.instruction": None, "data.max_prompt_tokens": 1024}


# The keys only a checkpoint run (model.path) reads: what the tiny presets compute from (a warm start's cache key,
# a geometry point's spec) leaves them out, so adding them changed no key or spec recorded before.
CHECKPOINT_ONLY_KEYS = {"model": ("path", "trust_remote_code"), "data": ("chat_template", "instruction",
                                                                         "max_prompt_tokens")}


def without_checkpoint_keys(section: str, values: dict) -> dict:
    """``values`` (a ``to_dict`` of config section ``section``) without its CHECKPOINT_ONLY_KEYS."""
    return {k: v for k, v in values.items() if k not in CHECKPOINT_ONLY_KEYS.get(section, ())}


def identity_dict(cfg: ExperimentConfig) -> dict:
    """The resolved config without OPERATIONAL_KEYS (and OMITTED_AT_DEFAULT keys at that value), flattened
    to ``{"a.b": value}``."""
    flat = flatten(to_dict(cfg))
    return {k: v for k, v in flat.items()
            if not any(k == op or k.startswith(op + ".") for op in OPERATIONAL_KEYS)
            and not (k in OMITTED_AT_DEFAULT and v == OMITTED_AT_DEFAULT[k])}


def config_hash(cfg: ExperimentConfig) -> str:
    """Short hash of the run's identity: two runs with the same hash compute the same thing. The arm's
    name is part of the identity: a run of a renamed arm hashes differently under its former name."""
    return _identity_hash(identity_dict(cfg))


def _identity_hash(identity: dict) -> str:
    blob = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def config_hashes(cfg: ExperimentConfig) -> list[str]:
    """config_hash, then the hash of the same run under each former name of its arm (RENAMED_ARMS): the
    hashes a checkpoint of this run may carry (one written before the arm was renamed carries its old one)."""
    identity = identity_dict(cfg)
    return [config_hash(cfg), *(_identity_hash({**identity, "arm": old}) for old in former_arms(cfg.experiment, cfg.arm))]


# Keys added after runs were recorded, with the value those runs computed with: a recorded identity
# that lacks one is read as having this value (so an old run still resumes, and is not taken for a
# run of the new default).
LEGACY_VALUES = {"rollout.kernels": "native", "trainer.eval_precision": "rollout", "trainer.eval_samples": 1,
                 "trainer.fake_quant": "none"}


def with_legacy_values(identity: dict) -> dict:
    """``identity`` with every key of LEGACY_VALUES it lacks filled in."""
    return {**{k: v for k, v in LEGACY_VALUES.items() if k not in identity}, **identity}


def config_diff(a: dict, b: dict) -> list[str]:
    """``key: a -> b`` for every flattened key whose value differs between two identity dicts."""
    a, b = with_legacy_values(a), with_legacy_values(b)
    # An arm's former name is the same arm (RENAMED_ARMS): a run recorded under it is not another config.
    a, b = ({**d, "arm": current_arm(d.get("experiment", ""), d["arm"])} if "arm" in d else d for d in (a, b))
    keys = sorted(set(a) | set(b))
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in keys if a.get(k) != b.get(k)]


def flatten(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value and key != "overrides":
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


# ---------------------------------------------------------------------------------------------
# Loading and validation


# Names users carry over from other frameworks, mapped to ours (difflib cannot guess these).
ALIASES = {"learning_rate": "lr", "num_steps": "steps", "total_steps": "steps", "max_steps": "steps",
           "n_samples": "group_size", "num_generations": "group_size", "clip_ratio_low": "eps_low",
           "clip_ratio_high": "eps_high", "num_experts_per_tok": "top_k", "n_routed_experts": "num_experts"}


def _closest(key: str, options: list[str]) -> str:
    if ALIASES.get(key) in options:
        return f" (did you mean '{ALIASES[key]}'?)"
    match = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else f" (valid keys: {', '.join(sorted(options))})"


class ConfigKeyError(ConfigError):
    """A ConfigError about one key: ``load_config`` prefixes the layer (file or override) that set it."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check one leaf against its type hint, converting where YAML is looser than Python."""
    origin = get_origin(hint)
    if origin is Literal:
        allowed = get_args(hint)
        if value not in allowed:
            raise ConfigKeyError(where, f"{where}: {value!r} is not one of {list(allowed)}")
        return value
    args = get_args(hint)
    if type(None) in args:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigKeyError(where, f"{where}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigKeyError(where, f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigKeyError(where, f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigKeyError(where, f"{where}: expected a string, got {value!r}")
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigKeyError(where, f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if hint is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigKeyError(where, f"{where}: expected a list, got {value!r}")
        return tuple(value)
    return value


def _check_range(value: Any, meta: dict, where: str) -> None:
    rng: Range | None = meta.get("range")
    if rng is None or value is None:
        return
    items = value if isinstance(value, tuple) else (value,)
    if "length" in meta and len(items) != meta["length"]:
        raise ConfigKeyError(where, f"{where}={list(items)}: expected {meta['length']} values")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            raise ConfigKeyError(where, f"{where}: expected a number, got {item!r}")
        if not rng.contains(item):
            raise ConfigKeyError(where, f"{where}={value!r} is out of range: allowed {rng.describe()}")


def numeric_fields(cls: type = None, prefix: str = "") -> list[tuple[str, dataclasses.Field]]:
    """(dotted key, field) of every int/float field of the schema (tests: each declares a range)."""
    cls = cls or ExperimentConfig
    hints, out = get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        hint, path = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):
            out += numeric_fields(hint, path + ".")
        elif {int, float} & ({hint} | set(get_args(hint))) or hint is tuple:
            out.append((path, f))
    return out


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys with the closest valid name
    and values outside each field's declared range."""
    if not isinstance(data, dict):
        raise ConfigKeyError(where, f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise ConfigKeyError(path, f"unknown config key '{path}'{_closest(str(key), list(fields))}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(hint, value or {}, path)
        else:
            kwargs[key] = _coerce(value, hint, path)
            _check_range(kwargs[key], fields[key].metadata, path)
    cfg = cls(**kwargs)
    return cfg


def to_dict(cfg: Any) -> dict:
    out = dataclasses.asdict(cfg)

    def _lists(x):  # tuples -> lists so YAML/JSON stay plain
        if isinstance(x, dict):
            return {k: _lists(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [_lists(v) for v in x]
        return x

    return _lists(out)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader keeps the last of two equal keys silently; a config must not. YAML merge keys
    (``<<: *defaults``) work as in the safe loader: a key of the mapping itself overrides a merged one."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # merged in by the safe loader (flatten_mapping), not a key of its own
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool, type(None))):
                continue  # the base loader refuses unhashable keys with its own message
            if key in seen:
                raise ConfigError(f"key '{key}' appears twice (lines {seen[key] + 1} and "
                                  f"{key_node.start_mark.line + 1}); keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict:
    if not path.exists():
        arms = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.name == "arms" else []
        raise ConfigError(f"config file not found: {path}" + (f" (arms there: {', '.join(arms)})" if arms else ""))
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    if data is None:  # an empty arm file would otherwise run as the defaults, named 'baseline'
        raise ConfigError(f"{path}: empty config file (expected a mapping, e.g. 'base: ../base.yaml' and the "
                          f"arm's keys)")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def deep_merge(base: dict, over: dict) -> dict:
    """``over`` merged into ``base`` recursively (mappings merge, everything else replaces)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(over)), resolve=False)


def _layers_with_bases(path: Path, seen: tuple = ()) -> list[tuple[str, dict]]:
    """[(file, its own keys)] from the root of the ``base`` chain down to ``path``."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'base' chain loops back on itself")
    data = _read_yaml(path)
    base = data.pop("base", None)
    own = [(str(path), data)]
    if base is None:
        return own
    return _layers_with_bases((path.parent / base), seen + (path.resolve(),)) + own


def parse_override(item: str) -> dict:
    """``trainer.lr=3e-4`` -> ``{"trainer": {"lr": 0.0003}}`` (OmegaConf dot-list grammar)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if "=" not in item or item.startswith("="):
        raise ConfigError(f"override '{item}': expected key.path=value")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([item]), resolve=False)
    except (OmegaConfBaseException, yaml.YAMLError) as err:  # the value is parsed as YAML
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        raise ConfigError(f"command-line override '{item}': the value is not valid YAML ({problem}); "
                          f"quote it or fix the brackets") from None


def _has_key(data: dict, key: str) -> bool:
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _variant(overrides: list[tuple[str, dict]], legacy: bool = False) -> str:
    """The overrides that change what a run computes, as a directory name a shell and a glob take as it
    is: ``key-value`` joined by ``+`` (``rollout.dtype-nvfp4+trainer.steps-5``), characters outside
    ``[A-Za-z0-9._+-]`` replaced by ``_``; long lists hashed (the full list is in config.yaml).
    ``legacy``: the older spelling ``key=value,...``, by which runs recorded before are still found."""
    parts = []
    for item, data in overrides:
        key = item.split("=", 1)[0].strip()
        if key in ("seed", "variant") or any(key == op or key.startswith(op + ".") for op in OPERATIONAL_KEYS):
            continue
        item = item.strip().replace("/", "_")
        if not legacy:
            key, _, value = item.partition("=")
            item = re.sub(r"[^A-Za-z0-9._+-]", "_", f"{key.strip()}-{value.strip()}")
        parts.append(item)
    label = ("," if legacy else "+").join(parts)
    if len(label) > 80:  # a directory name must stay short; the full list is in config.yaml
        label = f"{len(parts)}overrides-{hashlib.sha256(label.encode()).hexdigest()[:8]}"
    return label


def legacy_run_label(label: str) -> str:
    """``arm+key-value+key-value`` -> the older ``arm+key=value,key=value`` (and a name already in the
    older spelling unchanged): how a loader finds a run recorded under either name."""
    arm, _, rest = label.partition("+")
    if not rest or "=" in rest or rest[:1].isdigit():
        return label
    return f"{arm}+" + ",".join(p.replace("-", "=", 1) for p in rest.split("+"))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load an experiment/arm YAML (with its ``base`` chain) plus ``key=value`` overrides.

    A ConfigError names the layer that set the offending key: the base file, the arm file or the
    command-line override."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = arm_file(path) if path is not None else None
    layers: list[tuple[str, dict]] = _layers_with_bases(path) if path is not None else []
    parsed = [(item, parse_override(item)) for item in overrides or []]
    layers += [(f"command-line override '{item}'", data) for item, data in parsed]
    merged: dict = {}
    for source, data in layers:
        try:
            merged = deep_merge(merged, data)
        except Exception as err:  # noqa: BLE001 - OmegaConf type clashes (a mapping over a value)
            raise ConfigError(f"{source}: {' '.join(str(err).split())}") from None
    try:  # ${a.b} interpolations resolve against the merged layers
        merged = OmegaConf.to_container(OmegaConf.create(merged), resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{layers[-1][0] if layers else 'config'}: {' '.join(str(err).split())}") from None
    variant, legacy = _variant(parsed), _variant(parsed, legacy=True)
    set_here = variant and not any(_has_key(d, "variant") for _, d in parsed)
    if set_here:
        legacy = "+".join(v for v in (merged.get("variant"), legacy) if v)
        merged["variant"] = "+".join(v for v in (merged.get("variant"), variant) if v)
    main = str(path) if path is not None else "defaults"
    try:
        cfg = from_dict(ExperimentConfig, merged)
        validate(cfg)
        if set_here:  # not a field: how the run was named before, to find it (run_dir)
            cfg.legacy_variant = legacy
    except ConfigKeyError as err:
        sources = [src for src, data in layers if _has_key(data, err.key)]
        raise ConfigError(f"{sources[-1] if sources else main}: {err}") from None
    except ConfigError as err:
        raise ConfigError(f"{_blamed_layer(str(err), layers, main)}: {err}") from None
    return cfg


_SECTIONS = "|".join(k for k, hint in get_type_hints(ExperimentConfig).items() if dataclasses.is_dataclass(hint))


def _blamed_layer(message: str, layers: list[tuple[str, dict]], main: str) -> str:
    """The last layer (file or override) that sets a key a cross-field check names, else ``main``."""
    keys = re.findall(rf"\b(?:{_SECTIONS})\.[a-z_0-9]+", message)
    keys += re.findall(r"^(experiment|arm)=", message)  # the run's directory names (name_checks)
    sources = [src for src, data in layers if any(_has_key(data, k) for k in keys)]
    return sources[-1] if sources else main


def loss_checks(lo: LossConfig) -> list[tuple[bool, str]]:
    """Bounds of the loss section; each message names the key, its value and what is allowed."""
    levels = {"tis": ["token", "sequence"], "mis": ["token", "sequence", "geometric"]}
    return [
        (0 <= lo.eps_low < 1, f"loss.eps_low={lo.eps_low} must be in [0, 1) (the clip floor is 1 - eps_low)"),
        (lo.eps_high >= 0, f"loss.eps_high={lo.eps_high} must be >= 0"),
        (lo.dual_clip_c is None or lo.dual_clip_c > 1,
         f"loss.dual_clip_c={lo.dual_clip_c} must be > 1, or null to disable the dual clip"),
        (lo.tis_cap > 0, f"loss.tis_cap={lo.tis_cap} must be > 0 (C in min(rho, C); 2.0 is typical)"),
        (lo.variant not in levels or lo.is_level in levels[lo.variant],
         f"loss.is_level={lo.is_level!r} is not allowed with loss.variant={lo.variant!r} "
         f"(allowed: {levels.get(lo.variant)})"),
        (lo.mis_lower >= 0, f"loss.mis_lower={lo.mis_lower} must be >= 0"),
        (lo.mis_lower < lo.mis_upper,
         f"loss.mis_lower={lo.mis_lower} must be < loss.mis_upper={lo.mis_upper}"),
        (lo.mis_veto is None or 0 < lo.mis_veto < 1,
         f"loss.mis_veto={lo.mis_veto} must be in (0, 1) (typical 1e-4 to 1e-6), or null to disable it"),
        (not lo.mis_token_tis or (lo.variant == "mis" and lo.is_level == "geometric"),
         "loss.mis_token_tis=true needs loss.variant=mis and loss.is_level=geometric"),
        (lo.icepop_alpha >= 0, f"loss.icepop_alpha={lo.icepop_alpha} must be >= 0"),
        (lo.icepop_alpha < lo.icepop_beta,
         f"loss.icepop_alpha={lo.icepop_alpha} must be < loss.icepop_beta={lo.icepop_beta}"),
        (0 <= lo.gspo_eps_low < 1, f"loss.gspo_eps_low={lo.gspo_eps_low} must be in [0, 1)"),
        (lo.gspo_eps_high >= 0, f"loss.gspo_eps_high={lo.gspo_eps_high} must be >= 0"),
        (lo.entropy_coef >= 0, f"loss.entropy_coef={lo.entropy_coef} must be >= 0"),
    ]


def model_checks(m: ModelConfig) -> list[tuple[bool, str]]:
    """Shape relations the transformers model classes need (they fail deep in a forward otherwise,
    naming no key). DeepSeek-V3 derives its MLA sizes from hidden_size and head_dim (moerl.models.presets)."""
    ds = m.preset == "deepseek_v3"
    per_group = m.num_experts // m.n_group if m.n_group else 0
    return [
        (ds or m.num_heads % m.num_kv_heads == 0,
         f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads} "
         f"(grouped-query attention shares each key/value head among num_heads / num_kv_heads heads)"),
        (ds or m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be even (rotary embeddings rotate pairs)"),
        (not ds or m.head_dim % 4 == 0,
         f"model.head_dim={m.head_dim} must be a multiple of 4 with model.preset=deepseek_v3 (half of it is the "
         f"rotary part, which rotates pairs)"),
        (not ds or m.hidden_size >= 4,
         f"model.hidden_size={m.hidden_size} must be >= 4 with model.preset=deepseek_v3 (its kv_lora_rank is "
         f"hidden_size // 4)"),
        (m.experts_implementation != "grouped_mm" or (m.hidden_size % 8 == 0 and m.moe_intermediate_size % 8 == 0),
         f"model.hidden_size={m.hidden_size} and model.moe_intermediate_size={m.moe_intermediate_size} must be "
         f"multiples of 8 with model.experts_implementation=grouped_mm (16-byte strides in bf16), or use eager"),
        (not ds or m.num_experts % m.n_group != 0 or per_group >= 2,
         f"model.num_experts={m.num_experts} / model.n_group={m.n_group} must leave at least 2 experts per group "
         f"(deepseek_v3 scores a group by its 2 best experts)"),
        (not ds or m.num_experts % m.n_group != 0 or m.top_k <= m.topk_group * per_group,
         f"model.top_k={m.top_k} must be <= model.topk_group={m.topk_group} x {per_group} experts per group "
         f"(model.num_experts / model.n_group): routing picks top_k experts within the topk_group best groups"),
    ]


def moe_layer_numbers(m: ModelConfig) -> list[int]:
    """Global numbers of the decoder layers that hold experts, by the rules of the transformers class
    of ``m.preset`` (``model.overrides`` included), so a config with no MoE layer is refused before a
    model is built: such a run would train silently with nothing to route."""
    o = m.overrides
    layers = range(int(o.get("num_hidden_layers", m.num_layers)))
    if m.preset == "deepseek_v3":  # DeepseekV3DecoderLayer: an MoE block from first_k_dense_replace on
        dense = int(o.get("first_k_dense_replace", m.first_k_dense))
        return [i for i in layers if i >= dense]
    if m.preset == "qwen3_moe":  # Qwen3MoeDecoderLayer: not in mlp_only_layers, every decoder_sparse_step-th
        only, step = set(o.get("mlp_only_layers", [])), int(o.get("decoder_sparse_step", 1))
        experts = int(o.get("num_experts", m.num_experts))
        return [i for i in layers if i not in only and experts > 0 and (i + 1) % step == 0]
    return list(layers)  # mixtral: every layer


def validate(cfg: ExperimentConfig) -> None:
    """Cross-field checks that a type hint cannot express; each names the key and the rule."""
    m, r, t, lo = cfg.model, cfg.rollout, cfg.trainer, cfg.loss
    checks = [
        (m.preset != "deepseek_v3" or m.topk_group <= m.n_group, "model.topk_group must be <= model.n_group"),
        (m.top_k <= m.num_experts, "model.top_k must be <= model.num_experts"),
        (m.preset != "deepseek_v3" or m.num_experts % m.n_group == 0,
         "model.num_experts must be divisible by model.n_group (deepseek_v3)"),
        (bool(moe_layer_numbers(m)),
         f"model.first_k_dense={m.first_k_dense} leaves no MoE layer among model.num_layers={m.num_layers}"
         f"{f' (with model.overrides={m.overrides})' if m.overrides else ''}: a run would route nothing; "
         f"use fewer dense layers or more layers" if m.preset == "deepseek_v3" else
         f"model.overrides={m.overrides} leave no MoE layer among model.num_layers={m.num_layers} "
         f"(model.preset={m.preset}): a run would route nothing"),
        *model_checks(m),
        (r.group_size >= 2, "rollout.group_size must be >= 2 (GRPO normalises within a group)"),
        (r.temperature > 0, "rollout.temperature must be > 0"),
        (0 < r.top_p <= 1, "rollout.top_p must be in (0, 1]"),
        ((r.prompts_per_step * r.group_size) % t.mini_batches == 0,
         "rollout.prompts_per_step * rollout.group_size must be divisible by trainer.mini_batches"),
        (t.micro_batch_size > 0, "trainer.micro_batch_size must be > 0"),
        *loss_checks(lo),
        (cfg.refit.bucket_mb > 0, "refit.bucket_mb must be > 0"),
        (cfg.lora.rank > 0, "lora.rank must be > 0"),
        (not (cfg.replay.mode != "none" and not r.capture_routing and cfg.replay.mode == "R3"),
         "replay.mode=R3 needs rollout.capture_routing=true"),
        (r.engine != "vllm" or (cfg.refit.mode, cfg.refit.engine) == ("adapter", "inprocess"),
         "rollout.engine=vllm takes adapter refit into its own processes: refit.mode=adapter, refit.engine=inprocess"),
        (r.engine != "vllm" or r.kernels == "native",
         "rollout.kernels=emulated is the embedded engine's (rollout.engine=hf); vLLM runs its own kernels: set rollout.kernels=native"),
        (cfg.replay.layer_mapping == "layer_number" or cfg.replay.mode == "R3",
         "replay.layer_mapping=position reproduces an R3 bug and needs replay.mode=R3"),
        (cfg.trainer.fake_quant in ("none", r.dtype),
         f"trainer.fake_quant={cfg.trainer.fake_quant} puts the trainer on the rollout's grid: it must be none or "
         f"rollout.dtype ({r.dtype})"),
        (not (r.dtype not in ("bf16", "fp16", "fp32") and cfg.refit.mode == "merged"),
         f"rollout.dtype={r.dtype} needs refit.mode=adapter (the engine quantises its base once; a merged "
         "refit would overwrite it with unquantised weights)"),
        (not (lo.variant == "bypass" and cfg.replay.mode == "R2"),
         "replay.mode=R2 records routing in the old-logprob pass, which loss.variant=bypass skips"),
        (m.path is None or not cfg.warm_start.enabled,
         f"model.path={m.path} is a trained checkpoint: set warm_start.enabled=false (the warm start trains a "
         f"tiny preset from random init)"),
        (m.path is None or cfg.lora.expert_mode == "per_expert" or not cfg.lora.target_experts,
         f"lora.expert_mode={cfg.lora.expert_mode} is written for the tiny presets' fused experts; a checkpoint "
         f"(model.path) takes per_expert (PEFT target_parameters)"),
        (t.dtype == "fp32" or m.path is not None or cfg.device != "cpu",
         "trainer.dtype=bf16 is for a checkpoint on a GPU; the CPU lab's trainer is the fp32 reference"),
    ]
    checks += [(ok, message) for ok, message in name_checks(cfg)]
    checks += [(ok, message) for ok, message in warm_start_checks(cfg.warm_start)]
    checks += [(ok, message) for ok, message in ignored_key_checks(cfg)]
    from moerl.sizes import size_checks

    checks += size_checks(cfg)  # what this machine cannot hold, before anything is written
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


_BAD_NAME_PARTS = ("/", "\\", "\0")


def name_checks(cfg: ExperimentConfig) -> list[tuple[bool, str]]:
    """``experiment`` and ``arm`` are directory names of the run (<output>/<experiment>/<arm>/seed<k>): each
    must be one path part, or a run would be written outside the output directory or into another run's."""
    out = []
    for key in ("experiment", "arm"):
        value = getattr(cfg, key)
        ok = isinstance(value, str) and value not in ("", ".", "..") and not any(c in value for c in _BAD_NAME_PARTS)
        out.append((ok, f"{key}={value!r} must be a single directory name (no '/', '\\', and not '', '.' or '..'): "
                        f"it names the run's directory under tracking.output_dir"))
    return out


def warm_start_checks(ws: WarmStartConfig) -> list[tuple[bool, str]]:
    """torch's OneCycleLR divides by its warm-up length, which is exactly zero at one schedule length."""
    return [(not ws.enabled or float(WARM_START_PCT_START * ws.steps) - 1 != 0,
             f"warm_start.steps={ws.steps} makes the warm start's OneCycleLR warm-up end at its first step "
             f"({WARM_START_PCT_START:g} x {ws.steps} = 1), which torch's scheduler divides by zero on; "
             f"use {ws.steps - 1} or {ws.steps + 1}")]


def _is_default(cfg: Any, name: str) -> bool:
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    f = fields[name]
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return getattr(cfg, name) == default


# The ModelConfig keys a checkpoint's own config.json replaces (model.path).
CHECKPOINT_DEFINES = ("preset", "hidden_size", "num_layers", "num_experts", "top_k", "moe_intermediate_size",
                      "num_heads", "num_kv_heads", "head_dim", "first_k_dense", "n_shared_experts", "n_group",
                      "topk_group", "init_std", "router_aux_loss_coef", "overrides")


def ignored_key_checks(cfg: ExperimentConfig) -> list[tuple[bool, str]]:
    """A key set away from its default where the chosen task, engine or mode never reads it is an error:
    a run would ignore it silently, yet carry it in its name and identity. Two switches may leave their
    settings in place, since a base file's values apply again when an arm switches them back on:
    ``warm_start.enabled=false`` (the warm-start schedule) and ``trainer.samples_every=0``
    (``trainer.samples_per_save``)."""
    d, lo, rp, t, m, lr = cfg.data, cfg.loss, cfg.replay, cfg.trainer, cfg.model, cfg.lora
    synthetic = d.task in ("arith", "arith_steps")
    rules = [  # (section, keys, the condition under which they are ignored, why)
        (d, ("train_path", "test_path", "hub_id"), synthetic,
         f"data.task={d.task} generates its rows (data.train_size, data.test_size, data.max_a, data.max_bc)"),
        (d, ("max_a", "max_bc"), not synthetic, f"data.task={d.task} reads its rows from files or the hub"),
        (d, ("hub_id",), not synthetic and bool(d.train_path), "data.train_path is given and wins over data.hub_id"),
        (d, ("test_path",), not synthetic and not d.train_path,
         "data.test_path is read only with data.train_path (data.hub_id brings its own test split)"),
        (lo, ("mis_lower", "mis_upper", "mis_veto"), lo.variant != "mis",
         f"loss.variant={lo.variant} (only mis reads it)"),
        (lo, ("icepop_alpha", "icepop_beta"), lo.variant != "icepop",
         f"loss.variant={lo.variant} (only icepop reads it)"),
        (lo, ("gspo_eps_low", "gspo_eps_high"), lo.variant != "gspo",
         f"loss.variant={lo.variant} (only gspo reads it)"),
        (lo, ("eps_low", "eps_high", "dual_clip_c"), lo.variant == "gspo",
         "loss.variant=gspo clips its sequence ratio by loss.gspo_eps_low / loss.gspo_eps_high"),
        (lo, ("is_level",), lo.variant not in ("tis", "mis"), f"loss.variant={lo.variant} (only tis and mis read it)"),
        (rp, ("agreement_alarm",), rp.mode != "R3", f"replay.mode={rp.mode} (the alarm watches R3's replay)"),
        (rp, ("strict",), rp.mode == "none", "replay.mode=none replays nothing to check"),
        (t, ("paired_replay_every",), not cfg.rollout.capture_routing,
         "rollout.capture_routing=false records no routes to pair"),
        (lr, ("expert_mode",), not lr.target_experts, "lora.target_experts=false puts no LoRA on the experts"),
        (m, CHECKPOINT_DEFINES, m.path is not None, f"model.path={m.path} defines the model (its config.json)"),
        (m, ("trust_remote_code",), m.path is None, "only a checkpoint (model.path) carries code of its own"),
        (d, ("chat_template", "instruction", "max_prompt_tokens"), m.path is None,
         "only a checkpoint's tokenizer (model.path) has a chat template; the tiny presets' prompts are fixed"),
    ]
    from moerl.models.family_keys import unread_keys, why_unread

    # the model keys the chosen family never reads (the table next to the presets)
    rules += [(m, (key,), m.path is None, why_unread(m.preset, key))
              for key in unread_keys(m.preset, [f.name for f in dataclasses.fields(m)])]
    section_of = {id(getattr(cfg, f.name)): f.name for f in dataclasses.fields(cfg)
                  if dataclasses.is_dataclass(getattr(cfg, f.name))}
    out = []
    for section, keys, ignored, why in rules:
        for key in keys:
            if ignored and not _is_default(section, key):
                name = f"{section_of[id(section)]}.{key}"
                out.append((False, f"{name}={getattr(section, key)!r} has no effect: {why}; remove it"))
    return out


def config_yaml(cfg: ExperimentConfig, only_read: bool = False) -> str:
    """The resolved config as YAML (every key: what a run directory records); ``only_read`` leaves out the
    ``model.*`` keys the chosen family never reads (what ``--print-config`` shows)."""
    data = to_dict(cfg)
    if only_read and cfg.model.path:  # the checkpoint's config.json defines the model; no preset key is read
        for key in CHECKPOINT_DEFINES:
            data["model"].pop(key)
        if cfg.data.task in ("gsm8k", "math"):
            for key in ("max_a", "max_bc"):
                data["data"].pop(key, None)
    elif only_read:
        from moerl.models.family_keys import unread_keys

        for key in unread_keys(cfg.model.preset, list(data["model"])):
            data["model"].pop(key)
    if only_read and not cfg.model.path:
        for key in ("path", "trust_remote_code"):
            data["model"].pop(key)
        for key in ("chat_template", "instruction", "max_prompt_tokens"):
            data["data"].pop(key)
    return yaml.safe_dump(data, sort_keys=False)


def save_config(cfg: ExperimentConfig, path: str | Path) -> None:
    Path(path).write_text(config_yaml(cfg))
