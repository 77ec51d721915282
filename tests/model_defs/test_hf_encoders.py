"""BERT and RoBERTa checkpoints (transformers' own files) imported onto kvforge's Encoder, vs transformers.

Each checkpoint is written by transformers from an off-default tiny config with seeded random weights, every
parameter perturbed (biases start at 0 and norm weights at 1: a dropped or swapped mapping would not show), then
loaded with kvforge.model_defs.load. Outputs are compared on a right-padded batch, real positions only.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from kvforge.errors import KvforgeError  # noqa: E402
from kvforge.model_defs import load  # noqa: E402

ATOL = 1e-4
LENGTHS = (9, 5, 2)  # right padding, as tokenizers pad for encoders
LABELS = {0: "negative", 1: "neutral", 2: "positive"}

_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=120,
             max_position_embeddings=64)
_ROBERTA = dict(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80, vocab_size=150,
                max_position_embeddings=80)

# name -> (transformers model class, config overrides): each off the defaults somewhere
CASES = {
    # three segment types, the tanh GELU, an unprefixed file (the base model saves no "bert.")
    "bert-base": ("BertModel", dict(_BERT, type_vocab_size=3, hidden_act="gelu_new", layer_norm_eps=1e-7)),
    # the masked-LM head's transform follows hidden_act (tanh GELU), tied to the embeddings
    "bert-mlm": ("BertForMaskedLM", dict(_BERT, hidden_act="gelu_new", layer_norm_eps=1e-6, pad_token_id=3)),
    # an untied decoder: the checkpoint holds its weight, and its bias under two names
    "bert-mlm-untied": ("BertForMaskedLM", dict(_BERT, tie_word_embeddings=False, layer_norm_eps=1e-5)),
    "bert-cls": ("BertForSequenceClassification", dict(_BERT, hidden_act="relu", layer_norm_eps=1e-5, id2label=LABELS)),
    # RoBERTa: positions counted after the pad token (an off-default one), one segment type
    "roberta-base": ("RobertaModel", dict(_ROBERTA, type_vocab_size=1, pad_token_id=4, layer_norm_eps=1e-5)),
    # the lm_head's GELU is the exact one whatever hidden_act says
    "roberta-mlm": ("RobertaForMaskedLM", dict(_ROBERTA, type_vocab_size=1, hidden_act="gelu_new", layer_norm_eps=1e-6)),
    "roberta-mlm-untied": ("RobertaForMaskedLM", dict(_ROBERTA, type_vocab_size=1, tie_word_embeddings=False)),
    # two segment types (RobertaConfig's default), token_type_ids given
    "roberta-cls": ("RobertaForSequenceClassification", dict(_ROBERTA, layer_norm_eps=1e-7, id2label=LABELS)),
}


def make_model(class_name: str, seed: int = 0, **config):
    """A transformers encoder with seeded random weights, every parameter perturbed."""
    import transformers

    family = "Roberta" if class_name.startswith("Roberta") else "Bert"
    cfg = getattr(transformers, f"{family}Config")(**config, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, class_name)(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
        head = getattr(model, "cls", None) or getattr(model, "lm_head", None)
        if head is not None and not cfg.tie_word_embeddings:
            # untied, transformers 5 keeps `bias` and `decoder.bias` apart (it computes with the latter) and saves
            # both; transformers 4 made them one tensor. Checkpoints hold them equal: kvforge accepts no other.
            bias = head.predictions if hasattr(head, "predictions") else head
            bias.bias.copy_(bias.decoder.bias)
    return model.eval()


def batch(cfg, seed: int = 0):
    """input_ids, attention_mask, token_type_ids (None with one segment type): real ids avoid the special ones."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, cfg.vocab_size, (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = 1
    ids[mask == 0] = cfg.pad_token_id
    types = torch.randint(0, cfg.type_vocab_size, ids.shape, generator=gen) if cfg.type_vocab_size > 1 else None
    return ids, mask, types


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, checkpoint directory), each made once."""
    cache = {}

    def make(name: str):
        if name not in cache:
            class_name, config = CASES[name]
            model = make_model(class_name, **config)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            cache[name] = model, directory
        return cache[name]

    return make


def _real(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()]


@pytest.mark.parametrize("name", list(CASES))
@torch.no_grad()
def test_outputs_match_transformers(checkpoints, name):
    hf_model, directory = checkpoints(name)
    ours, tokenizer = load(directory)
    assert tokenizer is None
    ids, mask, types = batch(hf_model.config)
    expected = hf_model(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    got = ours(ids, attention_mask=mask, token_type_ids=types)

    torch.testing.assert_close(_real(got["last_hidden_state"], mask), _real(expected.hidden_states[-1], mask),
                               atol=ATOL, rtol=0)
    head = ours.config.head
    if head == "pooler":
        assert set(got) == {"last_hidden_state", "pooler_output"}
        torch.testing.assert_close(got["pooler_output"], expected.pooler_output, atol=ATOL, rtol=0)
    elif head == "mlm":
        assert set(got) == {"last_hidden_state", "logits"}
        torch.testing.assert_close(_real(got["logits"], mask), _real(expected.logits, mask), atol=ATOL, rtol=0)
    else:
        assert set(got) == {"last_hidden_state", "logits"} and got["logits"].shape == (len(LENGTHS), 3)
        torch.testing.assert_close(got["logits"], expected.logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["bert-base", "roberta-cls"])
@torch.no_grad()
def test_absent_token_types_are_the_first_segment(checkpoints, name):
    hf_model, directory = checkpoints(name)
    ours = load(directory).model
    ids, mask, _ = batch(hf_model.config, seed=1)
    expected = hf_model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    got = ours(ids, attention_mask=mask)["last_hidden_state"]
    torch.testing.assert_close(_real(got, mask), _real(expected, mask), atol=ATOL, rtol=0)


def test_configs_map_to_encoder_fields(checkpoints):
    bert = load(checkpoints("bert-base")[1]).model.config
    assert (bert.architecture, bert.family, bert.head, bert.position, bert.type_vocab_size) == (
        "encoder", "bert", "pooler", "absolute", 3)
    assert (bert.norm_placement, bert.norm_eps, bert.activation, bert.pad_token_id) == ("post", 1e-7, "gelu_tanh", 0)
    mlm = load(checkpoints("bert-mlm")[1]).model
    assert (mlm.config.head, mlm.config.head_activation, mlm.config.tie_embeddings) == ("mlm", "gelu_tanh", True)
    assert mlm.head.decoder.weight is mlm.embed.tokens.weight
    cls = load(checkpoints("bert-cls")[1]).model.config
    assert (cls.head, cls.num_labels, cls.labels, cls.activation) == (
        "classification", 3, ["negative", "neutral", "positive"], "relu")
    roberta = load(checkpoints("roberta-base")[1]).model.config
    assert (roberta.position, roberta.pad_token_id, roberta.bos_token_id, roberta.eos_token_id) == ("padded", 4, 0, 2)
    assert roberta.max_input_len == 80 - 5
    rmlm = load(checkpoints("roberta-mlm")[1]).model.config
    assert (rmlm.activation, rmlm.head_activation) == ("gelu_tanh", "gelu")
    assert load(checkpoints("roberta-mlm-untied")[1]).model.config.tie_embeddings is False


# --- strictness -------------------------------------------------------------------------------
def _copy(src, dst, edit_config=None, edit_tensors=None):
    """A copy of checkpoint `src` in `dst`, its config.json and tensors edited in place by the callables."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update({"bert.encoder.layer.1.attention.self.extra.weight": torch.zeros(2)}),
     r"unexpected tensors \(1\): \['bert.encoder.layer.1.attention.self.extra.weight'\]"),
    (lambda t: t.pop("classifier.bias"), r"missing tensors \(1\): \['classifier.bias'\]"),
    # an MLM checkpoint's head next to the classifier is not silently dropped
    (lambda t: t.update({"cls.predictions.bias": torch.zeros(120)}), r"unexpected tensors \(1\): \['cls.predictions.bias'\]"),
], ids=["extra", "missing", "other-head"])
def test_loading_is_strict(checkpoints, tmp_path, edit, message):
    directory = _copy(checkpoints("bert-cls")[1], tmp_path / "edited", edit_tensors=edit)
    with pytest.raises(KvforgeError, match=message):
        load(directory)


@torch.no_grad()
def test_tied_copies_are_accepted_only_when_equal(checkpoints, tmp_path):
    hf_model, src = checkpoints("bert-mlm")
    emb = "bert.embeddings.word_embeddings.weight"

    def copies(decoder_weight, decoder_bias):
        return lambda t: t.update({"cls.predictions.decoder.weight": decoder_weight(t[emb]),
                                   "cls.predictions.decoder.bias": decoder_bias(t["cls.predictions.bias"])})

    same = _copy(src, tmp_path / "same", edit_tensors=copies(torch.clone, torch.clone))
    ours = load(same).model
    ids, mask, types = batch(hf_model.config)
    torch.testing.assert_close(_real(ours(ids, mask, types)["logits"], mask),
                               _real(hf_model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits, mask),
                               atol=ATOL, rtol=0)
    for name, edit in (("cls.predictions.decoder.weight", copies(lambda t: t + 1, torch.clone)),
                       ("cls.predictions.decoder.bias", copies(torch.clone, lambda t: t + 1))):
        directory = _copy(src, tmp_path / name, edit_tensors=edit)
        with pytest.raises(KvforgeError, match=rf"tied tensors that differ .*\['{name} \(tied to "):
            load(directory)
    # untied, the two bias names are one tensor to kvforge: transformers 4 and 5 disagree on which one counts
    untied = _copy(checkpoints("bert-mlm-untied")[1], tmp_path / "untied",
                   edit_tensors=lambda t: t["cls.predictions.decoder.bias"].add_(1.0))
    with pytest.raises(KvforgeError, match=r"cls.predictions.decoder.bias \(tied to cls.predictions.bias\)"):
        load(untied)
    # either name alone will do
    alone = _copy(checkpoints("bert-mlm-untied")[1], tmp_path / "alone", edit_tensors=lambda t: t.pop("cls.predictions.bias"))
    load(alone)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(position_embedding_type="relative_key"), "position_embedding_type='relative_key' is not supported"),
    (lambda c: c.update(is_decoder=True), r"option\(s\) \['is_decoder'\] not supported"),
    (lambda c: c.update(add_cross_attention=True), r"option\(s\) \['add_cross_attention'\] not supported"),
    (lambda c: c.update(architectures=["BertForTokenClassification"]),
     r"architecture 'BertForTokenClassification' is not supported; kvforge imports \['BertModel', 'BertForMaskedLM', "
     r"'BertForSequenceClassification'\]"),
    (lambda c: c.update(architectures=["BertLMHeadModel"]), "architecture 'BertLMHeadModel' is not supported"),
], ids=["relative-positions", "decoder", "cross-attention", "token-classification", "causal-lm"])
def test_unsupported_configs_are_refused(checkpoints, tmp_path, edit, message):
    directory = _copy(checkpoints("bert-base")[1], tmp_path / "edited", edit_config=edit)
    with pytest.raises(KvforgeError, match=message):
        load(directory)


def test_real_unsupported_head_is_refused(tmp_path):
    """A checkpoint transformers really wrote for a head kvforge does not build."""
    make_model("RobertaForTokenClassification", **_ROBERTA).save_pretrained(tmp_path)
    with pytest.raises(KvforgeError, match="architecture 'RobertaForTokenClassification' is not supported"):
        load(tmp_path)


@torch.no_grad()
def test_config_without_architectures_is_the_base_model(checkpoints, tmp_path):
    hf_model, src = checkpoints("roberta-base")
    directory = _copy(src, tmp_path / "plain", edit_config=lambda c: c.pop("architectures"))
    ours = load(directory).model
    assert ours.config.head == "pooler"
    ids, mask, types = batch(hf_model.config)
    torch.testing.assert_close(ours(ids, mask)["pooler_output"], hf_model(input_ids=ids, attention_mask=mask).pooler_output,
                               atol=ATOL, rtol=0)


@torch.no_grad()
def test_pretraining_leftovers_of_a_masked_lm_checkpoint_are_skipped(checkpoints, tmp_path):
    """bert-base-uncased is a BertForMaskedLM whose file still holds the pooler and the next-sentence head:
    transformers skips them, and so does kvforge; any other stray tensor still fails."""
    hf_model, src = checkpoints("bert-mlm")
    dim = hf_model.config.hidden_size

    def leftovers(t):
        t.update({"bert.pooler.dense.weight": torch.ones(dim, dim), "bert.pooler.dense.bias": torch.ones(dim),
                  "cls.seq_relationship.weight": torch.ones(2, dim), "cls.seq_relationship.bias": torch.ones(2)})

    ours = load(_copy(src, tmp_path / "pretrained", edit_tensors=leftovers)).model
    ids, mask, types = batch(hf_model.config)
    torch.testing.assert_close(_real(ours(ids, mask, types)["logits"], mask),
                               _real(hf_model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits, mask),
                               atol=ATOL, rtol=0)
    stray = _copy(src, tmp_path / "stray", edit_tensors=lambda t: t.update({"cls.other.weight": torch.ones(2)}))
    with pytest.raises(KvforgeError, match=r"unexpected tensors \(1\): \['cls.other.weight'\]"):
        load(stray)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in ("bert-mlm", "roberta-cls") else pytest.mark.slow)
                                  for n in CASES])
def test_export_is_checked_against_transformers_end_to_end(checkpoints, tmp_path, name):
    """Export's own end-to-end check on each encoder checkpoint: the class that saved it (config.json's
    architectures), on the same seeded ids, its last hidden state and its head's outputs against the graph's."""
    from kvforge.export import export

    o = export(str(checkpoints(name)[1]), tmp_path / "bundle").manifest["oracle"]
    assert o["compared"] and o["passed"] and o["inputs"] == "token ids", o
    assert o["outputs"] == (["last_hidden_state"] if name.endswith("-base") else ["last_hidden_state", "logits"])
    assert o["worst"]["ratio"] <= o["noise_multiple"]
