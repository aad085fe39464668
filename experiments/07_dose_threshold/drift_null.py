"""The drift null: how far a low-precision engine's mismatch grows on a policy that moves without any
mismatch feedback. The fp32 control of the crossover grid trains for 600 steps with an fp32 rollout and keeps
every checkpoint (``trainer.keep_checkpoints=0``); at each of them (and at the warm start, step 0) this script
builds the nvfp4 and the fp8 engine from the control's own weights and measures their k3 against the fp32
trainer, as experiment 06 measures a point (``moerl.analysis.routing_geometry.measure``).

    .venv/bin/python experiments/07_dose_threshold/drift_null.py RUN_DIR [--engines nvfp4,fp8] [--prompts 128]
        [--out results/07_dose_threshold/drift_null]

Why: "the corrected arms keep drifting" was judged by k3's growth along each arm's own run. A policy that
moves away from its start may raise an engine's k3 with no mismatch feedback at all; this measures that
growth, so the registered ``drift_null`` comparisons read an arm's growth against it (analysis.yaml).
The prompts are the calibration set (``moerl.data.synthetic.worked_calibration_rows``: in neither the
training split nor the held-out problems), each sampled 8 times at T = 1; the sampling seed is the step.
Writes ``<out>/<run name>-seed<N>.json`` (per engine: step -> k3), resumable: steps already measured are kept.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from moerl.analysis.routing_geometry import measure  # noqa: E402
from moerl.config import config_hash, load_config  # noqa: E402
from moerl.data.synthetic import worked_calibration_rows  # noqa: E402
from moerl.lora.peft_lora import apply_lora  # noqa: E402
from moerl.trainer.checkpoint import checkpoint_dirs, checkpoint_step, verify_checkpoint  # noqa: E402
from moerl.trainer.grpo import check_splits  # noqa: E402
from moerl.trainer.warm_start import load_warm_start  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="the fp32 control's run directory (seedN/), with its checkpoints/")
    ap.add_argument("--engines", default="nvfp4,fp8")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--out", default="results/07_dose_threshold/drift_null")
    args = ap.parse_args()
    torch.set_num_threads(1)
    run = Path(args.run)
    if not (run / "config.yaml").exists():
        sys.exit(f"drift_null: {run / 'config.yaml'} not found: RUN_DIR is a run's seedN/ directory")
    checkpoints = checkpoint_dirs(run)
    if not checkpoints:
        sys.exit(f"drift_null: {run / 'checkpoints'} holds no checkpoint (the control must run with "
                 "trainer.keep_checkpoints=0; launch.sh crossover sets it)")
    cfg = load_config(run / "config.yaml", ["threads=1", "tracking.wandb_mode=disabled"])
    if cfg.rollout.dtype != "fp32":
        sys.exit(f"drift_null: {run} ran rollout.dtype={cfg.rollout.dtype}; the null is measured on an fp32 control")
    base, tokenizer, _ = load_warm_start(cfg, train_if_missing=False, progress=False)
    policy = apply_lora(base, cfg.lora, cfg.model.preset)
    policy.eval()
    params = dict(policy.named_parameters())
    initial = {n: p.detach().clone() for n, p in params.items() if p.requires_grad}
    train, test = check_splits(cfg)
    rows = worked_calibration_rows(args.prompts, cfg.data.seed, train, test, cfg.data.max_a, cfg.data.max_bc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{run.parent.name}-{run.name}.json"
    record = json.loads(path.read_text()) if path.exists() else {
        "run": str(run), "seed": cfg.seed, "prompts": len(rows), "samples_per_prompt": cfg.rollout.group_size,
        "prompts_from": "moerl.data.synthetic.worked_calibration_rows (in neither split)", "k3": {}}
    steps = [(0, None)] + [(checkpoint_step(c), c) for c in checkpoints]
    for engine in args.engines.split(","):
        done = record["k3"].setdefault(engine, {})
        for step, ckpt in steps:
            if str(step) in done:
                continue
            if ckpt is None:
                tensors = initial  # the warm start with the LoRA as initialised (B = 0: the warm start itself)
            else:
                verify_checkpoint(ckpt, config_hash(cfg))
                tensors = load_file(str(ckpt / "lora.safetensors"))
            with torch.no_grad():
                for name, value in tensors.items():
                    params[name].copy_(value)
            point = measure(policy, tokenizer, cfg, rows, dtype=engine, seed=step)
            done[str(step)] = point["native/k3"]
            path.write_text(json.dumps(record, indent=1) + "\n")
            # blind, as the grid's sweeps: the log says what was measured, not the value
            print(f"drift null: {run} {engine} step {step} measured", flush=True)


if __name__ == "__main__":
    main()
