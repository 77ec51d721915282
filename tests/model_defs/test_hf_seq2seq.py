"""T5 and BART checkpoints (transformers' own files) imported onto kvforge's encoder-decoder, vs transformers.

Each checkpoint is written by transformers from an off-default tiny config with seeded random weights, every
parameter (and BART's final_logits_bias buffer) perturbed, then loaded with kvforge.model_defs.load. Compared
within 1e-4: the encoder's last hidden state on a right-padded source batch (real positions), teacher-forced
decoder logits, decoding token by token from the cache against those logits, and greedy generation against
transformers' generate.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from kvforge.errors import KvforgeError  # noqa: E402
from kvforge.model_defs import load  # noqa: E402

ATOL = 1e-4
LENGTHS = (9, 5, 2)  # right padding, as tokenizers pad sources
TARGET_LEN = 7
MAX_NEW = 12

# d_kv 12 != 32 / 4; few buckets and a short max_distance, so that the longest distances share the last bucket
_T5 = dict(d_model=32, d_kv=12, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4, vocab_size=120,
           relative_attention_num_buckets=10, relative_attention_max_distance=7, decoder_start_token_id=0)
_BART = dict(d_model=48, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=80, decoder_ffn_dim=80, vocab_size=150, max_position_embeddings=40)

# name -> (family, config overrides, forced_bos_token_id for generation_config.json)
CASES = {
    # v1.0: ReLU FFNs, a tied head reading the last hidden state * d_model^-0.5
    "t5-v1.0": ("t5", dict(_T5, feed_forward_proj="relu", layer_norm_epsilon=1e-5), None),
    # v1.1 as transformers 5 writes it: gated-GELU, tie_word_embeddings=False read as "no rescale", head tied anyway
    "t5-v1.1": ("t5", dict(_T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False, layer_norm_epsilon=1e-7), None),
    # decoder heads 8 wide where the encoder's are 12; FFN widths differ; embeddings * sqrt(48); ReLU; a forced
    # first token (transformers 5 writes it to generation_config.json only)
    "bart": ("bart", dict(_BART, decoder_attention_heads=6, decoder_ffn_dim=64, scale_embedding=True,
                          activation_function="relu"), 5),
    "bart-defaults": ("bart", dict(_BART), None),
    # an untied head: transformers 5 then unties each stack's embeddings too, made equal here (kvforge's stacks
    # share one table; unequal ones are refused: test_untied_bart_with_distinct_stack_embeddings_is_refused)
    "bart-untied": ("bart", dict(_BART, tie_word_embeddings=False), None),
}


def make_model(family: str, seed: int = 0, class_name: str | None = None, forced_bos: int | None = None,
               same_embeddings: bool = True, **config):
    """A transformers encoder-decoder with seeded random weights, every parameter (and buffer) perturbed."""
    import transformers

    stem = {"t5": "T5", "bart": "Bart"}[family]
    cfg = getattr(transformers, f"{stem}Config")(**config, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, class_name or f"{stem}ForConditionalGeneration")(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
        if hasattr(model, "final_logits_bias"):  # a buffer, zeros as built
            model.final_logits_bias.add_(0.1 * torch.randn(model.final_logits_bias.shape, generator=gen))
        base = getattr(model, "model", None)
        if family == "bart" and same_embeddings and base is not None and not cfg.tie_word_embeddings:
            base.encoder.embed_tokens.weight.copy_(base.shared.weight)
            base.decoder.embed_tokens.weight.copy_(base.shared.weight)
    if forced_bos is not None:
        model.generation_config.forced_bos_token_id = forced_bos
    return model.eval()


def source(cfg, seed: int = 0):
    """input_ids, attention_mask: a right-padded batch whose real ids avoid the special ones."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, cfg.vocab_size, (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = 1
    ids[mask == 0] = cfg.pad_token_id
    return ids, mask


def target(cfg, start: int, seed: int = 1):
    """decoder_input_ids: the decoder's start token, then random tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, cfg.vocab_size, (len(LENGTHS), TARGET_LEN), generator=gen)
    ids[:, 0] = start
    return ids


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, checkpoint directory), each made once."""
    cache = {}

    def make(name: str):
        if name not in cache:
            family, config, forced_bos = CASES[name]
            model = make_model(family, forced_bos=forced_bos, **config)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            cache[name] = model, directory
        return cache[name]

    return make


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """name -> (transformers model, kvforge model), each loaded once."""
    cache = {}

    def get(name: str):
        if name not in cache:
            hf_model, directory = checkpoints(name)
            ours, tokenizer = load(directory)
            assert tokenizer is None
            cache[name] = hf_model, ours
        return cache[name]

    return get


def _real(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()]


@pytest.mark.parametrize("name", list(CASES))
@torch.no_grad()
def test_encoder_and_teacher_forced_logits_match_transformers(loaded, name):
    hf_model, ours = loaded(name)
    ids, mask = source(hf_model.config)
    dec = target(hf_model.config, ours.config.decoder_start_token_id)
    expected_hidden = hf_model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    hidden, _ = ours.encode(ids, mask)
    torch.testing.assert_close(_real(hidden, mask), _real(expected_hidden, mask), atol=ATOL, rtol=0)
    expected = hf_model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    torch.testing.assert_close(ours(ids, mask, dec), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
@torch.no_grad()
def test_cached_decoding_matches_teacher_forcing(loaded, name):
    """Encode once, then one token per step from the self-attention cache: each step's logits are transformers'
    teacher-forced logits at that position."""
    hf_model, ours = loaded(name)
    ids, mask = source(hf_model.config, seed=2)
    dec = target(hf_model.config, ours.config.decoder_start_token_id, seed=3)
    expected = hf_model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    _, cross = ours.encode(ids, mask)
    past = ours.empty_cache(len(LENGTHS)) if name == "t5-v1.0" else None  # an empty cache is no cache
    for t in range(TARGET_LEN):
        logits, past = ours.decode(dec[:, t:t + 1], mask, past, cross)
        assert logits.shape == (len(LENGTHS), 1, hf_model.config.vocab_size)
        assert past[0][0].shape[2] == t + 1
        torch.testing.assert_close(logits[:, 0], expected[:, t], atol=ATOL, rtol=0, msg=lambda m: f"step {t}: {m}")


@torch.no_grad()
def greedy(model, input_ids, attention_mask, max_new_tokens: int, eos_token_ids: list[int] | None = None):
    """Greedy decoding as transformers' generate does it: start from decoder_start_token_id, force
    forced_bos_token_id first and forced_eos_token_id at the last allowed step, pad the rows that have finished,
    stop when every row has (or after max_new_tokens)."""
    cfg = model.config
    eos = torch.tensor(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    batch = input_ids.shape[0]
    tokens = torch.full((batch, 1), cfg.decoder_start_token_id)
    done = torch.zeros(batch, dtype=torch.bool)
    max_length = 1 + max_new_tokens
    _, cross = model.encode(input_ids, attention_mask)
    past, step = None, tokens
    while tokens.shape[1] < max_length:
        logits, past = model.decode(step, attention_mask, past, cross)
        length = tokens.shape[1]
        if cfg.forced_bos_token_id is not None and length == 1:
            nxt = torch.full((batch,), cfg.forced_bos_token_id)
        elif cfg.forced_eos_token_id is not None and length == max_length - 1:
            nxt = torch.full((batch,), cfg.forced_eos_token_id)
        else:
            nxt = logits[:, -1].argmax(-1)
        nxt = torch.where(done, torch.tensor(cfg.pad_token_id), nxt)
        tokens = torch.cat((tokens, nxt[:, None]), dim=1)
        done |= torch.isin(nxt, eos)
        if done.all():
            break
        step = nxt[:, None]
    return tokens


def _cache():
    """An empty cache whose layers grow as used: generate's own is sized from the config's num_hidden_layers, which
    for T5 is num_layers (the encoder's), so transformers 5.23 fails on a T5 with more decoder layers."""
    from transformers import DynamicCache, EncoderDecoderCache

    return EncoderDecoderCache(DynamicCache(), DynamicCache())


@pytest.mark.parametrize("name", ["t5-v1.0", "t5-v1.1", "bart", "bart-defaults"])
@torch.no_grad()
def test_greedy_generation_matches_transformers(loaded, name):
    hf_model, ours = loaded(name)
    ids, mask = source(hf_model.config, seed=4)
    options = dict(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, num_beams=1)
    expected = hf_model.generate(**options, past_key_values=_cache())
    assert torch.equal(greedy(ours, ids, mask, MAX_NEW), expected)
    if ours.config.forced_bos_token_id is not None:
        assert (expected[:, 1] == ours.config.forced_bos_token_id).all()
    if ours.config.forced_eos_token_id is not None:  # each row ends on eos: generated, or forced at the last step
        assert (expected[:, 1:] == ours.config.forced_eos_token_id).any(dim=1).all()
    # stopping on a token the last row generates: it is padded while the others go on
    eos = int(expected[-1, 3])
    expected = hf_model.generate(**options, eos_token_id=eos, past_key_values=_cache())
    assert torch.equal(greedy(ours, ids, mask, MAX_NEW, [eos]), expected)


def test_configs_map_to_seq2seq_fields(loaded):
    v10 = loaded("t5-v1.0")[1]
    cfg = v10.config
    assert (cfg.architecture, cfg.family, cfg.position, cfg.norm, cfg.norm_placement, cfg.final_norm) == (
        "encoder-decoder", "t5", "relative", "rmsnorm", "pre", True)
    assert (cfg.dim, cfg.n_heads, cfg.head_dim, cfg.decoder_head_dim, cfg.n_layers, cfg.n_decoder_layers) == (32, 4, 12, 12, 2, 3)
    assert (cfg.relative_buckets, cfg.relative_max_distance, cfg.norm_eps, cfg.attn_scale) == (10, 7, 1e-5, 1.0)
    assert (cfg.activation, cfg.gated_ffn, cfg.tie_embeddings, cfg.head_scale) == ("relu", False, True, 32 ** -0.5)
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.decoder_start_token_id, cfg.forced_eos_token_id) == (0, 1, 0, None)
    assert cfg.max_seq_len == 512  # no n_positions in the file: T5's training length bounds kvforge's inputs
    assert v10.lm_head.weight is v10.shared.weight
    v11 = loaded("t5-v1.1")[1].config
    assert (v11.activation, v11.gated_ffn, v11.tie_embeddings, v11.head_scale, v11.norm_eps) == ("gelu_tanh", True, True, 1.0, 1e-7)
    bart = loaded("bart")[1].config
    assert (bart.family, bart.position, bart.position_offset, bart.max_seq_len, bart.norm, bart.norm_eps) == (
        "bart", "learned", 2, 40, "layernorm", 1e-5)
    assert (bart.norm_placement, bart.final_norm, bart.embed_norm, bart.embed_scale, bart.attn_scale) == (
        "post", False, True, 48 ** 0.5, None)
    assert (bart.n_heads, bart.head_dim, bart.decoder_heads, bart.decoder_head_dim, bart.ffn_dim, bart.decoder_ffn_dim) == (
        4, 12, 6, 8, 80, 64)
    assert (bart.activation, bart.qkv_bias, bart.lm_head_bias, bart.tie_embeddings) == ("relu", True, True, True)
    assert (bart.pad_token_id, bart.bos_token_id, bart.eos_token_id, bart.decoder_start_token_id) == (1, 0, 2, 2)
    assert (bart.forced_bos_token_id, bart.forced_eos_token_id) == (5, 2)
    defaults = loaded("bart-defaults")[1].config
    assert (defaults.embed_scale, defaults.activation, defaults.decoder_head_dim, defaults.forced_bos_token_id) == (
        1.0, "gelu", 12, None)
    untied = loaded("bart-untied")[1]
    assert untied.config.tie_embeddings is False and untied.lm_head.weight is not untied.shared.weight


@pytest.mark.parametrize("keys, tied, rescaled", [
    ({}, True, True),  # t5-small's config.json (v1.0): neither key
    ({"tie_word_embeddings": False}, False, False),  # v1.1 and FLAN-T5 before transformers 5
    ({"tie_word_embeddings": True, "scale_decoder_outputs": False}, True, False),  # v1.1 written by transformers 5
    ({"tie_word_embeddings": True, "scale_decoder_outputs": True}, True, True),  # v1.0 written by transformers 5
])
def test_t5_head_tying_and_rescale(checkpoints, keys, tied, rescaled):
    from kvforge.model_defs import config_from_hf

    hf = json.loads((checkpoints("t5-v1.0")[1] / "config.json").read_text())
    hf.pop("tie_word_embeddings")
    hf.pop("scale_decoder_outputs")
    cfg = config_from_hf({**hf, **keys})
    assert (cfg.tie_embeddings, cfg.head_scale) == (tied, 32 ** -0.5 if rescaled else 1.0)


# --- T5 v1.1's older files: an untied head ---------------------------------------------------------
def _copy(src, dst, edit_config=None, edit_tensors=None):
    """A copy of checkpoint `src` in `dst`, its config.json and tensors edited in place by the callables."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    if (src / "generation_config.json").is_file():
        (dst / "generation_config.json").write_text((src / "generation_config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@torch.no_grad()
def test_t5_untied_head_of_older_v11_files(checkpoints, tmp_path):
    """tie_word_embeddings: false and a distinct lm_head.weight, no scale_decoder_outputs (files from before
    transformers 5): the head is that tensor, reading the decoder's last hidden state unscaled."""
    hf_model, src = checkpoints("t5-v1.1")
    head = 0.3 * torch.randn(hf_model.config.vocab_size, hf_model.config.d_model, generator=torch.Generator().manual_seed(7))

    def untie(cfg):
        cfg["tie_word_embeddings"] = False
        cfg.pop("scale_decoder_outputs")

    directory = _copy(src, tmp_path / "untied", untie, lambda t: t.update({"lm_head.weight": head.clone()}))
    ours = load(directory).model
    assert (ours.config.tie_embeddings, ours.config.head_scale) == (False, 1.0)
    assert ours.lm_head.weight is not ours.shared.weight and torch.equal(ours.lm_head.weight, head)
    ids, mask = source(hf_model.config)
    dec = target(hf_model.config, 0)
    encoded = hf_model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    decoded = hf_model.decoder(input_ids=dec, encoder_hidden_states=encoded, encoder_attention_mask=mask).last_hidden_state
    got = ours(ids, mask, dec)
    torch.testing.assert_close(got, decoded @ head.T, atol=ATOL, rtol=0)
    # transformers 5 reads such a file the same way (it unties a head saved with values of its own)
    import transformers

    reread = transformers.T5ForConditionalGeneration.from_pretrained(directory, attn_implementation="eager").eval()
    torch.testing.assert_close(got, reread(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits, atol=ATOL, rtol=0)


# --- strictness -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, edit, message", [
    ("t5-v1.0", lambda t: t.pop("encoder.block.1.layer.0.SelfAttention.k.weight"),
     r"missing tensors \(1\): \['encoder.block.1.layer.0.SelfAttention.k.weight'\]"),
    ("t5-v1.0", lambda t: t.update({"decoder.block.2.layer.1.EncDecAttention.relative_attention_bias.weight": torch.zeros(10, 4)}),
     r"unexpected tensors \(1\): \['decoder.block.2.layer.1.EncDecAttention.relative_attention_bias.weight'\]"),
    # a gated FFN's second input projection in a ReLU (v1.0) file
    ("t5-v1.0", lambda t: t.update({"encoder.block.0.layer.1.DenseReluDense.wi_1.weight": torch.zeros(48, 32)}),
     r"unexpected tensors \(1\): \['encoder.block.0.layer.1.DenseReluDense.wi_1.weight'\]"),
    ("t5-v1.0", lambda t: t.update({"lm_head.weight": t["shared.weight"] + 1}),
     r"tied tensors that differ .*\['lm_head.weight \(tied to shared.weight\)'\]"),
    ("bart", lambda t: t.pop("final_logits_bias"), r"missing tensors \(1\): \['final_logits_bias'\]"),
    ("bart", lambda t: t.pop("model.decoder.layers.2.encoder_attn.out_proj.bias"),
     r"missing tensors \(1\): \['model.decoder.layers.2.encoder_attn.out_proj.bias'\]"),
    ("bart", lambda t: t.update({"model.encoder.layer_norm.weight": torch.ones(48)}),
     r"unexpected tensors \(1\): \['model.encoder.layer_norm.weight'\]"),
    ("bart", lambda t: t.update({"model.decoder.embed_tokens.weight": t["model.shared.weight"] * 2}),
     r"tied tensors that differ .*\['model.decoder.embed_tokens.weight \(tied to model.shared.weight\)'\]"),
], ids=["t5-missing", "t5-extra", "t5-gated-in-relu", "t5-head-copy-differs", "bart-logits-bias", "bart-missing",
        "bart-extra", "bart-embed-copy-differs"])
def test_loading_is_strict(checkpoints, tmp_path, name, edit, message):
    directory = _copy(checkpoints(name)[1], tmp_path / "edited", edit_tensors=edit)
    with pytest.raises(KvforgeError, match=message):
        load(directory)


@torch.no_grad()
def test_equal_copies_and_leftovers_are_accepted(loaded, checkpoints, tmp_path):
    """Each stack's copy of the shared embeddings and a tied head's copy, when equal; the cross-attention position
    table older T5 files hold for decoder block 0, which transformers skips too."""
    hf_model, _ = loaded("t5-v1.0")

    def t5(t):
        shared = t["shared.weight"]
        t.update({"encoder.embed_tokens.weight": shared.clone(), "decoder.embed_tokens.weight": shared.clone(),
                  "lm_head.weight": shared.clone(),
                  "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight": torch.ones(10, 4)})

    ids, mask = source(hf_model.config)
    dec = target(hf_model.config, 0)
    expected = hf_model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    ours = load(_copy(checkpoints("t5-v1.0")[1], tmp_path / "t5", edit_tensors=t5)).model
    torch.testing.assert_close(ours(ids, mask, dec), expected, atol=ATOL, rtol=0)
    # any one of the three names of the shared embeddings will do
    only_stacks = _copy(checkpoints("t5-v1.0")[1], tmp_path / "stacks",
                        edit_tensors=lambda t: t.update({"encoder.embed_tokens.weight": t["shared.weight"].clone(),
                                                         "decoder.embed_tokens.weight": t.pop("shared.weight")}))
    torch.testing.assert_close(load(only_stacks).model(ids, mask, dec), expected, atol=ATOL, rtol=0)

    hf_bart, _ = loaded("bart")

    def bart(t):
        shared = t["model.shared.weight"]
        t.update({"model.encoder.embed_tokens.weight": shared.clone(), "model.decoder.embed_tokens.weight": shared.clone(),
                  "lm_head.weight": shared.clone()})

    ids, mask = source(hf_bart.config)
    dec = target(hf_bart.config, 2)
    ours = load(_copy(checkpoints("bart")[1], tmp_path / "bart", edit_tensors=bart)).model
    torch.testing.assert_close(ours(ids, mask, dec), hf_bart(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits,
                               atol=ATOL, rtol=0)


def test_untied_bart_with_distinct_stack_embeddings_is_refused(tmp_path):
    """transformers 5 unties each stack's embeddings along with the head: a file whose stacks read different
    tables is not kvforge's one shared table."""
    make_model("bart", same_embeddings=False, **dict(_BART, tie_word_embeddings=False)).save_pretrained(tmp_path)
    with pytest.raises(KvforgeError, match=r"tied tensors that differ .*model.encoder.embed_tokens.weight \(tied to "
                                           r"model.shared.weight\)"):
        load(tmp_path)


@pytest.mark.parametrize("family, class_name, config", [
    ("t5", "T5EncoderModel", _T5),
    ("t5", "T5ForSequenceClassification", _T5),
    ("bart", "BartForSequenceClassification", _BART),
    ("bart", "BartModel", _BART),
])
def test_real_unsupported_architectures_are_refused(tmp_path, family, class_name, config):
    """Checkpoints transformers really wrote for models kvforge does not build."""
    make_model(family, class_name=class_name, **config).save_pretrained(tmp_path)
    lm = {"t5": "T5ForConditionalGeneration", "bart": "BartForConditionalGeneration"}[family]
    with pytest.raises(KvforgeError, match=rf"{family} architecture '{class_name}' is not supported; kvforge imports "
                                           rf"\['{lm}'\]"):
        load(tmp_path)


@pytest.mark.parametrize("name, edit, message", [
    ("t5-v1.0", lambda c: c.update(feed_forward_proj="gated-swish-x"), "is not of the form '<act>' or 'gated-<act>'"),
    ("t5-v1.0", lambda c: c.update(feed_forward_proj="gated-tanh"), "activation 'tanh' is not supported"),
    ("bart", lambda c: c.update(normalize_before=True), r"option\(s\) \['normalize_before'\] not supported"),
    ("bart", lambda c: c.update(add_final_layer_norm=True), r"option\(s\) \['add_final_layer_norm'\] not supported"),
], ids=["t5-ffn-form", "t5-activation", "bart-pre-norm", "bart-final-norms"])
def test_unsupported_configs_are_refused(checkpoints, tmp_path, name, edit, message):
    directory = _copy(checkpoints(name)[1], tmp_path / "edited", edit_config=edit)
    with pytest.raises(KvforgeError, match=message):
        load(directory)


@torch.no_grad()
def test_gated_relu_and_silu_t5_variants(tmp_path):
    """feed_forward_proj 'gated-<act>' takes <act> as it is ('gated-gelu' alone means the tanh GELU)."""
    for proj, act in (("gated-relu", "relu"), ("gated-silu", "silu"), ("gelu", "gelu")):
        hf_model = make_model("t5", **dict(_T5, feed_forward_proj=proj, num_layers=1, num_decoder_layers=1))
        directory = tmp_path / proj
        hf_model.save_pretrained(directory)
        ours = load(directory).model
        assert (ours.config.activation, ours.config.gated_ffn) == (act, proj.startswith("gated"))
        ids, mask = source(hf_model.config)
        dec = target(hf_model.config, 0)
        torch.testing.assert_close(ours(ids, mask, dec), hf_model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits,
                                   atol=ATOL, rtol=0)


@pytest.mark.parametrize("name, block", [("t5-v1.1", None), ("bart", None), ("bart", 16 << 10)])
@torch.no_grad()
def test_the_checks_fp64_run_computes_what_the_double_model_computes(loaded, monkeypatch, name, block):
    """Export's transformers check computes its FP64 outputs holding the model in FP32 (export/oracle.py
    float64_modules): T5's gated FFN reads its output layer's dtype before calling it, BART's layers sit in a
    ModuleList that never runs; both must compute what model.double() computes. With a block of 16 KiB (as a
    large model's layers are to 256 MiB) BART runs a module at a time, its tables' rows cast and its head a
    block of rows at a time: its scaled embedding is then scaled in FP32, within FP32's rounding."""
    import copy

    from kvforge.export import oracle
    from kvforge.export.oracle import float64_modules

    if block is not None:
        monkeypatch.setattr(oracle, "FP64_BLOCK_BYTES", block)
    hf_model, _ = loaded(name)
    ids, mask = source(hf_model.config)
    dec = target(hf_model.config, hf_model.config.decoder_start_token_id)

    def outputs(model):
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
        return out.encoder_last_hidden_state, out.logits

    expected = outputs(copy.deepcopy(hf_model).double())
    with float64_modules(hf_model):
        got = outputs(hf_model)
    assert all(p.dtype == torch.float32 for p in hf_model.parameters())
    for g, e in zip(got, expected):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12 if block is None else 1e-6)


def test_a_seq2seq_weight_import_defect_is_named(checkpoints, tmp_path, monkeypatch):
    """Two decoder layers' FFN weights read the wrong way round: validation passes (the reference shares the
    defect); transformers catches it and names the weights."""
    from kvforge.export import export
    from kvforge.model_defs import hf

    original = hf.normalize_names

    def swapped(family, tensors):
        a, b = "decoder.layers.1.fc1.", "decoder.layers.2.fc1."
        return {k.replace(a, "\0").replace(b, a).replace("\0", b): v for k, v in original(family, tensors).items()}

    monkeypatch.setattr(hf, "normalize_names", swapped)
    with pytest.raises(KvforgeError, match="end-to-end check against transformers: the weights depart: logits"):
        export(str(checkpoints("bart")[1]), tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()
