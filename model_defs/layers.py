"""Transformer components: norms, attention, FFNs (position schemes: positions.py).

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
from .positions import apply_rope

# The most negative float32: masked scores get it instead of -inf, so that a
# row with no visible key (a left-pad query) softmaxes to a finite uniform row
# rather than NaN, and NaN can never leak into the cache of a padded batch.
MASK_VALUE = torch.finfo(torch.float32).min


# --- norms --------------------------------------------------------------------
class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 whatever the model dtype.

    groups > 1 normalizes each of `groups` equal slices of the features on its
    own (a q/k norm over each head: Qwen 3, Gemma 3, Cohere); the weight still
    covers all features, one row per head.
    """

    def __init__(self, dim: int, eps: float, groups: int = 1):
        super().__init__()
        self.eps = eps
        self.groups = groups
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        if self.groups > 1:
            x = x.unflatten(-1, (self.groups, -1))  # (..., heads, D)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.groups > 1:
            x = x.flatten(-2)
        return self.weight * x.to(dtype)


class LayerNorm(nn.Module):
    """LayerNorm whose statistics are computed in float32 whatever the model dtype (groups: as RMSNorm)."""

    def __init__(self, dim: int, eps: float, bias: bool = True, groups: int = 1):
        super().__init__()
        self.eps = eps
        self.groups = groups
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        w = self.weight.float()
        b = self.bias.float() if self.bias is not None else None
        if self.groups == 1:
            return F.layer_norm(x.float(), (x.shape[-1],), w, b, self.eps).to(dtype)
        x = x.float().unflatten(-1, (self.groups, -1))
        x = F.layer_norm(x, (x.shape[-1],), None, None, self.eps).flatten(-2) * w
        return (x if b is None else x + b).to(dtype)


def build_norm(cfg: ModelConfig, dim: int | None = None, groups: int = 1) -> nn.Module:
    """The config's norm over `dim` features (default: the model width)."""
    dim = cfg.dim if dim is None else dim
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps, groups)
    return LayerNorm(dim, cfg.norm_eps, bias=cfg.norm_bias, groups=groups)


def build_qk_norms(cfg: ModelConfig) -> tuple[nn.Module, nn.Module]:
    """q and k norms: over each head ("head": Qwen 3, Gemma 3, Cohere) or the whole projection ("proj": OLMo 2)."""
    if cfg.qk_norm is None:
        return nn.Identity(), nn.Identity()
    per_head = cfg.qk_norm == "head"
    q = build_norm(cfg, cfg.n_heads * cfg.head_dim, groups=cfg.n_heads if per_head else 1)
    k = build_norm(cfg, cfg.n_kv_heads * cfg.head_dim, groups=cfg.n_kv_heads if per_head else 1)
    return q, k


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

    Scores are q.k * scale (1/sqrt(head_dim) unless the config sets
    `attn_scale`), optionally soft-capped (cap * tanh(s / cap), Gemma 2),
    plus an optional position bias (ALiBi), then masked and softmaxed in
    float32 (the kernel subtracts the row max before exponentiating, so large
    scores cannot overflow). K/V heads are shared by groups of query heads
    through a broadcasting matmul, never repeated in memory. q_norm / k_norm
    (identity unless the config has q/k norms) act on the projections before
    RoPE.

    window: this layer's sliding window W, or None. A windowed layer keeps a
    capped cache, a rolling buffer of its last W positions: `present` holds
    min(W, past + T) positions, and its keys line up with the last columns of
    the mask (which covers the whole context).
    """

    def __init__(self, cfg: ModelConfig, window: int | None = None, q_norm: nn.Module | None = None,
                 k_norm: nn.Module | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(cfg.head_dim)
        self.softcap = cfg.attn_softcap
        self.window = window
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.out_bias)
        self.q_norm = q_norm if q_norm is not None else nn.Identity()
        self.k_norm = k_norm if k_norm is not None else nn.Identity()
        self.attn_dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        mask: torch.Tensor,  # (B, 1, T, S) bool
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        past: tuple[torch.Tensor, torch.Tensor] | None,  # (B, KV, P, D) each; P <= window when windowed
        bias: torch.Tensor | None = None,  # (B, H, T or 1, S) float32 position bias (ALiBi)
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        B, T, _ = x.shape
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(x)).view(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_norm(self.k_proj(x)).view(B, T, KV, D).transpose(1, 2)  # (B, KV, T, D)
        v = self.v_proj(x).view(B, T, KV, D).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if past is not None:
            k = torch.cat((past[0], k), dim=2)  # (B, KV, L, D), L = P + T
            v = torch.cat((past[1], v), dim=2)
        if self.window is None:
            present = (k, v)
        else:
            # The rolling buffer: a capped past holds only the newest positions, so the keys are the
            # mask's last L columns; the next step needs at most the last W of them.
            start = mask.shape[-1] - k.shape[2]  # S - L
            mask = mask[..., start:]
            bias = bias[..., start:] if bias is not None else None
            present = (k[:, :, -self.window:], v[:, :, -self.window:])

        out = attend(q, k, v, mask, self.scale, self.softcap, bias, self.attn_dropout)
        return self.o_proj(out), present


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           softcap: float | None = None, bias: torch.Tensor | None = None, dropout: nn.Module | None = None,
           grouped: bool = True) -> torch.Tensor:
    """softmax(q.k * scale [soft-capped] + bias, masked) . v for q (B, H, T, D), k and v (B, KV, L, D),
    mask (B, 1, T, L) bool; returns (B, T, H * Dv).

    Query heads are grouped by the KV head they share (a broadcasting matmul, K/V
    never repeated in memory); q is scaled before the matmul so that FP16 scores
    stay in range; scores are masked and softmaxed in float32. grouped=False (as many K/V heads as query
    heads, no soft-cap) computes the same with 4-D matmuls, which spares a transposed copy of K per call.
    """
    B, H, T, D = q.shape
    KV = k.shape[1]
    q = q * scale if scale != 1.0 else q
    if not grouped:  # one K/V head per query head (cross-attention): plain 4-D matmuls, K^T fused into the MatMul
        scores = torch.matmul(q, k.transpose(-1, -2)).float()  # (B, H, T, L)
        if bias is not None:
            scores = scores + bias
        scores = scores.masked_fill(~mask, MASK_VALUE)
        probs = torch.softmax(scores, dim=-1)
        probs = (dropout(probs) if dropout is not None else probs).to(v.dtype)
        return torch.matmul(probs, v).transpose(1, 2).reshape(B, T, H * v.shape[-1])
    qg = q.reshape(B, KV, H // KV, T, D)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)).float()  # (B, KV, G, T, L)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.unflatten(1, (KV, H // KV))
    scores = scores.masked_fill(~mask.unsqueeze(1), MASK_VALUE)
    probs = torch.softmax(scores, dim=-1)
    probs = (dropout(probs) if dropout is not None else probs).to(v.dtype)
    out = torch.matmul(probs, v.unsqueeze(2))  # (B, KV, G, T, Dv)
    return out.reshape(B, H, T, v.shape[-1]).transpose(1, 2).reshape(B, T, H * v.shape[-1])


class CrossAttention(nn.Module):
    """Queries from one sequence (B, T, C), keys and values from another, the memory (B, L, C_mem): a
    decoder reading its encoder's output (T5, BART), or learned latents reading a long input (the
    Perceiver's latent block). No positions inside; `mask` (B, 1, T, L) hides padded memory entries.

    `kv(memory)` projects the memory once; `forward` takes those K/V, so a decoder computes them once
    per source and feeds them to every step.
    """

    def __init__(self, cfg, memory_dim: int | None = None, kv_heads: int | None = None):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.kv_heads = cfg.n_heads if kv_heads is None else kv_heads  # fewer: grouped queries (Idefics2's resampler)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(cfg.head_dim)
        memory_dim = cfg.dim if memory_dim is None else memory_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(memory_dim, self.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(memory_dim, self.kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.out_bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)

    def kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The memory's keys and values, (B, KV, L, D) each."""
        B, L, _ = memory.shape
        k = self.k_proj(memory).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(memory).view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def forward(self, x: torch.Tensor, mask: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                bias: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        grouped = self.kv_heads != self.n_heads
        return self.o_proj(attend(q, kv[0], kv[1], mask, self.scale, None, bias, self.attn_dropout, grouped=grouped))


# --- FFN ----------------------------------------------------------------------
def activation_fn(name: str):
    return {
        "relu": F.relu,
        "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
        "silu": F.silu,
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's
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
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu, ReGLU with relu. width: the hidden width
    (default: the config's ffn_dim; a MoE's shared expert has its own)."""

    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        width = cfg.ffn_dim if width is None else width
        self.gate_proj = nn.Linear(cfg.dim, width, bias=cfg.ffn_bias)
        self.up_proj = nn.Linear(cfg.dim, width, bias=cfg.ffn_bias)
        self.down_proj = nn.Linear(width, cfg.dim, bias=cfg.ffn_bias)
        self.act = activation_fn(cfg.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def build_ffn(cfg: ModelConfig) -> nn.Module:
    return GatedMLP(cfg) if cfg.gated_ffn else MLP(cfg)
