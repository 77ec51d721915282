"""The reference model across the design space: every preset, cache, padding, components."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvforge.errors import KvforgeError
from kvforge.model_defs import PRESETS, ModelConfig, build_model, init_random_weights, load
from kvforge.model_defs.positions import RotaryEmbedding, SinusoidalPositions, apply_rope

MICRO = sorted(n for n in PRESETS if n.endswith("-micro"))
ATOL = 1e-4  # same code path, different batching/caching: float32 rounding only (logits ~10)


def _model(name_or_cfg, seed=0):
    cfg = ModelConfig.from_name(name_or_cfg) if isinstance(name_or_cfg, str) else name_or_cfg
    return init_random_weights(build_model(cfg), seed)


def _ids(batch, seq, vocab, seed=0):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", MICRO)
@torch.no_grad()
def test_io_contract_shapes_and_dtypes(name):
    model = _model(name)
    cfg = model.config
    logits, present = model(_ids(3, 5, cfg.vocab_size))
    assert logits.shape == (3, 5, cfg.vocab_size) and logits.dtype == torch.float32
    assert len(present) == cfg.n_layers
    for i, tensors in enumerate(present):  # (key, value) per KV head, or latent attention's one latent
        assert [t.shape for t in tensors] == [(3, heads, 5, dim) for _, heads, dim in cfg.cache_entries(i)]
    logits, present = model(_ids(3, 1, cfg.vocab_size, 1), past_key_values=present)
    assert logits.shape == (3, 1, cfg.vocab_size) and present[0][0].shape[2] == 6


@pytest.mark.parametrize("name", MICRO)
@torch.no_grad()
def test_cached_decode_equals_full_forward(name):
    """Prefill 4 then decode one token at a time (past > sliding windows) == one full forward."""
    model = _model(name)
    ids = _ids(2, 20, model.config.vocab_size, seed=1)
    full, _ = model(ids)
    logits, past = model(ids[:, :4])
    steps = [logits]
    for t in range(4, 20):
        # the mask tells the past length: a capped (windowed) cache no longer does
        mask = torch.ones(2, t + 1, dtype=torch.int64)
        logits, past = model(ids[:, t : t + 1], attention_mask=mask, past_key_values=past)
        steps.append(logits)
        for i, tensors in enumerate(past):
            window = model.config.layer_window(i)
            assert {x.shape[2] for x in tensors} == {t + 1 if window is None else min(t + 1, window)}
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", MICRO)
@torch.no_grad()
def test_logits_to_keep_gives_the_last_positions_logits_and_the_same_cache(name):
    """logits_to_keep=k (transformers' argument: validation's prefills that only fill the cache use k=1): the
    full forward's last k positions' logits, and the very same present."""
    model = _model(name)
    ids = _ids(2, 9, model.config.vocab_size, seed=2)
    full, present = model(ids)
    for k in (1, 3):
        logits, kept = model(ids, logits_to_keep=k)
        assert logits.shape == (2, k, model.config.vocab_size)
        torch.testing.assert_close(logits, full[:, -k:], atol=1e-5, rtol=0)
        assert all(torch.equal(a, b) for pa, pb in zip(present, kept) for a, b in zip(pa, pb))


@pytest.mark.parametrize("name", MICRO)
@torch.no_grad()
def test_left_padded_rows_match_rows_alone(name):
    model = _model(name)
    vocab = model.config.vocab_size
    lengths = [11, 7, 3]
    rows = [_ids(1, n, vocab, seed=i)[0] for i, n in enumerate(lengths)]
    T = max(lengths)
    ids = torch.zeros(3, T, dtype=torch.int64)
    mask = torch.zeros(3, T, dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, T - len(row):] = row
        mask[i, T - len(row):] = 1
    batched, past = model(ids, attention_mask=mask)  # position ids derived from the mask
    nxt = _ids(3, 1, vocab, seed=9)
    mask2 = torch.cat([mask, torch.ones(3, 1, dtype=torch.int64)], dim=1)
    step, _ = model(nxt, attention_mask=mask2, past_key_values=past)
    for i, row in enumerate(rows):
        alone, _ = model(torch.cat([row, nxt[i]])[None])
        torch.testing.assert_close(batched[i, T - len(row):], alone[0, :-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(step[i, 0], alone[0, -1], atol=ATOL, rtol=0)
        assert torch.isfinite(batched[i]).all(), "padding rows must stay finite (no NaN leaking into the cache)"


@torch.no_grad()
def test_sliding_window_limits_what_a_query_sees():
    cfg = ModelConfig.from_name("mistral-micro")  # window 8
    windowed = _model(cfg)
    full = _model(ModelConfig(**{**cfg.to_dict(), "sliding_window": None}))
    ids = _ids(1, 20, cfg.vocab_size)
    a, _ = windowed(ids)
    b, _ = full(ids)
    # identical while the context fits in the window, different once it does not
    torch.testing.assert_close(a[:, :8], b[:, :8], atol=ATOL, rtol=0)
    assert (a[:, 8:] - b[:, 8:]).abs().amax() > 1e-3
    # a token more than `window` back cannot influence the output at all
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 1) % cfg.vocab_size
    c, _ = windowed(changed)
    torch.testing.assert_close(a[:, 15:], c[:, 15:], atol=ATOL, rtol=0)  # 2 layers x 7 back < 15
    assert (a[:, :8] - c[:, :8]).abs().amax() > 1e-4


@torch.no_grad()
def test_gqa_and_mqa_equal_mha_with_repeated_kv_heads():
    """GQA/MQA is MHA whose K/V heads are shared: repeating the K/V weights per group gives MHA."""
    for kv in (1, 2):
        gqa = _model(ModelConfig(**{**ModelConfig.from_name("llama3-micro").to_dict(), "n_kv_heads": kv}))
        cfg = gqa.config
        mha = build_model(ModelConfig(**{**cfg.to_dict(), "n_kv_heads": cfg.n_heads}))
        state = gqa.state_dict()
        group = cfg.n_heads // kv
        for name in list(state):
            if name.endswith(("k_proj.weight", "v_proj.weight")):
                w = state[name].view(kv, cfg.head_dim, cfg.dim)
                state[name] = w.repeat_interleave(group, dim=0).reshape(cfg.n_heads * cfg.head_dim, cfg.dim)
        mha.load_state_dict(state)
        ids = _ids(2, 9, cfg.vocab_size)
        torch.testing.assert_close(gqa.eval()(ids)[0], mha.eval()(ids)[0], atol=ATOL, rtol=0)
        assert gqa(ids)[1][0][0].shape[1] == kv


@torch.no_grad()
def test_softmax_is_stable_for_huge_scores():
    model = _model("llama3-micro")
    for layer in model.layers:
        layer.attn.q_proj.weight.mul_(1e4)  # scores ~1e4: exp() would overflow without the max shift
    logits, present = model(_ids(1, 6, model.config.vocab_size))
    assert torch.isfinite(logits).all()


def test_dropout_is_identity_at_inference():
    cfg = ModelConfig(**{**ModelConfig.from_name("gpt2-micro").to_dict(), "dropout": 0.5})
    model = _model(cfg)
    plain = build_model(ModelConfig.from_name("gpt2-micro"))
    plain.load_state_dict(model.state_dict())
    ids = _ids(1, 8, cfg.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids)[0], plain.eval()(ids)[0], atol=0, rtol=0)
    model.train()
    assert not torch.equal(model(ids)[0], model(ids)[0])  # dropout really is in the graph when training


def test_tied_and_untied_embeddings():
    tied = _model("gpt2-micro")
    assert tied.lm_head.weight.data_ptr() == tied.embed.weight.data_ptr()
    untied = _model("llama3-micro")
    assert untied.lm_head.weight.data_ptr() != untied.embed.weight.data_ptr()
    assert tied.num_parameters() == sum(p.numel() for n, p in tied.named_parameters())


def test_rope_scores_depend_only_on_relative_offset():
    cfg = ModelConfig.from_name("llama3-micro")
    rope = RotaryEmbedding(cfg)
    q, k = torch.randn(1, 1, 1, cfg.head_dim), torch.randn(1, 1, 1, cfg.head_dim)

    def score(m, n):
        qc, qs = rope(torch.tensor([[m]]))
        kc, ks = rope(torch.tensor([[n]]))
        return (apply_rope(q, qc, qs) * apply_rope(k, kc, ks)).sum().item()

    assert score(7, 3) == pytest.approx(score(104, 100), abs=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), abs=1e-3)


def test_partial_rotary_leaves_the_tail_untouched():
    cfg = ModelConfig.from_name("geglu-micro")  # head_dim 24, rotary_fraction 0.5
    cos, sin = RotaryEmbedding(cfg)(torch.tensor([[0, 5, 9]]))
    assert cos.shape[-1] == cfg.rotary_dim == 12
    x = torch.randn(1, 2, 3, cfg.head_dim)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y[..., 12:], x[..., 12:], atol=0, rtol=0)
    torch.testing.assert_close(y[..., :12].norm(dim=-1), x[..., :12].norm(dim=-1))  # a rotation
    assert not torch.allclose(y[:, :, 1:, :12], x[:, :, 1:, :12])


def test_sinusoidal_positions_follow_the_formula():
    cfg = ModelConfig.from_name("classic-micro")
    pe = SinusoidalPositions(cfg)(torch.arange(50)[None])[0]
    pos, i = 37, 5
    assert pe[pos, 2 * i].item() == pytest.approx(math.sin(pos / 10000 ** (2 * i / cfg.dim)), abs=1e-5)
    assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(pos / 10000 ** (2 * i / cfg.dim)), abs=1e-5)


@pytest.mark.parametrize("placement,activation", [("post", "relu"), ("pre", "gelu")])
@torch.no_grad()
def test_blocks_match_torch_transformer_encoder_layer(placement, activation):
    """An independent oracle for LayerNorm blocks: torch.nn.TransformerEncoderLayer with a causal
    mask is a pre-norm (norm_first) or post-norm MHA + two-layer MLP block."""
    cfg = ModelConfig(
        vocab_size=50, dim=32, n_layers=2, n_heads=4, ffn_dim=64, position="none", norm="layernorm",
        norm_placement=placement, final_norm=False, activation=activation, gated_ffn=False,
        qkv_bias=True, out_bias=True, ffn_bias=True,
    )
    model = _model(cfg)
    x = torch.randn(2, 7, cfg.dim)
    mask = torch.ones(2, 7, dtype=torch.int64)
    from kvforge.model_defs.layers import attention_mask_bool

    m = attention_mask_bool(mask, 0, 7, None)
    for block in model.layers:
        ref = torch.nn.TransformerEncoderLayer(
            cfg.dim, cfg.n_heads, cfg.ffn_dim, dropout=0.0, activation=activation, batch_first=True,
            norm_first=placement == "pre", layer_norm_eps=cfg.norm_eps,
        ).eval()
        a = block.attn
        ref.self_attn.in_proj_weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        ref.self_attn.in_proj_bias.copy_(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
        ref.self_attn.out_proj.weight.copy_(a.o_proj.weight)
        ref.self_attn.out_proj.bias.copy_(a.o_proj.bias)
        ref.linear1.weight.copy_(block.ffn.up_proj.weight)
        ref.linear1.bias.copy_(block.ffn.up_proj.bias)
        ref.linear2.weight.copy_(block.ffn.down_proj.weight)
        ref.linear2.bias.copy_(block.ffn.down_proj.bias)
        for src, dst in ((block.attn_norm, ref.norm1), (block.ffn_norm, ref.norm2)):
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(7)
        expected = ref(x, src_mask=causal, is_causal=True)
        got, _ = block(x, m, None, None)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        x = expected


@pytest.mark.parametrize("act,fn", [("silu", F.silu), ("gelu", F.gelu), ("relu", F.relu)])
@torch.no_grad()
def test_gated_ffn_formula(act, fn):
    """SwiGLU / GeGLU / ReGLU: down(act(gate x) * up x)."""
    cfg = ModelConfig(vocab_size=20, dim=16, n_layers=1, n_heads=2, ffn_dim=24, activation=act, gated_ffn=True)
    ffn = _model(cfg).layers[0].ffn
    x = torch.randn(3, 16)
    expected = (fn(x @ ffn.gate_proj.weight.T) * (x @ ffn.up_proj.weight.T)) @ ffn.down_proj.weight.T
    torch.testing.assert_close(ffn(x), expected)


def test_rmsnorm_and_layernorm_compute_in_float32_for_half_inputs():
    for name in ("llama3-micro", "gpt2-micro"):
        model = _model(name)
        norm = model.layers[0].attn_norm
        x = torch.randn(2, 3, model.config.dim) * 300  # squares overflow FP16 (> 65504)
        ref = norm(x)
        got = norm.half()(x.half())
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"n_kv_heads": 3}, "multiple of n_kv_heads"),
        ({"position": "xpos"}, "position='xpos'"),
        ({"block": "parallel", "norm_placement": "post"}, "norm_placement must be 'pre'"),
        ({"qk_norm": "layer"}, "qk_norm='layer'"),
        ({"sliding_window": 1}, "sliding_window must be an integer >= 2"),
        ({"local_rope_theta": 10000.0}, "needs position='rope' and a sliding_window"),
        ({"logit_scale": 0.0}, "logit_scale must be a finite non-zero number"),
        ({"attn_softcap": -5.0}, "attn_softcap must be a positive number"),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8,
                           "original_max_seq_len": 64, "attention_factor": 1.1}}, "short_factor has 3 factors"),
        ({"activation": "tanh"}, "activation='tanh'"),
        ({"dim": 65, "head_dim": None}, "not divisible"),
        ({"rotary_fraction": 0.1}, "rotary dimension"),
        ({"rope_scaling": {"type": "dynamic"}}, "rope_scaling type 'dynamic'"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, r"lacks \['original_max_seq_len'\]"),
        ({"sliding_window_layers": [5]}, "outside"),
        ({"eos_token_id": 9999}, "outside the vocabulary"),
    ],
)
def test_invalid_configs_are_named(change, match):
    base = ModelConfig.from_name("llama3-micro").to_dict()
    with pytest.raises(KvforgeError, match=match):
        ModelConfig(**{**base, **change})


def test_presets_load_in_eval_mode_with_a_tokenizer():
    model, tok = load("gpt2-micro")
    assert not model.training and tok is not None and tok.vocab_size <= model.config.vocab_size
    with pytest.raises(KvforgeError, match="unknown preset"):
        ModelConfig.from_name("gpt5")
