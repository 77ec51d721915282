"""Transformer components: norms, position schemes, attention, FFNs.

Each component is a small module with one job; `model.py` composes them.
All maths is export-friendly: real cos/sin for RoPE (no complex tensors), the
KV cache as explicit tensors in and out, no device baked into any module.
Shape comments: B batch, T new tokens, P past tokens, S = P + T, H query
heads, KV key/value heads, G = H // KV, D head_dim, C model dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig

# The most negative float32: masked scores get it instead of -inf, so that a
# row with no visible key (a left-pad query) softmaxes to a finite uniform row
# rather than NaN, and NaN can never leak into the cache of a padded batch.
MASK_VALUE = torch.finfo(torch.float32).min


# --- norms --------------------------------------------------------------------
class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 whatever the model dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class LayerNorm(nn.Module):
    """LayerNorm whose statistics are computed in float32 whatever the model dtype."""

    def __init__(self, dim: int, eps: float, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        w = self.weight.float()
        b = self.bias.float() if self.bias is not None else None
        return F.layer_norm(x.float(), (x.shape[-1],), w, b, self.eps).to(dtype)


def build_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.dim, cfg.norm_eps)
    return LayerNorm(cfg.dim, cfg.norm_eps, bias=cfg.norm_bias)


# --- positions ----------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/rot) for i < rot/2, with the configured scaling."""
    rot = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["type"] == "linear":  # position interpolation: positions / factor
        return inv_freq / scaling["factor"]
    # Llama 3.1: leave high frequencies alone, divide low frequencies by `factor`,
    # and interpolate smoothly in between (wavelengths measured against the
    # original training context).
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_seq_len"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE with real cos/sin computed from position ids (no table to outgrow)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.rotary_dim = cfg.rotary_dim
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: (B, T) -> cos, sin: (B, T, rotary_dim), float32
        freqs = position_ids[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim features of x: (B, heads, T, D) by cos/sin: (B, T, rot).

    The half-split layout (rotate_half) is the one Hugging Face Llama-family
    checkpoints are stored for, so their q/k weights need no permutation.
    """
    rot = cos.shape[-1]
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


class LearnedPositions(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.max_seq_len, cfg.dim))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(position_ids, self.weight)  # (B, T, C)


class SinusoidalPositions(nn.Module):
    """sin/cos of position * 10000^(-2i/C), interleaved as in the original Transformer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv = torch.exp(torch.arange(0, cfg.dim, 2, dtype=torch.float32) * (-math.log(10000.0) / cfg.dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        angles = position_ids[..., None].float() * self.inv_freq  # (B, T, C/2)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (B, T, C)


# --- attention ----------------------------------------------------------------
def attention_mask_bool(
    attention_mask: torch.Tensor, past: int | torch.Tensor, seq: int | torch.Tensor, window: int | None
) -> torch.Tensor:
    """Which keys each new query may see: (B, 1, T, S), True = visible.

    Queries are the T new tokens at cache indices P..S-1; keys are cache indices
    0..S-1. A key is visible when it is not in the future (causal), not padding
    (attention_mask), and, with a sliding window, fewer than `window` indices
    back. Cache indices, not position ids, define causality and the window, so
    a left-padded row sees exactly what it would see alone.
    """
    total = attention_mask.shape[-1]
    k_idx = torch.arange(total, device=attention_mask.device)  # (S,)
    q_idx = torch.arange(seq, device=attention_mask.device) + past  # (T,)
    visible = k_idx[None, :] <= q_idx[:, None]  # (T, S)
    if window is not None:
        visible = visible & (k_idx[None, :] > q_idx[:, None] - window)
    return visible[None, None] & attention_mask[:, None, None, :].bool()


class Attention(nn.Module):
    """Causal self-attention for MHA, GQA and MQA: only n_kv_heads changes.

    Scores are scaled by 1/sqrt(head_dim) and softmaxed in float32 (the kernel
    subtracts the row max before exponentiating, so large scores cannot
    overflow). K/V heads are shared by groups of query heads through a
    broadcasting matmul, never repeated in memory.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.out_bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        mask: torch.Tensor,  # (B, 1, T, S) bool
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        past: tuple[torch.Tensor, torch.Tensor] | None,  # (B, KV, P, D) each
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        B, T, _ = x.shape
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, KV, D).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, KV, D).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if past is not None:
            k = torch.cat((past[0], k), dim=2)  # (B, KV, S, D)
            v = torch.cat((past[1], v), dim=2)
        present = (k, v)

        # Query heads grouped by the KV head they share; q is scaled before the
        # matmul so that FP16 scores stay in range.
        qg = (q * self.scale).reshape(B, KV, H // KV, T, D)
        scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)).float()  # (B, KV, G, T, S)
        scores = scores.masked_fill(~mask.unsqueeze(1), MASK_VALUE)
        probs = self.attn_dropout(torch.softmax(scores, dim=-1)).to(v.dtype)
        out = torch.matmul(probs, v.unsqueeze(2))  # (B, KV, G, T, D)
        out = out.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)
        return self.o_proj(out), present


# --- FFN ----------------------------------------------------------------------
def activation_fn(name: str):
    return {
        "relu": F.relu,
        "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "silu": F.silu,
    }[name]


class MLP(nn.Module):
    """up -> act -> down (GPT-2, the original Transformer)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.ffn_bias)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.ffn_bias)
        self.act = activation_fn(cfg.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu, ReGLU with relu."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.ffn_bias)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=cfg.ffn_bias)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=cfg.ffn_bias)
        self.act = activation_fn(cfg.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def build_ffn(cfg: ModelConfig) -> nn.Module:
    return GatedMLP(cfg) if cfg.gated_ffn else MLP(cfg)
