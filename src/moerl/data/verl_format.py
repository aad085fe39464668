"""Convert rows to verl's RL parquet schema (data_source, prompt, ability, reward_model, extra_info)."""
from __future__ import annotations

from pathlib import Path

from moerl.data.prompts import render_prompt


def to_verl_records(rows: list[dict], task: str, split: str, data_source: str | None = None) -> list[dict]:
    source = data_source or {"arith": "moerl/arith", "gsm8k": "openai/gsm8k", "math": "math"}[task]
    return [
        {
            "data_source": source,
            "prompt": [{"role": "user", "content": render_prompt(task, row["question"])}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": row["answer"]},
            "extra_info": {"split": split, "index": i, "question": row["question"], "answer": row["answer"]},
        }
        for i, row in enumerate(rows)
    ]


def write_verl_parquet(rows: list[dict], task: str, split: str, path: str | Path,
                       data_source: str | None = None) -> Path:
    """Write atomically (temp file + rename) so a crash never leaves a half-written parquet."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    pd.DataFrame(to_verl_records(rows, task, split, data_source)).to_parquet(tmp, index=False)
    tmp.replace(path)
    return path
