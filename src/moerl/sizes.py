"""Sizes a run cannot hold refused when the config is loaded, before anything is written.

Every numeric key has a lower bound, but a count like ``rollout.prompts_per_step=10**20`` is in range and
would only show as a process growing its memory until the machine gives out. Each check below is a lower
bound on the bytes one piece of the run must hold at once (the embedded engine generates a step's sequences
together; a micro-batch's logits exist together), compared with this machine's memory (the cgroup's limit
when lower). A lower bound refuses only what cannot fit; a size that passes may still be too large.
"""
from __future__ import annotations

import os
from pathlib import Path

GIB = 1 << 30
VOCAB_BOUND = 64  # at least this many token ids (the tiny tokenizer has ~100): a logits row's floor
ROW_BYTES = 100  # a generated data row (a dict of two short strings) takes at least this much


def machine_memory_bytes() -> int | None:
    """Physical memory, or the cgroup's memory limit when that is lower; None when neither is known."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge number: no limit
            sizes.append(int(text))
    return min(sizes) if sizes else None


def size_checks(cfg, memory: int | None = None) -> list[tuple[bool, str]]:
    """(fits, message) per size; each message names the keys, the lower bound and the memory."""
    memory = machine_memory_bytes() if memory is None else memory
    if not memory:
        return []
    m, r, t = cfg.model, cfg.rollout, cfg.trainer
    positions = r.max_new_tokens + 1  # a sequence holds at least one prompt token and its completion
    kv_heads = m.num_heads if m.preset == "deepseek_v3" else m.num_kv_heads
    # a sequence's keys and values in every layer, at 2 bytes a value (bf16: the smallest a rollout keeps); a
    # checkpoint (model.path) defines its own shapes, so its sequences count by their token ids only
    kv_per_position = 0 if getattr(m, "path", None) else m.num_layers * 2 * kv_heads * m.head_dim * 2
    per_sequence = positions * (kv_per_position + 8)  # + its token ids
    sequences = r.prompts_per_step * r.group_size
    have = f"this machine's {memory / GIB:.1f} GiB of memory"
    checks = [
        (sequences * per_sequence <= memory,
         f"rollout.prompts_per_step={r.prompts_per_step} x rollout.group_size={r.group_size} = {sequences} sequences "
         f"a step, generated together: at least {_gib(sequences * per_sequence)} (keys, values and token ids of "
         f"at least {positions} positions each), more than {have}; lower rollout.prompts_per_step"),
        (t.eval_size * per_sequence <= memory,
         f"trainer.eval_size={t.eval_size}: at least {_gib(t.eval_size * per_sequence)} to evaluate, more than {have}"),
        (t.micro_batch_size * positions * VOCAB_BOUND * 4 * 2 <= memory,
         f"trainer.micro_batch_size={t.micro_batch_size}: its logits and their gradient take at least "
         f"{_gib(t.micro_batch_size * positions * VOCAB_BOUND * 8)}, more than {have}"),
        (cfg.data.train_size * ROW_BYTES + cfg.data.test_size * ROW_BYTES <= memory,
         f"data.train_size={cfg.data.train_size} + data.test_size={cfg.data.test_size} rows take at least "
         f"{_gib((cfg.data.train_size + cfg.data.test_size) * ROW_BYTES)}, more than {have}"),
    ]
    if cfg.warm_start.enabled and not getattr(m, "path", None):
        batch = cfg.warm_start.batch_size * 2 * VOCAB_BOUND * 8  # a prompt token and an answer token at least
        checks.append((batch <= memory, f"warm_start.batch_size={cfg.warm_start.batch_size}: its logits and their "
                                        f"gradient take at least {_gib(batch)}, more than {have}"))
    return checks


def _gib(size: int) -> str:
    return f"{size / GIB:.3g} GiB"
