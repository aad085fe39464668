"""First-step invariants of a GRPO run: what must hold in steps 1-3 before a cluster run is worth
its GPU-hours. Each failed invariant has a name and a reason.

Read from a moerl run directory (``metrics.jsonl``), a verl file-logger ``.jsonl``
(``{"step": n, "data": {...}}``, trainer.logger=[file]), a verl console log (``step:n - key:value -
...`` lines, trainer.logger=[console]) or a wandb run (``wandb:ENTITY/PROJECT/RUN_ID``); verl's
metric names go through ``moerl.analysis.results.VERL_METRIC_MAP`` so both read the same keys.

Invariants:

- ``finite``: every logged number of the checked steps is finite.
- ``k3_floor``: rollout-vs-trainer k3 at step 1 is at most the bf16 floor of the model family.
  LoRA B starts at 0, so at step 1 rollout and trainer hold the same weights and only numerics
  (bf16 kernels, reduction order) separate them. Anything above the floor is a bug: a wrong
  weight load, an adapter applied on one side only, routing replay rows on the wrong layer.
- ``r3``: under R3 the replayed-routing agreement is 1.0 and no replay violation is logged.
- ``refit``: the rollout engine serves the updated policy from step 2 on. If refit did not
  change it, step 2's k3 carries the whole step-1 update (``actor/ppo_kl``) on top of the floor.
  Where moerl logs ``refit/version`` it must advance each step.

The floors (``BF16_K3_FLOOR``) come from measured CPU runs, not from one machine's error: the
largest step-1 k3 over every bf16 arm and seed of experiment 00 (results/runs/00_tiny_moe_cpu;
not 05, which injects mismatches on purpose) for that family, times
``FLOOR_MARGIN`` (``derive_floors`` recomputes them; a test keeps the constants equal to it).
Those are tiny models on CPU kernels; a large model on GPU kernels has its own floor, which is why
the margin is a factor of 4 and ``--floor`` overrides it. Published GPU values sit below these
floors (R3 paper, arXiv 2510.11370: k3 ~1.5e-3 on Qwen3-30B-A3B over a whole run without R3).
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from moerl.analysis.results import map_verl_metrics

FLOOR_MARGIN = 4.0
# max step-1 k3 of experiment 00's bf16 arms (3 seeds each) x FLOOR_MARGIN, one significant digit up
BF16_K3_FLOOR = {"qwen3_moe": 4e-3, "deepseek_v3": 2e-2}
REFIT_DRIFT_SHARE = 0.5  # a stale rollout shows at least half the step-1 update as step-2 k3
CHECK_STEPS = (1, 2, 3)
R3_AGREEMENT = "routing/replayed_agreement"
R3_VIOLATIONS = ("replay/violations", "replay/old_pass_violations")


@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str


class RunReadError(ValueError):
    """A run that cannot be read; says which file and why."""


# ---- reading ------------------------------------------------------------------------------------

_CONSOLE = re.compile(r"(?:^|\s)step:(\d+)\s+-\s+(.*)$")


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return None


def read_rows(path: str | Path, api=None) -> list[dict]:
    """One dict per logged step (key ``step``), in moerl's metric names."""
    text = str(path)
    if text.startswith("wandb:"):
        if api is None:
            import wandb

            api = wandb.Api()
        # scan_history yields each logged row with only the keys logged in it (history()'s frame
        # fills unlogged keys with NaN, which would read as non-finite values)
        raw = [dict(r) for r in api.run(text[len("wandb:"):]).scan_history()]
        for r in raw:
            if "training/global_step" not in r and "_step" in r:
                r["step"] = r["_step"]
        return [_mapped(r) for r in raw]
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not p.exists():
        raise RunReadError(f"{p}: no such file (give a moerl run directory, a verl .jsonl or console log, "
                           f"or wandb:ENTITY/PROJECT/RUN_ID)")
    rows = []
    for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        line = line.strip()
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise RunReadError(f"{p}:{n}: not JSON ({err})") from None
            if isinstance(rec.get("data"), dict):  # verl FileLogger; orjson writes NaN/inf as null
                data = {k: (math.nan if v is None else v) for k, v in rec["data"].items()}
                rows.append(_mapped({**data, "step": rec.get("step")}))
            else:
                rows.append(_mapped(rec))
            continue
        m = _CONSOLE.search(line)
        if m:  # verl console: "step:1 - key:value - key:value"
            rec = {"step": int(m.group(1))}
            for part in m.group(2).split(" - "):
                key, sep, val = part.rpartition(":")
                if sep and key:
                    num = _number(val.strip())
                    if num is not None:
                        rec[key.strip()] = num
            rows.append(_mapped(rec))
    if not rows:
        raise RunReadError(f"{p}: no metrics found (expected moerl/verl jsonl or verl console 'step:N - ...' lines)")
    return rows


def _mapped(rec: dict) -> dict:
    out = dict(rec)
    for old, new in map_verl_metrics(list(rec)).items():
        out[new] = out.pop(old)
    return out


def by_step(rows: list[dict]) -> dict[int, dict]:
    """Merge rows of the same step (moerl logs eval and train rows separately)."""
    out: dict[int, dict] = {}
    for r in rows:
        if r.get("step") is None:
            continue
        out.setdefault(int(r["step"]), {}).update(r)
    return out


# ---- the floors ----------------------------------------------------------------------------------

def derive_floors(root: str | Path, margin: float = FLOOR_MARGIN) -> dict[str, float]:
    """Per family: max step-1 k3 of every bf16-rollout run under ``root`` (moerl run dirs with
    config.yaml), times ``margin``, rounded up to one significant digit."""
    worst: dict[str, float] = {}
    for cfg_path in Path(root).glob("**/config.yaml"):
        cfg = yaml.safe_load(cfg_path.read_text()) or {}
        if (cfg.get("rollout") or {}).get("dtype") != "bf16" or not (cfg_path.parent / "metrics.jsonl").exists():
            continue
        fam = (cfg.get("model") or {}).get("preset")
        k3 = by_step(read_rows(cfg_path.parent)).get(1, {}).get("mismatch/k3")
        if fam and k3 is not None:
            worst[fam] = max(worst.get(fam, 0.0), float(k3))
    return {f: _round_up(v * margin) for f, v in worst.items()}


def _round_up(x: float) -> float:
    e = math.floor(math.log10(x))
    return float(f"{math.ceil(x / 10 ** e)}e{e}")


# ---- the invariants -----------------------------------------------------------------------------

def check(rows: list[dict], family: str, r3: bool, floor: float | None = None,
          r3_unlogged_ok: bool = False) -> list[Verdict]:
    """Every invariant on a run's first steps."""
    steps = by_step(rows)
    floor = BF16_K3_FLOOR.get(family) if floor is None else floor
    out = []

    bad = [f"{k}={v} at step {s}" for s in CHECK_STEPS for k, v in steps.get(s, {}).items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isfinite(v)]
    out.append(Verdict("finite", not bad, "; ".join(bad[:5]) + (" ..." if len(bad) > 5 else "") if bad else
                       f"all logged values of steps {list(CHECK_STEPS)} are finite"))

    k3_1 = steps.get(1, {}).get("mismatch/k3")
    if floor is None:
        out.append(Verdict("k3_floor", False, f"no bf16 floor for family {family!r} (have {sorted(BF16_K3_FLOOR)}); "
                                              f"pass --floor"))
    elif k3_1 is None:
        out.append(Verdict("k3_floor", False, "step 1 logs no rollout-vs-trainer k3 (verl: rollout_corr/k3_kl, "
                                              "needs rollout.calculate_log_probs=True)"))
    else:
        out.append(Verdict("k3_floor", k3_1 <= floor,
                           f"step-1 k3 {k3_1:.3g} {'<=' if k3_1 <= floor else '>'} bf16 floor {floor:.3g} of "
                           f"{family}" + ("" if k3_1 <= floor else ": at step 1 (adapter B = 0) rollout and trainer "
                                          "hold the same model, so the gap is not numerics; look for weights loaded "
                                          "differently, an adapter on one side only, or replay rows on the wrong layer")))

    if r3:
        out.append(_r3(steps, r3_unlogged_ok))
    out.append(_refit(steps, floor))
    return out


def _r3(steps: dict[int, dict], unlogged_ok: bool) -> Verdict:
    checked = [s for s in CHECK_STEPS if s in steps]
    agree = {s: steps[s][R3_AGREEMENT] for s in checked if R3_AGREEMENT in steps[s]}
    viol = {(s, k): steps[s][k] for s in checked for k in R3_VIOLATIONS if steps[s].get(k)}
    if not agree and not viol:
        return Verdict("r3", unlogged_ok, "R3 run logs no replayed-routing agreement (verl 0.9.1 logs none; "
                                          "moerl logs routing/replayed_agreement)"
                       + ("; accepted by --r3-unlogged-ok, R3 was NOT checked" if unlogged_ok else
                          "; pass --r3-unlogged-ok to accept the run without this check"))
    low = {s: a for s, a in agree.items() if not a >= 1.0}
    problems = [f"agreement {a} < 1.0 at step {s}" for s, a in low.items()]
    problems += [f"{k}={v} at step {s}" for (s, k), v in viol.items()]
    return Verdict("r3", not problems, "; ".join(problems) if problems else
                   f"replayed agreement 1.0 and no violations at steps {sorted(agree)}")


def _refit(steps: dict[int, dict], floor: float | None) -> Verdict:
    s1, s2 = steps.get(1, {}), steps.get(2, {})
    if "refit/version" in s1 and "refit/version" in s2 and not s2["refit/version"] > s1["refit/version"]:
        return Verdict("refit", False, f"refit/version did not advance from step 1 to 2 "
                                       f"({s1['refit/version']} -> {s2['refit/version']}): the rollout kept the old weights")
    k3_2, drift = s2.get("mismatch/k3"), s1.get("loss/ppo_kl")
    if k3_2 is None or drift is None or floor is None:
        return Verdict("refit", False, "needs step-2 k3 (rollout_corr/k3_kl) and step-1 actor/ppo_kl; run at "
                                       "least 2 steps")
    if drift <= floor:
        return Verdict("refit", True, f"undecided: step 1 moved the policy by ppo_kl {drift:.3g}, within the floor "
                                      f"{floor:.3g}, so a stale rollout would not show (not a failure)")
    stale = k3_2 > floor and k3_2 >= REFIT_DRIFT_SHARE * drift
    return Verdict("refit", not stale,
                   f"step-2 k3 {k3_2:.3g} vs step-1 update ppo_kl {drift:.3g}: " +
                   ("the rollout still samples from the step-0 weights (k3 carries the update); check the weight "
                    "sync / adapter reload" if stale else "the rollout follows the updated policy"))


def family_and_r3(run: str | Path, experiment: str | Path | None = None) -> tuple[str | None, bool | None]:
    """(family, R3?) from a scale experiment's YAML (``--experiment``) or a moerl run's config.yaml."""
    from moerl import planner
    from moerl.verl_ext.compose import read_yaml_chain

    if experiment is not None:
        e = Path(experiment)
        entry = e if e.suffix in (".yaml", ".yml") else (e / "experiment.yaml" if (e / "experiment.yaml").exists()
                                                          else e / "base.yaml")
        data, _ = read_yaml_chain(entry)
        fam = planner.load_public_config(data["moerl"]["model"])["family"]
        mode = (((data.get("verl") or {}).get("actor_rollout_ref") or {}).get("actor") or {}).get("megatron", {})
        return fam, str((mode.get("router_replay") or {}).get("mode")) == "R3"
    cfg = Path(run) / "config.yaml" if Path(str(run)).is_dir() else None
    if cfg is not None and cfg.exists():
        c = yaml.safe_load(cfg.read_text()) or {}
        return (c.get("model") or {}).get("preset"), str((c.get("replay") or {}).get("mode")).upper() == "R3"
    return None, None
