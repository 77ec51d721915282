"""Tokenizers: the built-in byte-level one and tokenizer.json files, against transformers as oracle."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.errors import KvforgeError
from kvforge.tokenizer import Tokenizer


SPECIAL_STRINGS = ("<s>", "</s>", "<pad>")


@settings(max_examples=200, deadline=None)
@given(st.text().filter(lambda t: not any(s in t for s in SPECIAL_STRINGS)))
def test_byte_level_round_trips_any_text(text):
    tok = Tokenizer.byte_level()
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_level_special_tokens():
    tok = Tokenizer.byte_level()
    assert tok.vocab_size == 259
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    assert tok.encode("ab") == [256, 97, 98]  # post-processor prepends <s>
    assert tok.decode([256, 97, 257, 98]) == "ab"
    assert tok.decode([256, 97], skip_special_tokens=False) == "<s>a"
    # an id past the tokenizer (a model vocabulary padded beyond it) has no text, as in transformers
    assert tok.decode([97, 259, 98]) == "ab"
    with pytest.raises(KvforgeError, match=r"token ids \[-1\] are negative"):
        tok.decode([97, -1])
    # As in transformers, a special token's text inside the input is that special token.
    assert tok.encode("a</s>", add_special_tokens=False) == [97, 257]


def test_saved_tokenizer_matches_transformers_fast_tokenizer(tmp_path):
    """The byte-level tokenizer.json is a standard file: transformers reads it and agrees."""
    from transformers import PreTrainedTokenizerFast

    Tokenizer.byte_level().save(tmp_path)
    ours = Tokenizer.from_file(tmp_path / "tokenizer.json")
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    for text in ["def f(x):\n    return x * 2", "naïve café ☕", ""]:
        assert ours.encode(text) == theirs(text)["input_ids"]
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs(text)["input_ids"], skip_special_tokens=True)


def test_tokenizer_json_post_processing_is_honoured(tmp_path):
    """A BPE tokenizer.json whose template adds BOS and EOS around a sequence."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = HFTokenizer(models.BPE(unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator(["hello world, hello there"] * 20, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "[BOS]", "[EOS]"]))
    tk.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", tk.token_to_id("[BOS]")), ("[EOS]", tk.token_to_id("[EOS]"))]
    )
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "[BOS]"}, "eos_token": "[EOS]"}))
    ours = Tokenizer.from_file(tmp_path)
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    ids = ours.encode("hello there")
    assert ids == theirs("hello there")["input_ids"]
    assert ids[0] == ours.bos_token_id and ids[-1] == ours.eos_token_id
    assert ours.encode("hello there", add_special_tokens=False) == ids[1:-1]


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(KvforgeError, match="no tokenizer file"):
        Tokenizer.from_file(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(KvforgeError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(tmp_path)
    Tokenizer.byte_level().save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<nope>"}))
    with pytest.raises(KvforgeError, match="bos token '<nope>' is not in the tokenizer's vocabulary"):
        Tokenizer.from_file(tmp_path)
