"""Real math datasets (GSM8K, MATH/DAPO-style) from local parquet/jsonl via `datasets`, or the hub.

Every loader returns plain rows ``{"question", "answer"}``; rows missing either are skipped,
counted and logged rather than silently turned into empty prompts.
"""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

QUESTION_KEYS = ("question", "problem", "prompt", "query")
ANSWER_KEYS = ("answer", "solution", "ground_truth", "final_answer")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (brace-matched). math-verify parses boxed answers but
    has no public helper that returns the raw string, which is what the dataset rows need."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    out = []
    while i < len(text):
        ch = text[i]
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return "".join(out).strip()
        out.append(ch)
        i += 1
    return None


def gsm8k_answer(text: str) -> str | None:
    """GSM8K solutions end with ``#### <number>``."""
    if "####" not in text:
        return None
    ans = text.split("####")[-1].strip().replace(",", "")
    return ans or None


def math_answer(text: str) -> str | None:
    """MATH/DAPO solutions carry the answer in ``\\boxed{}``; a bare short answer is taken as is."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    text = text.strip()
    return text if text and len(text) < 64 and "\n" not in text else None


def _first(row: dict, keys: tuple[str, ...]):
    extra = row.get("extra_info")
    if isinstance(extra, dict):  # our own verl parquet keeps the raw question/answer here
        row = {**row, **{k: v for k, v in extra.items() if k in keys}}
    for key in keys:
        value = row.get(key)
        if not isinstance(value, (str, dict)) and hasattr(value, "__len__") and len(value) \
                and isinstance(value[-1], dict):  # chat-format prompt (list, or array from parquet)
            value = value[-1].get("content")
        if isinstance(value, dict):  # verl reward_model column
            value = value.get("ground_truth")
        if value not in (None, ""):
            return str(value)
    return None


def rows_from_records(records, task: str, source: str) -> list[dict]:
    extract = gsm8k_answer if task == "gsm8k" else math_answer
    rows, skipped = [], 0
    for i, rec in enumerate(records):
        question, raw = _first(rec, QUESTION_KEYS), _first(rec, ANSWER_KEYS)
        answer = None if raw is None else (extract(raw) or (raw.strip() if task == "math" else None))
        if question is None or answer is None:
            skipped += 1
            if skipped <= 3:
                log.warning("%s: row %d has no %s; skipped", source, i,
                            "question" if question is None else "answer")
            continue
        rows.append({"question": question, "answer": answer})
    if skipped:
        log.warning("%s: skipped %d of %d rows without a question or answer", source, skipped,
                    skipped + len(rows))
    return rows


def load_local(path: str | Path, task: str) -> list[dict]:
    """Rows from a local .parquet / .jsonl / .json file."""
    from datasets import load_dataset

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {path} (data.train_path / data.test_path)")
    kind = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}.get(path.suffix)
    if kind is None:
        raise ValueError(f"{path}: unsupported dataset format '{path.suffix}' (expected .parquet, .jsonl, .json)")
    ds = load_dataset(kind, data_files=str(path), split="train")
    return rows_from_records(ds, task, str(path))


def load_hub(hub_id: str, split: str, task: str) -> list[dict]:
    """Rows from the Hugging Face hub (needs network; e.g. ``openai/gsm8k`` with config ``main``)."""
    from datasets import load_dataset

    name = "main" if hub_id == "openai/gsm8k" else None
    ds = load_dataset(hub_id, name, split=split)
    return rows_from_records(ds, task, f"{hub_id}[{split}]")
