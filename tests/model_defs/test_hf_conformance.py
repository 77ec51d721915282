"""kvforge's Torch reference vs Hugging Face transformers (the oracle), per family.

Checkpoints are made locally from configs with random weights (see conftest).
Tolerance: 1e-4 max abs on FP32 logits, the issue's bound; observed ~1e-6.
"""

from __future__ import annotations

import pytest
import torch

from kvforge.model_defs import load

from ..conftest import HF_FAMILIES, HF_VARIANTS, make_hf_model

ATOL = 1e-4
VOCAB = 300


def _ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=HF_FAMILIES)
def pair(request, hf_checkpoint):
    family = request.param
    hf_model = make_hf_model(family)
    ours, _ = load(hf_checkpoint(family))
    return family, hf_model, ours


@torch.no_grad()
def test_prefill_logits_match(pair):
    _, hf_model, ours = pair
    ids = _ids(2, 13, seed=1)  # 13 > every sliding window in the configs: the window matters
    expected = hf_model(ids).logits
    got, present = ours(ids)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    cfg = ours.config
    assert len(present) == cfg.n_layers
    for i, tensors in enumerate(present):  # a windowed layer's cache is capped at its window
        window = cfg.layer_window(i)
        length = 13 if window is None else min(13, window)
        # per-head K/V: (2, kv_heads, length, head_dim) each; latent attention: one (2, 1, length, rank + rope)
        assert [t.shape for t in tensors] == [(2, heads, length, dim) for _, heads, dim in cfg.cache_entries(i)]
        if cfg.kv_lora_rank:
            assert tensors[0].shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim


@torch.no_grad()
def test_cached_decode_matches_full_recompute(pair):
    """Prefill 6 tokens, then 8 cached decode steps; each step's logits vs transformers on the whole prefix."""
    _, hf_model, ours = pair
    ids = _ids(1, 14, seed=2)
    logits, past = ours(ids[:, :6])
    torch.testing.assert_close(logits, hf_model(ids[:, :6]).logits, atol=ATOL, rtol=0)
    for t in range(6, 14):
        mask = torch.ones(1, t + 1, dtype=torch.int64)  # a capped cache does not tell the past length; the mask does
        logits, past = ours(ids[:, t : t + 1], attention_mask=mask, past_key_values=past)
        expected = hf_model(ids[:, : t + 1]).logits[:, -1:]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0, msg=f"decode step at position {t}")
    assert max(kv[0].shape[2] for kv in past) == 14 or all(ours.config.layer_window(i) for i in range(len(past)))


@torch.no_grad()
def test_left_padded_batch_of_two(pair):
    """Row 1 is left-padded by 5; both rows must get transformers' logits, prefill and two decode steps."""
    family, hf_model, ours = pair
    ids = _ids(2, 12, seed=3)
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[1, :5] = 0
    ids[1, :5] = 0  # pad token id: its value must not matter
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    got, past = ours(ids, attention_mask=mask, position_ids=positions)
    expected = hf_model(ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(got[0], expected[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(got[1, 5:], expected[1, 5:], atol=ATOL, rtol=0)
    # ... and each row equals what transformers gives it alone, unpadded
    alone = hf_model(ids[1:, 5:]).logits
    torch.testing.assert_close(got[1, 5:], alone[0], atol=ATOL, rtol=0)

    full = ids.clone()
    for step in range(2):
        nxt = torch.randint(3, VOCAB, (2, 1), generator=torch.Generator().manual_seed(10 + step))
        full = torch.cat([full, nxt], dim=1)
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.int64)], dim=1)
        logits, past = ours(nxt, attention_mask=mask, past_key_values=past)  # positions derived from the mask
        torch.testing.assert_close(logits[0, -1], hf_model(full[:1]).logits[0, -1], atol=ATOL, rtol=0)
        torch.testing.assert_close(logits[1, -1], hf_model(full[1:, 5:]).logits[0, -1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family, overrides", HF_VARIANTS, ids=[f"{f}-{'-'.join(o)}" for f, o in HF_VARIANTS])
@torch.no_grad()
def test_more_valid_configs_of_each_family(tmp_path, family, overrides):
    """Other layouts and options of the families (Falcon's four, GPT-NeoX sequential, LongRoPE, YaRN, ...):
    prefill, cached decode and a left-padded row against transformers."""
    hf_model = make_hf_model(family, **overrides)
    hf_model.save_pretrained(tmp_path)
    ours, _ = load(tmp_path)
    ids = _ids(2, 24, seed=4)  # 24 > the LongRoPE variant's original context (16): both factor sets are used
    torch.testing.assert_close(ours(ids)[0], hf_model(ids).logits, atol=ATOL, rtol=0)
    logits, past = ours(ids[:, :9])
    for t in range(9, 12):
        logits, past = ours(ids[:, t:t + 1], attention_mask=torch.ones(2, t + 1, dtype=torch.int64), past_key_values=past)
        torch.testing.assert_close(logits[:, -1], hf_model(ids[:, :t + 1]).logits[:, -1], atol=ATOL, rtol=0)
    mask = torch.ones(2, 24, dtype=torch.int64)
    mask[1, :7] = 0
    padded, _ = ours(ids, attention_mask=mask)
    torch.testing.assert_close(padded[1, 7:], hf_model(ids[1:, 7:]).logits[0], atol=ATOL, rtol=0)


# config.json as older or hand-written files hold it (save_pretrained normalizes these away): the keys
# changed, and transformers reading the same file is the reference.
RAW_CONFIGS = [
    # a top-level original_max_position_embeddings wins over rope_scaling's (llama3, yarn, longrope)
    ("llama", dict(original_max_position_embeddings=16, rope_parameters=None, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32))),
    ("qwen2", dict(original_max_position_embeddings=8, rope_parameters=None, rope_scaling=dict(type="yarn", factor=4.0))),
    # Gemma 3: nested rope_parameters lacking their bases take rope_theta and rope_local_base_freq ...
    ("gemma3_text", dict(rope_theta=500.0, rope_local_base_freq=50.0, rope_parameters=dict(
        full_attention=dict(rope_type="default"), sliding_attention=dict(rope_type="default")))),
    # ... a legacy rope_scaling merges into the full-attention layers' ...
    ("gemma3_text", dict(rope_scaling=dict(rope_type="linear", factor=4.0), rope_parameters=dict(
        full_attention=dict(rope_type="default", rope_theta=500.0), sliding_attention=dict(rope_type="default", rope_theta=50.0)))),
    # ... and without layer_types, only `sliding_window_pattern` sets the pattern (not `_sliding_window_pattern`)
    ("gemma3_text", dict(layer_types=None, _sliding_window_pattern=3)),
]


@pytest.mark.parametrize("family, edits", RAW_CONFIGS, ids=[f"{f}-{'-'.join(e)}" for f, e in RAW_CONFIGS])
@torch.no_grad()
def test_config_files_as_hubs_hold_them(tmp_path, family, edits):
    import json

    import transformers

    make_hf_model(family).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key, value in edits.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours, _ = load(tmp_path)
    ids = _ids(2, 24, seed=5)  # past every original context the edits set
    torch.testing.assert_close(ours(ids)[0], hf_model(ids).logits, atol=ATOL, rtol=0)


def test_import_maps_config(hf_checkpoint):
    """Spot-check the config tables: family quirks land in the right fields."""
    gpt2 = load(hf_checkpoint("gpt2")).model.config
    assert (gpt2.position, gpt2.norm, gpt2.activation, gpt2.gated_ffn, gpt2.tie_embeddings) == (
        "learned", "layernorm", "gelu_tanh", False, True)
    llama = load(hf_checkpoint("llama")).model.config
    assert llama.rope_scaling["type"] == "llama3" and llama.n_kv_heads == 2 and llama.rope_theta == 500000.0
    assert load(hf_checkpoint("mistral")).model.config.sliding_window == 5
    qwen = load(hf_checkpoint("qwen2")).model.config
    assert qwen.qkv_bias and not qwen.out_bias and qwen.n_kv_heads == 1
    assert [qwen.layer_window(i) for i in range(3)] == [None, 5, 5]  # max_window_layers=1


@pytest.mark.parametrize("family, overrides", [
    ("gpt2", dict(tie_word_embeddings=False)),  # an untied head: GPT2LMHeadModel writes lm_head.weight
    ("mistral", dict(attention_bias=True, mlp_bias=True)),  # transformers' Mistral has no biases whatever the config says
    ("llama", dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),  # ignored
])
@torch.no_grad()
def test_config_keys_mean_what_they_mean_in_transformers(tmp_path, family, overrides):
    hf_model = make_hf_model(family, **overrides)
    hf_model.save_pretrained(tmp_path)
    ours, _ = load(tmp_path)
    ids = _ids(1, 9, seed=3)
    torch.testing.assert_close(ours(ids)[0], hf_model(ids).logits, atol=ATOL, rtol=0)


def test_partial_rotary_with_scaled_rope_is_refused(tmp_path):
    """transformers' Llama would build tables shorter than its heads: there is no reference to match, so refuse."""
    from kvforge.errors import KvforgeError

    make_hf_model("llama", rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0,
                                                partial_rotary_factor=0.5)).save_pretrained(tmp_path)
    with pytest.raises(KvforgeError, match="partial_rotary_factor 0.5 with rope type 'linear' is not supported"):
        load(tmp_path)


def test_a_checkpoint_quantized_by_an_unread_method_is_refused_by_name(hf_checkpoint, tmp_path):
    """GGUF, GPTQ, AWQ, compressed-tensors and block FP8 keep their codes (tests/export/test_prequantized_export.py);
    a checkpoint quantized any other way (bitsandbytes' NF4 here) is refused, naming its method and those read."""
    import json
    import shutil

    from kvforge.errors import KvforgeError
    from kvforge.model_defs import load

    src = hf_checkpoint("llama")
    shutil.copytree(src, tmp_path / "nf4")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (tmp_path / "nf4" / "config.json").write_text(json.dumps(config))
    with pytest.raises(KvforgeError, match="bitsandbytes.*compressed-tensors"):
        load(tmp_path / "nf4")

@pytest.mark.parametrize("family", ["llama", "phi3", "gemma3_text", "gpt_neox", "falcon"])
def test_half_models_keep_position_tables_in_float32_as_transformers_does(hf_checkpoint, family):
    """Loaded in float16, transformers keeps RoPE's inverse frequencies (and ALiBi's slopes) in float32; so does
    kvforge's model, loaded in float16 or cast to it (rounded to float16, a key at position 1000 would turn by
    up to ~0.5 rad more or less)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_checkpoint(family), dtype=torch.float16)
    theirs = [b for name, b in hf.named_buffers() if name.endswith(("inv_freq", "slopes")) and "original" not in name]
    assert theirs and all(b.dtype == torch.float32 for b in theirs)
    for ours in (load(hf_checkpoint(family), dtype="float16").model, load(hf_checkpoint(family))[0].half()):
        assert next(ours.parameters()).dtype == torch.float16
        tables = [b for b in ours.buffers() if b.is_floating_point()]
        assert tables and all(b.dtype == torch.float32 for b in tables)
        for table in tables:  # each equals one of transformers' tables
            assert any(b.shape == table.shape and torch.allclose(b, table, rtol=1e-6, atol=0) for b in theirs), table
