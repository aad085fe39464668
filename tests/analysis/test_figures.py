"""Figures answer one question each, arms keep their colour everywhere, and what a figure marks
(correction thresholds, ratios to the baseline) is computed from the runs and their configs."""
from __future__ import annotations

import matplotlib.colors as mcolors
import numpy as np
import pandas as pd
import pytest

from moerl.analysis import figure_style, plots, refit_plots, sample_plots
from moerl.analysis.results import MissingRunError, select_arms


def _frame(arms, seeds=(0, 1), steps=5):
    rows = []
    for a, arm in enumerate(arms):
        for seed in seeds:
            for step in range(1, steps + 1):
                rows.append({"experiment": "x", "arm": arm, "seed": seed, "step": step,
                             "reward/mean": 0.1 * a + 0.01 * step, "mismatch/k3": 1e-4 * (a + 1)})
    return pd.DataFrame(rows)


def _line_colors(fig) -> dict[str, tuple]:
    return {line.get_label(): mcolors.to_rgba(line.get_color()) for ax in fig.axes for line in ax.get_lines()
            if not line.get_label().startswith("_")}


def test_an_arm_keeps_its_colour_whatever_else_is_drawn():
    one = plots.curves(_frame(["baseline", "r3"]), [("mismatch/k3", "k3")], "a")
    two = plots.curves(_frame(["tis", "r3", "zz_new_arm"]), [("mismatch/k3", "k3")], "b")
    assert _line_colors(one)["r3"] == _line_colors(two)["r3"] == mcolors.to_rgba(figure_style.ARM_COLORS["r3"])
    # an arm without a fixed colour still gets the same one every time
    assert figure_style.arm_color("zz_new_arm") == figure_style.arm_color("zz_new_arm")
    assert _line_colors(two)["zz_new_arm"] == mcolors.to_rgba(figure_style.arm_color("zz_new_arm"))
    # the legend sits outside the axes (a figure legend, not one per panel)
    assert one.legends and not any(ax.get_legend() for ax in one.axes)


def test_questions_file_is_checked(tmp_path):
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "figures.yaml").write_text("questions:\n  - name: q\n    arms: [a]\n")
    with pytest.raises(ValueError, match=r"figures.yaml: questions\[0\] lacks \['title'\]"):
        plots.load_questions("exp", tmp_path)
    assert plots.load_questions("absent", tmp_path) == []
    qs = plots.load_questions("00_tiny_moe_cpu")
    arms = {a for q in qs for a in q.arms}
    assert {"baseline", "r3", "tis", "deepseek_r3"} <= arms and all(q.title.endswith("?") or "?" in q.title for q in qs)


def test_question_figure_draws_only_its_arms():
    q = plots.Question("replay", "Does replay help?", ["baseline", "r3"], ["mismatch/k3", "reward/mean"])
    fig = plots.question_figure(_frame(["baseline", "r3", "tis"]), q)
    assert set(_line_colors(fig)) == {"baseline", "r3"} and len(fig.axes) == 2
    with pytest.raises(KeyError, match="none of its metrics"):
        plots.question_figure(_frame(["baseline"]), plots.Question("n", "t?", ["baseline"], ["grad_norm"]))


def test_k3_ratio_to_baseline_is_paired_by_seed():
    runs = pd.DataFrame({"arm": ["baseline", "baseline", "r3", "r3"], "seed": [0, 1, 0, 1],
                         "mean/mismatch/k3": [2e-4, 4e-4, 1e-4, 1e-4]})
    ratio = plots._paired_ratio(runs, "mean/mismatch/k3", "baseline")
    assert ratio.loc["r3", "mean"] == pytest.approx((0.5 + 0.25) / 2)
    assert (ratio.loc["r3", "lo"], ratio.loc["r3", "hi"]) == pytest.approx((0.25, 0.5))
    assert ratio.loc["baseline", "mean"] == 1.0


def test_correction_marks_follow_each_arms_config():
    assert sample_plots.correction_marks({"variant": "tis", "tis_cap": 3.0})[0][:3] == ("cap", 3.0, None)
    assert sample_plots.correction_marks({"variant": "icepop", "icepop_alpha": 0.5, "icepop_beta": 5.0})[0][:3] == \
        ("band", 0.5, 5.0)
    kind, lo, hi, label = sample_plots.correction_marks({"variant": "mis", "mis_lower": 0.97, "mis_upper": 1.03,
                                                   "is_level": "geometric"})[0]
    assert (kind, lo, hi) == ("band", 0.97, 1.03) and "geometric" in label
    assert sample_plots.correction_marks({"variant": "ppo_clip"}) == [] and sample_plots.correction_marks(None) == []
    samples = pd.DataFrame({"arm": ["tis"] * 50 + ["baseline"] * 50, "raw_ratio": np.linspace(0.5, 2.5, 100)})
    fig = sample_plots.ratio_histograms(samples, losses={"tis": {"variant": "tis", "tis_cap": 2.0}})
    tis_ax = next(ax for ax in fig.axes if ax.get_title().startswith("tis"))
    assert any(list(line.get_xdata()) == [2.0, 2.0] for line in tis_ax.get_lines())


def test_select_arms_names_what_is_missing():
    df = _frame(["baseline", "r3"])
    assert set(select_arms(df, "r3")["arm"]) == {"r3"} and len(select_arms(df, "")) == len(df)
    with pytest.raises(MissingRunError, match=r"\['nope'\] not recorded \(have: \['baseline', 'r3'\]\)"):
        select_arms(df, ["r3", "nope"])


def test_reward_panel_marks_each_collapse_step():
    df = _frame(["baseline", "r3"], seeds=(0, 1), steps=60)
    collapsed = (df["arm"] == "baseline") & (df["seed"] == 1)
    df.loc[collapsed & (df["step"] > 30), "reward/mean"] = 0.0  # learned, then lost it
    df.loc[collapsed & (df["step"] <= 30), "reward/mean"] = 0.9
    fig = plots.curves(df, [("reward/mean", "reward")], "t", smooth=1)
    marks = [line for line in fig.axes[0].get_lines() if line.get_label() == "collapse step"]
    assert len(marks) == 1 and marks[0].get_xdata()[0] == 40  # the 20-step mean reaches half the peak ~10 steps after the drop
    assert mcolors.to_rgba(marks[0].get_color()) == mcolors.to_rgba(figure_style.arm_color("baseline"))


def test_tau_curve_and_its_question_kind(tmp_path):
    df = _frame(["baseline", "r3"])
    for tau, share in ((1.5, 1e-2), (2.0, 1e-3), (10.0, 0.0)):
        df[f"mismatch/extreme_gt{tau:g}"] = np.where(df["arm"] == "baseline", share, share / 10)
    fig = plots.question_figure(df, plots.Question("x", "F?", ["baseline", "r3"], kind="tau_curve"))
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert list(lines["baseline"].get_xdata()) == [1.5, 2.0, 10.0]
    assert np.allclose(lines["r3"].get_ydata(), [1e-3, 1e-4, 0.0])
    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "figures.yaml").write_text("questions:\n  - {name: q, title: t, arms: [a], kind: histo}\n")
    with pytest.raises(ValueError, match=r"questions\[0\].kind is 'histo'"):
        plots.load_questions("exp", tmp_path)


def _family_runs():
    # deepseek_r3 has 0.5x its own baseline's k3 but 2x Qwen's baseline: the figure must say 0.5x.
    rows = []
    for seed in (0, 1):
        for arm, preset, k3 in (("baseline", "qwen3_moe", 1e-4), ("r3", "qwen3_moe", 5e-5),
                                ("deepseek_baseline", "deepseek_v3", 4e-4), ("deepseek_r3", "deepseek_v3", 2e-4)):
            rows.append({"experiment": "x", "arm": arm, "seed": seed, "cfg/preset": preset,
                         "median/mismatch/k3": k3, "mean/routing/agreement": 0.97})
    return pd.DataFrame(rows)


def test_summary_divides_each_arm_by_its_own_family_baseline():
    fig = plots.summary_figure(_family_runs(), "t", k3_key="median/mismatch/k3")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "0.5×" in texts and "2×" not in texts
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert "deepseek_v3 preset: k3 ÷ deepseek_baseline" in ticks  # the denominator is named


def test_relative_k3_notes_the_fp32_floor_and_collapse_draws_its_threshold():
    df = _frame(["baseline", "r3", "fp32_rollout"], steps=30)
    df.loc[df["arm"] == "fp32_rollout", "mismatch/k3"] = 1e-14
    refs = {"baseline": "baseline", "r3": "baseline", "fp32_rollout": "baseline"}
    fig = plots.relative_curves(df, "mismatch/k3", [{"title": "p", "arms": ["r3", "fp32_rollout"]}], refs, "t", smooth=3)
    labels = [line.get_label() for line in fig.axes[0].get_lines() if len(line.get_xdata())]  # drawn lines
    assert "r3 / baseline: 2× (median over steps)" in labels and not any("fp32" in lab for lab in labels)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]  # the floor is a note in the legend
    assert any("fp32_rollout" in t and "numerical floor" in t for t in legend)
    assert np.allclose(fig.axes[0].get_lines()[0].get_ydata(), 2.0)  # r3's k3 is 2x baseline's in _frame
    fig = plots.collapse_figure(df, [{"title": "p", "arms": ["baseline"]}], "t")
    dotted = [line for line in fig.axes[0].get_lines() if line.get_linestyle() == ":"]
    assert len(dotted) == 1  # the threshold: half the running peak of the 20-step mean
    smoothed = fig.axes[0].get_lines()[0].get_ydata()
    assert np.allclose(dotted[0].get_ydata()[19:], 0.5 * np.fmax.accumulate(smoothed[19:]))


def test_zeros_stay_on_a_log_panel_and_an_outlier_arm_does_not_set_the_scale():
    df = _frame(["baseline", "r3"], steps=10)
    df["mismatch/extreme_frac"] = np.where(df["step"] % 2, 0.0, 1e-3)
    fig = plots.curves(df, [("mismatch/extreme_frac", "x")], "t", log_keys=("mismatch/extreme_frac",))
    assert fig.axes[0].get_yscale() == "symlog" and fig.axes[0].get_ylim()[0] == 0
    assert figure_style.outlier_keys({"a": 1.0, "b": 1.2, "bug": 900.0}) == {"bug"}
    assert figure_style.outlier_keys({"a": 1.0, "b": 1.2, "c": 2.0}) == set()


def test_a_run_with_overrides_takes_its_base_arms_colour_and_its_rung_a_line_style():
    fp8, nvfp4 = "geo_mis_0p1pct+rollout.dtype=fp8", "geo_mis_0p1pct+rollout.dtype=nvfp4"
    assert figure_style.base_arm(fp8) == "geo_mis_0p1pct" and figure_style.run_variant(fp8) == "rollout.dtype=fp8"
    assert figure_style.arm_color(fp8) == figure_style.arm_color(nvfp4) == figure_style.ARM_COLORS["geo_mis_0p1pct"]
    assert figure_style.arm_color("r3_tis+rollout.dtype=fp8") == figure_style.ARM_COLORS["r3_tis"] != figure_style.ARM_COLORS["r3"]
    assert figure_style.arm_color("fp32_control") == figure_style.arm_color("fp32_rollout")
    assert figure_style.arm_color("tis_cap3") == figure_style.ARM_COLORS["tis"]  # a name extending a known arm keeps its hue
    # the MIS arms, named for their estimator and band, keep the hue their former name had
    assert {figure_style.arm_color(a) for a in ("geo_mis_3pct", "seq_mis", "geo_mis_0p1pct", "mis")} == {figure_style.arm_color("mis")}
    # the rung is told apart by line style and marker, the same rung alike in every arm
    assert figure_style.arm_style(fp8)["ls"] != figure_style.arm_style(nvfp4)["ls"]
    assert figure_style.arm_style(fp8)["marker"] != figure_style.arm_style(nvfp4)["marker"]
    assert figure_style.arm_style("baseline+rollout.dtype=fp8")["ls"] == figure_style.arm_style(fp8)["ls"]
    assert figure_style.arm_style("geo_mis_0p1pct")["ls"] == "-"
    assert figure_style.arm_style("geo_mis_0p1pct+rollout.dtype-fp8") == figure_style.arm_style(fp8)  # the newer spelling of the name
    fig = plots.curves(_frame([fp8, nvfp4, "baseline"]), [("mismatch/k3", "k3")], "t")
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert mcolors.to_rgba(lines[fp8].get_color()) == mcolors.to_rgba(lines[nvfp4].get_color()) \
        == mcolors.to_rgba(figure_style.ARM_COLORS["geo_mis_0p1pct"])
    assert lines[fp8].get_linestyle() != lines[nvfp4].get_linestyle()


def test_histogram_axis_holds_every_cap_and_band_and_a_sequence_ratio_gets_its_own_range():
    rng = np.random.default_rng(0)
    token = np.exp(rng.normal(0, 0.05, 2000))
    samples = pd.DataFrame({"arm": ["icepop"] * 2000 + ["mis"] * 2000, "raw_ratio": np.r_[token, token ** 0.2],
                            "seed": 0, "step": 1, "sample": np.r_[np.arange(2000), np.arange(2000)]})
    losses = {"icepop": {"variant": "icepop", "icepop_alpha": 0.5, "icepop_beta": 5.0},
              "mis": {"variant": "mis", "mis_lower": 0.97, "mis_upper": 1.03, "is_level": "geometric"}}
    fig = sample_plots.ratio_histograms(samples, losses=losses)
    icepop = next(ax for ax in fig.axes if ax.get_title().startswith("icepop"))
    mis = next(ax for ax in fig.axes if ax.get_title().startswith("mis"))
    lo, hi = icepop.get_xlim()
    assert lo < 0.5 and hi > 5.0  # IcePop's upper bound is on the plot
    lo, hi = mis.get_xlim()
    assert 0.9 < lo < 0.97 and 1.03 < hi < 1.1  # the narrow MIS band fills a visible part of its own axis


def test_spread_figure_names_an_arm_at_the_floor_instead_of_stretching_the_axis():
    rng = np.random.default_rng(0)
    rows = []
    for arm, scale in (("baseline", 0.05), ("r3", 0.04), ("fp32_rollout", 1e-9)):
        for step in (10, 20, 30, 40, 50, 60):
            d = rng.normal(0, scale * (1 + step / 60), 500)
            rows.append(pd.DataFrame({"arm": arm, "step": step, "token_ratio": np.exp(d)}))
    fig = sample_plots.spread_over_training(pd.concat(rows), "token_ratio", arms=["fp32_rollout", "baseline", "r3"])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["baseline", "r3"]
    assert ax.get_xlim()[0] > 1e-3 and "fp32_rollout" in fig.texts[-1].get_text()
    growth = [t.get_text() for t in ax.texts]
    assert all(t.startswith("×1.") or t.startswith("×2") for t in growth)  # the spread was made to grow ~1.8x


def test_shares_and_difference_figures_draw_what_the_runs_hold():
    df = _frame(["fp32_rollout", "baseline", "tis"], steps=10)
    df["is/truncated_frac"] = np.where(df["arm"] == "tis", 0.02, 0.0)
    fig = plots.shares_figure(df, ["baseline", "tis"], ["is/truncated_frac"], "t?")
    assert {t.get_text() for t in fig.axes[0].texts} == {"0 %", "2 %"}
    fig = plots.difference_curves(df, "reward/mean", ["baseline", "tis"], "fp32_rollout", "t?", smooth=1)
    (ax,) = fig.axes
    lines = {line.get_label(): line.get_ydata() for line in ax.get_lines()}
    # _frame: reward = 0.1 * (arm index) + 0.01 * step, so tis - fp32 = 0.2 and baseline - fp32 = 0.1 at every step
    assert np.allclose(lines["tis − fp32_rollout"], 0.2) and np.allclose(lines["baseline − fp32_rollout"], 0.1)
    with pytest.raises(KeyError, match="reference arm 'nope'"):
        plots.difference_curves(df, "reward/mean", ["tis"], "nope", "t?")


def test_refit_figures_ask_one_question_each():
    bench = {"presets": [{"preset": "default", "base_params": 1.8e6, "speedup_adapter_vs_merged": 9.4, "bytes_ratio": 9.4,
                          "adapter": {"seconds_median": 0.002, "bytes": 4e5}, "merged": {"seconds_median": 0.017, "bytes": 3.6e6}}],
             "drift": {"adapter": [0.0017, 0.0018], "merged": [0.0024, 0.011]},
             "analytic": {"Kimi-K2 (1T)": {"full_bf16_bytes": 2e12, "r32_shared_bytes": 4e8}}}
    figs = refit_plots.refit_figures(bench)
    assert set(figs) == {"cost", "drift", "at_scale"}
    assert all("?" in (f._suptitle.get_text() if f._suptitle else f.axes[0].get_title()) for f in figs.values())
    legend = [t.get_text() for t in figs["drift"].axes[0].get_legend().get_texts()]
    assert any(t.startswith("adapter-only") for t in legend) and any(t.startswith("merged") for t in legend)
    assert refit_plots.refit_figures({"presets": bench["presets"]}).keys() == {"cost"}
