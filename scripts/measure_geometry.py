"""Experiment 06: measure the routing mismatch at every ladder point, one JSON per point.

    python scripts/measure_geometry.py                     # every point, skipping finished ones
    python scripts/measure_geometry.py --only depth        # the points whose name contains 'depth'
    python scripts/measure_geometry.py --list              # the points and whether each is done
    python scripts/measure_geometry.py --smoke --out DIR   # CI-sized: two tiny points

A point is finished when ``results/geometry/<name>.json`` exists with the same spec (model, state,
prompts, samples, dtypes, seed); a changed spec is measured again. Points run one after the other on
one thread (``threads`` in the base config). The ladders vary one factor at a time around the
Qwen3-30B-A3B routing geometry at CPU width (48 MoE layers x 128 experts, top-8, hidden 64):

    depth    MoE layers 8 / 16 / 32 / 48
    experts  32 / 64 / 128 / 256 / 384 (top-8)
    topk     2 / 4 / 8
    width    hidden 64 / 128 / 256 (expert FFN hidden/2, heads of 32): the known confound
    state    experiment 05's geometry (8 x 32, top-4): random init, its warm start, + a short GRPO run;
             the base geometry after a short SFT (150 and 400 steps), and 8 / 16 MoE layers after 400
    cluster  the four cluster models' routing geometries (moerl.models.geometry), bf16 and fp8 rollouts
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from moerl.config import ExperimentConfig, ModelConfig, load_config, to_dict, without_checkpoint_keys
from moerl.data import load_splits
from moerl.models.geometry import CPU_WIDTH, geometry_model_config
from moerl.models.presets import build_model
from moerl.analysis.routing_geometry import measure

BASE_CONFIG = "experiments/06_routing_geometry/base.yaml"
GRPO_ARM = "experiments/05_mismatch_consequences/arms/baseline.yaml"
# Warm starts of the big geometries (150 MB each at hidden 64) are cached here, not committed.
WARM_CACHE = "results/geometry/warm_start"
log = logging.getLogger("measure_geometry")


@dataclasses.dataclass
class Point:
    name: str
    ladders: tuple[str, ...]
    model: ModelConfig
    state: str = "random"  # random | warm | grpo<N>
    dtypes: tuple[str, ...] = ("bf16",)
    seed: int = 0
    note: str = ""
    # state "warm": warm_start.* overrides of the base config (a shorter SFT for a big geometry)
    warm_start: dict = dataclasses.field(default_factory=dict)


def qwen3(layers=48, experts=128, top_k=8, hidden=64) -> ModelConfig:
    """Qwen3-style MoE (all layers MoE, softmax, normalised top-k) at CPU width ``hidden``."""
    width = dict(CPU_WIDTH) if hidden == 64 else dict(
        hidden_size=hidden, moe_intermediate_size=hidden // 2, num_heads=hidden // 32, num_kv_heads=hidden // 64,
        head_dim=32)
    return ModelConfig(preset="qwen3_moe", num_layers=layers, num_experts=experts, top_k=top_k, **width)


def ladder_points() -> list[Point]:
    pts = [Point("qwen3_base_L48_E128_k8_h64", ("depth", "experts", "topk", "width", "cluster"),
                 geometry_model_config("qwen3_30b_a3b"), dtypes=("bf16", "fp8"),
                 note="the Qwen3-30B-A3B routing geometry at hidden 64"),
           Point("qwen3_base_L48_E128_k8_h64_seed1", ("seed",), geometry_model_config("qwen3_30b_a3b"), seed=1,
                 note="the base with another init and sampling seed: how far one model's numbers move")]
    pts += [Point(f"depth_L{n}", ("depth",), qwen3(layers=n)) for n in (8, 16, 32)]
    pts += [Point(f"experts_E{e}", ("experts",), qwen3(experts=e)) for e in (32, 64, 256, 384)]
    pts += [Point(f"topk_k{k}", ("topk",), qwen3(top_k=k)) for k in (2, 4)]
    pts += [Point(f"width_h{h}", ("width",), qwen3(hidden=h)) for h in (128, 256)]
    exp05 = qwen3(layers=8, experts=32, top_k=4)
    pts += [Point("state_exp05_random", ("state",), exp05, note="experiment 05's geometry, random init"),
            Point("state_exp05_warm", ("state",), exp05, state="warm", dtypes=("bf16", "fp8"),
                  note="experiment 05's cached warm start (600 SFT steps)"),
            Point("state_exp05_grpo30", ("state",), exp05, state="grpo30",
                  note="the warm start after 30 steps of experiment 05's baseline GRPO (emulated bf16 rollout)"),
            Point("state_qwen3_warm150", ("state",), geometry_model_config("qwen3_30b_a3b"), state="warm",
                  warm_start={"steps": 150, "batch_size": 32, "cache_dir": WARM_CACHE},
                  note="the Qwen3-30B-A3B geometry at h64 after a short SFT (150 steps x 32 samples)"),
            Point("state_qwen3_warm400", ("state",), geometry_model_config("qwen3_30b_a3b"), state="warm",
                  warm_start={"steps": 400, "batch_size": 32, "cache_dir": WARM_CACHE},
                  note="the Qwen3-30B-A3B geometry at h64 after a longer SFT (400 steps x 32 samples)")]
    pts += [Point("state_qwen3_warm400_seed1", ("seed",), geometry_model_config("qwen3_30b_a3b"), state="warm",
                  warm_start={"steps": 400, "batch_size": 32, "cache_dir": WARM_CACHE}, seed=1,
                  note="the same SFT'd model, another sampling seed: how far one batch's numbers move")]
    # the depth ladder again with trained routers: does p_l grow with depth as at random init?
    pts += [Point(f"state_qwen3_L{n}_warm400", ("state", "depth_sft"), qwen3(layers=n), state="warm",
                  warm_start={"steps": 400, "batch_size": 32, "cache_dir": WARM_CACHE},
                  note=f"{n} MoE layers x 128, top-8, h64 after the same 400-step SFT") for n in (8, 16)]
    # the width ladder with trained routers (the same 400-step SFT at hidden 128 and 256): the width slope's
    # trained points; each SFT at 48 layers x 128 experts costs over 10 min on one thread at these widths
    pts += [Point(f"state_qwen3_warm400_h{h}", ("state", "width_sft"), qwen3(hidden=h), state="warm",
                  warm_start={"steps": 400, "batch_size": 32, "cache_dir": WARM_CACHE},
                  note=f"48 MoE layers x 128, top-8, hidden {h} after the same 400-step SFT") for h in (128, 256)]
    pts += [Point(f"cluster_{g}", ("cluster",), geometry_model_config(g), dtypes=("bf16", "fp8"))
            for g in ("moonlight_16b_a3b", "deepseek_v3", "kimi_k2")]
    return pts


def smoke_points() -> list[Point]:
    tiny = dict(hidden_size=32, moe_intermediate_size=16, num_heads=1, num_kv_heads=1, head_dim=32)
    return [Point("smoke_qwen3", ("depth",), ModelConfig(preset="qwen3_moe", num_layers=2, num_experts=8, top_k=2,
                                                         **tiny)),
            Point("smoke_kimi", ("cluster",), dataclasses.replace(
                geometry_model_config("kimi_k2", **tiny), num_layers=3, num_experts=16), dtypes=("bf16", "fp8"))]


# How the engine decodes is not what a point measures: its paths are bit-identical (moerl.rollout.decode).
NOT_IN_SPEC = {"rollout": ("decode",)}


def spec(point: Point, prompts: int, cfg: ExperimentConfig) -> dict:
    rollout = {k: v for k, v in to_dict(cfg.rollout).items() if k not in NOT_IN_SPEC["rollout"]}
    out = {"name": point.name, "ladders": list(point.ladders), "model": without_checkpoint_keys("model", to_dict(point.model)),
           "state": point.state, "dtypes": list(point.dtypes), "seed": point.seed, "prompts": prompts,
           "group_size": cfg.rollout.group_size, "rollout": rollout,
           "data": without_checkpoint_keys("data", to_dict(cfg.data)), "note": point.note}
    if point.warm_start:
        out["warm_start"] = point.warm_start
    return out


def spec_hash(s: dict) -> str:
    return hashlib.sha256(json.dumps(s, sort_keys=True, default=str).encode()).hexdigest()[:12]


def policy_for(point: Point, cfg: ExperimentConfig, tokenizer) -> tuple[torch.nn.Module, dict]:
    """The fp32 policy of ``point`` and what produced it."""
    if point.state == "random":
        return build_model(point.model, tokenizer, seed=point.seed), {"state": "random", "init_std": point.model.init_std}
    from moerl.trainer.warm_start import load_warm_start

    wcfg = dataclasses.replace(cfg, model=point.model, warm_start=dataclasses.replace(cfg.warm_start, **point.warm_start))
    if point.state == "warm":
        model, _, meta = load_warm_start(wcfg, progress=False)
        return model, {"state": "warm", "warm_start": {k: meta.get(k) for k in ("key", "steps", "test_accuracy")}}
    if point.state.startswith("grpo"):
        from moerl.trainer.grpo import GRPOTrainer

        steps = int(point.state[4:])
        gcfg = load_config(GRPO_ARM, [f"trainer.steps={steps}", "trainer.eval_every=0", "trainer.checkpoint_every=0",
                                      "trainer.samples_every=0", "trainer.paired_replay_every=0",
                                      f"rollout.kernels={cfg.rollout.kernels}", "tracking.wandb_mode=disabled",
                                      "tracking.progress_bar=false", "threads=1", f"seed={point.seed}"])
        if to_dict(gcfg.model) != to_dict(point.model):
            raise ValueError(f"{point.name}: the GRPO arm's model differs from the point's")
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = GRPOTrainer(gcfg, run_dir, progress=False)
            rewards = [trainer.step()["reward/mean"] for _ in range(steps)]
            trainer.close()
        return trainer.policy, {"state": point.state, "grpo_arm": GRPO_ARM, "grpo_steps": steps,
                                "reward_first5": sum(rewards[:5]) / 5, "reward_last5": sum(rewards[-5:]) / 5}
    raise ValueError(f"{point.name}: unknown state '{point.state}'")


def run_point(point: Point, cfg: ExperimentConfig, prompts: int, out_dir: Path, tokenizer, rows) -> Path:
    s = spec(point, prompts, cfg)
    path = out_dir / f"{point.name}.json"
    start = time.perf_counter()
    torch.manual_seed(point.seed)
    policy, state = policy_for(point, cfg, tokenizer)
    build_seconds = time.perf_counter() - start
    results = {}
    for dtype in point.dtypes:
        results[dtype] = measure(policy, tokenizer, cfg, rows[:prompts], dtype=dtype, seed=point.seed)
        r = results[dtype]
        log.info("%s %s: p_mean %.4f  >=1-layer share %.4f [%.4f, %.4f]  independence %.4f  k3 %.2e -> R3 %.2e",
                 point.name, dtype, r["all/p_mean"], r["all/share"], r["all/share_lo"], r["all/share_hi"],
                 r["all/independence"], r["native/k3"], r["r3/k3"])
    from moerl.tracking import git_sha

    record = {"spec": s, "spec_hash": spec_hash(s), "policy": state, "results": results,
              "seconds_total": time.perf_counter() - start, "seconds_policy": build_seconds,
              "threads": torch.get_num_threads(), "git_sha": git_sha()}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    return path


def finished(path: Path, s: dict) -> bool:
    if not path.exists():
        return False
    try:
        return json.loads(path.read_text()).get("spec_hash") == spec_hash(s)
    except json.JSONDecodeError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key=value overrides of base.yaml (each point then sets its geometry)")
    ap.add_argument("--out", default="results/geometry")
    ap.add_argument("--only", default="", help="run the points whose name contains this string")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per point (each sampled group_size times)")
    ap.add_argument("--smoke", action="store_true", help="two tiny points, 2 prompts x 2 samples (CI)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--commit", action="store_true", help="git-commit each point's JSON as it lands")
    args = ap.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    overrides = ["rollout.group_size=2", "rollout.max_new_tokens=6", "data.train_size=64", "data.test_size=8"] \
        if args.smoke else []
    cfg = load_config(BASE_CONFIG, overrides + list(args.overrides))
    torch.set_num_threads(cfg.threads or 1)
    prompts = 2 if args.smoke else args.prompts
    points = [p for p in (smoke_points() if args.smoke else ladder_points()) if args.only in p.name]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.list:
        for p in points:
            done = finished(out / f"{p.name}.json", spec(p, prompts, cfg))
            print(f"{'done' if done else 'todo'}  {p.name:36s} {','.join(p.ladders):30s} {p.state}")
        return 0
    from moerl.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    _, test_rows = load_splits(cfg.data)
    for point in points:
        path = out / f"{point.name}.json"
        if finished(path, spec(point, prompts, cfg)):
            log.info("%s: finished, skipped", point.name)
            continue
        run_point(point, cfg, prompts, out, tokenizer, test_rows)
        if args.commit:
            import subprocess

            subprocess.run(["git", "add", str(path)], check=True)
            subprocess.run(["git", "commit", "-q", "-m", f"Experiment 06: point {point.name}", "--", str(path)],
                           check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
