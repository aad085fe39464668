"""verl 0.9.1's Router Replay on megatron-core, run by its tests on one device, reported as JSON + PNG.

Two steps, the same code on a GPU and on the CPU (scripts/gpu_router_replay.sh runs both):

    python scripts/gpu_router_replay.py run --device cuda --out DIR    # tests -> DIR/router_replay.json
    python scripts/gpu_router_replay.py plot DIR/router_replay.json    # -> DIR/router_replay.png

``run`` needs megatron-core and verl (not Ray: tests/upstream/verl_without_ray.py) and runs
tests/upstream/test_megatron_router_replay.py in-process with ``MOERL_TEST_DEVICE`` set; the JSON names the
device (``torch.cuda.get_device_name``), the versions, each test's outcome and the per-layer replay counts
the tests recorded. It is rewritten after every test, so a run cut short still leaves what it measured
(``"complete": false``). ``plot`` needs only matplotlib: one question per figure - on this device, does
every MoE router follow the replayed route, where its own top-k would mostly have picked otherwise?
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "upstream"
TEST_FILE = TESTS / "test_megatron_router_replay.py"
REPORT = "router_replay.json"
FIGURE = "router_replay.png"
SCHEMA = "moerl.upstream.router_replay/1"
VERSIONED = ("torch", "megatron-core", "verl", "transformers", "tokenizers", "tensordict", "omegaconf", "numpy")


def refuse(message: str) -> None:
    print(f"[gpu-router-replay] error: {message}", file=sys.stderr)
    raise SystemExit(2)


def check_device(name: str):
    """The torch device for ``name``, or one line and exit 2 (before anything is written)."""
    import torch

    if name not in ("cpu", "cuda"):
        refuse(f"--device {name!r}: expected 'cpu' or 'cuda'")
    if name == "cuda" and not torch.cuda.is_available():
        refuse(f"--device cuda but torch {torch.__version__} sees no CUDA device "
               "(torch.cuda.is_available() is False); use --device cpu to rehearse on the CPU")
    return torch.device(name)


def environment(device) -> dict:
    import torch
    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    env = {"python": platform.python_version(), "torch_cuda": torch.version.cuda,
           "versions": {name: ver(name) for name in VERSIONED}}
    if device.type == "cuda":
        env["device"] = {"type": "cuda", "name": torch.cuda.get_device_name(device),
                         "capability": list(torch.cuda.get_device_capability(device)),
                         "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    else:
        env["device"] = {"type": "cpu", "name": cpu_name()}
    return env


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loaded_distributions() -> dict:
    """Every installed distribution a loaded module belongs to, with its version: what the run really used."""
    from importlib.metadata import packages_distributions, version

    owners = packages_distributions()
    names = {d for m in list(sys.modules) for d in owners.get(m.partition(".")[0], ())}
    return {n: version(n) for n in sorted(names)}


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


class Collector:
    """pytest plugin: each test's outcome, duration, first line of failure and recorded properties,
    written to the report after every test."""

    def __init__(self, report: dict, path: Path):
        self.report, self.path = report, path

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            tests = self.report["tests"]
            entry = next((t for t in tests if t["nodeid"] == report.nodeid), None)
            if entry is None:
                entry = {"nodeid": report.nodeid, "outcome": "passed", "duration_s": 0.0, "properties": {}}
                tests.append(entry)
            entry["duration_s"] = round(entry["duration_s"] + report.duration, 3)
            entry["properties"].update({k: v for k, v in report.user_properties})
            if report.outcome != "passed" and entry["outcome"] == "passed":
                entry["outcome"] = report.outcome if report.when == "call" else f"{report.outcome} ({report.when})"
                entry["message"] = (report.longreprtext.strip().splitlines() or [""])[-1][:500]
            write_json(self.path, self.report)

    def pytest_collectreport(self, report):
        if report.failed:
            self.report["collection_error"] = (report.longreprtext.strip().splitlines() or [""])[-1][:500]
            write_json(self.path, self.report)


def run(device_name: str, out: Path, pytest_args: list[str]) -> int:
    device = check_device(device_name)
    path = out / REPORT
    if path.exists():
        refuse(f"{path} exists: give an empty --out directory (nothing is overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(TESTS))
    import verl_without_ray

    verl_without_ray.install()
    os.environ["MOERL_TEST_DEVICE"] = device.type
    import pytest

    report = {"schema": SCHEMA, "complete": False, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "test_file": str(TEST_FILE.relative_to(ROOT)), "process_group": "nccl" if device.type == "cuda" else "gloo",
              "verl_import": "verl's replay modules without Ray (tests/upstream/verl_without_ray.py)",
              **environment(device), "tests": []}
    write_json(path, report)
    start = time.perf_counter()
    code = pytest.main([str(TEST_FILE), "-q", "-p", "no:cacheprovider", "-p", "no:warnings", "-rfEs", *pytest_args],
                       plugins=[Collector(report, path)])
    report.update(complete=True, pytest_exit_code=int(code), wall_s=round(time.perf_counter() - start, 1),
                  passed=sum(t["outcome"] == "passed" for t in report["tests"]),
                  failed=sum(t["outcome"] != "passed" for t in report["tests"]),
                  loaded_distributions=loaded_distributions())
    write_json(path, report)
    print(f"[gpu-router-replay] {report['device']['name']}: {report['passed']} passed, {report['failed']} failed "
          f"-> {path}")
    return int(code)


def layer_fractions(report: dict, source: Path) -> list[tuple[str, float, float]]:
    """(label, followed fraction, native-agreed fraction) per recorded router call group; one line naming
    the file and key where the report lacks what the figure needs."""
    for key in ("device", "tests"):
        if key not in report:
            raise ValueError(f"{source}: no {key!r} key (expected a {SCHEMA} report)")
    rows = []
    for test in report["tests"]:
        for prop in ("r3_replay_counts", "r2_replay_counts"):
            for c in test.get("properties", {}).get(prop, []):
                missing = [k for k in ("phase", "layer", "replayed_rows", "router_followed", "native_agreed")
                           if k not in c]
                if missing or not c.get("replayed_rows"):
                    raise ValueError(f"{source}: {test['nodeid']} {prop}: expected phase, layer and counts with "
                                     f"replayed_rows > 0, got {c}")
                rows.append((f"{prop[:2].upper()} {c['phase']}", c["layer"], c["replayed_rows"],
                             c["router_followed"], c["native_agreed"]))
    if not rows:
        raise ValueError(f"{source}: no test recorded r3_replay_counts or r2_replay_counts")
    totals: dict[tuple[str, int], list[int]] = {}
    for group, layer, n, followed, agreed in rows:
        t = totals.setdefault((group, layer), [0, 0, 0])
        t[0] += n
        t[1] += followed
        t[2] += agreed
    return [(f"{g}\nlayer {layer}", f / n, a / n) for (g, layer), (n, f, a) in sorted(totals.items())]


def plot(json_path: Path, png_path: Path | None = None) -> Path:
    try:
        report = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{json_path}: not a readable JSON report ({err})") from err
    bars = layer_fractions(report, json_path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png_path = png_path or json_path.with_name(FIGURE)
    labels = [b[0] for b in bars]
    x = range(len(bars))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(bars)), 3.6))
    ax.bar([i - 0.2 for i in x], [b[1] for b in bars], width=0.4, label="router followed the replayed route")
    ax.bar([i + 0.2 for i in x], [b[2] for b in bars], width=0.4, label="native top-k = replayed route")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("fraction of replayed rows")
    v = report.get("versions", {})
    failed = report.get("failed", "?")
    ax.set_title(f"verl {v.get('verl')} replay on megatron-core {v.get('megatron-core')}, "
                 f"{report['device'].get('type')}: {report['device'].get('name')}\n(torch {v.get('torch')}; {report.get('passed', '?')} passed, "
                 f"{failed} failed{'' if report.get('complete') else ', INCOMPLETE'})", fontsize=9)
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    tmp = png_path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(png_path)
    print(f"[gpu-router-replay] figure -> {png_path}")
    return png_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    r = sub.add_parser("run", help="run the replay tests on one device and write router_replay.json")
    r.add_argument("--device", default=os.environ.get("MOERL_TEST_DEVICE", "cuda"), help="cuda (default) or cpu")
    r.add_argument("--out", type=Path, required=True, help="an empty or new directory")
    r.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    f = sub.add_parser("plot", help="draw router_replay.png beside a router_replay.json")
    f.add_argument("report", type=Path)
    a = p.parse_args(argv)
    if a.step == "run":
        return run(a.device.strip().lower(), a.out, a.pytest_args)
    try:
        plot(a.report)
    except ValueError as err:
        refuse(str(err))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
