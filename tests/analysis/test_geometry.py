"""Experiment 06: the geometry presets equal their published configs; the prediction helpers; a smoke run."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moerl.models.geometry import GEOMETRIES, geometry_model_config, public_config, routing_structure
from moerl.models.presets import build_model
from moerl.models.routers import find_moe_layers

# The routing structure the issue cites for each cluster model, restated by hand: the presets must equal
# both this table and the shipped public config.json it was read from.
CITED = {
    "qwen3_30b_a3b": dict(layers=48, dense_layers=0, experts=128, top_k=8, shared_experts=0, groups=1, topk_group=1,
                          scoring="softmax"),
    "moonlight_16b_a3b": dict(layers=27, dense_layers=1, experts=64, top_k=6, shared_experts=2, groups=1,
                              topk_group=1, scoring="sigmoid"),
    "deepseek_v3": dict(layers=61, dense_layers=3, experts=256, top_k=8, shared_experts=1, groups=8, topk_group=4,
                        scoring="sigmoid"),
    "kimi_k2": dict(layers=61, dense_layers=1, experts=384, top_k=8, shared_experts=1, groups=1, topk_group=1,
                    scoring="sigmoid"),
}
# A width small enough that the 61-layer, 384-expert geometry builds in about a second.
TINY = dict(hidden_size=16, moe_intermediate_size=4, num_heads=1, num_kv_heads=1, head_dim=16)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_structure_is_the_cited_one(name):
    s = routing_structure(name)
    assert {k: s[k] for k in CITED[name]} == CITED[name]
    assert "Hugging Face" in s["source"]  # each file names the published config.json it restates


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_preset_builds_the_published_geometry(name, tokenizer):
    cited, pub = CITED[name], public_config(name)
    model = build_model(geometry_model_config(name, **TINY), tokenizer)
    layers = find_moe_layers(model)
    assert model.config.num_hidden_layers == cited["layers"] == pub["num_hidden_layers"]
    assert [m.layer_number for m in layers] == list(range(cited["dense_layers"], cited["layers"]))
    assert {m.num_experts for m in layers} == {cited["experts"]}
    assert {m.top_k for m in layers} == {cited["top_k"]}
    block = layers[0].block
    if cited["scoring"] == "softmax":
        assert model.config.norm_topk_prob is True and not hasattr(block, "shared_experts")
        return
    assert block.n_group == cited["groups"] and block.topk_group == cited["topk_group"]
    assert block.shared_experts.intermediate_size == TINY["moe_intermediate_size"] * cited["shared_experts"]
    assert block.routed_scaling_factor == pub["routed_scaling_factor"]
    assert model.config.q_lora_rank is None if pub["q_lora_rank"] is None else model.config.q_lora_rank is not None


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2"])
def test_sigmoid_scoring_with_correction_bias_and_groups(name, tokenizer):
    """The correction bias steers selection only; DeepSeek-V3's experts come from <= topk_group groups."""
    model = build_model(geometry_model_config(name, **TINY), tokenizer)
    block = find_moe_layers(model)[0].block
    torch.manual_seed(0)
    hidden = torch.randn(64, TINY["hidden_size"])
    logits = block.gate(hidden)
    favoured = 5
    block.gate.e_score_correction_bias[favoured] = 10.0
    index, weights = block.route_tokens_to_experts(logits)
    assert bool((index == favoured).any(-1).all())
    expected = torch.sigmoid(logits).gather(1, index)
    expected = expected / expected.sum(-1, keepdim=True) * block.routed_scaling_factor
    torch.testing.assert_close(weights, expected)
    groups = index // (block.n_routed_experts // block.n_group)
    assert max(len(set(row.tolist())) for row in groups) <= block.topk_group


def test_width_is_the_callers_choice_and_structure_is_not():
    cfg = geometry_model_config("kimi_k2", hidden_size=128)
    assert cfg.hidden_size == 128 and cfg.num_experts == 384
    with pytest.raises(ValueError, match="routing structure"):
        geometry_model_config("kimi_k2", num_experts=8)


def test_independence_prediction():
    from moerl.analysis.routing_geometry import independence_prediction

    assert independence_prediction([0.0, 0.0]) == 0.0
    assert independence_prediction([0.5, 0.5]) == pytest.approx(0.75)
    assert independence_prediction([0.02] * 48) == pytest.approx(1 - 0.98 ** 48)


def test_bootstrap_shares_counts_sequences():
    from moerl.analysis.routing_geometry import bootstrap_shares

    tokens = np.full(40, 10.0)
    any_layer = np.r_[np.full(20, 10.0), np.zeros(20)]  # half the sequences flip everywhere
    per_layer = np.stack([any_layer, np.zeros(40)], 1)
    out = bootstrap_shares(tokens, any_layer, per_layer, resamples=500)
    assert out["share"] == pytest.approx(0.5) and out["independence"] == pytest.approx(0.5)
    assert out["share_lo"] < 0.5 < out["share_hi"] and out["share_hi"] - out["share_lo"] > 0.15


def test_loglinear_fit_recovers_a_power_law():
    from moerl.analysis.routing_geometry import fit_loglinear, predict_loglinear

    x = np.array([8, 16, 32, 48.0])
    fit = fit_loglinear(x, 0.01 * x ** 0.5)
    assert fit["b"] == pytest.approx(0.5) and fit["s"] == pytest.approx(0, abs=1e-9)
    mid, lo, hi = predict_loglinear(fit, 64)
    assert mid == pytest.approx(0.08) and lo == pytest.approx(mid) and hi == pytest.approx(mid)


def test_smoke_pipeline(tmp_path):
    """Two tiny points through the runner: one JSON each, with the item-3 statistics; a rerun skips them."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import measure_geometry

    assert measure_geometry.main(["--smoke", "--out", str(tmp_path)]) == 0
    records = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert set(records) == {"smoke_qwen3", "smoke_kimi"}
    kimi = records["smoke_kimi"]["results"]
    assert set(kimi) == {"bf16", "fp8"}
    r = kimi["bf16"]
    for key in ("all/share", "all/share_lo", "all/share_hi", "all/independence", "native/k3", "r3/k3",
                "native/extreme_gt2", "r3/extreme_gt2"):
        assert np.isfinite(r[key]), key
    assert [int(n) for n in r["p_layer"]] == [1, 2]  # global layer numbers: layer 0 is dense
    assert r["replay_violations"] == 0
    mtime = {p: p.stat().st_mtime for p in tmp_path.glob("*.json")}
    assert measure_geometry.main(["--smoke", "--out", str(tmp_path)]) == 0
    assert {p: p.stat().st_mtime for p in tmp_path.glob("*.json")} == mtime


def test_prediction_moves_the_anchor_along_the_fitted_slopes():
    """p at a new geometry = p_anchor * prod (x / x_anchor)^b; the share follows by independence."""
    import pandas as pd

    from moerl.analysis.geometry_report import predict
    from moerl.analysis.routing_geometry import fit_loglinear

    anchor = pd.Series({"p_mean": 0.02, "p_lo": 0.019, "p_hi": 0.021, "L": 8, "E": 32, "k": 4, "H": 64})
    depth = fit_loglinear([8, 16, 32], [0.02, 0.02 * 2 ** 0.5, 0.04])
    topk = fit_loglinear([2, 4, 8], [0.01, 0.02, 0.04])
    out = predict(anchor, {"depth": depth, "topk": topk}, L=32, E=32, k=8, H=64)
    assert out["p"] == pytest.approx(0.02 * 4 ** 0.5 * 2)
    assert out["share"] == pytest.approx(1 - (1 - out["p"]) ** 32)
    assert out["p_lo"] < out["p"] < out["p_hi"] and out["missing"] == []
    assert predict(anchor, {}, L=8, E=64, k=4, H=64)["missing"] == ["experts"]


def test_extrapolation_interval_respects_the_fits_degrees_of_freedom():
    """Slopes fitted on 3 points have 1 degree of freedom: their t interval is far wider than the z one;
    with many points the two agree."""
    import numpy as np
    import pandas as pd

    from moerl.analysis.geometry_report import predict
    from moerl.analysis.routing_geometry import fit_loglinear

    anchor = pd.Series({"p_mean": 0.02, "p_lo": 0.0199, "p_hi": 0.0201, "L": 8, "E": 32, "k": 4, "H": 64})
    rng = np.random.default_rng(0)
    x3 = np.array([64, 128, 256])
    few = fit_loglinear(x3, 0.02 * (x3 / 64) ** -0.05 * np.exp(rng.normal(0, 0.05, 3)))
    out = predict(anchor, {"width": few}, L=8, E=32, k=4, H=2048)
    z_width, t_width = out["share_hi"] - out["share_lo"], out["share_hi_t"] - out["share_lo_t"]
    assert t_width > 2 * z_width and 0 <= out["share_p94"] <= 1
    x = np.geomspace(64, 256, 200)
    many = fit_loglinear(x, 0.02 * (x / 64) ** -0.05 * np.exp(rng.normal(0, 0.05, 200)))
    out = predict(anchor, {"width": many}, L=8, E=32, k=4, H=2048)
    assert out["share_hi_t"] - out["share_lo_t"] == pytest.approx(out["share_hi"] - out["share_lo"], rel=0.1)


def test_trained_width_points_give_the_trained_anchors_their_width_slope():
    import pandas as pd

    from moerl.analysis.geometry_report import fits, sft_width

    rows = [{"point": "state_qwen3_warm400", "rollout": "bf16", "ladders": ["state"], "H": 64, "p_mean": 0.043,
             "state": "warm", "seed": 0, "family": "qwen3_moe", "L": 48, "E": 128, "k": 8},
            {"point": "state_qwen3_warm400_h128", "rollout": "bf16", "ladders": ["state", "width_sft"], "H": 128,
             "p_mean": 0.040, "state": "warm", "seed": 0, "family": "qwen3_moe", "L": 48, "E": 128, "k": 8}]
    assert sft_width(pd.DataFrame(rows[:1])).empty  # no trained width point yet: no trained slope
    df = pd.DataFrame(rows)
    assert list(sft_width(df).H) == [64, 128]
    assert "width_sft" not in fits(df)  # two of the three registered points: no slope with an error yet
    rows.append({**rows[1], "point": "state_qwen3_warm400_h256", "H": 256, "p_mean": 0.036})
    df = pd.DataFrame(rows)
    assert list(sft_width(df).H) == [64, 128, 256]
    assert fits(df)["width_sft"]["b"] < 0 and fits(df)["width_sft"]["s"] > 0


def test_every_recorded_point_is_finished_under_todays_spec():
    """A config key added later (how the engine decodes, say) must not turn every recorded point into one
    to measure again: the runner would spend hours re-measuring what is recorded."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "scripts"))
    import measure_geometry

    cfg = measure_geometry.load_config(measure_geometry.BASE_CONFIG, [])
    recorded = {p.stem for p in (root / "results" / "geometry").glob("*.json")}
    points = [p for p in measure_geometry.ladder_points() if p.name in recorded]
    assert len(points) >= 20
    stale = [p.name for p in points
             if not measure_geometry.finished(root / "results" / "geometry" / f"{p.name}.json",
                                              measure_geometry.spec(p, 16, cfg))]
    assert stale == []


def test_experiment_05s_share_is_read_from_its_runs_and_a_missing_run_is_named(tmp_path):
    import json

    import pytest

    from moerl.analysis.geometry_claims import experiment_05_share

    for seed, share in ((0, 0.1), (1, 0.2)):
        run = tmp_path / f"seed{seed}"
        run.mkdir()
        rows = [{"step": s, "routing/any_layer_differs": share + (0.02 if s % 2 else -0.02)} for s in range(1, 11)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert experiment_05_share(tmp_path) == pytest.approx(0.15)
    with pytest.raises(FileNotFoundError, match="no recorded run with routing/any_layer_differs"):
        experiment_05_share(tmp_path / "missing")


def test_answer_lines_name_the_largest_independence_gap_and_every_router_state(tmp_path):
    import json
    from pathlib import Path

    from moerl.analysis.geometry_claims import answer_lines, timing_line
    from moerl.analysis.geometry_report import load_points

    root = Path(__file__).resolve().parents[2] / "results" / "geometry"
    df = load_points(root)
    lines = answer_lines(df, exp05=0.155)
    assert any(line.startswith("- router state at experiment 05's geometry: random init") for line in lines)
    assert not any(line.startswith("- GPU") for line in lines)  # no geometry folder given: no GPU line
    # make one random-init point's independence prediction miss by 30 points: the line names it
    row = df.index[(df.point == "depth_L16") & (df.rollout == "bf16")][0]
    df.loc[row, "independence"] = df.loc[row, "share"] + 0.30
    gap = next(line for line in answer_lines(df, exp05=0.155) if line.startswith("- independence"))
    assert "random-init Qwen3-MoE +30.0 points (depth_L16:" in gap
    (tmp_path / "a.json").write_text(json.dumps({"seconds_total": 60.0}))
    (tmp_path / "b.json").write_text(json.dumps({"seconds_total": 3600.0}))
    assert timing_line(tmp_path) == ("Time per CPU point (`seconds_total`, one thread, SFT included): median 1830 s "
                                     "over 2 points; longest `b` 60 min, `a` 1 min.")
