"""GPT-2 and the LayerNorm + plain-MLP families, parallel-block or ALiBi (GPT-NeoX, GPT-J, Falcon, BLOOM): their
config mappers and weight tables."""

from __future__ import annotations

import math
from typing import Any, Callable

from kvforge.errors import KvforgeError

from .hf_common import (
    Table,
    activation,
    falcon_grouped,
    first,
    gpt2_qkv,
    half_split,
    kv_heads,
    linear_weights,
    mlp_weights,
    norm_weights,
    per_head,
    query_heads,
    require,
    rope_fields,
    rope_parameters,
    rows,
    special_ids,
    transpose,
)


# --- GPT-2 and the parallel-block / ALiBi families ---------------------------------
def gpt2(hf):
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


def gpt_neox(hf):
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


def gptj(hf):
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


def falcon(hf):
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


def bloom(hf):
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


# --- weight tables --------------------------------------------------------------
def gpt2_weights(hf, cfg) -> Table:
    layer = "transformer.h.{i}"
    table: Table = {
        "embed.weight": ("transformer.wte.weight", None),
        "positions.weight": ("transformer.wpe.weight", None),
        **norm_weights("norm", "transformer.ln_f"),
        **norm_weights("layers.{i}.attn_norm", f"{layer}.ln_1"),
        **norm_weights("layers.{i}.ffn_norm", f"{layer}.ln_2"),
        "layers.{i}.attn.o_proj.weight": (f"{layer}.attn.c_proj.weight", transpose),
        "layers.{i}.attn.o_proj.bias": (f"{layer}.attn.c_proj.bias", None),
        "layers.{i}.ffn.up_proj.weight": (f"{layer}.mlp.c_fc.weight", transpose),
        "layers.{i}.ffn.up_proj.bias": (f"{layer}.mlp.c_fc.bias", None),
        "layers.{i}.ffn.down_proj.weight": (f"{layer}.mlp.c_proj.weight", transpose),
        "layers.{i}.ffn.down_proj.bias": (f"{layer}.mlp.c_proj.bias", None),
        "lm_head.weight": ("lm_head.weight", None),  # only when tie_word_embeddings is false
    }
    for j, p in enumerate("qkv"):
        table.update(linear_weights(f"layers.{{i}}.attn.{p}_proj", f"{layer}.attn.c_attn", gpt2_qkv(j)))
    return table

def _fused_qkv(fused: str, split_of: Callable[[int], Any]) -> Table:
    """q/k/v projections cut from one fused linear; ``split_of(j)`` cuts out the j-th of q, k, v."""
    table: Table = {}
    for j, p in enumerate("qkv"):
        table.update(linear_weights(f"layers.{{i}}.attn.{p}_proj", fused, split_of(j)))
    return table


def gpt_neox_weights(hf, cfg) -> Table:
    layer = "gpt_neox.layers.{i}"
    table: Table = {
        "embed.weight": ("gpt_neox.embed_in.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
        **norm_weights("norm", "gpt_neox.final_layer_norm"),
        **norm_weights("layers.{i}.attn_norm", f"{layer}.input_layernorm"),
        **norm_weights("layers.{i}.ffn_norm", f"{layer}.post_attention_layernorm"),
        **linear_weights("layers.{i}.attn.o_proj", f"{layer}.attention.dense"),
        **mlp_weights(f"{layer}.mlp", "dense_h_to_4h", "dense_4h_to_h"),
        **_fused_qkv(f"{layer}.attention.query_key_value", lambda j: per_head(3, j)),
    }
    return table


def gptj_weights(hf, cfg) -> Table:
    layer = "transformer.h.{i}"
    table: Table = {
        "embed.weight": ("transformer.wte.weight", None),
        **linear_weights("lm_head", "lm_head"),
        **norm_weights("norm", "transformer.ln_f"),
        **norm_weights("layers.{i}.attn_norm", f"{layer}.ln_1"),
        "layers.{i}.attn.v_proj.weight": (f"{layer}.attn.v_proj.weight", None),
        "layers.{i}.attn.o_proj.weight": (f"{layer}.attn.out_proj.weight", None),
        "layers.{i}.attn.q_proj.weight": (f"{layer}.attn.q_proj.weight", half_split(query_heads)),
        "layers.{i}.attn.k_proj.weight": (f"{layer}.attn.k_proj.weight", half_split(kv_heads)),
        **mlp_weights(f"{layer}.mlp", "fc_in", "fc_out"),
    }
    return table


def falcon_weights(hf, cfg) -> Table:
    layer = "transformer.h.{i}"
    two = _falcon_norms(hf) == 2
    table: Table = {
        "embed.weight": ("transformer.word_embeddings.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
        **norm_weights("norm", "transformer.ln_f"),
        **norm_weights("layers.{i}.attn_norm", f"{layer}.{'ln_attn' if two else 'input_layernorm'}"),
        **norm_weights("layers.{i}.ffn_norm", f"{layer}.{'ln_mlp' if two else 'post_attention_layernorm'}"),
        **linear_weights("layers.{i}.attn.o_proj", f"{layer}.self_attention.dense"),
        **mlp_weights(f"{layer}.mlp", "dense_h_to_4h", "dense_4h_to_h"),
    }
    layout = _falcon_layout(hf)
    mqa = lambda c: [c.n_heads * c.head_dim, c.head_dim, c.head_dim]  # noqa: E731
    split_of = {"grouped": falcon_grouped, "multi_query": lambda j: rows(mqa, j), "per_head": lambda j: per_head(3, j)}
    table.update(_fused_qkv(f"{layer}.self_attention.query_key_value", split_of[layout]))
    return table


def bloom_weights(hf, cfg) -> Table:
    layer = "transformer.h.{i}"
    table: Table = {
        "embed.weight": ("transformer.word_embeddings.weight", None),
        "lm_head.weight": ("lm_head.weight", None),
        **norm_weights("embed_norm", "transformer.word_embeddings_layernorm"),
        **norm_weights("norm", "transformer.ln_f"),
        **norm_weights("layers.{i}.attn_norm", f"{layer}.input_layernorm"),
        **norm_weights("layers.{i}.ffn_norm", f"{layer}.post_attention_layernorm"),
        **linear_weights("layers.{i}.attn.o_proj", f"{layer}.self_attention.dense"),
        **mlp_weights(f"{layer}.mlp", "dense_h_to_4h", "dense_4h_to_h"),
        **_fused_qkv(f"{layer}.self_attention.query_key_value", lambda j: per_head(3, j)),
    }
    return table
