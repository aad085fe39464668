"""Fault injection for the kill -9 tests: ``MOERL_FAULT=<point>:<n>`` SIGKILLs this process the
n-th time (1-based) the trainer passes the named point. Unset (always, outside tests), ``hit`` is
a dictionary lookup that returns at once.

Points: ``step`` (after a step's updates, before its refit and row), ``checkpoint_write`` (a
checkpoint's files half written), ``prune`` (an old checkpoint half deleted), ``after_checkpoint``
(a checkpoint just completed), ``final_eval`` (the final evaluation row logged, no summary yet),
``truncate`` (a resume's metrics.jsonl.bak written, the kept rows not yet), ``warm_start_progress`` (a
warm start's SFT progress just saved).
"""
from __future__ import annotations

import os
import signal

POINTS = ("step", "checkpoint_write", "prune", "after_checkpoint", "final_eval", "truncate", "warm_start_progress")


def _parse(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, count = spec.partition(":")
    if name not in POINTS or not count.isdigit() or int(count) < 1:
        raise ValueError(f"MOERL_FAULT={spec!r}: expected <point>:<n> with point in {POINTS} and n >= 1")
    return name, int(count)


_TARGET = _parse(os.environ.get("MOERL_FAULT"))
_SEEN: dict[str, int] = {}


def hit(point: str) -> None:
    """Die here (SIGKILL, no cleanup, as a killed job) if MOERL_FAULT names this point and count."""
    if _TARGET is None or _TARGET[0] != point:
        return
    _SEEN[point] = _SEEN.get(point, 0) + 1
    if _SEEN[point] == _TARGET[1]:
        os.kill(os.getpid(), signal.SIGKILL)
