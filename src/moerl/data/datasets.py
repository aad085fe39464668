"""Real math datasets (GSM8K, MATH/DAPO-style) from local parquet/jsonl via `datasets`, or the hub.

Every loader returns plain rows ``{"question", "answer"}``; rows missing either (or, for GSM8K,
whose gold answer is not a number) are skipped, counted and logged with file and row rather than
silently turned into empty prompts. A file that cannot be read at all (empty, a line that is not
JSON, no usable row) is a DataError naming the file and line, raised before a run writes anything.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)

_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$|^[+-]?\d+/\d+$")


class DataError(ValueError):
    """A dataset file that cannot give training or test rows; the message names file and line."""

QUESTION_KEYS = ("question", "problem", "prompt", "query")
# reward_model: verl's parquet column {"style": "rule", "ground_truth": ...} (the gold answer only).
ANSWER_KEYS = ("answer", "solution", "ground_truth", "final_answer", "reward_model")
# The instructions verl's preprocessing appends to a question (examples/data_preprocess/gsm8k.py, math_dataset.py,
# DAPO's): a prompt read from verl's ``prompt`` column is the question again once they are removed, so the
# checkpoint's own instruction (moerl.data.prompts) is not asked twice.
VERL_INSTRUCTIONS = ('Let\'s think step by step and output the final answer after "####".',
                     "Let's think step by step and output the final answer within \\boxed{}.",
                     'Please output the final answer within \\boxed{}.')


def strip_instruction(question: str) -> str:
    text = question.rstrip()
    for instruction in VERL_INSTRUCTIONS:
        if text.endswith(instruction):
            return text[: -len(instruction)].rstrip()
    return question


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


def _problem(question, raw, answer, task: str) -> str | None:
    """Why a row cannot be used, or None."""
    if question is None:
        return "no question (expected one of " + ", ".join(QUESTION_KEYS) + ")"
    if raw is None:
        return "no answer (expected one of " + ", ".join(ANSWER_KEYS) + ")"
    if answer is None:
        return "no final answer (expected '#### <number>')" if task == "gsm8k" else "no final answer"
    if task == "gsm8k" and not _NUMBER.match(answer):
        return f"gold answer {answer!r} is not a number (expected '#### <number>')"
    return None


def rows_from_records(records, task: str, source: str, row_label: str = "row") -> list[dict]:
    """``records``: dicts, or (label, dict) pairs when rows are better named by file line."""
    extract = gsm8k_answer if task == "gsm8k" else math_answer
    rows, skipped = [], 0
    for i, rec in enumerate(records):
        where, rec = rec if isinstance(rec, tuple) else (i, rec)
        if not isinstance(rec, dict):
            problem = f"expected a JSON object, got {type(rec).__name__}"
        else:
            question, raw = _first(rec, QUESTION_KEYS), _first(rec, ANSWER_KEYS)
            question = None if question is None else strip_instruction(question)
            # a bare gold number (verl's reward_model.ground_truth) is a GSM8K answer as it stands
            bare = raw is not None and (task == "math" or bool(_NUMBER.match(raw.strip().replace(",", ""))))
            answer = None if raw is None else (extract(raw) or (raw.strip().replace(",", "") if task == "gsm8k" and bare
                                                                else raw.strip() if bare else None))
            problem = _problem(question, raw, answer, task)
        if problem is not None:
            skipped += 1
            if skipped <= 3:
                log.warning("%s: %s %s: %s; skipped", source, row_label, where, problem)
            continue
        rows.append({"question": question, "answer": answer})
    if skipped:
        log.warning("%s: skipped %d of %d rows without a question or answer", source, skipped,
                    skipped + len(rows))
    return rows


def load_local(path: str | Path, task: str) -> list[dict]:
    """Rows from a local .parquet / .jsonl / .json file (jsonl read here; the others through ``datasets``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {path} (data.train_path / data.test_path)")
    kind = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "json"}.get(path.suffix)
    if kind is None:
        raise DataError(f"{path}: unsupported dataset format '{path.suffix}' (expected .parquet, .jsonl, .json)")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file (expected {'one JSON object per line' if kind == 'jsonl' else 'rows'} "
                        f"with a question and an answer)")
    if kind == "jsonl":  # read here so a bad line is named by its line number
        records = []
        for n, raw in enumerate(path.read_bytes().splitlines(), start=1):
            try:  # per line, so a stray byte is named by its line rather than by an offset into the file
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}: line {n} is not UTF-8 text (byte {raw[err.start]:#04x} at column "
                                f"{err.start + 1}); expected one UTF-8 JSON object per line") from None
            if not line.strip():
                continue
            try:
                records.append((n, json.loads(line)))
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: line {n} is not valid JSON ({err.msg} at column {err.colno}); "
                                f"expected one JSON object per line") from None
        if not records:
            raise DataError(f"{path}: no rows, only blank lines (expected one JSON object per line)")
        return rows_from_records(records, task, str(path), row_label="line")
    from datasets import load_dataset

    try:
        ds = load_dataset(kind, data_files=str(path), split="train")
    except Exception as err:  # noqa: BLE001 - pyarrow/datasets errors do not name the file
        raise DataError(f"{path}: cannot read as {kind} ({type(err).__name__}: {' '.join(str(err).split())[:200]})") \
            from None
    return rows_from_records(ds, task, str(path))


def load_hub(hub_id: str, split: str, task: str) -> list[dict]:
    """Rows from the Hugging Face hub (needs network; e.g. ``openai/gsm8k`` with config ``main``)."""
    from datasets import load_dataset

    name = "main" if hub_id == "openai/gsm8k" else None
    ds = load_dataset(hub_id, name, split=split)
    return rows_from_records(ds, task, f"{hub_id}[{split}]")
