"""The shared loader and the scripts over it: killed runs, missing runs, tables, figures."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from moerl.analysis.results import (MissingRunError, load_metrics, load_refit, load_run, load_summaries, load_token_samples,
                           mean_std, results_root, run_table, seed_stats)

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "runs"
EXP = "00_tiny_moe_cpu"


@pytest.fixture
def runs(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "runs")
    return tmp_path / "runs"


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / name), *args], capture_output=True, text=True,
                          cwd=REPO)


def test_load_metrics_is_tidy():
    df = load_metrics(FIXTURE, EXP)
    assert set(df["arm"]) == {"baseline", "r3", "deepseek_r3"} and set(df["seed"]) == {0, 1}
    assert {"experiment", "arm", "seed", "step", "mismatch/k3"} <= set(df.columns)
    train = df[df["reward/mean"].notna()]
    assert train.groupby(["arm", "seed"])["step"].max().eq(6).all()
    # deepseek_v3 starts with a dense layer: its MoE layers are 1..3, no layer0 column values
    ds = train[train["arm"] == "deepseek_r3"]
    assert ds["routing/agreement/layer0"].isna().all() and ds["routing/agreement/layer1"].notna().all()


def test_truncated_last_line_loads_with_a_warning_naming_the_file(runs):
    path = runs / EXP / "baseline" / "seed0" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines) + "\n" + lines[-1][: len(lines[-1]) // 2])  # a killed run's half line
    with pytest.warns(UserWarning, match=str(path).replace("\\", "\\\\") + ".*truncated"):
        df = load_metrics(runs, EXP)
    assert len(df[(df["arm"] == "baseline") & (df["seed"] == 0)]) == len(lines)


def test_corrupt_middle_line_is_an_error_naming_file_and_line(runs):
    path = runs / EXP / "r3" / "seed1" / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:10]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=f"{path}: line 3 is not valid JSON"):
        load_metrics(runs, EXP)


def test_missing_runs_are_reported_by_name(tmp_path):
    with pytest.raises(MissingRunError, match=r"run 00_tiny_moe_cpu/tis/seed2 not found.*baseline/seed0"):
        load_run(FIXTURE, EXP, "tis", 2)
    with pytest.raises(MissingRunError, match=r"arm\(s\) \['tis'\]"):
        load_metrics(FIXTURE, EXP, arms=["baseline", "tis"])
    with pytest.raises(MissingRunError, match="does not exist"):
        load_metrics(tmp_path / "nowhere")
    with pytest.raises(MissingRunError, match="no per-token samples"):
        load_token_samples(FIXTURE, EXP, arms=["tis"])
    assert load_run(FIXTURE, EXP, "r3", 1)["step"].max() == 6


def test_missing_run_in_scripts_is_a_message_not_a_traceback(tmp_path):
    for proc in (_script("compare_runs.py", str(FIXTURE / EXP), "baseline", "tis"),
                 _script("write_results.py", str(tmp_path / EXP), "--out", str(tmp_path / "R.md")),
                 _script("make_figures.py", "--runs", str(tmp_path / "none"), "--out", str(tmp_path))):
        assert proc.returncode != 0
        assert "Traceback" not in proc.stderr, proc.stderr
    assert "['tis']" in _script("compare_runs.py", str(FIXTURE / EXP), "tis").stderr


def test_results_root_reads_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MOERL_RESULTS", str(FIXTURE))
    assert results_root() == FIXTURE
    monkeypatch.setenv("MOERL_RESULTS", str(tmp_path / "missing"))
    with pytest.raises(MissingRunError, match=r"missing does not exist \(set \$MOERL_RESULTS"):
        results_root()


def test_summaries_samples_and_run_table():
    summ = load_summaries(FIXTURE, EXP)
    assert len(summ) == 6
    knobs = summ.groupby("arm")[["cfg/preset", "cfg/replay"]].first()
    assert knobs.loc["deepseek_r3"].tolist() == ["deepseek_v3", "R3"]
    assert knobs.loc["baseline"].tolist() == ["qwen3_moe", "none"]
    samples = load_token_samples(FIXTURE, EXP)
    assert {"rollout_logp", "trainer_logp", "raw_ratio", "is_weight", "truncated", "masked", "step"} <= set(samples)
    assert sorted(samples["step"].unique()) == [2, 4, 6]
    table = run_table(FIXTURE, EXP)
    assert table["wall/run_s"].gt(0).all() and table["wall/train_s"].gt(0).all()
    assert table["git_sha"].str.len().ge(40).all()


def test_seed_stats_and_mean_std():
    df = pd.DataFrame({"arm": ["a", "a", "b"], "x": [1.0, 3.0, 5.0]})
    stats = seed_stats(df, ["x", "not_recorded"])
    assert stats.loc["a", ("x", "mean")] == 2.0 and stats.loc["a", ("x", "std")] == pytest.approx(2 ** 0.5)
    assert mean_std(2.0, 2 ** 0.5, 2, "{:.2f}") == "2.00 ± 1.41"
    assert mean_std(5.0, float("nan"), 1, "{:.2f}") == "5.00"
    assert mean_std(float("nan"), float("nan"), 0) == "n/a"


def test_load_refit(tmp_path):
    assert "presets" in load_refit(REPO / "tests" / "fixtures" / "refit")["bench_refit"]
    with pytest.raises(MissingRunError, match=r"benchmarks/bench_refit.py"):
        load_refit(tmp_path)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        load_refit(tmp_path)


def _arm_cells(text: str) -> dict[str, dict[str, str]]:
    """arm -> column -> cell over every per-arm table of RESULTS.md (the columns are split over three tables)."""
    out: dict[str, dict[str, str]] = {}
    header = None
    for line in text.splitlines():
        if line.startswith("| arm | seeds |"):
            header = [h.strip() for h in line.strip("|").split(" | ")]
        elif header and line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            out.setdefault(cells[0], {}).update(zip(header, cells))
        elif not line.startswith("|"):
            header = None
    return out


def test_write_results_table(tmp_path):
    out = tmp_path / "RESULTS.md"
    proc = _script("write_results.py", str(FIXTURE / EXP), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    sha = (FIXTURE / EXP / "r3" / "seed0" / "git_sha.txt").read_text().strip()
    assert sha in text and "total sweep wall time: 2.3 min" in text
    cells = _arm_cells(text)
    rows = {arm: " | ".join(v.values()) for arm, v in cells.items()}
    assert set(rows) >= {"baseline", "r3", "deepseek_r3"}
    # k3 of r3 (mean over steps, then over seeds) as computed independently from metrics.jsonl
    k3 = []
    for seed in (0, 1):
        rows_ = [json.loads(x) for x in (FIXTURE / EXP / "r3" / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()]
        vals = [r["mismatch/k3"] for r in rows_ if "mismatch/k3" in r]
        k3.append(sum(vals) / len(vals))
    assert f"{sum(k3) / 2:.2e}" in rows["r3"]
    assert " ± " in rows["r3"]


def test_make_figures_writes_every_figure(tmp_path):
    from moerl.analysis.plots import experiment_figures, load_questions

    df, runs_, samples = load_metrics(FIXTURE), load_summaries(FIXTURE), load_token_samples(FIXTURE)
    paths = experiment_figures(df, EXP, tmp_path, runs=runs_, samples=samples)
    names = {p.name for p in paths}
    # one figure per question of experiments/00_tiny_moe_cpu/figures.yaml whose arms and metrics were recorded
    asked = {q.name for q in load_questions(EXP)
             if {"baseline", "r3", "deepseek_r3"} & set(q.arms) and set(q.metrics) & set(df.columns)}
    assert asked and {f"{EXP}_{q}.png" for q in asked} <= names
    assert {f"{EXP}_{k}.png" for k in ("accuracy", "routing_layers", "summary", "is_hist", "is_quantiles",
                                          "logprob_scatter")} <= names
    assert all(p.stat().st_size > 5000 for p in paths)


def _tiny_run(root: Path, arm: str, seed: int, rows: list[dict], summary: dict | None = None,
              loss: dict | None = None, preset: str = "qwen3_moe") -> None:
    run = root / "exp" / arm / f"seed{seed}"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps(summary or {"steps": len(rows)}))
    cfg = {"model": {"preset": preset}, "rollout": {"dtype": "bf16"}, "loss": loss or {"variant": "vanilla"},
           "replay": {"mode": "none"}, "lora": {"expert_mode": "per_expert"}, "refit": {"mode": "adapter"},
           "trainer": {"steps": len(rows)}}
    (run / "config.yaml").write_text(json.dumps(cfg))


def test_renamed_metric_loads_under_its_current_name(tmp_path):
    """reward/group_solved_frac counted groups with mixed rewards; old runs load it as mixed_group_frac."""
    old = [{"step": 1, "reward/mean": 0.5, "reward/group_solved_frac": 0.25}]
    new = [{"step": 1, "reward/mean": 0.5, "reward/mixed_group_frac": 0.75}]
    _tiny_run(tmp_path, "old", 0, old, summary={"mean/reward/group_solved_frac": 0.25})
    _tiny_run(tmp_path, "new", 0, new, summary={"mean/reward/mixed_group_frac": 0.75})
    df = load_metrics(tmp_path, "exp")
    assert "reward/group_solved_frac" not in df
    assert df.set_index("arm")["reward/mixed_group_frac"].to_dict() == {"old": 0.25, "new": 0.75}
    assert load_run(tmp_path, "exp", "old", 0)["reward/mixed_group_frac"].tolist() == [0.25]
    summ = load_summaries(tmp_path, "exp").set_index("arm")
    assert summ["mean/reward/mixed_group_frac"].to_dict() == {"old": 0.25, "new": 0.75}


def test_run_table_k3_median_all_layer_agreement_and_is_level(tmp_path):
    from moerl.analysis.results import family_references, run_statistics

    # k3 with one spike: the run median ignores it, the mean does not.
    rows = [{"step": s, "reward/mean": 0.5, "mismatch/k3": 1.0 if s == 3 else 1e-4,
             "routing/agreement": 0.97, "routing/any_layer_differs": 0.2, "is/p99": 1.5} for s in range(1, 6)]
    _tiny_run(tmp_path, "baseline", 0, rows, summary={"mean/is/p99": 1.5, "mean/routing/agreement": 0.97})
    _tiny_run(tmp_path, "mis", 0, rows, summary={"mean/is/p99": 3.0},
              loss={"variant": "mis", "is_level": "sequence"})
    _tiny_run(tmp_path, "deepseek_baseline", 0, rows, summary={"mean/is/p99": 1.5}, preset="deepseek_v3")
    _tiny_run(tmp_path, "deepseek_r3", 0, [dict(r, **{"mismatch/k3": 1e-5}) for r in rows], preset="deepseek_v3")
    stats = run_statistics(load_metrics(tmp_path, "exp")).set_index("arm")
    assert stats.loc["baseline", "median/mismatch/k3"] == pytest.approx(1e-4)
    assert stats.loc["baseline", "mean/mismatch/k3"] == pytest.approx((1.0 + 4e-4) / 5)
    assert stats.loc["baseline", "mean/routing/all_layers_agree"] == pytest.approx(0.8)  # not the 0.97 over layers
    table = run_table(tmp_path, "exp").set_index("arm")
    assert table.loc["mis", "cfg/is_level"] == "sequence" and table.loc["baseline", "cfg/is_level"] == "token"
    assert family_references(table.reset_index()) == {"baseline": "baseline", "mis": "baseline",
                                                      "deepseek_baseline": "deepseek_baseline",
                                                      "deepseek_r3": "deepseek_baseline"}
    out = tmp_path / "R.md"
    proc = _script("write_results.py", str(tmp_path / "exp"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    cells = _arm_cells(out.read_text())
    col = {name: name for name in next(iter(cells.values()))}
    assert cells["baseline"][col["k3 KL (run median)"]] == "1.00e-04"
    assert cells["baseline"][col["tokens agreeing in all layers"]] == "0.8000"
    assert cells["baseline"][col["routing agreement, mean over layers"]] == "0.9700"
    # token and sequence ratios never share a column
    assert cells["mis"][col["token IS ratio p99"]] == "n/a" and cells["mis"][col["sequence IS ratio p99"]] == "3.000"
    assert cells["baseline"][col["token IS ratio p99"]] == "1.500" and cells["baseline"][col["sequence IS ratio p99"]] == "n/a"
    # a ratio names its denominator: the DeepSeek-V3 arm against the DeepSeek-V3 baseline
    assert cells["deepseek_r3"][col["k3 vs family baseline"]].startswith("0.1× deepseek_baseline")


def test_write_results_keeps_another_scripts_marked_section(tmp_path):
    """Experiment 06's section (written by scripts/geometry_figures.py between its markers) survives a
    regeneration of the rest of RESULTS.md; an unmarked stale section does not."""
    out = tmp_path / "RESULTS.md"
    section = "<!-- experiment 06: begin (scripts/geometry_figures.py) -->\n## 06\nkept\n<!-- experiment 06: end -->"
    out.write_text(f"# Results\nstale text\n\n{section}\n")
    proc = _script("write_results.py", str(FIXTURE / EXP), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text.count(section) == 1 and "stale text" not in text and text.rstrip().endswith(section)


def test_write_results_is_the_same_bytes_on_another_day(tmp_path, monkeypatch):
    """RESULTS.md is tracked: regenerating it from unchanged runs must not rewrite it (no date of writing)."""
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("write_results_script", REPO / "scripts" / "write_results.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.chdir(REPO)
    first, second = tmp_path / "first.md", tmp_path / "second.md"
    script.main([str(FIXTURE / EXP), "--out", str(first)])
    real_strftime = time.strftime
    monkeypatch.setattr(time, "strftime", lambda fmt, t=None: real_strftime(fmt, t or time.gmtime(0)))
    script.main([str(FIXTURE / EXP), "--out", str(second)])
    assert first.read_bytes() == second.read_bytes()
