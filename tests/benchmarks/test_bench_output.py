"""Benchmarks write under runs/bench/ unless --record, like the experiments; every benchmark takes both."""
from __future__ import annotations

import argparse
import re

import pytest

from moerl.bench_output import REPO, add_output_args, output_dir


def _parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_output_args(ap, "results/refit")
    return ap.parse_args(list(argv))


def test_default_is_runs_bench_and_only_record_writes_results(tmp_path):
    assert output_dir(_parse()) == REPO / "runs" / "bench" / "refit"
    assert output_dir(_parse("--record")) == REPO / "results" / "refit"
    assert output_dir(_parse("--out", str(tmp_path))) == tmp_path
    with pytest.raises(SystemExit, match="--record .* does not combine with --out"):
        output_dir(_parse("--record", "--out", str(tmp_path)))


@pytest.mark.parametrize("script", sorted(p.name for p in (REPO / "benchmarks").glob("bench_*.py")))
def test_every_benchmark_defaults_outside_results(script):
    """No benchmark's --out defaults into results/ (a quick look once replaced the recorded JSON and PNG)."""
    text = (REPO / "benchmarks" / script).read_text()
    assert "add_output_args(ap, " in text and "output_dir(args)" in text
    assert not re.search(r'add_argument\("--out", default=[^)]*results', text)
    assert not re.search(r'^OUT = Path\("results', text, re.M)
