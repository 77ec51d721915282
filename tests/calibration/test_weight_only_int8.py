"""Weight-only INT8 (`kvforge calibrate --precision int8 --weights-only`): each linear layer's weights in blocks of
32 along K with one scale each (llama.cpp's Q8_0 form), the activations left in float, no calibration data read.

Oracles: gguf's own Q8_0 quantizer for the codes and scales; the FP32 graph with its weights replaced by the
dequantized codes, run by ONNX Runtime, for the function; the Torch FP32 reference for the accuracy."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kvforge import metrics, runtime
from kvforge.calibration import calibrate
from kvforge.calibration.qdq import dequantize, find_targets
from kvforge.errors import KvforgeError
from kvforge.ort_session import make_session, prefill_feeds
from kvforge.runtime.evaluate import window_logits


@pytest.fixture(scope="module")
def w8(tiny_fp32, tmp_path_factory):
    out = tmp_path_factory.mktemp("w8") / "tiny-w8"
    done = subprocess.run([sys.executable, "-m", "kvforge", "calibrate", str(tiny_fp32.path), "-o", str(out),
                           "--precision", "int8", "--weights-only", "--quiet"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "int8 (block-wise weights)" in done.stdout and "no data (weight-only)" in done.stdout, done.stdout
    from kvforge.bundle import Bundle

    return Bundle(out)


def _q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """gguf's Q8_0 of a [K, N] weight as GGUF stores it ([N, K] rows, blocks of 32 along K): (codes [K, N],
    scales [K/32, N] as float32 from their float16)."""
    from gguf import GGMLQuantizationType, quants

    n, k = w.shape[1], w.shape[0]
    raw = quants.quantize(np.ascontiguousarray(w.T), GGMLQuantizationType.Q8_0).reshape(n, k // 32, 34)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    qs = raw[..., 2:].copy().view(np.int8).reshape(n, k)
    return qs.T, d.T


def test_the_weights_are_q8_0_blocks_as_gguf_quantizes_them(w8, tiny_fp32):
    quant = w8.manifest["precision"]["quantization"]
    assert quant["format"] == "int8" and quant["weight_only"] and quant["weights"] == "block-wise"
    assert quant["block_size"] == 32 and quant["activations"] is None and quant["recipe"] == "fixed"
    assert w8.manifest["calibration"]["data"] is None and quant["quantized_layers"]
    g = onnx.load(str(w8.graph_file)).graph
    assert not any(n.op_type == "QuantizeLinear" for n in g.node)  # the activations stay float
    inits = {i.name: i for i in g.initializer}
    floats = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(tiny_fp32.graph_file)).graph.initializer}
    targets, _ = find_targets(onnx.load(str(tiny_fp32.graph_file)))
    checked = 0
    for t in targets:
        if t.layer not in quant["quantized_layers"]:
            continue
        dq = next(n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] == f"{t.layer}.weight_quantized")
        attrs = {a.name: a.i for a in dq.attribute}
        assert attrs == {"axis": 0, "block_size": 32}
        codes = numpy_helper.to_array(inits[f"{t.layer}.weight_quantized"])
        scale = numpy_helper.to_array(inits[f"{t.layer}.weight_scale"])
        assert codes.dtype == np.int8 and codes.shape == floats[t.weight].shape
        their_codes, their_scale = _q8_0(floats[t.weight])
        # gguf stores each scale in float16, the graph in float32; a code differs only where x / d sits within
        # that rounding of a half step
        np.testing.assert_allclose(scale, their_scale, rtol=2 ** -11, atol=0)
        diff = np.abs(codes.astype(np.int16) - their_codes)
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, (t.layer, (diff > 0).mean())
        checked += 1
    assert checked == len(quant["quantized_layers"]) >= 4 * 7


def test_onnx_runtime_computes_the_dequantized_weights_in_float(w8, tiny_fp32, tiny_heldout):
    """The session (variant or not) computes x @ dequant(W) as the float graph would with those weights: the
    activations are not quantized on the way (ONNX Runtime's 8-bit MatMulNBits fusion would quantize them)."""
    reference = onnx.load(str(tiny_fp32.graph_file))
    targets, _ = find_targets(reference)
    g = onnx.load(str(w8.graph_file)).graph
    inits = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    weights = {i.name: i for i in reference.graph.initializer}
    for t in targets:
        if f"{t.layer}.weight_quantized" in inits:
            w = dequantize(inits[f"{t.layer}.weight_quantized"], inits[f"{t.layer}.weight_scale"], "int8", 32)
            weights[t.weight].CopyFrom(numpy_helper.from_array(w, t.weight))
    ids = tiny_heldout[:2, :64].copy()
    (theirs,) = make_session(reference.SerializeToString()).run(
        ["logits"], prefill_feeds(ids, tiny_fp32.model_config, tiny_fp32.io, "float32"))
    with runtime.load(w8.path, variant=False) as plain, runtime.load(w8.path) as fast:
        np.testing.assert_allclose(plain.forward(ids)[0], theirs, rtol=0, atol=2e-5 * np.abs(theirs).max())
        np.testing.assert_allclose(fast.forward(ids)[0], theirs, rtol=0, atol=2e-4 * np.abs(theirs).max())


def test_weight_only_int8_keeps_the_reference_models_predictions(w8, tiny_fp32, tiny_heldout):
    with runtime.load(w8.path) as q, runtime.load(tiny_fp32.path) as f:
        for (lq, _), (lf, _) in zip(window_logits(q, tiny_heldout[:4]), window_logits(f, tiny_heldout[:4])):
            assert metrics.top1_agreement(lq, lf) > 0.99 and metrics.kl_divergence(lq, lf).mean() < 1e-3


def test_blocks_that_do_not_divide_k_are_padded_and_what_cannot_apply_is_named(tiny_fp32, tmp_path):
    q = calibrate(tiny_fp32.path, tmp_path / "b48", precision="int8", weights_only=True, block_size=48)
    records = q.manifest["calibration"]["scales"]["weights"]
    assert q.manifest["precision"]["quantization"]["block_size"] == 48
    # K = 256 and 704 padded to whole blocks of 48 (TensorRT's reading of a block size, kept for every format)
    assert {(r["shape"][0], r["k_padding"]) for r in records.values()} == {(256, 32), (704, 16)}
    for options, message in [
        (dict(precision="fp8", weights_only=True), "--weights-only applies to int8 .* not fp8"),
        (dict(precision="int8", weights_only=True, activations="per-token"), "int8 with --weights-only is weight-only"),
        (dict(precision="int8", weights_only=True, smoothquant=0.5, recipe="fixed"), "not to weight-only formats"),
        (dict(precision="int8", weights_only=True, kv_cache="fp8"), "not a weight-only format"),
    ]:
        with pytest.raises(KvforgeError, match=message):
            calibrate(tiny_fp32.path, tmp_path / "x", **options)
    assert not (tmp_path / "x").exists()


def test_tensorrt_is_told_it_takes_no_weight_only_int8(w8):
    from kvforge.tensorrt_env import check_precision_supported

    findings = [f for f in w8.manifest["lint"]["findings"] if f["severity"] == "error"]
    assert findings and all("TensorRT's weight-only quantization is INT4's" in f["message"] for f in findings)
    with pytest.raises(KvforgeError, match="block-wise with float activations .--weights-only.*--precision int4"):
        check_precision_supported(w8.quantization, "9.0", "H100")
