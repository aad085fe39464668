"""scripts/gpu_width_geometry.py on the CPU: every part a GPU run uses except the GPU itself (CI has none)."""
from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_width_geometry as gw  # noqa: E402
import measure_geometry  # noqa: E402

CPU_POINTS = ROOT / "tests" / "fixtures" / "geometry_cpu"  # copies of five CPU ladder points


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_width")
    assert gw.main(["--device", "cpu", "--smoke", "--out", str(out), "--cpu-points", str(CPU_POINTS)]) == 0
    return out


def test_smoke_builds_warm_starts_measures_and_draws(smoke_run):
    from moerl.analysis.geometry_report import load_points

    names = sorted(p.name for p in smoke_run.iterdir())
    assert names == ["gpu_smoke_warm3_h32_f16.json", "gpu_smoke_warm3_h64_f16.json", gw.FIGURE, gw.RUN_RECORD]
    rec = json.loads((smoke_run / "gpu_smoke_warm3_h64_f16.json").read_text())
    r = rec["results"]["bf16"]
    assert r["kernels"] == "native" and r["prompts"] == 2 and r["group_size"] == 2
    assert 0 <= r["all/share_lo"] <= r["all/share"] <= r["all/share_hi"] <= 1
    assert set(r["p_layer"]) == {"0", "1"} and "r3/k3" in r and "all/independence" in r
    assert rec["policy"]["warm_start"]["steps"] == 3 and rec["spec"]["warm_start"] == {"steps": 3, "batch_size": 4}
    assert rec["device"]["name"] == "CPU" and rec["device"]["torch"] == torch.__version__
    assert rec["parameters"] > 0 and rec["adamw_bytes_estimate"] == 16 * rec["parameters"]
    assert rec["seconds_total"] >= rec["seconds_policy"] > 0
    assert rec["spec_hash"] == measure_geometry.spec_hash(rec["spec"])
    run = json.loads((smoke_run / gw.RUN_RECORD).read_text())
    assert run["calibration"]["chosen"] == run["sft_steps"] == 3 and run["calibration"]["seconds_per_sft_step_at_widest"] > 0
    assert [p["name"] for p in run["points"]] == ["gpu_smoke_warm3_h64_f16", "gpu_smoke_warm3_h32_f16"]
    assert run["skipped"] == []
    df = load_points(smoke_run, pattern="gpu_*.json")  # the analysis reads GPU points as it reads the CPU's
    assert sorted(df.H) == [32, 64] and set(df.F) == {16} and set(df.device) == {"CPU"}
    assert (smoke_run / gw.FIGURE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_figure_names_the_gpu_and_puts_both_devices_on_one_axis(smoke_run, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from moerl.analysis.geometry_report import figure_gpu_width, load_points

    for path in smoke_run.glob("gpu_*.json"):
        rec = json.loads(path.read_text())
        rec["device"]["name"] = "NVIDIA H100 80GB HBM3"
        (tmp_path / path.name).write_text(json.dumps(rec))
    fig = figure_gpu_width(load_points(CPU_POINTS), load_points(tmp_path, pattern="gpu_*.json"))
    ax = fig.axes[0]
    assert "NVIDIA H100 80GB HBM3" in ax.get_title()
    labels = ax.get_legend_handles_labels()[1]
    gpu_label = next(label for label in labels if label.startswith("NVIDIA H100"))
    assert "3-step SFT" in gpu_label and "expert FFN 16)" in gpu_label
    assert any(label.startswith("CPU, trained routers") for label in labels)
    xs = {float(x) for line in ax.get_lines() for x in line.get_xdata()}
    assert {32.0, 64.0, 128.0, 256.0} <= xs  # GPU smoke widths and the CPU ladder's


def test_figure_only_redraws_from_recorded_points(smoke_run, tmp_path):
    for path in smoke_run.glob("gpu_*.json"):
        shutil.copy(path, tmp_path)
    assert gw.main(["--figure-only", "--out", str(tmp_path), "--cpu-points", str(CPU_POINTS)]) == 0
    assert (tmp_path / gw.FIGURE).exists()
    with pytest.raises(SystemExit, match="no point JSONs"):
        gw.main(["--figure-only", "--out", str(tmp_path / "empty")])


def test_cuda_asked_for_and_absent_is_one_line_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as err:
        gw.main(["--out", str(out)])
    message = str(err.value)
    assert "--device cuda asked for" in message and "no CUDA device" in message and "\n" not in message
    assert not out.exists()


def test_the_full_ladder_is_refused_on_a_cpu(tmp_path):
    with pytest.raises(SystemExit, match="GPU work; on a CPU pass --smoke"):
        gw.main(["--device", "cpu", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_budget_spent_skips_every_point_and_says_why(tmp_path):
    assert gw.main(["--device", "cpu", "--smoke", "--budget-s", "0", "--out", str(tmp_path),
                    "--cpu-points", str(CPU_POINTS)]) == 0
    run = json.loads((tmp_path / gw.RUN_RECORD).read_text())
    assert run["points"] == [] and len(run["skipped"]) == 2
    assert all(s["reason"].startswith("time: needs ~") for s in run["skipped"])
    assert not list(tmp_path.glob("gpu_*.json")) and (tmp_path / gw.FIGURE).exists()


def test_sft_steps_fit_the_budget():
    assert gw.choose_sft_steps(0.05, 4, 480) == 400
    # 0.3 s a step: 4 x (400 x 0.3 x 1.15 + 30) = 672 s and 300 steps 534 s exceed 450; 200 steps take 396
    assert gw.choose_sft_steps(0.3, 4, 450) == 200
    assert gw.choose_sft_steps(5.0, 4, 450) == 100  # nothing fits: the fewest, and the guard skips points


def test_skip_reasons():
    assert gw.skip_reason(10e9, 80e9, 100, 200) is None
    assert gw.skip_reason(60e9, 80e9, 100, 200).startswith("memory: AdamW state 60.0 GB > 70% of 80.0 GB")
    assert gw.skip_reason(10e9, 80e9, 300, 200) == "time: needs ~300 s, 200 s left"
    assert gw.skip_reason(10e9, 80e9, None, -5) is None  # no estimate (a fixed step count): the first point runs


def test_geometry_and_memory_of_the_ladder(tokenizer):
    # the 256 point at cap 128 is the CPU width ladder's own geometry (measure_geometry.qwen3)
    assert gw.model_config(256, gw.expert_ffn(256, 128)) == measure_geometry.qwen3(hidden=256)
    params = {(h, cap): gw.parameter_count(gw.model_config(h, gw.expert_ffn(h, cap)), tokenizer)
              for h, cap in ((2048, 128), (2048, 64), (256, 128))}
    assert 5.3e9 < params[2048, 128] < 5.6e9 and 2.9e9 < params[2048, 64] < 3.1e9 and 0.6e9 < params[256, 128] < 0.63e9
    h100, h200 = 81559 * 2**20, 143771 * 2**20  # the cards' memory as nvidia-smi reports it
    assert gw.fit_ffn_cap(gw.WIDTHS, h200, tokenizer) == 128  # 87 GB of AdamW state in 70 % of 151 GB
    assert gw.fit_ffn_cap(gw.WIDTHS, h100, tokenizer) == 64  # 48 GB in 70 % of 86 GB


def test_device_wheels_are_the_repositorys_pins():
    wheels = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([0-9][\w.]*)", (ROOT / "requirements/device.txt").read_text(),
                             re.M))
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([0-9][\w.]*)", (ROOT / "requirements/cpu.txt").read_text(), re.M))
    cluster = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([0-9][\w.]*)", (ROOT / "requirements/gpu.txt").read_text(),
                              re.M))
    # megatron-core travels at the cluster's pin (the router-replay check), not the CPU suite's
    assert wheels["megatron-core"] == cluster["megatron-core"]
    shared = {name for name in wheels if name in pins} - {"megatron-core"}
    assert {"transformers", "peft", "omegaconf", "math-verify"} <= shared
    assert {name: wheels[name] for name in shared} == {name: pins[name] for name in shared}


@pytest.mark.parametrize("args, expected", [
    (["--widths", "2048,300"], "300 is not a multiple of 64"),
    (["--expert-ffn-cap", "12"], "--expert-ffn-cap 12: expected a multiple of 8"),
    (["--sft-steps", "0"], "--sft-steps 0: expected a positive number"),
    (["--widths", "big"], "--widths / --expert-ffn-cap / --sft-steps"),
])
def test_bad_options_are_one_line_before_anything_is_written(tmp_path, args, expected):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as err:
        gw.main(["--out", str(out), *args])
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert not out.exists()


def test_a_point_out_of_memory_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    real = gw.run_point

    def first_runs_out(name, *args, **kwargs):
        if "_h64_" in name:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(gw, "run_point", first_runs_out)
    assert gw.main(["--device", "cpu", "--smoke", "--sft-steps", "2", "--out", str(tmp_path),
                    "--cpu-points", str(CPU_POINTS)]) == 0
    run = json.loads((tmp_path / gw.RUN_RECORD).read_text())
    assert run["skipped"] == [{"name": "gpu_smoke_warm2_h64_f16",
                               "reason": "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB"}]
    assert [p["name"] for p in run["points"]] == ["gpu_smoke_warm2_h32_f16"] and "calibration" not in run


def test_the_report_table_puts_the_recorded_gpu_points_beside_the_cpus_trained_ladder(tmp_path):
    """RESULTS.md and the 06 README read the GPU points through one table: the CPU's trained width ladder
    first, then the GPU's points as one width ladder per SFT length; the real-width line compares the
    widest point with the CPU's SFT length (400); one line per GPU run; no GPU folder is one line."""
    from moerl.analysis.geometry_claims import gpu_width_lines
    lines = gpu_width_lines(ROOT / "results" / "geometry")
    rows = [line for line in lines if line.startswith("| `")]
    names = [row.split("`")[1] for row in rows]
    assert names[:4] == ["state_qwen3_warm400", "state_qwen3_warm400_h128", "state_qwen3_warm400_h256",
                         "gpu_qwen3_warm100_h256_f128"]
    assert names[6:] == ["gpu_qwen3_warm100_h2048_f128", "gpu_qwen3_warm400_h256_f128", "gpu_qwen3_warm400_h2048_f128"]
    recorded = json.loads((ROOT / "results/geometry/gpu/gpu_qwen3_warm400_h2048_f128.json").read_text())
    share = recorded["results"]["bf16"]["all/share"]
    assert f"| {share:.1%} [" in rows[-1] and f"| NVIDIA H200, native | 2048 | 128 | 400 | {recorded['policy']['warm_start']['test_accuracy']['pass1']:.3f} |" in rows[-1]
    assert "| CPU, emulated | 256 | 128 | 400 | 0.074 |" in rows[2]
    calls = [line for line in lines if line.startswith("GPU run `")]
    assert [c.split("`")[1] for c in calls] == ["run_warm100.json", "run_warm400_h2048.json", "run_warm400_h256.json"]
    assert "chosen by the time guard" in calls[0] and "set by --sft-steps" in calls[1]
    verdict = [line for line in lines if line.startswith("At Qwen3-30B-A3B's real width (hidden 2048)")]
    assert len(verdict) == 1
    assert f"the GPU measured {100 * share:.1f} % [" in verdict[0] and "`gpu_qwen3_warm400_h2048_f128`" in verdict[0]
    cpu256 = json.loads((ROOT / "results/geometry/state_qwen3_warm400_h256.json").read_text())["results"]["bf16"]
    gpu256 = json.loads((ROOT / "results/geometry/gpu/gpu_qwen3_warm400_h256_f128.json").read_text())["results"]["bf16"]
    same = [line for line in lines if line.startswith("- Same geometry and SFT length on both devices (hidden 256")]
    assert len(same) == 1 and f"{100 * (gpu256['all/share'] - cpu256['all/share']):+.1f} points" in same[0]
    disjoint = gpu256["all/share_hi"] < cpu256["all/share_lo"] or cpu256["all/share_hi"] < gpu256["all/share_lo"]
    assert ("disjoint" if disjoint else "overlap") in same[0]
    empty = tmp_path / "geometry"
    (empty / "gpu").mkdir(parents=True)
    assert gpu_width_lines(empty) == [f"No GPU point is recorded under `{empty / 'gpu'}` "
                                         "(scripts/gpu_width_geometry.py writes them)."]


def test_another_sft_seed_is_named_recorded_and_drawn_apart(tmp_path):
    """--sft-seed: the same SFT from other initial weights and batch order (the spread between SFTs); its
    points carry the seed in their name and record, and the figure draws them apart from the ladder."""
    import matplotlib

    matplotlib.use("Agg")
    from moerl.analysis.geometry_report import figure_gpu_width, gpu_reference_point, load_points

    assert gw.main(["--device", "cpu", "--smoke", "--sft-steps", "2", "--sft-seed", "3", "--out", str(tmp_path),
                    "--cpu-points", str(CPU_POINTS)]) == 0
    run = json.loads((tmp_path / gw.RUN_RECORD).read_text())
    assert run["sft_seed"] == 3
    assert [p["name"] for p in run["points"]] == ["gpu_smoke_warm2_h64_f16_sft3", "gpu_smoke_warm2_h32_f16_sft3"]
    rec = json.loads((tmp_path / "gpu_smoke_warm2_h64_f16_sft3.json").read_text())
    assert rec["policy"]["warm_start"]["init_seed"] == 3 and "(SFT seed 3)" in rec["spec"]["note"]
    points = load_points(tmp_path, pattern="gpu_*.json")
    assert set(points.sft_seed) == {3}
    assert gpu_reference_point(points).point == "gpu_smoke_warm2_h64_f16_sft3"  # no data-seed point: the widest
    labels = figure_gpu_width(load_points(CPU_POINTS), points).axes[0].get_legend_handles_labels()[1]
    assert any("from other seeds (3): the spread between SFTs" in label for label in labels)
    with pytest.raises(SystemExit, match="--sft-seed -1: expected a seed >= 0"):
        gw.main(["--device", "cpu", "--smoke", "--sft-seed", "-1", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()


def test_the_report_reads_another_sft_seed_as_the_spread_between_sfts(tmp_path):
    """A point of another SFT seed stays out of the width ladder and the reference point; the report names
    its seed and states how far the SFTs at one width are apart."""
    from moerl.analysis.geometry_claims import gpu_width_lines
    geometry = tmp_path / "geometry"
    (geometry / "gpu").mkdir(parents=True)
    for path in (ROOT / "results" / "geometry").glob("*.json"):
        shutil.copy(path, geometry)
    for path in (ROOT / "results" / "geometry" / "gpu").glob("*.json"):
        shutil.copy(path, geometry / "gpu")
    rec = json.loads((geometry / "gpu" / "gpu_qwen3_warm400_h256_f128.json").read_text())
    first = rec["results"]["bf16"]["all/share"]
    rec["spec"]["name"] = "gpu_qwen3_warm400_h256_f128_sft1"
    rec["policy"]["warm_start"]["init_seed"] = 1
    for key in ("all/share", "all/share_lo", "all/share_hi"):
        rec["results"]["bf16"][key] -= 0.05
    (geometry / "gpu" / "gpu_qwen3_warm400_h256_f128_sft1.json").write_text(json.dumps(rec))
    lines = gpu_width_lines(geometry)
    row = next(line for line in lines if line.startswith("| `gpu_qwen3_warm400_h256_f128_sft1`"))
    assert "| 400 (seed 1) |" in row
    between = [line for line in lines if line.startswith("- Between SFTs on the GPU (hidden 256, 400 steps")]
    assert len(between) == 1 and "(data seed, SFT pass@1" in between[0] and "(seed 1, SFT pass@1" in between[0]
    assert between[0].endswith(f": {100 * 0.05:.1f} points apart.") and f"{100 * first:.1f} %" in between[0]
    ladder = [line for line in lines if line.startswith("- 400-step SFT on the GPU: ")]
    assert len(ladder) == 1 and ladder[0].count("at hidden 256") == 1  # the ladder keeps the data seed's point
    assert any("`gpu_qwen3_warm400_h2048_f128`" in line for line in lines if line.startswith("At Qwen3-30B-A3B"))
