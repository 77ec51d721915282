"""Position schemes: RoPE (with its frequency scalings), ALiBi, learned and sinusoidal embeddings.

RoPE and ALiBi act inside attention (RoPE rotates q and k, ALiBi biases the
scores); learned and sinusoidal positions are added to the embeddings. All of
them are computed from position ids or the attention mask, so a left-padded
row gets exactly the positions it would get alone.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class Float32Tables(nn.Module):
    """A module whose floating buffers are tables computed in float32 (RoPE's inverse frequencies, ALiBi's
    slopes): they stay float32 when the model is cast to float16 or bfloat16 (moved to another device, they
    keep their values), as transformers keeps them. Rounded to float16, RoPE's inverse frequencies turn a
    key at position 1000 by up to ~0.5 rad more or less than the model was trained with (2^-11 relative on
    an angle of up to 1000 rad); its angles are computed in float32 from them either way."""

    float32_tables = True  # model_defs/weights.py's casts of skeletons leave these buffers alone too

    def _apply(self, fn, recurse=True):
        kept = {name: b for name, b in self.named_buffers(recurse=False) if b.is_floating_point()}
        out = super()._apply(fn, recurse)
        for name, b in kept.items():
            setattr(self, name, b.to(device=getattr(self, name).device))
        return out


# --- RoPE ---------------------------------------------------------------------
def _rope_powers(rotary_dim: int, theta: float) -> torch.Tensor:
    """theta^(2i/rot) for i < rot/2: the inverse of RoPE's unscaled frequencies."""
    return theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/rot) for i < rot/2, with the given scaling (not longrope: see LongRope)."""
    inv_freq = 1.0 / _rope_powers(rotary_dim, theta)
    if scaling is None:
        return inv_freq
    if scaling["type"] == "linear":  # position interpolation: positions / factor
        return inv_freq / scaling["factor"]
    if scaling["type"] == "yarn":
        return _yarn_inv_freq(inv_freq, rotary_dim, theta, scaling)
    if scaling["type"] != "llama3":  # longrope switches between two sets of frequencies: LongRope
        raise ValueError(f"rope_inv_freq computes no {scaling['type']!r} scaling")
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


def _yarn_inv_freq(inv_freq: torch.Tensor, rotary_dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated
    (divided by factor), those that turn more than beta_fast times are kept, with a linear ramp in between."""
    factor, original = s["factor"], s["original_max_seq_len"]

    def correction_dim(rotations: float) -> float:  # the dimension whose frequency turns `rotations` times
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast", 32.0)), correction_dim(s.get("beta_slow", 1.0))
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep), 0: interpolate
    return (1.0 / (factor * _rope_powers(rotary_dim, theta))) * (1 - keep) + inv_freq * keep  # in transformers' order of operations


def _yarn_attention_factor(scaling: dict[str, Any] | None) -> float:
    """YaRN scales cos and sin (so q.k by its square): attention_factor, or 0.1 ln(factor) + 1."""
    if scaling is None or scaling["type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 1.0 if scaling["factor"] <= 1 else 0.1 * math.log(scaling["factor"]) + 1.0


class RotaryEmbedding(Float32Tables):
    """RoPE with real cos/sin computed from position ids (no table to outgrow).

    Its base and scaling are the config's `rope_theta` and `rope_scaling`, or
    with local=True the windowed layers' own (Gemma 3: `local_rope_theta`,
    `local_rope_scaling`).
    """

    def __init__(self, cfg: ModelConfig, local: bool = False):
        super().__init__()
        self.rotary_dim = cfg.rotary_dim
        theta, scaling = (cfg.local_rope_theta, cfg.local_rope_scaling) if local else (cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rotary_dim, theta, scaling), persistent=False)
        self.attention_factor = _yarn_attention_factor(scaling)
        self.mrope_section = None if local else cfg.mrope_section

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: (B, T) -> cos, sin: (B, T, rotary_dim), float32; multimodal RoPE: (B, 3, T), each section
        # of the frequencies turned by its own stream (Qwen2-VL's time, height, width)
        freqs = position_ids[..., None].float() * self.inv_freq
        if position_ids.dim() == 3:
            parts = freqs.split(list(self.mrope_section), dim=-1)
            freqs = torch.cat([part[:, i % 3] for i, part in enumerate(parts)], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return emb.cos(), emb.sin()


class LongRope(Float32Tables):
    """Phi-3's LongRoPE: per-frequency divisors, `short_factor` while the batch's positions stay within the
    original context and `long_factor` beyond it, and cos/sin scaled by the attention factor.

    As transformers: the choice is made per forward call from the largest position id in the batch.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        s = cfg.rope_scaling
        self.rotary_dim = cfg.rotary_dim
        self.original = int(s["original_max_seq_len"])
        powers = _rope_powers(cfg.rotary_dim, cfg.rope_theta)
        for name in ("short", "long"):  # 1 / (factor * theta^(2i/rot)), in transformers' order of operations
            factors = torch.tensor(s[f"{name}_factor"], dtype=torch.float32)
            self.register_buffer(f"{name}_inv_freq", 1.0 / (factors * powers), persistent=False)
        self.attention_factor = float(s["attention_factor"])

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        long = position_ids.max() + 1 > self.original  # 0-d bool: a Where in the graph, no branch
        inv_freq = torch.where(long, self.long_inv_freq, self.short_inv_freq)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor


def build_rope(cfg: ModelConfig, local: bool = False) -> nn.Module:
    """The RoPE of full-attention layers, or (local=True) of windowed layers when they have their own base."""
    if not local and cfg.rope_scaling is not None and cfg.rope_scaling["type"] == "longrope":
        return LongRope(cfg)
    return RotaryEmbedding(cfg, local)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim features of x: (B, heads, T, D) by cos/sin: (B, T, rot).

    The half-split layout (rotate_half) is the one Hugging Face Llama-family
    checkpoints are stored for, so their q/k weights need no permutation;
    checkpoints made for interleaved pairs (GPT-J, Cohere) get their q/k rows
    permuted at import (hf.py), which computes the same scores.
    """
    rot = cos.shape[-1]
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    if rot == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)


# --- ALiBi --------------------------------------------------------------------
def alibi_slopes(n_heads: int) -> torch.Tensor:
    """BLOOM's head slopes: a geometric sequence 2^(-8/n), 2^(-16/n), ... for the largest power of two
    n <= n_heads, then every other slope of the sequence for 2n heads for the remaining heads."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** k for k in range(1, closest + 1)]
    if closest != n_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        remaining = min(closest, n_heads - closest)
        slopes += [extra_base ** k for k in range(1, 2 * remaining, 2)]
    return torch.tensor(slopes, dtype=torch.float32)


class Alibi(Float32Tables):
    """Attention-score biases slope_h * (key position - query position), float32 (B, H, T, S).

    Positions count real tokens (the attention mask's cumulative sum), as BLOOM
    computes them, so left padding does not shift them. BLOOM adds
    slope * key_position; subtracting the query's position changes each score
    row by a constant, which softmax ignores, and keeps the biases small (exact
    in FP16 graphs too). `alibi_scale` multiplies the slopes (Falcon adds the
    bias before scaling the scores by 1/sqrt(head_dim)).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(cfg.n_heads) * cfg.alibi_scale, persistent=False)

    def forward(self, attention_mask: torch.Tensor, seq: int) -> torch.Tensor:
        # (B, S); summed in float32 (exact below 2^24): TensorRT's CumSum takes no integers
        pos = (attention_mask.float().cumsum(-1) - 1).clamp(min=0)
        rel = pos[:, None, :] - pos[:, -seq:, None]  # (B, T, S): key - query
        return self.slopes[None, :, None, None] * rel[:, None]


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 (to nearest even), kept in float32."""
    return x.to(torch.bfloat16).float()


class FalconAlibi(Float32Tables):
    """Falcon's ALiBi as transformers computes it, whatever the model dtype: bf16(bf16(slope) * bf16(key position)),
    times alibi_scale; (B, H, 1, S), the same for every query. The rounding makes the biases depend on absolute
    positions, so they are not made relative as in `Alibi`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("slopes", _bf16(alibi_slopes(cfg.n_heads)), persistent=False)
        self.scale = cfg.alibi_scale

    def forward(self, attention_mask: torch.Tensor, seq: int) -> torch.Tensor:
        mask = attention_mask.float()
        pos = _bf16((mask.cumsum(-1) - 1) * mask)  # (B, S); padding keys at 0
        return (_bf16(self.slopes[None, :, None] * pos[:, None, :]) * self.scale)[:, :, None, :]


def build_alibi(cfg: ModelConfig) -> nn.Module:
    return FalconAlibi(cfg) if cfg.alibi_bf16 else Alibi(cfg)


# --- absolute positions added to the embeddings --------------------------------
class LearnedPositions(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.max_seq_len, cfg.dim))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(position_ids, self.weight)  # (B, T, C)


class SinusoidalPositions(Float32Tables):
    """sin/cos of position * 10000^(-2i/C), interleaved as in the original Transformer."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv = torch.exp(torch.arange(0, cfg.dim, 2, dtype=torch.float32) * (-math.log(10000.0) / cfg.dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        angles = position_ids[..., None].float() * self.inv_freq  # (B, T, C/2)
        return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (B, T, C)


# --- T5's relative position buckets ------------------------------------------------
def relative_position_bucket(relative: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucket of each key - query distance: exact buckets for the nearest distances, logarithmic ones up to
    max_distance, one bucket beyond. Bidirectional (the encoder) splits the buckets between keys before and
    after the query; causal (the decoder) has only keys before it.

    Computed on float32 (integers below 2**24 are exact), the type TensorRT's Clip, Abs and Where take."""
    rel = relative.float()
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).float() * num_buckets
        distance = rel.abs()
    else:
        distance = (-rel).clamp(min=0)
    max_exact = num_buckets // 2
    # the log runs on distances >= max_exact only (the others take the exact branch), so it never sees log(0)
    far = distance.clamp(min=max_exact)
    large = max_exact + torch.floor(torch.log(far / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    large = large.clamp(max=num_buckets - 1)
    return (buckets + torch.where(distance < max_exact, distance, large)).to(torch.int64)


class RelativePositionBias(nn.Module):
    """A learned bias per head and distance bucket, added to the attention scores: (1, H, T, S) float32 for T
    queries at positions past..past+T-1 over S keys at 0..S-1. One table serves every layer of a stack (T5
    computes it in the first layer and passes it on)."""

    def __init__(self, n_heads: int, num_buckets: int, max_distance: int, bidirectional: bool):
        super().__init__()
        self.bias = nn.Embedding(num_buckets, n_heads)
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional

    def forward(self, queries: int, keys: int, past: int | torch.Tensor = 0) -> torch.Tensor:
        device = self.bias.weight.device
        q = torch.arange(queries, device=device)[:, None] + past
        k = torch.arange(keys, device=device)[None, :]
        buckets = relative_position_bucket(k - q, self.bidirectional, self.num_buckets, self.max_distance)
        return self.bias(buckets).permute(2, 0, 1).unsqueeze(0).float()
