"""Experiment 05's claims, answered from the recorded runs: the source's value, this repo's value,
and a verdict (yes / partly / no / not tested) by a rule stated next to it.

Every figure is computed here from metrics.jsonl and summary.json; nothing is typed in. The rules
are fixed before reading the main grid (see experiments/05_mismatch_consequences/README.md) and
are deliberately simple: a reader should be able to redo each verdict from the table.

Windows: "early" is the first ``WINDOW`` training steps of a run, "late" its last ``WINDOW``.
Ratios between arms pair runs by seed (same prompts, same warm start) and report the median over
seeds with the min-max range. k3 is summarised per run by its *median* over steps: per-step k3 is
heavy-tailed (in experiment 05 a run's largest step is 6-9500x its median step), so one spike can
carry a run's mean; the ratio of means is shown beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from moerl.collapse import collapse_step

WINDOW = 50
EXPERIMENT = "05_mismatch_consequences"


@dataclass
class Claim:
    claim: str
    source: str
    paper: str  # the source's value
    repo: str  # this repository's value, from the runs
    verdict: str  # yes | partly | no | not tested
    rule: str  # how the verdict follows from the values


# -- per-run quantities ----------------------------------------------------------------------------
def _train(metrics: pd.DataFrame) -> pd.DataFrame:
    return metrics[metrics["reward/mean"].notna()] if "reward/mean" in metrics else metrics.iloc[:0]


def collapse_steps(metrics: pd.DataFrame) -> dict[tuple[str, int], int | None]:
    """(arm, seed) -> collapse step (None: did not collapse), by moerl.collapse."""
    out = {}
    for (arm, seed), run in _train(metrics).groupby(["arm", "seed"]):
        out[(arm, int(seed))] = collapse_step(run.sort_values("step").to_dict("records"))
    return out


def window_mean(metrics: pd.DataFrame, key: str, where: str = "all", stat: str = "mean") -> pd.Series:
    """Per (arm, seed): the mean (or ``stat``: median) of ``key`` over the run ('all'), its first or
    its last WINDOW steps."""
    train = _train(metrics)
    if key not in train:
        return pd.Series(dtype=float)
    rows = train[["arm", "seed", "step", key]].dropna().sort_values("step")
    groups = rows.groupby(["arm", "seed"])[key]
    if where == "early":
        return groups.apply(lambda s: getattr(s.head(WINDOW), stat)())
    if where == "late":
        return groups.apply(lambda s: getattr(s.tail(WINDOW), stat)())
    return getattr(groups, stat)()


def k3_ratio(metrics: pd.DataFrame, arm: str, reference: str) -> tuple[list[float], str]:
    """Per-seed ratio of the runs' median k3 (the statistic the verdicts use) and its text, with the
    ratio of the runs' mean k3 beside it."""
    medians = paired_ratio(window_mean(metrics, "mismatch/k3", stat="median"), arm, reference)
    means = paired_ratio(window_mean(metrics, "mismatch/k3"), arm, reference)
    return medians, f"{_fmt_ratio(medians)} [ratio of means {_fmt_ratio(means)}]" if medians else "n/a"


def paired_ratio(per_run: pd.Series, arm: str, reference: str) -> list[float]:
    """``arm`` / ``reference`` per seed both have."""
    if per_run.empty:
        return []
    a, b = per_run.get(arm), per_run.get(reference)
    if a is None or b is None:
        return []
    seeds = sorted(set(a.index) & set(b.index))
    return [float(a[s] / b[s]) for s in seeds if b[s] and np.isfinite(a[s] / b[s])]


def _arm_values(per_run: pd.Series, arm: str) -> list[float]:
    return [] if per_run.empty or arm not in per_run.index.get_level_values(0) else list(per_run[arm].values)


def _fmt_ratio(ratios: list[float]) -> str:
    if not ratios:
        return "n/a"
    if len(ratios) == 1:
        return f"{ratios[0]:.2g}× (1 seed)"
    return f"{np.median(ratios):.2g}× (seeds {min(ratios):.2g}–{max(ratios):.2g}, n={len(ratios)})"


def _fmt_values(values: list[float], fmt: str = "{:.3f}") -> str:
    if not values:
        return "n/a"
    return fmt.format(float(np.mean(values))) + (f" (n={len(values)})" if len(values) > 1 else " (1 seed)")


def _count(collapses: dict, arm: str) -> tuple[int, int]:
    runs = [v for (a, _), v in collapses.items() if a == arm]
    return sum(v is not None for v in runs), len(runs)


def _count_str(collapses: dict, arm: str) -> str:
    k, n = _count(collapses, arm)
    return f"{arm} {k}/{n}" if n else f"{arm} not run"


# -- the claims -------------------------------------------------------------------------------------
def claim_collapse(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    c = collapse_steps(metrics)
    uncorrected = ["baseline", "baseline_fp8", "deepseek_baseline"]
    aligned = ["r3", "deepseek_r3", "fp32_rollout", "deepseek_fp32_rollout"]
    pass1 = runs.set_index(["arm", "seed"])["final_eval/eval/pass1"] if "final_eval/eval/pass1" in runs else None
    gap = []
    if pass1 is not None:
        for arm, control in (("baseline", "fp32_rollout"), ("deepseek_baseline", "deepseek_fp32_rollout")):
            d = [pass1[(arm, s)] - pass1[(control, s)] for (a, s) in pass1.index if a == arm
                 and (control, s) in pass1.index]
            if d:
                gap.append(f"{arm} − {control} final pass@1 {np.mean(d):+.3f} (seeds {min(d):+.3f}…{max(d):+.3f})")
    repo = ("collapsed: " + ", ".join(_count_str(c, a) for a in uncorrected + aligned)
            + ("; " + "; ".join(gap) if gap else ""))
    bad = [_count(c, a) for a in uncorrected]
    good = [_count(c, a) for a in aligned]
    ran = sum(n for _, n in bad)
    if not ran:
        verdict = "not tested"
    elif any(n and k * 2 > n for k, n in bad) and not any(k for k, _ in good):
        verdict = "yes"
    elif any(k for k, _ in bad):
        verdict = "partly"
    else:
        verdict = "no"
    return Claim("uncorrected GRPO on an MoE collapses while an aligned rollout does not",
                 "R3 paper (arXiv 2510.11370), Qwen3-30B-A3B", "3 of 3 baseline runs collapsed, 0 of 3 R3", repo,
                 verdict, "yes: most runs of an uncorrected arm collapse and no R3 or fp32 run does; partly: some "
                 "uncorrected run collapses; no: none does")


def claim_family(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    ratios, text = k3_ratio(metrics, "deepseek_baseline", "baseline")
    differs = window_mean(metrics, "routing/any_layer_differs")
    repo = (f"k3 DeepSeek-V3 / Qwen3-MoE preset (bf16 rollout, same seed): {text}; tokens re-routed "
            f"in ≥ 1 MoE layer: Qwen3-MoE {_fmt_values(_arm_values(differs, 'baseline'))}, DeepSeek-V3 "
            f"{_fmt_values(_arm_values(differs, 'deepseek_baseline'))}")
    verdict = "not tested" if not ratios else "yes" if min(ratios) > 1 else "partly" if np.median(ratios) > 1 else "no"
    return Claim("the mismatch is worse on DeepSeek-V3-style MoE than on Qwen3-MoE", "Mind Lab R3 blog",
                 "larger on Moonlight-16B-A3B than on Qwen3-30B-A3B (qualitative)", repo, verdict,
                 "yes: k3 larger on the DeepSeek-V3 preset in every seed; partly: in the median only")


def claim_clipping(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    ratios, text = k3_ratio(metrics, "ppo_tight_clip", "baseline")
    clip_tight = _arm_values(window_mean(metrics, "clip/frac"), "ppo_tight_clip")
    clip_base = _arm_values(window_mean(metrics, "clip/frac"), "baseline")
    repo = (f"k3 with clip 0.1 / clip 0.2: {text}; clipped tokens {_fmt_values(clip_tight, '{:.4f}')} "
            f"vs {_fmt_values(clip_base, '{:.4f}')}")
    verdict = "not tested" if not ratios else "yes" if np.median(ratios) > 0.5 else "no"
    return Claim("PPO clipping does not see the mismatch", "Mind Lab R3 blog",
                 "clipping bounds π_θ/π_old, not π_old/π_rollout", repo, verdict,
                 "yes: a tighter clip leaves k3 above half the baseline's (it does not act on it); no: it halves it")


def claim_tis(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    early = window_mean(metrics, "mismatch/k3", "early", stat="median")
    late = window_mean(metrics, "mismatch/k3", "late", stat="median")
    growth = {arm: [float(late[arm][s] / early[arm][s]) for s in late[arm].index if s in early[arm].index]
              for arm in ("baseline", "tis") if not late.empty and arm in late.index.get_level_values(0)}
    repo = ("median k3, last vs first 50 steps: "
            + ", ".join(f"{arm} {_fmt_ratio(v)}" for arm, v in growth.items()) if growth else "n/a")
    if "baseline" not in growth or "tis" not in growth:
        verdict = "not tested"
    elif np.median(growth["baseline"]) <= 1.2:
        verdict, repo = "not tested", repo + " — the baseline's mismatch did not drift upward, so there was no drift to stop"
    else:
        verdict = "yes" if np.median(growth["tis"]) > 1.2 else "no"
    return Claim("TIS does not stop the drift", "Mind Lab R3 blog", "k3 keeps growing under TIS", repo, verdict,
                 "tested only if the baseline's k3 grows > 1.2× from the first to the last 50 steps; then yes if TIS's grows too")


def claim_masking(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    early = window_mean(metrics, "effective/token_frac", "early")
    late = window_mean(metrics, "effective/token_frac", "late")
    parts, verdicts = [], []
    for arm in ("mis", "icepop"):
        e, l_ = _arm_values(early, arm), _arm_values(late, arm)
        if not e:
            continue
        parts.append(f"{arm}: tokens with gradient {np.mean(e):.3f} early → {np.mean(l_):.3f} late (n={len(e)})")
        verdicts.append("yes" if np.mean(l_) < 0.5 else "partly" if np.mean(l_) < 0.9 * np.mean(e) else "no")
    base = _arm_values(late, "baseline")
    if base:
        parts.append(f"baseline {np.mean(base):.3f} late")
    verdict = ("not tested" if not verdicts else "yes" if "yes" in verdicts
               else "partly" if "partly" in verdicts else "no")
    return Claim("masking IS (MIS / IcePop) discards ever more samples, eventually halting training",
                 "Mind Lab R3 blog; verl rollout-correction docs", "\"eventually discarding everything\"",
                 "; ".join(parts) or "n/a", verdict,
                 "yes: fewer than half the tokens keep a gradient over the last 50 steps; partly: the share fell by "
                 "> 10 % from the first 50 steps; no: it did not")


def claim_r2(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    r2, r2_text = k3_ratio(metrics, "r2", "baseline")
    _, r3_text = k3_ratio(metrics, "r3", "baseline")
    repo = f"k3 R2 / baseline {r2_text} (R3 / baseline {r3_text})"
    verdict = "not tested" if not r2 else "yes" if np.median(r2) > 0.8 else "no"
    return Claim("R2 does not improve the mismatch", "Mind Lab R3 blog", "no improvement over no replay", repo, verdict,
                 "yes: R2's k3 stays above 0.8× the baseline's")


def claim_position_bug(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    c = collapse_steps(metrics)
    worse, worse_text = k3_ratio(metrics, "deepseek_r3_position_bug", "deepseek_baseline")
    replayed = _arm_values(window_mean(metrics, "routing/replayed_agreement"), "deepseek_r3_position_bug")
    native = _arm_values(window_mean(metrics, "routing/agreement"), "deepseek_r3_position_bug")
    fixed = _arm_values(window_mean(metrics, "routing/agreement"), "deepseek_r3")
    k, n = _count(c, "deepseek_r3_position_bug")
    repo = (f"k3 vs no replay {worse_text}; replayed agreement {_fmt_values(replayed, '{:.3f}')} (the checks "
            f"pass) but trainer-native vs trace agreement {_fmt_values(native, '{:.3f}')} (fixed R3: "
            f"{_fmt_values(fixed, '{:.3f}')}); collapsed {k}/{n}")
    verdict = "not tested" if not worse else "yes" if min(worse) > 1 else "partly" if k else "no"
    return Claim("R3 mapped by position on a dense-first-layer model is broken", "verl PR 5037 / Mind Lab",
                 "MoE layers replay another layer's routes; the first gets the dense layer's zero rows", repo,
                 verdict, "yes: its k3 exceeds no replay's in every seed (replay makes it worse); partly: it collapses")


def claim_r3(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    eff = window_mean(metrics, "effective/token_frac")
    differs = window_mean(metrics, "routing/any_layer_differs")
    gt2 = window_mean(metrics, "mismatch/extreme_gt2")
    parts, ok = [], []
    for r3, base in (("r3", "baseline"), ("deepseek_r3", "deepseek_baseline")):
        ratio, ratio_text = k3_ratio(metrics, r3, base)
        if not ratio:
            continue
        drop = paired_ratio(gt2, base, r3)
        e_r3, e_base = _arm_values(eff, r3), _arm_values(eff, base)
        parts.append(f"{r3}: k3 {ratio_text} of {base}, tokens with ratio > 2 down {_fmt_ratio(drop)}, "
                     f"tokens with gradient {_fmt_values(e_r3)} vs {_fmt_values(e_base)}, re-routed in ≥ 1 layer "
                     f"without replay {_fmt_values(_arm_values(differs, base))}")
        ok.append(np.median(ratio) < 0.5 and abs(np.mean(e_r3) - np.mean(e_base)) < 0.01)
    verdict = "not tested" if not ok else "yes" if all(ok) else "partly" if any(ok) else "no"
    return Claim("R3 mapped by global layer number reduces the mismatch without shrinking the effective sample set",
                 "R3 paper, Mind Lab", "~94 % of tokens differ in ≥ 1 router without R3; tokens with ratio > 2 drop ~10×",
                 "; ".join(parts) or "n/a", verdict,
                 "yes: R3 halves k3 (median over seeds) and keeps the share of tokens with gradient within 1 point, "
                 "on both presets; partly: on one")


CLAIMS = [claim_collapse, claim_family, claim_clipping, claim_tis, claim_masking, claim_r2, claim_position_bug,
          claim_r3]


def finished(metrics: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """The metrics of the runs in ``runs`` (run_table: finished runs) only; a run still going is left out."""
    done = set(zip(runs["arm"], runs["seed"].astype(int)))
    return metrics[[(a, int(s)) in done for a, s in zip(metrics["arm"], metrics["seed"])]]


def evaluate_claims(metrics: pd.DataFrame, runs: pd.DataFrame) -> list[Claim]:
    """Every claim of experiment 05 from its metrics (load_metrics) and runs (run_table: finished runs)."""
    metrics = finished(metrics, runs)
    return [claim(metrics, runs) for claim in CLAIMS]


def claims_markdown(claims: list[Claim]) -> str:
    lines = ["| claim | source | source's value | this repo (CPU scale) | reproduced | rule |", "|---|---|---|---|---|---|"]
    for c in claims:
        lines.append(f"| {c.claim} | {c.source} | {c.paper} | {c.repo} | **{c.verdict}** | {c.rule} |")
    return "\n".join(lines)


def collapse_markdown(metrics: pd.DataFrame) -> str:
    """Each run's collapse step (moerl.collapse), one row per arm, one column per seed."""
    steps = collapse_steps(metrics)
    seeds = sorted({s for _, s in steps})
    lines = ["| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for arm in sorted({a for a, _ in steps}):
        cells = []
        for s in seeds:
            cells.append("not run" if (arm, s) not in steps else "—" if steps[(arm, s)] is None
                         else str(steps[(arm, s)]))
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
