"""Encoder-decoder transformers (T5 v1.0 / v1.1, BART), assembled from the decoder's components.

    hidden, cross = model.encode(input_ids, attention_mask)           once per source
    logits, present = model.decode(ids, attention_mask, past, cross)   each step; past = None on the first

    input_ids / attention_mask   int64 (B, L)    the source, right-padded (1 = real token)
    hidden                       (B, L, C)       the encoder's last hidden state
    cross                        n_decoder_layers x (key, value), each (B, H, L, D): every decoder layer's
                                 cross-attention keys and values, computed once from `hidden`
    ids                          int64 (B, T)    the target tokens of this step (decoder_start_token_id first)
    past / present               n_decoder_layers x (key, value), each (B, H, P / P + T, D): the self-attention cache
    logits                       float32 (B, T, vocab)

Every row of a batch decodes in step (one new token per row per step), so the
decoder needs no attention mask of its own: its queries see the cache indices
before them, and the source's padding is hidden by `attention_mask`.

The two families differ only in components the config selects:
- T5: pre-norm RMSNorm stacks with a final norm each, no biases, no score
  scaling (T5 folds 1/sqrt(d) into its initialization), positions as a learned
  bias per distance bucket (bidirectional in the encoder, causal in the
  decoder, one table per stack shared by its layers), ReLU (v1.0) or gated-GELU
  (v1.1) FFNs, and a head tied to the embeddings that reads the last hidden
  state times d_model^-0.5 (v1.0's rescale);
- BART: post-norm LayerNorm layers, biases, learned positions offset by 2,
  embeddings optionally scaled by sqrt(d_model) and normalized, GELU FFNs, a
  tied head plus final_logits_bias.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from torch import nn

from kvforge.errors import KvforgeError

from .config import ConfigDict
from .layers import Attention, CrossAttention, attention_mask_bool, build_ffn, build_norm
from .model import Block, PostNormBlock
from .positions import RelativePositionBias

KVPairs = tuple[tuple[torch.Tensor, torch.Tensor], ...]
SEQ2SEQ_POSITIONS = ("relative", "learned")


@dataclass
class Seq2SeqConfig(ConfigDict):
    vocab_size: int
    dim: int
    n_layers: int  # encoder layers
    n_heads: int  # encoder heads
    head_dim: int | None = None  # None -> dim // n_heads (T5's d_kv may differ)
    ffn_dim: int | None = None  # encoder FFN width; None -> 4 * dim
    n_decoder_layers: int | None = None  # None -> n_layers
    decoder_heads: int | None = None  # None -> n_heads
    decoder_head_dim: int | None = None  # None -> head_dim (BART's heads are dim // heads wide in each stack)
    decoder_ffn_dim: int | None = None  # None -> ffn_dim
    max_seq_len: int = 512  # the longest source and target: learned positions cover it

    position: str = "relative"  # "relative" (T5's buckets) or "learned" (BART, offset by position_offset)
    position_offset: int = 0
    relative_buckets: int = 32
    relative_max_distance: int = 128

    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    norm_bias: bool = True
    norm_placement: str = "pre"  # pre (T5, with a final norm per stack) or post (BART)
    final_norm: bool = True
    embed_norm: bool = False  # BART's layernorm_embedding, in both stacks
    embed_scale: float = 1.0  # BART's scale_embedding: sqrt(dim)
    attn_scale: float | None = 1.0  # T5: 1.0 (no scaling); None -> 1/sqrt(head_dim)
    qkv_bias: bool = False
    out_bias: bool = False
    ffn_bias: bool = False
    activation: str = "relu"
    gated_ffn: bool = False

    tie_embeddings: bool = True  # lm_head shares the embeddings
    head_scale: float = 1.0  # the last hidden state * head_scale before lm_head (T5 v1.0: dim ** -0.5)
    lm_head_bias: bool = False  # BART's final_logits_bias

    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 1
    decoder_start_token_id: int = 0
    forced_bos_token_id: int | None = None  # generation: the first generated token (mBART's language id)
    forced_eos_token_id: int | None = None  # generation: the token forced at the last allowed step (BART)
    dropout: float = 0.0
    family: str = "kvforge"
    architecture: str = "encoder-decoder"
    extra: dict[str, Any] = field(default_factory=dict)

    # what the shared components read
    n_kv_heads: int | None = None
    residual_scale: float = 1.0
    attn_softcap: None = None

    ARCHITECTURE: ClassVar[str] = "encoder-decoder"

    def __post_init__(self) -> None:
        if self.head_dim is None and self.dim % self.n_heads == 0:
            self.head_dim = self.dim // self.n_heads
        self.ffn_dim = 4 * self.dim if self.ffn_dim is None else self.ffn_dim
        self.n_decoder_layers = self.n_layers if self.n_decoder_layers is None else self.n_decoder_layers
        self.decoder_heads = self.n_heads if self.decoder_heads is None else self.decoder_heads
        self.decoder_head_dim = self.head_dim if self.decoder_head_dim is None else self.decoder_head_dim
        self.decoder_ffn_dim = self.ffn_dim if self.decoder_ffn_dim is None else self.decoder_ffn_dim
        self.n_kv_heads = self.n_heads
        self.validate()

    def validate(self) -> None:
        problems = []
        if self.architecture != self.ARCHITECTURE:
            problems.append(f"architecture must be {self.ARCHITECTURE!r}, got {self.architecture!r}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "n_decoder_layers", "decoder_heads",
                     "decoder_ffn_dim", "max_seq_len", "relative_buckets", "relative_max_distance"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            problems.append(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim")
        else:
            for name in ("head_dim", "decoder_head_dim"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                    problems.append(f"{name} must be a positive integer, got {value!r}")
        for name, value, allowed in (("position", self.position, SEQ2SEQ_POSITIONS),
                                     ("norm", self.norm, ("rmsnorm", "layernorm")),
                                     ("norm_placement", self.norm_placement, ("pre", "post")),
                                     ("activation", self.activation, ("relu", "gelu", "gelu_tanh", "silu"))):
            if value not in allowed:
                problems.append(f"{name}={value!r} is not one of {allowed}")
        if self.position == "relative" and not problems and self.relative_buckets < 4:
            problems.append(f"relative_buckets={self.relative_buckets} is too few (at least 4)")
        ids = {"pad_token_id": self.pad_token_id, "bos_token_id": self.bos_token_id,
               "decoder_start_token_id": self.decoder_start_token_id, "forced_bos_token_id": self.forced_bos_token_id,
               "forced_eos_token_id": self.forced_eos_token_id}
        for name, value in list(ids.items()) + [("eos_token_id", i) for i in self.eos_token_ids]:
            if value is not None and not (isinstance(value, int) and 0 <= value < self.vocab_size):
                problems.append(f"{name}={value} is outside the vocabulary (size {self.vocab_size})")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        if problems:
            raise KvforgeError("invalid encoder-decoder config:\n  " + "\n  ".join(problems))

    @property
    def eos_token_ids(self) -> list[int]:
        value = self.eos_token_id
        return [] if value is None else list(value) if isinstance(value, list) else [value]

    @property
    def max_input_len(self) -> int:
        return self.max_seq_len

    def side(self, which: str) -> SimpleNamespace:
        """The config as one stack's components read it (the decoder's heads, their width and the FFN width may
        differ)."""
        view = dataclasses.asdict(self)
        if which == "decoder":
            view.update(n_heads=self.decoder_heads, n_kv_heads=self.decoder_heads, head_dim=self.decoder_head_dim,
                        ffn_dim=self.decoder_ffn_dim)
        return SimpleNamespace(**view)


# --- the stacks ---------------------------------------------------------------------
class Embeddings(nn.Module):
    """A stack's input: the shared token embeddings * embed_scale + learned positions (offset), then an optional norm."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.cfg = cfg
        self.positions = nn.Embedding(cfg.max_seq_len + cfg.position_offset, cfg.dim) if cfg.position == "learned" else None
        self.norm = build_norm(cfg) if cfg.embed_norm else None

    def forward(self, tokens: torch.Tensor, past: int | torch.Tensor = 0) -> torch.Tensor:
        """tokens: the token embeddings (B, T, C) of positions past..past+T-1."""
        x = tokens * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else tokens
        if self.positions is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device) + past + self.cfg.position_offset
            x = x + self.positions(pos)[None]
        return self.norm(x) if self.norm is not None else x


class PreNormDecoderLayer(nn.Module):
    """T5's decoder block: x + self(norm(x)), x + cross(norm(x), memory), x + ffn(norm(x))."""

    def __init__(self, cfg):
        super().__init__()
        self.attn_norm, self.attn = build_norm(cfg), Attention(cfg)
        self.cross_norm, self.cross = build_norm(cfg), CrossAttention(cfg)
        self.ffn_norm, self.ffn = build_norm(cfg), build_ffn(cfg)

    def forward(self, x, mask, cross_mask, past, cross_kv, bias=None):
        h, present = self.attn(self.attn_norm(x), mask, None, past, bias)
        x = x + h
        x = x + self.cross(self.cross_norm(x), cross_mask, cross_kv)
        return x + self.ffn(self.ffn_norm(x)), present


class PostNormDecoderLayer(nn.Module):
    """BART's decoder layer: norm(x + self(x)), norm(x + cross(x, memory)), norm(x + ffn(x))."""

    def __init__(self, cfg):
        super().__init__()
        self.attn, self.attn_norm = Attention(cfg), build_norm(cfg)
        self.cross, self.cross_norm = CrossAttention(cfg), build_norm(cfg)
        self.ffn, self.ffn_norm = build_ffn(cfg), build_norm(cfg)

    def forward(self, x, mask, cross_mask, past, cross_kv, bias=None):
        h, present = self.attn(x, mask, None, past, bias)
        x = self.attn_norm(x + h)
        x = self.cross_norm(x + self.cross(x, cross_mask, cross_kv))
        return self.ffn_norm(x + self.ffn(x)), present


class Seq2SeqLM(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.config = cfg
        enc, dec = cfg.side("encoder"), cfg.side("decoder")
        self.shared = nn.Embedding(cfg.vocab_size, cfg.dim)
        relative = cfg.position == "relative"
        # encoder
        self.encoder_embed = Embeddings(cfg)
        self.encoder_bias = RelativePositionBias(cfg.n_heads, cfg.relative_buckets, cfg.relative_max_distance, True) if relative else None
        block = Block if cfg.norm_placement == "pre" else PostNormBlock
        self.encoder_layers = nn.ModuleList(block(enc, Attention(enc), build_ffn(enc)) for _ in range(cfg.n_layers))
        self.encoder_norm = build_norm(cfg) if cfg.final_norm else None
        # decoder
        self.decoder_embed = Embeddings(cfg)
        self.decoder_bias = RelativePositionBias(cfg.decoder_heads, cfg.relative_buckets, cfg.relative_max_distance, False) if relative else None
        layer = PreNormDecoderLayer if cfg.norm_placement == "pre" else PostNormDecoderLayer
        self.decoder_layers = nn.ModuleList(layer(dec) for _ in range(cfg.n_decoder_layers))
        self.decoder_norm = build_norm(cfg) if cfg.final_norm else None
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=cfg.lm_head_bias)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.shared.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.shared.weight.dtype

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, KVPairs]:
        """The encoder's last hidden state (B, L, C) and every decoder layer's cross-attention K/V."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        L = input_ids.shape[1]
        x = self.encoder_embed(self.shared(input_ids))
        mask = attention_mask[:, None, None, :].bool().expand(-1, 1, L, -1)
        bias = self.encoder_bias(L, L) if self.encoder_bias is not None else None
        for layer in self.encoder_layers:
            x, _ = layer(x, mask, None, None, bias)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return x, tuple(layer.cross.kv(x) for layer in self.decoder_layers)

    def decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, past: KVPairs | None,
               cross: KVPairs) -> tuple[torch.Tensor, KVPairs]:
        """One decoder step over T new tokens after P cached ones: logits (B, T, vocab) and the new cache."""
        B, T = input_ids.shape
        P = 0 if past is None else past[0][0].shape[2]
        x = self.decoder_embed(self.shared(input_ids), P)
        mask = attention_mask_bool(torch.ones(B, P + T, dtype=torch.int64, device=input_ids.device), P, T, None)
        cross_mask = attention_mask[:, None, None, :].bool().expand(-1, 1, T, -1)
        bias = self.decoder_bias(T, P + T, P) if self.decoder_bias is not None else None
        presents = []
        for i, layer in enumerate(self.decoder_layers):
            x, present = layer(x, mask, cross_mask, None if past is None else past[i], cross[i], bias)
            presents.append(present)
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        if self.config.head_scale != 1.0:
            x = x * self.config.head_scale
        return self.lm_head(x).float(), tuple(presents)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced logits of decoder_input_ids given the source (no cache kept)."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        _, cross = self.encode(input_ids, attention_mask)
        return self.decode(decoder_input_ids, attention_mask, None, cross)[0]

    def empty_cache(self, batch: int) -> KVPairs:
        cfg = self.config
        shape = (batch, cfg.decoder_heads, 0, cfg.decoder_head_dim)
        dev = self.shared.weight.device
        return tuple((torch.zeros(shape, dtype=self.dtype, device=dev), torch.zeros(shape, dtype=self.dtype, device=dev))
                     for _ in range(cfg.n_decoder_layers))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_seq2seq(cfg: Seq2SeqConfig) -> Seq2SeqLM:
    return Seq2SeqLM(cfg)
