"""Write a random-init Hugging Face checkpoint of a bring-up model (nothing is downloaded).

    python scripts/make_bringup_checkpoint.py tiny_kimi_k2 /scratch/ckpt/tiny_kimi_k2
    python scripts/make_bringup_checkpoint.py kimi_k2_5layers /scratch/ckpt/kimi_k2_5layers   # ~137 GB

The model is one of moerl's public configs (src/moerl/models/public_configs/<name>.json): the tiny
models of each scale experiment's family (rung 1 of the bring-up ladder) or Kimi-K2 cut to 5 layers
(rung 3). It is written by transformers' own ``save_pretrained`` (Hub layout: one tensor per
expert, the names vLLM and Megatron-Bridge load) with moerl's character tokenizer and a plain chat
template, so verl, Megatron-Bridge and vLLM read it as they read a downloaded model. Random weights
test the system (loading, sharding, refit, routing replay, numerics), not learning.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# verl's dataset applies the chat template to every prompt; one message per line is enough here
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}{% endif %}")


def hf_config(cfg: dict):
    """transformers config of a moerl public config (the keys are the model's own config.json keys)."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    keys = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("name", "family")}
    if cfg["family"] == "deepseek_v3":
        keys.pop("num_nextn_predict_layers", None)
        return DeepseekV3Config(**keys)
    return Qwen3MoeConfig(**keys)


def write(name: str, out: str | Path, seed: int = 0, max_shard_size: str = "5GB") -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from moerl import planner
    from moerl.data.tokenizer import build_tokenizer

    cfg = planner.load_public_config(name)
    tok = build_tokenizer()
    if len(tok) > cfg["vocab_size"]:
        raise SystemExit(f"{name}: vocab_size {cfg['vocab_size']} < tokenizer's {len(tok)} tokens")
    tok.chat_template = CHAT_TEMPLATE
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.config.eos_token_id, model.config.pad_token_id, model.config.bos_token_id = (
        tok.eos_token_id, tok.pad_token_id, tok.bos_token_id)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    tok.save_pretrained(out)
    (out / "moerl_bringup.json").write_text(json.dumps(
        {"public_config": name, "seed": seed, "params": sum(p.numel() for p in model.parameters()),
         "note": "random init by scripts/make_bringup_checkpoint.py; nothing downloaded"}, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="public config: tiny_kimi_k2, tiny_moonlight, tiny_qwen3_moe, kimi_k2_5layers")
    ap.add_argument("out", help="checkpoint directory to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    path = write(args.name, args.out, args.seed)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
