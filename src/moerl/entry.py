"""Run a module's ``main()`` so that a package the interpreter lacks ends in one line, not a traceback.

    python -m moerl.entry moerl.verl_ext.launch experiments/01_kimi_k2_lora_grpo --dry-run

The cluster launchers start this way: they may meet an interpreter (a cluster image's ``python3``) that
imports moerl but lacks torch or verl, and a user should read which package and what to do.
"""
from __future__ import annotations

import importlib
import sys


def run(module: str, argv: list[str]) -> int:
    # Lines as they are printed, also into a pipe or a log (a dry run's report otherwise arrives at the end).
    sys.stdout.reconfigure(line_buffering=True)
    print(f"[{module.rsplit('.', 1)[-1]}] importing verl and the config machinery (seconds to tens of seconds)...",
          file=sys.stderr, flush=True)
    try:
        main = importlib.import_module(module).main
    except ModuleNotFoundError as missing:
        if missing.name and missing.name.split(".")[0] in ("moerl",):
            raise  # moerl's own module: a bug, not the environment
        print(f"error: {sys.executable} lacks the Python package '{missing.name}', which {module} imports; "
              "install the cluster environment (requirements/gpu.txt, docs/cluster.md) or set PYTHON to an "
              "interpreter that has it", file=sys.stderr)
        return 1
    return main(argv)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m moerl.entry MODULE [ARG ...]")
    sys.exit(run(sys.argv[1], sys.argv[2:]))
