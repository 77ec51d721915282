"""Calibration: observers, quantization primitives against ONNX Runtime, and quantized `tiny` bundles."""

from __future__ import annotations

import collections
import hashlib
import json
import shutil

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from kvforge import metrics, runtime
from kvforge.calibration import Recipe, TensorObserver, calibrate
from kvforge.calibration.qdq import dequantize, quantize, weight_scales
from kvforge.errors import KvforgeError
from kvforge.model_defs.evaluate import heldout_text
from kvforge.runtime.evaluate import window_logits


# -- observers -----------------------------------------------------------------------
def _observe(x, batch):
    o = TensorObserver("t")
    for i in range(0, len(x), batch):
        o.observe_range(x[i:i + batch])
    for i in range(0, len(x), batch):
        o.observe_histogram(x[i:i + batch])
    return o


def test_observers_give_the_same_scales_whatever_the_batching():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal((4000, 16)), 25 * rng.standard_normal((3, 16))])
    a, b = _observe(x, 7), _observe(x, 1000)
    for method in ("max", "percentile", "mse", "entropy"):
        for fmt in ("int8", "fp8"):
            assert a.compute_amax(method, fmt) == b.compute_amax(method, fmt), (method, fmt)
    assert a.hist.nbytes == b.hist.nbytes == 2048 * 8  # constant memory, however much data


def test_methods_clip_outliers_that_max_keeps():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(200_000), [80.0, -75.0]])
    o = _observe(x, 10_000)
    amax = o.compute_amax("max", "int8")
    assert amax == pytest.approx(80.0)
    for method in ("percentile", "entropy"):
        clipped = o.compute_amax(method, "int8")
        assert 2.0 < clipped < 0.5 * amax, method
    # MSE is judged by what it minimizes: the real quantization error on the data
    from kvforge.calibration.observers import fake_quant

    def err(t):
        return float(np.mean((fake_quant(np.clip(x, -t, t), t, "int8") - x) ** 2))

    best = o.compute_amax("mse", "int8")
    assert err(best) <= min(err(amax), err(o.compute_amax("percentile", "int8"))) * 1.01


def test_nan_activations_are_named():
    o = TensorObserver("layers.1.ffn.down_proj.input")
    with pytest.raises(KvforgeError, match="down_proj.input.*NaN"):
        o.observe_range(np.array([1.0, np.nan]))


# -- primitives match ONNX Runtime's DequantizeLinear ----------------------------------
@pytest.mark.parametrize("fmt,K,block", [("int8", 64, None), ("fp8", 64, None), ("int4", 100, 32), ("int4", 64, 16)])
def test_quantized_weights_dequantize_identically_in_onnxruntime(fmt, K, block):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((K, 24)).astype(np.float32)
    scale = weight_scales(w, fmt, block)
    q = quantize(w, scale, fmt, block)
    ours = dequantize(q, scale, fmt, block)
    assert np.abs(ours - w).max() <= (np.repeat(scale, block, 0)[:K] if block else scale).max() * (0.51 if fmt != "fp8" else 32)
    attrs = {"axis": 0, "block_size": block} if fmt == "int4" else {"axis": 1}
    node = helper.make_node("DequantizeLinear", ["q", "s"], ["y"], **attrs)
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", TP.FLOAT, None)],
                              initializer=[numpy_helper.from_array(q, "q"), numpy_helper.from_array(scale, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    (theirs,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-6)
    if fmt == "fp8":
        assert q.dtype == ml_dtypes.float8_e4m3fn


@pytest.mark.parametrize("K", [96, 100])
def test_asymmetric_int4_blocks_are_the_least_error_range_and_dequantize_identically_in_onnxruntime(K):
    """Zero-point INT4 blocks (uint4 codes, a uint4 zero point per block): ONNX Runtime's DequantizeLinear gives
    the same values, and each block's range leaves no more squared error than its plain [min, max] (the oracle:
    asymmetric quantization written here from its definition) or the symmetric +-max|w| / 7 grid."""
    from kvforge.calibration.qdq import zero_point_blocks

    rng = np.random.default_rng(5)
    w = (rng.standard_normal((K, 24)) + 0.4).astype(np.float32)  # off-centre: a zero point has work to do
    w[3, 2] = 9.0  # an outlier: clipping it may lower the block's error
    scale, zp = zero_point_blocks(w, 32)
    q = quantize(w, scale, "int4", 32, zp)
    assert q.dtype == ml_dtypes.uint4 and zp.dtype == np.uint8 and zp.max() <= 15
    ours = dequantize(q, scale, "int4", 32, zp)
    node = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=0, block_size=32)
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", TP.FLOAT, None)], initializer=[
        numpy_helper.from_array(q, "q"), numpy_helper.from_array(scale, "s"),
        numpy_helper.from_array(zp.astype(ml_dtypes.uint4), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    (theirs,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {})
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-6)

    def block_errors(deq):
        e = np.zeros((-(-K // 32) * 32, 24))
        e[:K] = (deq - w) ** 2
        return e.reshape(-1, 32, 24).sum(1)

    padded = np.zeros((-(-K // 32) * 32, 24), np.float32)
    padded[:K] = w
    b = padded.reshape(-1, 32, 24)
    lo, hi = np.minimum(b.min(1), 0), np.maximum(b.max(1), 0)
    step = (hi - lo) / 15
    z = np.clip(np.round(-lo / step), 0, 15)
    plain = (np.clip(np.round(b / step[:, None]) + z[:, None], 0, 15) - z[:, None]) * step[:, None]
    plain = plain.reshape(-1, 24)[:K]
    sym_scale = weight_scales(w, "int4", 32)
    sym = dequantize(quantize(w, sym_scale, "int4", 32), sym_scale, "int4", 32)
    assert (block_errors(ours) <= block_errors(plain) * (1 + 1e-5) + 1e-9).all()
    assert block_errors(ours).sum() < 0.8 * block_errors(sym).sum()


def test_minimum_blocks_give_q4_1_weights_back_and_fit_others_closer_than_a_range_or_an_integer_zero_point():
    """INT4 blocks with a float minimum (llama.cpp's Q4_1 / Q4_K form): a weight gguf quantized to Q4_1 (the oracle:
    llama.cpp's reference quantizer in gguf-py) comes back on its own grid; on other weights each block leaves no
    more squared error than its plain [min, max] range with a float minimum (written here from the definition), and
    less in all than the integer zero point form."""
    import gguf

    from kvforge.calibration.qdq import minimum_blocks, zero_point_blocks

    rng = np.random.default_rng(11)
    rows = (rng.standard_normal((48, 128)) * 0.05 + 0.01).astype(np.float32)  # [N, K]: gguf blocks the last axis
    on_grid = gguf.quants.dequantize(gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q4_1),
                                     gguf.GGMLQuantizationType.Q4_1).T.copy()  # [K, N]
    scale, offset = minimum_blocks(on_grid, 32)
    back = dequantize(quantize(on_grid, scale, "int4", 32, offset=offset), scale, "int4", 32, offset=offset)
    np.testing.assert_allclose(back, on_grid, rtol=0, atol=1e-6 * np.abs(on_grid).max())

    w = (rng.standard_normal((100, 24)) + 0.4).astype(np.float32)  # K = 100: the last block is cut short
    w[3, 2] = 9.0
    scale, offset = minimum_blocks(w, 32)
    q = quantize(w, scale, "int4", 32, offset=offset)
    assert q.dtype == ml_dtypes.int4 and scale.shape == offset.shape == (4, 24)
    ours = dequantize(q, scale, "int4", 32, offset=offset)

    def block_errors(deq):
        e = np.zeros((128, 24))
        e[:100] = (deq - w) ** 2
        return e.reshape(4, 32, 24).sum(1)

    plain = np.zeros_like(w)
    for start in range(0, 100, 32):
        b = w[start:start + 32]
        lo, step = b.min(0), (b.max(0) - b.min(0)) / 15
        plain[start:start + 32] = np.round((b - lo) / step) * step + lo
    assert (block_errors(ours) <= block_errors(plain) * (1 + 1e-5) + 1e-9).all()
    zp_scale, zp = zero_point_blocks(w, 32)
    integer = dequantize(quantize(w, zp_scale, "int4", 32, zp), zp_scale, "int4", 32, zp)
    assert block_errors(ours).sum() < 0.9 * block_errors(integer).sum()


@pytest.mark.parametrize("K", [96, 100])
def test_minimum_blocks_run_in_onnxruntime_as_the_weight_they_stand_for(K):
    """The Q/DQ rewrite of a MatMul with minimum blocks (signed codes behind a DequantizeLinear, the offsets added on
    the activation side through block sums) computes, in ONNX Runtime, x @ (codes * scale + offset) (numpy, float64),
    padded K included; the offset table is not a layer find_targets would quantize again."""
    from kvforge.calibration.qdq import find_targets, minimum_blocks, rewrite
    from kvforge.ort_session import make_session

    rng = np.random.default_rng(2)
    w = (rng.standard_normal((K, 24)) * 0.1 + 0.02).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="proj")], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, ["b", "t", K])],
        [helper.make_tensor_value_info("y", TP.FLOAT, ["b", "t", 24])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    targets, _ = find_targets(model)
    record = rewrite(model, targets, "int4", None, 32, None, np.float32, zero_points=True)
    assert "offset" in record["weights"]["proj"] and "zero_point" not in record["weights"]["proj"]
    onnx.checker.check_model(model, full_check=True)
    assert find_targets(model, require_matches=False)[0] == []
    scale, offset = minimum_blocks(w, 32)
    expected_w = dequantize(quantize(w, scale, "int4", 32, offset=offset), scale, "int4", 32, offset=offset)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    (y,) = make_session(model.SerializeToString(), "int4").run(None, {"x": x})  # MatMulNBits, float32 sums
    np.testing.assert_allclose(y, x.astype(np.float64) @ expected_w, rtol=0, atol=1e-4)


@pytest.mark.parametrize("fmt,block", [("int8", None), ("fp8", None), ("int4", 16)])
def test_float16_scales_are_stored_exactly_and_never_flush_to_zero(fmt, block):
    """A float16 model's scales are float16: amax / qmax of a near-dead channel (here ~1e-8) would round to 0,
    which TensorRT refuses, or to a subnormal; codes must also round against the scale the graph stores."""
    from kvforge.calibration.qdq import QMAX, stored_scale

    w = np.random.default_rng(3).standard_normal((64, 4)).astype(np.float32)
    w[:, 1] *= 1e-6
    assert np.float16(np.abs(w[:, 1]).max() / QMAX[fmt]) < np.finfo(np.float16).tiny  # what a plain cast would store
    s = weight_scales(w, fmt, block, dtype=np.float16)
    assert s.dtype == np.float32 and np.array_equal(s.astype(np.float16).astype(np.float32), s)
    assert s.min() >= np.finfo(np.float16).tiny
    err = np.abs(dequantize(quantize(w, s, fmt, block), s, fmt, block) - w)
    per_row = np.repeat(s, block, 0)[:64] if block else s
    assert (err <= per_row * (0.5 if fmt != "fp8" else 16.0) + 1e-12).all()  # half a grid step (E4M3: 32 at the top)
    assert stored_scale(0.0, np.float16) == np.finfo(np.float16).tiny
    assert np.array_equal(weight_scales(w, fmt, block), weight_scales(w, fmt, block, dtype=np.float32))


# -- quantized tiny ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp32(tiny_fp32):
    return tiny_fp32


@pytest.fixture(scope="module")
def heldout(tiny_heldout):
    return tiny_heldout


def _quality(bundle_path, reference, chunks):
    with runtime.load(bundle_path) as s, runtime.load(reference) as r:
        nll, ref_nll, agree = [], [], []
        for (cand, targets), (ref, _) in zip(window_logits(s, chunks), window_logits(r, chunks)):
            nll.append(-np.take_along_axis(metrics.log_softmax(cand), targets[..., None], -1))
            ref_nll.append(-np.take_along_axis(metrics.log_softmax(ref), targets[..., None], -1))
            agree.append(metrics.top1_agreement(cand, ref))
    ppl = float(np.exp(np.mean(np.concatenate([n.ravel() for n in nll]))))
    ref_ppl = float(np.exp(np.mean(np.concatenate([n.ravel() for n in ref_nll]))))
    return 100 * (ppl / ref_ppl - 1), float(np.mean(agree))


@pytest.mark.slow
@pytest.mark.parametrize("precision,options,max_ppl_pct", [
    ("int8", {"method": "mse", "smoothquant": 0.5}, 1.0),
    ("fp8", {"method": "max"}, 0.5),
    ("int4", {"block_size": 32}, 2.0),
])
def test_quantized_tiny_stays_close_to_fp32(tmp_path, fp32, heldout, precision, options, max_ppl_pct):
    q = calibrate(fp32.path, tmp_path / precision, recipe="fixed", precision=precision, **options)
    delta, top1 = _quality(q.path, fp32.path, heldout)
    assert delta <= max_ppl_pct, f"perplexity +{delta:.2f}%"
    assert top1 >= 0.9, top1
    m = q.manifest
    assert m["lint"]["passed"], m["lint"]["findings"]
    assert m["precision"]["quantization"]["format"] == precision and m["stage"] == "calibrate"
    assert [e["stage"] for e in m["lineage"]] == ["export", "calibrate"]
    assert len(m["calibration"]["scales"]["weights"]) == 28
    if precision != "int4":
        c = m["calibration"]
        assert c["samples"] == 128 and c["seq_len"] == 256 and len(c["data_sha256"]) == 64 and not c["random_data"]
        assert c["data"] == "built-in tiny corpus" and len(c["scales"]["activations"]) == 16  # q/k/v and gate/up share theirs
    else:
        assert m["calibration"]["data"] is None


def test_int8_runs_on_integer_kernels_in_onnxruntime(tmp_path, fp32):
    """The speed of static INT8 comes from ORT fusing each Q/DQ/MatMul group; every quantized layer must fuse.
    (Per-token INT8, whose scales ORT's fusion cannot take, is moved onto the integer kernels by the runtime:
    tests/calibration/test_per_token.py.)"""
    q = calibrate(fp32.path, tmp_path / "int8", precision="int8", samples=8, seq_len=64, recipe="fixed")
    from kvforge.ort_session import QUANT_DISABLED_OPTIMIZERS as _QUANT_DISABLED_OPTIMIZERS

    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(q.graph_file), opts, providers=["CPUExecutionProvider"],
                         disabled_optimizers=_QUANT_DISABLED_OPTIMIZERS["int8"])
    ops = collections.Counter(n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)
    assert ops["MatMulIntegerToFloat"] + ops["QLinearMatMul"] == len(q.manifest["precision"]["quantization"]["quantized_layers"])


def test_fp8_relu_ffn_computes_what_the_graph_says_in_onnxruntime(micro_bundle, tmp_path):
    """ORT's ReluQuantRewrite drops a Relu before an FP8 QuantizeLinear (zero point 0); the runtime turns it off."""
    from kvforge.ort_session import make_session, prefill_feeds

    b = micro_bundle("classic-micro")
    # the fixed recipe: the runtime's variant folds a SmoothQuant Mul into the norm (equal up to float rounding)
    q = calibrate(b.path, tmp_path / "fp8", precision="fp8", random_data=True, samples=8, seq_len=32, recipe="fixed")
    ids = np.random.default_rng(0).integers(0, q.model_config["vocab_size"], (2, 16))
    feeds = prefill_feeds(ids, q.model_config, q.io, "float32")
    (plain,) = make_session(str(q.graph_file), optimization="none").run(["logits"], feeds)
    (ours,) = make_session(str(q.graph_file), "fp8").run(["logits"], feeds)
    np.testing.assert_allclose(ours, plain, rtol=0, atol=1e-4)
    with runtime.load(q.path) as s:
        np.testing.assert_allclose(s.forward(ids)[0], plain, rtol=0, atol=1e-4)


def test_int8_computes_what_the_graph_says_on_this_cpu(tmp_path, fp32):
    """Where this CPU's integer kernels saturate (x86 with AVX2 alone), the runtime runs INT8 as written instead;
    either way its logits equal the graph's Q/DQ function, computed here without any fusion."""
    from kvforge.ort_session import EXACT_QDQ, int8_kernels_exact, make_session, prefill_feeds, session_config

    q = calibrate(fp32.path, tmp_path / "int8", precision="int8", samples=8, seq_len=64)
    assert (session_config("int8") == EXACT_QDQ) == (not int8_kernels_exact())
    assert session_config("int8", ["CUDAExecutionProvider", "CPUExecutionProvider"]) == {}  # a CPU probe only
    ids = np.random.default_rng(0).integers(0, q.model_config["vocab_size"], (2, 24))
    feeds = prefill_feeds(ids, q.model_config, q.io, "float32")
    (plain,) = make_session(str(q.graph_file), optimization="none").run(["logits"], feeds)
    (ours,) = make_session(str(q.graph_file), "int8").run(["logits"], feeds)
    # Not bit-equal: a last-bit difference before a QuantizeLinear can move a value one step. Measured on tiny:
    # as written, relative L2 7.6e-4 and top-1 1.0; the saturating AVX2 kernels, 2.9e-2 and 0.979.
    assert np.linalg.norm(ours - plain) / np.linalg.norm(plain) < 5e-3
    # the same choices but at ties: a token differs only where the graph's own top two lie within twice the
    # largest logit difference of that row (random ids on tiny give near-ties; one flip in 48 was seen on a
    # VNNI CPU with the automatic recipe's smoothed graph)
    chosen, theirs = ours.argmax(-1), plain.argmax(-1)
    margin = np.take_along_axis(plain, theirs[..., None], -1) - np.take_along_axis(plain, chosen[..., None], -1)
    slack = 2 * np.abs(ours - plain).max(-1, keepdims=True)
    assert np.all(margin[..., 0][chosen != theirs] <= slack[..., 0][chosen != theirs])
    assert (chosen == theirs).mean() >= 0.95


def test_scales_do_not_depend_on_the_batch_size(tmp_path, fp32):
    # one as a Recipe (the options object the CLI passes), one as named fields over it: the same options
    options = Recipe(recipe="fixed", precision="int8", method="percentile", samples=12, seq_len=64, batch_size=1)
    a = calibrate(fp32.path, tmp_path / "a", options=options)
    b = calibrate(fp32.path, tmp_path / "b", options=options, batch_size=12)
    assert a.manifest["calibration"]["scales"] == b.manifest["calibration"]["scales"]
    assert [a.manifest["calibration"]["batch_size"], b.manifest["calibration"]["batch_size"]] == [1, 12]
    assert a.manifest["precision"]["quantization"]["method"] == "percentile"  # the object's options, not defaults


def test_exclusions_keep_layers_in_float(tmp_path, fp32):
    seen = []
    q = calibrate(fp32.path, tmp_path / "ex", precision="fp8", exclude=[r"down_proj", r"layers\.0\."], samples=8,
                  seq_len=64, progress=lambda phase, done, total: seen.append((phase, done, total)))
    quant = q.manifest["precision"]["quantization"]
    assert not any("down_proj" in n or n.startswith("layers.0.") for n in quant["quantized_layers"])
    # (the automatic recipe chose whether the vocabulary projection is quantized too)
    layers = [n for n in quant["quantized_layers"] if n != "lm_head"]
    assert len(layers) == 3 * 6 and "layers.2.ffn.down_proj" in quant["excluded_layers"]
    # the quantize bar moves a layer at a time over the layers quantized (each rewrite a candidate makes anew; a
    # head stored as INT8 blocks is a rewrite of its own, after the others)
    steps = [(done, total) for phase, done, total in seen if phase == "quantize"]
    blocks = len(quant.get("int8_layers", []))
    n = len(quant["quantized_layers"]) - blocks
    assert steps and steps[-(n + blocks):] == [(i, n) for i in range(1, n + 1)] + [(i, blocks) for i in range(1, blocks + 1)]


def test_data_files_and_their_errors(tmp_path, fp32):
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": heldout_text()[i * 3000:(i + 1) * 3000]}) for i in range(8)))
    q = calibrate(fp32.path, tmp_path / "j", precision="int8", data=jsonl, samples=4, seq_len=128)
    assert q.manifest["calibration"]["data"] == str(jsonl) and q.manifest["calibration"]["samples"] == 4
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(KvforgeError, match="holds no text"):
        calibrate(fp32.path, tmp_path / "e", precision="int8", data=tmp_path / "empty.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(KvforgeError, match=r"bad.jsonl:2 is not valid JSON"):
        calibrate(fp32.path, tmp_path / "e", precision="int8", data=tmp_path / "bad.jsonl")
    (tmp_path / "short.txt").write_text("x = 1")
    with pytest.raises(KvforgeError, match="calibration data has .* tokens; one sample needs seq_len=256"):
        calibrate(fp32.path, tmp_path / "e", precision="int8", data=tmp_path / "short.txt")
    assert not (tmp_path / "e").exists()


def test_data_files_read_as_users_write_them(tmp_path):
    from kvforge.calibration.data import read_texts

    jsonl = tmp_path / "u.jsonl"  # a byte-order mark, CRLF, and line/paragraph separators inside JSON strings
    jsonl.write_bytes(b"\xef\xbb\xbf" + '{"text": "a\u2028b"}\r\n"c\u2029d\u0085e"\r\n'.encode())
    assert read_texts(jsonl) == ["a\u2028b", "c\u2029d\u0085e"]
    upper = jsonl.rename(tmp_path / "U.JSONL")
    assert read_texts(upper) == ["a\u2028b", "c\u2029d\u0085e"]
    text = tmp_path / "t.txt"
    text.write_bytes(b"\xef\xbb\xbfdef f(): pass\n")
    assert read_texts(text) == ["def f(): pass\n"]


def test_token_ids_beyond_the_vocabulary_are_named(fp32, tmp_path):
    """A tokenizer that is not the model's gives ids its embedding cannot look up: named before ORT fails on them."""
    import types

    from kvforge.calibration.data import load_calibration_set

    config = {**fp32.model_config, "vocab_size": 300}
    small = types.SimpleNamespace(io=fp32.io, model_config=config, text_config=config,
                                  tokenizer_file=fp32.tokenizer_file, manifest=fp32.manifest, path=fp32.path)
    (tmp_path / "v.txt").write_text(heldout_text()[:5000])
    with pytest.raises(KvforgeError, match="tokenizes to id .*, but the model's vocabulary has 300 entries"):
        load_calibration_set(small, tmp_path / "v.txt", samples=2, seq_len=64)


def test_non_finite_weights_are_named(fp32):
    from kvforge.calibration.qdq import check_weights_finite
    from kvforge.calibration.qdq import find_targets

    model = onnx.load(str(fp32.graph_file))
    targets, _ = find_targets(model)
    check_weights_finite(model, targets)  # the sound graph passes; the broken one below must not
    t = next(t for t in targets if t.layer == "layers.3.ffn.down_proj")
    init = next(i for i in model.graph.initializer if i.name == t.weight)
    w = numpy_helper.to_array(init).copy()
    w[3, 5], w[0, 0] = np.nan, np.inf
    init.CopyFrom(numpy_helper.from_array(w, t.weight))
    with pytest.raises(KvforgeError, match="layer layers.3.ffn.down_proj's weight holds 2 NaN or infinite values"):
        check_weights_finite(model, targets)


def test_other_models_calibrate_on_the_built_in_prose_or_an_explicit_random_flag(micro_bundle, tmp_path):
    """A model with its own tokenizer reads the shipped English prose by default (recorded); random tokens only
    when asked; a bundle without a tokenizer has nothing to read text with, and says so."""
    b = micro_bundle("llama3-micro")
    assert b.tokenizer_file is not None
    q = calibrate(b.path, tmp_path / "q", precision="int8", samples=4, seq_len=32)
    assert q.manifest["calibration"]["data"] == "built-in English prose (botchan.txt, us_constitution.txt)"
    assert q.manifest["calibration"]["random_data"] is False
    q = calibrate(b.path, tmp_path / "q", precision="int8", random_data=True, samples=4, seq_len=32, force=True)
    assert q.manifest["calibration"]["random_data"] is True and q.manifest["calibration"]["data"] == "random tokens"
    no_tokenizer = tmp_path / "bare"
    shutil.copytree(b.path, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    manifest = json.loads((no_tokenizer / "kvforge.json").read_text())
    manifest["files"].pop("tokenizer.json")
    (no_tokenizer / "kvforge.json").write_text(json.dumps(manifest))
    with pytest.raises(KvforgeError, match="no calibration data: .* has no tokenizer"):
        calibrate(no_tokenizer, tmp_path / "q2", precision="int8")


def test_the_built_in_prose_is_measured_on_held_out_prose_of_another_source(micro_bundle):
    """Calibrating on the shipped prose, the automatic recipe measures its candidates on the fourth shipped text
    (another source and register): every held-out piece is a run of that text's tokens, spread over all of it,
    and none is in the calibration prose. With --data the pieces are the corpus's own (test_auto_recipe)."""
    from kvforge.calibration import load_calibration_set
    from kvforge.texts import builtin_prose
    from kvforge.tokenizer import Tokenizer

    b = micro_bundle("llama3-micro")
    cset = load_calibration_set(b, samples=4, seq_len=64, hold_out=1024)
    (text,), name = builtin_prose("held-out")
    assert cset.held_out_source == name and "loc_workshop_on_electronic_texts.txt" in name
    tok = Tokenizer.from_file(b.tokenizer_file)
    stream = tok.encode(text)
    calibration = [tok.encode(t) for t in builtin_prose("calibration")[0]]
    held = cset.held_out
    assert len(held) == 1024
    starts = []
    for i in range(0, len(held), 64):
        piece = held[i:i + 64]
        starts.append(next(s for s in range(len(stream) - 63) if stream[s:s + 64] == piece))
        run = piece[:24]
        assert not any(c[j:j + 24] == run for c in calibration for j in range(len(c) - 23))
    assert starts == sorted(starts) and starts[0] < len(stream) / 8 and starts[-1] > len(stream) * 7 / 8


def test_option_errors(tmp_path, fp32):
    with pytest.raises(TypeError, match=r"not Recipe fields: \['precison'\]"):
        calibrate(fp32.path, tmp_path / "x", precison="int8")
    with pytest.raises(TypeError, match="options are a Recipe, not str"):
        calibrate(fp32.path, tmp_path / "x", options="int8")
    with pytest.raises(KvforgeError, match="precision 'int3'"):
        calibrate(fp32.path, tmp_path / "x", precision="int3")
    with pytest.raises(KvforgeError, match="not a valid regular expression"):
        calibrate(fp32.path, tmp_path / "x", precision="int8", exclude=["("])
    with pytest.raises(KvforgeError, match="not to weight-only formats .got 0.5 for int4"):
        calibrate(fp32.path, tmp_path / "x", recipe="fixed", precision="int4", smoothquant=0.5)
    with pytest.raises(KvforgeError, match="seq_len 2000 exceeds the bundle's max context 1024"):
        calibrate(fp32.path, tmp_path / "x", precision="int8", seq_len=2000)
    with pytest.raises(KvforgeError, match="--block-size applies to the weight-only formats.*int8 W8A8 weights are per channel"):
        calibrate(fp32.path, tmp_path / "x", recipe="fixed", precision="int8", block_size=64)
    (tmp_path / "c.txt").write_text(heldout_text()[:20000])
    with pytest.raises(KvforgeError, match="--data and --random-data name two different calibration sets"):
        calibrate(fp32.path, tmp_path / "x", precision="int8", data=tmp_path / "c.txt", random_data=True)
    for options, message in [({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
                             ({"samples": 4.5}, "samples must be a positive integer, got 4.5"),
                             ({"seq_len": "64"}, "seq_len must be a positive integer, got '64'"),
                             ({"method": "percentile", "percentile": "99"}, "--percentile must be a number in \\(0, 100\\], got '99'"),
                             ({"method": "percentile", "percentile": 150}, "--percentile must be a number in \\(0, 100\\], got 150")]:
        with pytest.raises(KvforgeError, match=message):  # before any work
            calibrate(fp32.path, tmp_path / "x", recipe="fixed", precision="int8", **options)
    with pytest.raises(KvforgeError, match="block_size must be a positive integer, got 2.5"):
        calibrate(fp32.path, tmp_path / "x", recipe="fixed", precision="int4", block_size=2.5)
    with pytest.raises(KvforgeError, match=r"--exclude \['c_attn'\] matches no linear layer; their names look like \['layers.0.attn.q_proj'"):
        calibrate(fp32.path, tmp_path / "x", precision="int4", exclude=["c_attn", "down_proj"])
    with pytest.raises(KvforgeError, match="would sit inside the input bundle"):
        calibrate(fp32.path, fp32.path / "sub", precision="int4")
    assert not (fp32.path / "sub").exists()
    one = calibrate(fp32.path, tmp_path / "one", precision="int4", exclude="layers\\.0\\.")  # one pattern, as a string
    assert sum(name.startswith("layers.0.") for name in one.manifest["precision"]["quantization"]["excluded_layers"]) == 7
    with pytest.raises(KvforgeError, match="already quantized"):  # an INT4 bundle, as any quantized one
        calibrate(one.path, tmp_path / "x", precision="int8")
    assert not (tmp_path / "x").exists()


def test_fp8_kv_cache_holds_only_fp8_values(tmp_path, fp32, heldout):
    q = calibrate(fp32.path, tmp_path / "kv", recipe="fixed", precision="int8", method="mse", smoothquant=0.5, kv_cache="fp8")
    kv = q.manifest["calibration"]["scales"]["kv_cache"]
    names = [n for layer in q.io.present for n in layer]
    assert sorted(kv) == sorted(names) and q.manifest["precision"]["quantization"]["kv_cache"] == "fp8"
    assert q.manifest["lint"]["passed"]
    with runtime.load(q.path) as s:
        _, cache = s.forward(heldout[:2, :30].copy())
        _, cache = s.forward(np.array([[7], [9]], np.int64), cache=cache)
        for name, a in zip(names, s.backend.cache_arrays(cache)):
            scale = kv[name]["scale"]
            np.testing.assert_array_equal((a / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale, a)
    delta, _ = _quality(q.path, fp32.path, heldout[:16])
    assert delta <= 1.0
    with pytest.raises(KvforgeError, match="with W8A8 int8 or fp8, not a weight-only format"):
        calibrate(fp32.path, tmp_path / "x", precision="int4", kv_cache="fp8")


def test_a_quantized_lm_head_runs_and_matches_the_exact_graph(micro_bundle, tmp_path):
    """--quantize-lm-head on an untied model: the runtime's faster ORT variant slices before the head's Q/DQ pair."""
    from kvforge import runtime

    fp32 = micro_bundle("mistral-micro")
    q = calibrate(fp32.path, tmp_path / "q", precision="int8", random_data=True, samples=8, seq_len=32, quantize_lm_head=True)
    assert "lm_head" in q.manifest["precision"]["quantization"]["quantized_layers"]
    ids = np.random.default_rng(0).integers(0, q.model_config["vocab_size"], (2, 12))
    with runtime.load(q.path) as fast, runtime.load(q.path, variant=False) as exact:
        last, cache = fast.forward(ids, last_logits_only=True)
        full, _ = exact.forward(ids)
        np.testing.assert_allclose(last[:, 0], full[:, -1], rtol=1e-4, atol=1e-4)
        step, _ = fast.forward(np.array([[5], [6]]), cache=cache, last_logits_only=True)
        assert step.shape == (2, 1, q.model_config["vocab_size"]) and np.isfinite(step).all()


@pytest.mark.parametrize("precision, block, smoothquant", [("int8", None, 0.5), ("fp8", None, None), ("int4", 48, None)])
def test_a_tied_lm_head_is_quantized_and_stored_once(fp32, heldout, tmp_path, precision, block, smoothquant):
    """tiny ties its head to the embedding; --quantize-lm-head quantizes the one tensor both read: the head through a
    Transpose of its DequantizeLinear, the embedding Gather through the same DequantizeLinear (INT4 block 48 pads
    K=256 to 288: the Gather reads the unpadded columns). No float copy of the table is left in the bundle; the ORT
    variant computes what the graph says."""
    q = calibrate(fp32.path, tmp_path / "q", recipe="fixed", precision=precision, samples=16, seq_len=128,
                  quantize_lm_head=True, **({"block_size": block} if block else {}),
                  **({"smoothquant": smoothquant} if smoothquant else {}))
    assert "lm_head" in q.manifest["precision"]["quantization"]["quantized_layers"]
    assert q.manifest["calibration"]["scales"]["weights"]["lm_head"]["shared_with_embedding"] == "model.lm_head.weight"
    g = onnx.load(str(q.graph_file)).graph
    weights = {i.name: i for i in g.initializer}
    tables = [i.name for i in weights.values() if len(i.dims) == 2 and 4096 in i.dims and min(i.dims) >= 256]
    assert tables == ["model.embed_and_lm_head.weight_quantized"]  # one table, not a float copy beside it
    assert list(weights["model.embed_and_lm_head.weight_quantized"].dims) == [4096, 288 if block else 256]
    producer = {o: n for n in g.node for o in n.output}
    transpose = producer[producer["logits"].input[1]]
    dq = producer[transpose.input[0]]
    assert transpose.op_type == "Transpose" and dq.op_type == "DequantizeLinear" and dq.input[0] == "model.embed_and_lm_head.weight_quantized"
    gather = next(n for n in g.node if n.op_type == "Gather" and "input_ids" in n.input)
    table = producer[gather.input[0]]
    assert (table.op_type == "Slice" and producer[table.input[0]] is dq) if block else table is dq
    if smoothquant:  # the head's rows hold SmoothQuant's diag(s): the embedding divides it out after the Gather
        consumer = next(n for n in g.node if gather.output[0] in n.input)
        assert consumer.op_type == "Mul" and "model.embed_and_lm_head.weight_unsmooth" in consumer.input
    assert q.manifest["lint"]["passed"], q.manifest["lint"]["findings"]
    # the embedding is the head's dequantized codes, row for row
    codes = numpy_helper.to_array(weights["model.embed_and_lm_head.weight_quantized"]).astype(np.float32)
    scale = numpy_helper.to_array(weights["model.embed_and_lm_head.weight_scale"]).astype(np.float32)
    rows = codes * (np.repeat(scale, block, axis=1) if block else scale[:, None])
    if smoothquant:
        unsmooth = numpy_helper.to_array(weights["model.embed_and_lm_head.weight_unsmooth"])
        rows, scale = rows * unsmooth, scale[:, None] * unsmooth  # a code's step on each embedding column
    original = numpy_helper.to_array(next(i for i in onnx.load(str(fp32.graph_file)).graph.initializer if i.name == "model.lm_head.weight"))
    step = scale.max()
    assert np.abs(rows[:, :256] - original).max() <= step * (0.51 if precision != "fp8" else 32)
    reference = runtime.load(fp32.path)
    with reference, runtime.load(q.path, variant=False) as exact, runtime.load(q.path) as fast:
        for (lq, _), (lf, _), (lr, _) in zip(window_logits(exact, heldout[:4]), window_logits(fast, heldout[:4]),
                                             window_logits(reference, heldout[:4])):
            # the variant's fused norms round a little differently, and a quantized activation can flip a code on it
            assert metrics.top1_agreement(lf, lq) > 0.99 and metrics.kl_divergence(lf, lq).mean() < 1e-3
            assert metrics.top1_agreement(lq, lr) > (0.9 if precision != "int4" else 0.75)
            assert metrics.kl_divergence(lq, lr).mean() < (0.02 if precision != "int4" else 0.1)


def test_a_tied_int4_head_with_minimums_runs_as_its_graph(tmp_path, fp32, heldout):
    """A tied head in INT4 blocks with minimums keeps uint4 codes and a zero point per block, which the embedding
    reads too: ONNX Runtime's variant gives the embedding its float rows, (codes - zero point) * scale, and the
    head its transposed codes. Held to the bundle's graph as written (a table without its zero points put every
    logit off by up to 7.6 on tiny)."""
    q = calibrate(fp32.path, tmp_path / "q", recipe="fixed", precision="int4", zero_points=True, quantize_lm_head=True)
    assert q.manifest["calibration"]["scales"]["weights"]["lm_head"]["shared_with_embedding"]
    with runtime.load(q.path) as fast, runtime.load(q.path, variant=False) as exact:
        a, _ = fast.forward(heldout[:2, :24])
        e, _ = exact.forward(heldout[:2, :24])
    np.testing.assert_allclose(a, e, atol=1e-4 * np.abs(e).max(), rtol=0)


def test_int4_blocks_that_do_not_divide_k_are_padded_whole_and_exact(tmp_path, fp32, heldout):
    """Block 48 divides neither tiny's K=256 nor K=704: the codes are padded to whole blocks (TensorRT reads the
    block size as K / scale rows), the activation gets zero columns, and the graph computes exactly x @ dequant(W)."""
    from kvforge.calibration.qdq import find_targets

    q = calibrate(fp32.path, tmp_path / "int4", recipe="fixed", precision="int4", block_size=48, random_data=True)
    assert q.manifest["lint"]["passed"], q.manifest["lint"]["findings"]
    step = q.manifest["lineage"][-1]
    assert step["input"]["source"] == str(fp32.path.resolve())  # absolute, as docs/bundle.md says
    assert step["options"]["random_data"] is False and q.manifest["calibration"]["data"] is None  # RTN INT4 reads no data
    g = onnx.load(str(q.graph_file)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    records = q.manifest["calibration"]["scales"]["weights"]
    dequantized = {}
    for layer, rec in records.items():
        codes, scale = inits[f"{layer}.weight_quantized"], inits[f"{layer}.weight_scale"]
        K = rec["shape"][0]
        assert codes.shape[0] == 48 * scale.shape[0] == K + rec["k_padding"] > K
        assert not codes[K:].astype(np.int8).any()  # the padding codes are zeros
        # the manifest's digest is of the graph's scales
        assert rec["scale"]["sha256"] == hashlib.sha256(np.ascontiguousarray(scale).tobytes()).hexdigest()
        assert rec["scale"]["shape"] == list(scale.shape) and rec["scale"]["max"] == float(scale.max())
        dequantized[layer] = dequantize(codes[:K], scale, "int4", 48)
    assert sum(n.op_type == "Pad" for n in g.node) == 4 * 4  # per block: q/k/v, o_proj, gate/up and down_proj inputs
    # the same function in float: the FP32 graph with its weights replaced by the dequantized ones
    reference = onnx.load(str(fp32.graph_file))
    targets, _ = find_targets(reference)
    weights = {i.name: i for i in reference.graph.initializer}
    for t in targets:
        weights[t.weight].CopyFrom(numpy_helper.from_array(dequantized[t.layer], t.weight))
    feeds_ids = heldout[:2, :64].copy()
    with runtime.load(q.path, variant=False) as s, runtime.load(q.path) as fast:
        ours, _ = s.forward(feeds_ids)
        np.testing.assert_allclose(fast.forward(feeds_ids)[0], ours, rtol=0, atol=2e-4)  # the runtime's ORT variant
    from kvforge.ort_session import make_session, prefill_feeds

    (theirs,) = make_session(reference.SerializeToString()).run(["logits"], prefill_feeds(feeds_ids, fp32.model_config, fp32.io, "float32"))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-4)
