"""Instruction counting (instructions) and how bench_replay turns counts into overheads.

The callgrind dump reader and the overhead arithmetic are checked on small hand-written inputs; one
test counts two regions of a real process under valgrind where valgrind is installed.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests_helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import instructions  # noqa: E402  (benchmarks/instructions.py: bench tooling, not part of the library)
from instructions import InstructionCountError, function_costs, read_dump, read_regions  # noqa: E402

DUMP = """# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 42
part: 2

desc: Trigger: Client Request: rollout/capture_hook

positions: line
events: Ir
summary: 1000

ob=(1) /lib/libtorch_cpu.so
fl=(1) ???
fn=(1) at::native::cpublas::gemm_core
0 600
cfn=(2) memcpy
calls=3 0
0 50

fn=(2)
0 50
fn=(3) _PyEval_EvalFrameDefault
0 350
"""


def test_a_dump_gives_its_label_its_total_and_self_cost_per_function(tmp_path):
    path = tmp_path / "cg.42.2"
    path.write_text(DUMP)
    assert read_dump(path) == ("rollout/capture_hook", 1000)
    costs = function_costs(path)
    # The call line's 50 is memcpy's inclusive cost, not gemm's own; compressed names "(2)" resolve.
    assert costs == {"at::native::cpublas::gemm_core": 600, "memcpy": 50, "_PyEval_EvalFrameDefault": 350}
    assert sum(costs.values()) == 1000


def test_regions_are_read_in_the_order_they_closed(tmp_path):
    for part, (label, total) in enumerate([("a", 5), ("b", 7), ("c", 11)] * 4, start=1):
        (tmp_path / f"cg.42.{part}").write_text(
            f"desc: Trigger: Client Request: {label}\nsummary: {total}\n")
    (tmp_path / "cg.42").write_text("summary: 999\n")  # the exit dump is not a region
    regions = read_regions(tmp_path / "cg")
    assert [label for label, _ in regions] == ["a", "b", "c"] * 4  # part 10 after part 9, not after 1
    with pytest.raises(InstructionCountError, match="no callgrind dumps"):
        read_regions(tmp_path / "other")
    (tmp_path / "bad.1.1").write_text("not a dump\n")
    with pytest.raises(InstructionCountError, match="no 'summary:' line"):
        read_dump(tmp_path / "bad.1.1")


def _bench_replay():
    return load_script("benchmarks/bench_replay.py", "_bench_replay")


def _arm(regions: dict, sha: str = "s", matmul: dict | None = None, markers: int = 0) -> dict:
    matmul = matmul or {}
    return {"regions": regions, "matmul_regions": matmul, "marker_instructions": markers,
            "total": sum(regions.values()) - markers, "matmul_total": sum(matmul.values()),
            "rollout_sha": sha, "paired_replay_every": 0}


def test_overheads_are_the_differences_between_arms_without_diagnostics(capsys):
    summarise = _bench_replay().summarise_instructions
    none = _arm({"rollout": 1_000_000, "update": 500_000, "refit": 1_000, "step_other": 100_000})
    cap = _arm({"rollout": 1_004_000, "rollout/capture_hook": 2_000, "update": 500_000, "refit": 1_010,
                "step_other": 100_000, "routing_metrics": 50_000})
    r3 = _arm({"rollout": 1_004_000, "rollout/capture_hook": 2_000, "update": 506_000, "refit": 1_000,
               "step_other": 100_020, "routing_metrics": 50_000, "log": 700}, matmul={"update": 1_000})
    out = summarise({"none_0": none, "capture_0": cap, "r3_0": r3}, "arm.yaml", 1)
    base = none["total"]
    assert out["capture_instructions"] == 6_010  # rollout + hook + refit, not routing_metrics
    assert out["replay_instructions"] == 6_000 - 10 + 20  # update, refit, step_other
    assert out["diagnostics_instructions"] == 50_700
    assert out["resolution_pct"] == pytest.approx(100 * 20 / base)  # the largest same-work spread
    assert out["total_pct"] == pytest.approx(100 * 12_020 / base)
    assert out["target_met"] and out["same_rollout_tokens"]
    assert out["vs_step_without_matmul"]["replay_pct"] == pytest.approx(100 * 5_010 / base)
    # Overhead beyond 2 % of the step fails the target; arms that sampled different tokens are flagged.
    r3_costly = _arm({**r3["regions"], "update": 550_000}, sha="other")
    out = summarise({"none_0": none, "capture_0": cap, "r3_0": r3_costly}, "arm.yaml", 1)
    assert not out["target_met"] and not out["same_rollout_tokens"]
    assert "WARNING: the arms sampled different tokens" in capsys.readouterr().out


@pytest.mark.skipif(instructions.available() is not None, reason=f"{instructions.available()}")
def test_callgrind_counts_two_marked_regions(tmp_path):
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "benchmarks")!r})
        from instructions import Regions
        regions = Regions()
        assert regions.under_callgrind
        regions.start()
        sum(range(20_000))
        regions.mark("short")
        sum(range(200_000))
        regions.stop("long")
    """))
    prefix = tmp_path / "cg"
    subprocess.run(instructions.callgrind_command(prefix) + [sys.executable, str(child)], check=True,
                   capture_output=True, timeout=300)
    (short_label, short), (long_label, long) = read_regions(prefix)
    assert (short_label, long_label) == ("short", "long")
    assert 5 < long / short < 15  # ten times the loop, give or take the markers' own cost


def test_markers_do_nothing_outside_callgrind():
    if instructions.available() is not None:
        pytest.skip(instructions.available())
    regions = instructions.Regions()
    assert not regions.under_callgrind
    regions.start()
    regions.mark("a")
    regions.stop("b")
    assert regions.labels == ["a", "b"]
    with pytest.raises(ValueError, match="one line only"):
        regions.mark("two\nlines")
