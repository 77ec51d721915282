"""GGUF files (llama.cpp, Ollama) as float model sources, read with the `gguf` package.

A GGUF file holds the model's hyperparameters as `<arch>.*` metadata, its tensors under llama.cpp's names
(some quantized in blocks), and its tokenizer (`tokenizer.ggml.*`, with the chat template). This module
turns it into what a Hugging Face checkpoint directory gives the importer: a config.json-shaped dict, float
tensors under transformers' names, and a tokenizer.json. The blocks are dequantized to float32 (keeping the
codes themselves is the pre-quantized checkpoints' work); llama.cpp's converter permutes the query and key
rows of RoPE models into its own rotary layout, which is undone here.

Supported: the Llama family (Llama, SmolLM, Mistral-style GGUFs whose `general.architecture` is `llama`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvforge.errors import KvforgeError, MissingDependencyError
from kvforge.tokenizer import Tokenizer

# GGUF metadata (under the architecture's prefix) -> config.json keys
_LLAMA_CONFIG = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
}
# llama.cpp tensor names -> transformers' ({i}: the layer)
_LLAMA_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_SUPPORTED = ("llama",)
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of special tokens


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


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    """(config.json-shaped dict, float32 tensors under transformers' names, tokenizer record) of a GGUF file."""
    path = Path(path)
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in _SUPPORTED:
        raise KvforgeError(f"{path}: GGUF architecture {arch!r} is not supported as a model source; kvforge reads "
                           f"{list(_SUPPORTED)} GGUF files")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise KvforgeError(f"{path}: RoPE scaling ({scaling or 'rope_freqs, as Llama 3.1 writes'}) is not read from GGUF "
                           "files yet; export the Hugging Face checkpoint instead")
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
          "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors)}
    for key, name in _LLAMA_CONFIG.items():
        value = _field(reader, f"{arch}.{key}")
        if value is not None:
            hf[name] = value
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    hf["vocab_size"] = _field(reader, f"{arch}.vocab_size", len(tokens))
    for role in ("bos", "eos", "pad"):
        value = _field(reader, f"tokenizer.ggml.{role}_token_id")
        if value is not None:
            hf[f"{role}_token_id"] = int(value)
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    tensors = {}
    for t in reader.tensors:
        name = _hf_name(t.name, path)
        value = _dequantize(t)
        if name.endswith("q_proj.weight"):
            value = _unpermute(value, heads)
        elif name.endswith("k_proj.weight"):
            value = _unpermute(value, kv_heads)
        tensors[name] = torch.from_numpy(np.array(value, np.float32))  # a writable copy of the file's data
    return hf, tensors, _tokenizer_record(reader, tokens)


def read_gguf_tokenizer(path: str | Path) -> dict[str, Any]:
    """A GGUF file's tokenizer record alone (vocabulary, merges, special ids, chat template): no tensor is read."""
    reader = _reader(Path(path))
    return _tokenizer_record(reader, _field(reader, "tokenizer.ggml.tokens") or [])


def _hf_name(name: str, path: Path) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        key, layer = ".".join(["blk", "{i}", *parts[2:]]), parts[1]
    else:
        key, layer = name, None
    if key not in _LLAMA_TENSORS:
        raise KvforgeError(f"{path}: tensor {name!r} has no place in a Llama model")
    return _LLAMA_TENSORS[key].format(i=layer)


def _dequantize(t) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims fastest first
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data, np.float32).reshape(shape)
    return dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves each head's two rotary halves into pairs."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


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
