"""Bidirectional encoders (BERT, RoBERTa and pre-norm variants), assembled from the decoder's components.

forward(input_ids, attention_mask=None, token_type_ids=None) -> dict of outputs

    input_ids          int64   (B, T)
    attention_mask     int64   (B, T)   1 = real token, 0 = padding (right, as tokenizers pad for encoders)
    token_type_ids     int64   (B, T)   segment ids; only when the config has type_vocab_size > 1
    last_hidden_state  float32 (B, T, C)
    logits             float32 (B, T, vocab) for a masked-LM head, (B, num_labels) for a classification head
    pooler_output      float32 (B, C)   tanh(dense(first token)), for a base model that has BERT's pooler

Every token sees every real token (no causal mask, padding mask only). The
layers are the decoder's `Block` (pre-norm) or `PostNormBlock` (post-norm:
BERT), around the same `Attention` given a bidirectional mask, no RoPE and no
cache. Positions are learned: absolute (BERT: position t for token t), or
counted from the padding token as RoBERTa counts them (pad_token_id + 1 + the
number of real tokens before), or none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from kvforge.errors import KvforgeError

from .config import ConfigDict
from .layers import Attention, activation_fn, build_ffn, build_norm
from .model import Block, PostNormBlock

ENCODER_POSITIONS = ("absolute", "padded", "none")
HEADS = (None, "pooler", "mlm", "classification")


@dataclass
class EncoderConfig(ConfigDict):
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int | None = None  # None -> dim // n_heads
    ffn_dim: int | None = None  # None -> 4 * dim
    max_seq_len: int = 512  # the longest input the positions cover

    # embeddings: token + position + token type, then a norm (BERT) or not
    position: str = "absolute"  # "absolute" (BERT), "padded" (RoBERTa: counted after pad_token_id), "none"
    type_vocab_size: int = 2  # segment embeddings; 0 = none; 1 = one constant row (RoBERTa), no input
    embed_norm: bool = True

    # layers
    norm: str = "layernorm"
    norm_eps: float = 1e-12
    norm_bias: bool = True
    norm_placement: str = "post"  # post: norm(x + f(x)) (BERT); pre: x + f(norm(x)), then final_norm
    final_norm: bool = False
    activation: str = "gelu"
    gated_ffn: bool = False
    ffn_bias: bool = True
    qkv_bias: bool = True
    out_bias: bool = True
    attn_scale: float | None = None  # None -> 1/sqrt(head_dim)

    # heads: None (last_hidden_state only), "pooler" (+ pooler_output), "mlm" (token logits), "classification"
    head: str | None = None
    head_activation: str = "gelu"  # the masked-LM head's transform (BERT: hidden_act; RoBERTa: gelu)
    num_labels: int = 2
    tie_embeddings: bool = True  # the masked-LM decoder shares the token embeddings

    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    labels: list[str] | None = None  # class names (id2label), for classify()
    # how embed() pools and normalizes by default: a sentence-transformers directory's modules.json and Pooling
    # config (model_defs/sentence_transformers.py: pooling, normalize, max_seq_length, source); None: mean, as is
    embedding: dict[str, Any] | None = None
    dropout: float = 0.0
    family: str = "kvforge"
    architecture: str = "encoder"
    extra: dict[str, Any] = field(default_factory=dict)

    # what the shared components read, fixed for encoders
    n_kv_heads: int | None = None
    residual_scale: float = 1.0
    attn_softcap: None = None

    def __post_init__(self) -> None:
        if self.head_dim is None and self.dim % self.n_heads == 0:
            self.head_dim = self.dim // self.n_heads
        if self.ffn_dim is None:
            self.ffn_dim = 4 * self.dim
        self.n_kv_heads = self.n_heads
        self.validate()

    ARCHITECTURE: ClassVar[str] = "encoder"

    def validate(self) -> None:
        problems = self.problems()
        if problems:
            raise KvforgeError(f"invalid {self.ARCHITECTURE} config:\n  " + "\n  ".join(problems))

    def problems(self) -> list[str]:
        problems = []
        if self.architecture != self.ARCHITECTURE:
            problems.append(f"architecture must be {self.ARCHITECTURE!r}, got {self.architecture!r}")
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            problems.append(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim")
        for name, value, allowed in (("position", self.position, ENCODER_POSITIONS), ("head", self.head, HEADS),
                                     ("norm", self.norm, ("layernorm", "rmsnorm")),
                                     ("norm_placement", self.norm_placement, ("pre", "post")),
                                     ("activation", self.activation, ("relu", "gelu", "gelu_tanh", "silu")),
                                     ("head_activation", self.head_activation, ("relu", "gelu", "gelu_tanh", "silu"))):
            if value not in allowed:
                problems.append(f"{name}={value!r} is not one of {allowed}")
        if not isinstance(self.type_vocab_size, int) or self.type_vocab_size < 0:
            problems.append(f"type_vocab_size must be an integer >= 0, got {self.type_vocab_size!r}")
        if self.head == "classification" and (not isinstance(self.num_labels, int) or self.num_labels < 1):
            problems.append(f"num_labels must be a positive integer, got {self.num_labels!r}")
        if self.labels is not None and len(self.labels) != self.num_labels:
            problems.append(f"labels has {len(self.labels)} names for {self.num_labels} classes")
        if self.position == "padded" and self.pad_token_id is None:
            problems.append("position='padded' counts positions after pad_token_id: it needs one")
        if self.position == "padded" and not problems and self.pad_token_id + 1 >= self.max_seq_len:
            problems.append(f"position='padded' starts at pad_token_id + 1 = {self.pad_token_id + 1}, beyond the "
                            f"{self.max_seq_len} positions")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value < self.vocab_size):
                problems.append(f"{name}={value} is outside the vocabulary (size {self.vocab_size})")
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"dropout must be in [0, 1), got {self.dropout}")
        return problems

    @property
    def max_input_len(self) -> int:
        """The longest input the positions cover (RoBERTa's first position is pad_token_id + 1)."""
        return self.max_seq_len - (self.pad_token_id + 1 if self.position == "padded" else 0)

    @property
    def eos_token_ids(self) -> list[int]:
        return [] if self.eos_token_id is None else [self.eos_token_id]


# --- embeddings -------------------------------------------------------------------
def padded_position_ids(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """RoBERTa's positions: pad_token_id + the count of non-pad tokens up to and including each token;
    pad tokens themselves get pad_token_id. The count runs in float32 (exact below 2**24), the type
    TensorRT's CumSum takes."""
    real = (input_ids != pad_token_id).to(torch.float32)
    return (torch.cumsum(real, dim=1) * real).to(torch.int64) + pad_token_id


class EncoderEmbeddings(nn.Module):
    """token + position + token-type embeddings, then an optional norm."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.positions = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.position != "none" else None
        self.token_types = nn.Embedding(cfg.type_vocab_size, cfg.dim) if cfg.type_vocab_size else None
        self.norm = build_norm(cfg) if cfg.embed_norm else None
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        x = self.tokens(input_ids)
        if self.positions is not None:
            if cfg.position == "padded":
                pos = padded_position_ids(input_ids, cfg.pad_token_id)
            else:
                pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
            x = x + self.positions(pos)
        if self.token_types is not None:
            if token_type_ids is None or cfg.type_vocab_size == 1:
                x = x + self.token_types.weight[0]
            else:
                x = x + self.token_types(token_type_ids)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


# --- heads --------------------------------------------------------------------------
class Pooler(nn.Module):
    """tanh(dense(first token)): BERT's pooler; with `out`, a classifier over it (BERT, RoBERTa)."""

    def __init__(self, cfg: EncoderConfig, num_labels: int | None = None):
        super().__init__()
        self.dense = nn.Linear(cfg.dim, cfg.dim)
        self.out = nn.Linear(cfg.dim, num_labels) if num_labels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.dense(x[:, 0]))
        return self.out(h) if self.out is not None else h


class MaskedLMHead(nn.Module):
    """decoder(norm(act(dense(x)))) + bias: one score per vocabulary entry at every position."""

    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.dim, cfg.dim)
        self.act = activation_fn(cfg.head_activation)
        self.norm = build_norm(cfg)
        self.decoder = nn.Linear(cfg.dim, cfg.vocab_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(x))))


def build_head(cfg: EncoderConfig) -> nn.Module | None:
    if cfg.head == "mlm":
        return MaskedLMHead(cfg)
    if cfg.head == "classification":
        return Pooler(cfg, cfg.num_labels)
    if cfg.head == "pooler":
        return Pooler(cfg)
    return None


def head_output(cfg) -> str | None:
    """The name of the head's output: logits (masked LM, classification), pooler_output, or None."""
    return {"mlm": "logits", "classification": "logits", "pooler": "pooler_output"}.get(cfg.head)


def encoder_mask(attention_mask: torch.Tensor, queries: int | None = None) -> torch.Tensor:
    """(B, 1, Q, S) bool: every query sees every real key (no causal order)."""
    q = attention_mask.shape[-1] if queries is None else queries
    return attention_mask[:, None, None, :].bool().expand(-1, 1, q, -1)


# --- the encoder ----------------------------------------------------------------------
class Encoder(nn.Module):
    def __init__(self, cfg: EncoderConfig, layers: list[nn.Module], head: nn.Module | None):
        super().__init__()
        self.config = cfg
        self.embed = EncoderEmbeddings(cfg)
        self.layers = nn.ModuleList(layers)
        self.norm = build_norm(cfg) if cfg.final_norm else None
        self.head = head
        if cfg.head == "mlm" and cfg.tie_embeddings:
            self.head.decoder.weight = self.embed.tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.tokens.weight.dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        x = self.embed(input_ids, token_type_ids)
        mask = encoder_mask(attention_mask)
        for layer in self.layers:
            x, _ = layer(x, mask, None, None)
        if self.norm is not None:
            x = self.norm(x)
        out = {"last_hidden_state": x.float()}
        if self.head is not None:
            out[head_output(self.config)] = self.head(x).float()
        return out

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_encoder_layer(cfg: EncoderConfig) -> nn.Module:
    block = PostNormBlock if cfg.norm_placement == "post" else Block
    return block(cfg, Attention(cfg), build_ffn(cfg))


def build_encoder(cfg: EncoderConfig) -> Encoder:
    return Encoder(cfg, [build_encoder_layer(cfg) for _ in range(cfg.n_layers)], build_head(cfg))
