"""Calibration data: text or JSONL files tokenized with the bundle's tokenizer.

Without a file, `tiny` calibrates on its built-in corpus (text from its
training split) and any other model with a tokenizer on the built-in English
prose (kvforge/texts.py); a model without a tokenizer is refused with
instructions, because calibrating on random tokens silently gives scales that
do not fit real activations. Random tokens are used only when asked for
explicitly, and the manifest says so. Evaluation text follows the same rule
(tiny's held-out text for tiny's tokenizer, held-out prose for any other).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError
from kvforge.texts import builtin_prose
from kvforge.tokenizer import Tokenizer

BUILTIN_TINY_CORPUS = "calibration.txt"


@dataclass
class CalibrationSet:
    samples: np.ndarray  # int64 (N, seq_len)
    source: str  # the file, "built-in tiny corpus" or "random tokens"
    sha256: str  # of the token ids
    random: bool = False
    held_out: list[int] | None = None  # ids to measure on (hold_out): pieces from all over a text never calibrated on
    held_out_source: str | None = None  # what they are

    def batches(self, batch_size: int):
        for i in range(0, len(self.samples), batch_size):
            yield self.samples[i : i + batch_size]


def read_text_file(path: Path, what: str) -> str:
    if path.is_dir():
        raise KvforgeError(f"{what} {path} is a directory; a directory of images calibrates or compares "
                           "vision-language models only: give a text file")
    if not path.is_file():
        raise KvforgeError(f"{what} file {path} does not exist")
    try:
        return path.read_text(encoding="utf-8-sig")  # a leading byte-order mark is not text
    except UnicodeDecodeError as e:
        raise KvforgeError(f"{what} {path} is not UTF-8 text: {e}") from e


def jsonl_items(path: Path, raw: str):
    """(line number, parsed item) for every non-blank line of a .jsonl file's text."""
    for n, line in enumerate(raw.split("\n"), 1):  # not splitlines(): U+2028 & co. are legal inside JSON strings
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise KvforgeError(f"{path}:{n} is not valid JSON: {e}") from e


def read_texts(path: str | Path, what: str = "calibration data") -> list[str]:
    """A .jsonl file: one JSON string or {"text": ...} object per line; anything else: one UTF-8 text."""
    path = Path(path)
    raw = read_text_file(path, what)
    if path.suffix.lower() == ".jsonl":
        texts = []
        for n, item in jsonl_items(path, raw):
            text = item.get("text") if isinstance(item, dict) else item
            if not isinstance(text, str):
                raise KvforgeError(f"{path}:{n}: expected a string or an object with a \"text\" string")
            texts.append(text)
    else:
        texts = [raw]
    if not any(t.strip() for t in texts):
        raise KvforgeError(f"{what} {path} holds no text")
    return texts


def check_vocab(ids, vocab_size: int, source: str) -> None:
    """Token ids the model's embedding cannot look up mean the tokenizer is not this model's."""
    top = int(np.max(ids)) if len(ids) else -1
    if top >= vocab_size:
        raise KvforgeError(f"{source} tokenizes to id {top}, but the model's vocabulary has {vocab_size} entries: "
                           "the bundle's tokenizer does not belong to its model")


def _is_builtin_tiny(bundle: Bundle) -> bool:
    """A bundle of a trained preset (tiny, tiny-moe: one corpus and tokenizer)."""
    from kvforge.model_defs import ModelConfig  # model_defs imports torch: only for a bundle of tiny
    from kvforge.model_defs.checkpoint import TRAINED

    source = bundle.recorded_source
    return source in TRAINED and bundle.model_config == ModelConfig.from_name(source).to_dict()


def load_calibration_set(
    bundle: Bundle,
    data: str | Path | None = None,
    *, samples: int = 128,
    seq_len: int = 256,
    random_data: bool = False,
    seed: int = 0,
    hold_out: int = 0,
) -> CalibrationSet:
    """Up to `samples` windows of `seq_len` tokens, spread evenly over the corpus.

    hold_out: up to this many tokens, in pieces of seq_len spread evenly over a text, are returned as `held_out`,
    for measuring what the calibration chose on text it did not see: the built-in held-out prose where the
    built-in prose is calibrated on (another source and register), else pieces of the corpus itself (at most a
    fifth of it), kept out of the samples."""
    if samples < 1 or seq_len < 1:
        raise KvforgeError(f"need samples >= 1 and seq_len >= 1, got {samples} and {seq_len}")
    max_context = bundle.io.max_context or bundle.text_config["max_seq_len"]
    if seq_len > max_context:
        raise KvforgeError(f"seq_len {seq_len} exceeds the bundle's max context {max_context}")
    vocab = bundle.text_config["vocab_size"]
    if random_data:
        rng = np.random.default_rng(seed)
        try:
            ids = rng.integers(0, vocab, (samples, seq_len), dtype=np.int64)
        except MemoryError as e:
            raise KvforgeError(f"{samples} random samples of {seq_len} tokens do not fit in memory; ask for fewer") from e
        return CalibrationSet(ids, "random tokens", hashlib.sha256(ids.tobytes()).hexdigest(), random=True)
    prose = False  # the built-in prose: measured on the built-in held-out prose
    if data is None and _is_builtin_tiny(bundle):
        from kvforge.model_defs.checkpoint import TINY_DIR  # torch: only when tiny's own text is the default

        texts, source = [(TINY_DIR / BUILTIN_TINY_CORPUS).read_text(encoding="utf-8")], "built-in tiny corpus"
    elif data is None:
        if bundle.tokenizer_file is None:
            raise KvforgeError(
                f"no calibration data: {bundle.path} has no tokenizer to read the built-in English text with; pass "
                "--data FILE (a UTF-8 text file, or JSONL with one text per line) with text like what the model will "
                "see, or --random-data to calibrate on random tokens (scales then rarely fit real inputs)"
            )
        texts, source = builtin_prose("calibration")
        prose = True
    else:
        texts, source = read_texts(data), str(data)
    if bundle.tokenizer_file is None:
        raise KvforgeError(f"bundle {bundle.path} has no tokenizer to tokenize calibration text with")
    tok = Tokenizer.from_file(bundle.tokenizer_file)
    stream = np.concatenate([np.asarray(tok.encode(text), np.int64) for text in texts])
    held_out = held_name = None
    if hold_out and prose:
        other, held_name = builtin_prose("held-out")
        other_stream = np.concatenate([np.asarray(tok.encode(text), np.int64) for text in other])
        held_out = _hold_out(other_stream, min(hold_out, len(other_stream) // 2), seq_len)[1]
    elif hold_out and len(stream) >= 2 * seq_len:
        stream, held_out = _hold_out(stream, min(hold_out, len(stream) // 5), seq_len)
        held_name = f"held-out pieces of {source}"
    if len(stream) < seq_len:
        raise KvforgeError(f"calibration data has {len(stream)} tokens; one sample needs seq_len={seq_len}")
    windows = len(stream) // seq_len
    n = min(samples, windows)
    starts = np.linspace(0, (windows - 1) * seq_len, n).astype(np.int64) // seq_len * seq_len
    ids = np.stack([stream[s : s + seq_len] for s in starts])
    check_vocab(ids, vocab, f"calibration data {source}")
    return CalibrationSet(ids, source, hashlib.sha256(ids.tobytes()).hexdigest(), held_out=held_out,
                          held_out_source=held_name)


def _hold_out(stream: np.ndarray, keep: int, piece: int) -> tuple[np.ndarray, list[int]]:
    """(the rest, the held-out ids): `keep` tokens in pieces of `piece` drawn evenly from the whole stream, so
    every text of a corpus is measured (the corpus's tail alone is its last text: the automatic recipe chose
    FP8 scales on the US Constitution's tail that did not transfer to narrative prose)."""
    pieces = len(stream) // piece
    n = max(1, min(keep // piece, pieces // 2))
    chosen = set(np.linspace(0, pieces - 1, n).round().astype(int).tolist())
    held = [stream[i * piece:(i + 1) * piece] for i in sorted(chosen)]
    rest = [stream[i * piece:(i + 1) * piece] for i in range(pieces) if i not in chosen] + [stream[pieces * piece:]]
    return np.concatenate(rest), np.concatenate(held).tolist()


def eval_ids(tokenizer, data: str | Path | None, max_tokens: int, vocab_size: int | None = None) -> tuple[list[int], str]:
    """The evaluation token stream: `data` (text or JSONL), tiny's held-out text or the held-out prose, at most max_tokens + 1 ids
    (checked against the model's vocabulary where given)."""
    if tokenizer is None:
        raise KvforgeError("comparing on text needs a tokenizer, and neither candidate nor reference has one; pass --random-data")
    if data is not None:
        texts, name = read_texts(data, what="evaluation data"), str(data)
    else:
        from kvforge.model_defs.checkpoint import is_tiny_tokenizer  # torch: only when the default text is chosen

        if is_tiny_tokenizer(tokenizer):
            from kvforge.model_defs.evaluate import heldout_text

            texts, name = [heldout_text()], "built-in held-out text"
        else:
            texts, name = builtin_prose("evaluation")
    ids: list[int] = []
    for text in texts:
        ids += tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > max_tokens:
            break
    if vocab_size is not None:
        check_vocab(ids[: max_tokens + 1], vocab_size, name)
    return ids[: max_tokens + 1], name
