"""ONNX export: every preset and HF family matches the Torch reference; defects fail the export."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.bundle import MANIFEST, Bundle
from kvforge.errors import KvforgeError
from kvforge.export import ExportValidationError, export
from kvforge.export import kinds as export_kinds
from kvforge.export.onnx_export import FlatKVModel, example_inputs, input_names
from kvforge.export.validate_inputs import ROUTING_TIE
from kvforge.model_defs import PRESETS, load

from ..conftest import HF_FAMILIES, make_hf_model

MICRO = sorted(n for n in PRESETS if n.endswith("-micro"))
ATOL = 1e-4  # FP32 graph vs FP32 Torch, the bound


def _session(bundle: Bundle) -> ort.InferenceSession:
    return ort.InferenceSession(str(bundle.graph_file), providers=["CPUExecutionProvider"])


@torch.no_grad()
def _independent_check(bundle: Bundle, model, shapes, seed=0):
    """Our own ORT-vs-Torch comparison, separate from the validator under test."""
    sess = _session(bundle)
    cfg = model.config
    flat = FlatKVModel(model)
    for i, (b, t, p) in enumerate(shapes):
        args = example_inputs(cfg, torch.float32, b, t, p, seed=seed + i)
        out = sess.run(None, {n: a.numpy() for n, a in zip(input_names(cfg), args)})
        ref = flat(*args)
        for o, r in zip(out, ref):
            np.testing.assert_allclose(o, r.numpy(), atol=ATOL, rtol=0, err_msg=f"shape {(b, t, p)}")


def _assert_validated_fp32(bundle: Bundle):
    v = bundle.manifest["validation"]
    assert v["passed"] and not v["failures"]
    assert v["logits"]["max_abs"] <= ATOL and v["present"]["max_abs"] <= ATOL
    assert v["lockstep"]["steps"] == 32 and v["lockstep"]["greedy_matching_steps"] == 32
    assert v["lockstep"]["logits"]["max_abs"] <= ATOL
    assert bundle.manifest["lint"]["passed"], bundle.manifest["lint"]["findings"]
    # a mixture's case routed at a tie is shown with its margin and not judged; every other case is
    tied = [c for c in v["case_results"] if "routing_margin" in c]
    assert all(c["routing_margin"] < ROUTING_TIE for c in tied)
    assert all(c["excess"] <= 1.0 for c in v["case_results"] if c not in tied) and len(tied) <= 2


@pytest.mark.parametrize("name", MICRO)
def test_every_micro_preset_exports_and_matches(micro_bundle, name):
    bundle = micro_bundle(name)
    _assert_validated_fp32(bundle)
    model, _ = load(name)
    _independent_check(bundle, model, [(1, 1, 0), (2, 5, 0), (3, 1, 40), (2, 3, 17)])


@pytest.mark.slow  # every Hugging Face family: 22 exports (~300 s of tracing); the default tier exports every preset
@pytest.mark.parametrize("family", HF_FAMILIES)
def test_every_hf_family_exports_and_matches(hf_bundle, hf_checkpoint, family):
    bundle = hf_bundle(family)
    _assert_validated_fp32(bundle)
    model, _ = load(hf_checkpoint(family))
    _independent_check(bundle, model, [(1, 1, 0), (3, 4, 0), (2, 1, 21)])
    assert bundle.manifest["lineage"][0]["input"]["kind"] == "hf"
    # export's own end-to-end check: transformers on the same files and seeded token ids (no tokenizer here)
    o = bundle.manifest["oracle"]
    assert o["compared"] and o["passed"] and o["inputs"] == "token ids", o


@pytest.mark.slow  # reads the slow tier's exports of every family
@pytest.mark.parametrize("family", HF_FAMILIES)
@torch.no_grad()
def test_the_graph_matches_transformers(hf_bundle, family):
    """The exported graph against transformers itself (no kvforge Torch in between), 1e-4 on FP32 logits:
    a prefill, cached decode steps fed the graph's own presents (capped where windowed), a left-padded batch."""
    bundle = hf_bundle(family)
    hf_model = make_hf_model(family)
    sess = _session(bundle)
    names = [i.name for i in sess.get_inputs()]
    io = bundle.io
    ids = torch.randint(3, 300, (2, 14), generator=torch.Generator().manual_seed(7))

    def run(step_ids, mask, past):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        out = sess.run(None, dict(zip(names, [step_ids.numpy(), mask.numpy(), pos.numpy(), *past])))
        return out[0], out[1:]

    empty = [np.zeros(io.empty_shape(n, 2), np.float32) for n in names[3:]]  # per-head K/V, or latent attention's latent
    logits, past = run(ids[:, :6], torch.ones(2, 6, dtype=torch.int64), empty)
    np.testing.assert_allclose(logits, hf_model(ids[:, :6]).logits.numpy(), atol=ATOL, rtol=0)
    for t in range(6, 14):  # past the windows of every windowed config
        logits, past = run(ids[:, t:t + 1], torch.ones(2, t + 1, dtype=torch.int64), past)
        np.testing.assert_allclose(logits[:, -1], hf_model(ids[:, :t + 1]).logits[:, -1].numpy(), atol=ATOL, rtol=0,
                                   err_msg=f"decode at position {t}")
    firsts = [names[3:].index(layer[0]) for layer in io.past]
    assert [past[k].shape[2] for k in firsts] == io.cache_lengths(14)  # windowed layers hold only their window
    mask = torch.ones(2, 14, dtype=torch.int64)
    mask[1, :5] = 0
    logits, _ = run(ids, mask, empty)
    np.testing.assert_allclose(logits[0], hf_model(ids[:1]).logits[0].numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(logits[1, 5:], hf_model(ids[1:, 5:]).logits[0].numpy(), atol=ATOL, rtol=0)


def test_io_contract_names_and_dynamic_dims(micro_bundle):
    bundle = micro_bundle("llama3-micro")
    m = onnx.load(str(bundle.graph_file))
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in list(m.graph.input) + list(m.graph.output)}
    assert dims["input_ids"] == ["batch_size", "sequence_length"]
    assert dims["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert dims["position_ids"] == ["batch_size", "sequence_length"]
    assert dims["past_key_values.1.value"] == ["batch_size", 2, "past_sequence_length", 16]
    assert dims["logits"] == ["batch_size", "sequence_length", 259]
    assert dims["present.0.key"] == ["batch_size", 2, "total_sequence_length", 16]
    io = bundle.io
    assert io.past[1] == ["past_key_values.1.key", "past_key_values.1.value"]
    assert io.present[0] == ["present.0.key", "present.0.value"]
    assert io.max_context == PRESETS["llama3-micro"]["max_seq_len"]
    bundle.verify_files()


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 5), t=st.integers(1, 12), p=st.integers(0, 70))
def test_shape_fuzzing_no_dimension_is_specialized(micro_bundle, b, t, p):
    """Shapes far from the export example (2, 3, 5) run and match: no dimension was baked in."""
    bundle = micro_bundle("qwen2-micro")
    model, _ = load("qwen2-micro")
    _independent_check(bundle, model, [(b, t, p)], seed=b * 1000 + t * 100 + p)


@torch.no_grad()
def test_left_padded_batch_through_the_graph(micro_bundle):
    bundle = micro_bundle("mistral-micro")
    model, _ = load("mistral-micro")
    sess = _session(bundle)
    cfg = model.config
    rows = [torch.randint(0, 259, (n,), generator=torch.Generator().manual_seed(n)) for n in (14, 9)]
    ids = torch.zeros(2, 14, dtype=torch.int64)
    mask = torch.zeros(2, 14, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, 14 - len(r):], mask[i, 14 - len(r):] = r, 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    empty = [np.zeros((2, cfg.n_kv_heads, 0, cfg.head_dim), np.float32)] * (2 * cfg.n_layers)
    out = sess.run(None, dict(zip(input_names(cfg), [ids.numpy(), mask.numpy(), pos.numpy(), *empty])))
    for i, r in enumerate(rows):
        alone, _ = model(r[None])
        np.testing.assert_allclose(out[0][i, 14 - len(r):], alone[0].numpy(), atol=ATOL, rtol=0)


@torch.no_grad()
def test_sliding_window_is_in_the_graph(micro_bundle):
    """With past > window, the graph agrees with the windowed model and not with full attention."""
    bundle = micro_bundle("mistral-micro")  # window 8
    model, _ = load("mistral-micro")
    full = type(model)  # same class; rebuild without the window
    from kvforge.model_defs import ModelConfig, build_model

    no_window = build_model(ModelConfig(**{**model.config.to_dict(), "sliding_window": None}))
    no_window.load_state_dict(model.state_dict())
    full_args = example_inputs(no_window.config, torch.float32, 1, 3, 30, seed=3)  # caches of all 30 positions
    args = full_args[:3] + tuple(c[:, :, -8:] for c in full_args[3:])  # the windowed graph keeps the newest 8
    out = _session(bundle).run(None, {n: a.numpy() for n, a in zip(input_names(model.config), args)})
    np.testing.assert_allclose(out[0], FlatKVModel(model)(*args)[0].numpy(), atol=ATOL, rtol=0)
    assert [o.shape[2] for o in out[1:]] == [8] * 4  # present: capped at the window too
    assert np.abs(out[0] - FlatKVModel(no_window.eval())(*full_args)[0].numpy()).max() > 1e-3
    assert full is type(no_window)


def _with_decoder_writer(monkeypatch, wrap) -> None:
    """Swap the decoder kind's graph writer for `wrap(real writer)` for this test (export/kinds.py EXPORTS)."""
    decoder = export_kinds.EXPORTS["decoder"]
    monkeypatch.setitem(export_kinds.EXPORTS, "decoder", decoder._replace(write=wrap(decoder.write)))


def test_a_wrong_graph_fails_the_export_and_writes_nothing(tmp_path, monkeypatch):
    def corrupting(real):
        def write(model, directory, *a):
            graphs = real(model, directory, *a)
            _corrupt(directory / graphs.main)
            return graphs

        return write

    def _corrupt(path):
        m = onnx.load(str(path))
        biggest = max(m.graph.initializer, key=lambda t: np.prod(t.dims))
        arr = onnx.numpy_helper.to_array(biggest).copy()
        arr.flat[0] += 0.5  # one weight off
        biggest.CopyFrom(onnx.numpy_helper.from_array(arr, biggest.name))
        onnx.save(m, str(path))

    _with_decoder_writer(monkeypatch, corrupting)
    out = tmp_path / "bad"
    with pytest.raises(ExportValidationError, match=r"(?s)logits_max_abs .* rounding noise.*no bundle was written") as err:
        export("gpt2-micro", out)
    assert err.value.summary["failures"]
    assert list(tmp_path.iterdir()) == []  # neither the bundle nor a temporary directory


def test_force_replaces_only_after_success(micro_bundle, tmp_path, monkeypatch):
    out = tmp_path / "b"
    first = Bundle(shutil.copytree(micro_bundle("reglu-micro").path, out))  # the run's export of it, as written
    first_hash = first.manifest["files"]["model.onnx"]["sha256"]

    def failing(real):
        def boom(*a, **k):
            raise KvforgeError("simulated failure during export")

        return boom

    _with_decoder_writer(monkeypatch, failing)
    with pytest.raises(KvforgeError, match="simulated"):
        export("gpt2-micro", out, force=True)
    assert Bundle(out).manifest["files"]["model.onnx"]["sha256"] == first_hash  # the old bundle survived
    monkeypatch.undo()
    second = export("gpt2-micro", out, force=True)
    assert second.model_config["family"] == "gpt2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_an_interrupted_replace_puts_the_previous_bundle_back(micro_bundle, tmp_path, monkeypatch):
    """Where the OS cannot swap two directories in one step, the replace is two renames; interrupted between
    them, the previous bundle goes back (on Linux the swap is one step: tests/reliability kills it mid-way)."""
    import os

    from kvforge import outputs as outputs_mod

    out = tmp_path / "b"
    first = Bundle(shutil.copytree(micro_bundle("reglu-micro").path, out))  # the run's export of it, as written
    real = os.replace
    monkeypatch.setattr(outputs_mod, "_exchange", lambda a, b: False)

    def interrupted(src, dst):
        if str(src).startswith(str(tmp_path / ".b.tmp-")):  # the new bundle's rename: as if Ctrl-C landed here
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(outputs_mod.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export("gpt2-micro", out, force=True)
    monkeypatch.undo()
    assert Bundle(out).manifest["files"] == first.manifest["files"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_output_and_option_errors(tmp_path):
    (tmp_path / "exists").mkdir()
    with pytest.raises(KvforgeError, match="already exists; pass --force"):
        export("gpt2-micro", tmp_path / "exists")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(KvforgeError, match="cannot create"):
        export("gpt2-micro", tmp_path / "afile" / "sub" / "out")
    with pytest.raises(KvforgeError, match="unknown model source"):
        export("nope", tmp_path / "o")
    with pytest.raises(KvforgeError, match="opset 30 is outside"):
        export("gpt2-micro", tmp_path / "o", opset=30)
    with pytest.raises(KvforgeError, match="exceeds the 256 learned positions"):
        export("gpt2-micro", tmp_path / "o", max_context=1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "exists"]


def test_external_data(tmp_path):
    bundle = export("llama3-micro", tmp_path / "ext", external_data=True)
    assert (bundle.path / "model.onnx.data").is_file()
    assert bundle.manifest["external_data"] == "model.onnx.data"
    assert "model.onnx.data" in bundle.manifest["files"]
    graph_bytes = bundle.path.joinpath("model.onnx").stat().st_size
    assert graph_bytes < bundle.path.joinpath("model.onnx.data").stat().st_size / 4  # weights are not inline
    assert b"/work/" not in bundle.path.joinpath("model.onnx").read_bytes()  # no local paths in the artifact
    _assert_validated_fp32(bundle)


def test_damaged_bundles_are_named(tmp_path, micro_bundle):
    import shutil

    b = shutil.copytree(micro_bundle("gpt2-micro").path, tmp_path / "b")
    data = (b / "model.onnx").read_bytes()
    (b / "model.onnx").write_bytes(data[:-10])
    with pytest.raises(KvforgeError, match="model.onnx has .* bytes, the manifest says"):
        Bundle(b).verify_files()
    import json

    good = json.loads((b / MANIFEST).read_text())
    damaged = [
        ("[]", "format 'list' is not"),
        (b"\xff{}", "not valid JSON"),
        ({**good, "format_version": "2"}, "is damaged: 'format_version' is the string '2', expected an integer"),
        ({k: v for k, v in good.items() if k != "precision"}, "'precision' is missing"),
        ({**good, "io": []}, "'io' is a list, expected a dict"),
        ({**good, "model": {k: v for k, v in good["model"].items() if k != "vocab_size"}}, "is damaged: 'model.vocab_size' is missing"),
        ({**good, "io": {"inputs": 3}}, "is damaged: 'io.outputs' is missing"),
    ]
    for content, message in damaged:
        if isinstance(content, bytes):
            (b / MANIFEST).write_bytes(content)
        else:
            (b / MANIFEST).write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(KvforgeError, match=message):
            Bundle(b)
    (b / MANIFEST).write_text("{oops")
    with pytest.raises(KvforgeError, match="not valid JSON"):
        Bundle(b)
    with pytest.raises(KvforgeError, match="no kvforge.json"):
        Bundle(tmp_path)


def test_the_transformers_check_counts_the_weight_files_transformers_maps(tmp_path, monkeypatch):
    """transformers keeps a checkpoint's weight files mapped while it builds its float32 copy (a BF16 Qwen2.5-1.5B:
    6.0 GiB of float32 beside 2.96 GiB of mapped files, measured): where the two would not fit the export's bound
    though the float32 copy alone would, the check is skipped and says why (nothing is loaded)."""
    from kvforge.export import oracle

    directory = tmp_path / "ckpt"
    make_hf_model("llama").save_pretrained(directory, safe_serialization=True)
    reference, _ = load(str(directory))
    fp32 = 4 * sum(p.numel() for p in reference.parameters())
    layer = max(p.numel() for p in reference.parameters() if reference.config.vocab_size not in p.shape)
    files = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    assert files > 0
    empty = tmp_path / "bundle"
    empty.mkdir()
    monkeypatch.setattr(oracle, "PROCESS_BYTES", 0)
    monkeypatch.setattr(oracle, "FP64_BLOCK_BYTES", 0)
    monkeypatch.setattr(oracle, "BOUND_MARGIN_BYTES", fp32 + 8 * layer + files // 2)  # float32 fits; with files, no
    record = oracle.check(str(directory), empty, "decoder", reference, None, "float32")
    assert record["compared"] is False and "weight files" in record["reason"], record
