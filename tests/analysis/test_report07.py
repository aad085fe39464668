"""moerl.analysis.dose_report (the code of experiments/07_dose_threshold/report.py) on crafted run
directories: the ladder, the control's learning test per seed, and the main grid's paired verdicts land
in ladder.md / ladder.json, and the figure is drawn."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from moerl.analysis import dose_report as report

REPO = Path(__file__).resolve().parents[2]


def write_run(root, arm, rung, seed, pass1_end, k3, extra=None, collapse=False, steps=60):
    name = arm if rung in ("bf16", "fp32") else f"{arm}+rollout.dtype={rung}"
    run = root / "07_dose_threshold" / name / f"seed{seed}"
    run.mkdir(parents=True)
    cfg = {"arm": arm, "seed": seed, "rollout": {"dtype": rung}, "trainer": {"steps": steps}}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = [{"step": 0, "eval/pass1": 0.55}]
    for i in range(steps):
        reward = 0.02 if collapse and i > steps // 2 else 0.5
        rows.append({"step": i + 1, "reward/mean": reward, "mismatch/k3": k3, "grad_norm": 0.5,
                     "effective/token_frac": 0.99, "routing/any_layer_differs": 0.3 if arm.startswith("r3") else 0.0,
                     # TIS caps few tokens but scales down more: 2.3 % of tokens have ρ outside [1/2, 2].
                     "is/truncated_frac": 0.003 if arm.endswith("tis") else 0.0,
                     "is/above_frac": 0.003 if arm.endswith("tis") else 0.0,
                     "is/below_frac": 0.02 if arm.endswith("tis") else 0.0, **(extra or {})})
    rows.append({"step": steps, "eval/pass1": pass1_end})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_writes_ladder_grid_and_figure(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    for seed, (control, base, tis, r3) in enumerate([(0.68, 0.40, 0.60, 0.66), (0.67, 0.42, 0.45, 0.65),
                                                     (0.70, 0.35, 0.30, 0.69)]):
        write_run(runs, "fp32_control", "fp32", seed, control, 0.0)
        write_run(runs, "baseline", "int4", seed, base, 2e-2, collapse=seed in (0, 2))
        write_run(runs, "tis", "int4", seed, tis, 2e-2)
        write_run(runs, "r3", "int4", seed, r3, 8e-3)
        # MIS masking 70 % of tokens throughout: by experiment 05's rule, masking "halts" training. Recorded
        # under the arm's former name (mis), it is reported under its current one (geo_mis_0p1pct).
        write_run(runs, "mis", "int4", seed, 0.5, 2e-2, extra={"effective/token_frac": 0.3, "mask/token_frac": 0.7})
    for rung, k3 in (("bf16", 6e-4), ("int8", 3e-3), ("fp8", 2.5e-3), ("nvfp4", 1.5e-2)):  # the rest of the ladder
        write_run(runs, "baseline", rung, 0, 0.6, k3)
    # A finished-looking run that run.py --fresh set aside must not count as seed 0.
    tis0 = runs / "07_dose_threshold" / "tis+rollout.dtype=int4" / "seed0"
    shutil.rmtree(tis0)
    write_run(runs, "tis", "int4", 0, 0.10, 2e-2)
    tis0.rename(tis0.with_name("seed0.old-20261125-053753"))
    write_run(runs, "tis", "int4", 0, 0.60, 2e-2)
    out, fig = tmp_path / "out", tmp_path / "fig.png"
    monkeypatch.setattr(sys, "argv", ["report.py", "--runs", str(runs), "--out", str(out), "--figure", str(fig),
                                     "--mitigation-figure", str(tmp_path / "mit.png"), "--results", str(tmp_path / "R.md"),
                                     "--dynamics-figure", str(tmp_path / "dyn.png"),
                                         "--threshold-figure", str(tmp_path / "thr.png")])
    report.main()
    # the closing line names every file the report wrote: the four figures and the RESULTS section too
    wrote = capsys.readouterr().out.splitlines()[-1]
    assert wrote == (f"wrote {out / 'ladder.md'}, {out / 'ladder.json'}, {fig}, {tmp_path / 'mit.png'}, "
                     f"{tmp_path / 'dyn.png'}, {tmp_path / 'thr.png'}, {tmp_path / 'R.md'}")
    text = (out / "ladder.md").read_text()
    assert "seed 0: pass@1 0.550 → 0.680 at step 60 (learns by the rule)" in text
    assert "Threshold (lowest rung in mismatch order whose uncorrected run collapses while the control learns): **int4**" in text
    grid = json.loads((out / "ladder.json").read_text())["grid"]["int4"]
    # tis beats the baseline in seeds 0 and 1 but not in seed 2: inconclusive; r3 beats it in all three
    assert grid["arms"]["tis"]["minus_baseline"]["0"] == pytest.approx(0.60 - 0.40)
    assert grid["arms"]["tis"]["helps"] == "inconclusive" and grid["arms"]["r3"]["helps"] == "yes"
    # Under the pre-registered "acted on" measure (truncated share, 0.3 %) TIS is not tested; both are reported.
    assert grid["arms"]["tis"]["preregistered"]["helps"] == "not tested"
    assert "tis under the rules as first written (\"acted on\" first measured as `is/truncated_frac`: 0.003, 0.003, 0.003 per seed)" in text
    # every verdict carries its interval and power; amended rules are labelled post hoc with their commit
    assert "| tis | like control: " in text and "95 % t interval" in text
    assert "*post hoc*: match_margin (76c4ee0f)" in text and "acts_on_measure (c009c40b)" in text
    assert "| match_margin | main (first run 2026-11-25 05:35 UTC)" in text
    assert grid["arms"]["r3"]["like_control"] == "yes" and grid["arms"]["r3"]["prevents_collapse"] == "yes"
    assert grid["r3_reduces_mismatch"]["verdict"] == "yes"
    assert "| r3 | [0, 1, 2] | 0 (—) |" in text
    # Where each arm collapses: the baseline in seeds 0 and 2 at int4; R3 and TIS in none.
    assert "| baseline | 2/3 (step 42) | int4 | — |" in text and "| r3 | 0/3 | above int4 | raised above int4 |" in text
    assert (tmp_path / "thr.png").stat().st_size > 10_000
    assert fig.exists() and fig.stat().st_size > 10_000 and (tmp_path / "mit.png").stat().st_size > 10_000
    assert (tmp_path / "dyn.png").stat().st_size > 10_000
    results = (tmp_path / "R.md").read_text()
    assert "<!-- experiment 07: begin (experiments/07_dose_threshold/report.py) -->" in results
    assert "![mismatch before the collapse](figures/07_mismatch_before_collapse.png)" in results
    assert "| uncorrected GRPO on an MoE collapses | R3 paper (arXiv 2510.11370) | the uncorrected run collapses from rung int4" in results
    assert ("| masking IS (MIS / IcePop) discards ever more samples, eventually halting training (rung int4) | "
            "Mind Lab R3 blog; verl rollout-correction docs | geo_mis_0p1pct: masked 70.00% of tokens") in results
    assert "| **yes** (experiment 05's rule, `moerl.analysis.claims.claim_masking`" in results
    assert "R3 keeps GRPO training like the mismatch-free run (rung int4)" in results
    assert "| **yes — *post hoc*: match_margin (76c4ee0f)** (-0.017 [-0.031, -0.002], 95 % t; power 0.38 at 3 seeds" in results


def test_masking_yes_on_the_level_says_when_the_share_did_not_fall():
    """05's masking rule answers "yes" on the level of masking; the row adds that "ever more" is not shown
    when the masking arm's share keeping a gradient rose in every seed, and nothing when it fell."""
    import pandas as pd

    def metrics(early: float, late: float) -> pd.DataFrame:
        rows = [{"arm": "geo_mis_0p1pct", "seed": s, "step": t, "reward/mean": 0.5, "effective/token_frac": early if t <= 50 else late,
                 "mask/token_frac": 1 - (early if t <= 50 else late)} for s in range(3) for t in range(1, 301)]
        return pd.DataFrame(rows)

    rising, falling = metrics(0.36, 0.42), metrics(0.45, 0.30)
    assert "did not fall" in report.masking_trend_caveat(rising, "yes")
    assert report.masking_trend_caveat(falling, "yes") == ""
    assert report.masking_trend_caveat(rising, "no") == ""


def test_report_links_only_the_figures_it_drew(tmp_path, monkeypatch, capsys):
    """With the control's runs alone there is no rung to draw the before-collapse figure for: RESULTS.md
    must not link a figure the report did not write."""
    runs = tmp_path / "runs"
    for seed in range(3):
        write_run(runs, "fp32_control", "fp32", seed, 0.68, 0.0)
    monkeypatch.setattr(sys, "argv", ["report.py", "--runs", str(runs), "--out", str(tmp_path / "out"),
                                     "--figure", str(tmp_path / "fig.png"), "--mitigation-figure", str(tmp_path / "mit.png"),
                                     "--dynamics-figure", str(tmp_path / "dyn.png"),
                                     "--threshold-figure", str(tmp_path / "thr.png"), "--results", str(tmp_path / "R.md")])
    report.main()
    assert not (tmp_path / "dyn.png").exists()
    assert "07_mismatch_before_collapse.png" not in (tmp_path / "R.md").read_text()
    assert str(tmp_path / "dyn.png") not in capsys.readouterr().out.splitlines()[-1]


def test_confirmatory_figure_waits_for_the_grid_then_draws_its_verdicts(tmp_path):
    """The registered fp8 grid's figure: none while a registered run is missing; once all are in, drawn."""
    import numpy as np

    registered = report.REGISTERED
    path = {registered["rollout_path"]["key"]: registered["rollout_path"]["value"]}

    def run(arm, rung, seed, end):
        return {"arm": arm, "rung": rung, "seed": seed, "steps": 300, "steps_planned": 300, "eval_completions": 2048,
                "path": dict(path), "pass1_start": 0.55, "pass1_end": end, "collapse_step": None, "acts_on": {}}

    rng = np.random.default_rng(0)
    runs = [run("fp32_control", "fp32", s, 0.70 + rng.normal(0, 0.01)) for s in range(12)]
    for arm in registered["grids"]["confirmatory_fp8"]["arms"]:
        runs += [run(arm, "fp8", s, 0.64 + rng.normal(0, 0.01)) for s in range(12)]
    assert report.confirmatory_figure(runs[:-1], tmp_path / "partial.png") is None
    drawn = report.confirmatory_figure(runs, tmp_path / "fp8.png")
    assert drawn is not None and Path(drawn).stat().st_size > 10_000


def test_a_main_grid_row_shows_the_registered_grid_that_judged_its_arm_again():
    registered = {"confirmatory_fp8": {
        "r3 like_control": {"verdict": "inconclusive", "n": 12}, "r3 helps": {"verdict": "yes", "n": 12},
        "tis helps": {"verdict": "not tested", "floor_ungated": "yes", "n": 12}}}
    assert report.registered_beside(registered, "fp8", "r3") == \
        " — **registered fp8 grid (12 seeds, below): like control: inconclusive; helps: yes**"
    assert "helps: not tested (ungated yes: acts-on floor)" in report.registered_beside(registered, "fp8", "tis")
    assert report.registered_beside(registered, "nvfp4", "r3") == ""  # no registered grid judged it there
    assert report.registered_beside(None, "fp8", "r3") == ""
