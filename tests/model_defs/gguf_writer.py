"""A test fixture: what llama.cpp's converter (convert_hf_to_gguf.py) writes for a transformers model.

It works from what the converter reads, the model's saved checkpoint (config.json and safetensors, experts one
tensor each), and follows its conventions independently of kvforge's tables: the metadata each model class
writes, tensor names from gguf's own TensorNameMap, and the converter's rearrangements (Llama's q/k rotary
permutation, BLOOM's and Falcon's fused qkv regrouped as [q | k | v], GPT-2's Conv1D weights transposed and its
head written as a copy of the embeddings, as BLOOM's is, Gemma's norms stored as 1 + w, Qwen-MoE's experts
stacked and the shared expert's gate squeezed). The tokenizer is a minimal byte-level BPE (`gpt2`) record.
Weights may be stored quantized (`qtype`) where llama.cpp would: 2-D and stacked expert weights whose rows
divide into blocks; norms, biases, the routers and the position table stay F32.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as Q

from kvforge.tokenizer import bytes_to_unicode

# transformers' model_type -> llama.cpp's architecture (Mistral 7B is a `llama` file)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2moe",
             "qwen3_moe": "qwen3moe", "phi3": "phi3", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3",
             "gpt2": "gpt2", "falcon": "falcon", "bloom": "bloom"}
_ARCH_ENUM = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
_CONTROL, _NORMAL = 3, 1
_TEXT = ("the quick brown fox jumps over the lazy dog while the other dogs sleep in the warm sun; "
         "kvforge exports transformer language models to onnx with their key value cache, and then "
         "the runtime reads the exported bundle and generates the next tokens of the text ") * 3


def merge_pair(words: dict[tuple[str, ...], int], pair: tuple[str, str]) -> dict[tuple[str, ...], int]:
    """Word counts with every adjacent `pair` joined into one symbol (one step of learning BPE merges)."""
    merged: dict[tuple[str, ...], int] = {}
    for w, n in words.items():
        out, i = [], 0
        while i < len(w):
            if w[i:i + 2] == pair:
                out.append(pair[0] + pair[1])
                i += 2
            else:
                out.append(w[i])
                i += 1
        merged[tuple(out)] = merged.get(tuple(out), 0) + n
    return merged


def byte_level_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of `size` tokens: the 256 bytes, merges learned greedily from a fixed text,
    then three control tokens (bos, eos, pad: the last three ids)."""
    alphabet = bytes_to_unicode()
    tokens = [alphabet[b] for b in range(256)]
    words = Counter("".join(alphabet[b] for b in w.encode()) for w in _TEXT.replace(" ", "\0 ").split("\0"))
    words = {tuple(w): n for w, n in words.items() if w}
    merges = []
    while len(tokens) < size - 3:
        pairs: Counter = Counter()
        for w, n in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += n
        if not pairs:
            raise ValueError(f"the sample text allows only {len(tokens)} tokens, not {size - 3}")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{best[0]} {best[1]}")
        tokens.append(best[0] + best[1])
        words = merge_pair(words, best)
    tokens += ["<|bos|>", "<|eos|>", "<|pad|>"]
    return tokens, [_NORMAL] * (size - 3) + [_CONTROL] * 3, merges


def _checkpoint(model) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and the tensors as save_pretrained writes them: what the converter reads."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        tensors = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
    return model.config.to_dict(), {k: v.float() for k, v in tensors.items()}


def _llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """LlamaModel.permute: each head's rotary halves interleaved into pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(hp: dict[str, Any]) -> dict[str, Any]:
    params = hp.get("rope_parameters") or {}
    return params.get("full_attention", params) if isinstance(params.get("full_attention"), dict) else params


def _metadata(w: gguf.GGUFWriter, hp: dict[str, Any], family: str) -> None:
    """Each converter class's set_gguf_parameters, for the configs the tests use."""
    rope = _rope(hp)
    heads = hp.get("num_attention_heads") or hp.get("n_head")
    if family == "gpt2":
        w.add_block_count(hp["n_layer"])
        w.add_context_length(hp["n_positions"])
        w.add_embedding_length(hp["n_embd"])
        w.add_feed_forward_length(hp.get("n_inner") or 4 * hp["n_embd"])
        w.add_head_count(hp["n_head"])
        w.add_layer_norm_eps(hp["layer_norm_epsilon"])
        return
    if family in ("falcon", "bloom"):
        dim = hp["hidden_size"]
        w.add_block_count(hp.get("num_hidden_layers") or hp["n_layer"])
        w.add_embedding_length(dim)
        w.add_head_count(heads)
        w.add_layer_norm_eps(hp["layer_norm_epsilon"])
        if family == "falcon":
            w.add_context_length(2048)  # the converter's constant
            w.add_tensor_data_layout("jploski")
            w.add_feed_forward_length(hp.get("ffn_hidden_size") or 4 * dim)
            w.add_head_count_kv(hp["num_kv_heads"] if hp.get("new_decoder_architecture") else 1)
        else:
            w.add_context_length(hp.get("seq_length", dim))
            w.add_feed_forward_length(4 * dim)
            w.add_head_count_kv(heads)
        return
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(hp.get("num_key_value_heads") or heads)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if rope.get("rope_theta") is not None:
        w.add_rope_freq_base(float(rope["rope_theta"]))
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    head_dim = hp.get("head_dim") or hp["hidden_size"] // heads
    if family in ("llama", "mistral"):
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if family == "phi3":
        w.add_rope_dimension_count(int(float(rope.get("partial_rotary_factor") or 1.0) * head_dim))
    if family in ("phi3", "gemma2", "gemma3_text") and hp.get("sliding_window"):
        w.add_sliding_window(hp["sliding_window"])
    if family == "gemma2":
        w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    if family in ("qwen2_moe", "qwen3_moe"):
        w.add_expert_count(hp.get("num_experts") or hp["num_local_experts"])
        w.add_expert_used_count(hp["num_experts_per_tok"])
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
        if family == "qwen2_moe":
            w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The converter's Qwen-MoE merge: mlp.experts.{j}.{p}_proj.weight -> one mlp.experts.{p}_proj.weight
    [experts, out, in] per layer and projection."""
    out, stacks = {}, {}
    for name, t in tensors.items():
        parts = name.split(".")
        if ".mlp.experts." in name and parts[-3].isdigit():
            key = ".".join(parts[:-3] + parts[-2:])
            stacks.setdefault(key, {})[int(parts[-3])] = t
        else:
            out[name] = t
    for key, experts in stacks.items():
        out[key] = torch.stack([experts[j] for j in range(len(experts))])
    return out


def _rearranged(family: str, hp: dict[str, Any], name: str, t: torch.Tensor) -> torch.Tensor:
    """The converter's modify_tensors: each family's layout changes, in checkpoint names."""
    if family in ("llama", "mistral"):
        heads = hp["num_attention_heads"]
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return _llama_permute(t, heads)
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return _llama_permute(t, hp.get("num_key_value_heads") or heads)
    if family in ("gemma", "gemma2", "gemma3_text") and name.endswith("norm.weight"):
        return t + 1
    if family == "gpt2" and name.endswith(("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                                            "mlp.c_proj.weight")):
        return t.t().contiguous()
    if family == "bloom" and "query_key_value" in name:
        heads = hp["n_head"]
        return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
    if family == "falcon" and "query_key_value" in name:
        heads = hp["num_attention_heads"]
        kv = hp["num_kv_heads"] if hp.get("new_decoder_architecture") else 1
        qkv = t.reshape(kv, heads // kv + 2, -1, *t.shape[1:])
        return torch.cat([part.reshape(-1, *t.shape[1:]) for part in (qkv[:, :-2], qkv[:, -2], qkv[:, -1])])
    if name.endswith("shared_expert_gate.weight"):
        return t.squeeze()
    return t


def _store_type(gguf_name: str, array: np.ndarray, qtype: Q) -> Q:
    """llama.cpp keeps vectors, norms, routers and the position table in F32, and falls back to F16 where the
    rows do not divide into the type's blocks."""
    if qtype == Q.F32 or array.ndim == 1 or gguf_name.endswith("_norm.weight") or ".ffn_gate_inp" in gguf_name \
            or gguf_name.startswith("position_embd"):
        return Q.F32
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return qtype if array.shape[-1] % block == 0 else Q.F16


def write_gguf(model, path: str | Path, qtype: Q = Q.F32, name: str | None = None) -> Path:
    """Write `model` (a transformers causal LM) as llama.cpp's converter would, weights stored as `qtype`."""
    hp, tensors = _checkpoint(model)
    family = hp["model_type"]
    arch = GGUF_ARCH[family]
    if family in ("qwen2_moe", "qwen3_moe"):
        tensors = _stack_experts(tensors)
    if family == "bloom":  # the converter strips the wrapper's prefix before mapping
        tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    layers = hp.get("num_hidden_layers") or hp.get("n_layer")
    names = gguf.get_tensor_name_map(_ARCH_ENUM[arch], layers)
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name or f"{family} micro")
    _metadata(w, hp, family)
    w.add_file_type({Q.F32: 0, Q.F16: 1}.get(qtype, 7))
    tokens, types, merges = byte_level_vocab(hp["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 2)
    w.add_pad_token_id(len(tokens) - 1)
    out: dict[str, torch.Tensor] = {}
    for hf_name, t in tensors.items():
        base, suffix = hf_name.rsplit(".", 1) if hf_name.endswith((".weight", ".bias")) else (hf_name, "")
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"gguf's TensorNameMap has no {arch} name for {hf_name}")
        gguf_name += f".{suffix}" if suffix else ""
        out[gguf_name] = _rearranged(family, hp, hf_name, t)
        if gguf_name == "token_embd.weight" and family in ("gpt2", "bloom") and "lm_head.weight" not in tensors:
            out["output.weight"] = t  # the converter duplicates the tied head
    for gguf_name, t in out.items():
        array = t.numpy().astype(np.float32)
        kind = _store_type(gguf_name, array, qtype)
        if kind == Q.F32:
            w.add_tensor(gguf_name, array)
        elif kind == Q.F16:
            w.add_tensor(gguf_name, array.astype(np.float16))
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
