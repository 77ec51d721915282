"""What the Hugging Face family modules share (hf_families.py holds the registry of families): the tensor
transforms, the config.json readers (key aliases, activations, special ids, RoPE parameters, sliding windows)
and the pieces the weight tables are built from.

Transforms take (tensor, config) and return the tensor kvforge's parameter
holds: a slice of a fused projection (laid out as each family lays it out), a
transpose (GPT-2's Conv1D), Gemma's norm weights w -> 1 + w (Gemma computes
x * (1 + w)), a q/k norm weight shared by all heads repeated per head, or the
RoPE permutation: GPT-J and Cohere rotate interleaved pairs (2i, 2i+1) where
kvforge rotates halves (i, i + rot/2), so their q/k output features are
reordered within each head (q.k is unchanged when q and k are permuted alike).
Each transform is named after what it undoes.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from kvforge.errors import KvforgeError

Transform = Callable[[torch.Tensor, Any], torch.Tensor]
Table = dict[str, tuple[str, Transform | None]]

ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}

# --- transforms -----------------------------------------------------------------
def transpose(t, cfg):
    return t.t()


def gpt2_qkv(j: int) -> Transform:
    """GPT-2's Conv1D c_attn stores (in, 3 * out): part j, transposed (a bias (3 * out,) is just split)."""

    def f(t, cfg):
        part = t.chunk(3, dim=-1)[j]
        return part.t() if part.ndim == 2 else part
    return f


def rows(sizes: Callable[[Any], list[int]], j: int) -> Transform:
    """Part j of a projection fused by concatenating outputs (Phi-3's qkv_proj [q | k | v], gate_up_proj [gate | up])."""

    def f(t, cfg):
        parts = sizes(cfg)
        if t.shape[0] != sum(parts):
            raise ValueError(f"{t.shape[0]} rows cannot be split into {parts}")
        return t.split(parts, dim=0)[j]
    return f


def per_head(parts: int, j: int) -> Transform:
    """Part j of a projection fused per head, [heads, parts, head_dim] (GPT-NeoX, BLOOM, Falcon without MQA)."""

    def f(t, cfg):
        x = t.reshape(cfg.n_heads, parts, cfg.head_dim, *t.shape[1:])
        return x[:, j].reshape(cfg.n_heads * cfg.head_dim, *t.shape[1:])
    return f


def falcon_grouped(j: int) -> Transform:
    """Falcon's new decoder architecture: [kv_heads, G + 2, head_dim], each group's G query heads, then k, then v."""

    def f(t, cfg):
        kv, d = cfg.n_kv_heads, cfg.head_dim
        g = cfg.n_heads // kv
        x = t.reshape(kv, g + 2, d, *t.shape[1:])
        part = x[:, :g] if j == 0 else x[:, g + j - 1]
        return part.reshape(-1, *t.shape[1:])
    return f


def half_split(heads: Callable[[Any], int]) -> Transform:
    """Reorder each head's rotary features from interleaved pairs (GPT-J, Cohere) to kvforge's halves."""

    def f(t, cfg):
        h, d, rot = heads(cfg), cfg.head_dim, cfg.rotary_dim
        perm = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, d)])
        return t.reshape(h, d, *t.shape[1:])[:, perm].reshape(h * d, *t.shape[1:])
    return f


def plus_one(t, cfg):
    """Gemma stores a norm's weight w and multiplies by (1 + w), in float32."""
    return t.float() + 1.0


def repeat_heads(heads: Callable[[Any], int]) -> Transform:
    """One q/k norm weight (head_dim,) shared by every head -> kvforge's one row per head."""
    return lambda t, cfg: t.reshape(-1).repeat(heads(cfg))


def flatten(t, cfg):
    return t.reshape(-1)


def chain(*fs: Transform) -> Transform:
    return lambda t, cfg: functools.reduce(lambda x, fn: fn(x, cfg), fs, t)


def query_heads(cfg) -> int:
    return cfg.n_heads


def kv_heads(cfg) -> int:
    return cfg.n_kv_heads


# --- config helpers -------------------------------------------------------------
def first(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of `keys` present (and not null) in config.json: transformers' attribute aliases."""
    for k in keys:
        if hf.get(k) is not None:
            return hf[k]
    return default


def require(hf: dict[str, Any], *keys: str) -> Any:
    value = first(hf, *keys)
    if value is None:
        raise KeyError(keys[0])
    return value


def activation(hf: dict[str, Any], key: str, default: str) -> str:
    name = hf.get(key) or default
    if name not in ACTIVATIONS:
        raise KvforgeError(f"activation {name!r} ({key}) is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def special_ids(hf: dict[str, Any]) -> dict[str, Any]:
    """bos/eos/pad ids; eos may be a list (Llama 3). Ids outside the vocabulary,
    which transformers tolerates in configs, are dropped with a warning."""
    import warnings

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


def rope_parameters(hf: dict[str, Any], default_theta: float = 10000.0, theta_keys: tuple[str, ...] = ("rope_theta",),
                    partial_keys: tuple[str, ...] = ("partial_rotary_factor",), default_partial: float = 1.0) -> dict:
    """transformers' rope_parameters: a legacy `rope_scaling` replaces them, and the family's top-level keys fill in
    the base and the rotary fraction they lack (which keys a family reads differs: GPT-NeoX ignores `rope_theta`)."""
    legacy = hf.get("rope_scaling")
    params = dict(legacy) if legacy else dict(hf.get("rope_parameters") or {})
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    params.setdefault("rope_theta", first(hf, *theta_keys, default=default_theta))
    params.setdefault("partial_rotary_factor", first(hf, *partial_keys, default=default_partial))
    if params["rope_type"] in ("llama3", "yarn", "longrope") and "original_max_position_embeddings" in hf:
        # a top-level value (Phi-3 style) wins over the one in rope_scaling, as transformers standardizes it
        params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    return params


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_fields(params: dict[str, Any], hf: dict[str, Any], partial_rotary: bool) -> dict[str, Any]:
    """ModelConfig's RoPE fields from rope_parameters.

    partial_rotary: the family rotates only `partial_rotary_factor` of each head
    (GPT-NeoX, Phi-3). Llama-style families rotate whole heads: their default
    RoPE ignores the factor, and with a scaled RoPE transformers itself fails
    (its tables come out shorter than the heads), so that is refused.
    """
    kind = params["rope_type"]
    partial = float(params.get("partial_rotary_factor") or 1.0)
    out: dict[str, Any] = {"rope_theta": float(params["rope_theta"])}
    if partial_rotary:
        out["rotary_fraction"] = partial
    elif kind != "default" and partial != 1.0:
        raise KvforgeError(f"partial_rotary_factor {partial} with rope type {kind!r} is not supported: transformers' "
                           f"{hf.get('model_type')} rotates whole heads, so its tables would not match them")
    mpe = hf.get("max_position_embeddings") or 2048
    omax = int(params.get("original_max_position_embeddings") or mpe)
    if kind == "default":
        return out
    if kind == "linear":
        out["rope_scaling"] = {"type": "linear", "factor": float(params["factor"])}
    elif kind == "llama3":
        out["rope_scaling"] = {
            "type": "llama3",
            "factor": float(params["factor"]),
            "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_seq_len": omax,
        }
    elif kind == "yarn":
        factor = float(params.get("factor") or mpe / omax)
        attention = params.get("attention_factor")
        if attention is None:
            ms, ms_all = params.get("mscale"), params.get("mscale_all_dim")
            attention = yarn_mscale(factor, ms) / yarn_mscale(factor, ms_all) if ms and ms_all else yarn_mscale(factor)
        out["rope_scaling"] = {
            "type": "yarn", "factor": factor, "original_max_seq_len": omax,
            "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
            "attention_factor": float(attention), "truncate": bool(params.get("truncate", True)),
        }
    elif kind == "longrope":
        factor = float(params.get("factor") or mpe / omax)
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(omax))
        out["rope_scaling"] = {
            "type": "longrope", "short_factor": [float(x) for x in params["short_factor"]],
            "long_factor": [float(x) for x in params["long_factor"]], "original_max_seq_len": omax,
            "attention_factor": float(attention),
        }
    elif kind == "dynamic":
        raise KvforgeError("rope type 'dynamic' is not supported: transformers' dynamic NTK RoPE changes its base with "
                           "the longest sequence seen so far (it depends on the call history), which no fixed graph computes")
    else:
        raise KvforgeError(f"rope type {kind!r} is not supported (supported: default, linear, llama3, yarn, longrope)")
    return out


def windowed_layers(hf: dict[str, Any], n_layers: int, window: int | None, layer_types: list[str] | None) -> dict[str, Any]:
    """sliding_window / sliding_window_layers from transformers' layer_types ("sliding_attention" / "full_attention")."""
    if layer_types is None:
        return {}
    if len(layer_types) != n_layers:
        raise KvforgeError(f"config.json layer_types has {len(layer_types)} entries for {n_layers} layers")
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise KvforgeError(f"layer types {unknown} are not supported (supported: sliding_attention, full_attention)")
    windowed = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    if not windowed:
        return {}
    if not window:
        raise KvforgeError(f"{hf.get('model_type')} config.json has sliding_attention layers {windowed} but no sliding_window")
    return {"sliding_window": int(window), "sliding_window_layers": windowed}


def refuse(hf: dict[str, Any], reason: str, *keys: str) -> None:
    set_keys = [k for k in keys if hf.get(k)]
    if set_keys:
        raise KvforgeError(f"{hf.get('model_type')} option(s) {set_keys} not supported: {reason}")


# --- weight tables --------------------------------------------------------------
def linear_weights(ours: str, theirs: str, transform: Transform | None = None) -> Table:
    return {f"{ours}.weight": (f"{theirs}.weight", transform), f"{ours}.bias": (f"{theirs}.bias", transform)}


def norm_weights(ours: str, theirs: str, transform: Transform | None = None) -> Table:
    return linear_weights(ours, theirs, transform)

def mlp_weights(prefix: str, up: str, down: str) -> Table:
    return {**linear_weights("layers.{i}.ffn.up_proj", f"{prefix}.{up}"),
            **linear_weights("layers.{i}.ffn.down_proj", f"{prefix}.{down}")}
