"""Time the README's documented commands on this machine and record them for its time table.

    python scripts/time_commands.py [--only NAME,...] [--out results/command_times.json]

Runs each command below from the repository root, one after another, into scratch folders (nothing under
results/ is written but the record), and records its wall time, exit status, the machine's usable cores
and the date. ``scripts/write_readme_numbers.py`` renders the record as the README's time table, so the
table's numbers come from this command, not from a hand. Commands run as a user runs them: with
``.venv/bin/python`` and one thread per run unless the command sets its own.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = ".venv/bin/python"

# name -> (the command as the README shows it, the command run here: {tmp} is a scratch folder)
COMMANDS = {
    "ls": (f"{PY} scripts/ls.py 05", f"{PY} scripts/ls.py 05"),
    "smoke_00": ("experiments/00_tiny_moe_cpu/launch.sh --smoke",
                 "bash experiments/00_tiny_moe_cpu/launch.sh --smoke --out {tmp}"),
    "dry_run_01": ("experiments/01_kimi_k2_lora_grpo/launch.sh --dry-run",
                   "bash experiments/01_kimi_k2_lora_grpo/launch.sh --dry-run"),
    "check_reproducible": (f"{PY} scripts/check_reproducible.py", f"{PY} scripts/check_reproducible.py"),
    "compare_runs": (f"{PY} scripts/compare_runs.py RUN_DIR RUN_DIR",
                     f"{PY} scripts/compare_runs.py results/runs/00_tiny_moe_cpu/baseline/seed0 "
                     "results/runs/00_tiny_moe_cpu/r3/seed0 --out {tmp}/compare.png"),
    "write_readme_numbers": (f"{PY} scripts/write_readme_numbers.py", f"{PY} scripts/write_readme_numbers.py"),
}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def time_one(command: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        started = time.perf_counter()
        proc = subprocess.run(command.format(tmp=tmp), shell=True, cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 1), "exit_status": proc.returncode,
            "last_line": (proc.stdout.strip().splitlines() or proc.stderr.strip().splitlines() or [""])[-1][:200]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help=f"comma-separated (of {', '.join(COMMANDS)}; default all)")
    ap.add_argument("--out", default=str(REPO / "results" / "command_times.json"))
    args = ap.parse_args(argv)
    wanted = [n for n in args.only.split(",") if n] or list(COMMANDS)
    unknown = [n for n in wanted if n not in COMMANDS]
    if unknown:
        raise SystemExit(f"--only {args.only}: unknown command(s) {unknown} (have: {', '.join(COMMANDS)})")
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.exists() else {"commands": {}}
    for i, name in enumerate(wanted, 1):
        shown, command = COMMANDS[name]
        print(f"[time_commands] {i}/{len(wanted)} {shown} ...", flush=True)
        result = time_one(command)
        print(f"[time_commands]   {result['seconds']} s, exit status {result['exit_status']}", flush=True)
        record["commands"][name] = {"command": shown, **result, "cores": usable_cores(),
                                    "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def table(record: dict) -> str:
    """The README's time table from a record (in COMMANDS' order)."""
    rows = [record["commands"][n] for n in COMMANDS if n in record.get("commands", {})]
    lines = ["| command | time |", "|---|---|"]
    for r in rows:
        seconds = r["seconds"]
        shown = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
        failed = "" if r["exit_status"] == 0 else f" (exit {r['exit_status']})"
        lines.append(f"| `{r['command']}` | {shown}{failed} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
