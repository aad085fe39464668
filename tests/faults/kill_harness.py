"""Drive scripts/run.py as a user would, killed with SIGKILL at named points (moerl.faults), and
compare the resumed run with an uninterrupted one: every metric row except wall-clock times, and
the final LoRA weights, optimizer state, sampler position and token samples, bit for bit."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests_helpers import load_script

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "scripts" / "run.py"
ARM = REPO / "experiments" / "00_tiny_moe_cpu" / "arms" / "baseline.yaml"
# Wall-clock measurements: the only logged values allowed to differ between two runs.
TIMING_KEYS = ("time/", "refit/seconds")


run_script = load_script("scripts/run.py", "moerl_run_script")


def fails_with(argv: list[str]) -> str:
    """The one-line message scripts/run.py exits with (SystemExit carrying a string: no traceback)."""
    import pytest

    with pytest.raises(SystemExit) as err:
        run_script.main(argv)
    message = err.value.code
    assert isinstance(message, str) and "\n" not in message and "Traceback" not in message, message
    return message


def overrides(out: Path, steps: int = 4, extra: tuple[str, ...] = ()) -> list[str]:
    """The committed warm start (so rewards are mixed and the LoRA weights move), 8 prompts x 4
    samples, a checkpoint every step (so pruning happens), evaluation every 2 steps."""
    return ["rollout.prompts_per_step=8", "rollout.group_size=4", f"trainer.steps={steps}",
            "trainer.micro_batch_size=16", "trainer.eval_every=2", "trainer.eval_size=16",
            "trainer.checkpoint_every=1", "trainer.samples_every=2", "trainer.samples_per_save=64",
            f"tracking.output_dir={out}", "tracking.wandb_mode=disabled", "tracking.progress_bar=false",
            "threads=1", *extra]


def run_cli(args: list[str], fault: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src"), "WANDB_MODE": "disabled",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("MOERL_FAULT", None)
    if fault:
        env["MOERL_FAULT"] = fault
    return subprocess.run([sys.executable, str(RUN), "--no-progress", str(ARM), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_dir(out: Path, extra: tuple[str, ...] = ()) -> Path:
    from moerl.config import load_config

    return load_config(ARM, overrides(out, extra=extra)).run_dir


def run_with_kills(out: Path, schedule: list[str], extra: tuple[str, ...] = ()) -> list[int]:
    """Start fresh, then --resume after every kill until summary.json exists; returns exit codes."""
    codes, first = [], True
    for fault in [*schedule, None]:
        proc = run_cli([("--fresh" if first else "--resume"), *overrides(out, extra=extra)], fault)
        codes.append(proc.returncode)
        if fault is None or proc.returncode != -signal.SIGKILL:
            assert proc.returncode == 0 or (fault and proc.returncode == -signal.SIGKILL), \
                f"fault {fault}: rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        if (run_dir(out, extra) / "checkpoints").exists():
            first = False
        if (run_dir(out, extra) / "summary.json").exists():
            break
    return codes


def seeded_schedule(seed: int, steps: int, kills: int) -> list[str]:
    """``kills`` fault points drawn with a seeded RNG; the n-th hit counts within one process."""
    rng = random.Random(seed)
    points = ["step", "checkpoint_write", "prune", "after_checkpoint", "final_eval"]
    out = []
    for _ in range(kills):
        point = rng.choice(points)
        n = 1 if point == "final_eval" else rng.randint(1, max(1, steps - 1))
        out.append(f"{point}:{n}")
    return out


def logged_rows(run: Path) -> list[dict]:
    from moerl.tracking import read_metrics

    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in read_metrics(run / "metrics.jsonl")]


def assert_identical_runs(a: Path, b: Path) -> None:
    """Every logged value (wall-clock times aside) and the final state equal, bit for bit."""
    rows_a, rows_b = logged_rows(a), logged_rows(b)
    assert [r["step"] for r in rows_b] == [r["step"] for r in rows_a]
    for ra, rb in zip(rows_a, rows_b):
        diff = {k: (ra.get(k), rb.get(k)) for k in set(ra) | set(rb) if ra.get(k) != rb.get(k)}
        assert not diff, f"step {ra['step']}: {diff}"
    last = sorted((a / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    other = b / "checkpoints" / last.name
    lora_a, lora_b = load_file(last / "lora.safetensors"), load_file(other / "lora.safetensors")
    assert lora_a.keys() == lora_b.keys()
    for name in lora_a:
        assert torch.equal(lora_a[name], lora_b[name]), name
    from moerl.trainer.state_files import load_state

    opt_a, opt_b = load_state(last / "optimizer.safetensors"), load_state(other / "optimizer.safetensors")
    assert opt_a["param_groups"] == opt_b["param_groups"]
    for i, state in opt_a["state"].items():
        for key, value in state.items():
            assert torch.equal(value, opt_b["state"][i][key]), (i, key)
    assert json.loads((last / "state.json").read_text()) == json.loads((other / "state.json").read_text())
    samples_a = sorted(p.name for p in (a / "samples").glob("*.npz"))
    assert samples_a == sorted(p.name for p in (b / "samples").glob("*.npz"))
    import numpy as np

    for name in samples_a:
        with np.load(a / "samples" / name) as x, np.load(b / "samples" / name) as y:
            for key in x.files:
                assert np.array_equal(x[key], y[key], equal_nan=True), (name, key)
    leftovers = [p.name for p in (b / "checkpoints").iterdir()
                 if not (p.name.startswith("step_") and (p / "state.json").exists())]
    assert not leftovers, f"half-written or half-deleted checkpoint directories left: {leftovers}"
