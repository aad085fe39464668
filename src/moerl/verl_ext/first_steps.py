"""First-step invariants of a GRPO run: what must hold in its first five steps before a cluster run is
worth its GPU-hours. Each failed invariant has a name and a reason.

Read from a moerl run directory (``metrics.jsonl``), a verl file-logger ``.jsonl``
(``{"step": n, "data": {...}}``, trainer.logger=[file]), a verl console log (``step:n - key:value -
...`` lines, trainer.logger=[console]) or a wandb run (``wandb:ENTITY/PROJECT/RUN_ID``); verl's
metric names go through ``moerl.analysis.results.VERL_METRIC_MAP`` so both read the same keys.
The trainer checkpoint's own invariant (shared expert adapter equal on every EP rank) is
``moerl.verl_ext.checkpoint_check``.

Invariants:

- ``finite``: every logged number of the checked steps (1-5) is finite.
- ``k3_floor``: rollout-vs-trainer k3 at step 1 is at most the bf16 floor of the model family.
  LoRA B starts at 0, so at step 1 rollout and trainer hold the same weights and only numerics
  (bf16 kernels, reduction order) separate them. Anything above the floor is a bug: a wrong
  weight load, an adapter applied on one side only, routing replay rows on the wrong layer.
- ``mismatch_growth``: from step 2 on LoRA B is no longer 0, so a delta that trainer and rollout
  apply differently (a shared-expert adapter summed TP times in the trainer, copies of a shared
  adapter that drifted apart across EP ranks) shows up, and grows with B, step after step. Healthy,
  the median k3 of steps 2-5 stays within ``GROWTH_FACTOR`` of max(step-1 k3, bf16 floor): the
  mismatch stays numerics. A stale refit grows k3 too (see ``refit``, which tells them apart where a refit
  side log or ``refit/version`` exists).
- ``r3``: under R3 the replayed-routing agreement is 1.0 and no replay violation is logged.
- ``refit``: the rollout engine serves the updated policy from step 2 on. Exact at any learning rate
  where a record of the updates exists:

  * the refit side log of a verl run (``moerl.verl_ext.refit_log``; the launcher writes it beside
    the run's logs, ``X.refit.jsonl`` next to ``X.jsonl``): one row per weight update and rank with
    verl's ``global_steps`` and a checksum of the LoRA tensors sent. verl sends the weights trained
    in step j at the end of step j (``global_steps=j``; 0 is the sync before step 1), and step j+1's
    rollout samples from them. For every step k >= 2 checked, every rank must have sent update
    k-1 (else: no update), with a checksum other than update k-2's (else: stale, the LoRA sent did
    not change) and the tensor names of its first update (else: partial refit). Any changed byte
    changes the checksum, so a 1e-6 learning rate decides as well as 1e-4;
  * ``refit/version``, which moerl's own trainer logs: it must advance every step.

  Without either, the rule reads k3 and ``actor/ppo_kl``:

  * A stale rollout (still at the step-0 weights) at step k is compared with a trainer holding the
    weights after k-1 updates, so k3 at step k is its step-1 value f (numerics, LoRA B = 0) plus
    KL(pi_0 || pi_{k-1}): the whole movement of the policy so far. A healthy rollout's k3 stays near f.
  * ``actor/ppo_kl`` of step j is the mean over its m mini-batches of the KL between the step's
    starting weights and the weights after i mini-batch updates (i = 0..m-1). A step's full movement
    is at least twice that for any m >= 2 (updates in one direction: m^2 against (m-1)(2m-1)/6
    mini-updates' KL; independent directions: m against (m-1)/2), and movements of successive steps
    add at least as independent ones do. So a stale rollout has
    k3_k - f >= ``STEP_KL_PER_PPO_KL`` * U_k, with U_k = sum of max(ppo_kl_j, 0) over j < k.
  * Step k *decides* when half that bound, U_k, exceeds ``REFIT_BAND`` * f (the scatter a healthy
    run's k3 may show around f; f capped at the bf16 floor, as healthy numerics are). At a deciding
    step the rollout looks stale when k3_k - f >= U_k. The refit fails when every deciding step of
    steps 2-5 looks stale, passes when one does not.
  * No deciding step: the verdict fails as undecided, naming what is missing (an explicit
    ``--refit-undecided-ok`` accepts it, as ``--r3-unlogged-ok`` does for R3).

  What that means in numbers, for the GPU scale the cluster runs at (step-1 k3 f ~ 1.5e-3, the
  R3 paper's Qwen3-30B-A3B value; ppo_kl ~ 1e-4 per step at lr 1e-5, scaling with lr^2 as a KL of
  an Adam step does): at lr 1e-4 step 2 decides; at lr 1e-5 step 5 does (U_5 = 4e-4 >
  0.25 * 1.5e-3); at lr 1e-6 (U_5 ~ 4e-6) nothing in k3 can: the stale rollout's whole
  gap is a few thousandths of the numerics, so only ``refit/version`` decides there. ppo_kl measures
  the update only when a step has m >= 2 mini-batches (verl: ppo_mini_batch_size < train_batch_size);
  with one, U stays ~0 and the verdict is undecided.

The floors (``BF16_K3_FLOOR``) come from measured CPU runs, not from one machine's error: the
largest step-1 k3 over every bf16 arm and seed of experiment 00 (results/runs/00_tiny_moe_cpu;
not 05, which injects mismatches on purpose) for that family, times
``FLOOR_MARGIN`` (``derive_floors`` recomputes them; a test keeps the constants equal to it).
Those are tiny models on CPU kernels; a large model on GPU kernels has its own floor, which is why
the margin is a factor of 4 and ``--floor`` overrides it. Published GPU values sit below these
floors (R3 paper, arXiv 2510.11370: k3 ~1.5e-3 on Qwen3-30B-A3B over a whole run without R3).
``GROWTH_FACTOR`` is a registered 2; experiment 00's healthy runs stay below it with the same margin
(``derive_growth_factor``, checked by a test). ``REFIT_BAND`` is an assumption about GPU runs, not a
measurement: no GPU run has been made.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from moerl.analysis.results import map_verl_metrics

FLOOR_MARGIN = 4.0
# max step-1 k3 of experiment 00's bf16 arms (3 seeds each) x FLOOR_MARGIN, one significant digit up
BF16_K3_FLOOR = {"qwen3_moe": 4e-3, "deepseek_v3": 2e-2}
CHECK_STEPS = (1, 2, 3, 4, 5)
GROWTH_STEPS = (2, 3, 4, 5)
# mismatch_growth's limit: median k3 of steps 2-5 <= GROWTH_FACTOR x max(step-1 k3, floor). Registered at 2
# (a healthy run's numerics do not double in four small steps); experiment 00's largest ratio times
# FLOOR_MARGIN (derive_growth_factor: 0.9) stays below it, which a test checks.
GROWTH_FACTOR = 2.0
STEP_KL_PER_PPO_KL = 2.0  # a step's KL is at least twice its logged ppo_kl (m >= 2 mini-batches)
REFIT_BAND = 0.25  # assumed relative scatter of a healthy GPU run's k3 around its step-1 value
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


def derive_growth_factor(root: str | Path, margin: float = FLOOR_MARGIN,
                         floors: dict[str, float] | None = None) -> float:
    """Max over every bf16-rollout run under ``root`` of the ``mismatch_growth`` ratio (median k3 of
    steps 2-5 over max(step-1 k3, the family's floor)), times ``margin``, rounded up."""
    floors = BF16_K3_FLOOR if floors is None else floors
    worst = 0.0
    for cfg_path in Path(root).glob("**/config.yaml"):
        cfg = yaml.safe_load(cfg_path.read_text()) or {}
        if (cfg.get("rollout") or {}).get("dtype") != "bf16" or not (cfg_path.parent / "metrics.jsonl").exists():
            continue
        ratio = _growth_ratio(by_step(read_rows(cfg_path.parent)), floors.get((cfg.get("model") or {}).get("preset")))
        if ratio is not None:
            worst = max(worst, ratio[0])
    return _round_up(worst * margin)


def _growth_ratio(steps: dict[int, dict], floor: float | None) -> tuple[float, float, float] | None:
    """(median k3 of steps 2-5 / reference, the median, the reference = max(step-1 k3, floor))."""
    k3_1 = steps.get(1, {}).get("mismatch/k3")
    later = [steps[s]["mismatch/k3"] for s in GROWTH_STEPS if "mismatch/k3" in steps.get(s, {})]
    if k3_1 is None or len(later) < 2:
        return None
    ref = max(k3_1, floor or 0.0)
    med = float(statistics.median(later))
    return med / ref, med, ref


def _round_up(x: float) -> float:
    e = math.floor(math.log10(x))
    return float(f"{math.ceil(x / 10 ** e)}e{e}")


# ---- the invariants -----------------------------------------------------------------------------

def check(rows: list[dict], family: str, r3: bool, floor: float | None = None,
          r3_unlogged_ok: bool = False, refit_undecided_ok: bool = False,
          refit_log: list[dict] | None = None, refit_log_source: str = "refit side log") -> list[Verdict]:
    """Every invariant on a run's first steps; ``refit_log``: the rows of the run's refit side log
    (``read_refit_log``), which decide the refit when given."""
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

    out.append(_growth(steps, floor))
    if r3:
        out.append(_r3(steps, r3_unlogged_ok))
    if refit_log is not None:
        out.append(_refit_side_log(refit_log, steps, refit_undecided_ok, refit_log_source))
    else:
        out.append(_refit(steps, floor, refit_undecided_ok))
    return out


def _growth(steps: dict[int, dict], floor: float | None) -> Verdict:
    ratio = _growth_ratio(steps, floor)
    if ratio is None:
        return Verdict("mismatch_growth", False, "needs rollout-vs-trainer k3 (rollout_corr/k3_kl) at step 1 and at "
                                                 "two or more of steps 2-5; run at least 3 steps")
    r, med, ref = ratio
    ok = r <= GROWTH_FACTOR
    return Verdict("mismatch_growth", ok,
                   f"median k3 of steps 2-5 {med:.3g} is {r:.3g}x max(step-1 k3, floor) {ref:.3g} "
                   f"({'<=' if ok else '>'} {GROWTH_FACTOR:g}x)" + ("" if ok else
                   ": once LoRA B != 0 the trainer and the rollout compute different models. Look for an adapter "
                   "delta applied differently on the two sides (a shared-expert LoRA summed over TP ranks, copies "
                   "of a shared expert adapter that drifted across EP ranks: scripts/check_first_steps.py "
                   "--checkpoint) or a rollout that keeps old weights (refit)"))


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


def _refit(steps: dict[int, dict], floor: float | None = None, undecided_ok: bool = False) -> Verdict:
    checked = [s for s in CHECK_STEPS if s in steps]
    versions = [(s, steps[s]["refit/version"]) for s in checked if "refit/version" in steps[s]]
    if len(versions) >= 2:
        stuck = [f"{a}->{b} ({va} -> {vb})" for (a, va), (b, vb) in zip(versions, versions[1:]) if not vb > va]
        if stuck:
            return Verdict("refit", False, f"refit/version did not advance from step {', '.join(stuck)}: the rollout "
                                           f"kept the old weights")
        return Verdict("refit", True, f"refit/version advanced every step ({versions[0][1]:g} -> {versions[-1][1]:g})")
    k3_1 = steps.get(1, {}).get("mismatch/k3")
    if k3_1 is None:
        return _undecided("step 1 logs no rollout-vs-trainer k3 (rollout_corr/k3_kl)", undecided_ok)
    # the scatter of healthy numerics cannot exceed the floor's: an abnormal step 1 (k3_floor) does not widen it
    band = REFIT_BAND * (min(k3_1, floor) if floor else k3_1)
    moved, deciding = 0.0, []
    for k in range(2, max(CHECK_STEPS) + 1):
        kl = steps.get(k - 1, {}).get("loss/ppo_kl")
        if kl is None or not math.isfinite(kl):
            break
        moved += max(kl, 0.0)  # U_k: summed ppo_kl of the steps before k
        k3 = steps.get(k, {}).get("mismatch/k3")
        if k3 is None:
            break
        half_bound = STEP_KL_PER_PPO_KL * moved / 2  # half of what a stale rollout adds at least
        if half_bound > band:
            deciding.append((k, k3 - k3_1, half_bound))
    if not deciding:
        return _undecided(f"no step of 2-{max(CHECK_STEPS)} moved the policy enough to tell: summed ppo_kl "
                          f"{moved:.3g} against the band {band:.3g} ({REFIT_BAND:g} x step-1 k3, capped at the floor): "
                          f"a stale rollout's extra k3 would hide in the scatter (ppo_kl counts only with >= 2 "
                          f"mini-batches per step)", undecided_ok)
    stale = [(k, gap, half) for k, gap, half in deciding if gap >= half]
    detail = "; ".join(f"step {k}: k3 - step-1 k3 = {gap:.3g} vs stale bound {2 * half:.3g}"
                       for k, gap, half in deciding[:3])
    if len(stale) == len(deciding):
        return Verdict("refit", False, f"{detail}: the rollout still samples from the step-0 weights (its gap to the "
                                       f"trainer carries every update so far); check the weight sync / adapter reload")
    return Verdict("refit", True, f"{detail}: the rollout follows the updated policy")


_DECIDE_HINT = ("log refit/version (moerl) or write the refit side log (verl: moerl.verl_ext.refit_log, set by "
                "the launcher; check with --refit-log) to decide at any learning rate")


def _undecided(why: str, ok: bool, hint: str = _DECIDE_HINT) -> Verdict:
    return Verdict("refit", ok, f"undecided: {why}; {hint}"
                   + ("; accepted by --refit-undecided-ok, the refit was NOT checked" if ok else
                      "; pass --refit-undecided-ok to accept the run without this check"))


# ---- the refit side log ------------------------------------------------------------------------------

SIDE_LOG_KEYS = ("global_steps", "names_digest", "checksum")


def read_refit_log(path: str | Path) -> list[dict]:
    """The rows of a refit side log (``moerl.verl_ext.refit_log``), in file order."""
    p = Path(path)
    if not p.is_file():
        raise RunReadError(f"{p}: no such refit side log (the launcher writes it beside the run's logs as "
                           f"<run>.refit.jsonl; see env MOERL_REFIT_LOG in the printed command)")
    rows = []
    for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as err:
            raise RunReadError(f"{p}:{n}: not JSON ({err})") from None
        if not isinstance(rec, dict) or any(k not in rec for k in SIDE_LOG_KEYS):
            raise RunReadError(f"{p}:{n}: not a refit side-log row (expected keys {', '.join(SIDE_LOG_KEYS)}, "
                               f"as moerl.verl_ext.refit_log writes them)")
        rows.append(rec)
    return rows


def _ranks(ranks) -> str:
    ranks = sorted(ranks, key=lambda r: (r is None, r if isinstance(r, int) else 0, str(r)))
    text = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _refit_side_log(log: list[dict], steps: dict[int, dict], undecided_ok: bool, source: str) -> Verdict:
    """The refit judged from the side log: every step k >= 2 checked must sample from a new, complete
    update, the one sent at the end of step k-1 (``global_steps=k-1``)."""
    served = [k for k in CHECK_STEPS if k >= 2 and (not steps or k in steps)]
    needed = [k - 1 for k in served]
    updates = [r for r in log if r.get("kind") != "base" and r.get("global_steps") is not None]
    if not needed:
        return _undecided(f"{source}: the run log has no step >= 2 to check", undecided_ok, "run at least 2 steps")
    if not updates:
        return Verdict("refit", False, f"{source}: no weight update recorded: the rollout engine never received "
                                       f"the trainer's weights, or the side log was not installed in the workers "
                                       f"(env VERL_USE_EXTERNAL_MODULES must name moerl.verl_ext.refit_log)")
    missing: dict[tuple[int, str], set] = {}
    stale: dict[int, set] = {}
    partial: dict[tuple[int, int, int], set] = {}
    unhashed: dict[int, set] = {}
    changed_names: dict[tuple[int, int, int], list[str]] = {}
    ranks = {r.get("rank") for r in updates}
    for rank in ranks:
        last: dict[int, dict] = {}
        for r in updates:
            if r.get("rank") == rank:
                last[int(r["global_steps"])] = r  # a repeated update of a step: the last one counts
        sent = {j: r for j, r in last.items() if r.get("ok", True) and r.get("count")}
        ref = sent[min(sent)] if sent else None
        for j in needed:
            r = sent.get(j)
            if r is None:
                bad = last.get(j)
                why = ("" if bad is None else f" ({bad['error']})" if bad.get("error") else " (no tensors)")
                missing.setdefault((j, why), set()).add(rank)
                continue
            if r["names_digest"] != ref["names_digest"]:
                key = (j, int(r["count"]), int(ref["count"]))
                partial.setdefault(key, set()).add(rank)
                diff = ([f"-{n}" for n in r.get("names_removed", [])[:3]]
                        + [f"+{n}" for n in r.get("names_added", [])[:3]])
                changed_names.setdefault(key, diff)
            prev = sent.get(j - 1)
            if r["checksum"] is None:
                unhashed.setdefault(j, set()).add(rank)
            elif prev is not None and prev["checksum"] == r["checksum"]:
                stale.setdefault(j, set()).add(rank)
    problems = [f"no update after step {j} (global_steps={j}, the weights step {j + 1}'s rollout samples from) "
                f"on {_ranks(rs)}{why}" for (j, why), rs in sorted(missing.items(), key=lambda kv: kv[0][0])]
    problems += [f"stale: the update after step {j} has the checksum of the update after step {j - 1} on "
                 f"{_ranks(rs)}: the LoRA sent did not change, step {j + 1} samples from old weights"
                 for j, rs in sorted(stale.items())]
    problems += [f"partial refit: the update after step {j} sends {n} tensors whose names differ from the first "
                 f"update's {n0} on {_ranks(rs)}" + (f" ({', '.join(changed_names[(j, n, n0)])})"
                                                     if changed_names.get((j, n, n0)) else "")
                 for (j, n, n0), rs in sorted(partial.items())]
    if problems:
        return Verdict("refit", False, f"{source}: " + "; ".join(problems[:4])
                       + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
                       + "; check the weight sync (verl ActorRolloutRefWorker.update_weights) and the adapter export")
    if unhashed:
        return _undecided(f"{source}: the updates after steps {sorted(unhashed)} carry no checksum (only LoRA "
                          f"adapter updates are hashed by default)", undecided_ok,
                          "set MOERL_REFIT_LOG_HASH=all in the run's runtime env to hash full-weight updates")
    return Verdict("refit", True, f"{source}: the updates after steps {needed[0]}-{needed[-1]} (served to steps "
                                  f"{served[0]}-{served[-1]}) each changed the LoRA checksum and kept the first "
                                  f"update's tensor names, on {_ranks(ranks)}")


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
