"""The prepared GPU check's report (scripts/gpu_router_replay.py), on what runs without a GPU: the figure
drawn from a fixture report, bad reports refused with one line naming the file and key, and a CUDA request
refused before anything is written where torch sees no CUDA device. The tests themselves on the CPU, end
to end through scripts/gpu_router_replay.sh, are in tests/upstream/test_gpu_router_replay_script.py (the
cluster-pin venv only)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tests_helpers import load_script

grr = load_script("scripts/gpu_router_replay.py", "moerl_gpu_router_replay")


def fixture_report(complete=True) -> dict:
    """A report shaped as `run` writes it: two MoE layers, R3 forward + recompute over two micro-batches, R2."""
    def counts(phase, layer, n, followed, agreed):
        return {"phase": phase, "layer": layer, "replayed_rows": n, "router_followed": followed,
                "native_agreed": agreed}

    r3 = [counts("forward", 1, 10, 10, 1), counts("forward", 2, 10, 10, 0), counts("forward", 1, 16, 16, 2),
          counts("forward", 2, 16, 15, 3), counts("recompute", 2, 10, 10, 0), counts("recompute", 1, 10, 10, 1)]
    return {"schema": grr.SCHEMA, "complete": complete, "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3"},
            "versions": {"torch": "2.11.0+cu130", "megatron-core": "0.19.2", "verl": "0.9.1"},
            "passed": 1, "failed": 1,
            "tests": [{"nodeid": "t.py::test_r3", "outcome": "failed", "properties": {"r3_replay_counts": r3}},
                      {"nodeid": "t.py::test_r2", "outcome": "passed",
                       "properties": {"r2_replay_counts": [counts("replay", 1, 18, 18, 2)]}},
                      {"nodeid": "t.py::test_position", "outcome": "passed", "properties": {}}]}


def test_layer_fractions_sum_each_layers_calls_over_micro_batches():
    bars = dict((label, (followed, agreed)) for label, followed, agreed in
                grr.layer_fractions(fixture_report(), Path("r.json")))
    assert bars["R3 forward\nlayer 2"] == pytest.approx((25 / 26, 3 / 26))  # 10 + 16 rows, one not followed
    assert bars["R3 forward\nlayer 1"] == pytest.approx((1.0, 3 / 26))
    assert bars["R3 recompute\nlayer 1"] == pytest.approx((1.0, 0.1))
    assert bars["R2 replay\nlayer 1"] == pytest.approx((1.0, 2 / 18))
    assert len(bars) == 5


def test_plot_draws_the_figure_beside_the_report(tmp_path):
    report = tmp_path / grr.REPORT
    report.write_text(json.dumps(fixture_report(complete=False)))
    png = grr.plot(report)
    assert png == tmp_path / grr.FIGURE and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.tmp*"))


@pytest.mark.parametrize("damage, named", [
    (lambda r: r.pop("device"), "'device'"),
    (lambda r: r["tests"][0]["properties"]["r3_replay_counts"][0].pop("native_agreed"), "r3_replay_counts"),
    (lambda r: r["tests"][1]["properties"]["r2_replay_counts"][0].update(replayed_rows=0), "r2_replay_counts"),
    (lambda r: [t["properties"].clear() for t in r["tests"]], "no test recorded"),
])
def test_a_report_missing_what_the_figure_needs_is_refused_in_one_line(tmp_path, capsys, damage, named):
    report = fixture_report()
    damage(report)
    path = tmp_path / grr.REPORT
    path.write_text(json.dumps(report))
    with pytest.raises(SystemExit) as stop:
        grr.main(["plot", str(path)])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1
    assert str(path) in err and named in err
    assert not (tmp_path / grr.FIGURE).exists()


def test_an_unreadable_report_is_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / grr.REPORT
    path.write_text("{not json")
    with pytest.raises(SystemExit):
        grr.main(["plot", str(path)])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_a_cuda_run_without_cuda_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        grr.main(["run", "--device", "cuda", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1
    assert "sees no CUDA device" in err and "--device cpu" in err
    assert not out.exists()


def test_an_existing_report_is_never_overwritten(tmp_path, capsys):
    (tmp_path / grr.REPORT).write_text("{}")
    with pytest.raises(SystemExit):
        grr.main(["run", "--device", "cpu", "--out", str(tmp_path)])
    assert "exists" in capsys.readouterr().err and (tmp_path / grr.REPORT).read_text() == "{}"
