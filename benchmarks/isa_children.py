"""Run one benchmark child process per oneDNN ISA cap and collect what each measured.

oneDNN reads ``ONEDNN_MAX_CPU_ISA`` once, when torch first uses it, so a cap (``AVX2``: the kernels of a
CPU without bf16 instructions) can only be applied to a fresh process. A child prints its measurement as
one ``RESULT <json>`` line; every other line it prints is passed through as progress.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

RESULT_PREFIX = "RESULT "


def report(result: dict) -> None:
    """The child's side: print the measurement for the parent to collect."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_per_isa(script: str, isas: str, child_args: list[str], threads: int | None = None) -> list[dict]:
    """Run ``script --child --isa ISA *child_args`` once per comma-separated cap in ``isas``
    (``default`` = no cap) and return the children's results in that order."""
    results = []
    for isa in isas.split(","):
        env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        if isa != "default":
            env["ONEDNN_MAX_CPU_ISA"] = isa
        cmd = [sys.executable, script, "--child", "--isa", isa, *child_args]
        print(f"ONEDNN_MAX_CPU_ISA={isa}: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
        for line in proc.stdout.splitlines():
            if line.startswith(RESULT_PREFIX):
                results.append(json.loads(line[len(RESULT_PREFIX):]))
            else:
                print(line, flush=True)
    return results
