"""A character-level tokenizer built with `tokenizers`, saved next to the model.

Why not a pretrained tokenizer: nothing may be downloaded at run time, and a tiny MoE learns
arithmetic far faster over characters (vocab ~100) than over a 150k-token BPE vocabulary.
Printable ASCII covers the synthetic task and GSM8K/MATH-style text alike; ``\\boxed{`` is one
token so an answer costs a handful of tokens.
"""
from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK, BOXED = "<pad>", "<bos>", "<eos>", "<unk>", "\\boxed{"
SPECIALS = [PAD, BOS, EOS, UNK]


def build_tokenizer() -> PreTrainedTokenizerFast:
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + [BOXED] + chars)}
    core = Tokenizer(WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIALS)
    core.add_tokens([BOXED])  # matched whole, before character splitting
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                  unk_token=UNK, padding_side="left")
    return tok
