"""Checkpoint directories in the hub's format, written here: the test doubles of a user's checkpoint.

Nothing may be downloaded, yet the real-checkpoint path (moerl.models.pretrained) must be exercised as a
user's directory would: so for each family this writes a tiny model of that family with transformers'
``save_pretrained`` (the hub's tensor names, per-expert weights), a byte-level BPE tokenizer trained here on
math text with ChatML turn tokens, a ``chat_template.jinja``, a ``generation_config.json`` whose EOS list
holds the end-of-turn token, and a vocabulary padded past the tokenizer's length, as hub checkpoints pad
theirs. It cannot reproduce a pretrained model's routing margins; it reproduces every file a loader reads.

    python scripts/write_checkpoint_double.py olmoe /tmp/olmoe-double
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML, as Qwen and OLMoE-Instruct-style templates render it.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
VOCAB_PADDING = 64  # config.vocab_size is the tokenizer's length rounded up past this multiple


def _tiny_configs(vocab_size: int, ids: dict) -> dict:
    from transformers import (DeepseekV2Config, DeepseekV3Config, GraniteMoeConfig, MixtralConfig, OlmoeConfig,
                              Qwen2MoeConfig, Qwen3MoeConfig)

    # head_dim 32: vLLM's CPU attention refuses smaller heads ("Unsupported CPU attention configuration")
    common = dict(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=1024, tie_word_embeddings=False, **ids)
    mla = dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
    return {
        "olmoe": lambda: OlmoeConfig(**common, num_key_value_heads=2, intermediate_size=32, num_experts=8,
                                     num_experts_per_tok=2),
        "qwen3_moe": lambda: Qwen3MoeConfig(**common, num_key_value_heads=1, head_dim=32, intermediate_size=128,
                                            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                            norm_topk_prob=True),
        "qwen2_moe": lambda: Qwen2MoeConfig(**common, num_key_value_heads=1, intermediate_size=128,
                                            moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                            num_experts=8, num_experts_per_tok=2),
        "mixtral": lambda: MixtralConfig(**common, num_key_value_heads=1, intermediate_size=32, num_local_experts=4,
                                         num_experts_per_tok=2),
        "granitemoe": lambda: GraniteMoeConfig(**common, num_key_value_heads=2, intermediate_size=32,
                                               num_local_experts=4, num_experts_per_tok=2),
        # Moonlight-16B-A3B's shape, shrunk: one dense first layer, shared experts, sigmoid routing, no q LoRA.
        "deepseek_v3": lambda: DeepseekV3Config(**{**common, "num_hidden_layers": 3}, num_key_value_heads=2,
                                                intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                                n_group=1, topk_group=1, norm_topk_prob=True, **mla),
        # DeepSeek-V2-Lite's shape, shrunk: one dense first layer, two shared experts, softmax greedy routing.
        "deepseek_v2": lambda: DeepseekV2Config(**{**common, "num_hidden_layers": 3}, num_key_value_heads=2,
                                                intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                                                num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
                                                topk_method="greedy", n_group=1, topk_group=1, **mla),
    }


def math_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """GSM8K-like word problems and worked answers (the BPE merges' training text)."""
    rng = random.Random(seed)
    names, things = ["Ada", "Ben", "Chen", "Dana", "Eli"], ["apples", "books", "coins", "marbles", "pens"]
    out = []
    for _ in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 9), rng.randint(2, 9)
        who, what = rng.choice(names), rng.choice(things)
        out.append(f"{who} has {a} {what} and buys {b} bags of {c} {what}. How many {what} does {who} have now? "
                   f"Let's think step by step and output the final answer after \"####\". "
                   f"{b} * {c} = {b * c}. {a} + {b * c} = {a + b * c}. #### {a + b * c} "
                   f"The answer is \\boxed{{{a + b * c}}}.")
    return out


def train_tokenizer(corpus: list[str], vocab_size: int = 512):
    """A byte-level BPE tokenizer (GPT-2 / Qwen style) trained on ``corpus``, with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=ENDOFTEXT,
                                  bos_token=None, padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_double(model_type: str, out_dir: str | Path, seed: int = 0, chat_template: bool = True,
                 init_std: float = 0.1) -> Path:
    """Write a tiny ``model_type`` checkpoint directory to ``out_dir`` (created); returns it."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(math_corpus(seed=seed))
    if not chat_template:
        tok.chat_template = None
    padded = (len(tok) // VOCAB_PADDING + 1) * VOCAB_PADDING  # strictly past the tokenizer's length
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
               bos_token_id=tok.convert_tokens_to_ids(ENDOFTEXT))
    configs = _tiny_configs(padded, ids)
    if model_type not in configs:
        raise ValueError(f"no test double for model_type {model_type!r} (have: {', '.join(configs)})")
    config = configs[model_type]()
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=[tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)],
                     pad_token_id=tok.pad_token_id).save_pretrained(out_dir)
    if chat_template and not (out_dir / "chat_template.jinja").exists():  # older transformers keep it in the config
        (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out_dir


def write_gsm8k_file(path: str | Path, n: int = 64, seed: int = 0, verl_format: bool = False) -> Path:
    """GSM8K-shaped rows (``question``, ``answer`` ending in ``#### n``) as jsonl, or as verl's parquet
    (``prompt`` chat list, ``reward_model.ground_truth``) when ``verl_format``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 9), rng.randint(2, 9)
        rows.append({"question": f"Ada has {a} coins and finds {b} bags of {c} coins. How many coins does she have?",
                     "answer": f"{b} * {c} = {b * c}. {a} + {b * c} = {a + b * c}.\n#### {a + b * c}"})
    if not verl_format:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    import pandas as pd

    pd.DataFrame([{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": r["question"]}],
                   "ability": "math", "reward_model": {"style": "rule", "ground_truth": r["answer"].split("####")[-1].strip()},
                   "extra_info": {"index": i}} for i, r in enumerate(rows)]).to_parquet(path)
    return path
