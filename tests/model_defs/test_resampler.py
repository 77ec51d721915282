"""The Perceiver resampler (model_defs/resampler.py) against two oracles that are not kvforge: the notes'
Latent Transformer Block written out here with plain tensor operations, and transformers' Idefics2 resampler."""

from __future__ import annotations

import math

import pytest
import torch

from kvforge.errors import KvforgeError
from kvforge.model_defs.hf_vision import resampler_table
from kvforge.model_defs.resampler import Resampler, ResamplerConfig

ATOL = 1e-5


def _perturbed(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen) + (1.0 if p.ndim == 1 else 0.0))
    return module.eval()


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _attention(q_in, kv_in, proj, heads, head_dim, mask=None):
    """softmax(q k^T / sqrt(d)) v over heads, with the layer's projections (q_proj, k_proj, v_proj, o_proj)."""
    N, M, _ = q_in.shape
    q = (q_in @ proj.q_proj.weight.T).view(N, M, heads, head_dim).transpose(1, 2)
    k = (kv_in @ proj.k_proj.weight.T).view(N, -1, heads, head_dim).transpose(1, 2)
    v = (kv_in @ proj.v_proj.weight.T).view(N, -1, heads, head_dim).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return out.transpose(1, 2).reshape(N, M, heads * head_dim) @ proj.o_proj.weight.T


def _swiglu(x, ffn):
    return (torch.nn.functional.silu(x @ ffn.gate_proj.weight.T) * (x @ ffn.up_proj.weight.T)) @ ffn.down_proj.weight.T


@torch.no_grad()
def test_the_cross_then_self_form_is_the_notes_latent_transformer_block():
    """z = z + CrossAttention(norm(z), norm(x)); z = z + FFN(norm(z)); z = z + SelfAttention(norm(z));
    z = z + FFN(norm(z)); then a final norm: written out here, on the module's own weights."""
    cfg = ResamplerConfig(dim=24, n_latents=5, n_layers=2, n_heads=3, head_dim=8, ffn_dim=40, form="cross_then_self")
    model = _perturbed(Resampler(cfg), seed=0)
    x = torch.randn(2, 11, 24, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 7:] = False  # the second image has 7 real features
    eps = cfg.norm_eps
    z = model.latents.expand(2, -1, -1)
    for layer in model.layers:
        c, s = layer.cross, layer.latent
        z = z + _attention(_rms(z, c.latent_norm.weight, eps), _rms(x, c.input_norm.weight, eps), c.attn, 3, 8, mask)
        z = z + _swiglu(_rms(z, c.ffn_norm.weight, eps), c.ffn)
        h = _rms(z, s.attn_norm.weight, eps)
        z = z + _attention(h, h, s.attn, 3, 8)
        z = z + _swiglu(_rms(z, s.ffn_norm.weight, eps), s.ffn)
    expected = _rms(z, model.norm.weight, eps)
    got = model(x, mask)
    assert got.shape == (2, 5, 24)
    assert (got - expected).abs().max() < ATOL
    padded = x.clone()
    padded[1, 7:] = 100.0  # what sits behind the mask does not matter
    assert (model(padded, mask) - got).abs().max() < ATOL


@torch.no_grad()
def test_the_joint_form_is_idefics2s_resampler():
    from transformers.models.idefics2.configuration_idefics2 import Idefics2PerceiverConfig
    from transformers.models.idefics2.modeling_idefics2 import Idefics2PerceiverResampler

    hf_cfg = Idefics2PerceiverConfig(hidden_size=32, hidden_act="silu", resampler_n_latents=6, resampler_depth=3,
                                     resampler_n_heads=4, resampler_head_dim=8, num_key_value_heads=2, rms_norm_eps=1e-6)
    hf_cfg._attn_implementation = "eager"
    hf = _perturbed(Idefics2PerceiverResampler(hf_cfg), seed=2)
    cfg = ResamplerConfig(dim=32, n_latents=6, n_layers=3, n_heads=4, head_dim=8, n_kv_heads=2, ffn_dim=128)
    ours = Resampler(cfg).eval()
    theirs = hf.state_dict()
    ours.load_state_dict({k: theirs[v] for k, (v, _) in resampler_table(3, "").items()})
    x = torch.randn(3, 13, 32, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(3, 13, dtype=torch.int64)
    mask[2, 9:] = 0
    expected = hf(context=x, attention_mask=mask)
    assert (ours(x, mask) - expected).abs().max() < ATOL
    assert (ours(x) - hf(context=x, attention_mask=torch.ones_like(mask))).abs().max() < ATOL


def test_bad_resampler_configs_are_named():
    with pytest.raises(KvforgeError, match="n_heads=4 is not a multiple of n_kv_heads=3"):
        ResamplerConfig(dim=8, n_latents=2, n_layers=1, n_heads=4, head_dim=2, ffn_dim=8, n_kv_heads=3)
    with pytest.raises(KvforgeError, match="form='gated' is not one of"):
        ResamplerConfig(dim=8, n_latents=2, n_layers=1, n_heads=4, head_dim=2, ffn_dim=8, form="gated")
