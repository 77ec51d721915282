"""The decoder-only transformer, assembled from components by `build_model`.

forward(input_ids, attention_mask=None, position_ids=None, past_key_values=None)
    -> (logits, present_key_values)

with the tensors of DESIGN.md's KV-cache IO contract:
    input_ids        int64  (B, T)
    attention_mask   int64  (B, P + T)   1 = real token, 0 = padding (left)
    position_ids     int64  (B, T)       default: count of real tokens before each one
    past_key_values  n_layers x (key, value), each (B, KV, P, D) in the model dtype
    logits           float32 (B, T, vocab)
    present          n_layers x (key, value), each (B, KV, P + T, D)
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .layers import (
    Attention,
    LearnedPositions,
    RotaryEmbedding,
    SinusoidalPositions,
    attention_mask_bool,
    build_ffn,
    build_norm,
)

KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]


class Block(nn.Module):
    """One decoder layer: attention and FFN, each with a residual and a norm."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module, ffn: nn.Module):
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.attn_norm = build_norm(cfg)
        self.attn = attn
        self.ffn_norm = build_norm(cfg)
        self.ffn = ffn
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, mask, rope, past):
        if self.pre_norm:  # x + f(norm(x))
            h, present = self.attn(self.attn_norm(x), mask, rope, past)
            x = x + self.resid_dropout(h)
            return x + self.resid_dropout(self.ffn(self.ffn_norm(x))), present
        # post-norm: norm(x + f(x))
        h, present = self.attn(x, mask, rope, past)
        x = self.attn_norm(x + self.resid_dropout(h))
        return self.ffn_norm(x + self.resid_dropout(self.ffn(x))), present


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, blocks: list[Block], positions: nn.Module | None, rope: nn.Module | None):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.positions = positions  # added to the embeddings (learned, sinusoidal)
        self.rope = rope  # rotates q and k inside attention
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(blocks)
        self.norm = build_norm(cfg) if cfg.final_norm else None
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # The distinct windows in use (None = full causal): one mask is built per window.
        self._windows = [cfg.layer_window(i) for i in range(cfg.n_layers)]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        B, T = input_ids.shape
        past = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        if attention_mask is None:
            attention_mask = torch.ones(B, past + T, dtype=torch.int64, device=input_ids.device)
        if position_ids is None:
            # Each real token's position is the number of real tokens before it,
            # so a left-padded row gets the positions it would have alone.
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -T:]

        x = self.embed(input_ids)  # (B, T, C)
        if self.positions is not None:
            x = x + self.positions(position_ids).to(x.dtype)
        x = self.embed_dropout(x)
        rope = self.rope(position_ids) if self.rope is not None else None
        masks = {w: attention_mask_bool(attention_mask, past, T, w) for w in dict.fromkeys(self._windows)}

        presents = []
        for i, layer in enumerate(self.layers):
            layer_past = None if past_key_values is None else past_key_values[i]
            x, present = layer(x, masks[self._windows[i]], rope, layer_past)
            presents.append(present)
        if self.norm is not None:
            x = self.norm(x)
        logits = self.lm_head(x).float()  # (B, T, vocab)
        return logits, tuple(presents)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights counted once

    def empty_cache(self, batch: int) -> KVCache:
        """A past of length 0, in the model dtype, for callers that always pass a cache."""
        cfg = self.config
        shape = (batch, cfg.n_kv_heads, 0, cfg.head_dim)
        dev = self.embed.weight.device
        return tuple(
            (torch.zeros(shape, dtype=self.dtype, device=dev), torch.zeros(shape, dtype=self.dtype, device=dev))
            for _ in range(cfg.n_layers)
        )


def build_model(cfg: ModelConfig) -> Transformer:
    """Assemble a Transformer from its config; weights are left as constructed."""
    blocks = [Block(cfg, Attention(cfg), build_ffn(cfg)) for _ in range(cfg.n_layers)]
    positions = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions}.get(cfg.position)
    rope = RotaryEmbedding(cfg) if cfg.position == "rope" else None
    return Transformer(cfg, blocks, positions(cfg) if positions else None, rope)


@torch.no_grad()
def init_random_weights(model: Transformer, seed: int = 0) -> Transformer:
    """Seeded random weights that exercise every parameter.

    Biases and norm weights are random too (not 0 and 1), so that a checkpoint
    mapping that drops or swaps one of them changes the logits.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif p.ndim == 1:  # biases
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        elif name == "embed.weight":
            # std 2/sqrt(dim): tied to lm_head, this gives logits of std ~2 (as in a
            # trained LM), not sqrt(dim); untied, the norms rescale the residual anyway.
            p.copy_(torch.randn(p.shape, generator=gen) * (2.0 / p.shape[-1] ** 0.5))
        else:  # (out, in) matrices and learned positions: unit-variance outputs
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model.eval()
