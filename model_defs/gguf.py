"""GGUF files (llama.cpp, Ollama) as model sources, read with the `gguf` package.

A GGUF file holds the model's hyperparameters as `<arch>.*` metadata, its tensors under llama.cpp's names
(some quantized in blocks), and its tokenizer (`tokenizer.ggml.*`, with the chat template). This module
turns it into what a Hugging Face checkpoint directory gives the importer: a config.json-shaped dict, float
tensors under transformers' names (the file's own dequantization: the reference the bundle is measured
against), and a tokenizer.json; and the quantized tensors' codes (model_defs/gguf_codes.py), which the export
keeps in the bundle's Q/DQ. Each architecture's names and layout changes (llama.cpp's converter permutes the
query and key rows of Llama-style RoPE models into its own rotary layout) are one entry in
model_defs/gguf_families.py.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from kvforge.errors import KvforgeError, MissingDependencyError
from kvforge.tokenizer import Tokenizer

from .gguf_codes import FLOAT_TYPES, decode
from .gguf_families import ARCHS, hf_tensors
from .quantized import QuantizedCheckpoint, row_chunks
from .weights import ScratchTensors, count_non_finite

# llama.cpp's general.file_type values (LLAMA_FTYPE_*) that name a file's main type
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
               12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
               25: "IQ4_NL", 30: "IQ4_XS", 32: "BF16"}

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of special tokens


class GgufModel(NamedTuple):
    """What read_gguf returns: a config.json-shaped dict, float32 tensors under transformers' names (the file's
    dequantization: the reference), the tokenizer record and the file's codes (None when nothing is quantized)."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: dict[str, Any]
    quantized: QuantizedCheckpoint | None


def _reader(path: Path):
    try:
        import gguf  # noqa: F401
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise MissingDependencyError("the `gguf` package", "Install it with `pip install gguf`.") from e
    try:
        stat = path.stat()
        return _open_reader(str(path), (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns))
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise KvforgeError(f"{path} is not a readable GGUF file: {e}") from e


@functools.lru_cache(maxsize=2)
def _open_reader(path: str, stamp: tuple[int, int, int, int]):
    """The file's index (model_defs/gguf_index.py: a read-only memory map, the metadata decoded when read), kept
    for the next read of the same unchanged file: one process reads a file several times (its loads, the
    tokenizer record, whether it holds quantized tensors). stamp: the file's identity, size and mtime, so a file
    rewritten in place is read anew."""
    from .gguf_index import GgufIndex

    return GgufIndex(path)


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _config(path: Path, reader) -> tuple[Any, dict[str, Any], dict[str, tuple[int, ...]]]:
    """(the file's architecture table, its config.json-shaped dict, each tensor's shape in torch's order)."""
    name = _field(reader, "general.architecture")
    arch = ARCHS.get(name)
    if arch is None:
        raise KvforgeError(f"{path}: GGUF architecture {name!r} is not supported as a model source; kvforge reads "
                           f"{sorted(ARCHS)} GGUF files")
    hf = {**arch.defaults, "model_type": arch.model_type, "architectures": list(arch.architectures)}
    if arch.tied_head is not None:
        hf["tie_word_embeddings"] = not any(t.name == arch.tied_head for t in reader.tensors)
    for key, hf_key in arch.config.items():
        value = _field(reader, f"{name}.{key}")
        if value is not None:
            hf[hf_key] = value
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    hf["vocab_size"] = _field(reader, f"{name}.vocab_size", len(tokens))
    for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):  # llama.cpp's keys
        value = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            hf[f"{role}_token_id"] = int(value)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}  # fastest dim last
    if arch.finish_config is not None:
        try:
            arch.finish_config(lambda key: _field(reader, key), hf, shapes)
        except KvforgeError as e:
            raise KvforgeError(f"{path}: {e}") from e
    return arch, hf, shapes


def _parts(path: Path, arch, hf: dict[str, Any], name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    try:
        return hf_tensors(arch, hf, name, value)
    except KvforgeError as e:
        raise KvforgeError(f"{path}: {e}") from e


def read_gguf(path: str | Path, codes: bool = True) -> GgufModel:
    """A GGUF file as a Hugging Face checkpoint directory would give it, with its quantized tensors' codes (not
    decoded where `codes` is false: a caller that wants only the float model)."""
    path = Path(path)
    reader = _reader(path)
    arch, hf, shapes = _config(path, reader)
    tensors: dict[str, torch.Tensor] = {}
    quantized = _read_tensors(path, reader, arch, hf, shapes, tensors, codes)
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    return GgufModel(hf, tensors, _tokenizer_record(reader, tokens), quantized)


def read_gguf_codes(path: str | Path) -> tuple[dict[str, Any], QuantizedCheckpoint | None]:
    """(the config.json-shaped dict, the file's codes) alone, for a caller that streams the float tensors
    (GgufTensors): each tensor is decoded to match its codes and dropped, and no tokenizer record is made."""
    path = Path(path)
    reader = _reader(path)
    arch, hf, shapes = _config(path, reader)
    return hf, _read_tensors(path, reader, arch, hf, shapes, None, codes=True)


def _read_tensors(path: Path, reader, arch, hf: dict[str, Any], shapes: dict[str, tuple[int, ...]],
                  tensors: dict[str, torch.Tensor] | None, codes: bool) -> QuantizedCheckpoint | None:
    """Each of the file's tensors decoded under transformers' names, into `tensors` where it is given; the
    codes of the quantized ones (None where `codes` is false or the file holds none)."""
    from gguf import GGMLQuantizationType

    types: dict[str, int] = {}
    quantized = QuantizedCheckpoint("gguf", {})
    for t in reader.tensors:
        shape = shapes[t.name]
        type_name = GGMLQuantizationType(t.tensor_type).name
        types[type_name] = types.get(type_name, 0) + 1
        value = None
        if tensors is not None:
            value = _dequantize(t, shape)
            parts = _parts(path, arch, hf, t.name, torch.from_numpy(value))
            tensors.update(parts)
        else:  # the parts' names and shapes alone
            parts = _parts(path, arch, hf, t.name, torch.empty(shape, dtype=torch.float32, device="meta"))
        if not codes:
            continue
        if type_name in FLOAT_TYPES or len(shape) < 2:
            quantized.kept_float.update({n: f"{type_name} in the file" for n, v in parts.items() if v.ndim >= 2})
            continue
        flat = (int(np.prod(shape[:-1])), shape[-1])  # stacked experts: [experts * out, in]
        # checked against gguf's dequantization: the values decoded above, else a chunk of rows at a time (never
        # whole: Gemma 3's 262k-row embedding is 0.67 GB of float32)
        dequantized = _DequantizedRows(t, flat) if value is None else value.reshape(flat)
        weight, error = decode(t.data, type_name, flat, dequantized)
        for hf_name in parts:  # each part's codes: the tensor's, with the layout change that gives the part
            quantized.codes[hf_name] = weight
            quantized.layouts[hf_name] = lambda x, n=t.name, s=shape, h=hf_name: hf_tensors(arch, hf, n, x.reshape(s))[h]
            if error is not None:
                quantized.converted[hf_name] = error
    file_type = _field(reader, "general.file_type")
    quantized.config = {"file_type": _FILE_TYPES.get(file_type, file_type), "tensor_types": dict(sorted(types.items()))}
    return quantized if quantized.codes else None


class GgufTensors:
    """A GGUF file's tensors under transformers' names, as `read_gguf` gives them, each decoded to float32 only
    when first read: the file stays a read-only memory map, and what a tensor decodes to is written to a scratch
    file (weights.ScratchTensors) and read back from it after, since decoding costs ~15x a read. So the decoded
    model is never held in memory, and a source read on every forward (validation's streamed references) decodes
    each tensor once (the streamed export's reader, in the terms of weights.SafetensorsShards)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self.path, self._reader = path, _reader(path)
        self.arch, self.config, shapes = _config(path, self._reader)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._shapes = shapes
        self.entries: dict[str, tuple[str, torch.Size]] = {}  # transformers' name -> (the file's, its shape)
        for t in self._reader.tensors:  # names and shapes from the layout changes alone, on meta tensors
            meta = torch.empty(shapes[t.name], dtype=torch.float32, device="meta")
            for hf_name, part in _parts(path, self.arch, self.config, t.name, meta).items():
                self.entries[hf_name] = (t.name, part.shape)
        self._decoded = ScratchTensors()

    @property
    def scratch_bytes(self) -> int:
        """The scratch file's size once every tensor is read: the decoded model in float32."""
        return sum(4 * int(torch.Size(shape).numel()) for _, shape in self.entries.values())

    def read_meta(self, name: str) -> torch.Tensor:
        return torch.empty(self.entries[name][1], dtype=torch.float32, device="meta")

    def read(self, name: str, copy: bool = False) -> torch.Tensor:
        """The float32 tensor `name` (the file's dequantization after the family's layout change): a view of a
        buffer the next read reuses (copy: a tensor of its own)."""
        return self.read_rows(name, None, copy)

    def read_rows(self, name: str, rows: torch.Tensor | None, copy: bool = False) -> torch.Tensor:
        if name not in self._decoded.entries:
            self._decode(self.entries[name][0])
        return self._decoded.read_rows(name, rows, copy)

    def _decode(self, file_name: str) -> None:
        """The file's tensor decoded, checked finite and put through the layout change; each of its parts (one,
        or one per expert of a stacked tensor) written to the scratch file."""
        value = torch.from_numpy(_dequantize(self._tensors[file_name], self._shapes[file_name]))
        bad = count_non_finite(value)
        if bad:
            raise KvforgeError(f"{self.path} is damaged: {file_name} holds {bad} NaN or infinite values")
        for hf_name, part in _parts(self.path, self.arch, self.config, file_name, value).items():
            self._decoded.add(hf_name, part)


def has_quantized_tensors(path: str | Path) -> bool:
    """Whether the file holds a tensor in a quantized type (only the tensor index is read)."""
    from gguf import GGMLQuantizationType

    return any(GGMLQuantizationType(t.tensor_type).name not in FLOAT_TYPES for t in _reader(Path(path)).tensors)


def tensor_elements(path: str | Path) -> int:
    """How many values the file's tensors hold (their logical sizes, whatever their codes), from its index alone."""
    return sum(int(t.n_elements) for t in _reader(Path(path)).tensors)


def read_gguf_tokenizer(path: str | Path) -> dict[str, Any]:
    """A GGUF file's tokenizer record alone (vocabulary, merges, special ids, chat template): no tensor is read."""
    reader = _reader(Path(path))
    return _tokenizer_record(reader, _field(reader, "tokenizer.ggml.tokens") or [])


def _dequantize(t, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor's values in float32, in an array of its own: a decoding already is one; an F32 tensor is the
    file's read-only map, copied (once: Gemma 3's 671 MB embedding was held twice while it was decoded)."""
    from gguf import GGMLQuantizationType

    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = np.asarray(t.data, np.float32)
        return (values if values.flags.writeable else values.copy()).reshape(shape)
    # a chunk of rows at a time into the result: gguf's decoders hold several arrays of their input's size (a
    # K-quant's 262k-row embedding took ~2 GB besides its 0.67 GB of values); each block decodes alike either way
    rows = _DequantizedRows(t, (int(np.prod(shape[:-1])), shape[-1]) if len(shape) > 1 else (1, shape[0]))
    values = np.empty(rows.shape, np.float32)
    for part in row_chunks(*values.shape):
        values[part] = rows[part]
    return values.reshape(shape)


class _DequantizedRows:
    """A GGUF tensor's float32 values as [rows, row length] (`shape`), made a slice of rows at a time where they
    are indexed (WeightCodes.matches reads them so); np.asarray makes them whole."""

    def __init__(self, t, shape: tuple[int, int]):
        self.t, self.shape = t, shape

    def __getitem__(self, rows: slice) -> np.ndarray:
        from gguf.quants import dequantize

        data = np.asarray(self.t.data)
        data = data.reshape(self.shape[0], -1)[rows]
        return np.asarray(dequantize(data, self.t.tensor_type), np.float32).reshape(-1, self.shape[1])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return _dequantize(self.t, self.shape).astype(dtype or np.float32, copy=False)


def _tokenizer_record(reader, tokens: list[str]) -> dict[str, Any]:
    """The file's tokenizer metadata, as tokenizer_json reads it. A flag the file does not carry is None: its
    default depends on the tokenizer model (a SentencePiece file adds BOS unless it says not to)."""
    return {
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "architecture": _field(reader, "general.architecture"),
        "tokens": tokens,
        "types": _field(reader, "tokenizer.ggml.token_type") or [],
        "scores": _field(reader, "tokenizer.ggml.scores") or [],
        "merges": _field(reader, "tokenizer.ggml.merges") or [],
        "add_bos": _field(reader, "tokenizer.ggml.add_bos_token"),
        "add_eos": _field(reader, "tokenizer.ggml.add_eos_token"),
        "add_space_prefix": _field(reader, "tokenizer.ggml.add_space_prefix"),
        "ids": {"bos": _field(reader, "tokenizer.ggml.bos_token_id"),
                "eos": _field(reader, "tokenizer.ggml.eos_token_id"),
                "pad": _field(reader, "tokenizer.ggml.padding_token_id"),  # llama.cpp's key for the pad id
                "unknown": _field(reader, "tokenizer.ggml.unknown_token_id")},
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }


_UNKNOWN = 2  # tokenizer.ggml.token_type of the unknown token: special, like a control token, in llama.cpp
_SPIECE = "\u2581"  # SentencePiece's visible space

# Byte-level BPE pre-tokenizers by `tokenizer.ggml.pre`: llama.cpp's split (src/llama-vocab.cpp,
# llm_tokenizer_bpe), each regex splitting every piece the previous ones left, matches and the text between them
# kept apart (a tokenizers Split with behavior "isolated"); then GPT-2's byte-to-character map. Where the model's
# own tokenizer.json and transformers' GGUF loader write the regex in its original form (case-insensitive
# contractions, Unicode classes), that form is used: llama.cpp rewrites some for its own regex engine.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                rf"{_CONTRACTIONS}|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_LATIN_LIKE = (  # DeepSeek LLM's letters: Latin, Greek, Cyrillic, Armenian, Georgian, ... (llama.cpp's list)
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-"
    "\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
    "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-"
    "\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113"
    "\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
    "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-"
    "\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0"
    "-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+")
_BLOOM_SPLIT = r" ?[^(\s|.,!?…。，、।۔،)]+"

_DIGITS = "digits"  # SmolLM's (StarCoder's) split: each digit alone, then GPT-2's regex, as its tokenizer.json says
_BYTE_LEVEL_PRE: dict[str, tuple[str, ...] | str] = {
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "gigachat",
                     "a.x-4.0", "mellum"), (_GPT2_SPLIT,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
                    _DIGITS),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
                    (_QWEN2_SPLIT,)),
    "qwen35": (_QWEN35_SPLIT,),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), (_GPT4O_SPLIT,)),
    "tekken": (_TEKKEN_SPLIT,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, "[0-9][0-9][0-9]"),
    "deepseek-llm": (r"[\r\n]", _LATIN_LIKE, "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                     r"\s+$", _CJK, r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
    **dict.fromkeys(("bloom", "gpt3-finnish", "poro-chat"), (_BLOOM_SPLIT,)),
    "viking": (_BLOOM_SPLIT, r"\p{N}"),
}
# where llama.cpp takes a word the vocabulary holds whole, whatever the merges say (the models' own tokenizer.json
# have "ignore_merges": true), and adds BOS when the file does not say
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                  "jina-v5-nano", "tekken"}
_ADDS_BOS = _IGNORE_MERGES
# GGUF tokenizer models kvforge cannot read, and what they are
_OTHER_MODELS = {"bert": "BERT's WordPiece", "t5": "T5's SentencePiece Unigram", "rwkv": "RWKV's trie tokenizer",
                 "plamo2": "PLaMo 2's tokenizer", "gemma4": "Gemma 4's BPE", "no_vocab": "no vocabulary",
                 "none": "no vocabulary"}
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def _added_tokens(tokens: list[str], types: list[int], skip: set[int] = frozenset()) -> list[dict[str, Any]]:
    """The tokens llama.cpp matches whole in the text: control and unknown tokens as special ones (skipped by a
    decode that skips special tokens), user-defined ones (like `<think>`) as plain added tokens."""
    return [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": kind != _USER_DEFINED}
            for i, (tok, kind) in enumerate(zip(tokens, types)) if kind in (_UNKNOWN, _CONTROL, _USER_DEFINED)
            and i not in skip]


def _token(record: dict[str, Any], role: str) -> str | None:
    tokens, index = record["tokens"], record["ids"].get(role)
    return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None


def _adds(record: dict[str, Any], add_bos: bool, add_eos: bool) -> dict[str, Any] | None:
    """A TemplateProcessing post-processor that puts the BOS first and the EOS last as the file says (None when
    it adds neither, or names no such token): what transformers builds from the file's add_bos/add_eos."""
    pieces = [(role, _token(record, role)) for role, on in (("bos", add_bos), ("eos", add_eos)) if on]
    pieces = [(role, tok) for role, tok in pieces if tok is not None]
    if not pieces:
        return None

    def template(sequence: str, type_id: int) -> list[dict[str, Any]]:
        items = [{"Sequence": {"id": sequence, "type_id": type_id}}]
        for role, tok in pieces:
            special = {"SpecialToken": {"id": tok, "type_id": type_id}}
            items = [special, *items] if role == "bos" else [*items, special]
        return items

    return {"type": "TemplateProcessing", "single": template("A", 0), "pair": template("A", 0) + template("B", 1),
            "special_tokens": {tok: {"id": tok, "ids": [int(record["ids"][role])], "tokens": [tok]}
                               for role, tok in pieces}}


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[list[str]]:
    """BPE merges for a SentencePiece vocabulary, which a GGUF file holds as pieces with scores and no merges:
    every cut of a piece into two pieces of the vocabulary is a merge, ranked by the joined piece's score (best
    first), then the longer left part, then the longer right part, then the piece's place in the file and the
    parts' ids. This is the ranking transformers' generate_merges gives (so that ties break alike); the score order
    is SentencePiece's own (llama.cpp joins the best-scoring adjacent pair first)."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    ranked = []
    for place, (piece, score) in enumerate(dict(zip(tokens, scores)).items()):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-score, -len(left), -len(right), place, ids[left], ids[right], left, right))
    ranked.sort()
    return [[left, right] for *_, left, right in ranked]


def _sentencepiece_json(record: dict[str, Any]) -> dict[str, Any]:
    """`tokenizer.ggml.model` llama: SentencePiece BPE with byte fallback (Llama 2, Mistral, TinyLlama, Phi-3,
    Gemma). Spaces are `▁`, and a `▁` is put before the text (and after each special token) unless the file says
    add_space_prefix false: llama.cpp's and SentencePiece's own behaviour, so a text that starts with a space keeps
    it (" Hi" is ▁ ▁Hi). Characters outside the vocabulary are their UTF-8 bytes' <0xXX> tokens. Merges: the
    file's, else derived from the pieces' scores. Encoding adds BOS unless the file says add_bos_token false."""
    tokens, types = list(record["tokens"]), record["types"]
    respelled: set[int] = set()
    if record.get("architecture") in _GEMMA_ARCHS:
        # Gemma's files write its runs of spaces with real spaces, and its scores do not follow its merge order:
        # the order of the pieces in the file does (transformers' GGUF loader reads them so)
        for i, tok in enumerate(tokens):
            if " " in tok and not tok.strip():
                tokens[i] = _SPIECE * len(tok)
                respelled.add(i)
        scores = [-float(i) for i in range(len(tokens))]
        prefix = bool(record.get("add_space_prefix"))
    else:
        scores = record.get("scores") or []
        prefix = record.get("add_space_prefix") is not False
    merges = [m.split(" ", 1) for m in record.get("merges") or []]
    if not merges:
        if len(scores) < len(tokens):
            raise KvforgeError(f"the GGUF SentencePiece tokenizer has {len(tokens)} tokens, {len(scores)} scores "
                               "(tokenizer.ggml.scores) and no merges: kvforge derives the merges from the scores")
        merges = merges_from_scores(tokens, scores)
    unk = _token(record, "unknown")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if unk is None and "<unk>" in vocab:
        unk = "<unk>"
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": _SPIECE}
    decoders = [{"type": "Replace", "pattern": {"String": _SPIECE}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, types, respelled),
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": _SPIECE}, replace]}
        if prefix else replace,
        "pre_tokenizer": None,
        "post_processor": _adds(record, record.get("add_bos") is not False, bool(record.get("add_eos"))),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def _byte_level_pre_tokenizer(pre: str | None) -> dict[str, Any]:
    """The split `tokenizer.ggml.pre` names, then GPT-2's byte-to-character map."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    splits = _BYTE_LEVEL_PRE.get(pre)
    if splits is None:
        if pre not in (None, "default"):
            import warnings

            warnings.warn(f"GGUF tokenizer.ggml.pre {pre!r} is not a pre-tokenizer kvforge knows; splitting the text "
                          "with GPT-2's regex, as transformers does (llama.cpp refuses the file), so token ids may "
                          f"differ from the model's own tokenizer. Known: {sorted(_BYTE_LEVEL_PRE)}", stacklevel=3)
        splits = (_GPT2_SPLIT,)  # transformers' reading of a file without a named split (llama.cpp's is its own)
    if splits == _DIGITS:
        return {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    if splits == (_GPT2_SPLIT,):
        return byte_level  # tokenizers' ByteLevel regex is GPT-2's
    return {"type": "Sequence", "pretokenizers": [
        *({"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False} for split in splits),
        {**byte_level, "use_regex": False}]}


def _byte_level_json(record: dict[str, Any]) -> dict[str, Any]:
    """`tokenizer.ggml.model` gpt2: byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM, ...), split as
    `tokenizer.ggml.pre` says."""
    tokens, pre = record["tokens"], record.get("pre")
    add_bos = record.get("add_bos")
    adds = _adds(record, pre in _ADDS_BOS if add_bos is None else bool(add_bos), bool(record.get("add_eos")))
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, record["types"]),
        "normalizer": None,
        "pre_tokenizer": _byte_level_pre_tokenizer(pre),
        "post_processor": adds or {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                                   "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": pre in _IGNORE_MERGES,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in record["merges"]]},
    }


def tokenizer_json(record: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face tokenizer.json for a GGUF file's tokenizer: `tokenizer.ggml.model` gpt2 (byte-level BPE)
    or llama (SentencePiece BPE with byte fallback)."""
    model = record["model"]
    if model == "gpt2":
        return _byte_level_json(record)
    if model == "llama":
        return _sentencepiece_json(record)
    what = f" ({_OTHER_MODELS[model]})" if model in _OTHER_MODELS else ""
    raise KvforgeError(f"GGUF tokenizer model {model!r}{what} is not supported: kvforge reads 'llama' (SentencePiece "
                       "BPE) and 'gpt2' (byte-level BPE) tokenizers")


def gguf_tokenizer(record: dict[str, Any]) -> Tokenizer:
    """The file's tokenizer, with its BOS, EOS and pad tokens named."""
    named = {role: _token(record, role) for role in ("bos", "eos", "pad")}
    return Tokenizer.from_json(tokenizer_json(record), named["bos"], named["eos"], named["pad"],
                               record.get("chat_template"))
