"""The one-device memory plan of a run on a checkpoint (experiment 08): trainer weights, LoRA with its gradients
and AdamW state, the rollout engine's copy and KV cache, the scoring pass's logits and activations, against the
device's memory. Reads only config.json (the checkpoint's, or a --model-config file): nothing is loaded.

    python scripts/plan_device.py experiments/08_real_moe/arms/r3.yaml [--device-gib 80] [key=value ...]
    python scripts/plan_device.py experiments/08_real_moe/arms/r3.yaml \
        --model-config experiments/08_real_moe/model_configs/qwen3_30b_a3b.json --device-gib 141 trainer.dtype=bf16

Exit status 1 when the plan does not fit.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--model-config", help="a config.json to plan with instead of model.path's")
    ap.add_argument("--device-gib", type=float, help="plan for a device of this many GiB (default: this machine's)")
    args = ap.parse_intermixed_args(argv)
    from moerl.config import ConfigError, load_config
    from moerl.models.pretrained import memory_plan
    from moerl.planner import one_device_report

    try:
        cfg = load_config(args.config, args.overrides)
        if not cfg.model.path and not args.model_config:
            raise ConfigError(f"{args.config}: no model.path (the one-device plan is for a checkpoint)")
        source = Path(args.model_config) if args.model_config else Path(cfg.model.path) / "config.json"
        if not source.is_file():
            raise ConfigError(f"{source}: not found (download the checkpoint, or pass --model-config FILE)")
        plan = memory_plan(cfg, json.loads(source.read_text()), args.device_gib)
    except (ConfigError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{cfg.run_name}: {source}")
    print(one_device_report(plan))
    return 0 if plan.margin_gib >= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
