"""Multi-head latent attention (DeepSeek-V2/V3): every head's keys and values come from one small latent per token.

Per token (C model dim, H heads, r = kv_lora_rank, dn / dr = the query-key widths without / with RoPE, dv the
value width):

    q          = q_proj(x)  or  q_b_proj(norm(q_a_proj(x)))             (H, dn + dr)  -> q_nope (dn), q_pe (dr)
    c_kv, k_pe = kv_a_proj_with_mqa(x)                                   (r), (dr)
    latent     = [norm(c_kv) | rope(k_pe)]                               (r + dr): the cache, shared by all heads
    k_h, v_h   = kv_b_proj(norm(c_kv)) split per head                    (dn), (dv)  with W_UK_h (dn, r), W_UV_h (dv, r)

Written out, head h's score against a past token is q_nope.W_UK_h.c_kv + q_pe.k_pe, and its output
sum_j p_j W_UV_h.c_kv_j. So the per-head keys and values never need to exist: the query's no-RoPE part is
absorbed into the latent space (q_lat = q_nope.W_UK_h, r features), the attention runs over the cached latent
directly, as multi-query attention with one head of r + dr features, and W_UV_h maps each head's r-feature
result to its value width afterwards (DeepSeek's "weight absorption"). A decode step then reads r + dr values
per past token and layer, whatever H is, and never expands the past into per-head K/V. kv_b_proj stays one
linear layer's weight (as checkpoints store it); the graph reads its two halves as per-head matrices.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig
from .layers import MASK_VALUE, RMSNorm
from .positions import apply_rope

# DeepSeek's two low-rank norms use the RMSNorm default epsilon, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    # linear layers whose weight is read, not called: a LoRA slot (model_defs/lora.py) would change nothing there
    LORA_EXCLUDED = {"kv_b_proj": "latent attention absorbs kv_b into its queries and outputs (its weight is read per "
                                  "head, the layer is never called), so an adapter there would change nothing"}
    # kv_b_proj's weight is read here, its layer never called: a streamed model loads this module's weights whole
    # (model_defs/weights.py)
    reads_child_weights = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H = cfg.n_heads
        self.n_heads, self.rank = H, cfg.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.nope + self.rope_dim
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else 1.0 / math.sqrt(qk)
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.dim, H * qk, bias=False)
        self.kv_a_proj = nn.Linear(cfg.dim, self.rank + self.rope_dim, bias=cfg.qkv_bias)
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, cfg.dim, bias=cfg.out_bias)
        self.attn_dropout = nn.Dropout(cfg.dropout)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))

    def forward(
        self,
        x: torch.Tensor,  # (B, T, C)
        mask: torch.Tensor,  # (B, 1, T, S) bool
        rope: tuple[torch.Tensor, torch.Tensor],
        past: tuple[torch.Tensor] | None,  # ((B, 1, P, r + dr),)
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor]]:
        B, T, _ = x.shape
        H, r, dn, dv = self.n_heads, self.rank, self.nope, self.v_dim
        q = self._query(x).view(B, T, H, dn + self.rope_dim).transpose(1, 2)  # (B, H, T, dn + dr)
        q_nope, q_pe = q.split([dn, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj(x).split([r, self.rope_dim], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(1), *rope)  # (B, 1, T, dr)
        latent = torch.cat((self.kv_a_norm(c_kv).unsqueeze(1), k_pe), dim=-1)  # (B, 1, T, r + dr)
        if past is not None:
            latent = torch.cat((past[0], latent), dim=2)  # (B, 1, L, r + dr)

        w = self.kv_b_proj.weight.view(H, dn + dv, r)  # per head: rows [W_UK (dn) | W_UV (dv)] over the latent
        q_lat = torch.matmul(q_nope, w[:, :dn])  # (B, H, T, dn) @ (H, dn, r) -> (B, H, T, r)
        q_full = torch.cat((q_lat, apply_rope(q_pe, *rope)), dim=-1) * self.scale  # (B, H, T, r + dr)

        # One K/V "head" shared by all H query heads: fold the heads into the query rows (one matmul over the
        # cache instead of H), then back to (B, H, T, L) for the mask and the softmax in float32.
        L = latent.shape[2]
        scores = torch.matmul(q_full.reshape(B, 1, H * T, r + self.rope_dim), latent.transpose(-1, -2))
        scores = scores.float().view(B, H, T, L).masked_fill(~mask, MASK_VALUE)
        probs = self.attn_dropout(torch.softmax(scores, dim=-1)).to(latent.dtype)
        # values are the latent's first r features: multiply by the whole latent and drop the RoPE part of the
        # (small) result, rather than slicing (copying) the cache
        out = torch.matmul(probs.view(B, 1, H * T, L), latent)[..., :r].view(B, H, T, r)
        out = torch.matmul(out, w[:, dn:].transpose(1, 2))  # (B, H, T, r) @ (H, r, dv) -> (B, H, T, dv)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * dv)), (latent,)
