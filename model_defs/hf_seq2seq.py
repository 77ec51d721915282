"""The encoder-decoder families, T5 and BART (Seq2SeqConfig fields): their config mappers and weight tables."""

from __future__ import annotations

import math
from typing import Any

from kvforge.errors import KvforgeError

from .hf_common import (
    ACTIVATIONS,
    Table,
    activation,
    first,
    flatten,
    linear_weights,
    norm_weights,
    refuse,
    special_ids,
)


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
    if name not in ACTIVATIONS:
        raise KvforgeError(f"t5 feed_forward_proj={proj!r}: activation {name!r} is not supported; "
                           f"supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name], len(parts) == 2


def t5(hf):
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
    refuse(hf, "kvforge imports the encoder-decoder (a T5 stack alone, as a decoder, is not supported)", "is_decoder")
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


def bart(hf):
    """BART (BartForConditionalGeneration): post-norm LayerNorm layers (eps fixed at nn.LayerNorm's 1e-5) with
    biases, learned positions offset by 2, embeddings * sqrt(d_model) with scale_embedding and LayerNorm-ed in
    both stacks, attention scaled by 1/sqrt(d_model / heads) in each stack, a head tied to the shared embeddings
    (unless tie_word_embeddings is false) plus final_logits_bias."""
    _seq2seq_class(hf, "BartForConditionalGeneration")
    refuse(hf, "mBART-style pre-norm layers and final norms are not BART's (transformers' BART ignores them)",
            "normalize_before", "add_final_layer_norm")
    refuse(hf, "kvforge imports the encoder-decoder (BART's decoder alone, as a causal LM, is not supported)",
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
def t5_weights(hf, cfg) -> Table:
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


def bart_weights(hf, cfg) -> Table:
    """model.{encoder,decoder}.layers.{i}: self_attn (+ encoder_attn), fc1/fc2 and the norm after each, post-norm."""
    table: Table = {
        "shared.weight": ("model.shared.weight", None),
        "lm_head.weight": ("lm_head.weight", None),  # only when tie_word_embeddings is false
        "lm_head.bias": ("final_logits_bias", flatten),  # a (1, vocab) buffer
    }
    for side, n in (("encoder", cfg.n_layers), ("decoder", cfg.n_decoder_layers)):
        stack = f"model.{side}"
        table[f"{side}_embed.positions.weight"] = (f"{stack}.embed_positions.weight", None)
        table.update(norm_weights(f"{side}_embed.norm", f"{stack}.layernorm_embedding"))
        attention = {"attn": "self_attn", "cross": "encoder_attn"} if side == "decoder" else {"attn": "self_attn"}
        for i in range(n):
            ours, theirs = f"{side}_layers.{i}", f"{stack}.layers.{i}"
            for a, b in attention.items():
                for p, q in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out")):
                    table.update(linear_weights(f"{ours}.{a}.{p}_proj", f"{theirs}.{b}.{q}_proj"))
                table.update(norm_weights(f"{ours}.{a}_norm", f"{theirs}.{b}_layer_norm"))
            table.update({**linear_weights(f"{ours}.ffn.up_proj", f"{theirs}.fc1"),
                          **linear_weights(f"{ours}.ffn.down_proj", f"{theirs}.fc2"),
                          **norm_weights(f"{ours}.ffn_norm", f"{theirs}.final_layer_norm")})
    return table
