"""One writer per run directory: an exclusive ``flock`` on ``.<run>.lock`` next to the run directory.

The lock file sits beside the run directory, not in it, so it neither makes an empty run look
started nor moves with a run that ``--fresh`` renames aside. The OS releases the lock when the
holding process dies (kill -9 included), so a lock is never stale; the file itself stays and is
reused. The holder writes its PID into the file, which is how a refused run names it.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

_HELD: dict[Path, int] = {}  # run directory -> open file descriptor holding its lock, this process


class RunLockedError(RuntimeError):
    """Another live process writes this run directory."""


def lock_path(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    return run_dir.with_name(f".{run_dir.name}.lock")


def lock_run(run_dir: Path) -> None:
    """Take the run directory's lock for this process (a no-op when it holds it already), or raise
    RunLockedError naming the holder's PID. Creates the parent directories of the run."""
    key = Path(run_dir).resolve()
    if key in _HELD:
        return
    path = lock_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunLockedError(f"{run_dir} is in use by process {holder} (a run or resume of it is live); "
                             f"wait for it to end or stop it, then try again") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD[key] = fd


def unlock_run(run_dir: Path) -> None:
    """Release this process's lock of ``run_dir`` (the OS does it anyway when the process ends)."""
    fd = _HELD.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)
