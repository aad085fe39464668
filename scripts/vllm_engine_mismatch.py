"""Engine-vs-trainer mismatch of vLLM's CPU build beside the HF engine, on the same weights.

    MOERL_VLLM_VENV/bin/python scripts/vllm_engine_mismatch.py [--prompts 64] [--group 4] [--out f.json]

Runs in the optional vLLM environment (scripts/setup_upstream_vllm.sh). One tiny Qwen3-MoE (experiment
00's shape, random init), LoRA on attention with a random adapter refit into both engines. Each engine
samples its own batch in bf16; every batch is scored teacher-forced by the fp32 trainer and by the other
engine's model. Printed per pair: k3 (token mean of exp(d) - 1 - d, d = log p_ref - log p_engine) and
max |d| over response tokens. bf16 numerics depend on the CPU (AVX512-BF16/AMX or not): the figures are
this machine's.
"""
from __future__ import annotations

import argparse
import json
import platform

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--init-std", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import tempfile

    from moerl.config import LoraConfig, ModelConfig, RolloutConfig
    from moerl.data.synthetic import arith_splits
    from moerl.data.tokenizer import build_tokenizer
    from moerl.lora.peft_lora import apply_lora
    from moerl.models.presets import build_model
    from moerl.refit.adapter_format import AdapterMap
    from moerl.rollout.hf import HFEngine
    from moerl.rollout.vllm import VLLMEngine
    from moerl.trainer.logprobs import forward_logprobs
    from moerl.trainer.metrics import mismatch_metrics

    model_cfg = ModelConfig(init_std=args.init_std)  # experiment 00: hidden 128, 4 layers, 8 experts, top-2
    lora_cfg = LoraConfig(rank=8, alpha=16.0, target_experts=False)  # vLLM's CPU build: attention LoRA only
    rollout = RolloutConfig(dtype="bf16", max_new_tokens=args.max_new_tokens, capture_routing=False)
    tok = build_tokenizer()
    policy = apply_lora(build_model(model_cfg, tok, seed=args.seed), lora_cfg, model_cfg.preset).eval()
    g = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    rows = arith_splits(args.prompts, 1, seed=args.seed)[0]
    questions, answers = [r["question"] for r in rows], [r["answer"] for r in rows]

    with tempfile.TemporaryDirectory() as work:
        with torch.no_grad():
            lora_b = {n: p.clone() for n, p in policy.named_parameters() if "lora_B" in n}
            for n, p in policy.named_parameters():  # the engine starts from the base: B = 0 ...
                if "lora_B" in n:
                    p.zero_()
            vllm_engine = VLLMEngine.from_policy(policy, tok, rollout, lora_cfg, model_cfg.preset, work)
            for n, p in policy.named_parameters():  # ... and receives the adapter by refit
                if n in lora_b:
                    p.copy_(lora_b[n])
        vllm_engine.load_adapter(AdapterMap(policy).state())
        hf_engine = HFEngine(policy, tok, rollout)
        batches = {"vllm": vllm_engine.generate(questions, answers, args.group, seed=args.seed),
                   "hf": hf_engine.generate(questions, answers, args.group, seed=args.seed)}
        vllm_engine.close()

    scorers = {"fp32 trainer": policy, "hf bf16 engine": hf_engine.model}
    figures = {}
    with torch.no_grad():
        for engine, batch in batches.items():
            for ref_name, model in scorers.items():
                if engine == "hf" and ref_name == "hf bf16 engine":
                    continue
                ref = forward_logprobs(model, batch)[0]
                m = mismatch_metrics(ref, batch.rollout_logprobs, batch.response_mask)
                d = (ref - batch.rollout_logprobs)[batch.response_mask].abs()
                figures[f"{engine} bf16 vs {ref_name}"] = {
                    "k3": m["mismatch/k3"], "max_abs_dlogp": float(d.max()), "mean_abs_dlogp": float(d.mean()),
                    "tokens": int(batch.response_mask.sum())}
    import vllm

    meta = {"vllm": vllm.__version__, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "prompts": args.prompts, "group": args.group, "init_std": args.init_std, "seed": args.seed}
    print(f"{'pair':<38} {'k3':>10} {'max|dlogp|':>11} {'mean|dlogp|':>12} {'tokens':>7}")
    for name, f in figures.items():
        print(f"{name:<38} {f['k3']:>10.3e} {f['max_abs_dlogp']:>11.4f} {f['mean_abs_dlogp']:>12.2e} {f['tokens']:>7d}")
    print(json.dumps(meta))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "figures": figures}, fh, indent=1)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is required
    main()
