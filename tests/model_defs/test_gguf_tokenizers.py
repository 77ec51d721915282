"""GGUF tokenizers (model_defs/gguf.py: tokenizer_json) against transformers' own GGUF tokenizer loading.

Each file is written here with gguf's GGUFWriter and holds a tokenizer and a minimal architecture header (what
transformers reads to pick a config) but no tensors: a SentencePiece vocabulary (`tokenizer.ggml.model` llama:
pieces with scores, the 256 <0xXX> byte tokens, no merges) and a byte-level BPE one (`gpt2`, with merges) under
each `tokenizer.ggml.pre` that transformers knows. Both vocabularies are learned greedily from a short text, so
that merges, digits, contractions, newlines and runs of spaces all show. kvforge's encoding and decoding of a set
of texts must give transformers' ids and text.

Where transformers' GGUF loader and llama.cpp read a file differently, kvforge follows llama.cpp (the file's own
runtime, and the model's own SentencePiece / tokenizer.json):
- SentencePiece: transformers builds a `Metaspace` pre-tokenizer for a `llama` architecture file, which drops the
  `▁` SentencePiece puts before a text that already starts with a space (" Hi": ▁Hi, not ▁ ▁Hi) and the one after a
  special token. It builds Prepend + Replace normalizers (SentencePiece's, and llama.cpp's) only for a `phi3`
  file; kvforge does so for all, and is checked on every text against the `phi3` file's tokenizer, and on the texts
  where the two agree against the `llama` file's.
- Byte-level BPE: the `pre` values that only llama.cpp knows (smollm, starcoder, falcon, deepseek-llm, bloom, ...)
  are split as llama.cpp splits them, where transformers uses GPT-2's regex; checked against splits llama.cpp
  gives. llama-bpe and tekken files take a word the vocabulary holds whole (ignore_merges), and add BOS when the file
  does not say, as llama.cpp (and the models' own tokenizer.json) do.
The one reading kvforge takes from transformers against llama.cpp: a byte-level file whose pre is `default` (or
missing) is split with GPT-2's regex, where llama.cpp uses a fallback of its own (punctuation runs and groups of
three digits apart) and warns that the file is degraded.
(Off line, llama.cpp itself, through llama-cpp-python 0.3.36 with vocab_only, gave the ids kvforge gives for the
SentencePiece file and all these texts, and the same splits for every pre value here but `default`.)
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path

import pytest

from kvforge.tokenizer import bytes_to_unicode

from .gguf_writer import merge_pair
from kvforge.errors import KvforgeError
from kvforge.model_defs.gguf import gguf_tokenizer, read_gguf_tokenizer, tokenizer_json

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

_UNKNOWN, _NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 2, 1, 3, 4, 6
SPIECE = "\u2581"

TEXT = """The quick brown fox jumps over the lazy dog. It's the other one that's there, and they're here; we'll see.
In 2024 the model read 123456 tokens: the first one read 7 or 8 thousand, then 99 more.  Hello world!  "Quoted"
text, (parens) and tabs\tand newlines

are common. She said: I don't think that's right, but you've been there. Cafe, caf\u00e9 au lait, r\u00e9sum\u00e9.
    def read(self, tokens):
        return [t for t in tokens if t]
"""

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "  two leading spaces",
    "trailing space ",
    "line one\nline two\n\nline four\n",
    "tabs\tand  double  spaces   and three",
    "In 2024 the model read 123456 tokens, 7 or 8 thousand: 3.14159!",
    "It's what they're saying; we'll see, you've heard, I'd say. DON'T SHOUT, It'S fine",
    "na\u00efve caf\u00e9 \u65e5\u672c",
    "emoji \U0001f642 and symbols: $5 + 3 = <8> | ^~ `code` #tag @user 100%",
    "    def read(self, tokens):\n        return [t for t in tokens if t]\n",
    "",
    " ",
    "\n",
    "\n\n \n",
]


# -- vocabularies ------------------------------------------------------------------------------------------------

def _learn(words: Counter, size: int) -> list[tuple[str, str]]:
    """Greedy BPE merges over `words` (tuples of symbols, with counts): the most frequent pair first."""
    words = {tuple(w): n for w, n in words.items() if w}
    merges = []
    while len(merges) < size:
        pairs: Counter = Counter()
        for w, n in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        words = merge_pair(words, best)
    return merges


def sentencepiece_vocab(merges: int = 220) -> tuple[list[str], list[int], list[float]]:
    """(tokens, types, scores) as llama.cpp's converter writes a Llama 2 tokenizer.model: <unk> <s> </s>, the 256
    byte tokens, then the pieces best first (score -rank), the single characters last; plus a control and a
    user-defined token. Characters outside the vocabulary (ï, 日, 本, the emoji, ...) fall back to bytes."""
    chars = {ch for ch in TEXT if ch not in "\n\t"} - {" "}
    words = Counter(SPIECE + w for w in TEXT.replace("\n", " ").replace("\t", " ").split(" ") if w)
    pieces = [a + b for a, b in _learn(Counter({tuple(w): n for w, n in words.items()}), merges)]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<|end|>", "<think>"]
    types = [_UNKNOWN, _CONTROL, _CONTROL, *[_BYTE] * 256, _CONTROL, _USER_DEFINED]
    scores = [0.0] * len(tokens)
    for piece in [*dict.fromkeys(pieces), SPIECE, *sorted(chars)]:
        if piece not in tokens:
            tokens.append(piece)
            types.append(_NORMAL)
            scores.append(-float(len(scores)))
    return tokens, types, scores


def byte_level_vocab(merges: int = 300) -> tuple[list[str], list[int], list[str]]:
    """(tokens, types, merges) of a byte-level BPE: the 256 byte characters, merges learned over GPT-2's split of
    the text, then control tokens and a user-defined one."""
    from tokenizers.pre_tokenizers import ByteLevel

    pieces = Counter(p for p, _ in ByteLevel(add_prefix_space=False).pre_tokenize_str(TEXT))
    learned = _learn(Counter({tuple(p): n for p, n in pieces.items()}), merges)
    tokens = [*bytes_to_unicode().values()]
    tokens += [a + b for a, b in learned if a + b not in tokens]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [_NORMAL] * len(tokens) + [_CONTROL] * len(specials) + [_USER_DEFINED]
    return tokens + specials + ["<think>"], types, [f"{a} {b}" for a, b in learned]


def write_tokenizer_gguf(path: Path, arch: str, model: str, tokens, types, *, scores=None, merges=None, pre=None,
                         ids=(1, 2, 0, None), **flags) -> Path:
    """A GGUF file with an `arch` header (no tensors) and a tokenizer; ids: bos, eos, unknown, pad; flags:
    add_bos_token, add_eos_token, add_space_prefix, chat_template."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    for value, add in zip(ids, (w.add_bos_token_id, w.add_eos_token_id, w.add_unk_token_id, w.add_pad_token_id)):
        if value is not None:
            add(value)
    for key, value in flags.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf-tokenizers")


def oracle(path: Path):
    from transformers import AutoTokenizer
    from transformers.utils import logging

    logging.set_verbosity_error()  # a config without its model's pad id says so
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def ours(path: Path):
    return gguf_tokenizer(read_gguf_tokenizer(path))


def assert_same(path: Path, texts, reference=None):
    """kvforge's tokenizer for `path` encodes each text to the ids transformers' (for `reference`, else `path`)
    gives, with and without special tokens, and decodes them to the same text."""
    mine, theirs = ours(path), oracle(reference or path)
    for text in texts:
        for special in (True, False):
            expected = theirs.encode(text, add_special_tokens=special)
            assert mine.encode(text, add_special_tokens=special) == expected, (text, special)
        for skip in (True, False):
            assert mine.decode(expected, skip_special_tokens=skip) == theirs.decode(expected, skip_special_tokens=skip)
    return mine, theirs


# -- SentencePiece (tokenizer.ggml.model llama) -------------------------------------------------------------------

SPM_SPECIAL_TEXTS = ["<s>Hi</s> there<|end|>", "<think>hmm</think> no", "a <unk> b", "x\n<|end|>\ny"]


@pytest.fixture(scope="module")
def sentencepiece(files):
    tokens, types, scores = sentencepiece_vocab()
    return {arch: write_tokenizer_gguf(files / f"spm-{arch}.gguf", arch, "llama", tokens, types, scores=scores)
            for arch in ("llama", "phi3")}


def test_a_sentencepiece_file_encodes_as_transformers_and_sentencepiece_do(sentencepiece):
    """Llama 2 / Mistral / TinyLlama: merges from the scores, byte fallback, BOS added (no add_bos_token key),
    the prefix ▁ and the decoder's strip of it; control, unknown and user-defined tokens matched whole."""
    mine, theirs = assert_same(sentencepiece["llama"], TEXTS + SPM_SPECIAL_TEXTS, reference=sentencepiece["phi3"])
    agree = [t for t in TEXTS if not t.startswith(" ")]  # where transformers' Metaspace reading is SentencePiece's
    assert_same(sentencepiece["llama"], agree)
    ids = mine.encode("na\u00efve caf\u00e9")
    assert ids[0] == mine.bos_token_id and "<0xC3>" in [mine.backend.id_to_token(i) for i in ids]
    assert mine.encode(" Hi", add_special_tokens=False)[0] == mine.backend.token_to_id(SPIECE)  # ▁ ▁H i
    assert mine.decode(mine.encode(" Hi")) == " Hi" and mine.adds_special_tokens() == {"add_bos_token": True,
                                                                                        "add_eos_token": False}
    # a user-defined token is not skipped as special; the text after it starts with a ▁, as in llama.cpp
    assert mine.decode(mine.encode("<think>hmm")) == "<think> hmm"


def test_a_sentencepiece_files_flags_are_honoured(files):
    """add_bos_token false and add_eos_token true: encoding adds the EOS alone; the merges the file carries are
    used as they are."""
    tokens, types, scores = sentencepiece_vocab()
    path = write_tokenizer_gguf(files / "spm-eos.gguf", "phi3", "llama", tokens, types, scores=scores,
                                add_bos_token=False, add_eos_token=True)
    mine, _ = assert_same(path, TEXTS[:4])
    assert mine.adds_special_tokens() == {"add_bos_token": False, "add_eos_token": True}
    from kvforge.model_defs.gguf import merges_from_scores

    merges = [" ".join(m) for m in merges_from_scores(tokens, scores)][:150]  # a shorter list: other ids
    path = write_tokenizer_gguf(files / "spm-merges.gguf", "phi3", "llama", tokens, types, scores=scores,
                                merges=merges)
    assert_same(path, TEXTS)
    assert len(tokenizer_json(read_gguf_tokenizer(path))["model"]["merges"]) == 150


def test_a_gemma_file_has_no_prefix_space_and_merges_in_file_order(files):
    """Gemma: add_space_prefix false, runs of spaces written with real spaces, merges ranked by the order of the
    pieces in the file whatever the scores say (transformers' GemmaTokenizer reading)."""
    tokens, types, scores = sentencepiece_vocab()
    tokens = [*tokens, "  ", "    "]
    types = [*types, _NORMAL, _NORMAL]
    scores = [*reversed(scores), 0.0, 0.0]  # scores that would rank the merges backwards
    path = write_tokenizer_gguf(files / "spm-gemma.gguf", "gemma2", "llama", tokens, types, scores=scores,
                                add_space_prefix=False)
    mine, _ = assert_same(path, TEXTS + SPM_SPECIAL_TEXTS)
    four = mine.backend.token_to_id(SPIECE * 4)
    assert four == len(tokens) - 1 and four in mine.encode("a     b")
    assert mine.encode("Hi", add_special_tokens=False) != mine.encode(" Hi", add_special_tokens=False)


# -- byte-level BPE (tokenizer.ggml.model gpt2) --------------------------------------------------------------------

BPE_SPECIAL_TEXTS = ["<|im_start|>user\nHi there<|im_end|>\n", "<think>hmm</think> ok<|endoftext|>"]


def _byte_level_file(files: Path, pre: str | None, arch: str = "llama", **flags) -> Path:
    tokens, types, merges = byte_level_vocab()
    n = len(tokens)
    flags.setdefault("add_bos_token", False)
    return write_tokenizer_gguf(files / f"bpe-{pre}-{arch}-{sorted(flags.items())}.gguf", arch, "gpt2", tokens, types,
                                merges=merges, pre=pre, ids=(n - 4, n - 4, None, n - 2), **flags)


@pytest.mark.parametrize("pre", ["gpt-2", "default", None, "llama-bpe", "llama3", "qwen2", "qwen35", "gpt-4o",
                                 "tekken"])
def test_a_byte_level_file_splits_as_its_pre_tokenizer_says(files, pre):
    """Each `tokenizer.ggml.pre` transformers knows: the same ids and text as transformers' tokenizer."""
    path = _byte_level_file(files, pre, arch="qwen2" if pre == "qwen2" else "llama")
    mine, _ = assert_same(path, TEXTS + BPE_SPECIAL_TEXTS)
    assert mine.decode(mine.encode(TEXTS[7])) == TEXTS[7]
    assert mine.special_tokens["pad"] == "<|im_end|>"  # tokenizer.ggml.padding_token_id


def test_the_splits_differ_between_pre_tokenizers():
    """The pre values are not all one split: digits, contractions and newlines come out differently."""
    splits = {pre: tuple(_split(pre, SPLIT_TEXT)) for pre in ("gpt-2", "llama-bpe", "qwen2", "smollm", "default")}
    assert len(set(splits.values())) == 4 and splits["default"] == splits["gpt-2"]


def test_a_byte_level_files_bos_follows_the_file_and_llama_cpps_default(files):
    """add_bos_token true: BOS first (transformers too); no key: llama-bpe adds BOS, as llama.cpp and Llama 3's
    own tokenizer.json do (transformers would not), gpt-2 does not."""
    mine, _ = assert_same(_byte_level_file(files, "gpt-2", add_bos_token=True, add_eos_token=True), TEXTS[:3])
    assert mine.adds_special_tokens() == {"add_bos_token": True, "add_eos_token": True}
    tokens, types, merges = byte_level_vocab()
    for pre, adds in (("llama-bpe", True), ("gpt-2", False)):
        path = write_tokenizer_gguf(files / f"bpe-nokey-{pre}.gguf", "llama", "gpt2", tokens, types, merges=merges,
                                    pre=pre, ids=(len(tokens) - 4, len(tokens) - 4, None, None))
        assert ours(path).adds_special_tokens()["add_bos_token"] is adds


def test_llama3_takes_a_word_of_the_vocabulary_whole(files):
    """ignore_merges (llama-bpe, tekken): a piece the vocabulary holds is one token even where no merge makes it."""
    tokens, types, merges = byte_level_vocab()
    tokens = [*tokens, "Ġzyx"]
    types = [*types, _NORMAL]
    for pre, whole in (("llama-bpe", True), ("gpt-2", False)):
        path = write_tokenizer_gguf(files / f"bpe-whole-{pre}.gguf", "llama", "gpt2", tokens, types, merges=merges,
                                    pre=pre, add_bos_token=False)
        assert (ours(path).encode(" zyx") == [len(tokens) - 1]) is whole


# Splits llama.cpp (llama-cpp-python 0.3.36, vocab-only) makes of one text under pre values transformers does not
# know (it would split all of them with GPT-2's regex): one token per piece, with a vocabulary that joins any text
SPLIT_TEXT = "Hello, world!! It's 2024: 12345 caf\u00e9s\n\n  ok \u65e5\u672c\u8a9e"
LLAMA_CPP_SPLITS = {
    "smollm": ["Hello", ",", " world", "!!", " It", "'s", " ", "2", "0", "2", "4", ":", " ", "1", "2", "3", "4", "5",
        " caf\u00e9s", "\n\n ", " ok", " \u65e5\u672c\u8a9e"],
    "falcon": ["Hello", ",", " world", "!!", " It", "'", "s", " ", "202", "4", ":", " ", "123", "45", " caf\u00e9s",
        "\n\n ", " ok", " \u65e5\u672c\u8a9e"],
    "deepseek-llm": ["Hello", ",", " world", "!!", " It", "'", "s", " ", "2024", ":", " ", "12345", " caf", "\u00e9",
        "s", "\n", "\n", " ", " ok", " ", "\u65e5\u672c\u8a9e"],
    "deepseek-coder": ["Hello", ",", " world", "!!", " It", "'", "s", " ", "2", "0", "2", "4", ":", " ", "1", "2",
        "3", "4", "5", " caf\u00e9s", "\n", "\n", " ", " ok", " ", "\u65e5\u672c\u8a9e"],
    "bloom": ["Hello", ",", " world", "!!", " It's", " 2024:", " 12345", " caf\u00e9s", "\n\n ", " ok",
        " \u65e5\u672c\u8a9e"],
}


def _split(pre: str, text: str) -> list[str]:
    """The pieces kvforge's pre-tokenizer for `pre` cuts `text` into."""
    from tokenizers import Tokenizer

    record = {"model": "gpt2", "pre": pre, "tokens": ["a"], "types": [_NORMAL], "merges": [], "ids": {}}
    backend = Tokenizer.from_str(json.dumps(tokenizer_json(record)))
    byte = {c: b for b, c in bytes_to_unicode().items()}
    return [bytes(byte[c] for c in piece).decode() for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre", sorted(LLAMA_CPP_SPLITS))
def test_pre_tokenizers_only_llama_cpp_knows_split_as_llama_cpp(pre):
    assert _split(pre, SPLIT_TEXT) == LLAMA_CPP_SPLITS[pre]


def test_smollm_keeps_its_split(files):
    """SmolLM's file (pre smollm): each digit alone, then GPT-2's regex: the pre-tokenizer SmolLM's tokenizer.json has."""
    data = tokenizer_json(read_gguf_tokenizer(_byte_level_file(files, "smollm")))
    assert data["pre_tokenizer"] == {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}


def test_an_unknown_pre_tokenizer_falls_back_to_gpt2_with_a_warning(files):
    path = _byte_level_file(files, "no-such-split")
    with pytest.warns(UserWarning, match="'no-such-split' is not a pre-tokenizer kvforge knows.*GPT-2"):
        mine = ours(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert mine.encode(TEXTS[8]) == ours(_byte_level_file(files, "gpt-2")).encode(TEXTS[8])


@pytest.mark.parametrize("model, named", [("bert", "WordPiece"), ("t5", "Unigram"), ("rwkv", "RWKV"),
                                          ("no-such-model", "")])
def test_other_tokenizer_models_are_refused_by_name(files, model, named):
    path = write_tokenizer_gguf(files / f"other-{model}.gguf", "llama", model, ["<unk>", "a"], [_UNKNOWN, _NORMAL],
                                scores=[0.0, -1.0])
    with pytest.raises(KvforgeError, match=f"GGUF tokenizer model '{model}'.*{named}.*is not supported") as error:
        ours(path)
    assert "'llama' (SentencePiece BPE) and 'gpt2' (byte-level BPE)" in str(error.value)
