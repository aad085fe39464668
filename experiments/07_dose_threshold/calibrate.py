"""Pick experiment 07's warm start: the shortest supervised warm start whose policy is in the regime where
GRPO can still learn (held-out pass@1 in [0.25, 0.55], per-token entropy >= 0.2 nats, answers >= 25 tokens).

    .venv/bin/python experiments/07_dose_threshold/calibrate.py [--steps 120,200] [--out results/07_dose_threshold]

For each ``warm_start.steps`` the warm start is trained (or taken from results/warm_start, keyed by its
config) and measured by the fp32 policy at temperature 1: pass@1 and greedy accuracy on the 256 held-out
problems, and on 64 of them x 8 samples the mean per-token entropy and the mean answer length. Writes
``<out>/calibration.json`` (one entry per step count, merged with earlier calls) and prints the table;
the pick goes into base.yaml's ``warm_start.steps`` by hand; the README's table is written from calibration.json by
scripts/write_readme_numbers.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from moerl.analysis.dose_facts import (CALIBRATION_REGIME as REGIME, SHARPER_TEMPERATURES,  # noqa: E402
                                       calibration_lines)
from moerl.config import load_config  # noqa: E402
from moerl.rollout.hf import HFEngine  # noqa: E402
from moerl.trainer.grpo import check_splits  # noqa: E402
from moerl.trainer.logprobs import forward_logprobs  # noqa: E402
from moerl.trainer.warm_start import evaluate_policy, load_warm_start, warm_start_dir  # noqa: E402

BASE = ROOT / "experiments/07_dose_threshold/arms/fp32_control.yaml"


def measure(steps: int) -> dict:
    cfg = load_config(BASE, [f"warm_start.steps={steps}", "threads=1"])
    policy, tokenizer, meta = load_warm_start(cfg, progress=True)
    policy.eval()
    _, test_rows = check_splits(cfg)
    engine = HFEngine(policy, tokenizer, cfg.rollout, cfg.data.task)  # fp32: the policy itself
    accuracy = evaluate_policy(engine, test_rows, seed=cfg.data.seed)
    sharper = {}
    for temperature in SHARPER_TEMPERATURES:
        cooler = HFEngine(policy, tokenizer, dataclasses.replace(cfg.rollout, temperature=temperature), cfg.data.task)
        sharper[str(temperature)] = evaluate_policy(cooler, test_rows, seed=cfg.data.seed)["pass1"]
    rows = test_rows[:64]
    batch = engine.generate([r["question"] for r in rows], [r["answer"] for r in rows], 8, seed=cfg.data.seed)
    with torch.no_grad():
        _, entropy = forward_logprobs(policy, batch, cfg.rollout.temperature, with_entropy=True)
    mask = batch.response_mask
    in_regime = (REGIME["pass1"][0] <= accuracy["pass1"] <= REGIME["pass1"][1]
                 and entropy[mask].mean().item() >= REGIME["entropy"]
                 and mask.sum(1).float().mean().item() >= REGIME["length"])
    return {"warm_start_steps": steps, "key": warm_start_dir(cfg).name, "train_seconds": meta.get("train_seconds"),
            "pass1": accuracy["pass1"], "greedy": accuracy["greedy"], "pass1_at_temperature": sharper,
            "entropy_per_token": entropy[mask].mean().item(),
            "answer_tokens": mask.sum(1).float().mean().item(), "in_regime": in_regime}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default="120,200")
    ap.add_argument("--out", default="results/07_dose_threshold")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "calibration.json"
    table = {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}
    for steps in [int(s) for s in args.steps.split(",")]:
        table[steps] = measure(steps)
        path.write_text(json.dumps({str(k): table[k] for k in sorted(table)}, indent=1) + "\n")
        print(json.dumps(table[steps]), flush=True)
    print("\n" + "\n".join(calibration_lines(table, temperatures=SHARPER_TEMPERATURES)))


if __name__ == "__main__":
    main()
