"""The one loader of recorded runs, shared by scripts and notebooks: tidy pandas frames keyed by
experiment, arm and seed, read from run directories (metrics.jsonl, config.yaml, summary.json,
samples/*.npz) or from wandb's public API (cluster runs of verl, their metric names mapped to this
repo's).

A run directory is ``<root>/<experiment>/<arm>/seed<k>/``. A killed run's truncated last line is
dropped with a warning naming the file; a run that is asked for but missing is reported by name. A run
recorded under an arm's former name (moerl.config.RENAMED_ARMS) loads under its current name. Runs of one
comparison made from different base weights or data content (their run.json hashes) are refused, named.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from moerl.tracking import read_metrics

log = logging.getLogger(__name__)


class MissingRunError(FileNotFoundError):
    """A run that was asked for by name is not on disk."""


@dataclass(frozen=True)
class RunKey:
    experiment: str
    arm: str
    seed: int


def _keyed(df: pd.DataFrame, key: RunKey) -> pd.DataFrame:
    """``df`` with experiment, arm and seed as its leading columns."""
    for column in ("seed", "arm", "experiment"):
        df.insert(0, column, getattr(key, column))
    return df


def _read_jsonl(path: Path) -> list[dict]:
    return read_metrics(path, warn=True)


def results_root(env: str = "MOERL_RESULTS", default: str = "results/runs") -> Path:
    """The runs root a notebook reads: ``$MOERL_RESULTS`` (tests point it at a fixture) or ``default``.
    Relative paths are tried from the current directory and then from the repository root, so a
    notebook runs the same from the repo root and from analysis/."""
    path = Path(os.environ.get(env) or default)
    tried = [path.resolve()]
    if not path.is_absolute() and not path.exists():
        repo = Path(__file__).resolve().parents[3]
        tried.append(repo / path)
        if (repo / path).exists():
            path = repo / path
    if not path.exists():
        raise MissingRunError(f"{tried[0]} does not exist" + "".join(f", nor does {t}" for t in tried[1:])
                              + f" (set ${env} to a results directory, default {default})")
    return path


def find_runs(root: str | Path) -> dict[RunKey, Path]:
    """Every run directory (one holding metrics.jsonl) under ``root``."""
    root = Path(root)
    if not root.exists():
        raise MissingRunError(f"{root} does not exist: no recorded runs there")
    from moerl.config import current_arm

    out = {}
    for metrics in sorted(root.glob("**/seed*/metrics.jsonl")):
        run = metrics.parent
        if ".old-" in run.name:
            continue
        try:
            seed = int(run.name.removeprefix("seed"))
        except ValueError:
            continue
        experiment = run.parent.parent.name
        key = RunKey(experiment, current_arm(experiment, run.parent.name), seed)
        if key in out:  # one run under an arm's former and current name: neither can be chosen silently
            raise ValueError(f"{out[key]} and {run} are the same run ({key.arm}/seed{seed}; "
                             f"{run.parent.name if key.arm != run.parent.name else out[key].parent.name} is the "
                             f"arm's former name): move one of them out of {root}")
        out[key] = run
    return out


class MixedInputsError(ValueError):
    """Runs of one comparison made from different base weights or different data: pooling them would
    compare two experiments as one."""


# Identity keys that decide a run's base model and data: runs agreeing on them must share their content.
_BASE_AND_DATA = ("model.", "data.", "warm_start.")


def check_same_inputs(runs: dict[RunKey, Path]) -> None:
    """Refuse to pool runs of one comparison (one experiment, the same model, data and warm-start
    config) whose recorded base-weights hash (run.json ``base_hash``) or input hashes (run.json
    ``inputs``: data files, base config) differ, naming the runs on each side and both hashes. Runs
    recorded before these fields existed have nothing to compare and are pooled as before."""
    seen: dict[tuple, dict[str, list[RunKey]]] = {}
    for key, run in runs.items():
        try:
            record = json.loads((run / "run.json").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict):
            continue
        identity = record.get("identity") or {}
        group = json.dumps({k: v for k, v in identity.items() if k.startswith(_BASE_AND_DATA)
                            and k != "warm_start.cache_dir"}, sort_keys=True, default=str)
        inputs = record.get("inputs") if isinstance(record.get("inputs"), dict) else {}
        for name, value in {"base_hash": record.get("base_hash"), **inputs}.items():
            if value is not None:
                seen.setdefault((key.experiment, group, name), {}).setdefault(str(value), []).append(key)
    for (experiment, _, name), by_value in seen.items():
        if len(by_value) > 1:
            sides = "; ".join(f"{value} in {', '.join(f'{k.arm}/seed{k.seed}' for k in keys)}"
                              for value, keys in sorted(by_value.items()))
            raise MixedInputsError(f"{experiment}: runs of one comparison were made from different {name} ({sides}): "
                                   f"they cannot be pooled; rerun the odd ones on the same inputs (--fresh), or move "
                                   f"them out of the results directory")


def _numeric(value):
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return value


# Metric keys that were renamed: old name -> current name. Runs recorded under the old name load
# under the current one, so tables, figures and notebooks need only the current name.
METRIC_ALIASES = {
    # The share of prompt groups whose rewards are not all equal (the groups that carry a GRPO
    # gradient); it never counted solved groups.
    "reward/group_solved_frac": "reward/mixed_group_frac",
}


def canonical_key(key: str) -> str:
    """The current name of a metric key, also under a summary prefix (``mean/<key>``)."""
    if key in METRIC_ALIASES:
        return METRIC_ALIASES[key]
    head, sep, tail = key.partition("/")
    if sep and tail in METRIC_ALIASES:
        return f"{head}/{METRIC_ALIASES[tail]}"
    return key


def _rows_frame(rows: list[dict]) -> pd.DataFrame:
    """Metric rows as a frame, renamed keys under their current names (a row never holds both)."""
    return pd.DataFrame([{canonical_key(k): _numeric(v) for k, v in r.items()} for r in rows])


def load_metrics(root: str | Path, experiment: str | None = None, arms: list[str] | None = None) -> pd.DataFrame:
    """One row per logged step: columns experiment, arm, seed, step and every metric."""
    runs = find_runs(root)
    if experiment is not None:
        runs = {k: v for k, v in runs.items() if k.experiment == experiment}
    if arms is not None:
        arms = [_current(a, experiment) for a in arms]
        missing = [a for a in arms if not any(k.arm == a for k in runs)]
        if missing:
            raise MissingRunError(f"no recorded run for arm(s) {missing} under {Path(root)}"
                                  f"{'/' + experiment if experiment else ''}")
        runs = {k: v for k, v in runs.items() if k.arm in arms}
    check_same_inputs(runs)
    frames = []
    for key, run in runs.items():
        rows = _read_jsonl(run / "metrics.jsonl")
        if not rows:
            continue
        frames.append(_keyed(_rows_frame(rows), key))
    if not frames:
        where = Path(root) / experiment if experiment else Path(root)
        raise MissingRunError(f"no runs with metrics under {where} (expected <arm>/seed<k>/metrics.jsonl there)")
    return pd.concat(frames, ignore_index=True, sort=False)


def _current(arm: str, experiment: str | None) -> str:
    """``arm`` under its current name in ``experiment`` (unchanged without one)."""
    from moerl.config import current_arm

    return current_arm(experiment, arm) if experiment else arm


def run_names(arm: str, experiment: str | None = None) -> list[str]:
    """The directory names a run of ``arm`` (``<arm>[+<overrides>]``) may have: as written, and in the
    other spelling of its overrides (``key-value+...`` now, ``key=value,...`` for runs recorded before);
    with ``experiment``, also under the arm's current and former names (moerl.config.RENAMED_ARMS)."""
    from moerl.config import former_arms, legacy_run_label

    base, sep, rest = arm.partition("+")
    bases = [base]
    if experiment:
        current = _current(base, experiment)
        bases = list(dict.fromkeys([base, current, *former_arms(experiment, current)]))
    names = []
    for name in (b + sep + rest for b in bases):
        legacy = legacy_run_label(name)
        if legacy != name:
            names += [name, legacy]
        elif "=" in rest and "[" not in rest:  # written with '=', separated by ',' (older) or '+' (as run.py's)
            names += [name, name.partition("+")[0] + "+" + "+".join(p.replace("=", "-", 1)
                                                                  for p in re.split(r"[,+]", rest))]
        else:
            names.append(name)
    return names


def load_run(root: str | Path, experiment: str, arm: str, seed: int) -> pd.DataFrame:
    """The metrics of one run (under either spelling of its name and any name of its arm, ``run_names``),
    or MissingRunError naming the run directory that is not there. Rows carry the arm's current name."""
    arm = _current(arm, experiment)
    runs = [Path(root) / experiment / name / f"seed{seed}" for name in run_names(arm, experiment)]
    run = next((r for r in runs if (r / "metrics.jsonl").exists()), runs[0])
    if not (run / "metrics.jsonl").exists():
        have = sorted(f"{k.arm}/seed{k.seed}" for k in find_runs(root) if k.experiment == experiment) \
            if Path(root).exists() else []
        raise MissingRunError(f"run {experiment}/{arm}/seed{seed} not found: no {run / 'metrics.jsonl'}"
                              f" (recorded runs of {experiment}: {have or 'none'})")
    df = _rows_frame(_read_jsonl(run / "metrics.jsonl"))
    df.insert(0, "seed", seed)
    df.insert(0, "arm", arm)
    df.insert(0, "experiment", experiment)
    return df


def is_level(loss: dict | None) -> str:
    """The level of the raw importance ratio a run's ``is/*`` metrics describe: ``token``, or
    ``sequence`` / ``geometric`` (one ratio per sequence) for a TIS or MIS loss configured so.
    Token- and sequence-level ratios live on different scales and are never pooled."""
    loss = loss or {}
    if loss.get("variant") in ("tis", "mis"):
        return str(loss.get("is_level", "token"))
    return "token"


def load_summaries(root: str | Path, experiment: str | None = None) -> pd.DataFrame:
    """One row per finished run (summary.json flattened), plus its resolved config's key knobs;
    MissingRunError naming the directory when no run there has finished."""
    rows = []
    runs = {k: v for k, v in find_runs(root).items() if experiment is None or k.experiment == experiment}
    check_same_inputs(runs)
    for key, run in runs.items():
        path = run / "summary.json"
        if not path.exists():
            continue
        summary = json.loads(path.read_text())
        flat = {"experiment": key.experiment, "arm": key.arm, "seed": key.seed}
        for k, v in summary.items():
            if isinstance(v, dict):
                flat.update({canonical_key(f"{k}/{kk}"): vv for kk, vv in v.items()})
            else:
                flat[canonical_key(k)] = v
        cfg_path = run / "config.yaml"
        if cfg_path.exists():
            cfg = yaml.safe_load(cfg_path.read_text())
            try:
                flat.update({"cfg/preset": cfg["model"]["preset"], "cfg/rollout_dtype": cfg["rollout"]["dtype"],
                             "cfg/loss": cfg["loss"]["variant"], "cfg/replay": cfg["replay"]["mode"],
                             "cfg/expert_mode": cfg["lora"]["expert_mode"], "cfg/refit": cfg["refit"]["mode"],
                             "cfg/steps": cfg["trainer"]["steps"],
                             "cfg/is_level": is_level(cfg["loss"])})
            except (KeyError, TypeError) as err:
                raise ValueError(f"{cfg_path}: expected a resolved experiment config, missing key {err}") from None
        sha = run / "git_sha.txt"
        flat["git_sha"] = sha.read_text().strip() if sha.exists() else None
        rows.append(flat)
    if not rows:
        where = Path(root) / experiment if experiment else Path(root)
        raise MissingRunError(f"no finished runs under {where} (expected <arm>/seed<k>/summary.json there)")
    return pd.DataFrame(rows)


def load_experiment(experiment: str, root: str | Path | None = None, wandb_project: str | None = None,
                    api=None) -> pd.DataFrame:
    """The metrics a notebook plots: a cluster run of 01-04 from wandb when ``wandb_project``
    (ENTITY/PROJECT; runs grouped by experiment, as the launcher logs them) is given, else the run
    directories under ``root`` (default: results_root())."""
    if wandb_project:
        return load_wandb_runs(wandb_project, filters={"group": experiment}, api=api)
    return load_metrics(root if root is not None else results_root(), experiment)


def load_arm_configs(root: str | Path, experiment: str) -> dict[str, dict]:
    """Each arm's resolved config (config.yaml of its lowest seed): what a figure needs to mark the
    arm's thresholds (TIS cap, MIS / IcePop bands)."""
    out = {}
    for key, run in sorted(find_runs(root).items(), key=lambda kv: (kv[0].arm, kv[0].seed)):
        path = run / "config.yaml"
        if key.experiment != experiment or key.arm in out or not path.exists():
            continue
        cfg = yaml.safe_load(path.read_text())
        if not isinstance(cfg, dict):
            raise ValueError(f"{path}: expected a resolved experiment config (a mapping)")
        out[key.arm] = cfg
    if not out:
        raise MissingRunError(f"no run configs under {Path(root) / experiment} (expected <arm>/seed<k>/config.yaml)")
    return out


def per_arm_table(frame: pd.DataFrame, keys: list[str], fmt: str = "{:.4f}", stat: str = "mean") -> pd.DataFrame:
    """``stat`` (mean or median) over the steps of each run, then 'mean ± std' over seeds: one row per
    arm, one column per key (keys not recorded are left out). Use the median for a heavy-tailed
    per-step quantity such as k3."""
    keys = [k for k in keys if k in frame]
    per_run = getattr(frame.groupby(["arm", "seed"])[keys], stat)().reset_index()
    stats = seed_stats(per_run, keys)
    return pd.DataFrame({k: [mean_std(stats.loc[a, (k, "mean")], stats.loc[a, (k, "std")], int(stats.loc[a, (k, "n")]), fmt)
                             for a in stats.index] for k in keys}, index=stats.index)


def select_arms(frame: pd.DataFrame, arms: list[str] | str | None) -> pd.DataFrame:
    """Rows of the given arms (a list, or a comma-separated string as in $MOERL_ARMS); all when None
    or empty. An arm that is not in the frame is named with the arms that are."""
    if isinstance(arms, str):
        arms = [a.strip() for a in arms.split(",") if a.strip()]
    if not arms:
        return frame
    have = sorted(frame["arm"].unique())
    experiments = frame["experiment"].unique() if "experiment" in frame else []
    arms = [next((c for c in (_current(a, e) for e in experiments) if c in have), a) for a in arms]  # former names
    missing = [a for a in arms if a not in have]
    if missing:
        raise MissingRunError(f"arm(s) {missing} not recorded (have: {have})")
    return frame[frame["arm"].isin(arms)]


def load_token_samples(root: str | Path, experiment: str | None = None, arms: list[str] | None = None) -> pd.DataFrame:
    """Per-token samples (rollout vs trainer logprob, IS weight, flags) saved every N steps."""
    frames = []
    arms = None if arms is None else [_current(a, experiment) for a in arms]
    runs = {k: v for k, v in find_runs(root).items()
            if (experiment is None or k.experiment == experiment) and (arms is None or k.arm in arms)}
    check_same_inputs(runs)
    for key, run in runs.items():
        for path in sorted((run / "samples").glob("step_*.npz")):
            with np.load(path) as data:
                df = pd.DataFrame({k: data[k] for k in data.files})
            df.insert(0, "step", int(path.stem.split("_")[1]))
            frames.append(_keyed(df, key))
    if not frames:
        where = Path(root) / experiment if experiment else Path(root)
        raise MissingRunError(f"no per-token samples under {where} (expected <arm>/seed<k>/samples/step_*.npz; "
                              "trainer.samples_every saves them)")
    return pd.concat(frames, ignore_index=True)


# verl's metric names (verl 0.9.1: trainer/ppo/rollout_corr_helper.py, trainer/ppo/metric_utils.py,
# trainer/ppo/ray_trainer.py) -> this repo's, so a cluster run of 01-04 goes through the same tables,
# figures and notebooks as a CPU run. Both sides use d = log pi_old - log pi_rollout, k1 = -d,
# k3 = exp(d) - 1 - d and log_ppl_diff = mean log pi_rollout - mean log pi_old.
VERL_METRIC_MAP = {
    "rollout_corr/kl": "mismatch/k1",
    "rollout_corr/k3_kl": "mismatch/k3",
    "rollout_corr/log_ppl_diff": "mismatch/log_ppl_diff",
    "rollout_corr/log_ppl_abs_diff": "mismatch/log_ppl_abs_diff",
    "rollout_corr/log_ppl_diff_max": "mismatch/log_ppl_diff_max",
    "rollout_corr/log_ppl_diff_min": "mismatch/log_ppl_diff_min",
    "rollout_corr/ppl_ratio": "mismatch/ppl_ratio",
    "rollout_corr/chi2_token": "mismatch/chi2_token",
    "rollout_corr/training_log_ppl": "mismatch/trainer_log_ppl",
    "rollout_corr/rollout_log_ppl": "mismatch/rollout_log_ppl",
    "rollout_corr/rollout_is_mean": "is/mean",
    "rollout_corr/rollout_is_std": "is/std",
    "rollout_corr/rollout_is_max": "is/max",
    "rollout_corr/rollout_is_min": "is/min",
    "rollout_corr/rollout_is_eff_sample_size": "is/ess",
    "rollout_corr/rollout_is_ratio_fraction_high": "is/above_frac",
    "rollout_corr/rollout_is_ratio_fraction_low": "is/below_frac",
    "rollout_corr/rollout_rs_masked_fraction": "mask/token_frac",
    "rollout_corr/rollout_rs_seq_masked_fraction": "mask/seq_frac",
    "training/rollout_probs_diff_max": "mismatch/dp_max",
    "training/rollout_probs_diff_mean": "mismatch/dp_mean",
    "training/rollout_actor_probs_pearson_corr": "mismatch/prob_pearson",
    "training/global_step": "step",
    "critic/score/mean": "reward/mean",
    "actor/pg_clipfrac": "clip/frac",
    "actor/pg_clipfrac_lower": "clip/dual_frac",
    "actor/ppo_kl": "loss/ppo_kl",
    "actor/pg_loss": "loss/pg",
    "actor/grad_norm": "grad_norm",
    "actor/entropy": "entropy",
    "response_length/mean": "response/length_mean",
}


def map_verl_metrics(columns) -> dict[str, str]:
    """Rename map for a frame of verl metrics: VERL_METRIC_MAP, plus validation accuracy
    (``val-core/<data source>/<var>/mean@1`` -> ``eval/pass1``). Names not in the map keep theirs."""
    out = {c: VERL_METRIC_MAP[c] for c in columns if c in VERL_METRIC_MAP}
    val = [c for c in columns if str(c).startswith("val-core/") and str(c).endswith("/mean@1")]
    if len(val) == 1:
        out[val[0]] = "eval/pass1"
    return out


def _run_key_field(run, name: str):
    """experiment / arm / seed of a wandb run: its config (what moerl and the verl launcher log),
    else its group (experiment) and ``arm:`` / ``seed:`` tags."""
    cfg = dict(run.config or {})
    for key in (name, f"moerl/{name}", f"moerl.{name}"):
        if cfg.get(key) is not None:
            return cfg[key]
    if name == "experiment" and getattr(run, "group", None):
        return run.group
    for tag in getattr(run, "tags", None) or []:
        if str(tag).startswith(f"{name}:"):
            return str(tag).split(":", 1)[1]
    return None


def load_wandb_runs(path: str, filters: dict | None = None, api=None) -> pd.DataFrame:
    """Metrics of wandb runs through the public API (``wandb.Api().runs(path, filters)``; needs network
    and a login; an offline run gets there with ``wandb sync <run dir>``): one row per logged step,
    keyed by experiment, arm and seed like load_metrics, verl's metric names mapped to this repo's
    (VERL_METRIC_MAP). ``api``: a wandb.Api (tests pass a stand-in)."""
    if api is None:
        import wandb

        api = wandb.Api()
    frames = []
    for run in api.runs(path, filters=filters or {}):
        df = run.history(samples=100_000, pandas=True)
        if df is None or len(df) == 0:
            continue
        df = df.rename(columns=map_verl_metrics(df.columns)).rename(columns=canonical_key)
        if "step" not in df:
            if "_step" not in df:
                raise ValueError(f"wandb run {path}/{run.id}: no step column (training/global_step or _step)")
            df = df.rename(columns={"_step": "step"})
        seed = _run_key_field(run, "seed")
        key = RunKey(str(_run_key_field(run, "experiment") or path.rsplit("/", 1)[-1]),
                     str(_run_key_field(run, "arm") or run.name), int(seed) if seed is not None else 0)
        df = _keyed(df, key)
        df.insert(3, "wandb_run", run.id)
        frames.append(df)
    if not frames:
        raise MissingRunError(f"no wandb runs with history at {path}" + (f" matching {filters}" if filters else ""))
    return pd.concat(frames, ignore_index=True, sort=False)


# ----------------------------------------------------------------------------------------------
# Per-run and per-arm tables (RESULTS.md, compare_runs.py, notebooks)
# ----------------------------------------------------------------------------------------------
def load_sweep(experiment_dir: str | Path) -> dict | None:
    """``sweep.json`` written by scripts/sweep.py (invocations, total wall time, per-run seconds)."""
    path = Path(experiment_dir) / "sweep.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None


def run_table(root: str | Path, experiment: str) -> pd.DataFrame:
    """One row per finished run: its summary and config knobs, the statistics of run_statistics
    (run-median k3, all-layer routing agreement), ``wall/train_s`` (sum of the
    logged ``time/step``) and ``wall/run_s`` (the process time scripts/sweep.py measured, all
    attempts of the run, when the run went through the sweep)."""
    summ = load_summaries(root, experiment)
    metrics = load_metrics(root, experiment)
    train = metrics[metrics["reward/mean"].notna()] if "reward/mean" in metrics else metrics.iloc[:0]
    if "time/step" in train:
        wall = train.groupby(["arm", "seed"])["time/step"].sum().rename("wall/train_s").reset_index()
        summ = summ.merge(wall, on=["arm", "seed"], how="left")
    sweep = load_sweep(Path(root) / experiment) or {}
    per_run = {_sweep_key(experiment, name): v for name, v in sweep.get("runs", {}).items()}
    summ["wall/run_s"] = [per_run.get(f"{a}/seed{s}", {}).get("seconds", np.nan)
                          for a, s in zip(summ["arm"], summ["seed"])]
    stats = run_statistics(metrics)
    summ = summ.drop(columns=[c for c in stats if c not in ("arm", "seed")], errors="ignore")
    summ = summ.merge(stats, on=["arm", "seed"], how="left")
    return summ.sort_values(["arm", "seed"]).reset_index(drop=True)


def _sweep_key(experiment: str, name: str) -> str:
    """A sweep.json run key ``<arm>[+<overrides>]/seed<k>`` with the arm under its current name."""
    label, sep, seed = name.rpartition("/")
    return f"{_current(label, experiment)}{sep}{seed}" if sep else name


def run_statistics(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per-run statistics a summary.json lacks, one row per (arm, seed), from the training steps:

    - ``median/mismatch/k3``: the median over steps of per-step k3. Per-step k3 is heavy-tailed
      (one spike can carry a run's mean), so runs are compared by their median step.
    - ``mean/mismatch/k3``: the mean over steps, for reference.
    - ``mean/routing/all_layers_agree``: the share of tokens whose trainer-native top-k equals the
      rollout's in *every* MoE layer (1 - ``routing/any_layer_differs``), mean over steps. This is
      stricter than ``routing/agreement``, which averages the per-layer agreement over layers.
    """
    train = metrics[metrics["reward/mean"].notna()] if "reward/mean" in metrics else metrics
    out = train[["arm", "seed"]].drop_duplicates().set_index(["arm", "seed"])
    groups = train.groupby(["arm", "seed"])
    if "mismatch/k3" in train:
        out["median/mismatch/k3"] = groups["mismatch/k3"].median()
        out["mean/mismatch/k3"] = groups["mismatch/k3"].mean()
    if "routing/any_layer_differs" in train:
        out["mean/routing/all_layers_agree"] = 1.0 - groups["routing/any_layer_differs"].mean()
    return out.reset_index()


def family_references(runs: pd.DataFrame, name: str = "baseline") -> dict[str, str]:
    """arm -> the uncorrected arm of the same model preset (``cfg/preset``): ``baseline`` or
    ``<prefix>_baseline``. A ratio between arms is only meaningful within one architecture, so
    each arm is compared with its own family's baseline. A run name with overrides
    (``tis+rollout.dtype=fp8``) is compared with the baseline under the same overrides
    (``baseline+rollout.dtype=fp8``). Arms whose preset has no such arm are left out."""
    if "cfg/preset" not in runs:
        return {a: name for a in runs["arm"].unique()} if name in set(runs["arm"]) else {}
    from moerl.config import legacy_run_label

    preset = runs.groupby("arm")["cfg/preset"].first()
    split = {a: legacy_run_label(a).partition("+") for a in preset.index}  # either spelling of the overrides
    bases = {(p, split[a][2]): a for a, p in preset.items() if split[a][0] == name or split[a][0].endswith(f"_{name}")}
    return {a: bases[(p, split[a][2])] for a, p in preset.items() if (p, split[a][2]) in bases}


def seed_stats(df: pd.DataFrame, columns: list[str], by: str = "arm") -> pd.DataFrame:
    """Mean, std (ddof 1; NaN for one seed) and the number of seeds of each column, per ``by``.
    Columns become a MultiIndex (column, mean|std|n)."""
    present = [c for c in columns if c in df.columns]
    missing = [c for c in columns if c not in df.columns]
    if missing:
        log.info("seed_stats: columns not recorded: %s", missing)
    numeric = df[[by, *present]].copy()
    for c in present:
        numeric[c] = pd.to_numeric(numeric[c], errors="coerce")
    return numeric.groupby(by).agg(["mean", "std", "count"]).rename(columns={"count": "n"}, level=1)


def mean_std(mean: float, std: float, n: int, fmt: str = "{:.3f}") -> str:
    """'m ± s' over seeds; 'm' alone for one seed; 'n/a' when nothing was recorded."""
    if n == 0 or mean != mean:
        return "n/a"
    if n == 1 or std != std:
        return fmt.format(mean)
    return f"{fmt.format(mean)} ± {fmt.format(std)}"


def load_refit(root: str | Path = "results/refit") -> dict[str, dict]:
    """Every JSON the refit benchmark (benchmarks/bench_refit.py) wrote under ``root``, by file stem."""
    root = Path(root)
    files = sorted(root.glob("*.json")) if root.is_dir() else []
    if not files:
        raise MissingRunError(f"no refit benchmark results: expected {root}/*.json "
                              f"(run `python benchmarks/bench_refit.py` to produce them)")
    out = {}
    for path in files:
        try:
            out[path.stem] = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
    return out


def write_marked_section(path: str | Path, name: str, writer: str, body: str) -> None:
    """Put ``body`` into the markdown file ``path`` between ``<!-- name: begin (writer) -->`` and
    ``<!-- name: end -->``, replacing that section if present, appending it otherwise. Several scripts
    share results/RESULTS.md this way; scripts/write_results.py keeps every such section when it rewrites
    the rest."""
    from moerl.tracking import atomic_write_text

    path = Path(path)
    begin, end = f"<!-- {name}: begin ({writer}) -->", f"<!-- {name}: end -->"
    section = f"{begin}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else "# Results\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    atomic_write_text(path, text)
