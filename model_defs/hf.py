"""Import Hugging Face checkpoints (config.json + *.safetensors) of supported families.

Two explicit tables per family: config keys -> ModelConfig fields, and weight
names -> kvforge parameter names (with the transform each needs). Loading is
strict: every kvforge parameter must come from exactly one checkpoint tensor
of the right shape, and every checkpoint tensor must be used. Only
safetensors are read; pickle-based files are refused.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from kvforge.errors import KvforgeError

from .config import ModelConfig

SUPPORTED_FAMILIES = ("gpt2", "llama", "mistral", "qwen2")

_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}

# Checkpoint entries that are buffers, not weights (older exports saved them).
_IGNORED = (re.compile(r"(^|\.)attn\.(bias|masked_bias)$"), re.compile(r"rotary_emb\.inv_freq$"))


# --- config -------------------------------------------------------------------
def _activation(hf: dict[str, Any], key: str) -> str:
    name = hf.get(key, "silu")
    if name not in _ACTIVATIONS:
        raise KvforgeError(f"activation {name!r} ({key}) is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either the v5 `rope_parameters` or the v4 `rope_theta`/`rope_scaling` keys."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    # transformers' Llama, Mistral and Qwen2 rotate the whole head: their default RoPE ignores
    # partial_rotary_factor, and the scaled RoPE types would compute tables too short for the head.
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if kind == "default":
        return out
    if partial != 1.0:
        raise KvforgeError(f"partial_rotary_factor {partial} with rope type {kind!r} is not supported: transformers' "
                           f"{hf.get('model_type')} rotates whole heads, so its tables would not match them")
    if kind == "linear":
        out["rope_scaling"] = {"type": "linear", "factor": float(params["factor"])}
    elif kind == "llama3":
        out["rope_scaling"] = {
            "type": "llama3",
            "factor": float(params["factor"]),
            "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_seq_len": int(params["original_max_position_embeddings"]),
        }
    else:
        raise KvforgeError(f"rope type {kind!r} is not supported (supported: default, linear, llama3)")
    return out


def _special_ids(hf: dict[str, Any]) -> dict[str, Any]:
    """bos/eos/pad ids; eos may be a list (Llama 3). Ids outside the vocabulary,
    which transformers tolerates in configs, are dropped with a warning."""
    vocab = hf["vocab_size"]
    out: dict[str, Any] = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = hf.get(key)
        ids = value if isinstance(value, list) else [value]
        kept = [i for i in ids if isinstance(i, int) and 0 <= i < vocab]
        dropped = [i for i in ids if i is not None and i not in kept]
        if dropped:
            warnings.warn(f"config.json {key}={value} lies outside the vocabulary ({vocab}); ignoring {dropped}")
        out[key] = (kept if len(kept) > 1 else kept[0]) if kept else None
        if key != "eos_token_id" and isinstance(out[key], list):
            out[key] = out[key][0]
    return out


def _llama_like(hf: dict[str, Any], family: str) -> dict[str, Any]:
    heads = hf["num_attention_heads"]
    cfg = dict(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation=_activation(hf, "hidden_act"),
        gated_ffn=True,
        ffn_bias=bool(hf.get("mlp_bias", False)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        out_bias=bool(hf.get("attention_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        family=family,
        **_rope(hf),
        **_special_ids(hf),
    )
    return cfg


def _llama(hf):
    return _llama_like(hf, "llama")


def _mistral(hf):
    cfg = _llama_like(hf, "mistral")
    cfg.update(qkv_bias=False, out_bias=False, ffn_bias=False)  # transformers' Mistral has no biases, whatever the config says
    cfg["sliding_window"] = hf.get("sliding_window")
    return cfg


def _qwen2(hf):
    cfg = _llama_like(hf, "qwen2")
    cfg.update(qkv_bias=True, out_bias=False, ffn_bias=False)
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types is None and hf.get("use_sliding_window"):  # v4 configs: windowed from max_window_layers on
        first = hf.get("max_window_layers", cfg["n_layers"])
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(cfg["n_layers"])]
    windowed = [i for i, t in enumerate(layer_types or []) if t == "sliding_attention"]
    if window and windowed:
        cfg.update(sliding_window=window, sliding_window_layers=windowed)
    return cfg


def _gpt2(hf):
    unsupported = [k for k in ("scale_attn_by_inverse_layer_idx", "add_cross_attention") if hf.get(k)]
    if hf.get("scale_attn_weights", True) is False:
        unsupported.append("scale_attn_weights=false")
    if unsupported:
        raise KvforgeError(f"GPT-2 options not supported: {unsupported}")
    dim = hf["n_embd"]
    return dict(
        vocab_size=hf["vocab_size"],
        dim=dim,
        n_layers=hf["n_layer"],
        n_heads=hf["n_head"],
        ffn_dim=hf.get("n_inner") or 4 * dim,
        max_seq_len=hf["n_positions"],
        position="learned",
        norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=_activation(hf, "activation_function"),
        gated_ffn=False,
        qkv_bias=True,
        out_bias=True,
        ffn_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        family="gpt2",
        **_special_ids(hf),
    )


_CONFIG_MAPPERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "gpt2": _gpt2,
}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    family = hf.get("model_type")
    if family not in _CONFIG_MAPPERS:
        archs = hf.get("architectures")
        raise KvforgeError(
            f"unsupported architecture: model_type={family!r} (architectures={archs}); "
            f"supported model types: {list(SUPPORTED_FAMILIES)}"
        )
    try:
        return ModelConfig(**_CONFIG_MAPPERS[family](hf))
    except KeyError as e:
        raise KvforgeError(f"{family} config.json lacks the key {e.args[0]!r}") from e


# --- weights ------------------------------------------------------------------
# kvforge name pattern -> (checkpoint name pattern, transform). `{i}` is the layer.
# Transforms: None (as is), "T" (GPT-2 Conv1D stores (in, out): transpose),
# ("qkv", j) (GPT-2 fuses q, k, v along the output axis: take part j, transpose).
_LLAMA_WEIGHTS = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{
        f"layers.{{i}}.attn.{p}_proj.{t}": f"model.layers.{{i}}.self_attn.{p}_proj.{t}"
        for p in ("q", "k", "v", "o")
        for t in ("weight", "bias")
    },
    **{
        f"layers.{{i}}.ffn.{p}_proj.{t}": f"model.layers.{{i}}.mlp.{p}_proj.{t}"
        for p in ("gate", "up", "down")
        for t in ("weight", "bias")
    },
}
_GPT2_WEIGHTS = {
    "embed.weight": ("wte.weight", None),
    "positions.weight": ("wpe.weight", None),
    "norm.weight": ("ln_f.weight", None),
    "norm.bias": ("ln_f.bias", None),
    "layers.{i}.attn_norm.weight": ("h.{i}.ln_1.weight", None),
    "layers.{i}.attn_norm.bias": ("h.{i}.ln_1.bias", None),
    "layers.{i}.ffn_norm.weight": ("h.{i}.ln_2.weight", None),
    "layers.{i}.ffn_norm.bias": ("h.{i}.ln_2.bias", None),
    **{f"layers.{{i}}.attn.{p}_proj.weight": ("h.{i}.attn.c_attn.weight", ("qkv", j)) for j, p in enumerate("qkv")},
    **{f"layers.{{i}}.attn.{p}_proj.bias": ("h.{i}.attn.c_attn.bias", ("qkv", j)) for j, p in enumerate("qkv")},
    "layers.{i}.attn.o_proj.weight": ("h.{i}.attn.c_proj.weight", "T"),
    "layers.{i}.attn.o_proj.bias": ("h.{i}.attn.c_proj.bias", None),
    "layers.{i}.ffn.up_proj.weight": ("h.{i}.mlp.c_fc.weight", "T"),
    "layers.{i}.ffn.up_proj.bias": ("h.{i}.mlp.c_fc.bias", None),
    "layers.{i}.ffn.down_proj.weight": ("h.{i}.mlp.c_proj.weight", "T"),
    "layers.{i}.ffn.down_proj.bias": ("h.{i}.mlp.c_proj.bias", None),
    "lm_head.weight": ("lm_head.weight", None),  # only when tie_word_embeddings is false
}
WEIGHT_TABLES: dict[str, dict[str, Any]] = {
    "llama": {k: (v, None) for k, v in _LLAMA_WEIGHTS.items()},
    "mistral": {k: (v, None) for k, v in _LLAMA_WEIGHTS.items()},
    "qwen2": {k: (v, None) for k, v in _LLAMA_WEIGHTS.items()},
    "gpt2": _GPT2_WEIGHTS,
}
# GPT-2 checkpoints come with or without the "transformer." prefix of GPT2LMHeadModel.
_OPTIONAL_PREFIX = {"gpt2": "transformer."}


def _source_name(family: str, ours: str) -> tuple[str, Any]:
    """The checkpoint name and transform that feed the kvforge parameter `ours`."""
    layer = re.match(r"layers\.(\d+)\.(.*)", ours)
    key = f"layers.{{i}}.{layer.group(2)}" if layer else ours
    entry = WEIGHT_TABLES[family].get(key)
    if entry is None:
        raise KvforgeError(f"no {family} checkpoint name is known for parameter {ours!r}")
    name, transform = entry
    return (name.format(i=layer.group(1)) if layer else name), transform


def _apply(transform: Any, tensor: torch.Tensor) -> torch.Tensor:
    if transform is None:
        return tensor
    if transform == "T":
        return tensor.t()
    _, j = transform  # fused qkv: (in, 3 * out) or (3 * out,)
    part = tensor.chunk(3, dim=-1)[j]
    return part.t() if part.ndim == 2 else part


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({directory / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise KvforgeError(f"{index} names shard files that do not exist: {missing}")
        return files
    if (directory / "model.safetensors").is_file():  # as transformers: other .safetensors (adapters, ...) are not the model
        return [directory / "model.safetensors"]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" It has {pickles}: kvforge reads no pickle files; convert them to safetensors first." if pickles else ""
        raise KvforgeError(f"no *.safetensors weights in {directory}.{hint}")
    if len(files) > 1:
        raise KvforgeError(f"{directory} has several .safetensors files ({[f.name for f in files]}) but neither "
                           "model.safetensors nor model.safetensors.index.json to say which hold the model")
    return files


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise KvforgeError(f"cannot read {f}: {e}") from e
        dup = sorted(set(part) & set(tensors))
        if dup:
            raise KvforgeError(f"tensors {dup[:5]} appear in more than one shard ({f.name})")
        tensors.update(part)
    return tensors


def state_dict_from_hf(model: torch.nn.Module, family: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map checkpoint tensors onto `model`'s parameters, strictly.

    Raises one KvforgeError that lists every missing tensor, every unused one
    and every shape mismatch.
    """
    prefix = _OPTIONAL_PREFIX.get(family)
    if prefix:
        tensors = {k.removeprefix(prefix): v for k, v in tensors.items()}
    tied = model.config.tie_embeddings
    wanted = [n for n in model.state_dict() if not (tied and n == "lm_head.weight")]

    out, used, missing, shapes = {}, set(), [], []
    expected = model.state_dict()
    for ours in wanted:
        name, transform = _source_name(family, ours)
        if name not in tensors:
            missing.append(name)
            continue
        used.add(name)
        value = _apply(transform, tensors[name])
        if tuple(value.shape) != tuple(expected[ours].shape):
            shapes.append(f"{name}: checkpoint {tuple(value.shape)} vs config {tuple(expected[ours].shape)} ({ours})")
            continue
        out[ours] = value
    extra = sorted(k for k in tensors if k not in used and not any(p.search(k) for p in _IGNORED))
    if tied and "lm_head.weight" in extra:
        # Some exports write the tied head anyway: accept it only if it really is the embedding.
        emb_name, _ = _source_name(family, "embed.weight")
        if emb_name in tensors and torch.equal(tensors["lm_head.weight"], tensors[emb_name]):
            extra.remove("lm_head.weight")
    if missing or extra or shapes:
        lines = []
        if missing:
            lines.append(f"missing tensors ({len(missing)}): {missing}")
        if extra:
            lines.append(f"unexpected tensors ({len(extra)}): {extra}")
        if shapes:
            lines.append("shape mismatches:\n    " + "\n    ".join(shapes))
        raise KvforgeError(f"{family} checkpoint does not match its config:\n  " + "\n  ".join(lines))
    return out


def read_hf_config(directory: Path) -> dict[str, Any]:
    """config.json, with generation_config.json's eos_token_id over the config's: what transformers' generate stops on."""
    hf = _read_json(directory / "config.json")
    generation = directory / "generation_config.json"
    if generation.is_file():
        eos = _read_json(generation).get("eos_token_id")
        if eos is not None:
            hf["eos_token_id"] = eos
    return hf


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise KvforgeError(f"{path} is not valid JSON: {e}") from e
