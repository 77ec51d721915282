"""The Hugging Face families kvforge imports: per `model_type`, two explicit tables.

- a config mapper: config.json -> ModelConfig fields (EncoderConfig's for BERT
  and RoBERTa, Seq2SeqConfig's for T5 and BART), with transformers' own
  defaults for absent keys (they differ by family: Qwen3's head_dim is 128,
  Cohere's RoPE base 500000, GPT-NeoX rotates a quarter of each head ...) and a
  clear error for the options transformers itself cannot run or that kvforge
  does not compute;
- a weight table: kvforge parameter name -> (checkpoint tensor name, transform).

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
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvforge.errors import KvforgeError

Transform = Callable[[torch.Tensor, Any], torch.Tensor]
Table = dict[str, tuple[str, Transform | None]]

_ACTIVATIONS = {
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
    if name not in _ACTIVATIONS:
        raise KvforgeError(f"activation {name!r} ({key}) is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


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


def _mscale(scale: float, mscale: float = 1.0) -> float:
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
            attention = _mscale(factor, ms) / _mscale(factor, ms_all) if ms and ms_all else _mscale(factor)
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


def _refuse(hf: dict[str, Any], reason: str, *keys: str) -> None:
    set_keys = [k for k in keys if hf.get(k)]
    if set_keys:
        raise KvforgeError(f"{hf.get('model_type')} option(s) {set_keys} not supported: {reason}")


# --- Llama-style families -------------------------------------------------------
def llama_like(hf: dict[str, Any], family: str, *, eps: float = 1e-6, head_dim: int | None = None,
               kv_heads_default: int | None = None, theta: float = 10000.0, tie: bool = False,
               act_key: str = "hidden_act", act_default: str = "silu", attention_bias: bool | None = None,
               rope: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields every decoder with separate q/k/v/o projections and a gated MLP shares.

    rope: the RoPE fields when the family reads them its own way (default: whole-head RoPE from rope_parameters).
    """
    heads = hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False)) if attention_bias is None else attention_bias
    if rope is None:
        rope = rope_fields(rope_parameters(hf, default_theta=theta), hf, partial_rotary=False)
    return dict(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or kv_heads_default or heads,
        head_dim=hf.get("head_dim") or head_dim or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings") or 2048,
        norm="rmsnorm",
        norm_eps=first(hf, "rms_norm_eps", default=eps),
        activation=activation(hf, act_key, act_default),
        gated_ffn=True,
        ffn_bias=bool(hf.get("mlp_bias", False)),
        qkv_bias=bias,
        out_bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", tie)),
        family=family,
        **rope,
        **special_ids(hf),
    )


def _llama(hf):
    return llama_like(hf, "llama")


def _mistral(hf):
    cfg = llama_like(hf, "mistral", attention_bias=False)
    cfg["ffn_bias"] = False  # transformers' Mistral has no biases, whatever the config says
    cfg["sliding_window"] = hf.get("sliding_window")
    return cfg


def _qwen_windows(hf: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """Qwen2/Qwen3: layer_types, or (older configs) the layers from max_window_layers on slide when use_sliding_window."""
    layer_types = hf.get("layer_types")
    if layer_types is None:
        if not hf.get("use_sliding_window"):
            return {}
        first_windowed = hf.get("max_window_layers", n_layers)
        layer_types = ["sliding_attention" if i >= first_windowed else "full_attention" for i in range(n_layers)]
    if not hf.get("sliding_window"):
        return {}  # transformers drops the window when use_sliding_window is off
    return windowed_layers(hf, n_layers, hf.get("sliding_window"), layer_types)


def _qwen2(hf):
    cfg = llama_like(hf, "qwen2", attention_bias=True)
    cfg.update(out_bias=False, ffn_bias=False)
    cfg.update(_qwen_windows(hf, cfg["n_layers"]))
    return cfg


def _qwen3(hf):
    # Qwen3's config defaults: head_dim 128 (not hidden / heads) and 32 KV heads when the keys are absent.
    cfg = llama_like(hf, "qwen3", head_dim=128, kv_heads_default=32)
    cfg.update(ffn_bias=False, qk_norm="head")
    cfg.update(_qwen_windows(hf, cfg["n_layers"]))
    return cfg


def _olmo2(hf):
    cfg = llama_like(hf, "olmo2", eps=1e-5)
    cfg.update(ffn_bias=False, norm_placement="output", qk_norm="proj")
    return cfg


def _moe_layers(hf: dict[str, Any], n_layers: int) -> list[int]:
    """Qwen-MoE's layers with experts: every decoder_sparse_step-th one not in mlp_only_layers."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]


def _n_experts(hf: dict[str, Any], default: int) -> int:
    """The routed expert count: num_experts, or num_local_experts (Mixtral's name, and transformers 5's for Qwen3-MoE)."""
    return int(next((hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None), default))


def _mixtral(hf):
    cfg = _mistral(hf)
    cfg.update(family="mixtral", n_experts=_n_experts(hf, 8), experts_per_token=hf.get("num_experts_per_tok", 2),
               expert_ffn_dim=hf.get("intermediate_size", 14336), norm_topk_prob=True)
    return cfg


def _qwen2_moe(hf):
    cfg = _qwen2(hf)
    cfg.update(family="qwen2_moe", n_experts=_n_experts(hf, 60), experts_per_token=hf.get("num_experts_per_tok", 4),
               expert_ffn_dim=hf.get("moe_intermediate_size", 1408), norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
               shared_expert_ffn_dim=hf.get("shared_expert_intermediate_size", 5632), shared_expert_gate=True,
               moe_layers=_moe_layers(hf, cfg["n_layers"]))
    return cfg


def _qwen3_moe(hf):
    cfg = _qwen3(hf)
    cfg.update(family="qwen3_moe", n_experts=_n_experts(hf, 128), experts_per_token=hf.get("num_experts_per_tok", 8),
               expert_ffn_dim=hf.get("moe_intermediate_size", 768), norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
               moe_layers=_moe_layers(hf, cfg["n_layers"]))
    return cfg


def _olmoe(hf):
    if hf.get("clip_qkv") is not None:
        raise KvforgeError("olmoe clip_qkv (clamping q, k and v) is not supported")
    cfg = llama_like(hf, "olmoe", eps=1e-5)
    cfg.update(ffn_bias=False, qk_norm="proj", n_experts=_n_experts(hf, 64),
               experts_per_token=hf.get("num_experts_per_tok", 8), expert_ffn_dim=hf.get("intermediate_size", 1024),
               norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    return cfg


def _deepseek(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """DeepSeek-V2/V3: latent attention, a dense FFN on the first first_k_dense_replace layers, then routed experts
    beside always-on shared ones (n_shared_experts of them: one FFN of that multiple of moe_intermediate_size)."""
    v3 = family == "deepseek_v3"
    if not v3 and hf.get("mlp_bias"):
        raise KvforgeError("deepseek_v2 mlp_bias is not supported: transformers' experts have no biases while its "
                           "dense and shared FFNs would")
    heads = hf["num_attention_heads"]
    cfg = llama_like(hf, family, kv_heads_default=heads)
    n = cfg["n_layers"]
    rope_dim, nope = int(hf.get("qk_rope_head_dim", 64)), int(hf.get("qk_nope_head_dim", 128))
    method = "group_limited_greedy" if v3 else hf.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise KvforgeError(f"deepseek_v2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    groups = int(hf.get("n_group") or 1) if method == "group_limited_greedy" else 1
    cfg.update(
        n_kv_heads=heads, head_dim=rope_dim, kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
        q_lora_rank=hf.get("q_lora_rank", 1536), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
        v_head_dim=int(hf.get("v_head_dim") or 128), ffn_bias=bool(hf.get("mlp_bias", False)),
        n_experts=_n_experts({"num_experts": hf.get("n_routed_experts")}, 256 if v3 else 64),
        experts_per_token=int(hf.get("num_experts_per_tok") or (8 if v3 else 6)),
        expert_ffn_dim=int(hf.get("moe_intermediate_size", 2048 if v3 else 1407)),
        router_scoring="sigmoid" if v3 else "softmax", router_correction_bias=v3,
        # transformers' V2 router never renormalizes its top-k, whatever norm_topk_prob says
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if v3 else False,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        router_groups=groups, router_topk_groups=int(hf.get("topk_group") or 1) if groups > 1 else 1,
        router_group_score="top2" if v3 else "max",
        shared_expert_ffn_dim=int(hf.get("moe_intermediate_size", 2048 if v3 else 1407))
        * int(hf.get("n_shared_experts") or 0),
        moe_layers=list(range(int(hf.get("first_k_dense_replace") or 0), n)),
    )
    params = rope_parameters(hf)
    mscale_all = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all:
        # YaRN's softmax scale: 1/sqrt(qk head dim) * mscale(factor, mscale_all_dim)^2
        cfg["attn_scale"] = (nope + rope_dim) ** -0.5 * _mscale(float(params["factor"]), float(mscale_all)) ** 2
    return cfg


def _deepseek_v2(hf):
    return _deepseek(hf, "deepseek_v2")


def _deepseek_v3(hf):
    return _deepseek(hf, "deepseek_v3")


def _granite(hf):
    cfg = llama_like(hf, "granite")
    cfg.update(
        embed_scale=float(hf.get("embedding_multiplier", 1.0)),
        residual_scale=float(hf.get("residual_multiplier", 1.0)),
        attn_scale=float(hf.get("attention_multiplier", 1.0)),  # replaces 1/sqrt(head_dim); its default is 1.0
        logit_scale=1.0 / float(hf.get("logits_scaling", 1.0)),  # transformers divides the logits by logits_scaling
    )
    return cfg


def _cohere(hf):
    if hf.get("logit_scale", 0.0625) is None:
        raise KvforgeError("cohere config.json has logit_scale null, which transformers' Cohere cannot run (it multiplies by it)")
    cfg = llama_like(hf, "cohere", theta=500000.0, tie=True)
    cfg.update(
        norm="layernorm", norm_bias=False, norm_eps=hf.get("layer_norm_eps", 1e-5), block="parallel", ffn_bias=False,
        qk_norm="head" if hf.get("use_qk_norm") else None, logit_scale=float(hf.get("logit_scale", 0.0625)),
    )
    return cfg


def _phi3(hf):
    # Phi-3 reads partial_rotary_factor, allows default and longrope (older configs say su or yarn for it), and
    # takes original_max_position_embeddings from the top level whatever rope_scaling says.
    params = rope_parameters(hf)
    if params["rope_type"] in ("su", "yarn"):
        params["rope_type"] = "longrope"
    if params["rope_type"] not in ("default", "longrope"):
        raise KvforgeError(f"phi3 rope type {params['rope_type']!r} is not one transformers' Phi-3 runs (default, longrope)")
    params["original_max_position_embeddings"] = hf.get("original_max_position_embeddings") or 4096  # the class default
    cfg = llama_like(hf, "phi3", eps=1e-5, attention_bias=False, rope=rope_fields(params, hf, partial_rotary=True))
    cfg["ffn_bias"] = False
    if hf.get("sliding_window"):
        cfg["sliding_window"] = int(hf["sliding_window"])
    return cfg


def _gemma_common(hf, family: str, act_key: str, rope: dict[str, Any] | None = None) -> dict[str, Any]:
    _refuse(hf, "bidirectional attention makes an encoder (an embedding model), and kvforge exports causal decoders"
                + ("" if family == "gemma3_text" else "; transformers' Gemma runs it only on some of its paths"),
            "use_bidirectional_attention")
    cfg = llama_like(hf, family, head_dim=256, tie=True, act_key=act_key, act_default="gelu_pytorch_tanh", rope=rope)
    cfg.update(ffn_bias=False, embed_scale=float(torch.tensor(hf["hidden_size"] ** 0.5, dtype=torch.float32)))
    return cfg


def _gemma(hf):
    cfg = _gemma_common(hf, "gemma", "hidden_act")
    if hf.get("hidden_act") == "gelu":  # transformers' Gemma rewrites it: Gemma's GELU is the tanh one
        cfg["activation"] = "gelu_tanh"
    return cfg


def _gemma2(hf):
    cfg = _gemma_common(hf, "gemma2", "hidden_activation")
    n = cfg["n_layers"]
    layer_types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    cfg.update(
        norm_placement="sandwich",
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=hf.get("attn_logit_softcapping", 50.0),
        final_softcap=hf.get("final_logit_softcapping", 30.0),
        **windowed_layers(hf, n, hf.get("sliding_window", 4096), layer_types),
    )
    return cfg


def _gemma3_rope(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full-attention, sliding-attention) rope parameters, as Gemma3TextConfig builds them: nested
    rope_parameters (or two default ones), a legacy rope_scaling merged into the full layers' only, and the
    bases a nested dict lacks from rope_theta (full, 1e6) and rope_local_base_freq (sliding, 1e4)."""
    nested = {k: dict(v) for k, v in (hf.get("rope_parameters") or {}).items() if isinstance(v, dict)}
    full = nested.get("full_attention") or {"rope_type": "default"}
    local = nested.get("sliding_attention") or {"rope_type": "default"}
    if hf.get("rope_scaling"):
        full.update(hf["rope_scaling"])
    full.setdefault("rope_theta", hf.get("rope_theta", 1000000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    for params in (full, local):
        params.setdefault("rope_type", params.get("type", "default"))
        # transformers' YaRN reads `truncate` from the top of rope_parameters, which for Gemma 3 holds the two
        # layer types' dicts: it always truncates
        params["truncate"] = (hf.get("rope_parameters") or {}).get("truncate", True)
    return full, local


def _gemma3_text(hf):
    n = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", 6)  # transformers reads this key only (not _sliding_window_pattern)
    layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    full, local = _gemma3_rope(hf)
    cfg = _gemma_common(hf, "gemma3_text", "hidden_activation", rope=rope_fields(full, hf, partial_rotary=False))
    windows = windowed_layers(hf, n, hf.get("sliding_window", 4096), layer_types)
    if windows:
        local_rope = rope_fields(local, hf, partial_rotary=False)
        if local_rope.get("rope_scaling", {}).get("type") == "longrope":
            raise KvforgeError("gemma3 sliding-attention RoPE of type 'longrope' is not supported (linear, llama3, yarn are)")
        cfg.update(local_rope_theta=local_rope["rope_theta"], local_rope_scaling=local_rope.get("rope_scaling"))
    cfg.update(
        norm_placement="sandwich", qk_norm="head",
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=None,  # transformers' Gemma 3 never applies attn_logit_softcapping
        final_softcap=hf.get("final_logit_softcapping"),
        **windows,
    )
    return cfg


# --- GPT-2 and the parallel-block / ALiBi families ---------------------------------
def _gpt2(hf):
    unsupported = [k for k in ("scale_attn_by_inverse_layer_idx", "add_cross_attention") if hf.get(k)]
    if hf.get("scale_attn_weights", True) is False:
        unsupported.append("scale_attn_weights=false")
    if unsupported:
        raise KvforgeError(f"GPT-2 options not supported: {unsupported}")
    dim = hf["n_embd"]
    return dict(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["n_layer"], n_heads=hf["n_head"],
        ffn_dim=hf.get("n_inner") or 4 * dim, max_seq_len=hf["n_positions"], position="learned",
        norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation=activation(hf, "activation_function", "gelu_new"),
        gated_ffn=False, qkv_bias=True, out_bias=True, ffn_bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), family="gpt2", **special_ids(hf),
    )


def _layernorm_mlp(hf, family: str, dim: int, heads: int, layers: int, ffn_dim: int, eps_key: str, act: str, **fields):
    """The fields of the LayerNorm + plain-MLP families (GPT-NeoX, GPT-J, Falcon, BLOOM)."""
    return dict(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=layers, n_heads=heads, ffn_dim=ffn_dim,
        norm="layernorm", norm_eps=hf.get(eps_key, 1e-5), activation=act, gated_ffn=False, ffn_bias=True,
        family=family, **special_ids(hf), **fields,
    )


def rotary_fraction(family: str, rot: int, head_dim: int) -> float:
    """The ModelConfig fraction that gives exactly `rot` rotary features of a head_dim head (int(head_dim * f))."""
    if not 2 <= rot <= head_dim or rot % 2:
        raise KvforgeError(f"{family}: {rot} rotary features must be even and within the head dimension {head_dim}")
    fraction = rot / head_dim
    while int(head_dim * fraction) < rot:  # the float must give back exactly rot features
        fraction = math.nextafter(fraction, 1.0)
    return fraction


def _gpt_neox(hf):
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", True))
    # GPT-NeoX reads its base and rotary fraction from rotary_emb_base / rotary_pct (a top-level rope_theta is ignored)
    params = rope_parameters(hf, theta_keys=("rotary_emb_base",), partial_keys=("rotary_pct",), default_partial=0.25)
    rope = rope_fields(params, hf, partial_rotary=True)
    # its heads are always hidden / heads wide; a config's head_dim only sizes the rotary part, int(head_dim * pct)
    head_dim = dim // heads
    rope["rotary_fraction"] = rotary_fraction("gpt_neox", int((hf.get("head_dim") or head_dim) * rope["rotary_fraction"]), head_dim)
    return _layernorm_mlp(
        hf, "gpt_neox", dim, heads, hf["num_hidden_layers"], hf["intermediate_size"], "layer_norm_eps",
        activation(hf, "hidden_act", "gelu"),
        head_dim=head_dim, max_seq_len=hf.get("max_position_embeddings") or 2048,
        qkv_bias=bias, out_bias=bias, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        block="parallel_two_norms" if hf.get("use_parallel_residual", True) else "sequential",
        **rope,
    )


def _gptj(hf):
    dim, heads = require(hf, "n_embd", "hidden_size"), require(hf, "n_head", "num_attention_heads")
    head_dim = dim // heads
    fraction = rotary_fraction("gptj", int(hf.get("rotary_dim") or 64), head_dim)
    return _layernorm_mlp(
        hf, "gptj", dim, heads, require(hf, "n_layer", "num_hidden_layers"), hf.get("n_inner") or 4 * dim,
        "layer_norm_epsilon", activation(hf, "activation_function", "gelu_new"),
        max_seq_len=require(hf, "n_positions", "max_position_embeddings"), qkv_bias=False, out_bias=False,
        lm_head_bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", False)), block="parallel",
        rope_theta=10000.0, rotary_fraction=fraction,  # GPT-J's base is fixed and it has no RoPE scaling
    )


def _falcon_layout(hf: dict[str, Any]) -> str:
    if hf.get("new_decoder_architecture"):
        return "grouped"
    return "multi_query" if hf.get("multi_query", True) else "per_head"


def _falcon_norms(hf: dict[str, Any]) -> int:
    return (hf.get("num_ln_in_parallel_attn") or 2) if hf.get("new_decoder_architecture") else 1


def _falcon(hf):
    dim, heads = require(hf, "hidden_size", "n_embed"), hf["num_attention_heads"]
    layout, parallel = _falcon_layout(hf), hf.get("parallel_attn", True)
    if layout == "grouped":
        if not parallel:
            raise KvforgeError("falcon new_decoder_architecture with parallel_attn=false is not supported: transformers' "
                               "Falcon fails on it (the new architecture always runs attention and MLP in parallel)")
        kv = hf.get("num_kv_heads") or heads
        block = "parallel_two_norms" if _falcon_norms(hf) == 2 else "parallel"
    else:
        if parallel and hf.get("num_ln_in_parallel_attn") == 2:
            raise KvforgeError("falcon num_ln_in_parallel_attn=2 needs new_decoder_architecture (transformers fails without it)")
        if layout == "per_head" and (hf.get("num_kv_heads") or heads) != heads:
            raise KvforgeError("falcon without multi_query or the new architecture has one KV head per query head; "
                               f"num_kv_heads {hf.get('num_kv_heads')} != {heads}")
        kv = 1 if layout == "multi_query" else heads
        block = "parallel" if parallel else "sequential"
    bias = bool(hf.get("bias", False))
    fields = dict(
        n_kv_heads=kv, max_seq_len=hf.get("max_position_embeddings") or 2048, qkv_bias=bias, out_bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), block=block,
    )
    if hf.get("alibi"):
        # Falcon adds ALiBi before scaling the scores by 1/sqrt(head_dim), and transformers rounds it to bfloat16
        fields.update(position="alibi", alibi_scale=1.0 / math.sqrt(dim // heads), alibi_bf16=True)
    else:
        fields.update(rope_fields(rope_parameters(hf), hf, partial_rotary=False))
    cfg = _layernorm_mlp(hf, "falcon", dim, heads, hf["num_hidden_layers"], hf.get("ffn_hidden_size") or 4 * dim,
                         "layer_norm_epsilon", activation(hf, "activation", "gelu"), **fields)
    cfg["ffn_bias"] = bias
    return cfg


def _bloom(hf):
    if hf.get("apply_residual_connection_post_layernorm"):
        raise KvforgeError("bloom apply_residual_connection_post_layernorm=true is not supported (the residual would be "
                           "the normed input; no released BLOOM uses it)")
    if (hf.get("pretraining_tp") or 1) > 1 and hf.get("slow_but_exact"):
        raise KvforgeError("bloom slow_but_exact with pretraining_tp > 1 is not supported (transformers then drops the "
                           "biases of two projections)")
    dim = require(hf, "hidden_size", "n_embed")
    return _layernorm_mlp(
        hf, "bloom", dim, require(hf, "n_head", "num_attention_heads"), require(hf, "n_layer", "num_hidden_layers"),
        4 * dim, "layer_norm_epsilon", "gelu_tanh",  # BLOOM's GELU is the tanh form (its constant 0.79788456)
        max_seq_len=first(hf, "max_position_embeddings", "seq_length", default=2048), position="alibi",
        embed_norm=True, qkv_bias=True, out_bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


# --- encoders: BERT, RoBERTa (EncoderConfig fields) -------------------------------
# The head comes from config.json's architectures[0]: the class that saved the checkpoint, and so the tensors it
# holds. A config without `architectures` gets the pooler: AutoModel builds the base model, pooler included, from it.
_ENCODER_HEADS = {"Model": "pooler", "ForMaskedLM": "mlm", "ForSequenceClassification": "classification"}


def _encoder_head(hf: dict[str, Any], stem: str) -> str:
    archs = hf.get("architectures") or []
    if not archs:
        return "pooler"
    for suffix, head in _ENCODER_HEADS.items():
        if archs[0] == stem + suffix:
            return head
    raise KvforgeError(f"{hf.get('model_type')} architecture {archs[0]!r} is not supported; kvforge imports "
                       f"{[stem + suffix for suffix in _ENCODER_HEADS]} (the base model with its pooler, a masked-LM "
                       "head, a sequence classifier)")


def _encoder_labels(hf: dict[str, Any]) -> dict[str, Any]:
    """num_labels and the class names, ordered by id; without id2label, transformers' two LABEL_0, LABEL_1."""
    id2label = hf.get("id2label")
    if not id2label:
        n = int(hf.get("num_labels") or 2)
        return {"num_labels": n, "labels": [f"LABEL_{i}" for i in range(n)]}
    try:
        names = {int(k): str(v) for k, v in id2label.items()}
    except (TypeError, ValueError) as e:
        raise KvforgeError(f"{hf.get('model_type')} config.json id2label has a key that is not a class id: {e}") from e
    if sorted(names) != list(range(len(names))):
        raise KvforgeError(f"{hf.get('model_type')} config.json id2label ids {sorted(names)} are not 0..{len(names) - 1}")
    return {"num_labels": len(names), "labels": [names[i] for i in range(len(names))]}


def _bert_like(hf: dict[str, Any], family: str, stem: str, position: str, head_activation: str) -> dict[str, Any]:
    """The fields BERT and RoBERTa share: post-norm layers, learned positions and segment types, an embedding norm."""
    kind = hf.get("position_embedding_type") or "absolute"
    if kind != "absolute":  # transformers 5 dropped the relative kinds (it would silently compute absolute ones)
        raise KvforgeError(f"{family} position_embedding_type={kind!r} is not supported (only 'absolute'): the "
                           "relative kinds add learned distance terms to the attention scores")
    _refuse(hf, "kvforge imports bidirectional encoders (a decoder BERT/RoBERTa is a causal LM with cross-attention)",
            "is_decoder", "add_cross_attention")
    head = _encoder_head(hf, stem)
    fields = dict(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
        n_heads=hf["num_attention_heads"], ffn_dim=hf.get("intermediate_size") or 3072,
        max_seq_len=hf.get("max_position_embeddings") or 512, position=position,
        type_vocab_size=int(hf.get("type_vocab_size", 2)), embed_norm=True,
        norm="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12), norm_placement="post",
        activation=activation(hf, "hidden_act", "gelu"), head=head, head_activation=head_activation,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), family=family, **special_ids(hf),
    )
    if head == "classification":
        fields.update(_encoder_labels(hf))
    return fields


def _bert(hf):
    hf = {"pad_token_id": 0, **hf}  # the config class's default when the file lacks it
    # the masked-LM head's transform uses hidden_act too
    return _bert_like(hf, "bert", "Bert", "absolute", activation(hf, "hidden_act", "gelu"))


def _roberta(hf):
    # RoBERTa counts positions after the pad token (transformers' create_position_ids_from_input_ids); its
    # masked-LM head always uses the exact GELU, whatever hidden_act says
    hf = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, **hf}
    return _bert_like(hf, "roberta", "Roberta", "padded", "gelu")


# --- encoder-decoders: T5, BART (Seq2SeqConfig fields) ------------------------------
def _seq2seq_class(hf: dict[str, Any], lm_class: str) -> None:
    """kvforge builds the encoder-decoder with its language-model head only: config.json's architectures[0] must be
    that class (absent, the file is taken for it; its tensors are checked strictly all the same)."""
    archs = hf.get("architectures") or [lm_class]
    if archs[0] != lm_class:
        raise KvforgeError(f"{hf.get('model_type')} architecture {archs[0]!r} is not supported; kvforge imports "
                           f"{[lm_class]} (the encoder and the decoder with its language-model head)")


def _generation_ids(hf: dict[str, Any], start: int | None) -> dict[str, Any]:
    """bos/eos/pad, the decoder's first token and the tokens generate forces first (forced_bos_token_id) and at the
    last allowed step (forced_eos_token_id)."""
    vocab = hf["vocab_size"]
    out = special_ids(hf)
    out["decoder_start_token_id"] = start
    if not (isinstance(start, int) and 0 <= start < vocab):
        raise KvforgeError(f"{hf.get('model_type')} decoder_start_token_id={start!r} is not a token of the vocabulary "
                           f"(size {vocab})")
    for key in ("forced_bos_token_id", "forced_eos_token_id"):
        value = hf.get(key)
        if isinstance(value, list):  # one forced eos, as generate's processor takes it
            if len(value) != 1:
                raise KvforgeError(f"{hf.get('model_type')} {key}={value} is not supported (one token)")
            value = value[0]
        if value is not None and not (isinstance(value, int) and 0 <= value < vocab):
            raise KvforgeError(f"{hf.get('model_type')} {key}={value!r} is outside the vocabulary (size {vocab})")
        out[key] = value
    return out


def _t5_feed_forward(hf: dict[str, Any]) -> tuple[str, bool]:
    """feed_forward_proj, as T5Config reads it: "<act>" or "gated-<act>", "gated-gelu" meaning the tanh GELU."""
    proj = hf.get("feed_forward_proj") or "relu"
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise KvforgeError(f"t5 feed_forward_proj={proj!r} is not of the form '<act>' or 'gated-<act>'")
    name = "gelu_new" if proj == "gated-gelu" else parts[-1]
    if name not in _ACTIVATIONS:
        raise KvforgeError(f"t5 feed_forward_proj={proj!r}: activation {name!r} is not supported; "
                           f"supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name], len(parts) == 2


def _t5(hf):
    """T5 v1.0 (ReLU FFNs, a tied head reading the last hidden state * d_model^-0.5) and v1.1 (gated-GELU FFNs, no
    rescale; its older files untie the head and hold lm_head.weight).

    transformers 5 forces tie_word_embeddings to true (untying only a head saved with values of its own) and writes
    scale_decoder_outputs = (tie_word_embeddings was not false) next to it. kvforge rescales when
    scale_decoder_outputs says so (in older files, which lack it, when tie_word_embeddings is not false), and unties
    the head, reading lm_head.weight, when the file says tie_word_embeddings: false.

    T5's relative positions have no length limit; max_seq_len (n_positions, 512 when absent: T5's training length)
    is only the longest source and target kvforge's exports accept and validate.
    """
    _seq2seq_class(hf, "T5ForConditionalGeneration")
    _refuse(hf, "kvforge imports the encoder-decoder (a T5 stack alone, as a decoder, is not supported)", "is_decoder")
    hf = {"pad_token_id": 0, "eos_token_id": 1, **hf}  # T5Config's defaults
    activation_name, gated = _t5_feed_forward(hf)
    tied = hf.get("tie_word_embeddings", True) is not False
    rescale = hf["scale_decoder_outputs"] if hf.get("scale_decoder_outputs") is not None else tied
    dim = hf["d_model"]
    # decoder_start_token_id: T5 starts its decoder on the pad token (transformers' own advice when it is unset)
    start = first(hf, "decoder_start_token_id", "pad_token_id", default=0)
    return dict(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["num_layers"], n_heads=hf["num_heads"],
        head_dim=hf["d_kv"], ffn_dim=hf["d_ff"], n_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
        max_seq_len=int(hf.get("n_positions") or 512), position="relative",
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        norm="rmsnorm", norm_eps=hf.get("layer_norm_epsilon", 1e-6), norm_placement="pre", final_norm=True,
        attn_scale=1.0, qkv_bias=False, out_bias=False, ffn_bias=False, activation=activation_name, gated_ffn=gated,
        tie_embeddings=tied, head_scale=dim ** -0.5 if rescale else 1.0, family="t5",
        **_generation_ids(hf, start),
    )


def _bart(hf):
    """BART (BartForConditionalGeneration): post-norm LayerNorm layers (eps fixed at nn.LayerNorm's 1e-5) with
    biases, learned positions offset by 2, embeddings * sqrt(d_model) with scale_embedding and LayerNorm-ed in
    both stacks, attention scaled by 1/sqrt(d_model / heads) in each stack, a head tied to the shared embeddings
    (unless tie_word_embeddings is false) plus final_logits_bias."""
    _seq2seq_class(hf, "BartForConditionalGeneration")
    _refuse(hf, "mBART-style pre-norm layers and final norms are not BART's (transformers' BART ignores them)",
            "normalize_before", "add_final_layer_norm")
    _refuse(hf, "kvforge imports the encoder-decoder (BART's decoder alone, as a causal LM, is not supported)",
            "is_decoder")
    hf = {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 2, "forced_eos_token_id": 2,
          **hf}  # BartConfig's defaults
    dim = hf["d_model"]
    heads = {}
    for side in ("encoder", "decoder"):
        heads[side] = hf[f"{side}_attention_heads"]
        if dim % heads[side]:
            raise KvforgeError(f"bart d_model={dim} is not divisible by {side}_attention_heads={heads[side]}")
    return dict(
        vocab_size=hf["vocab_size"], dim=dim, n_layers=hf["encoder_layers"], n_heads=heads["encoder"],
        head_dim=dim // heads["encoder"], ffn_dim=hf["encoder_ffn_dim"], n_decoder_layers=hf["decoder_layers"],
        decoder_heads=heads["decoder"], decoder_head_dim=dim // heads["decoder"], decoder_ffn_dim=hf["decoder_ffn_dim"],
        max_seq_len=hf.get("max_position_embeddings") or 1024, position="learned", position_offset=2,
        norm="layernorm", norm_eps=1e-5, norm_placement="post", final_norm=False, embed_norm=True,
        embed_scale=math.sqrt(dim) if hf.get("scale_embedding") else 1.0, attn_scale=None,
        qkv_bias=True, out_bias=True, ffn_bias=True, activation=activation(hf, "activation_function", "gelu"),
        gated_ffn=False, tie_embeddings=hf.get("tie_word_embeddings", True) is not False, lm_head_bias=True,
        family="bart",
        **_generation_ids(hf, first(hf, "decoder_start_token_id", "bos_token_id")),  # generate's fallback: bos
    )


# --- weight tables --------------------------------------------------------------
def _linear(ours: str, theirs: str, transform: Transform | None = None) -> Table:
    return {f"{ours}.weight": (f"{theirs}.weight", transform), f"{ours}.bias": (f"{theirs}.bias", transform)}


def _norm(ours: str, theirs: str, transform: Transform | None = None) -> Table:
    return _linear(ours, theirs, transform)


def llama_weights(norms: dict[str, str] | None = None, norm_transform: Transform | None = None) -> Table:
    """model.layers.{i}.self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj; `norms` maps kvforge's block norms to
    the family's names (default: Llama's input_layernorm / post_attention_layernorm)."""
    norms = norms or {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    table: Table = {
        "embed.weight": ("model.embed_tokens.weight", None),
        "norm.weight": ("model.norm.weight", norm_transform),
        "lm_head.weight": ("lm_head.weight", None),
    }
    for ours, theirs in norms.items():
        table[f"layers.{{i}}.{ours}.weight"] = (f"model.layers.{{i}}.{theirs}.weight", norm_transform)
    for p in ("q", "k", "v", "o"):
        table.update(_linear(f"layers.{{i}}.attn.{p}_proj", f"model.layers.{{i}}.self_attn.{p}_proj"))
    for p in ("gate", "up", "down"):
        table.update(_linear(f"layers.{{i}}.ffn.{p}_proj", f"model.layers.{{i}}.mlp.{p}_proj"))
    return table


def moe_weights(layer: str, experts: str, names: tuple[str, str, str], router: str, shared: str | None = None,
                shared_gate: str | None = None) -> Table:
    """A MoE FFN's table: the router, each expert's gate/up/down (`names`, under {layer}.{experts}.{j}), the shared
    expert and its gate."""
    table: Table = {"layers.{i}.ffn.router.weight": (f"{layer}.{router}.weight", None)}
    for ours, theirs in zip(("gate_proj", "up_proj", "down_proj"), names):
        table[f"layers.{{i}}.ffn.experts.experts.{{j}}.{ours}.weight"] = (f"{layer}.{experts}.{{j}}.{theirs}.weight", None)
    if shared:
        for p in ("gate", "up", "down"):
            table.update(_linear(f"layers.{{i}}.ffn.shared.{p}_proj", f"{layer}.{shared}.{p}_proj"))
    if shared_gate:
        table["layers.{i}.ffn.shared_gate.weight"] = (f"{layer}.{shared_gate}.weight", None)
    return table


def _mixtral_weights(hf, cfg) -> Table:
    return {**llama_weights(), **moe_weights("model.layers.{i}.block_sparse_moe", "experts", ("w1", "w3", "w2"), "gate")}


def _qwen_moe_weights(shared: bool) -> Callable[[dict[str, Any], Any], Table]:
    def table(hf, cfg) -> Table:
        out = {**llama_weights(), **moe_weights("model.layers.{i}.mlp", "experts", ("gate_proj", "up_proj", "down_proj"),
                                                "gate", "shared_expert" if shared else None,
                                                "shared_expert_gate" if shared else None)}
        if not shared:  # Qwen3-MoE: per-head q/k norms
            out.update(_qk_norms("weight", repeat_heads(query_heads), repeat_heads(kv_heads)))
        return out
    return table


def _olmoe_weights(hf, cfg) -> Table:
    return {**llama_weights(), **_qk_norms("weight", None, None),
            **moe_weights("model.layers.{i}.mlp", "experts", ("gate_proj", "up_proj", "down_proj"), "gate")}


def mla_half_split(which: str) -> Transform:
    """DeepSeek rotates interleaved pairs of the RoPE dims (V2 always, V3 with rope_interleave): reorder them to
    kvforge's halves, in each head's query rows (`q`: [nope | rope] per head) or the shared key's (`kv_a`: the
    last qk_rope_head_dim rows of kv_a_proj_with_mqa, after the latent's)."""

    def f(t, cfg):
        dr, dn = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
        perm = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])
        if which == "kv_a":
            r = cfg.kv_lora_rank
            return torch.cat([t[:r], t[r:][perm]])
        x = t.reshape(cfg.n_heads, dn + dr, *t.shape[1:])
        return torch.cat([x[:, :dn], x[:, dn:][:, perm]], dim=1).reshape(t.shape)
    return f


def _deepseek_weights(hf, cfg) -> Table:
    interleaved = hf.get("model_type") == "deepseek_v2" or hf.get("rope_interleave", True)
    q_rows = mla_half_split("q") if interleaved else None
    attn = "model.layers.{i}.self_attn"
    table = {k: v for k, v in llama_weights().items() if ".attn." not in k}
    table.update(_linear("layers.{i}.attn.q_proj", f"{attn}.q_proj", q_rows))
    table.update(_linear("layers.{i}.attn.q_a_proj", f"{attn}.q_a_proj"))
    table["layers.{i}.attn.q_a_norm.weight"] = (f"{attn}.q_a_layernorm.weight", None)
    table.update(_linear("layers.{i}.attn.q_b_proj", f"{attn}.q_b_proj", q_rows))
    table.update(_linear("layers.{i}.attn.kv_a_proj", f"{attn}.kv_a_proj_with_mqa",
                         mla_half_split("kv_a") if interleaved else None))
    table["layers.{i}.attn.kv_a_norm.weight"] = (f"{attn}.kv_a_layernorm.weight", None)
    table.update(_linear("layers.{i}.attn.kv_b_proj", f"{attn}.kv_b_proj"))
    table.update(_linear("layers.{i}.attn.o_proj", f"{attn}.o_proj"))
    table.update(moe_weights("model.layers.{i}.mlp", "experts", ("gate_proj", "up_proj", "down_proj"), "gate",
                             "shared_experts"))
    table["layers.{i}.ffn.router.bias"] = ("model.layers.{i}.mlp.gate.e_score_correction_bias", None)
    return table


def _qk_norms(theirs: str, q: Transform | None, k: Transform | None) -> Table:
    return {
        "layers.{i}.attn.q_norm.weight": (f"model.layers.{{i}}.self_attn.q_norm.{theirs}", q),
        "layers.{i}.attn.k_norm.weight": (f"model.layers.{{i}}.self_attn.k_norm.{theirs}", k),
    }


_SANDWICH = {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "ffn_out_norm": "post_feedforward_layernorm"}


def _qwen3_weights(hf, cfg) -> Table:
    return {**llama_weights(), **_qk_norms("weight", repeat_heads(query_heads), repeat_heads(kv_heads))}


def _olmo2_weights(hf, cfg) -> Table:
    return {**llama_weights({"attn_out_norm": "post_attention_layernorm", "ffn_out_norm": "post_feedforward_layernorm"}),
            **_qk_norms("weight", None, None)}


def _gemma_weights(hf, cfg) -> Table:
    return llama_weights(norm_transform=plus_one)


def _gemma2_weights(hf, cfg) -> Table:
    return llama_weights(_SANDWICH, norm_transform=plus_one)


def _gemma3_weights(hf, cfg) -> Table:
    return {**llama_weights(_SANDWICH, norm_transform=plus_one),
            **_qk_norms("weight", chain(plus_one, repeat_heads(query_heads)), chain(plus_one, repeat_heads(kv_heads)))}


def _cohere_weights(hf, cfg) -> Table:
    table = llama_weights({"attn_norm": "input_layernorm"})
    for p, heads in (("q", query_heads), ("k", kv_heads)):
        table.update(_linear(f"layers.{{i}}.attn.{p}_proj", f"model.layers.{{i}}.self_attn.{p}_proj", half_split(heads)))
    # per-head LayerNorm weights (heads, head_dim), permuted like the features they scale
    table.update(_qk_norms("weight", chain(flatten, half_split(query_heads)), chain(flatten, half_split(kv_heads))))
    return table


def _phi3_weights(hf, cfg) -> Table:
    table = llama_weights()
    qkv = lambda c: [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]  # noqa: E731
    for j, p in enumerate("qkv"):
        table[f"layers.{{i}}.attn.{p}_proj.weight"] = ("model.layers.{i}.self_attn.qkv_proj.weight", rows(qkv, j))
    gate_up = lambda c: [c.ffn_dim, c.ffn_dim]  # noqa: E731
    for j, p in enumerate(("gate", "up")):
        table[f"layers.{{i}}.ffn.{p}_proj.weight"] = ("model.layers.{i}.mlp.gate_up_proj.weight", rows(gate_up, j))
    return table


def _gpt2_weights(hf, cfg) -> Table:
    layer = "transformer.h.{i}"
    table: Table = {
        "embed.weight": ("transformer.wte.weight", None),
        "positions.weight": ("transformer.wpe.weight", None),
        **_norm("norm", "transformer.ln_f"),
        **_norm("layers.{i}.attn_norm", f"{layer}.ln_1"),
        **_norm("layers.{i}.ffn_norm", f"{layer}.ln_2"),
        "layers.{i}.attn.o_proj.weight": (f"{layer}.attn.c_proj.weight", transpose),
        "layers.{i}.attn.o_proj.bias": (f"{layer}.attn.c_proj.bias", None),
        "layers.{i}.ffn.up_proj.weight": (f"{layer}.mlp.c_fc.weight", transpose),
        "layers.{i}.ffn.up_proj.bias": (f"{layer}.mlp.c_fc.bias", None),
        "layers.{i}.ffn.down_proj.weight": (f"{layer}.mlp.c_proj.weight", transpose),
        "layers.{i}.ffn.down_proj.bias": (f"{layer}.mlp.c_proj.bias", None),
        "lm_head.weight": ("lm_head.weight", None),  # only when tie_word_embeddings is false
    }
    for j, p in enumerate("qkv"):
        table.update(_linear(f"layers.{{i}}.attn.{p}_proj", f"{layer}.attn.c_attn", gpt2_qkv(j)))
    return table


def _mlp(prefix: str, up: str, down: str) -> Table:
    return {**_linear("layers.{i}.ffn.up_proj", f"{prefix}.{up}"), **_linear("layers.{i}.ffn.down_proj", f"{prefix}.{down}")}


def _fused_qkv(fused: str, split_of: Callable[[int], Any]) -> Table:
    """q/k/v projections cut from one fused linear; ``split_of(j)`` cuts out the j-th of q, k, v."""
    table: Table = {}
    for j, p in enumerate("qkv"):
        table.update(_linear(f"layers.{{i}}.attn.{p}_proj", fused, split_of(j)))
    return table


def _gpt_neox_weights(hf, cfg) -> Table:
    layer = "gpt_neox.layers.{i}"
    table: Table = {
        "embed.weight": ("gpt_neox.embed_in.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
        **_norm("norm", "gpt_neox.final_layer_norm"),
        **_norm("layers.{i}.attn_norm", f"{layer}.input_layernorm"),
        **_norm("layers.{i}.ffn_norm", f"{layer}.post_attention_layernorm"),
        **_linear("layers.{i}.attn.o_proj", f"{layer}.attention.dense"),
        **_mlp(f"{layer}.mlp", "dense_h_to_4h", "dense_4h_to_h"),
        **_fused_qkv(f"{layer}.attention.query_key_value", lambda j: per_head(3, j)),
    }
    return table


def _gptj_weights(hf, cfg) -> Table:
    layer = "transformer.h.{i}"
    table: Table = {
        "embed.weight": ("transformer.wte.weight", None),
        **_linear("lm_head", "lm_head"),
        **_norm("norm", "transformer.ln_f"),
        **_norm("layers.{i}.attn_norm", f"{layer}.ln_1"),
        "layers.{i}.attn.v_proj.weight": (f"{layer}.attn.v_proj.weight", None),
        "layers.{i}.attn.o_proj.weight": (f"{layer}.attn.out_proj.weight", None),
        "layers.{i}.attn.q_proj.weight": (f"{layer}.attn.q_proj.weight", half_split(query_heads)),
        "layers.{i}.attn.k_proj.weight": (f"{layer}.attn.k_proj.weight", half_split(kv_heads)),
        **_mlp(f"{layer}.mlp", "fc_in", "fc_out"),
    }
    return table


def _falcon_weights(hf, cfg) -> Table:
    layer = "transformer.h.{i}"
    two = _falcon_norms(hf) == 2
    table: Table = {
        "embed.weight": ("transformer.word_embeddings.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
        **_norm("norm", "transformer.ln_f"),
        **_norm("layers.{i}.attn_norm", f"{layer}.{'ln_attn' if two else 'input_layernorm'}"),
        **_norm("layers.{i}.ffn_norm", f"{layer}.{'ln_mlp' if two else 'post_attention_layernorm'}"),
        **_linear("layers.{i}.attn.o_proj", f"{layer}.self_attention.dense"),
        **_mlp(f"{layer}.mlp", "dense_h_to_4h", "dense_4h_to_h"),
    }
    layout = _falcon_layout(hf)
    mqa = lambda c: [c.n_heads * c.head_dim, c.head_dim, c.head_dim]  # noqa: E731
    split_of = {"grouped": falcon_grouped, "multi_query": lambda j: rows(mqa, j), "per_head": lambda j: per_head(3, j)}
    table.update(_fused_qkv(f"{layer}.self_attention.query_key_value", split_of[layout]))
    return table


def _bloom_weights(hf, cfg) -> Table:
    layer = "transformer.h.{i}"
    table: Table = {
        "embed.weight": ("transformer.word_embeddings.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
        **_norm("embed_norm", "transformer.word_embeddings_layernorm"),
        **_norm("norm", "transformer.ln_f"),
        **_norm("layers.{i}.attn_norm", f"{layer}.input_layernorm"),
        **_norm("layers.{i}.ffn_norm", f"{layer}.post_attention_layernorm"),
        **_linear("layers.{i}.attn.o_proj", f"{layer}.self_attention.dense"),
        **_mlp(f"{layer}.mlp", "dense_h_to_4h", "dense_4h_to_h"),
        **_fused_qkv(f"{layer}.self_attention.query_key_value", lambda j: per_head(3, j)),
    }
    return table


def _bert_body(model: str) -> Table:
    """{model}.embeddings and {model}.encoder.layer.{i}: BERT's names, which RoBERTa keeps."""
    layer = f"{model}.encoder.layer.{{i}}"
    table: Table = {
        "embed.tokens.weight": (f"{model}.embeddings.word_embeddings.weight", None),
        "embed.positions.weight": (f"{model}.embeddings.position_embeddings.weight", None),
        "embed.token_types.weight": (f"{model}.embeddings.token_type_embeddings.weight", None),
        **_norm("embed.norm", f"{model}.embeddings.LayerNorm"),
        **_linear("layers.{i}.attn.o_proj", f"{layer}.attention.output.dense"),
        **_norm("layers.{i}.attn_norm", f"{layer}.attention.output.LayerNorm"),  # post-norm: after the residual add
        **_mlp(layer, "intermediate.dense", "output.dense"),
        **_norm("layers.{i}.ffn_norm", f"{layer}.output.LayerNorm"),
    }
    for p, theirs in (("q", "query"), ("k", "key"), ("v", "value")):
        table.update(_linear(f"layers.{{i}}.attn.{p}_proj", f"{layer}.attention.self.{theirs}"))
    return table


def _mlm_head(prefix: str, dense: str, norm: str) -> Table:
    """The masked-LM head; its decoder's bias is saved as `{prefix}.bias` (tied to `{prefix}.decoder.bias`, which
    untied checkpoints write too: Family.duplicates)."""
    return {
        **_linear("head.dense", f"{prefix}.{dense}"),
        **_norm("head.norm", f"{prefix}.{norm}"),
        "head.decoder.weight": (f"{prefix}.decoder.weight", None),  # only when tie_word_embeddings is false
        "head.decoder.bias": (f"{prefix}.bias", None),
    }


def _bert_weights(hf, cfg) -> Table:
    table = _bert_body("bert")
    if cfg.head == "mlm":
        table.update(_mlm_head("cls.predictions", "transform.dense", "transform.LayerNorm"))
    else:  # the pooler, and the classifier over it
        table.update({**_linear("head.dense", "bert.pooler.dense"), **_linear("head.out", "classifier")})
    return table


def _roberta_weights(hf, cfg) -> Table:
    table = _bert_body("roberta")
    if cfg.head == "mlm":
        table.update(_mlm_head("lm_head", "dense", "layer_norm"))
    elif cfg.head == "classification":  # RobertaClassificationHead: out_proj(tanh(dense(first token)))
        table.update({**_linear("head.dense", "classifier.dense"), **_linear("head.out", "classifier.out_proj")})
    else:
        table.update(_linear("head.dense", "roberta.pooler.dense"))
    return table


def _t5_weights(hf, cfg) -> Table:
    """encoder.block.{i}.layer.{0: self-attention, 1: FFN}, decoder.block.{i}.layer.{0: self-attention,
    1: cross-attention, 2: FFN}; the relative position tables sit in each stack's block 0."""
    ffn = {"gate_proj": "wi_0", "up_proj": "wi_1", "down_proj": "wo"} if cfg.gated_ffn else {"up_proj": "wi", "down_proj": "wo"}
    table: Table = {
        "shared.weight": ("shared.weight", None),
        "lm_head.weight": ("lm_head.weight", None),  # only when tie_word_embeddings is false
        "encoder_norm.weight": ("encoder.final_layer_norm.weight", None),
        "decoder_norm.weight": ("decoder.final_layer_norm.weight", None),
    }
    for side, n, sublayers in (("encoder", cfg.n_layers, ("attn", "ffn")),
                               ("decoder", cfg.n_decoder_layers, ("attn", "cross", "ffn"))):
        table[f"{side}_bias.bias.weight"] = (f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", None)
        for i in range(n):
            for j, ours in enumerate(sublayers):
                theirs = f"{side}.block.{i}.layer.{j}"
                table[f"{side}_layers.{i}.{ours}_norm.weight"] = (f"{theirs}.layer_norm.weight", None)
                if ours == "ffn":
                    for p, wi in ffn.items():
                        table[f"{side}_layers.{i}.ffn.{p}.weight"] = (f"{theirs}.DenseReluDense.{wi}.weight", None)
                    continue
                module = "SelfAttention" if ours == "attn" else "EncDecAttention"
                for p in "qkvo":
                    table[f"{side}_layers.{i}.{ours}.{p}_proj.weight"] = (f"{theirs}.{module}.{p}.weight", None)
    return table


def _bart_weights(hf, cfg) -> Table:
    """model.{encoder,decoder}.layers.{i}: self_attn (+ encoder_attn), fc1/fc2 and the norm after each, post-norm."""
    table: Table = {
        "shared.weight": ("model.shared.weight", None),
        "lm_head.weight": ("lm_head.weight", None),  # only when tie_word_embeddings is false
        "lm_head.bias": ("final_logits_bias", flatten),  # a (1, vocab) buffer
    }
    for side, n in (("encoder", cfg.n_layers), ("decoder", cfg.n_decoder_layers)):
        stack = f"model.{side}"
        table[f"{side}_embed.positions.weight"] = (f"{stack}.embed_positions.weight", None)
        table.update(_norm(f"{side}_embed.norm", f"{stack}.layernorm_embedding"))
        attention = {"attn": "self_attn", "cross": "encoder_attn"} if side == "decoder" else {"attn": "self_attn"}
        for i in range(n):
            ours, theirs = f"{side}_layers.{i}", f"{stack}.layers.{i}"
            for a, b in attention.items():
                for p, q in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out")):
                    table.update(_linear(f"{ours}.{a}.{p}_proj", f"{theirs}.{b}.{q}_proj"))
                table.update(_norm(f"{ours}.{a}_norm", f"{theirs}.{b}_layer_norm"))
            table.update({**_linear(f"{ours}.ffn.up_proj", f"{theirs}.fc1"), **_linear(f"{ours}.ffn.down_proj", f"{theirs}.fc2"),
                          **_norm(f"{ours}.ffn_norm", f"{theirs}.final_layer_norm")})
    return table


# --- the families -----------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    config: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> the fields of `architecture`'s config
    weights: Callable[[dict[str, Any], Any], Table]  # (config.json, kvforge config) -> weight table
    # checkpoint names some files use instead of the table's: an optional prefix to add (files saved from the
    # base model, without the wrapper's), except to the names of the heads, which sit outside the base model
    # (`head_prefixes`); and whole-name aliases (older releases)
    add_prefix: str | None = None
    head_prefixes: tuple[str, ...] = ("lm_head.",)
    aliases: dict[str, str] = field(default_factory=dict)
    architecture: str = "decoder"  # which model the config builds (model_defs.architectures)
    embedding: str = "embed.weight"  # the kvforge parameter a tied head shares
    # pairs of checkpoint names for one tied tensor: either may stand for the other, and a file holding both is
    # accepted only when they are equal
    duplicates: tuple[tuple[str, str], ...] = ()
    # checkpoint name prefixes of parts the config's model does not have, which released files carry and
    # transformers skips when it loads them (bert-base-uncased, a BertForMaskedLM, still holds the pooler and
    # the next-sentence head of its pretraining): (kvforge config) -> prefixes left unread
    leftovers: Callable[[Any], tuple[str, ...]] = lambda cfg: ()


def _static(table: Table) -> Callable[[dict[str, Any], Any], Table]:
    return lambda hf, cfg: table


FAMILIES: dict[str, Family] = {
    "llama": Family(_llama, _static(llama_weights())),
    "mistral": Family(_mistral, _static(llama_weights())),
    "qwen2": Family(_qwen2, _static(llama_weights())),
    "qwen3": Family(_qwen3, _qwen3_weights),
    "olmo2": Family(_olmo2, _olmo2_weights),
    "granite": Family(_granite, _static(llama_weights())),
    "cohere": Family(_cohere, _cohere_weights),
    "phi3": Family(_phi3, _phi3_weights),
    "gemma": Family(_gemma, _gemma_weights),
    "gemma2": Family(_gemma2, _gemma2_weights),
    "gemma3_text": Family(_gemma3_text, _gemma3_weights),
    "gpt2": Family(_gpt2, _gpt2_weights, add_prefix="transformer."),
    "gpt_neox": Family(_gpt_neox, _gpt_neox_weights, aliases={"embed_out.weight": "lm_head.weight"}),
    "gptj": Family(_gptj, _gptj_weights),
    "falcon": Family(_falcon, _falcon_weights),
    "bloom": Family(_bloom, _bloom_weights, add_prefix="transformer."),
    "mixtral": Family(_mixtral, _mixtral_weights),
    "qwen2_moe": Family(_qwen2_moe, _qwen_moe_weights(shared=True)),
    "qwen3_moe": Family(_qwen3_moe, _qwen_moe_weights(shared=False)),
    "olmoe": Family(_olmoe, _olmoe_weights),
    "deepseek_v2": Family(_deepseek_v2, _deepseek_weights),
    # released V3 files also hold the multi-token-prediction layer(s) after the last one, which transformers skips
    "deepseek_v3": Family(_deepseek_v3, _deepseek_weights, leftovers=lambda cfg: (f"model.layers.{cfg.n_layers}.",)),
    "bert": Family(_bert, _bert_weights, add_prefix="bert.", head_prefixes=("cls.", "classifier."),
                   architecture="encoder", embedding="embed.tokens.weight",
                   duplicates=(("cls.predictions.decoder.bias", "cls.predictions.bias"),),
                   leftovers=lambda cfg: ("bert.pooler.", "cls.seq_relationship.") if cfg.head == "mlm" else ()),
    "roberta": Family(_roberta, _roberta_weights, add_prefix="roberta.", head_prefixes=("lm_head.", "classifier."),
                      architecture="encoder", embedding="embed.tokens.weight",
                      duplicates=(("lm_head.decoder.bias", "lm_head.bias"),),
                      leftovers=lambda cfg: ("roberta.pooler.",) if cfg.head == "mlm" else ()),
    # Both stacks read the shared embeddings, which files may also hold under each stack's name.
    "t5": Family(_t5, _t5_weights, architecture="encoder-decoder", embedding="shared.weight",
                 duplicates=(("encoder.embed_tokens.weight", "shared.weight"), ("decoder.embed_tokens.weight", "shared.weight")),
                 # older T5 files hold a position table for block 0's cross-attention, which transformers skips
                 leftovers=lambda cfg: ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.",)),
    "bart": Family(_bart, _bart_weights, architecture="encoder-decoder", embedding="shared.weight",
                   duplicates=(("model.encoder.embed_tokens.weight", "model.shared.weight"),
                               ("model.decoder.embed_tokens.weight", "model.shared.weight"))),
}
