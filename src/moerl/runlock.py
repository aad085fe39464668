"""One writer per run directory: an exclusive ``flock`` on ``.<run>.lock`` next to the run directory,
and one on the run directory itself once it exists.

The lock file sits beside the run directory, not in it, so it neither makes an empty run look
started nor moves with a run that ``--fresh`` renames aside. The OS releases the lock when the
holding process dies (kill -9 included), so a lock is never stale; the file itself stays and is
reused. The holder writes its PID into the file, which is how a refused run names it.

A file can be deleted under its lock (a cleanup of dot files, ``rm .seed0.lock``): a second process
would then create a new file and lock it. The lock on the directory is what such a cleanup cannot
remove: a second writer that gets the file's lock is still refused by the directory's, and named by
the PID the kernel lists for it (``/proc/locks``).
"""
from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass
class _Held:
    file_fd: int
    dir_fd: int | None = None  # the run directory's lock, once the directory exists


_HELD: dict[Path, _Held] = {}  # run directory -> the locks this process holds on it


class RunLockedError(RuntimeError):
    """Another live process writes this run directory."""


# scripts/run.py's exit status when the run is refused because another live process holds it (EX_TEMPFAIL):
# a sweep reports such a run as busy, not failed, and adds none of its time to the run's.
BUSY_EXIT_CODE = 75


def lock_path(run_dir: Path) -> Path:
    run_dir = Path(run_dir)
    return run_dir.with_name(f".{run_dir.name}.lock")


def _refused(run_dir: Path, holder: str) -> RunLockedError:
    return RunLockedError(f"{run_dir} is in use by process {holder} (a run or resume of it is live); "
                          f"wait for it to end or stop it, then try again")


def _lock_holder(fd: int) -> str:
    """The PID holding a flock on the file open as ``fd``, from /proc/locks (Linux), else 'unknown'."""
    st = os.fstat(fd)
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "unknown"
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(st.st_ino):
            major, minor = parts[5].split(":")[:2]
            if os.makedev(int(major, 16), int(minor, 16)) == st.st_dev and parts[4] != str(os.getpid()):
                return parts[4]
    return "unknown"


def _lock_dir(run_dir: Path, held: _Held) -> None:
    """Lock the run directory itself (again after ``--fresh`` renamed the locked one aside)."""
    if not run_dir.is_dir():
        return
    if held.dir_fd is not None:
        if os.fstat(held.dir_fd).st_ino == os.stat(run_dir).st_ino:
            return
        os.close(held.dir_fd)
        held.dir_fd = None
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fd)
        os.close(fd)
        raise _refused(run_dir, holder) from None
    held.dir_fd = fd


def lock_run(run_dir: Path, create: bool = False) -> None:
    """Take the run directory's lock for this process, or raise RunLockedError naming the holder's PID.
    Creates the parent directories of the run, and the run directory itself when ``create``; the
    directory is locked whenever it exists (calling this again after creating it takes its lock)."""
    key = Path(run_dir).resolve()
    held = _HELD.get(key)
    if held is None:
        path = lock_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise _refused(run_dir, holder) from None
        held = _Held(fd)
        try:
            _lock_dir(key, held)  # the file may be a new one, made after the live run's was deleted
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[key] = held
    if create:
        key.mkdir(parents=True, exist_ok=True)
    _lock_dir(key, held)


def unlock_run(run_dir: Path) -> None:
    """Release this process's locks of ``run_dir`` (the OS does it anyway when the process ends)."""
    held = _HELD.pop(Path(run_dir).resolve(), None)
    if held is not None:
        if held.dir_fd is not None:
            os.close(held.dir_fd)
        os.close(held.file_fd)


def held_fds(run_dir: Path) -> tuple[int, ...]:
    """The descriptors holding this process's locks of ``run_dir``. A child started with them
    (``subprocess`` ``pass_fds``) shares the locks, which then last until the child ends too, even when
    this process dies first."""
    held = _HELD.get(Path(run_dir).resolve())
    if held is None:
        return ()
    return (held.file_fd,) + ((held.dir_fd,) if held.dir_fd is not None else ())


def lock_holder(run_dir: Path) -> str | None:
    """The PID holding ``run_dir``'s lock file, None when it is free. Creates and writes nothing (what a
    dry run may do): a shared lock is tried for a moment on the existing file and given back."""
    path = lock_path(Path(run_dir).resolve())
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)  # closing the descriptor gives back a lock taken on it
    return None
