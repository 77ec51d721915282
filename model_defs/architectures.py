"""The model shapes kvforge builds, one entry each: its config class, its builder and its presets.

    decoder     ModelConfig     model.Transformer       causal LM with a KV cache (config.PRESETS)
    encoder     EncoderConfig   encoder.Encoder         bidirectional, padding mask only (BERT, RoBERTa)
    perceiver   PerceiverConfig perceiver.Perceiver     learned latents cross-attending to the input
    encoder-decoder Seq2SeqConfig seq2seq.Seq2SeqLM     an encoder and a decoder reading it (T5, BART)

A config's `architecture` field names its entry (absent in decoder configs, which predate it).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from kvforge.errors import KvforgeError
from kvforge.kinds import check_registry, kind_of

from .config import PRESETS, ModelConfig
from .encoder import EncoderConfig, build_encoder
from .model import build_model
from .perceiver import PerceiverConfig, build_perceiver
from .seq2seq import Seq2SeqConfig, build_seq2seq
from .vision import VisionLanguageConfig, build_vision_language


class Architecture(NamedTuple):
    config: type
    build: Callable[[Any], Any]
    presets: dict[str, dict[str, Any]]
    design: Callable[[Any], str]  # one line naming a config's design choices, for `kvforge models`


# Random-weight presets of the other shapes (micro sizes for tests and examples), with the built-in byte-level
# tokenizer's special ids: <s> 256, </s> 257, <pad> 258.
ENCODER_PRESETS: dict[str, dict[str, Any]] = {
    # BERT: post-norm, learned absolute positions, two segment types, a masked-LM head tied to the embeddings.
    "bert-micro": dict(vocab_size=259, dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=256, head="mlm",
                       family="bert", pad_token_id=258),
    # RoBERTa-shaped classifier: positions counted after the pad token, one segment type, a tanh-pooled classifier.
    "roberta-micro": dict(vocab_size=259, dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=515,
                          position="padded", type_vocab_size=1, norm_eps=1e-5, head="classification", num_labels=3,
                          family="roberta", pad_token_id=258, bos_token_id=256, eos_token_id=257),
}
PERCEIVER_PRESETS: dict[str, dict[str, Any]] = {
    # 16 latents over inputs of up to 512 tokens, two latent blocks, a 4-class head on the mean latent.
    "perceiver-micro": dict(vocab_size=259, dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=512,
                            n_latents=16, head="classification", num_labels=4, activation="gelu", pad_token_id=258),
}

SEQ2SEQ_PRESETS: dict[str, dict[str, Any]] = {
    # T5 v1.1-shaped: relative position buckets, gated-GELU FFNs, RMSNorm pre-norm, an untied head.
    "t5-micro": dict(vocab_size=259, dim=64, n_layers=2, n_decoder_layers=3, n_heads=4, head_dim=24, ffn_dim=128,
                     max_seq_len=256, relative_buckets=16, relative_max_distance=64, activation="gelu_tanh",
                     gated_ffn=True, tie_embeddings=False, family="t5", pad_token_id=258, eos_token_id=257,
                     decoder_start_token_id=258),
    # BART-shaped: learned positions offset by 2, post-norm LayerNorm with biases, scaled and normed embeddings.
    # The decoder has its own head count and width (BART's heads are d_model / heads wide in each stack).
    "bart-micro": dict(vocab_size=259, dim=64, n_layers=2, n_heads=4, decoder_heads=2, decoder_head_dim=32, ffn_dim=128,
                       decoder_ffn_dim=96, max_seq_len=256,
                       position="learned", position_offset=2, norm="layernorm", norm_eps=1e-5, norm_placement="post",
                       final_norm=False, embed_norm=True, embed_scale=8.0, attn_scale=None, qkv_bias=True,
                       out_bias=True, ffn_bias=True, activation="gelu", lm_head_bias=True, family="bart",
                       pad_token_id=258, bos_token_id=256, eos_token_id=257, decoder_start_token_id=257,
                       forced_eos_token_id=257),
}

VISION_LANGUAGE_PRESETS: dict[str, dict[str, Any]] = {
    # LLaVA-shaped: a CLIP image encoder (30 x 30 images in 10 x 10 patches, a class token, the second-to-last
    # layer's patches), LLaVA's MLP projector, a Llama decoder whose vocabulary is the byte-level tokenizer's
    # plus the image token (259).
    "llava-micro": dict(
        vision=dict(image_size=30, patch_size=10, dim=32, n_layers=3, n_heads=4, ffn_dim=64, feature_layer=-2),
        decoder=dict(vocab_size=260, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256,
                     bos_token_id=256, eos_token_id=257, family="llama"),
        image_token_id=259),
}


def architecture_of(config: Any) -> str:
    """The architecture of a config object or dict ("decoder" when it does not say)."""
    return kind_of(config).name


def config_from_dict(data: dict[str, Any]):
    return ARCHITECTURES[architecture_of(data)].config.from_dict(data)


def build(cfg):
    """The Torch model of any config, weights as constructed."""
    return ARCHITECTURES[architecture_of(cfg)].build(cfg)


def all_presets() -> dict[str, str]:
    """Every preset name -> its architecture."""
    return {name: arch for arch, a in ARCHITECTURES.items() for name in a.presets}


def preset_config(name: str):
    arch = all_presets().get(name)
    if arch is None:
        raise KvforgeError(f"unknown preset {name!r}; presets: {sorted(all_presets())}")
    return ARCHITECTURES[arch].config(**ARCHITECTURES[arch].presets[name])


def tied_parameters(model) -> list[str]:
    """Parameters that share another's tensor: absent from checkpoints (the head tied to the embeddings)."""
    cfg = model.config
    if not getattr(cfg, "tie_embeddings", False):
        return []
    head = kind_of(cfg).tied_head
    if head:
        return [head]
    return ["head.decoder.weight"] if getattr(cfg, "head", None) == "mlm" else []


def describe_design(cfg) -> str:
    """One line naming a config's design choices, for `kvforge models` (a Llama-style decoder's defaults left out)."""
    return ARCHITECTURES[architecture_of(cfg)].design(cfg)


def _decoder_design(cfg) -> str:
    """One line naming a config's design choices (the defaults of a Llama-style decoder are left out)."""
    parts = [cfg.position + (f" x{cfg.rotary_fraction:g}" if cfg.position == "rope" and cfg.rotary_fraction < 1 else ""),
             f"{cfg.norm}-{cfg.norm_placement}", f"{'gated-' if cfg.gated_ffn else ''}{cfg.activation}"]
    if cfg.block != "sequential":
        parts.append(f"block={cfg.block}")
    if cfg.kv_lora_rank:
        parts.append(f"mla latent={cfg.kv_lora_rank}+{cfg.qk_rope_head_dim}")
    if cfg.qk_norm:
        parts.append(f"qk-norm={cfg.qk_norm}")
    if cfg.sliding_window:
        layers = "" if cfg.sliding_window_layers is None else f" on {cfg.sliding_window_layers}"
        parts.append(f"window={cfg.sliding_window}{layers}")
    if cfg.n_experts:
        shared = f"+shared {cfg.shared_expert_ffn_dim}" if cfg.shared_expert_ffn_dim else ""
        groups = f" in {cfg.router_topk_groups}/{cfg.router_groups} groups" if cfg.router_groups > 1 else ""
        parts.append(f"moe={cfg.experts_per_token}/{cfg.n_experts}{groups}{shared}")
    if cfg.attn_softcap or cfg.final_softcap:
        parts.append(f"softcap={cfg.attn_softcap}/{cfg.final_softcap}")
    if any(v != 1.0 for v in (cfg.embed_scale, cfg.residual_scale, cfg.logit_scale)) or cfg.attn_scale is not None:
        parts.append("scaled")
    return " ".join(parts)


def _encoder_design(cfg) -> str:
    head = f"head={cfg.head}" if hasattr(cfg, "head") else f"{cfg.n_layers}+{cfg.n_decoder_layers} layers"
    parts = [f"{cfg.position} positions", f"{cfg.norm}-{cfg.norm_placement}",
             f"{'gated-' if cfg.gated_ffn else ''}{cfg.activation}", head]
    if getattr(cfg, "n_latents", None):
        parts.insert(0, f"{cfg.n_latents} latents")
    return " ".join(parts)


def _vision_language_design(cfg) -> str:
    v = cfg.vision_config
    return (f"vit {v.image_size}px/{v.patch_size} {v.layers_used} layers -> {cfg.image_tokens} image tokens, "
            f"{cfg.projector} projector; decoder: {_decoder_design(cfg.decoder_config)}")


ARCHITECTURES: dict[str, Architecture] = {
    "decoder": Architecture(ModelConfig, build_model, PRESETS, _decoder_design),
    "encoder": Architecture(EncoderConfig, build_encoder, ENCODER_PRESETS, _encoder_design),
    "perceiver": Architecture(PerceiverConfig, build_perceiver, PERCEIVER_PRESETS, _encoder_design),
    "encoder-decoder": Architecture(Seq2SeqConfig, build_seq2seq, SEQ2SEQ_PRESETS, _encoder_design),
    "vision-language": Architecture(VisionLanguageConfig, build_vision_language, VISION_LANGUAGE_PRESETS,
                                    _vision_language_design),
}
check_registry("model_defs", ARCHITECTURES)
