"""A full disk during a checkpoint: a real 1 MiB tmpfs (in a user+mount namespace, where the
platform allows one), else the writer raising the error safetensors raises on ENOSPC."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

# Runs inside the namespace: a checkpoint that fits, then one that does not.
SCRIPT = r'''
import json, sys, torch
from pathlib import Path
from moerl.trainer.checkpoint import CheckpointError, save_checkpoint
run = Path(sys.argv[1]) / "run"
def save(step, numel):
    w = torch.nn.Parameter(torch.zeros(numel))
    return save_checkpoint(run, step, {"w": w}, torch.optim.AdamW([w]), {"sampler": {}})
save(1, 1000)
try:
    save(2, 1_000_000)
    print(json.dumps({"error": None}))
except CheckpointError as err:
    print(json.dumps({"error": str(err)}))
'''


def _in_tmpfs(tmp_path: Path) -> dict | None:
    """The script's result on a 1 MiB tmpfs, or None where no mount namespace can be made."""
    if shutil.which("unshare") is None:
        return None
    mnt = tmp_path / "small"
    mnt.mkdir()
    (tmp_path / "script.py").write_text(SCRIPT)
    cmd = (f"mount -t tmpfs -o size=1m tmpfs {mnt} && {sys.executable} {tmp_path / 'script.py'} {mnt} "
           f"&& ls -a {mnt / 'run' / 'checkpoints'} && ls {mnt / 'run' / 'checkpoints' / 'step_1'}")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0 and not proc.stdout.strip() and ("unshare" in proc.stderr or "mount" in proc.stderr):
        return None  # no unprivileged user/mount namespaces here (the script never started)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    return {**json.loads(lines[0]), "listing": lines[1:], "root": str(mnt / "run" / "checkpoints")}


def test_full_disk_during_a_checkpoint(tmp_path, monkeypatch):
    result = _in_tmpfs(tmp_path)
    if result is None:  # the writer raises what safetensors raises on a full disk
        import moerl.trainer.checkpoint as ckpt
        from safetensors import SafetensorError

        real = ckpt.save_file

        def full(tensors, path):
            if sum(t.numel() for t in tensors.values()) > 10_000:
                raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
            return real(tensors, path)

        monkeypatch.setattr(ckpt, "save_file", full)
        run = tmp_path / "run"

        def save(step, numel):
            w = torch.nn.Parameter(torch.zeros(numel))
            return ckpt.save_checkpoint(run, step, {"w": w}, torch.optim.AdamW([w]), {"sampler": {}})

        save(1, 1000)
        with pytest.raises(ckpt.CheckpointError) as err:
            save(2, 1_000_000)
        root = run / "checkpoints"
        result = {"error": str(err.value), "root": str(root),
                  "listing": [".", "..", *sorted(p.name for p in root.iterdir()),
                              *sorted(p.name for p in (root / "step_1").iterdir())]}
    root = result["root"]
    assert result["error"].startswith(f"could not write checkpoint {root}/step_2 (lora.safetensors: "), result
    assert "No space left on device" in result["error"]
    assert result["error"].endswith(f"kept {root}/step_1; free space and continue with --resume")
    listing = result["listing"]
    assert listing[:3] == [".", "..", "step_1"] and "state.json" in listing and not any(".tmp" in n for n in listing)


LOG_SCRIPT = r'''
import json, os, sys
from pathlib import Path
from moerl.config import load_config
from moerl.tracking import Tracker
run = Path(sys.argv[1]) / "run"
tracker = Tracker(run, load_config(None, ["tracking.wandb_mode=disabled"]))
tracker.log({"step": 6})
fd = os.open(Path(sys.argv[1]) / "filler", os.O_WRONLY | os.O_CREAT)  # fill the rest of the disk
for chunk in (b"x" * 4096, b"x"):
    try:
        while True:
            os.write(fd, chunk)
    except OSError:
        pass
os.close(fd)
try:  # a row larger than the page the file already holds (real rows carry ~100 metrics)
    tracker.log({"step": 7, **{f"metric/{i}": 0.5 for i in range(1000)}})
    print(json.dumps({"error": None}))
except OSError as err:
    print(json.dumps({"error": str(err), "metrics": str(run / "metrics.jsonl")}))
'''


def on_small_disk(tmp_path, script: str, size: str) -> dict | None:
    """Run ``script`` (it prints one JSON line) against a ``size`` tmpfs mounted in a user and mount
    namespace; None where this machine cannot make one (the caller then fakes the full disk)."""
    if shutil.which("unshare") is None:
        return None
    mnt = tmp_path / "small"
    mnt.mkdir()
    (tmp_path / "script.py").write_text(script)
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {mnt} && "
                           f"{sys.executable} {tmp_path / 'script.py'} {mnt}"], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src"),
                                            "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"})
    if proc.returncode == 0:
        return json.loads(proc.stdout.splitlines()[-1])
    assert not proc.stdout.strip() and ("unshare" in proc.stderr or "mount" in proc.stderr), proc.stderr
    return None


def test_full_disk_while_logging_a_row(tmp_path, monkeypatch):
    """A full disk when a metric row is appended: the error names the file and the step."""
    result = on_small_disk(tmp_path, LOG_SCRIPT, "256k")
    if result is None:  # no mount namespace: the file handle fails as a full disk does
        import errno

        from moerl.config import load_config
        from moerl.tracking import Tracker

        run = tmp_path / "run"
        tracker = Tracker(run, load_config(None, ["tracking.wandb_mode=disabled"]))

        class Full:
            def write(self, text):
                raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(tracker, "_fh", Full())
        try:
            tracker.log({"step": 7})
            result = {"error": None}
        except OSError as err:
            result = {"error": str(err), "metrics": str(run / "metrics.jsonl")}
    assert result["error"] is not None and result["error"].startswith(
        f"[Errno 28] could not append step 7 to {result['metrics']} (No space left on device)"), result


# The LoRA fits, the optimizer state (twice its size) does not; a writer that says only "unexpected pos"
# (torch's) still gets the full disk named.
TORCH_SAVE_SCRIPT = r'''
import json, sys, torch
from pathlib import Path
from moerl.trainer.checkpoint import CheckpointError, save_checkpoint
w = torch.nn.Parameter(torch.zeros(100_000))
opt = torch.optim.AdamW([w])
w.grad = torch.ones_like(w)
opt.step()
try:
    save_checkpoint(Path(sys.argv[1]) / "run", 1, {"w": w}, opt, {"sampler": {}})
    print(json.dumps({"error": None}))
except CheckpointError as err:
    print(json.dumps({"error": str(err)}))
'''


def test_a_full_disk_is_named_when_torch_does_not_say_so(tmp_path, monkeypatch):
    result = on_small_disk(tmp_path, TORCH_SAVE_SCRIPT, "1m")
    if result is None:  # no mount namespace: torch's writer fails as it does on a full disk
        import moerl.trainer.checkpoint as ckpt

        def full(path, tree):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 401408 vs 401296")

        monkeypatch.setattr(ckpt, "save_state", full)
        monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 20, 1 << 20, 0))
        w = torch.nn.Parameter(torch.zeros(10))
        try:
            ckpt.save_checkpoint(tmp_path / "run", 1, {"w": w}, torch.optim.AdamW([w]), {"sampler": {}})
            result = {"error": None}
        except ckpt.CheckpointError as err:
            result = {"error": str(err)}
    assert result["error"] is not None and "(optimizer.safetensors: " in result["error"], result
    # the writer's own words when it names the full disk (safetensors does), else the checkpoint's hint
    assert "no space left on device" in result["error"].lower(), result
