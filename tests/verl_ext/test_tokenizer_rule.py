"""The tokenizer path Kimi-K2 and Moonlight use (a tiktoken ``TikTokenTokenizer`` loaded through
auto_map with trust_remote_code) under the pinned transformers, on a small tokenizer the repo makes
(tests/fixtures/kimi_tokenizer: nothing downloaded; the tokenizer code is a stand-in with the same
shape as Moonshot's, not Moonshot's file)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from moerl import planner
from moerl.verl_ext import constraints as C

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "kimi_tokenizer"
_spec = importlib.util.spec_from_file_location("make_kimi_tokenizer", FIX / "make_fixture.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)
K2 = planner.load_public_config("kimi_k2")

pytest.importorskip("tiktoken")


def test_fixture_is_what_its_generator_writes(tmp_path):
    make.write(tmp_path / "new", tmp_path / "old")
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / "new" / name).read_text() == (FIX / name).read_text()
        assert (tmp_path / "old" / name).read_text() == (make.OLD_IMPORT / name).read_text()
    assert (tmp_path / "old" / "tokenization_kimi.py").read_text() == (make.OLD_IMPORT / "tokenization_kimi.py").read_text()


def test_kimi_style_tiktoken_tokenizer_loads_as_verl_loads_it():
    from verl.utils.tokenizer.tokenizer import hf_tokenizer

    f = C.check_all(C.LaunchSpec(model=K2, n_gpus=1, verl={"model_path": str(FIX), "trust_remote_code": True}),
                    only=("model.tokenizer_loads",))[0]
    assert f.ok and "TikTokenTokenizer" in f.detail and "5 special tokens" in f.detail
    tok = hf_tokenizer(str(FIX), trust_remote_code=True)
    ids = tok.encode("hello world<|im_end|>", add_special_tokens=False)
    assert ids == [259, 264, 267] and tok.decode(ids) == "hello world<|im_end|>"


def test_the_old_gpt2_import_is_refused_with_the_workaround():
    f = C.check_all(C.LaunchSpec(model=K2, n_gpus=1, verl={"model_path": str(make.OLD_IMPORT),
                                                           "trust_remote_code": True}), only=("model.tokenizer_loads",))[0]
    assert not f.ok and "bytes_to_unicode" in f.detail and "convert_slow_tokenizer" in f.detail and "#414" in f.detail


def test_a_hub_id_or_absent_directory_is_not_checked_here():
    spec = C.LaunchSpec(model=K2, n_gpus=1, verl={"model_path": "moonshotai/Kimi-K2-Instruct", "trust_remote_code": True})
    assert C.check_all(spec, only=("model.tokenizer_loads",)) == []
