"""Experiment 05's claims, answered from the recorded runs: the source's value, this repo's value,
and a verdict (yes / partly / no / not tested / inconclusive) by a rule stated next to it; the
rules for "not tested" and "inconclusive" live in moerl.analysis.verdicts.

Every figure is computed here from metrics.jsonl and summary.json; nothing is typed in. The yes /
partly / no thresholds were fixed before reading the main grid; the "not tested" and
"inconclusive" gates were added after the runs had been read (see
experiments/05_mismatch_consequences/README.md). The rules are deliberately simple: a reader should be able to redo each verdict from the table.

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

from moerl.analysis import verdicts
from moerl.analysis.collapse import collapse_step
from moerl.config import current_arm

WINDOW = verdicts.EARLY_LATE_WINDOW
EXPERIMENT = "05_mismatch_consequences"
# The arms that drop tokens or sequences from the gradient: sequence-level MIS (verl's Seq-MIS) and IcePop.
MASKING_ARMS = (current_arm(EXPERIMENT, "mis"), "icepop")


@dataclass
class Claim:
    claim: str
    source: str
    paper: str  # the source's value
    repo: str  # this repository's value, from the runs
    verdict: str  # yes | partly | no | not tested | inconclusive (moerl.analysis.verdicts)
    rule: str  # how the verdict follows from the values


# -- per-run quantities ----------------------------------------------------------------------------
def _train(metrics: pd.DataFrame) -> pd.DataFrame:
    return metrics[metrics["reward/mean"].notna()] if "reward/mean" in metrics else metrics.iloc[:0]


def collapse_steps(metrics: pd.DataFrame) -> dict[tuple[str, int], int | None]:
    """(arm, seed) -> collapse step (None: did not collapse), by moerl.analysis.collapse."""
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
# Each verdict goes through moerl.analysis.verdicts: "not tested" when the regime could not show the effect,
# "inconclusive" when the seeds straddle the rule's threshold.

def _per_seed(runs: pd.DataFrame, key: str) -> dict[str, dict[int, float]]:
    """arm -> seed -> the per-run value of ``key`` (a run_table column)."""
    if key not in runs:
        return {}
    out: dict[str, dict[int, float]] = {}
    for arm, seed, v in zip(runs["arm"], runs["seed"], pd.to_numeric(runs[key], errors="coerce")):
        out.setdefault(arm, {})[int(seed)] = float(v)
    return out


def _pass1_gain(runs: pd.DataFrame) -> dict[str, dict[int, float]]:
    """arm -> seed -> final minus step-0 held-out pass@1, each measured by the arm's own engine, so
    the evaluator's precision cancels (it does not between two arms' final values)."""
    final, initial = _per_seed(runs, "final_eval/eval/pass1"), _per_seed(runs, "initial_eval/eval/pass1")
    return {a: {s: final[a][s] - initial[a][s] for s in final[a] if s in initial.get(a, {})} for a in final}


def _paired_diffs(values: dict[str, dict[int, float]], arm: str, control: str) -> list[float]:
    a, b = values.get(arm, {}), values.get(control, {})
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def _fmt_diffs(d: list[float]) -> str:
    return f"{np.mean(d):+.3f} (seeds {min(d):+.3f}…{max(d):+.3f})" if d else "n/a"


UNCORRECTED_CONTROLS = {"baseline": "fp32_rollout", "baseline_fp8": "fp32_rollout",
                        "deepseek_baseline": "deepseek_fp32_rollout"}


def claim_collapse(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    c = collapse_steps(metrics)
    uncorrected = list(UNCORRECTED_CONTROLS)
    aligned = ["r3", "deepseek_r3", "fp32_rollout", "deepseek_fp32_rollout"]
    final, initial, gain = (_per_seed(runs, "final_eval/eval/pass1"), _per_seed(runs, "initial_eval/eval/pass1"),
                            _pass1_gain(runs))
    gaps, beyond = [], []
    for arm, control in UNCORRECTED_CONTROLS.items():
        if arm not in gain or control not in gain:
            continue
        gaps.append(f"{arm} − {control}: final pass@1 {_fmt_diffs(_paired_diffs(final, arm, control))}, step-0 "
                    f"offset of their evaluators {_fmt_diffs(_paired_diffs(initial, arm, control))}, pass@1 gain "
                    f"{_fmt_diffs(_paired_diffs(gain, arm, control))}")
        beyond.append(_count(c, arm)[0] > _count(c, control)[0] or verdicts.beyond_control(gain[arm], gain[control]))
    controls = [ctl for ctl in dict.fromkeys(UNCORRECTED_CONTROLS.values()) if ctl in gain]
    own = [f"{ctl} {_fmt_diffs(list(gain[ctl].values()))}" for ctl in controls]
    repo = ("collapsed: " + ", ".join(_count_str(c, a) for a in uncorrected + aligned)
            + ("; " + "; ".join(gaps) if gaps else "")
            + (f"; the fp32 controls' own pass@1 gain: {', '.join(own)}" if own else ""))
    bad = [_count(c, a) for a in uncorrected]
    good = [_count(c, a) for a in aligned]
    if not sum(n for _, n in bad):
        verdict = verdicts.NOT_TESTED
    elif any(n and k * 2 > n for k, n in bad) and not any(k for k, _ in good):
        verdict = verdicts.YES
    elif any(k for k, _ in bad):
        verdict = verdicts.PARTLY
    else:
        verdict = verdicts.NO
    verdict = verdicts.gate(verdict, effect_present=any(beyond) if beyond else None)
    return Claim("uncorrected GRPO on an MoE collapses while an aligned rollout does not",
                 "R3 paper (arXiv 2510.11370), Qwen3-30B-A3B", "3 of 3 baseline runs collapsed, 0 of 3 R3", repo,
                 verdict, "not tested: no uncorrected arm collapses more often than its fp32 control, nor loses more "
                 "held-out pass@1 (gain, own evaluator) in every seed; else yes: most runs of an uncorrected arm "
                 "collapse and no R3 or fp32 run does; partly: some uncorrected run collapses; no: none does")


def claim_family(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    ratios, text = k3_ratio(metrics, "deepseek_baseline", "baseline")
    differs = window_mean(metrics, "routing/any_layer_differs")
    repo = (f"k3 DeepSeek-V3 preset / Qwen3-MoE preset (both uncorrected, bf16 rollout, same seed): {text}; "
            f"tokens re-routed in ≥ 1 MoE layer: Qwen3-MoE {_fmt_values(_arm_values(differs, 'baseline'))}, "
            f"DeepSeek-V3 {_fmt_values(_arm_values(differs, 'deepseek_baseline'))}")
    verdict = verdicts.by_threshold(ratios, 1.0)
    return Claim("the mismatch is worse on DeepSeek-V3-style MoE than on Qwen3-MoE", "Mind Lab R3 blog",
                 "larger on Moonlight-16B-A3B than on Qwen3-30B-A3B (qualitative)", repo, verdict,
                 "yes: k3 larger on the DeepSeek-V3 preset in every seed; no: smaller in every seed; "
                 "inconclusive: the seeds disagree")


def claim_clipping(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    ratios, text = k3_ratio(metrics, "ppo_tight_clip", "baseline")
    clip_tight = _arm_values(window_mean(metrics, "clip/frac"), "ppo_tight_clip")
    clip_base = _arm_values(window_mean(metrics, "clip/frac"), "baseline")
    repo = (f"k3 ppo_tight_clip / baseline (clip 0.1 / 0.2): {text}; clipped tokens "
            f"{_fmt_values(clip_tight, '{:.4f}')} vs {_fmt_values(clip_base, '{:.4f}')}")
    verdict = verdicts.gate(verdicts.by_threshold(ratios, 0.5),
                            acted=verdicts.acts_on(clip_tight) if clip_tight else None)
    return Claim("PPO clipping does not see the mismatch", "Mind Lab R3 blog",
                 "clipping bounds π_θ/π_old, not π_old/π_rollout", repo, verdict,
                 f"not tested: the tight clip clips < {verdicts.ACTS_ON_MIN:.0%} of tokens in every seed; else yes: "
                 "k3 stays above half the baseline's in every seed (the clip does not act on it); no: below in "
                 "every seed; inconclusive: the seeds disagree")


def claim_tis(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    early = window_mean(metrics, "mismatch/k3", "early", stat="median")
    late = window_mean(metrics, "mismatch/k3", "late", stat="median")
    growth = {arm: [float(late[arm][s] / early[arm][s]) for s in late[arm].index if s in early[arm].index]
              for arm in ("baseline", "tis") if not late.empty and arm in late.index.get_level_values(0)}
    truncated = _arm_values(window_mean(metrics, "is/truncated_frac"), "tis")
    # What TIS acts on (as in moerl.analysis.dose): tokens whose weight min(ρ, C) departs from 1 by a factor of 2
    # or more either way, ρ outside [1/C, C]; truncation (ρ > C) is only the upper tail.
    reweighted = _arm_values(window_mean(metrics, "is/above_frac").add(window_mean(metrics, "is/below_frac"),
                                                                     fill_value=np.nan), "tis")
    parts = [f"median k3, last vs first {WINDOW} steps: "
             + ", ".join(f"{arm} {_fmt_ratio(v)}" for arm, v in growth.items())] if growth else []
    if reweighted:
        parts.append(f"TIS reweighted {np.mean(reweighted):.2%} of tokens by a factor ≥ 2 (ρ outside [1/2, 2]; "
                     f"truncated {np.mean(truncated):.2%}; n={len(reweighted)})")
    if "baseline" not in growth or "tis" not in growth:
        verdict = verdicts.NOT_TESTED
    else:
        verdict = verdicts.keeps_drifting(growth["tis"], growth["baseline"],
                                          acted=verdicts.acts_on(reweighted) if reweighted else None)
    return Claim("TIS does not stop the drift", "Mind Lab R3 blog", "k3 keeps growing under TIS",
                 "; ".join(parts) or "n/a", verdict,
                 f"not tested: TIS reweights (ρ outside [1/2, 2]) < {verdicts.ACTS_ON_MIN:.0%} of tokens in every seed, "
                 "or the baseline's "
                 "k3 does not grow > 1.2× from the first to the last steps in every seed; else yes: TIS's grows "
                 "> 1.2× in every seed; no: in none; inconclusive: the seeds disagree")


def claim_masking(metrics: pd.DataFrame, runs: pd.DataFrame, arms: tuple[str, ...] = MASKING_ARMS) -> Claim:
    """``arms``: the arms that mask tokens (experiment 07 passes its own MIS arm)."""
    early = window_mean(metrics, "effective/token_frac", "early")
    late = window_mean(metrics, "effective/token_frac", "late")
    masked = window_mean(metrics, "mask/token_frac")
    parts, answers, acted = [], [], []
    for arm in arms:
        e, l_ = _arm_values(early, arm), _arm_values(late, arm)
        if not e:
            continue
        m = _arm_values(masked, arm)
        if m:  # not logged: whether the mask acted is unknown, not "no"
            acted.append(verdicts.acts_on(m))
        parts.append(f"{arm}: " + (f"masked {np.mean(m):.2%} of tokens; " if m else "")
                     + f"tokens with gradient {np.mean(e):.3f} early → "
                     f"{np.mean(l_):.3f} late (n={len(e)})")
        halted = verdicts.by_threshold(l_, 0.5, above=verdicts.NO, below=verdicts.YES)
        fell = [b / a for a, b in zip(e, l_) if a]
        answers.append(halted if halted != verdicts.NO else
                       verdicts.by_threshold(fell, 0.9, above=verdicts.NO, below=verdicts.PARTLY))
    base = _arm_values(late, "baseline")
    if base:
        parts.append(f"baseline {np.mean(base):.3f} late")
    order = (verdicts.YES, verdicts.PARTLY, verdicts.INCONCLUSIVE, verdicts.NO)
    verdict = next((v for v in order if v in answers), verdicts.NOT_TESTED)
    verdict = verdicts.gate(verdict, acted=any(acted) if acted else None)
    return Claim("masking IS (MIS / IcePop) discards ever more samples, eventually halting training",
                 "Mind Lab R3 blog; verl rollout-correction docs", "\"eventually discarding everything\"",
                 "; ".join(parts) or "n/a", verdict,
                 f"not tested: MIS and IcePop each mask < {verdicts.ACTS_ON_MIN:.0%} of tokens in every seed; else "
                 "yes: fewer than half the tokens keep a gradient over the last steps; partly: the share fell by "
                 "> 10 % from the first steps; no: it did not (every seed); inconclusive: the seeds disagree")


def claim_r2(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    r2, r2_text = k3_ratio(metrics, "r2", "baseline")
    _, r3_text = k3_ratio(metrics, "r3", "baseline")
    repo = f"k3 r2 / baseline {r2_text} (r3 / baseline {r3_text})"
    verdict = verdicts.by_threshold(r2, 0.8)
    return Claim("R2 does not improve the mismatch", "Mind Lab R3 blog", "no improvement over no replay", repo, verdict,
                 "yes: R2's k3 stays above 0.8× the baseline's in every seed; no: below in every seed; "
                 "inconclusive: the seeds disagree")


def claim_position_bug(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    c = collapse_steps(metrics)
    worse, worse_text = k3_ratio(metrics, "deepseek_r3_position_bug", "deepseek_baseline")
    replayed = _arm_values(window_mean(metrics, "routing/replayed_agreement"), "deepseek_r3_position_bug")
    native = _arm_values(window_mean(metrics, "routing/agreement"), "deepseek_r3_position_bug")
    fixed = _arm_values(window_mean(metrics, "routing/agreement"), "deepseek_r3")
    k, n = _count(c, "deepseek_r3_position_bug")
    repo = (f"k3 deepseek_r3_position_bug / deepseek_baseline {worse_text}; replayed agreement "
            f"{_fmt_values(replayed, '{:.3f}')} (the checks pass) but trainer-native vs trace agreement, mean over "
            f"layers {_fmt_values(native, '{:.3f}')} (fixed R3: {_fmt_values(fixed, '{:.3f}')}); collapsed {k}/{n}")
    verdict = verdicts.by_threshold(worse, 1.0, below=verdicts.PARTLY if k else verdicts.NO)
    return Claim("R3 mapped by position on a dense-first-layer model is broken", "verl PR 5037 / Mind Lab",
                 "MoE layers replay another layer's routes; the first gets the dense layer's zero rows", repo,
                 verdict, "yes: its k3 exceeds no replay's in every seed (replay makes it worse); partly: it "
                 "collapses; inconclusive: the seeds disagree")


def claim_r3(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    eff = window_mean(metrics, "effective/token_frac")
    gt2 = window_mean(metrics, "mismatch/extreme_gt2")
    parts, answers = [], []
    for r3, base in (("r3", "baseline"), ("deepseek_r3", "deepseek_baseline")):
        ratio, ratio_text = k3_ratio(metrics, r3, base)
        if not ratio:
            continue
        drop = paired_ratio(gt2, base, r3)
        e_r3, e_base = _arm_values(eff, r3), _arm_values(eff, base)
        parts.append(f"k3 {r3} / {base} {ratio_text}, tokens with ratio > 2 down {_fmt_ratio(drop)}, "
                     f"tokens with gradient {_fmt_values(e_r3)} vs {_fmt_values(e_base)}")
        halves = verdicts.by_threshold(ratio, 0.5, above=verdicts.NO, below=verdicts.YES)
        keeps = abs(np.mean(e_r3) - np.mean(e_base)) < 0.01
        answers.append(halves if keeps or halves != verdicts.YES else verdicts.NO)
    if not answers:
        verdict = verdicts.NOT_TESTED
    elif verdicts.INCONCLUSIVE in answers:
        verdict = verdicts.INCONCLUSIVE
    else:
        verdict = (verdicts.YES if all(a == verdicts.YES for a in answers)
                   else verdicts.PARTLY if verdicts.YES in answers else verdicts.NO)
    return Claim("R3 mapped by global layer number reduces the mismatch and the extreme tokens without shrinking "
                 "the effective sample set", "R3 paper, Mind Lab", "tokens with ratio > 2 drop ~10×",
                 "; ".join(parts) or "n/a", verdict,
                 "yes: R3 halves k3 in every seed and keeps the share of tokens with gradient within 1 point, on "
                 "both presets; partly: on one; inconclusive: the seeds straddle half")


PAPER_REROUTED = 0.94  # the R3 paper (arXiv 2510.11370), Qwen3-30B-A3B: share of tokens routed differently in >= 1 router without R3


def claim_rerouted(metrics: pd.DataFrame, runs: pd.DataFrame) -> Claim:
    differs = window_mean(metrics, "routing/any_layer_differs")
    parts, values = [], []
    for base in ("baseline", "deepseek_baseline"):
        v = _arm_values(differs, base)
        if v:
            parts.append(f"{base}: {_fmt_values(v)} (seeds {min(v):.3f}–{max(v):.3f})")
            values += v
    verdict = verdicts.by_threshold(values, PAPER_REROUTED / 2)
    return Claim("without R3, nearly every token is routed differently in at least one MoE layer", "R3 paper",
                 f"~{PAPER_REROUTED:.0%} of tokens differ in ≥ 1 router (48-layer Qwen3-30B-A3B)",
                 "tokens re-routed in ≥ 1 MoE layer without replay (8 MoE layers here): " + ("; ".join(parts) or "n/a"),
                 verdict, f"yes: at least half the paper's share ({PAPER_REROUTED / 2:.0%}) in every seed of both "
                 "presets; no: below it in every seed; inconclusive: the seeds straddle it")


CLAIMS = [claim_collapse, claim_family, claim_clipping, claim_tis, claim_masking, claim_r2, claim_position_bug,
          claim_r3, claim_rerouted]


def finished(metrics: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """The metrics of the runs in ``runs`` (run_table: finished runs) only; a run still going is left out."""
    done = set(zip(runs["arm"], runs["seed"].astype(int)))
    return metrics[[(a, int(s)) in done for a, s in zip(metrics["arm"], metrics["seed"])]]


def evaluate_claims(metrics: pd.DataFrame, runs: pd.DataFrame) -> list[Claim]:
    """Every claim of experiment 05 from its metrics (load_metrics) and runs (run_table: finished runs)."""
    metrics = finished(metrics, runs)
    return [claim(metrics, runs) for claim in CLAIMS]


# The registered rules every claim's verdict is computed under (experiments/05_mismatch_consequences/analysis.yaml).
CLAIM_RULES = ("claim_thresholds", "verdict_gates")


def registration_status(rules: tuple[str, ...] = CLAIM_RULES) -> str:
    """'pre-registered', or 'post hoc: <rule> (<commit>), ...' for the rules set after the main grid's first
    run started (moerl.analysis.registration, from the file's git history and the recorded start)."""
    from moerl.analysis.registration import Registration, analysis_path

    reg = Registration(analysis_path(EXPERIMENT))
    late = [st for st in (reg.status(r, "main") for r in rules) if st.post_hoc]
    return "pre-registered" if not late else "post hoc: " + ", ".join(f"{st.rule} ({st.set_by})" for st in late)


def claims_markdown(claims: list[Claim]) -> str:
    status = registration_status()
    collapse = registration_status(CLAIM_RULES + ("collapse",))
    lines = ["| claim | source | source's value | this repo (CPU scale) | reproduced | rule | registration |",
             "|---|---|---|---|---|---|---|"]
    for c in claims:
        label = collapse if c.claim.startswith("uncorrected GRPO") else status
        lines.append(f"| {c.claim} | {c.source} | {c.paper} | {c.repo} | **{c.verdict}** | {c.rule} | {label} |")
    return "\n".join(lines)


def _span(values: pd.Series, spec: str) -> str:
    lo, hi = format(values.min(), spec), format(values.max(), spec)
    return lo if lo == hi else f"{lo}–{hi}"


def facts_markdown(metrics: pd.DataFrame) -> str:
    """Measures the 05 README's reading cites besides the claims table: how the position-bug runs end,
    how the baseline's per-layer agreement and its all-layers share differ, and how one heavy step moves
    the tight-clip arm's mean k3 but not its median."""
    train = _train(metrics)
    lines = []
    bug = train[train["arm"] == "deepseek_r3_position_bug"]
    if not bug.empty:
        reward = bug.sort_values("step").groupby("seed")["reward/mean"].apply(lambda s: s.tail(20).mean())
        final = metrics[(metrics["arm"] == "deepseek_r3_position_bug") & metrics["eval/pass1"].notna()]
        final = final.sort_values("step").groupby("seed")["eval/pass1"].last()
        lines.append(f"- deepseek_r3_position_bug at the end: training reward (last 20 steps) "
                     f"{_span(reward, '.2f')}, held-out pass@1 {_span(final, '.3f')}")
    agree = _arm_values(window_mean(metrics, "routing/agreement"), "baseline")
    alike = _arm_values(window_mean(metrics, "routing/any_layer_differs"), "baseline")
    if agree and alike:
        lines.append(f"- baseline: routing agreement averaged over layers {np.mean(agree):.4f}; tokens agreeing in "
                     f"all 8 MoE layers {100 * (1 - np.mean(alike)):.1f} %")
    clip = train[(train["arm"] == "ppo_tight_clip") & (train["seed"] == 0)]["mismatch/k3"].dropna()
    base = train[(train["arm"] == "baseline") & (train["seed"] == 0)]["mismatch/k3"].dropna()
    if not clip.empty and not base.empty:
        lines.append(f"- ppo_tight_clip seed 0: largest per-step k3 {clip.max():.2f} ({clip.max() / clip.median():,.0f}× its "
                     f"median step); run mean {clip.mean() / base.mean():.0f}× the baseline's, run median "
                     f"{clip.median() / base.median():.1f}×")
    return "\n".join(lines)


def collapse_markdown(metrics: pd.DataFrame) -> str:
    """Each run's collapse step (moerl.analysis.collapse), one row per arm, one column per seed."""
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
