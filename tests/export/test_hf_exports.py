"""Hugging Face encoders and encoder-decoders exported: the ONNX graphs against transformers itself, and
`kvforge generate` on T5 and BART bundles against transformers' greedy generate.

The checkpoints are written by transformers (random weights, every parameter perturbed; see
tests/model_defs/test_hf_encoders.py and test_hf_seq2seq.py); the comparisons skip kvforge's Torch model:
ONNX Runtime's outputs are held to 1e-4 of transformers' own."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("transformers")

from kvforge.cli import main  # noqa: E402
from kvforge.export import export  # noqa: E402
from kvforge.tokenizer import Tokenizer  # noqa: E402
from tests.model_defs import test_hf_encoders as enc  # noqa: E402
from tests.model_defs import test_hf_seq2seq as s2s  # noqa: E402

ATOL = 1e-4


def _ort(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@torch.no_grad()
def test_bert_masked_lm_graph_matches_transformers(tmp_path):
    class_name, config = enc.CASES["bert-mlm"]
    hf = enc.make_model(class_name, **config)
    hf.save_pretrained(tmp_path / "hf")
    bundle = export(tmp_path / "hf", tmp_path / "bundle", max_context=32)
    ids, mask, types = enc.batch(hf.config)
    out = dict(zip(["last_hidden_state", "logits"], _ort(bundle.graph_file).run(
        None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": types.numpy()})))
    expected = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    real = mask.numpy().astype(bool)
    assert np.abs(out["logits"][real] - expected.logits.numpy()[real]).max() < ATOL
    assert np.abs(out["last_hidden_state"][real] - expected.hidden_states[-1].numpy()[real]).max() < ATOL


# the byte-level tokenizer's special ids: <s> 256, </s> 257, <pad> 258
_SPECIALS = {"t5": dict(vocab_size=300, pad_token_id=258, eos_token_id=257, decoder_start_token_id=258),
             "bart": dict(vocab_size=300, pad_token_id=258, bos_token_id=256, eos_token_id=257,
                          decoder_start_token_id=257, forced_eos_token_id=257)}


@pytest.mark.slow  # four traces (T5 and BART, encoder and decoder) no default test shares; the default tier keeps
# both designs against kvforge's Torch reference (tests/export/test_seq2seq.py) and the CLI's encoder-decoder kind
@pytest.mark.parametrize("family, config", [
    ("t5", dict(s2s._T5, num_decoder_layers=2, feed_forward_proj="relu", layer_norm_epsilon=1e-5)),  # v1.0: tied + rescale
    ("bart", dict(s2s._BART, decoder_attention_heads=6, decoder_ffn_dim=64, scale_embedding=True)),
])
@torch.no_grad()
def test_seq2seq_graphs_and_kvforge_generate_match_transformers(family, config, tmp_path):
    """The exported graphs against transformers at the first step and over cached steps (1e-4), then
    `kvforge generate` against transformers' greedy generate."""
    hf = s2s.make_model(family, **{**config, **_SPECIALS[family]})
    hf.save_pretrained(tmp_path / "hf")
    Tokenizer.byte_level().save(tmp_path / "hf")
    bundle = export(tmp_path / "hf", tmp_path / "bundle", max_context=32)
    # export's own check: transformers' model and tokenizer from the same files, from text, through both graphs
    o = bundle.manifest["oracle"]
    assert o["compared"] and o["passed"] and o["inputs"] == "text" and o["token_ids_equal"], o
    assert o["outputs"] == ["last_hidden_state", "logits"] and o["worst"]["ratio"] <= o["noise_multiple"]
    cfg = bundle.manifest["model"]
    ids, mask = s2s.source(hf.config)
    dec = s2s.target(hf.config, cfg["decoder_start_token_id"])
    expected = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    encoder = _ort(bundle.path / "encoder_model.onnx")
    hidden, *cross = encoder.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    real = mask.numpy().astype(bool)
    assert np.abs(hidden[real] - expected.encoder_last_hidden_state.numpy()[real]).max() < ATOL
    decoder = _ort(bundle.path / "decoder_model.onnx")
    names = [i.name for i in decoder.get_inputs()]
    B, H, D = ids.shape[0], cfg["decoder_heads"], cfg["decoder_head_dim"]
    past = [np.zeros((B, H, 0, D), np.float32)] * (2 * cfg["n_decoder_layers"])
    for t in range(dec.shape[1]):  # the first step (past 0), then each cached one
        feeds = [dec[:, t:t + 1].numpy(), mask.numpy()]
        for i in range(cfg["n_decoder_layers"]):
            feeds += [past[2 * i], past[2 * i + 1], cross[2 * i], cross[2 * i + 1]]
        logits, *past = decoder.run(None, dict(zip(names, feeds)))
        assert np.abs(logits[:, 0] - expected.logits[:, t].numpy()).max() < ATOL, f"step {t}"
    for prompt in ("translate: hello world", "a"):
        result = CliRunner().invoke(main, ["generate", str(bundle.path), "--prompt", prompt, "--max-new-tokens", "12", "--json"])
        assert result.exit_code == 0, result.output
        ours = json.loads(result.output.strip().splitlines()[-1])["tokens"]
        src = torch.tensor([Tokenizer.byte_level().encode(prompt)])
        theirs = hf.generate(input_ids=src, attention_mask=torch.ones_like(src), max_new_tokens=12, do_sample=False,
                             num_beams=1)[0, 1:].tolist()  # without the decoder start token
        if 257 in theirs:  # transformers pads a finished row; kvforge stops at the end token
            theirs = theirs[:theirs.index(257) + 1]
        assert ours == theirs, prompt
