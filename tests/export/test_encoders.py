"""Encoders (BERT, RoBERTa, Perceiver presets): the Torch reference, the export contract, the runtime's
embed/classify, `kvforge embed`, calibration and compare. Hugging Face conformance: tests/model_defs/test_hf_encoders.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvforge import runtime
from kvforge.cli import main
from kvforge.errors import KvforgeError
from kvforge.export.encoder_export import example_inputs, validate_encoder
from kvforge.model_defs import load
from kvforge.model_defs.encoder import EncoderConfig
from kvforge.model_defs.perceiver import PerceiverConfig

ENCODERS = ("bert-micro", "roberta-micro", "perceiver-micro")
TEXTS = ["a short one", "a rather longer sentence, with punctuation and 1234 digits", "x"]


@pytest.mark.parametrize("preset", ENCODERS)
def test_padding_changes_nothing_for_real_tokens(preset):
    """A right-padded row's outputs equal the row run alone: the mask hides padding from every query."""
    model, _ = load(preset)
    cfg = model.config
    ids, mask, *types = example_inputs(cfg, 3, 12, [12, 7, 3], seed=1)
    with torch.no_grad():
        batch = model(ids, mask, *types)
        for row, n in enumerate([12, 7, 3]):
            alone = model(ids[row:row + 1, :n], mask[row:row + 1, :n], *(t[row:row + 1, :n] for t in types))
            hidden = batch["last_hidden_state"][row]
            hidden = hidden[:n] if cfg.architecture == "encoder" else hidden  # a Perceiver's latents
            assert (hidden - alone["last_hidden_state"][0]).abs().max() < 1e-5
            if "logits" in alone:
                ref = alone["logits"][0]
                got = batch["logits"][row][:n] if cfg.head == "mlm" else batch["logits"][row]
                assert (got - ref).abs().max() < 1e-5
        # and padding is not ignored by accident: another real token does change the outputs
        other = ids.clone()
        other[1, 0] = (other[1, 0] + 1) % cfg.vocab_size
        changed = model(other, mask, *types)["last_hidden_state"][1]
        assert (changed - batch["last_hidden_state"][1]).abs().max() > 1e-4


def test_configs_refuse_what_they_cannot_build():
    with pytest.raises(KvforgeError, match="head='lm'"):
        EncoderConfig(vocab_size=10, dim=8, n_layers=1, n_heads=2, head="lm")
    with pytest.raises(KvforgeError, match="position='padded'.*pad_token_id"):
        EncoderConfig(vocab_size=10, dim=8, n_layers=1, n_heads=2, position="padded", pad_token_id=None)
    with pytest.raises(KvforgeError, match="n_latents"):
        PerceiverConfig(vocab_size=10, dim=8, n_layers=1, n_heads=2, n_latents=0)
    with pytest.raises(KvforgeError, match="no head or a classification head"):
        PerceiverConfig(vocab_size=10, dim=8, n_layers=1, n_heads=2, head="mlm")


@pytest.mark.parametrize("preset", ENCODERS)
def test_export_contract_and_outputs_match_torch(preset, micro_bundle):
    bundle = micro_bundle(preset)
    m = bundle.manifest
    cfg = m["model"]
    assert m["validation"]["passed"] and m["lint"]["passed"]
    io = {t["name"]: t["shape"] for t in m["io"]["inputs"] + m["io"]["outputs"]}
    expected_inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if cfg["type_vocab_size"] > 1 else [])
    assert [t["name"] for t in m["io"]["inputs"]] == expected_inputs
    assert m["io"]["kv_cache"]["past"] == [] and m["io"]["kv_cache"]["present"] == []
    hidden = io["last_hidden_state"]
    assert hidden == ["batch_size", "sequence_length" if cfg["architecture"] == "encoder" else cfg["n_latents"], cfg["dim"]]
    # an independent run: ONNX Runtime against the Torch reference on a fresh right-padded batch
    import onnxruntime as ort

    model, _ = load(preset)
    args = example_inputs(model.config, 4, 23, [23, 11, 1, 17], seed=123)
    sess = ort.InferenceSession(str(bundle.graph_file), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {n: a.numpy() for n, a in zip(expected_inputs, args)})))
    with torch.no_grad():
        ref = model(*args)
    real = args[1].numpy().astype(bool)
    for name, value in got.items():
        r = ref[name].numpy()
        if cfg["architecture"] == "encoder" and (name == "last_hidden_state" or cfg["head"] == "mlm"):
            value, r = value[real], r[real]
        assert np.abs(value - r).max() < 1e-4, name


def test_float16_export_and_validation_catch_a_wrong_graph(micro_bundle, tmp_path):
    from kvforge.export import export

    half = export("bert-micro", tmp_path / "bert-fp16", dtype="float16")
    v = half.manifest["validation"]
    assert v["passed"] and v["outputs"]["last_hidden_state"]["rel_l2"] < 1e-2
    # the same checks on a reference that differs in one bias fail: validation is not vacuous
    model, _ = load("bert-micro")
    with torch.no_grad():
        model.layers[1].ffn.down_proj.bias[3] += 0.05  # one feature: a shift of all of them is normed away
    summary = validate_encoder(micro_bundle("bert-micro").graph_file, model, "float32", 256, fuzz=1)
    assert not summary["passed"] and any("last_hidden_state max_abs" in f for f in summary["failures"])


def test_embed_and_classify_match_the_reference(micro_bundle):
    with runtime.load(micro_bundle("roberta-micro").path) as ort_s, \
            runtime.load(micro_bundle("roberta-micro").path, backend="torch") as torch_s:
        assert isinstance(ort_s, runtime.EncoderSession)
        a, b = ort_s.embed(TEXTS), torch_s.embed(TEXTS)
        assert a.shape == (3, 64) and np.abs(a - b).max() < 1e-4
        unit = ort_s.embed(TEXTS, normalize=True)
        assert np.allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-6)
        # mean pooling is over real tokens only: a text's vector does not depend on its batch-mates
        alone = ort_s.embed(TEXTS[2])
        assert np.abs(alone[0] - a[2]).max() < 1e-5
        cls = ort_s.embed(TEXTS, pooling="cls")
        rows = ort_s.encode(TEXTS)
        assert np.abs(cls[1] - rows[1]["last_hidden_state"][0]).max() == 0
        classes = ort_s.classify(TEXTS)
        ref = torch_s.classify(TEXTS)
        for c, r in zip(classes, ref):
            assert c["index"] == r["index"] == int(np.argmax(c["scores"]))
            assert abs(sum(c["scores"]) - 1) < 1e-5 and c["label"] == f"LABEL_{c['index']}"


def test_encoder_session_names_bad_input(micro_bundle, tmp_path):
    s = runtime.load(micro_bundle("bert-micro").path)
    ids = np.ones((2, 5), np.int64)
    good = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    assert s.run(good)["logits"].shape == (2, 5, 259)
    cases = [
        ({**good, "input_ids": ids * 300}, "token id 300 is out of range"),
        ({**good, "attention_mask": np.ones((2, 5), np.int32)}, "attention_mask must be an int64"),
        ({**good, "attention_mask": np.ones((2, 4), np.int64)}, "must match"),
        ({**good, "token_type_ids": ids * 2}, "token_type_ids must lie in 0..1"),
        ({k: v for k, v in good.items() if k != "token_type_ids"}, r"missing \['token_type_ids'\]"),
        ({**good, "attention_mask": np.zeros_like(ids)}, "no real token"),
    ]
    for feeds, message in cases:
        with pytest.raises(KvforgeError, match=message):
            s.run(feeds)
    with pytest.raises(KvforgeError, match="more than this bundle's 256"):
        s.embed("y" * 400)
    assert s.embed("y" * 400, truncate=True).shape == (1, 64)
    with pytest.raises(KvforgeError, match="no classification head"):
        s.classify("hi")
    with pytest.raises(KvforgeError, match="does not generate"):
        s.generate("hi")
    with pytest.raises(KvforgeError, match="latents, not tokens: there is no token to pool by 'cls'"):
        runtime.load(micro_bundle("perceiver-micro").path).embed("hi", pooling="cls")
    from kvforge.serving import write_repository

    repo = write_repository(micro_bundle("bert-micro").path, tmp_path / "repo", model_name="bert")
    pbtxt = (repo / "bert" / "config.pbtxt").read_text()  # an embedding model: text in, a vector out
    assert 'name: "embedding" data_type: TYPE_FP32' in pbtxt and 'name: "text_output"' not in pbtxt


def test_cli_embed(micro_bundle):
    path = str(micro_bundle("perceiver-micro").path)
    result = CliRunner().invoke(main, ["embed", path, "--text", TEXTS[0], "--text", TEXTS[1], "--classify", "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    expected = runtime.load(path).embed(TEXTS[:2])
    assert record["dim"] == 64 and np.abs(np.asarray(record["vectors"]) - expected).max() < 1e-6
    assert [c["index"] for c in record["classes"]] == [c["index"] for c in runtime.load(path).classify(TEXTS[:2])]
    result = CliRunner().invoke(main, ["generate", path, "--prompt", "hi"])
    assert result.exit_code == 1 and "does not generate" in result.output


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from kvforge.model_defs.evaluate import heldout_text

    path = tmp_path_factory.mktemp("enc-data") / "text.txt"
    path.write_text(heldout_text()[:20000])
    return path


def test_int8_encoder_calibrates_and_compares(micro_bundle, corpus, tmp_path):
    from kvforge.calibration import calibrate
    from kvforge.verify.compare import compare

    fp32 = micro_bundle("bert-micro")
    with pytest.raises(KvforgeError, match="no KV cache"):
        calibrate(fp32.path, tmp_path / "x", precision="int8", data=corpus, kv_cache="fp8")
    int8 = calibrate(fp32.path, tmp_path / "bert-int8", precision="int8", data=corpus, samples=16, seq_len=64)
    q = int8.manifest["precision"]["quantization"]
    # 2 x 6 linears + the MLM head's transform; its vocabulary projection (tied to the embeddings) stays float
    assert len(q["quantized_layers"]) == 13 and "head.dense" in q["quantized_layers"]
    assert not any(name in ("lm_head", "head.decoder") for name in q["quantized_layers"])
    report = compare(int8.path, data=corpus, seq_len=64)
    r = report.result
    assert report.passed, report.failures
    assert r["kind"] == "encoder" and r["precision"] == "int8"
    assert 0.99 <= r["embedding_cosine_min"] < 1.0 and 0.9 <= r["top1_agreement"] <= 1.0
    assert r["hidden_rel_l2"] > 1e-4  # quantization really changed the graph
    exact = compare(fp32.path, data=corpus, seq_len=64).result
    assert exact["hidden_rel_l2"] < 1e-5 and exact["top1_agreement"] == 1.0
    assert exact["embedding_cosine_min"] > 0.999999
