"""Wait until a Ray cluster reports the GPUs a job asked for, or say which nodes are missing.

    python scripts/wait_for_ray.py --address HEAD_IP:6379 --gpus 16 --node n1=10.0.0.1 --node n2=10.0.0.2

Why: verl asks Ray for nnodes x n_gpus_per_node GPUs once, at start-up, and raises ValueError when
fewer are registered (verl 0.9.1: verl/single_controller/ray/base.py,
ResourcePoolManager._check_resource_available). Worker nodes join the head at
their own pace, so a fixed sleep either wastes minutes or starts verl too early on a slow node.
This polls ``ray list nodes --format json`` (Ray's state CLI, part of ray[default] which verl
needs) until the alive nodes hold ``--gpus`` GPUs, for at most ``--timeout`` seconds; then it exits
1 naming the expected nodes that never registered (by host name and IP).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def alive_nodes(address: str, ray: str = "ray") -> list[dict]:
    """Alive nodes as Ray's state API lists them ([] while the head is not up yet)."""
    try:
        out = subprocess.run([ray, "list", "nodes", "--format", "json", "--address", address, "--limit", "10000"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    try:
        nodes = json.loads(out.stdout)
    except json.JSONDecodeError:
        return []
    return [n for n in nodes if str(n.get("state", "")).upper() == "ALIVE"]


def gpus_of(nodes: list[dict]) -> float:
    return sum(float((n.get("resources_total") or {}).get("GPU", 0)) for n in nodes)


def missing(expected: dict[str, str], nodes: list[dict]) -> list[str]:
    """``host (ip)`` of every expected node with no alive Ray node on its IP."""
    ips = {n.get("node_ip") for n in nodes}
    return [f"{host} ({ip})" for host, ip in expected.items() if ip not in ips]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", required=True, help="Ray head, HOST:PORT")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs that must be registered")
    ap.add_argument("--node", action="append", default=[], metavar="HOST=IP",
                    help="a node that must join (repeat); named in the error when it does not")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    ap.add_argument("--poll", type=float, default=5.0, help="seconds between polls")
    ap.add_argument("--ray", default="ray", help="the ray executable")
    args = ap.parse_args(argv)
    expected = dict(n.split("=", 1) for n in args.node)
    start = time.monotonic()
    nodes: list[dict] = []
    while True:
        nodes = alive_nodes(args.address, args.ray)
        have = gpus_of(nodes)
        if have >= args.gpus and not missing(expected, nodes):
            print(f"[wait_for_ray] {have:g} GPUs on {len(nodes)} node(s) after {time.monotonic() - start:.0f} s")
            return 0
        if time.monotonic() - start >= args.timeout:
            break
        time.sleep(args.poll)
    gone = missing(expected, nodes)
    print(f"[wait_for_ray] error: after {args.timeout:.0f} s Ray at {args.address} reports {gpus_of(nodes):g} GPUs "
          f"on {len(nodes)} alive node(s), need {args.gpus}; verl would raise ValueError "
          f"(single_controller/ray/base.py _check_resource_available). "
          + (f"Nodes that never registered: {', '.join(gone)}; check their Ray logs under the node-local "
             f"--temp-dir and that they reach the head's port." if gone else
             "Every expected node registered but with fewer GPUs: check CUDA_VISIBLE_DEVICES / --num-gpus."),
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
