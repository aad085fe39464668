"""Checks of a task's rows against the model that will read them, before a run writes anything.

The tokenizer knows printable ASCII and newlines only (moerl.data.tokenizer): any other character
reaches the model as ``<unk>``, which a run should say rather than hide. A prompt that with
``rollout.max_new_tokens`` does not fit the model's positions cannot be generated correctly (and
costs memory for nothing): it is refused, naming the split and row.
"""
from __future__ import annotations

import logging

from moerl.config import ExperimentConfig
from moerl.data.datasets import DataError
from moerl.data.prompts import render_prompt
from moerl.data.tokenizer import BOS, build_tokenizer

log = logging.getLogger(__name__)


def split_sources(cfg: ExperimentConfig) -> tuple[str, str]:
    """How the (train, test) rows of ``cfg`` are named in messages: the config key and its value."""
    d = cfg.data
    if d.task in ("arith", "arith_steps"):
        return f"data.task={d.task} (training rows)", f"data.task={d.task} (test rows)"
    if d.train_path:
        return f"data.train_path={d.train_path}", f"data.test_path={d.test_path}"
    return f"data.hub_id={d.hub_id}[train]", f"data.hub_id={d.hub_id}[test]"


def check_rows(cfg: ExperimentConfig, train: list[dict], test: list[dict], max_positions: int) -> None:
    """Warn (one line per split) about characters the tokenizer maps to ``<unk>``; raise a DataError
    for the first prompt that with ``rollout.max_new_tokens`` exceeds ``max_positions``."""
    tokenizer = build_tokenizer()
    known = {t for t in tokenizer.get_vocab() if len(t) == 1}
    budget = max_positions - cfg.rollout.max_new_tokens
    for rows, source in zip((train, test), split_sources(cfg)):
        unknown, first = 0, None
        for i, row in enumerate(rows):
            strange = sorted({c for c in row["question"] + row["answer"] if c not in known})
            if strange:
                unknown += 1
                first = first or (i, strange)
            prompt = BOS + render_prompt(cfg.data.task, row["question"])
            if len(prompt) > budget:  # characters bound the tokens from above (one token per character at most)
                n = len(tokenizer(prompt, add_special_tokens=False).input_ids)
                if n > budget:
                    raise DataError(f"{source}: row {i}: its prompt is {n} tokens, which with rollout.max_new_tokens="
                                    f"{cfg.rollout.max_new_tokens} exceeds the model's {max_positions} positions; "
                                    f"drop or shorten the row")
        if unknown:
            i, chars = first
            log.warning("%s: %d of %d rows hold characters the tokenizer does not know (first: row %d, %s): the "
                        "model reads each as <unk>", source, unknown, len(rows), i,
                        ", ".join(repr(c) for c in chars[:5]))
