"""Checkpoint and tokenizer files as the Hub ships them, exported and compared with transformers end to end.

One small sentence-transformers BERT directory is written here the way the Hub holds one (transformers'
save_pretrained, a WordPiece tokenizer.json whose file carries fixed padding and truncation as
all-MiniLM-L6-v2's does, modules.json with Pooling and Normalize); each quirk is that directory edited the way
real checkpoints differ (a position_ids buffer, TensorFlow-era LayerNorm gamma/beta, sharded safetensors with an
index, pytorch_model.bin, a "bert." prefix). Each is exported and embedded through kvforge from text, and
compared with transformers' tokenizer and model from the same files, pooled as sentence-transformers pools
(mean over the attention mask, then L2): token ids equal, cosine >= 1 - 1e-6 on every text.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from kvforge import runtime  # noqa: E402
from kvforge.errors import KvforgeError  # noqa: E402
from kvforge.export import export  # noqa: E402
from kvforge.tokenizer import Tokenizer  # noqa: E402

COSINE = 1 - 1e-6
FIXED = 24  # the tokenizer file's own padding length and truncation, which no reader applies unless asked
TEXTS = ["the cat sat on the mat.", "a dog!", "is the dog on a mat, and the cat?", "cats and dogs and mats",
         "zq", "the " * 20 + "end", "12 3"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "is", "and", "end", "##s", ".", ",", "!", "?"]


def _tokenizer_json(path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    vocab = SPECIALS + WORDS + letters + ["##" + c for c in letters]
    backend = Backend(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    backend.decoder = decoders.WordPiece()
    backend.enable_padding(length=FIXED, pad_id=0, pad_token="[PAD]")
    backend.enable_truncation(FIXED)
    backend.save(str(path))
    return len(vocab)


@pytest.fixture(scope="module")
def hub_bert(tmp_path_factory):
    """(the transformers model, its sentence-transformers directory)."""
    import transformers

    directory = tmp_path_factory.mktemp("st-bert")
    vocab = _tokenizer_json(directory / "tokenizer.json")
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]",
        "unk_token": "[UNK]", "mask_token": "[MASK]", "model_max_length": FIXED}))
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=vocab, max_position_embeddings=128, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms at 1 and biases at 0 would hide a dropped or swapped mapping
            p.add_(0.05 * torch.randn(p.shape))
    model.save_pretrained(directory)
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    return model, directory


def _state(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _variant(src, dst, tensors=None, write=None):
    """src's files copied to dst, its weights replaced by `tensors` (written by `write(tensors, dst)`)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    if tensors is not None:
        (dst / "model.safetensors").unlink()
        (write or (lambda t, d: save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})))(tensors, dst)
    return dst


def _sharded(tensors, d):
    from safetensors.torch import save_file

    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(d / file), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}))


QUIRKS = {
    "as-saved": lambda t: None,
    # transformers ignores the buffer older releases saved with BERT's embeddings
    "position-ids": lambda t: {**t, "embeddings.position_ids": torch.arange(128)[None]},
    # TensorFlow-era names, renamed by transformers on load
    "gamma-beta": lambda t: {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"):
                             v for k, v in t.items()},
    # a wrapper's prefix (BertForMaskedLM and friends save "bert.")
    "prefixed": lambda t: {f"bert.{k}": v for k, v in t.items()},
    "sharded": lambda t: t,
    "pytorch-bin": lambda t: t,
}
WRITERS = {"sharded": _sharded, "pytorch-bin": lambda t, d: torch.save(t, d / "pytorch_model.bin")}


def _reference(model, directory, texts):
    """transformers from text: its tokenizer on the directory's files, the model, mean pooling, L2 norm."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
    mask = enc["attention_mask"][..., None].float()
    pooled = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)
    ids = [row[: int(m.sum())] for row, m in zip(enc["input_ids"].tolist(), enc["attention_mask"])]
    return ids, pooled.numpy()


@pytest.mark.parametrize("quirk", list(QUIRKS))
def test_hub_checkpoint_quirks_export_and_equal_transformers_from_text(hub_bert, tmp_path, quirk):
    model, src = hub_bert
    tensors = QUIRKS[quirk](_state(src))
    directory = _variant(src, tmp_path / quirk, tensors, WRITERS.get(quirk))
    bundle = export(str(directory), tmp_path / "bundle")
    ids, expected = _reference(model, src, TEXTS)
    with runtime.load(bundle.path) as session:
        assert session.tokenize(TEXTS) == ids  # the file's fixed padding and truncation not applied
        vectors = session.embed(TEXTS)  # the directory's own pooling (mean) and normalization
    assert bundle.model_config["embedding"]["pooling"] == "mean" and bundle.model_config["embedding"]["normalize"]
    # what the model does not read is reported by the file's name: here only the buffer the quirk added
    ignored = bundle.manifest["lineage"][0]["input"].get("ignored", {})
    assert ignored == ({"embeddings.position_ids": "a buffer transformers does not load"} if quirk == "position-ids"
                       else {}), ignored
    cosine = (vectors * expected).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= COSINE, cosine
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


def test_tokenizer_file_padding_and_truncation_apply_only_on_request(hub_bert, tmp_path):
    from transformers import AutoTokenizer

    _, src = hub_bert
    ours, theirs = Tokenizer.from_file(src / "tokenizer.json"), AutoTokenizer.from_pretrained(src)
    long_text = "the cat " * 30
    for text in ["a dog", long_text]:
        assert ours.encode(text) == theirs(text)["input_ids"]
    assert len(ours.encode(long_text)) > FIXED and ours.pad_token_id == 0
    ours.save(tmp_path)  # the file as shipped: its settings kept for the readers that apply them on request
    saved = json.loads((tmp_path / "tokenizer.json").read_text())
    assert saved["padding"]["strategy"] == {"Fixed": FIXED} and saved["truncation"]["max_length"] == FIXED
    assert Tokenizer.from_file(tmp_path / "tokenizer.json").encode(long_text) == ours.encode(long_text)


def test_texts_are_cut_only_on_request_as_transformers_cuts_them(hub_bert, tmp_path):
    """Neither tokenizer.json's truncation nor model_max_length cuts a text unasked; truncate=True cuts it as
    transformers' truncation=True does (the text first, [CLS] and [SEP] kept), at a sentence-transformers
    model's max_seq_length (what SentenceTransformer.encode cuts at). Embeddings of the cut text equal
    transformers' on the same ids."""
    from transformers import AutoTokenizer

    model, src = hub_bert
    directory = _variant(src, tmp_path / "st")
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 20, "do_lower_case": False}))
    bundle = export(str(directory), tmp_path / "bundle")
    theirs = AutoTokenizer.from_pretrained(directory)
    long_text = "the cat sat on a mat " * 8
    cut = theirs(long_text, truncation=True, max_length=20)["input_ids"]
    assert len(cut) == 20 and cut[0] == 2 and cut[-1] == 3
    with runtime.load(bundle.path) as session:
        whole = session.tokenize(long_text)
        assert whole == [theirs(long_text)["input_ids"]] and len(whole[0]) > FIXED
        assert session.tokenize(long_text, truncate=True) == [cut]
        vector = session.embed(long_text, truncate=True)
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([cut])).last_hidden_state[0]
    expected = torch.nn.functional.normalize(hidden.mean(0), dim=0).numpy()
    assert float(vector[0] @ expected) >= COSINE


class _Payload:
    def __reduce__(self):  # what a malicious pickle does: call something when loaded
        return (print, ("this ran",))


def test_pickles_run_no_code_and_checkpoints_missing_what_matters_are_refused(hub_bert, tmp_path, capsys):
    _, src = hub_bert
    evil = _variant(src, tmp_path / "evil", {"x": 1},
                    lambda t, d: (d / "pytorch_model.bin").write_bytes(pickle.dumps({"w": _Payload()})))
    with pytest.raises(KvforgeError, match="runs no code from a checkpoint"):
        export(str(evil), tmp_path / "b1")
    assert "this ran" not in capsys.readouterr().out
    state = _state(src)
    state.pop("encoder.layer.1.output.dense.weight")
    missing = _variant(src, tmp_path / "missing", state)
    with pytest.raises(KvforgeError, match=r"missing tensors \(1\): \['bert.encoder.layer.1.output.dense.weight'\]"):
        export(str(missing), tmp_path / "b2")
    assert not (tmp_path / "b1").exists() and not (tmp_path / "b2").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "modules.json").write_text(json.dumps(json.loads((d / "modules.json").read_text())[:2] + [
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}])),
     r"module '2' \(sentence_transformers.models.Dense\) changes the embedding"),
    (lambda d: (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True})),
     "pools by weighted mean, which kvforge does not apply"),
    (lambda d: (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True,
                                                                        "pooling_mode_mean_tokens": True})),
     r"concatenates several poolings \(\['cls', 'mean'\]\)"),
    (lambda d: (d / "modules.json").write_text((d / "modules.json").read_text().replace('"1_Pooling"', '"../1_Pooling"')),
     r"the Pooling module's path '\.\./1_Pooling' climbs out"),
], ids=["dense", "weighted-mean", "concatenated", "climbing-path"])
def test_sentence_transformers_modules_that_are_not_applied_are_refused(hub_bert, tmp_path, edit, message):
    directory = _variant(hub_bert[1], tmp_path / "st")
    edit(directory)
    with pytest.raises(KvforgeError, match=message):
        export(str(directory), tmp_path / "bundle")


# --- transformers as the end-to-end oracle at export (export/oracle.py) -------------------------------------------

def test_export_checks_itself_against_transformers_from_text(hub_bert, tmp_path):
    bundle = export(str(hub_bert[1]), tmp_path / "bundle")
    o = bundle.manifest["oracle"]
    assert o["compared"] and o["passed"] and o["token_ids_equal"] and o["inputs"] == "text"
    assert o["outputs"] == ["last_hidden_state"] and o["worst"]["ratio"] <= o["noise_multiple"]
    skipped = export(str(hub_bert[1]), tmp_path / "unchecked", transformers_check=False).manifest["oracle"]
    assert not skipped["compared"] and "not asked for" in skipped["reason"]


def _swap_layers(monkeypatch, a: str, b: str):
    """A weight-import defect: checkpoint names holding `a` read as `b` and the other way round."""
    from kvforge.model_defs import hf

    original = hf.normalize_names

    def swapped(family, tensors):
        out = original(family, tensors)
        return {k.replace(a, "\0").replace(b, a).replace("\0", b): v for k, v in out.items()}

    monkeypatch.setattr(hf, "normalize_names", swapped)


def _tokenizer_defect(monkeypatch, defect: str):
    original = Tokenizer.encode

    def encode(self, text, add_special_tokens=True):
        ids = original(self, text, add_special_tokens)
        return ids[1:] if defect == "dropped special token" else ids + [0] * 8  # pad ids, as a Fixed padding adds

    monkeypatch.setattr(Tokenizer, "encode", encode)


@pytest.mark.parametrize("defect, end", [("dropped special token", "tokenizer"), ("padding applied", "tokenizer"),
                                         ("layers swapped", "weights")])
def test_injected_defects_are_caught_naming_the_end(hub_bert, tmp_path, monkeypatch, defect, end):
    """Defects that kvforge's own reference shares with its graph pass validation; transformers catches them."""
    if defect == "layers swapped":
        _swap_layers(monkeypatch, "encoder.layer.0.attention.self.query.", "encoder.layer.1.attention.self.query.")
    else:
        _tokenizer_defect(monkeypatch, defect)
    with pytest.raises(KvforgeError, match=f"end-to-end check against transformers: the {end} depart"):
        export(str(hub_bert[1]), tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()


def test_a_checkpoint_without_tokenizer_is_compared_on_token_ids(hf_checkpoint, tmp_path, monkeypatch):
    """A random-weight decoder checkpoint (no tokenizer files): the same seeded ids to both sides; a swapped
    pair of layers in the import is named as the weights."""
    bundle = export(hf_checkpoint("llama"), tmp_path / "ok")
    o = bundle.manifest["oracle"]
    assert o["compared"] and o["passed"] and o["inputs"] == "token ids" and not o["token_ids_equal"]
    assert o["outputs"] == ["logits"]
    _swap_layers(monkeypatch, "layers.0.self_attn.q_proj.", "layers.1.self_attn.q_proj.")
    with pytest.raises(KvforgeError, match="the weights depart: logits"):
        export(hf_checkpoint("llama"), tmp_path / "swapped")


def test_compare_against_transformers_from_the_command_line(hub_bert, tmp_path):
    from click.testing import CliRunner

    from kvforge.cli import main

    bundle = export(str(hub_bert[1]), tmp_path / "bundle", transformers_check=False)
    out = CliRunner().invoke(main, ["compare", str(bundle.path), "--against", "transformers",
                                    "--json", str(tmp_path / "r.json")])
    assert out.exit_code == 0, out.output
    assert "transformers end to end: token ids equal on 4 texts, last_hidden_state within" in out.output
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["compared"] and record["passed"] and record["worst"]["ratio"] <= record["noise_multiple"]


def test_tensors_the_model_does_not_read_are_reported_with_why(hf_checkpoint, tmp_path):
    """A decoder checkpoint carrying what older exports saved: a rotary buffer and a written copy of a tied
    embedding (for a tied config). Each is read past and reported by its file name, with why; a tensor that is
    none of these is refused, named."""
    from safetensors.torch import load_file, save_file

    from kvforge.model_defs.checkpoint import ignored_tensors

    src = Path(hf_checkpoint("llama"))
    config = json.loads((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    tensors.pop("lm_head.weight", None)
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),
             "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    save_file({**tensors, **extra}, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert ignored_tensors(d) == {"lm_head.weight": "a copy of model.embed_tokens.weight (tied)",
                                  "model.layers.0.self_attn.rotary_emb.inv_freq": "a buffer transformers does not load"}
    save_file({**tensors, **extra, "model.layers.0.mlp.extra.weight": torch.ones(2, 2)}, str(d / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(KvforgeError, match=r"unexpected tensors \(1\): \['model.layers.0.mlp.extra.weight'\]"):
        ignored_tensors(d)


@pytest.mark.parametrize("labels", [1, 3], ids=["relevance", "three-classes"])
def test_a_cross_encoder_scores_text_pairs_as_transformers_does(hub_bert, tmp_path, labels):
    """A BERT sequence classifier over text pairs (a cross-encoder: one relevance logit, or several classes): the
    pair's ids and token types equal transformers' tokenizer(text, text_pair), and classify's probabilities equal
    the sigmoid (one label, as CrossEncoder.predict and the text-classification pipeline score it) or the softmax
    of transformers' logits; a pair too long is cut on request as transformers cuts it (longest first)."""
    import transformers
    from transformers import AutoTokenizer

    _, src = hub_bert
    directory = tmp_path / "cross"
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=json.loads((src / "config.json").read_text())["vocab_size"],
                                  max_position_embeddings=128, num_labels=labels, attn_implementation="eager")
    torch.manual_seed(1)
    model = transformers.BertForSequenceClassification(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape))
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, directory / name)
    pairs = [("is the cat on the mat?", "the cat sat on the mat."), ("a dog!", "cats and dogs and mats"),
             ("where is the dog", "is the dog on a mat, and the cat?")]
    theirs = AutoTokenizer.from_pretrained(directory)
    # (a BertTokenizer checkpoint returns token types by default; this file's generic class is asked for them)
    enc = theirs([a for a, _ in pairs], [b for _, b in pairs], padding=True, return_tensors="pt",
                 return_token_type_ids=True)
    with torch.no_grad():
        logits = model(**enc).logits.double()
    expected = torch.sigmoid(logits) if labels == 1 else torch.softmax(logits, -1)
    bundle = export(str(directory), tmp_path / "bundle")
    with runtime.load(bundle.path) as session:
        ids, types = session.tokenize_pairs(pairs)
        n = enc["attention_mask"].sum(1).tolist()
        assert ids == [r[:k] for r, k in zip(enc["input_ids"].tolist(), n)]
        assert types == [r[:k] for r, k in zip(enc["token_type_ids"].tolist(), n)] and any(1 in t for t in types)
        scores = np.array([r["scores"] for r in session.classify(pairs)])
        long_pair = ("the cat " * 40, "a dog")
        cut = theirs(*long_pair, truncation=True, max_length=128, return_token_type_ids=True)
        assert session.tokenize_pairs([long_pair], truncate=True) == ([cut["input_ids"]], [cut["token_type_ids"]])
        with pytest.raises(KvforgeError, match="pairs must be"):
            session.tokenize_pairs([("only one",)])
    np.testing.assert_allclose(scores, expected.numpy(), rtol=0, atol=1e-5)
    # the CLI: each --text with the --pair in its place
    from click.testing import CliRunner

    from kvforge.cli import main

    args = ["embed", str(bundle.path), "--classify", "--json"]
    out = CliRunner().invoke(main, args + [f for a, b in pairs for f in ("--text", a, "--pair", b)])
    assert out.exit_code == 0, out.output
    cli = np.array([r["scores"] for r in json.loads(out.output)["classes"]])
    np.testing.assert_allclose(cli, expected.numpy(), rtol=0, atol=1e-5)
    out = CliRunner().invoke(main, args + ["--text", "a", "--text", "b", "--pair", "c"])
    assert out.exit_code != 0 and "give one --pair per --text" in out.output
