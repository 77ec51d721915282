"""The decoder-only transformer, assembled from components by `build_model`.

forward(input_ids, attention_mask=None, position_ids=None, past_key_values=None)
    -> (logits, present_key_values)

with the tensors of docs/design.md's KV-cache IO contract:
    input_ids        int64  (B, T)
    attention_mask   int64  (B, P + T)   1 = real token, 0 = padding (left)
    position_ids     int64  (B, T)       default: count of real tokens before each one
    past_key_values  n_layers x (key, value), each (B, KV, P_i, D) in the model dtype
    logits           float32 (B, T, vocab)
    present          n_layers x (key, value), each (B, KV, P_i + T, D)

A latent-attention layer (DeepSeek's MLA: mla.py) caches one tensor instead of a pair: (latent,), (B, 1, P, r + dr)
(ModelConfig.cache_entries says what each layer's cache holds).

P_i is the past length P for full-attention layers; a layer with a sliding
window W keeps a capped cache of the last min(P, W) positions, and its present
holds min(P + T, W) (a rolling buffer: see layers.Attention).

The blocks: `Block` (a residual branch for attention, then one for the FFN,
each normalized before (pre-norm), before and after (sandwich: Gemma 2/3) or
after (OLMo 2) the sublayer), `PostNormBlock` (the original Transformer:
norm(x + f(x))) and `ParallelBlock` (attention and FFN read the same input and
add to one residual: GPT-J, GPT-NeoX, Falcon, Cohere).
"""

from __future__ import annotations

import torch
from torch import nn

from kvforge.errors import KvforgeError

from .config import ModelConfig
from .layers import Attention, GatedMLP, attention_mask_bool, build_ffn, build_norm, build_qk_norms
from .mla import LatentAttention
from .moe import MoE, Experts, Router
from .positions import LearnedPositions, SinusoidalPositions, build_alibi, build_rope

KVCache = tuple[tuple[torch.Tensor, ...], ...]  # per layer: (key, value), or (latent,)


def _norm_or_identity(cfg: ModelConfig, present: bool) -> nn.Module:
    return build_norm(cfg) if present else nn.Identity()


class Block(nn.Module):
    """x + s * out_norm(attn(in_norm(x))), then the same for the FFN; s = residual_scale (Granite).

    pre-norm: in norms only; sandwich (Gemma 2/3): in and out norms; output
    (OLMo 2): out norms only. An absent norm is the identity.
    """

    def __init__(self, cfg: ModelConfig, attn: nn.Module, ffn: nn.Module):
        super().__init__()
        norm_in = cfg.norm_placement in ("pre", "sandwich")
        norm_out = cfg.norm_placement in ("sandwich", "output")
        self.attn_norm = _norm_or_identity(cfg, norm_in)
        self.attn = attn
        self.attn_out_norm = _norm_or_identity(cfg, norm_out)
        self.ffn_norm = _norm_or_identity(cfg, norm_in)
        self.ffn = ffn
        self.ffn_out_norm = _norm_or_identity(cfg, norm_out)
        self.residual_scale = cfg.residual_scale
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def _residual(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = self.resid_dropout(h)
        return x + (h * self.residual_scale if self.residual_scale != 1.0 else h)

    def forward(self, x, mask, rope, past, bias=None):
        h, present = self.attn(self.attn_norm(x), mask, rope, past, bias)
        x = self._residual(x, self.attn_out_norm(h))
        return self._residual(x, self.ffn_out_norm(self.ffn(self.ffn_norm(x)))), present


class PostNormBlock(nn.Module):
    """The original Transformer's layer: norm(x + attn(x)), then norm(x + ffn(x))."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module, ffn: nn.Module):
        super().__init__()
        self.attn_norm = build_norm(cfg)
        self.attn = attn
        self.ffn_norm = build_norm(cfg)
        self.ffn = ffn
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, mask, rope, past, bias=None):
        h, present = self.attn(x, mask, rope, past, bias)
        x = self.attn_norm(x + self.resid_dropout(h))
        return self.ffn_norm(x + self.resid_dropout(self.ffn(x))), present


class ParallelBlock(nn.Module):
    """x + attn(norm(x)) + ffn(norm'(x)): one shared norm (GPT-J, Falcon-7B, Cohere: norm' = norm) or
    two (GPT-NeoX, Falcon-40B: `ffn_norm`)."""

    def __init__(self, cfg: ModelConfig, attn: nn.Module, ffn: nn.Module):
        super().__init__()
        self.attn_norm = build_norm(cfg)
        self.attn = attn
        self.ffn_norm = build_norm(cfg) if cfg.block == "parallel_two_norms" else None
        self.ffn = ffn
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, mask, rope, past, bias=None):
        h = self.attn_norm(x)
        a, present = self.attn(h, mask, rope, past, bias)
        f = self.ffn(self.ffn_norm(x) if self.ffn_norm is not None else h)
        return x + self.resid_dropout(a + f), present


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, blocks: list[nn.Module], positions: nn.Module | None,
                 rope: nn.Module | None, local_rope: nn.Module | None, alibi: nn.Module | None):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.positions = positions  # added to the embeddings (learned, sinusoidal)
        self.embed_norm = build_norm(cfg) if cfg.embed_norm else None  # BLOOM: a norm on the embeddings
        self.rope = rope  # rotates q and k inside attention
        self.local_rope = local_rope  # the windowed layers' own RoPE (Gemma 3), else None
        self.alibi = alibi  # biases the attention scores
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(blocks)
        self.norm = build_norm(cfg) if cfg.final_norm else None
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=cfg.lm_head_bias)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # Per layer: its sliding window (None = full causal); one mask is built per distinct window.
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
        inputs_embeds: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
        logits_to_keep: int | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        """inputs_embeds (B, T, C): the embeddings to start from instead of embed(input_ids) (a vision-language
        model's text with its image features merged in); the embedding scale and norm still apply.
        rope_positions (B, 3, T): multimodal RoPE's three position streams (config.mrope_section), else the
        position ids rotate every section.
        logits_to_keep: the head runs on the last this many positions only (transformers' argument of that name):
        a prefill that fills the cache needs no (B, T, vocab) logits, the largest tensor of a long one."""
        cfg = self.config
        B, T = input_ids.shape
        if attention_mask is None:
            past = self.past_length(past_key_values, position_ids)
            attention_mask = torch.ones(B, past + T, dtype=torch.int64, device=input_ids.device)
        else:
            past = attention_mask.shape[-1] - T
        if position_ids is None:
            # Each real token's position is the number of real tokens before it,
            # so a left-padded row gets the positions it would have alone.
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -T:]

        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        if self.positions is not None:
            x = x + self.positions(position_ids).to(x.dtype)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x = self.embed_dropout(x)
        rope = self.rope(position_ids if rope_positions is None else rope_positions) if self.rope is not None else None
        local_rope = self.local_rope(position_ids) if self.local_rope is not None else rope
        bias = self.alibi(attention_mask, T) if self.alibi is not None else None
        masks = {w: attention_mask_bool(attention_mask, past, T, w) for w in dict.fromkeys(self._windows)}

        presents = []
        for i, layer in enumerate(self.layers):
            window = self._windows[i]
            layer_past = None if past_key_values is None else past_key_values[i]
            x, present = layer(x, masks[window], rope if window is None else local_rope, layer_past, bias)
            presents.append(present)
        if logits_to_keep is not None:
            x = x[:, -logits_to_keep:]
        if self.norm is not None:
            x = self.norm(x)
        logits = self.lm_head(x).float()  # (B, T, vocab)
        if cfg.logit_scale != 1.0:
            logits = logits * cfg.logit_scale
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits, tuple(presents)

    def past_length(self, past_key_values: KVCache | None, position_ids: torch.Tensor | None = None) -> int:
        """The past length a cache covers (no attention mask given, so no padding either).

        A full-attention layer's cache holds the whole past. When every layer is
        windowed and the caches are full, the length is no longer in the cache:
        it is read from position_ids, or the caller passes attention_mask (the
        runtime and the exported graph always do).
        """
        if past_key_values is None:
            return 0
        lengths = [kv[0].shape[2] for kv in past_key_values]
        full = [n for n, w in zip(lengths, self._windows) if w is None]
        if full:
            return full[0]
        if all(n < w for n, w in zip(lengths, self._windows)):  # no cache has reached its cap yet
            return lengths[0]
        if position_ids is not None:
            return int(position_ids.max()) + 1 - position_ids.shape[1]
        raise KvforgeError("every layer of this model keeps a capped (sliding-window) cache, which no longer tells "
                           "how long the past is: pass attention_mask (batch, past + new tokens) or position_ids")

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied weights counted once

    def empty_cache(self, batch: int) -> KVCache:
        """A past of length 0, in the model dtype, for callers that always pass a cache."""
        cfg = self.config
        dev = self.embed.weight.device
        return tuple(
            tuple(torch.zeros(batch, heads, 0, dim, dtype=self.dtype, device=dev) for _, heads, dim in cfg.cache_entries(i))
            for i in range(cfg.n_layers)
        )


def build_block(cfg: ModelConfig, layer: int) -> nn.Module:
    """One decoder layer: attention (per-head with this layer's window and q/k norms, or latent) and the FFN
    (dense, or a mixture of experts on the config's MoE layers), in the config's block."""
    if cfg.kv_lora_rank:
        attn = LatentAttention(cfg)
    else:
        attn = Attention(cfg, cfg.layer_window(layer), *build_qk_norms(cfg))
    ffn = build_moe(cfg) if cfg.is_moe_layer(layer) else build_ffn(cfg)
    if cfg.block != "sequential":
        return ParallelBlock(cfg, attn, ffn)
    if cfg.norm_placement == "post":
        return PostNormBlock(cfg, attn, ffn)
    return Block(cfg, attn, ffn)


def build_moe(cfg: ModelConfig) -> MoE:
    router = Router(cfg.dim, cfg.n_experts, cfg.experts_per_token, cfg.router_scoring, cfg.norm_topk_prob,
                    cfg.routed_scaling_factor, cfg.router_correction_bias, cfg.router_groups, cfg.router_topk_groups,
                    cfg.router_group_score)
    shared = None
    if cfg.shared_expert_ffn_dim:
        shared = GatedMLP(cfg, cfg.shared_expert_ffn_dim)
    experts = Experts([GatedMLP(cfg, cfg.expert_ffn_dim) for _ in range(cfg.n_experts)])
    return MoE(router, experts, shared, cfg.shared_expert_gate)


def build_model(cfg: ModelConfig) -> Transformer:
    """Assemble a Transformer from its config; weights are left as constructed."""
    blocks = [build_block(cfg, i) for i in range(cfg.n_layers)]
    positions = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions}.get(cfg.position)
    rope = build_rope(cfg) if cfg.position == "rope" else None
    local_rope = build_rope(cfg, local=True) if rope is not None and cfg.local_rope_theta is not None else None
    alibi = build_alibi(cfg) if cfg.position == "alibi" else None
    return Transformer(cfg, blocks, positions(cfg) if positions else None, rope, local_rope, alibi)


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
    cfg = model.config
    if getattr(cfg, "attn_scale", None) == 1.0:
        # Scores unscaled (T5): the query projections carry the 1/sqrt(head_dim), as T5 initializes them,
        # so that scores have unit variance rather than a softmax that is one-hot from the start.
        for name, p in model.named_parameters():
            if name.endswith(("attn.q_proj.weight", "cross.q_proj.weight")):
                p.mul_(cfg.head_dim ** -0.5)
    return model.eval()
