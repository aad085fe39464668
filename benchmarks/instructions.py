"""Instruction counts of marked code regions, measured by valgrind's callgrind.

A 1 % cost cannot be resolved by wall-clock A/B tests on a shared CPU (steps vary by 20 % or more
from one to the next), but the number of instructions a region executes is nearly deterministic and
does not depend on what else runs on the machine. Usage:

    parent:  subprocess.run(callgrind_command(out_prefix) + [sys.executable, "child.py", ...])
    child:   regions = Regions(); regions.start(); ...; regions.mark("a"); ...; regions.stop("b")
    parent:  read_regions(out_prefix) -> [("a", Ir), ("b", Ir)]

Instrumentation is off until ``start`` (set-up and warm-up run at valgrind's uninstrumented speed);
each ``mark(label)`` closes a region: the instructions since the previous mark are filed under
``label``. Outside valgrind the markers do nothing.

Two caveats for a reader of the counts: instructions are not time (a vectorised kernel retires
more work per instruction than the Python interpreter does), and valgrind presents a CPU without
AVX-512, so torch takes its AVX2 kernels under it. Ratios of counts are a cost model, not a timing.
"""
from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

# The client requests of <valgrind/callgrind.h> are inline-assembly sequences: callable from Python
# only through a compiled shim. Without valgrind they are a few no-op instructions.
_SHIM = r"""
#include <valgrind/callgrind.h>
void moerl_cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void moerl_cg_mark(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
void moerl_cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
int moerl_cg_running(void) { return RUNNING_ON_VALGRIND; }
"""


class InstructionCountError(RuntimeError):
    """callgrind, its header or a C compiler is missing, or a measurement produced no counts."""


def available() -> str | None:
    """None when instruction counting can run here, else what is missing."""
    for tool in ("valgrind", "cc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found on PATH"
    if not Path("/usr/include/valgrind/callgrind.h").exists():
        return "valgrind's callgrind.h not found (install valgrind's development headers)"
    return None


def _shim_library() -> Path:
    missing = available()
    if missing:
        raise InstructionCountError(missing)
    digest = hashlib.sha256(_SHIM.encode()).hexdigest()[:12]
    lib = Path(tempfile.gettempdir()) / f"moerl_callgrind_{digest}.so"
    if not lib.exists():
        src = lib.with_suffix(".c")
        src.write_text(_SHIM)
        tmp = lib.with_suffix(".so.tmp")
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src)], check=True)
        tmp.rename(lib)  # atomic: a concurrent build never loads a half-written library
    return lib


class Regions:
    """Markers a process running under ``callgrind_command`` uses to close named regions."""

    def __init__(self):
        self._lib = ctypes.CDLL(str(_shim_library()))
        self.labels: list[str] = []

    @property
    def under_callgrind(self) -> bool:
        return bool(self._lib.moerl_cg_running())

    def start(self) -> None:
        """Switch instrumentation on and zero the counters: nothing before this is counted."""
        self._lib.moerl_cg_start()

    def mark(self, label: str) -> None:
        """Close the current region (everything since ``start`` or the previous mark) as ``label``."""
        if any(c in label for c in "\n\r"):
            raise ValueError(f"region label {label!r}: one line only")
        self.labels.append(label)
        self._lib.moerl_cg_mark(label.encode())

    def stop(self, label: str) -> None:
        """Close the last region as ``label`` and switch instrumentation off."""
        self.mark(label)
        self._lib.moerl_cg_stop()


def callgrind_command(out_prefix: str | Path) -> list[str]:
    """valgrind command line (append the program) writing one count file per region to ``out_prefix.*``."""
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-instr=no", "--compress-strings=no",
            f"--callgrind-out-file={out_prefix}.%p"]


_TRIGGER = "desc: Trigger: Client Request: "


def read_dump(path: str | Path) -> tuple[str, int]:
    """(label, instructions) of one callgrind dump."""
    label, total = None, None
    with open(path) as f:
        for line in f:
            if line.startswith(_TRIGGER):
                label = line[len(_TRIGGER):].strip()
            elif line.startswith("summary: "):
                total = int(line.split()[1])
                break
    if total is None:
        raise InstructionCountError(f"{path}: no 'summary:' line (not a callgrind dump?)")
    return label or "", total


def region_dumps(out_prefix: str | Path) -> list[Path]:
    """The dump files of one callgrind run, in the order the regions closed (``out_prefix.<pid>.<n>``).

    The final dump written at exit (no client request, instrumentation already off) is not one."""
    prefix = Path(out_prefix)
    dumps = []
    for path in prefix.parent.glob(prefix.name + ".*.*"):
        part = path.name.rsplit(".", 1)[1]
        if part.isdigit():
            dumps.append((int(part), path))
    if not dumps:
        raise InstructionCountError(f"no callgrind dumps named {prefix}.<pid>.<n>: did the process mark regions?")
    return [path for _, path in sorted(dumps)]


def read_regions(out_prefix: str | Path) -> list[tuple[str, int]]:
    """The regions one callgrind run dumped, in order: [(label, instructions), ...]."""
    return [read_dump(path) for path in region_dumps(out_prefix)]


def function_costs(path: str | Path) -> dict[str, int]:
    """Self instructions per function (C/C++ symbol) in one callgrind dump: which kernels a region ran.

    Python functions are not visible (they all run inside the interpreter's eval loop)."""
    costs: dict[str, int] = {}
    names: dict[str, str] = {}  # "(id)" -> name, should a dump use compressed names
    current, skip_next = "???", False
    with open(path) as f:
        for line in f:
            first = line[:1]
            if first.isdigit() or first in "+-*":
                if skip_next:  # the inclusive cost of a call: the callee's, not this function's
                    skip_next = False
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    costs[current] = costs.get(current, 0) + int(parts[-1])
            elif line.startswith("calls="):
                skip_next = True
            elif line.startswith(("fn=", "cfn=")):
                value = line.split("=", 1)[1].strip()
                if value.startswith("("):
                    ident, _, name = value.partition(")")
                    name = name.strip()
                    if name:
                        names[ident] = name
                    value = names.get(ident, value)
                if line.startswith("fn="):
                    current = value
    return costs
