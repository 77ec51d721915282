"""The Perceiver resampler: a fixed number of learned latents read a variable number of image features, so that
every image costs the decoder the same few tokens (Flamingo, Idefics2; issue 37).

Two ways a layer lets the latents read, both from the components of model_defs/layers.py and perceiver.py:

    joint (Idefics2, Flamingo):  z = z + Attention(q <- norm(z), k, v <- [norm'(x); norm(z)])
                                 z = z + FFN(norm''(z))
    cross_then_self (the notes'  z = z + CrossAttention(q <- norm(z), k, v <- norm(x))
    Latent Transformer Block):   z = z + FFN(norm(z))
                                 z = z + SelfAttention(norm(z))
                                 z = z + FFN(norm(z))

then a final norm over the latents. In the joint form the latents attend to the features and to themselves in one
softmax (keys and values of both, the features first); the attention may group its queries over fewer K/V heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from kvforge.errors import KvforgeError

from .config import ConfigDict
from .layers import CrossAttention, build_ffn, build_norm
from .perceiver import LatentBlock

FORMS = ("joint", "cross_then_self")


@dataclass
class ResamplerConfig(ConfigDict):
    dim: int
    n_latents: int
    n_layers: int
    n_heads: int
    head_dim: int
    ffn_dim: int
    n_kv_heads: int | None = None  # None: n_heads
    form: str = "joint"
    activation: str = "silu"
    gated_ffn: bool = True
    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    # what the shared components read, fixed here
    norm_bias: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    ffn_bias: bool = False
    norm_placement: str = "pre"
    attn_scale: float | None = None
    attn_softcap: None = None
    residual_scale: float = 1.0
    dropout: float = 0.0

    KIND: ClassVar[str] = "resampler config"

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        problems = []
        for name in ("dim", "n_latents", "n_layers", "n_heads", "head_dim", "ffn_dim", "n_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems and self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.form not in FORMS:
            problems.append(f"form={self.form!r} is not one of {FORMS}")
        if self.form == "cross_then_self" and self.n_kv_heads != self.n_heads:
            problems.append("the cross_then_self form has as many K/V heads as query heads")
        if problems:
            raise KvforgeError("invalid resampler config:\n  " + "\n  ".join(problems))


class JointLayer(nn.Module):
    """The latents attend to [the features; themselves] in one softmax, then an FFN (Idefics2's layer)."""

    def __init__(self, cfg: ResamplerConfig):
        super().__init__()
        self.latent_norm = build_norm(cfg)
        self.context_norm = build_norm(cfg)
        self.attn = CrossAttention(cfg, kv_heads=cfg.n_kv_heads)
        self.ffn_norm = build_norm(cfg)
        self.ffn = build_ffn(cfg)

    def forward(self, z: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        normed = self.latent_norm(z)
        z = z + self.attn(normed, mask, self.attn.kv(torch.cat([self.context_norm(x), normed], dim=1)))
        return z + self.ffn(self.ffn_norm(z))


class Resampler(nn.Module):
    """features (N, L, dim) [, mask (N, L) of real features] -> latents (N, n_latents, dim)."""

    def __init__(self, cfg: ResamplerConfig):
        super().__init__()
        self.config = cfg
        self.latents = nn.Parameter(torch.zeros(cfg.n_latents, cfg.dim))
        layer = JointLayer if cfg.form == "joint" else LatentBlock
        self.layers = nn.ModuleList(layer(cfg) for _ in range(cfg.n_layers))
        self.norm = build_norm(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        N, L, _ = x.shape
        M = self.config.n_latents
        z = self.latents.to(x.dtype).expand(N, -1, -1)
        real = torch.ones(N, L, dtype=torch.bool, device=x.device) if mask is None else mask.bool()
        if self.config.form == "joint":
            keys = torch.cat([real, torch.ones(N, M, dtype=torch.bool, device=x.device)], dim=1)  # features, latents
            joint = keys[:, None, None, :].expand(N, 1, M, L + M)
            for layer in self.layers:
                z = layer(z, x, joint)
        else:
            cross = real[:, None, None, :].expand(N, 1, M, L)
            latent = torch.ones(N, 1, M, M, dtype=torch.bool, device=x.device)
            for layer in self.layers:
                z = layer(z, x, cross, latent)
        return self.norm(z)
