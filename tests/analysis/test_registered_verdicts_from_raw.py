"""Every verdict RESULTS.md prints for experiment 07's registered grids, recomputed from the raw run files.

Independent of moerl.analysis on purpose: the grids' membership, the collapse rule, the paired t bounds,
the acts-on floor and the drift rule are restated here from analysis.yaml and the rules' words, with plain
json / yaml / scipy, and read from each run's config.yaml and metrics.jsonl. A published verdict that the raw
files do not give -- a wrong seed in a grid, a mixed-up pairing, a table left stale -- fails here. Only
complete grids print verdicts; each row of their tables must be one of the kinds below, so a new kind of
verdict cannot pass unchecked.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "results" / "runs" / "07_dose_threshold"
ANALYSIS = yaml.safe_load((REPO / "experiments" / "07_dose_threshold" / "analysis.yaml").read_text())
RULES = {name: spec["value"] for name, spec in ANALYSIS["rules"].items()}
GRIDS = ("confirmatory_control", "confirmatory_fp8", "confirmatory_nvfp4_600", "mechanism")
QAT_ONLY_AT = "int4_kimi"  # analysis.yaml, grids.mechanism.runs: "qat_* at int4_kimi only"


def planned(grid: str) -> set[tuple[str, str, int]]:
    spec = ANALYSIS["grids"][grid]
    return {(arm, rung, seed) for arm in spec["arms"] for rung in spec["rungs"] for seed in spec["seeds"]
            if not (arm.startswith("qat_") and rung != QAT_ONLY_AT)}


def collapse_step(train: list[dict]) -> int | None:
    """The collapse rule in its own words: a non-finite update, or the 20-step mean reward below half its
    running peak, staying below half of that peak for the rest of the run."""
    rule = RULES["collapse"]
    for row in train:
        grad = row.get("grad_norm", 0.0)
        if (row.get("updates/skipped_nonfinite") or 0) > 0 or (isinstance(grad, float) and not math.isfinite(grad)):
            return row["step"]
    window, means = rule["window"], []
    for i in range(len(train)):
        means.append(None if i + 1 < window else sum(r["reward/mean"] for r in train[i + 1 - window: i + 1]) / window)
    peak = -math.inf
    for i, mean in enumerate(means):
        if mean is None:
            continue
        peak = max(peak, mean)
        if mean < rule["fraction"] * peak and all(m < rule["fraction"] * peak for m in means[i:]):
            return train[i]["step"]
    return None


def read_run(run: Path) -> dict | None:
    """A finished run of a registered grid, or None."""
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    trainer, rollout = cfg["trainer"], cfg["rollout"]
    if rollout.get("decode") != ANALYSIS["rollout_path"]["value"]:
        return None
    lines = [line for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    try:
        rows = [json.loads(line) for line in lines]
    except json.JSONDecodeError:
        return None  # a run still writing its last line
    train = [r for r in rows if "reward/mean" in r]
    if len(train) != trainer["steps"]:
        return None  # still running
    key = (cfg["arm"], rollout["dtype"], int(cfg["seed"]))
    completions = int(trainer.get("eval_samples", 1)) * int(trainer["eval_size"])
    grid = next((g for g in GRIDS if key in planned(g) and ANALYSIS["grids"][g]["eval_completions"] == completions
                 and ANALYSIS["grids"][g].get("steps", 300) == trainer["steps"]), None)
    if grid is None:
        return None
    evals = [r["eval/pass1"] for r in rows if "eval/pass1" in r]
    k3 = [r["mismatch/k3"] for r in train if isinstance(r.get("mismatch/k3"), (int, float))]
    window = RULES.get("drift", {}).get("window", 50)
    tails = [r["is/below_frac"] + r["is/above_frac"] for r in train
             if isinstance(r.get("is/below_frac"), (int, float)) and isinstance(r.get("is/above_frac"), (int, float))]
    masked = [r["mask/token_frac"] for r in train if isinstance(r.get("mask/token_frac"), (int, float))]
    return {"grid": grid, "arm": key[0], "rung": key[1], "seed": key[2], "start": evals[0], "end": evals[-1],
            "collapse": collapse_step(train),
            "growth": float(np.median(k3[-window:]) / np.median(k3[:window])) if len(k3) >= 2 * window else None,
            "ratio_tail": float(np.mean(tails)) if tails else None, "masked": float(np.mean(masked)) if masked else None}


def load() -> dict[tuple[str, str, str], dict[int, dict]]:
    out: dict = {}
    for metrics in sorted(RUNS.glob("*/seed*/metrics.jsonl")):
        if re.fullmatch(r"seed\d+", metrics.parent.name) and (run := read_run(metrics.parent)):
            out.setdefault((run["grid"], run["arm"], run["rung"]), {})[run["seed"]] = run
    return out


def t_bounds(values: list[float], level: float) -> tuple[float, float, float]:
    """The mean and its one-sided ``level`` t bounds."""
    v = np.asarray(values)
    half = stats.t.ppf(level, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))
    return float(v.mean()), float(v.mean() - half), float(v.mean() + half)


def t_rule(values: list[float], threshold: float, level: float) -> tuple[str, tuple[float, float, float]]:
    mean, low, high = t_bounds(values, level)
    return ("yes" if low > threshold else "no" if high < threshold else "inconclusive"), (mean, low, high)


def every_seed(values: list[float], threshold: float) -> str:
    return "yes" if min(values) > threshold else "no" if max(values) < threshold else "inconclusive"


def printed_tables() -> dict[str, dict[str, list[str]]]:
    """RESULTS.md's registered-grid tables: grid -> comparison -> its cells."""
    text = (REPO / "results" / "RESULTS.md").read_text()
    tables: dict = {}
    for grid, body in re.findall(r"\*\*(\w+)\*\*\n\n\| comparison \|[^\n]*\n\|[-|]+\n((?:\|[^\n]*\n)+)", text):
        tables[grid] = {cells[0]: cells[1:] for cells in
                        ([c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines())}
    return tables


RAW = load()
TABLES = printed_tables()


def by_seed(grid: str, arm: str, rung: str) -> dict[int, dict]:
    return RAW.get((grid, arm, rung), {})


def paired(a: dict[int, dict], b: dict[int, dict]) -> list[float]:
    return [a[s]["end"] - b[s]["end"] for s in sorted(set(a) & set(b))]


def recompute(grid: str, name: str, regime: str | None) -> tuple[str, tuple | None]:
    """(verdict, (mean, low, high) or None) for one printed comparison, from the raw runs."""
    control = by_seed("confirmatory_control", "fp32_control", "fp32")
    like, helps, acts = RULES["like_control_t"], RULES["helps_t"], RULES["acts_on_per_mechanism"]
    gated = lambda verdict: verdict if regime == "yes" else "not tested"  # noqa: E731 - needs a learning control
    rung = ANALYSIS["grids"][grid]["rungs"][0]
    if name == "regime":
        rule = RULES["regime_t"]
        verdict, bounds = t_rule([r["end"] - r["start"] for r in control.values()], rule["lower_bound_above"],
                                 rule["level"])
        return ("no" if any(r["collapse"] is not None for r in control.values()) else verdict), bounds
    if name == "baseline behind control":
        return t_rule(paired(control, by_seed(grid, "baseline", rung)), helps["threshold"], helps["level"])
    if m := re.fullmatch(r"(\w+) like_control", name):
        arm = m[1]
        at = rung if grid != "mechanism" else QAT_ONLY_AT if arm.startswith("qat_") else None
        verdict, bounds = t_rule(paired(by_seed(grid, arm, at), control), -like["margin"], like["level"])
        return gated(verdict), bounds
    if m := re.fullmatch(r"(\w+) helps", name):
        arm = m[1]
        mine = by_seed(grid, arm, rung)
        verdict, bounds = t_rule(paired(mine, by_seed(grid, "baseline", rung)), helps["threshold"], helps["level"])
        share = "ratio_tail" if arm == "tis" else "masked" if arm in ("mis", "icepop") else None
        if share and min(r[share] for r in mine.values()) < acts["floor"]:
            verdict = "not tested"
        return verdict, bounds
    if m := re.fullmatch(r"(\w+) helps over (\w+) at (\w+)", name):
        return t_rule(paired(by_seed(grid, m[1], m[3]), by_seed(grid, m[2], m[3])), helps["threshold"], helps["level"])
    if m := re.fullmatch(r"(\w+) keeps_drifting", name):
        arm, growth = m[1], RULES.get("drift", {}).get("growth", 1.2)
        mine = by_seed(grid, arm, rung)
        share = "ratio_tail" if arm == "tis" else "masked" if arm in ("mis", "icepop") else None
        if share and min(r[share] for r in mine.values()) < acts["floor"]:
            return "not tested", None
        if every_seed([r["growth"] for r in by_seed(grid, "baseline", rung).values()], growth) != "yes":
            return "not tested", None  # no drift to stop
        return every_seed([r["growth"] for r in mine.values()], growth), None
    if m := re.fullmatch(r"(\w+) (collapses|prevents collapse)(?: at (\w+))?", name):
        arm, at = m[1], m[3] or QAT_ONLY_AT
        own = [s for s, r in by_seed(grid, arm, at).items() if r["collapse"] is not None]
        if m[2] == "collapses":
            n = len(by_seed(grid, arm, at))
            return gated("yes" if len(own) == n else "no" if not own else f"partly ({len(own)} of {n})"), None
        base = [s for s, r in by_seed(grid, "baseline", at).items() if r["collapse"] is not None
                and s in by_seed(grid, arm, at)]
        return gated("not tested" if not base else "yes" if not own else "no" if len(own) >= len(base)
                     else "partly"), None
    raise AssertionError(f"RESULTS.md, grid {grid}: no independent recomputation for the comparison {name!r}")


def recompute_p(grid: str, name: str) -> float:
    """The raw one-sided p of a printed comparison, in the family-wise rule's words: a t rule's one-sided t
    test against its threshold; an every-seed count's sign test under a fair coin per seed; prevents
    collapse: Fisher's exact test of the baseline collapsing more often than the arm on the arm's seeds."""
    control = by_seed("confirmatory_control", "fp32_control", "fp32")
    rung = ANALYSIS["grids"][grid]["rungs"][0]
    ttest = lambda values, threshold: stats.ttest_1samp(values, threshold, alternative="greater").pvalue  # noqa: E731
    if name == "regime":
        return ttest([r["end"] - r["start"] for r in control.values()], RULES["regime_t"]["lower_bound_above"])
    if name == "baseline behind control":
        return ttest(paired(control, by_seed(grid, "baseline", rung)), 0.0)
    if m := re.fullmatch(r"(\w+) like_control", name):
        at = rung if grid != "mechanism" else QAT_ONLY_AT
        return ttest(paired(by_seed(grid, m[1], at), control), -RULES["like_control_t"]["margin"])
    if m := re.fullmatch(r"(\w+) helps", name):
        return ttest(paired(by_seed(grid, m[1], rung), by_seed(grid, "baseline", rung)), 0.0)
    if m := re.fullmatch(r"(\w+) helps over (\w+) at (\w+)", name):
        return ttest(paired(by_seed(grid, m[1], m[3]), by_seed(grid, m[2], m[3])), 0.0)
    if m := re.fullmatch(r"(\w+) keeps_drifting", name):
        growth = [r["growth"] for r in by_seed(grid, m[1], rung).values()]
        return stats.binomtest(sum(g > RULES["drift"]["growth"] for g in growth), len(growth), 0.5,
                               alternative="greater").pvalue
    m = re.fullmatch(r"(\w+) (collapses|prevents collapse)(?: at (\w+))?", name)
    arm, at = m[1], m[3] or QAT_ONLY_AT
    mine = by_seed(grid, arm, at)
    own = sum(r["collapse"] is not None for r in mine.values())
    if m[2] == "collapses":
        return stats.binomtest(own, len(mine), 0.5, alternative="greater").pvalue
    base = sum(r["collapse"] is not None for s, r in by_seed(grid, "baseline", at).items() if s in mine)
    return stats.fisher_exact([[base, len(mine) - base], [own, len(mine) - own]], alternative="greater").pvalue


def holm_by_enumeration(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's adjusted p by its definition: p_(i) adjusted = max over j <= i of min(1, (m - j + 1) p_(j))."""
    ranked = sorted(pvalues, key=pvalues.get)
    m = len(ranked)
    return {name: max(min(1.0, (m - j) * pvalues[ranked[j]]) for j in range(i + 1)) for i, name in enumerate(ranked)}


@pytest.mark.parametrize("grid", [g for g in GRIDS if g in TABLES] or [pytest.param(None, marks=pytest.mark.skip(
    reason="no registered grid is complete yet"))])
def test_every_printed_p_and_its_holm_reading_follow_from_the_raw_runs(grid):
    """Raw p, Holm-adjusted p within the grid's family and the verdict under Holm: yes stands only when the
    adjusted p is below the family-wise alpha; every other verdict is kept."""
    family_wise = RULES["family_wise"]
    raw = {name: recompute_p(grid, name) for name in TABLES[grid]}
    adjusted = holm_by_enumeration(raw) if grid in family_wise["families"] else raw
    for name, cells in TABLES[grid].items():
        assert cells[3] == f"{raw[name]:.3g}", f"{grid} / {name}: printed p {cells[3]}, the raw runs give {raw[name]:.3g}"
        assert cells[4].split(" (of")[0] == f"{adjusted[name]:.3g}", f"{grid} / {name}: Holm p {cells[4]}"
        expected = "inconclusive" if cells[0] == "yes" and adjusted[name] >= family_wise["alpha"] else cells[0]
        assert cells[5].strip("*") == expected, f"{grid} / {name}: under Holm {cells[5]}, expected {expected}"


@pytest.mark.parametrize("grid", [g for g in GRIDS if g in TABLES] or [pytest.param(None, marks=pytest.mark.skip(
    reason="no registered grid is complete yet"))])
def test_every_printed_verdict_follows_from_the_raw_runs(grid):
    seeds = ANALYSIS["grids"][grid]["seeds"]
    missing = sorted(planned(grid) - {(a, r, s) for (g, a, r), runs in RAW.items() if g == grid for s in runs})
    assert not missing, f"{grid} prints verdicts but its registered runs {missing[:3]}... are not all finished"
    regime_row = TABLES["confirmatory_control"]["regime"]
    for name, cells in TABLES[grid].items():
        verdict, bounds = recompute(grid, name, regime_row[0])
        assert cells[0] == verdict, f"{grid} / {name}: printed {cells[0]!r}, the raw runs give {verdict!r}"
        if bounds is not None:
            assert cells[1] == "{:+.3f} [{:+.3f}, {:+.3f}]".format(*bounds), f"{grid} / {name}"
            assert int(cells[2]) == len(seeds), f"{grid} / {name}: {cells[2]} seeds, {len(seeds)} registered"


def test_the_restated_collapse_rule_agrees_with_the_package_on_the_earlier_grids():
    """The restated rule against moerl's on the runs recorded before the registered path (ladder, control,
    main grids: collapsed and healthy runs alike), so that an agreement above is not two copies of one bug
    agreeing by chance -- nor a restatement that never sees a collapse."""
    from moerl.analysis.collapse import collapse_step as package_rule

    steps = {}
    for metrics in sorted(RUNS.glob("*/seed*/metrics.jsonl")):
        cfg = yaml.safe_load((metrics.parent / "config.yaml").read_text())
        if not re.fullmatch(r"seed\d+", metrics.parent.name) or cfg["rollout"].get("decode") == "loop":
            continue
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        steps[metrics.parent] = (collapse_step([r for r in rows if "reward/mean" in r]), package_rule(rows))
    assert steps and all(mine == theirs for mine, theirs in steps.values())
    assert sum(mine is not None for mine, _ in steps.values()) >= 3  # the main grid's collapsed baselines
