"""Which reproduction check applies to a re-run, and the statistical one for a CPU of another kind.

The emulated bf16 rollout kernels (``moerl.rollout.emulated``) round at the same points, to the same
formats, on every CPU; the fp32 products they round come from the CPU's own GEMM, whose last bits depend
on its instruction set and blocking, and so do the fp32 trainer's. On the CPU kind that recorded a run a
re-run therefore reproduces it bit for bit; on another kind a bf16 rounding boundary flips a value within
a few steps and the trajectory departs, while its statistics are the same. So:

- same kind (CPU model, bf16/vector ISA flags, torch's CPU capability and oneDNN's ISA cap all equal to the
  recording's ``machine.json``): the **bitwise** check;
- another kind, or a recording that names no machine: the **statistical** check below.

The statistical rule, written before any cross-kind run was judged by it: each summary quantity of the
re-run (``SUMMARY_QUANTITIES``: median k3, mean reward over the first and the second half of the steps,
mean held-out pass@1 over the evaluations after step 0 and the last one, share of tokens routed alike) must
lie inside the 99% prediction interval of the recorded seeds of the same arm,
``mean ± t(0.995, n-1) · sd · sqrt(1 + 1/n)`` (n recorded seeds, sd their sample standard deviation): the
interval a further seed falls in 99 times in 100 if seeds spread normally. Every quantity is computed
over the same steps for the re-run and the seeds. With fewer than two recorded seeds the rule cannot judge.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

# Machine-record fields that decide which GEMM kernels a run's fp32 products went through.
KIND_FIELDS = ("cpu_model", "isa_flags", "torch_cpu_capability", "onednn_max_cpu_isa")

PREDICTION_LEVEL = 0.99


def cpu_kind(machine: dict | None) -> dict | None:
    """The part of a ``machine.json`` record that makes a CPU another kind (None: no record)."""
    if not machine:
        return None
    kind = {k: machine.get(k) for k in KIND_FIELDS}
    if isinstance(kind["isa_flags"], dict):
        kind["isa_flags"] = sorted(f for f, on in kind["isa_flags"].items() if on)
    return kind


def read_machine(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "machine.json").read_text())
    except (FileNotFoundError, ValueError):
        return None


def kind_difference(recorded: dict | None, current: dict | None) -> list[str]:
    """How the current machine's kind differs from the recording's ('field: recorded X, here Y'); a missing
    record is a difference (nothing says the kinds agree)."""
    a, b = cpu_kind(recorded), cpu_kind(current)
    if a is None:
        return ["the recorded run has no machine.json"]
    if b is None:
        return ["the re-run has no machine record"]
    return [f"{k}: recorded {a[k]!r}, here {b[k]!r}" for k in KIND_FIELDS if a[k] != b[k]]


def _train(rows: list[dict], max_step: int | None) -> list[dict]:
    return [r for r in rows if "reward/mean" in r and (max_step is None or int(r["step"]) <= max_step)]


def _evals(rows: list[dict], max_step: int | None) -> list[dict]:
    return [r for r in rows if isinstance(r.get("eval/pass1"), (int, float)) and int(r["step"]) > 0
            and (max_step is None or int(r["step"]) <= max_step)]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(rows: list[dict], max_step: int | None = None) -> dict[str, float | None]:
    """The quantities the statistical check compares (None where the run logged none of it)."""
    train = sorted(_train(rows, max_step), key=lambda r: int(r["step"]))
    half = len(train) // 2
    evals = sorted(_evals(rows, max_step), key=lambda r: int(r["step"]))
    k3 = [r["mismatch/k3"] for r in train if isinstance(r.get("mismatch/k3"), (int, float))]
    routed = [r["routing/agreement"] for r in train if isinstance(r.get("routing/agreement"), (int, float))]
    return {
        "median k3": statistics.median(k3) if k3 else None,
        "reward, first half": _mean([r["reward/mean"] for r in train[:half]]),
        "reward, second half": _mean([r["reward/mean"] for r in train[half:]]),
        "held-out pass@1, mean after step 0": _mean([r["eval/pass1"] for r in evals]),
        "held-out pass@1, last": evals[-1]["eval/pass1"] if evals else None,
        "tokens routed alike": _mean(routed),
    }


SUMMARY_QUANTITIES = tuple(summarize([]))


@dataclass
class Judgement:
    quantity: str
    value: float | None
    low: float | None
    high: float | None
    passed: bool | None  # None: not judged (no data, or fewer than two seeds)
    seeds_with_value: int = 0

    def line(self) -> str:
        if self.passed is None:
            why = ("the re-run logged none over these steps" if self.value is None else
                   f"{self.seeds_with_value} recorded seed(s) logged it over these steps; 2 needed")
            return f"{self.quantity}: not judged ({why})"
        verdict = "inside" if self.passed else "OUTSIDE"
        return f"{self.quantity}: {self.value:.4g} {verdict} the seeds' interval [{self.low:.4g}, {self.high:.4g}]"


def prediction_interval(values: list[float], level: float = PREDICTION_LEVEL) -> tuple[float, float]:
    """Where one more seed falls with probability ``level`` if seeds spread normally (t prediction interval)."""
    from scipy import stats

    n = len(values)
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    half = stats.t.ppf(0.5 + level / 2, n - 1) * sd * math.sqrt(1 + 1 / n)
    return mean - half, mean + half


def judge(rerun: list[dict], seeds: list[list[dict]], max_step: int | None = None) -> list[Judgement]:
    """Each summary quantity of ``rerun`` against the recorded ``seeds``' prediction interval."""
    mine = summarize(rerun, max_step)
    theirs = [summarize(s, max_step) for s in seeds]
    out = []
    for q in SUMMARY_QUANTITIES:
        values = [t[q] for t in theirs if t[q] is not None]
        if mine[q] is None or len(values) < 2:
            out.append(Judgement(q, mine[q], None, None, None, len(values)))
            continue
        low, high = prediction_interval(values)
        out.append(Judgement(q, mine[q], low, high, low <= mine[q] <= high, len(values)))
    return out
