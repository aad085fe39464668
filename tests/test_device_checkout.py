"""scripts/device_checkout.sh: slim takes the recorded results out of the index (not off the disk) for a device
call, refuses commits meanwhile, and restore gives back exactly the index it took."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


def checkout(root: Path) -> Path:
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "device_checkout.sh", root / "scripts")
    for path, size in {"src/a.py": 10, "results/runs/x/seed0/metrics.jsonl": 300_000,
                       "results/warm_start/w/model.safetensors": 200_000, "results/RESULTS.md": 20}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(b"x" * size)
    git(root, "init", "-q")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "recorded")
    return root


def device(root: Path, verb: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "scripts" / "device_checkout.sh"), verb], capture_output=True, text=True)


def test_slim_untracks_the_results_refuses_commits_and_restore_gives_the_index_back(tmp_path):
    root = checkout(tmp_path / "repo")
    before = git(root, "ls-files")
    assert "0.5 MiB would travel" in device(root, "size").stdout
    slim = device(root, "slim")
    assert slim.returncode == 0, slim.stderr
    tracked = git(root, "ls-files")
    assert "results/runs" not in tracked and "results/warm_start" not in tracked and "results/RESULTS.md" in tracked
    assert "0.0 MiB would travel" in slim.stdout  # the ignored results no longer count
    assert (root / "results/runs/x/seed0/metrics.jsonl").stat().st_size == 300_000  # still on disk
    refused = subprocess.run(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm",
                              "oops"], capture_output=True, text=True)
    assert refused.returncode != 0 and "device_checkout.sh restore" in refused.stderr
    assert "already slim" in device(root, "slim").stderr
    restore = device(root, "restore")
    assert restore.returncode == 0, restore.stderr
    assert git(root, "ls-files") == before and git(root, "status", "--porcelain") == ""
    assert "moerl device-slim" not in (root / ".git/info/exclude").read_text()
    assert not (root / ".git/hooks/pre-commit").exists()
    assert "not slim" in device(root, "restore").stderr


@pytest.mark.parametrize("blocker", ["staged", "hook"])
def test_slim_refuses_staged_changes_and_an_existing_hook_without_touching_anything(tmp_path, blocker):
    root = checkout(tmp_path / "repo")
    if blocker == "staged":
        (root / "src/a.py").write_text("changed")
        git(root, "add", "src/a.py")
    else:
        (root / ".git/hooks").mkdir(exist_ok=True)
        (root / ".git/hooks/pre-commit").write_text("#!/bin/sh\nexit 0\n")
    before = git(root, "ls-files")
    slim = device(root, "slim")
    assert slim.returncode == 1 and len(slim.stderr.strip().splitlines()) == 1
    assert ("staged changes" if blocker == "staged" else "pre-commit") in slim.stderr
    assert git(root, "ls-files") == before
