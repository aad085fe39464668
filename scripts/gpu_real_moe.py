"""Experiment 08 on one GPU: OLMoE-1B-7B's exact geometry (and Qwen3-30B-A3B's where the card holds it) at
random init, through the same path a user's checkpoint takes: a checkpoint directory in the hub's format
(moerl.models.doubles, bf16 safetensors, the locally trained tokenizer and chat template), the mismatch probe
(bf16, fp8, nvfp4 engines against the fp32 trainer) and three GRPO steps of experiment 08's r3 arm with the
embedded engine. Records peak GPU memory, rollout tokens per second against the card's bandwidth floor, and
step time. One run of under ten minutes.

    python scripts/gpu_real_moe.py --out results/real_moe/gpu        # on a machine with one H100 / H200
    python scripts/gpu_real_moe.py --device cpu --smoke --out DIR    # every part on the CPU, tiny geometry

Needs torch with CUDA and this repository's pins of transformers, peft, omegaconf and math-verify
(``bash scripts/device_wheels.sh`` fetches them as wheels where a registry is reachable; install them with
``pip install --no-index --no-deps --target DIR .whl/*.whl`` and put DIR first on PYTHONPATH). Nothing is
downloaded: the weights are random, so the probe's numbers show the machinery and the GPU's kernels on the
real shapes, not a trained model's routing margins (a trained checkpoint goes through scripts/probe.py).

Bandwidth floor: a decode step must read every active weight once (attention, router, top-k experts of each
MoE layer, embeddings row and LM head), so tokens per second per sequence cannot exceed HBM bandwidth / active
bytes; with B sequences decoded together the floor time of one step is the same, so the batch's tokens per
second are at most B x bandwidth / active bytes. The ratio floor / measured is printed (target: within 5x).
Writes OUT/<model>.json (and the probe's figure OUT/<model>_probe.png) as each model lands.
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = ROOT / "experiments" / "08_real_moe" / "model_configs"
# HBM bandwidth by card (vendor data sheets, bytes per second): H100 SXM 3.35 TB/s, H200 4.8 TB/s.
BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}
TINY = {"model_type": "olmoe", "vocab_size": 576, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 1024, "tie_word_embeddings": False}


def active_bytes(model: torch.nn.Module, dtype_bytes: int = 2) -> int:
    """Bytes one decode step reads: every weight except the routed experts not chosen (top-k of E)."""
    from moerl.models.routers import find_moe_layers

    total = sum(p.numel() for p in model.parameters())
    skipped = 0
    for layer in find_moe_layers(model):
        experts = sum(p.numel() for p in layer.block.experts.parameters())
        skipped += experts * (1 - layer.top_k / layer.num_experts)
    embed = model.get_input_embeddings().weight
    skipped += embed.numel() - embed.shape[1]  # a lookup reads one row
    return int((total - skipped) * dtype_bytes)


def bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None)


def write_checkpoint(config: dict, out: Path, device: torch.device) -> Path:
    """A hub-format checkpoint of ``config``'s geometry: weights initialised on ``device``, saved in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from moerl.models.doubles import ENDOFTEXT, IM_END, math_corpus, train_tokenizer

    tok = train_tokenizer(math_corpus())
    hf = AutoConfig.for_model(**{k: v for k, v in config.items() if not k.startswith("_")},
                              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=[tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)],
                     pad_token_id=tok.pad_token_id).save_pretrained(out)
    del model
    return out


def run_model(name: str, config: dict, args, device: torch.device, work: Path) -> dict:
    from moerl.config import load_config
    from moerl.data.prompts import PromptFormat
    from moerl.models.doubles import write_gsm8k_file
    from moerl.models.pretrained import eos_token_ids, inspect_checkpoint, load_model, load_tokenizer
    from moerl.trainer.grpo import GRPOTrainer
    from moerl.trainer.probe import run_probe

    record = {"model": name, "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda"
              else platform.processor(), "torch": torch.__version__, "cuda": torch.version.cuda}
    t = time.time()
    ckpt = write_checkpoint(config, work / name, device)
    record["write_checkpoint_s"] = round(time.time() - t, 1)
    data = write_gsm8k_file(work / "gsm8k.jsonl", 256)
    test = write_gsm8k_file(work / "gsm8k_test.parquet", 32, seed=1, verl_format=True)
    info = inspect_checkpoint(ckpt)
    tok = load_tokenizer(info)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.time()
    trainer = load_model(info, "fp32", device)
    record["params"] = sum(p.numel() for p in trainer.parameters())
    record["active_bytes_bf16"] = active_bytes(trainer)
    prompts = PromptFormat("gsm8k", checkpoint=True, stop_ids=tuple(eos_token_ids(info, tok)))
    rows = [{"question": q, "answer": "0"} for q in (r["question"] for r in
                                                     map(json.loads, data.read_text().splitlines()))][: args.prompts]
    probe = run_probe(trainer, tok, prompts, rows, ["bf16", "fp8", "nvfp4"], max_new_tokens=args.max_new_tokens,
                      batch_size=args.prompts, kernels="native" if device.type == "cuda" else "emulated",
                      progress=lambda line: print(line, flush=True))
    record["probe"] = probe
    record["probe_s"] = round(time.time() - t, 1)
    # decode throughput of the bf16 engine alone: one batch, every sequence forced to the full length
    from moerl.config import RolloutConfig
    from moerl.rollout.hf import HFEngine

    engine = HFEngine(trainer, tok, RolloutConfig(dtype="bf16", kernels="native" if device.type == "cuda" else
                                                  "emulated", max_new_tokens=args.max_new_tokens,
                                                  capture_routing=False), PromptFormat("gsm8k", checkpoint=True,
                                                                                       stop_ids=(-1,)))
    engine.generate([r["question"] for r in rows[:2]], ["0", "0"], 1, seed=0)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.time()
    batch = engine.generate([r["question"] for r in rows], ["0"] * len(rows), 1, seed=1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.time() - t
    tokens = int(batch.response_mask.sum())
    record["rollout"] = {"sequences": len(rows), "new_tokens": tokens, "seconds": round(seconds, 3),
                         "tokens_per_s": tokens / seconds}
    bw = bandwidth(device)
    if bw:
        floor = len(rows) * bw / record["active_bytes_bf16"]  # tokens/s if every step only read its weights
        record["rollout"].update(bandwidth_bytes_per_s=bw, floor_tokens_per_s=floor,
                                 floor_over_measured=floor / record["rollout"]["tokens_per_s"])
    del engine, trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # three GRPO steps of experiment 08's r3 arm through scripts/run.py's own trainer
    cfg = load_config(ROOT / "experiments/08_real_moe/arms/r3.yaml", [
        f"model.path={ckpt}", f"data.train_path={data}", f"data.test_path={test}", f"device={device.type}",
        f"rollout.kernels={'native' if device.type == 'cuda' else 'emulated'}", "trainer.steps=3",
        f"rollout.prompts_per_step={args.grpo_prompts}", "rollout.group_size=8",
        f"rollout.max_new_tokens={args.max_new_tokens}", "trainer.eval_every=0", "trainer.eval_size=8",
        "trainer.checkpoint_every=0", "trainer.samples_every=0", "data.max_prompt_tokens=256",
        f"tracking.output_dir={work / 'runs'}", "tracking.wandb_mode=disabled", "tracking.progress_bar=false"])
    t = time.time()
    trainer = GRPOTrainer(cfg, cfg.run_dir, progress=False)
    trainer.train()
    steps = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    record["grpo"] = {"steps": len(steps), "seconds": round(time.time() - t, 1),
                      "step_s": [round(s["time/step"], 2) for s in steps],
                      "replayed_agreement": [s.get("routing/replayed_agreement") for s in steps],
                      "k3": [s["mismatch/k3"] for s in steps]}
    if device.type == "cuda":
        record["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 1024**3
    del trainer
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--smoke", action="store_true", help="a tiny OLMoE geometry (CPU rehearsal)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--grpo-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the throughput pass stops at no id on purpose (-1); transformers warns
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no GPU; --device cpu --smoke rehearses every step", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the trainer's fp32 is fp32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = {"olmoe_tiny": TINY} if args.smoke else {
        "olmoe_1b_7b": json.loads((MODEL_CONFIGS / "olmoe_1b_7b_0125_instruct.json").read_text()),
        "qwen3_30b_a3b": json.loads((MODEL_CONFIGS / "qwen3_30b_a3b.json").read_text())}
    sys.path.insert(0, str(ROOT / "scripts"))
    from probe import plot

    for name, config in models.items():
        if device.type == "cuda" and name == "qwen3_30b_a3b":
            gib = torch.cuda.get_device_properties(device).total_memory / 1024**3
            if gib < 130:  # fp32 trainer copy (122 GB) alone exceeds an 80 GB card; bf16 pair needs ~125 GB
                (out / f"{name}.json").write_text(json.dumps({"model": name, "skipped": f"needs about 130 GiB, the "
                                                              f"card has {gib:.0f}"}, indent=1) + "\n")
                print(f"[gpu-real-moe] {name}: skipped ({gib:.0f} GiB card)")
                continue
        with tempfile.TemporaryDirectory() as work:
            record = run_model(name, config, args, device, Path(work))
        (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
        plot(record["probe"], out / f"{name}_probe.png", f"{name} geometry, random init: {record['gpu']}")
        r = record["rollout"]
        print(f"[gpu-real-moe] {name}: rollout {r['tokens_per_s']:.0f} tokens/s"
              + (f" (floor {r['floor_tokens_per_s']:.0f}, {r['floor_over_measured']:.1f}x)" if "floor_tokens_per_s" in r
                 else "") + f"; GRPO steps {record['grpo']['step_s']} s; peak {record.get('peak_memory_gib', 0):.1f} GiB",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
