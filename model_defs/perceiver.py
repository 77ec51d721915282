"""The Perceiver's latent transformer: learned latents read a long input through cross-attention.

forward(input_ids, attention_mask=None) -> {"last_hidden_state": (B, M, C) latents, "logits": (B, num_labels)}

The input tokens are embedded (token + learned absolute positions) and are
never attended among themselves: only the M learned latents (M << input
length L) query them. Each latent block is the notes' "Latent Transformer
Block":

    z = z + CrossAttention(q <- norm(z), k, v <- norm(x))     the latents ask the input
    z = z + FFN(norm(z))
    z = z + SelfAttention(norm(z))                            the latents share what they learned
    z = z + FFN(norm(z))

so a block costs O(M * L + M^2) instead of the O(L^2) of self-attention over
the input. The classification head averages the latents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .encoder import EncoderConfig, EncoderEmbeddings, encoder_mask
from .layers import Attention, CrossAttention, build_ffn, build_norm
from .model import Block


@dataclass
class PerceiverConfig(EncoderConfig):
    n_latents: int = 16
    architecture: str = "perceiver"
    norm_placement: str = "pre"
    final_norm: bool = True
    embed_norm: bool = False
    type_vocab_size: int = 0
    norm_eps: float = 1e-5

    ARCHITECTURE: ClassVar[str] = "perceiver"

    def problems(self) -> list[str]:
        problems = super().problems()
        if not isinstance(self.n_latents, int) or isinstance(self.n_latents, bool) or self.n_latents < 1:
            problems.append(f"n_latents must be a positive integer, got {self.n_latents!r}")
        if self.head not in (None, "classification"):
            problems.append(f"head={self.head!r}: a perceiver has no head or a classification head")
        if self.norm_placement != "pre" or not self.final_norm:
            problems.append("the latent blocks are pre-norm with a final norm (norm_placement='pre', final_norm=True)")
        if self.position == "padded" or self.type_vocab_size:
            problems.append("a perceiver's input has absolute or no positions and no token types")
        return problems


class LatentCrossBlock(nn.Module):
    """z + cross(norm(z), norm(x)), then z + ffn(norm(z))."""

    def __init__(self, cfg: PerceiverConfig):
        super().__init__()
        self.latent_norm = build_norm(cfg)
        self.input_norm = build_norm(cfg)
        self.attn = CrossAttention(cfg)
        self.ffn_norm = build_norm(cfg)
        self.ffn = build_ffn(cfg)

    def forward(self, z: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        z = z + self.attn(self.latent_norm(z), mask, self.attn.kv(self.input_norm(x)))
        return z + self.ffn(self.ffn_norm(z))


class LatentBlock(nn.Module):
    """The latents read the input, then attend among themselves."""

    def __init__(self, cfg: PerceiverConfig):
        super().__init__()
        self.cross = LatentCrossBlock(cfg)
        self.latent = Block(cfg, Attention(cfg), build_ffn(cfg))

    def forward(self, z, x, cross_mask, latent_mask):
        z = self.cross(z, x, cross_mask)
        z, _ = self.latent(z, latent_mask, None, None)
        return z


class Perceiver(nn.Module):
    def __init__(self, cfg: PerceiverConfig):
        super().__init__()
        self.config = cfg
        self.embed = EncoderEmbeddings(cfg)
        self.latents = nn.Parameter(torch.zeros(cfg.n_latents, cfg.dim))
        self.layers = nn.ModuleList(LatentBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = build_norm(cfg)
        self.head = nn.Linear(cfg.dim, cfg.num_labels) if cfg.head == "classification" else None

    @property
    def dtype(self) -> torch.dtype:
        return self.latents.dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        x = self.embed(input_ids, None)
        B, M = input_ids.shape[0], self.config.n_latents
        z = self.latents.expand(B, -1, -1)
        cross_mask = encoder_mask(attention_mask, M)  # (B, 1, M, L)
        latent_mask = torch.ones(B, 1, M, M, dtype=torch.bool, device=z.device)
        for layer in self.layers:
            z = layer(z, x, cross_mask, latent_mask)
        z = self.norm(z)
        out = {"last_hidden_state": z.float()}
        if self.head is not None:
            out["logits"] = self.head(z.mean(dim=1)).float()
        return out

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_perceiver(cfg: PerceiverConfig) -> Perceiver:
    return Perceiver(cfg)
