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

from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from kvforge.errors import KvforgeError, MissingDependencyError
from kvforge.tokenizer import Tokenizer

from .gguf_codes import FLOAT_TYPES, decode
from .gguf_families import ARCHS, hf_tensors
from .quantized import QuantizedCheckpoint

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
        from gguf import GGUFReader
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise MissingDependencyError("the `gguf` package", "Install it with `pip install gguf`.") from e
    try:
        return GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise KvforgeError(f"{path} is not a readable GGUF file: {e}") from e


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_gguf(path: str | Path) -> GgufModel:
    """A GGUF file as a Hugging Face checkpoint directory would give it, with its quantized tensors' codes."""
    from gguf import GGMLQuantizationType

    path = Path(path)
    reader = _reader(path)
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
    for role in ("bos", "eos", "pad"):
        value = _field(reader, f"tokenizer.ggml.{role}_token_id")
        if value is not None:
            hf[f"{role}_token_id"] = int(value)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}  # fastest dim last
    if arch.finish_config is not None:
        try:
            arch.finish_config(lambda key: _field(reader, key), hf, shapes)
        except KvforgeError as e:
            raise KvforgeError(f"{path}: {e}") from e
    tensors, types = {}, {}
    quantized = QuantizedCheckpoint("gguf", {})
    for t in reader.tensors:
        shape = shapes[t.name]
        type_name = GGMLQuantizationType(t.tensor_type).name
        types[type_name] = types.get(type_name, 0) + 1
        value = np.array(_dequantize(t, shape), np.float32)  # a writable copy of the file's data
        try:
            parts = hf_tensors(arch, hf, t.name, torch.from_numpy(value))
        except KvforgeError as e:
            raise KvforgeError(f"{path}: {e}") from e
        tensors.update(parts)
        if type_name in FLOAT_TYPES or len(shape) < 2:
            quantized.kept_float.update({n: f"{type_name} in the file" for n, v in parts.items() if v.ndim >= 2})
            continue
        flat = (int(np.prod(shape[:-1])), shape[-1])  # stacked experts: [experts * out, in]
        codes, error = decode(t.data, type_name, flat, value.reshape(flat))
        for hf_name in parts:  # each part's codes: the tensor's, with the layout change that gives the part
            quantized.codes[hf_name] = codes
            quantized.layouts[hf_name] = lambda x, n=t.name, s=shape, h=hf_name: hf_tensors(arch, hf, n, x.reshape(s))[h]
            if error is not None:
                quantized.converted[hf_name] = error
    file_type = _field(reader, "general.file_type")
    quantized.config = {"file_type": _FILE_TYPES.get(file_type, file_type), "tensor_types": dict(sorted(types.items()))}
    return GgufModel(hf, tensors, _tokenizer_record(reader, tokens), quantized if quantized.codes else None)


def has_quantized_tensors(path: str | Path) -> bool:
    """Whether the file holds a tensor in a quantized type (only the tensor index is read)."""
    from gguf import GGMLQuantizationType

    return any(GGMLQuantizationType(t.tensor_type).name not in FLOAT_TYPES for t in _reader(Path(path)).tensors)


def read_gguf_tokenizer(path: str | Path) -> dict[str, Any]:
    """A GGUF file's tokenizer record alone (vocabulary, merges, special ids, chat template): no tensor is read."""
    reader = _reader(Path(path))
    return _tokenizer_record(reader, _field(reader, "tokenizer.ggml.tokens") or [])


def _dequantize(t, shape: tuple[int, ...]) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data, np.float32).reshape(shape)
    return dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)


def _tokenizer_record(reader, tokens: list[str]) -> dict[str, Any]:
    return {
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": tokens,
        "types": _field(reader, "tokenizer.ggml.token_type") or [],
        "merges": _field(reader, "tokenizer.ggml.merges") or [],
        "add_bos": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "ids": {role: _field(reader, f"tokenizer.ggml.{role}_token_id") for role in ("bos", "eos", "pad", "unknown")},
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }


def tokenizer_json(record: dict[str, Any]) -> dict[str, Any]:
    """A Hugging Face tokenizer.json for a GGUF byte-level BPE tokenizer (`tokenizer.ggml.model` gpt2)."""
    if record["model"] != "gpt2":
        raise KvforgeError(f"GGUF tokenizer model {record['model']!r} is not supported (kvforge reads byte-level BPE: gpt2)")
    tokens, types = record["tokens"], record["types"]
    special = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                "special": True} for i, (tok, kind) in enumerate(zip(tokens, types)) if kind in (_CONTROL, _USER_DEFINED)]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        # SmolLM's and GPT-2's split: each digit alone, then the byte-level regex
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in record["merges"]]},
    }


def gguf_tokenizer(record: dict[str, Any]) -> Tokenizer:
    """The file's tokenizer, with its BOS, EOS and pad tokens named."""
    tokens, ids = record["tokens"], record["ids"]
    named = {role: tokens[int(ids[role])] if ids.get(role) is not None and 0 <= int(ids[role]) < len(tokens) else None
             for role in ("bos", "eos", "pad")}
    return Tokenizer.from_json(tokenizer_json(record), named["bos"], named["eos"], named["pad"], record.get("chat_template"))
