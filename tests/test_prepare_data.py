"""scripts/prepare_data.py writes verl parquet files verl's RLHFDataset schema expects."""
import json

import pandas as pd

from tests_helpers import load_script


def _main():
    return load_script("scripts/prepare_data.py", "_prepare_data").main


def test_synthetic_fallback(tmp_path):
    assert _main()(["--task", "arith", "--train-size", "50", "--test-size", "8", "--out", str(tmp_path)]) == 0
    train = pd.read_parquet(tmp_path / "math" / "train.parquet")
    test = pd.read_parquet(tmp_path / "math" / "test.parquet")
    assert len(train) == 50 and len(test) == 8
    assert set(train.columns) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    row = train.iloc[0]
    assert row["prompt"][0]["role"] == "user" and row["reward_model"]["ground_truth"]
    assert not set(train["extra_info"].map(lambda e: e["question"])) & set(test["extra_info"].map(lambda e: e["question"]))


def test_local_gsm8k_file(tmp_path):
    src = tmp_path / "gsm.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [
        {"question": "1+1?", "answer": "one and one\n#### 2"},
        {"question": "no answer here", "answer": "none"},
    ]))
    assert _main()(["--task", "gsm8k", "--train", str(src), "--out", str(tmp_path / "o"), "--name", "gsm8k"]) == 0
    df = pd.read_parquet(tmp_path / "o" / "gsm8k" / "train.parquet")
    assert list(df["reward_model"].map(lambda r: r["ground_truth"])) == ["2"]


def test_real_task_without_source_is_an_error(tmp_path, capsys):
    assert _main()(["--task", "math", "--out", str(tmp_path)]) == 2
    assert "--task arith" in capsys.readouterr().err
