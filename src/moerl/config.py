"""Typed experiment config: YAML in, dataclasses out, unknown keys rejected with a hint.

Every number a user may want to change lives here, not in code. An experiment is a base YAML plus
one YAML per arm (``base: base.yaml`` at the top of an arm file pulls the base in), plus optional
``key.path=value`` overrides from the command line. Merging is done by OmegaConf; validation is
ours because OmegaConf's own error for a misspelt key does not suggest the key that was meant.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A config file or override that does not fit the schema; the message names file and key."""


@dataclass
class ModelConfig:
    """A tiny MoE built from a transformers config with random init (no download)."""

    preset: Literal["qwen3_moe", "deepseek_v3", "mixtral"] = "qwen3_moe"
    hidden_size: int = 128
    num_layers: int = 4
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    # DeepSeek-V3 / Kimi-K2 family only: leading dense layers, shared experts, group-limited routing.
    first_k_dense: int = 1
    n_shared_experts: int = 1
    n_group: int = 2
    topk_group: int = 1
    init_std: float = 0.02
    experts_implementation: Literal["grouped_mm", "eager", "batched_mm"] = "grouped_mm"
    router_aux_loss_coef: float = 0.01
    # Extra keys passed verbatim to the transformers config (escape hatch for ablations).
    overrides: dict = field(default_factory=dict)


@dataclass
class DataConfig:
    """Which task the policy learns; the synthetic task needs no files at all."""

    # arith: a+b*c= -> \boxed{n}; arith_steps: a+b*c-d= worked step by step (answers of 25-33 tokens).
    task: Literal["arith", "arith_steps", "gsm8k", "math"] = "arith"
    # Local parquet/jsonl file(s) for real datasets; a hub id when online (e.g. "openai/gsm8k").
    train_path: str | None = None
    test_path: str | None = None
    hub_id: str | None = None
    train_size: int = 20000
    test_size: int = 512
    # Synthetic arithmetic ``a + b * c``: ranges of the operands.
    max_a: int = 99
    max_bc: int = 9
    seed: int = 1234


@dataclass
class WarmStartConfig:
    """Supervised pre-training so GRPO starts from a policy with non-trivial accuracy."""

    enabled: bool = True
    steps: int = 300
    batch_size: int = 256
    lr: float = 2e-3
    # Directory searched for a cached checkpoint (keyed by a hash of model config, task and seed).
    cache_dir: str = "results/warm_start"


@dataclass
class RolloutConfig:
    """The rollout engine: its own copy of the policy, in its own precision."""

    engine: Literal["hf", "vllm"] = "hf"
    # fp8: e4m3 weights with per-channel scales, computed in bf16 (an FP8 rollout, W8A16).
    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    prompts_per_step: int = 32
    group_size: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 disables top-k filtering (transformers' generate defaults to 50 otherwise).
    top_k: int = 0
    capture_routing: bool = True


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0
    target_attention: bool = True
    target_experts: bool = True
    # per_expert: PEFT target_parameters on the fused expert tensors; shared / shared_outer: see moerl.lora.
    expert_mode: Literal["per_expert", "shared", "shared_outer"] = "per_expert"
    init_seed: int = 0


@dataclass
class LossConfig:
    """Policy-loss variant and its knobs; formulas and sources are in moerl/trainer/losses.py.

    Ratios: r = pi_theta/pi_old (PPO clip), rho = pi_old/pi_rollout (rollout correction weight)."""

    variant: Literal["ppo_clip", "tis", "mis", "icepop", "gspo", "bypass"] = "ppo_clip"
    # PPO clip range [1 - eps_low, 1 + eps_high] on r (DAPO clip-higher: 0.2 / 0.28).
    eps_low: float = 0.2
    eps_high: float = 0.28
    # Dual-clip constant c > 1 bounds the ratio for negative advantages; null disables it.
    dual_clip_c: float | None = None
    # token_mean (default, as DAPO and verl): every response token counts once, no length bias
    # towards short answers; seq_mean_token_mean (GRPO/GSPO papers); seq_sum_constant (Dr. GRPO).
    aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_sum_constant"] = "token_mean"
    # Truncated IS (tis): weight min(rho, tis_cap); C=2 as in Yao et al. Also the cap of mis_token_tis.
    tis_cap: float = 2.0
    # Level of the rho used by tis (token | sequence) and mis (token | sequence | geometric).
    is_level: Literal["token", "sequence", "geometric"] = "token"
    # Masked IS (mis): zero tokens/sequences whose rho falls outside [mis_lower, mis_upper].
    mis_lower: float = 0.5
    mis_upper: float = 2.0
    # Veto: drop a whole sequence if any token has rho below this (catastrophic token); null = off.
    mis_veto: float | None = 1e-4
    # mis with is_level=geometric: also weight kept tokens by min(rho_t, tis_cap) (Miles, verl
    # decoupled_geo_rs_token_tis); false = pure rejection (weight 1 on kept sequences).
    mis_token_tis: bool = False
    # IcePop: token mask outside [icepop_alpha, icepop_beta] (Ring-1T defaults 0.5 / 5).
    icepop_alpha: float = 0.5
    icepop_beta: float = 5.0
    # GSPO: clip range of the sequence ratio (pi_theta/pi_old)^(1/|y|) (paper: 3e-4 / 4e-4).
    gspo_eps_low: float = 3e-4
    gspo_eps_high: float = 4e-4
    entropy_coef: float = 0.0


@dataclass
class ReplayConfig:
    """Router Replay: none, R2 (replay the trainer's own old-pass routing) or R3 (the rollout's)."""

    mode: Literal["none", "R2", "R3"] = "none"
    # Raise when an expert used under replay differs from the trace on a valid row.
    strict: bool = False
    # Warn (and log routing/agreement_alarm=1) when the trainer's native-vs-trace disagreement under R3
    # exceeds this many times its no-replay level (+0.01), measured by trainer.paired_replay_every's pass.
    agreement_alarm: float = 3.0
    # How a trace column is matched to an MoE router. layer_number is the only correct mapping;
    # position REPRODUCES A BUG (the i-th MoE router reads global layer i: on models with dense first
    # layers the first MoE layers get zero rows and the others another layer's routes). Experiment 05 only.
    layer_mapping: Literal["layer_number", "position"] = "layer_number"


@dataclass
class RefitConfig:
    # adapter: only LoRA tensors travel (engine keeps its base resident); merged: full merged weights.
    mode: Literal["adapter", "merged"] = "adapter"
    bucket_mb: float = 4.0
    # inprocess: the engine is a separate copy in this process; process: its own process, fed through
    # shared-memory buckets, as vLLM is fed by verl.
    engine: Literal["inprocess", "process"] = "inprocess"


@dataclass
class TrainerConfig:
    steps: int = 60
    lr: float = 1e-3
    # Linear learning-rate warm-up: Adam's first updates are sign-like at full lr, which on freshly
    # zero-initialised LoRA B matrices is a large, mostly random perturbation of the warm start.
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    # Each step's rollouts are split into this many optimizer updates (PPO mini-batches).
    mini_batches: int = 2
    epochs: int = 1
    micro_batch_size: int = 64
    grad_clip: float = 1.0
    activation_checkpointing: bool = False
    eval_every: int = 10
    eval_size: int = 512
    checkpoint_every: int = 10
    # Every N steps save per-token (rollout logprob, trainer logprob, IS weight, flags) samples.
    samples_every: int = 10
    samples_per_save: int = 2048
    # Every N steps recompute the old logprobs of the same batch with the other replay setting (R3 arms:
    # without replay; others: with the rollout trace) for a paired k3 ratio; 0 = off.
    paired_replay_every: int = 0


@dataclass
class TrackingConfig:
    output_dir: str = "results/runs"
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "moerl"
    wandb_entity: str | None = None
    progress_bar: bool = True


@dataclass
class ExperimentConfig:
    experiment: str = "00_tiny_moe_cpu"
    arm: str = "baseline"
    seed: int = 0
    threads: int = 2
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
        return f"{self.experiment}/{self.arm}/seed{self.seed}"


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


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check one leaf against its type hint, converting where YAML is looser than Python."""
    origin = get_origin(hint)
    if origin is Literal:
        allowed = get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {list(allowed)}")
        return value
    args = get_args(hint)
    if type(None) in args:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], where)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if hint is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(value)
    return value


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys with the closest valid name."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key '{path}'{_closest(str(key), names)}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = from_dict(hint, value or {}, path)
        else:
            kwargs[key] = _coerce(value, hint, path)
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


def _read_yaml(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def deep_merge(base: dict, over: dict) -> dict:
    """``over`` merged into ``base`` recursively (mappings merge, everything else replaces)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _load_with_bases(path: Path, seen: tuple = ()) -> dict:
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'base' chain loops back on itself")
    data = _read_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    parent = _load_with_bases((path.parent / base), seen + (path.resolve(),))
    return deep_merge(parent, data)


def parse_override(item: str) -> dict:
    """``trainer.lr=3e-4`` -> ``{"trainer": {"lr": 0.0003}}`` (value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}': expected key.path=value")
    key, raw = item.split("=", 1)
    value = yaml.safe_load(raw) if raw != "" else None
    out: dict = {}
    node = out
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load an experiment/arm YAML (with its ``base`` chain) plus ``key=value`` overrides."""
    data: dict = {}
    source = "defaults"
    if path is not None:
        path = Path(path)
        source = str(path)
        data = _load_with_bases(path)
    for item in overrides or []:
        data = deep_merge(data, parse_override(item))
    try:
        cfg = from_dict(ExperimentConfig, data)
        validate(cfg)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    return cfg


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


def validate(cfg: ExperimentConfig) -> None:
    """Cross-field checks that a type hint cannot express; each names the key and the rule."""
    m, r, t, lo = cfg.model, cfg.rollout, cfg.trainer, cfg.loss
    checks = [
        (m.top_k <= m.num_experts, "model.top_k must be <= model.num_experts"),
        (m.preset != "deepseek_v3" or m.num_experts % m.n_group == 0,
         "model.num_experts must be divisible by model.n_group (deepseek_v3)"),
        (m.preset != "deepseek_v3" or m.first_k_dense < m.num_layers,
         "model.first_k_dense must be < model.num_layers"),
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
        (cfg.replay.layer_mapping == "layer_number" or cfg.replay.mode == "R3",
         "replay.layer_mapping=position reproduces an R3 bug and needs replay.mode=R3"),
        (not (r.dtype == "fp8" and cfg.refit.mode == "merged"),
         "rollout.dtype=fp8 needs refit.mode=adapter (the engine rounds its base through e4m3 once; a merged "
         "refit would overwrite it with unrounded weights)"),
        (not (lo.variant == "bypass" and cfg.replay.mode == "R2"),
         "replay.mode=R2 records routing in the old-logprob pass, which loss.variant=bypass skips"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def save_config(cfg: ExperimentConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
