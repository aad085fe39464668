"""Compose a scale experiment against verl's *real* Hydra config.

An experiment is a directory (``experiments/NN_name/``) holding YAML: either one
``experiment.yaml`` or a ``base.yaml`` plus ``arms/<arm>.yaml``. A file may start with
``base: <relative path>`` to inherit another file (deep merge, the child wins). Each file has two
top-level sections:

- ``moerl:`` what the planner and launcher need and verl does not know (public model config
  name, GPU memory, the expert-adapter mode, a one-line question);
- ``verl:`` nested verl config overrides, flattened to Hydra ``key=value`` overrides. A key
  written ``+name`` is *added* (Hydra's ``+``), for verl's free-form dicts such as
  ``actor_rollout_ref.model.lora`` (passed on to Megatron-Bridge's ``LoRA`` dataclass) or
  ``override_transformer_config``.

Composition goes through Hydra's compose API on verl's own config directory, so an override verl
does not know fails with verl/Hydra's own message; we add the experiment file it came from.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moerl.config import deep_merge

VERL_CONFIG_NAME = "ppo_megatron_trainer"


class ExperimentError(ValueError):
    """An experiment file or override that cannot be composed; names the file and the key."""


def verl_config_dir() -> Path:
    import verl

    return Path(verl.__file__).resolve().parent / "trainer" / "config"


def verl_version() -> str:
    import verl

    return verl.__version__


def read_yaml_chain(path: Path, _seen: tuple[Path, ...] = ()) -> tuple[dict, list[Path]]:
    """A YAML file merged over its ``base:`` chain; returns (merged, files base-first)."""
    path = path.resolve()
    if path in _seen:
        raise ExperimentError(f"{path}: 'base:' chain loops back to itself ({' -> '.join(map(str, _seen))})")
    if not path.exists():
        raise ExperimentError(f"experiment file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ExperimentError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    unknown = set(data) - {"base", "moerl", "verl"}
    if unknown:
        raise ExperimentError(f"{path}: unknown top-level keys {sorted(unknown)} (allowed: base, moerl, verl)")
    files = [path]
    base = data.pop("base", None)
    if base is not None:
        parent, parent_files = read_yaml_chain(path.parent / base, _seen + (path,))
        data = deep_merge(parent, data)
        files = parent_files + files
    return data, files


_HYDRA_WORDS = {"null", "true", "false", "inf", "nan"}


def _format_value(value: Any) -> str:
    """A Python value as Hydra override syntax (strings always quoted so '1e-6' or 'a_b' stay
    strings only when they were strings in the YAML)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value) and value.lower() not in _HYDRA_WORDS:
            return value  # a bare identifier is a string to Hydra; keeps printed commands readable
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_format_value(v)}" for k, v in value.items()) + "}"
    raise ExperimentError(f"cannot express {value!r} ({type(value).__name__}) as a Hydra override")


def flatten_overrides(tree: dict, prefix: str = "") -> list[tuple[str, str]]:
    """Nested mapping -> [(dotted key incl. a leading '+' for additions, formatted value)].

    A mapping value is recursed into unless its key is an addition (``+key``): then the whole
    mapping is added as one value. Empty mappings are passed as ``{}`` (set a dict to empty)."""
    out = []
    for key, value in tree.items():
        key = str(key)
        add = key.startswith("+")
        name = key[1:] if add else key
        dotted = f"{prefix}.{name}" if prefix else name
        if isinstance(value, dict) and value and not add:
            for sub_key, sub_val in flatten_overrides(value, dotted):
                out.append((sub_key, sub_val))
        else:
            out.append((("+" if add else "") + dotted, _format_value(value)))
    return out


@dataclass
class Experiment:
    directory: Path
    arm: str | None
    files: list[Path]
    moerl: dict
    overrides: list[str]
    origin: dict[str, Path] = field(default_factory=dict)  # override key -> file that set it

    @property
    def name(self) -> str:
        if self.arm is None and self.files and self.files[-1].name != "experiment.yaml":
            return self.files[-1].stem  # a single experiment file
        return self.directory.name + (f"/{self.arm}" if self.arm else "")


def experiment_arms(directory: Path) -> list[str]:
    return sorted(p.stem for p in (directory / "arms").glob("*.yaml")) if (directory / "arms").is_dir() else []


def load_experiment(directory: str | Path, arm: str | None = None) -> Experiment:
    """Read an experiment directory (and arm), or one experiment YAML file, into verl overrides
    plus moerl metadata."""
    directory = Path(directory).resolve()
    if directory.suffix in (".yaml", ".yml") and directory.is_file():
        if arm is not None:
            raise ExperimentError(f"{directory}: --arm applies to experiment directories, not to a single file")
        return _experiment_from(directory.parent, None, directory)
    if not directory.is_dir():
        raise ExperimentError(f"experiment directory not found: {directory}")
    arms = experiment_arms(directory)
    if arms:
        if arm is None:
            raise ExperimentError(f"{directory.name} has arms {arms}: pass --arm")
        if arm not in arms:  # a former name (moerl.config.RENAMED_ARMS) runs the arm it became
            from moerl.config import current_arm

            arm = current_arm(directory.name, arm)
        if arm not in arms:
            raise ExperimentError(f"{directory.name}: unknown arm '{arm}' (have {arms})")
        entry = directory / "arms" / f"{arm}.yaml"
    else:
        if arm is not None:
            raise ExperimentError(f"{directory.name} has no arms/ folder; --arm {arm} does not apply")
        entry = directory / "experiment.yaml"
    return _experiment_from(directory, arm, entry)


def _experiment_from(directory: Path, arm: str | None, entry: Path) -> Experiment:
    data, files = read_yaml_chain(entry)
    origin: dict[str, Path] = {}
    for f in files:  # which file last set each key, for error messages
        raw = yaml.safe_load(f.read_text()) or {}
        for key, _ in flatten_overrides(raw.get("verl") or {}):
            origin[key.lstrip("+")] = f
    pairs = flatten_overrides(data.get("verl") or {})
    overrides = [f"{k}={v}" for k, v in pairs]
    return Experiment(directory=directory, arm=arm, files=files, moerl=data.get("moerl") or {},
                      overrides=overrides, origin=origin)


def compose_overrides(overrides: list[str], config_name: str = VERL_CONFIG_NAME):
    """verl's trainer config with these overrides, composed exactly as ``main_ppo`` would."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def compose_experiment(exp: Experiment, extra: list[str] = ()):
    """Compose; on failure find the override verl rejects and name the file that set it."""
    try:
        return compose_overrides(exp.overrides + list(extra))
    except Exception as err:  # Hydra raises several exception types; all mean "verl said no"
        culprit = _find_culprit(exp.overrides + list(extra), str(err))
        where = ""
        if culprit is not None:
            key = culprit.split("=", 1)[0].lstrip("+~")
            where = f" in {exp.origin.get(key, 'the command line')}: override '{culprit}'"
        raise ExperimentError(f"{exp.name}: verl {verl_version()} rejected the config{where}:\n{err}") from err


def _find_culprit(overrides: list[str], message: str) -> str | None:
    """The override verl rejected: Hydra names its key ("Could not override 'a.b'"); otherwise
    bisect for the shortest failing prefix (log2(n) composes)."""
    m = re.search(r"(?:override|append to) '([^']+)'", message) or re.search(r"full_key: (\S+)", message)
    if m:
        key = m.group(1).lstrip("+~")
        for o in overrides:
            if o.split("=", 1)[0].lstrip("+~") == key:
                return o
    lo, hi = 0, len(overrides)  # overrides[:hi] fails; find the smallest such hi
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        try:
            compose_overrides(overrides[:mid])
            lo = mid
        except Exception:
            hi = mid
    return overrides[hi - 1] if overrides else None


def select(cfg, key: str, default=None):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=default)


def env_for(cfg) -> dict[str, str]:
    """Environment of the driver process: the variables the config sends to Ray workers
    (``ray_kwargs.ray_init.runtime_env.env_vars``; workers see *only* those, not the driver's
    environment), so the driver imports the same plug-ins (verl imports VERL_USE_EXTERNAL_MODULES in
    every process that imports verl)."""
    env = {str(k): str(v) for k, v in (select(cfg, "ray_kwargs.ray_init.runtime_env.env_vars") or {}).items()}
    if str(select(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode", "")).startswith("moerl_"):
        mods = [m for m in env.get("VERL_USE_EXTERNAL_MODULES", "").split(",") if m]
        if "moerl.verl_ext.losses" not in mods:
            mods.append("moerl.verl_ext.losses")
        env["VERL_USE_EXTERNAL_MODULES"] = ",".join(mods)
    return env
