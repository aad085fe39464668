import json

import pytest

from moerl.config import DataConfig
from moerl.data import load_splits
from moerl.data.datasets import gsm8k_answer, last_boxed, load_local, math_answer
from moerl.data.synthetic import arith_splits
from moerl.data.verl_format import to_verl_records, write_verl_parquet


def test_arith_is_seeded_disjoint_and_correct():
    train, test = arith_splits(2000, 100, seed=7)
    again, _ = arith_splits(2000, 100, seed=7)
    assert train == again
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    for row in train[:50]:
        a, rest = row["question"].rstrip("=").split("+")
        b, c = rest.split("*")
        assert int(row["answer"]) == int(a) + int(b) * int(c)


def test_tokenizer_round_trip_and_boxed_token(tokenizer):
    text = "<bos>12+3*4=\\boxed{24}<eos>"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.convert_ids_to_tokens(ids).count("\\boxed{") == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12+3*4=\\boxed{24}"


def test_answer_extraction():
    assert gsm8k_answer("so 3+4 = 7\n#### 1,234") == "1234"
    assert gsm8k_answer("no marker") is None
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert math_answer("The answer is \\boxed{x^{2}}.") == "x^{2}"


def test_local_jsonl_skips_bad_rows_and_names_missing_file(tmp_path, caplog):
    path = tmp_path / "gsm.jsonl"
    rows = [{"question": "1+1?", "answer": "it is 2\n#### 2"}, {"question": "", "answer": "#### 3"},
            {"question": "no answer", "answer": "none here"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    out = load_local(path, "gsm8k")
    assert out == [{"question": "1+1?", "answer": "2"}]
    assert "skipped 2 of 3 rows" in caplog.text
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        load_local(tmp_path / "missing.parquet", "gsm8k")
    with pytest.raises(ValueError, match="needs data.train_path"):
        load_splits(DataConfig(task="gsm8k"))


def test_verl_parquet_schema(tmp_path):
    import pandas as pd

    rows = [{"question": "2+3*4=", "answer": "14"}]
    rec = to_verl_records(rows, "arith", "train")[0]
    assert set(rec) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert rec["reward_model"] == {"style": "rule", "ground_truth": "14"}
    path = write_verl_parquet(rows, "arith", "train", tmp_path / "train.parquet")
    df = pd.read_parquet(path)
    assert list(df.columns) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert load_local(path, "math") == [{"question": "2+3*4=", "answer": "14"}]


def test_worked_arithmetic_task_answers_are_long_correct_and_held_out():
    from moerl.config import DataConfig
    from moerl.data import load_splits
    from moerl.data.prompts import render_prompt, render_target
    from moerl.data.tokenizer import build_tokenizer
    from moerl.reward import batch_rewards

    train, test = load_splits(DataConfig(task="arith_steps", train_size=400, test_size=50, seed=3))
    assert len(train) == 400 and len(test) == 50
    assert not {r["question"] for r in test} & {r["question"] for r in train}
    tok = build_tokenizer()
    for row in train[:100]:
        q = row["question"]
        a, rest = q[:-1].split("+")
        b, rest = rest.split("*")
        c, d = rest.split("-")
        assert int(row["answer"]) == int(a) + int(b) * int(c) - int(d)
        target = render_target(row["answer"], row["target"])
        assert target.endswith("\\boxed{" + row["answer"] + "}") and render_prompt("arith_steps", q) == q
        assert len(tok(target + "<eos>", add_special_tokens=False).input_ids) >= 24
    assert batch_rewards([r["target"] for r in train[:20]], [r["answer"] for r in train[:20]]) == [1.0] * 20


def test_calibration_rows_lie_outside_both_splits_and_are_stable():
    from moerl.data.synthetic import worked_calibration_rows, worked_splits

    train, test = worked_splits(2000, 256, seed=1234)
    rows = worked_calibration_rows(256, 1234, train, test)
    questions = [r["question"] for r in rows]
    assert len(set(questions)) == 256
    assert not set(questions) & ({r["question"] for r in train} | {r["question"] for r in test})
    assert worked_calibration_rows(256, 1234, train, test) == rows  # its own generator: the same set every call
    with pytest.raises(ValueError, match="only"):
        worked_calibration_rows(10 ** 6, 1234, train, test)
