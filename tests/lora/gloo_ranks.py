"""Start a function on 2 gloo ranks (spawned processes) and wait for them, bounded: the sharding tests'
one way of running real collectives on a CPU."""
from __future__ import annotations

import socket
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, args: tuple, what: str, nprocs: int = 2, timeout: float = 120.0) -> None:
    """``target(rank, nprocs, port, *args)`` on ``nprocs`` spawned ranks; fails the test naming ``what``
    if they have not finished within ``timeout`` seconds (a hung collective never blocks the suite)."""
    ctx = mp.start_processes(target, args=(nprocs, free_port(), *args), nprocs=nprocs, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5) and time.monotonic() < deadline:
        pass
    if any(proc.is_alive() for proc in ctx.processes):
        for proc in ctx.processes:
            proc.kill()
        pytest.fail(f"gloo workers ({what}) did not finish within {timeout:g} s")
