"""The mismatch probe on a checkpoint directory: per rollout precision, k3 with and without R3 and the share of
tokens re-routed, per MoE layer. No training; nothing is downloaded.

    python scripts/probe.py --model DIR --data FILE --precisions bf16,fp8,nvfp4 --prompts 64 \
        --max-new-tokens 256 --out results/probe/olmoe.json

DIR: a local Hugging Face checkpoint of a family in moerl.models.families (olmoe, qwen3_moe, qwen2_moe,
deepseek_v3, deepseek_v2, mixtral, granitemoe). FILE: GSM8K / MATH rows as jsonl or parquet (the raw dataset's
columns or verl's parquet). Writes OUT.json (the per-precision record, moerl.trainer.probe) and OUT.png beside
it. The trainer scores in --dtype (fp32 by default) on --device; each engine is a copy of the weights in its
precision. A progress line per batch gives the time left. Errors are one line naming the file and the fix.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

PRECISIONS = ("bf16", "fp16", "fp32", "fp8", "int8", "nvfp4", "int4", "nvfp4_experts", "nvfp4_attention",
              "int4_experts", "int4_attention", "int4_kimi")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json, safetensors, tokenizer)")
    ap.add_argument("--data", required=True, help="jsonl / parquet of questions and answers")
    ap.add_argument("--task", choices=("gsm8k", "math"), default="gsm8k",
                    help="how the gold answer is read and the instruction asked (default gsm8k)")
    ap.add_argument("--precisions", default="bf16,fp8,nvfp4", help=f"comma-separated, of {', '.join(PRECISIONS)}")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="prompts per engine call")
    ap.add_argument("--out", required=True, help="OUT.json (OUT.png is written beside it)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the trainer's dtype")
    ap.add_argument("--kernels", choices=("native", "emulated"), default="native",
                    help="the engine's products: the device's own bf16 kernels, or moerl's emulated ones (CPU)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-chat-template", action="store_true", help="plain prompts (a tokenizer without a template)")
    ap.add_argument("--trust-remote-code", action="store_true", help="the checkpoint's own tokenizer code (Moonlight)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads on a CPU")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                    help="the embedded engine (every precision), or vLLM over the checkpoint (bf16, fp16, fp32; "
                         "routes only where vLLM captures them, on a GPU)")
    args = ap.parse_args(argv)
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    bad = [p for p in args.precisions if p not in PRECISIONS]
    if bad or not args.precisions:
        ap.error(f"--precisions: {bad or 'none given'} (expected some of {', '.join(PRECISIONS)})")
    if args.engine == "vllm" and set(args.precisions) - {"bf16", "fp16", "fp32"}:
        ap.error("--engine vllm: --precisions of bf16, fp16, fp32 (vLLM's own quantized formats are not moerl's)")
    for name in ("prompts", "max_new_tokens", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def plot(record: dict, path: Path, title: str) -> Path:
    """Two panels: the re-routed share per MoE layer (one line per precision), and k3 without / with R3."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    precisions = list(record["precisions"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    for name in precisions:
        layers = record["precisions"][name]["reroute_per_layer"]
        if layers is None:
            continue
        x = [int(k) for k in layers]
        y = [layers[k]["value"] for k in layers]
        lo = [layers[k]["value"] - layers[k]["ci95"][0] for k in layers]
        hi = [layers[k]["ci95"][1] - layers[k]["value"] for k in layers]
        left.errorbar(x, y, yerr=[lo, hi], marker="o", ms=3, capsize=2, label=name)
    from matplotlib.ticker import MaxNLocator

    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_xlabel("decoder layer (global number; dense layers have no router)")
    left.set_ylabel("share of tokens re-routed in the layer")
    left.set_ylim(bottom=0)
    left.legend(title="rollout precision", fontsize=8)
    left.set_title("Where routes flip: trainer vs engine, per MoE layer", fontsize=10)
    width = 0.38
    for j, (key, label) in enumerate((("k3", "native routing"), ("r3_k3", "engine's routes replayed (R3)"))):
        entries = [record["precisions"][p][key] or {"value": float("nan"), "ci95": [float("nan")] * 2}
                   for p in precisions]  # no R3 where the engine returned no routes
        vals = [e["value"] for e in entries]
        errs = [[v - e["ci95"][0] for v, e in zip(vals, entries)], [e["ci95"][1] - v for v, e in zip(vals, entries)]]
        right.bar([i + (j - 0.5) * width for i in range(len(precisions))], vals, width, yerr=errs, capsize=3,
                  label=label)
    right.set_xticks(range(len(precisions)), precisions)
    right.set_yscale("log")  # precisions differ by orders of magnitude
    right.set_ylabel("k3, token mean over responses (log)")
    right.set_title("How far the policies are apart", fontsize=10)
    right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.text(0.01, 0.01, "95 % bootstrap intervals over prompts", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw(record: dict, out: Path) -> Path | None:
    """OUT.png beside OUT.json; None (and a note) where matplotlib is not installed (vLLM's own environment)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"[probe] no figure: matplotlib is not installed here; draw it elsewhere with "
              f"python scripts/probe.py --figure-only {out}")
        return None
    title = (f"{Path(record['checkpoint']).name} ({record['model_type']}): {record['precisions'][next(iter(record['precisions']))]['prompts']} "
             f"prompts, trainer {record['trainer_dtype']} on {record['device']}, engine {record.get('engine', 'hf')}")
    return plot(record, out.with_suffix(".png"), title)


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--figure-only"]:  # redraw OUT.png from an existing OUT.json
        if len(argv) != 2:
            print("usage: python scripts/probe.py --figure-only OUT.json", file=sys.stderr)
            return 2
        out = Path(argv[1])
        print(f"[probe] wrote {draw(json.loads(out.read_text()), out)}")
        return 0
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import torch

    from moerl.config import ConfigError
    from moerl.data.datasets import DataError, load_local
    from moerl.data.prompts import PromptFormat
    from moerl.models.pretrained import (eos_token_ids, inspect_checkpoint, load_model, load_tokenizer,
                                         resolve_device)
    from moerl.trainer.probe import hf_engine, run_probe, vllm_engine

    out = Path(args.out)
    if out.suffix != ".json":
        print(f"error: --out {out}: expected a .json path (the figure goes beside it as .png)", file=sys.stderr)
        return 2
    try:  # every check that reads no weight first: the checkpoint's files, the data, the device
        info = inspect_checkpoint(args.model)
        rows = load_local(args.data, args.task)[: args.prompts]
        tokenizer = load_tokenizer(info, args.trust_remote_code, need_chat_template=not args.no_chat_template)
        device = resolve_device(args.device)
    except (ConfigError, DataError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"[probe] {info.path.name}: {info.model_type}, MoE layers {info.moe_layers()}; {len(rows)} prompts x "
          f"{len(args.precisions)} precisions, up to {args.max_new_tokens} new tokens; trainer {args.dtype} on {device}",
          flush=True)
    start = time.time()
    trainer = load_model(info, args.dtype, device)
    prompts = PromptFormat(args.task, checkpoint=True, chat_template=not args.no_chat_template,
                           stop_ids=tuple(eos_token_ids(info, tokenizer)))
    record = run_probe(trainer, tokenizer, prompts, rows, args.precisions, max_new_tokens=args.max_new_tokens,
                       batch_size=args.batch, kernels=args.kernels, temperature=args.temperature, seed=args.seed,
                       progress=lambda line: print(line, flush=True),
                       make_engine=vllm_engine(str(info.path)) if args.engine == "vllm" else hf_engine)
    record.update({"engine": args.engine, "checkpoint": str(info.path), "model_type": info.model_type, "fingerprint": info.fingerprint(),
                   "data": str(args.data), "task": args.task, "trainer_dtype": args.dtype, "device": str(device),
                   "kernels": args.kernels, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                   "seed": args.seed, "chat_template": not args.no_chat_template, "seconds": round(time.time() - start, 1),
                   "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(out)
    figure = draw(record, out)
    for name, r in record["precisions"].items():
        routes = (f"R3 {r['r3_k3']['value']:.3g}), re-routed in >= 1 layer {r['reroute_any']['value']:.3f}"
                  if r["reroute_any"] else "no routes from this engine)")
        print(f"[probe] {name}: k3 {r['k3']['value']:.3g} ({routes}, ratio > 2 {r['ratio_gt2']['value']:.4f}")
    print(f"[probe] wrote {out}{f' and {figure}' if figure else ''} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
