"""Per-token INT8 activations (calibration/qdq.py `per_token`, runtime/ort/per_token.py): each row of a linear
layer's input quantized at run time to uint8 with its own scale and zero point.

The oracle is numpy's per-row asymmetric quantization, written here from the definition; the integer kernels the
runtime puts in its place are held to the graph as written."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge import runtime
from kvforge.calibration import calibrate
from kvforge.calibration.qdq import find_targets, rewrite
from kvforge.errors import KvforgeError
from kvforge.ort_session import make_session, u8_kernels_exact
from kvforge.runtime.ort.per_token import integer_per_token_matmuls


def _per_row_oracle(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (..., K) quantized per row to uint8 over [min(row, 0), max(row, 0)], w per output channel to int8 over
    +-max|w|; the product of the dequantized values, in float64."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float64)
    lo, hi = np.minimum(rows.min(1), 0), np.maximum(rows.max(1), 0)
    scale = np.maximum(((hi - lo) / 255).astype(np.float32), np.finfo(np.float32).tiny).astype(np.float64)
    zp = np.clip(np.round(-lo / scale), 0, 255)
    q = np.clip(np.round(rows / scale[:, None]) + zp[:, None], 0, 255)
    w_scale = (np.abs(w).max(0) / 127).astype(np.float32).astype(np.float64)
    wq = np.clip(np.round(w / w_scale), -127, 127)
    y = ((q - zp[:, None]) * scale[:, None]) @ (wq * w_scale)
    return y.reshape(*x.shape[:-1], w.shape[1])


def _per_row_fp8_oracle(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (..., K) quantized per row to FP8 E4M3 over +-max|row| (ml_dtypes' rounding), w per output channel over
    +-max|w|; the product of the dequantized values, in float64."""
    import ml_dtypes

    def fp8(a, step):
        return np.clip(a / step, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * step

    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    step = np.maximum((np.abs(rows).max(1) / np.float32(448)).astype(np.float32), np.finfo(np.float32).tiny)[:, None]
    w_step = (np.abs(w).max(0) / 448).astype(np.float32)
    y = fp8(rows, step) @ fp8(w, w_step)
    return y.reshape(*x.shape[:-1], w.shape[1])


def _branches(node) -> tuple[list, list]:
    """An If's then- and else-branch nodes."""
    branch = {a.name: list(a.g.node) for a in node.attribute}
    return branch["then_branch"], branch["else_branch"]


def _one_layer_graph(k: int, n: int, rank: int, seed: int = 0, fmt: str = "int8", opset: int = 21):
    w = np.random.default_rng(seed).normal(size=(k, n)).astype(np.float32)
    shape = ["b", "t", k] if rank == 3 else ["t", k]
    node = helper.make_node("MatMul", ["x", "layers.0.mlp.up_proj.weight"], ["y"], name="layers.0.mlp.up_proj")
    graph = helper.make_graph([node], "one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape[:-1] + [n])],
                              [numpy_helper.from_array(w, "layers.0.mlp.up_proj.weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    targets, _ = find_targets(model)
    rewrite(model, targets, fmt, None, None, None, np.float32, per_token=True)
    return model, w


@pytest.mark.parametrize("rank, fmt", [(2, "int8"), (3, "int8"), (3, "fp8")])
def test_the_graph_quantizes_each_row_as_numpy_does(rank, fmt):
    model, w = _one_layer_graph(48, 24, rank, fmt=fmt)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 5, 48) if rank == 3 else (6, 48)).astype(np.float32) * 3
    rows = x.reshape(-1, 48)
    rows[0] = 0.0  # all zeros: the smallest scale, zero point 0
    rows[1] = np.abs(rows[1])  # all positive: zero point 0, 255 steps over [0, max]
    rows[2] = -np.abs(rows[2]) * 1000  # all negative and large: zero point 255; its scale is its own
    (y,) = make_session(model.SerializeToString(), optimization="none").run(["y"], {"x": x})
    expected = (_per_row_fp8_oracle if fmt == "fp8" else _per_row_oracle)(x, w)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # the scales the automatic recipe's search assumes (calibration.qdq.dequantized_rows) are the graph's
    from kvforge.calibration.qdq import dequantized_rows, weight_scales, dequantize, quantize
    step = weight_scales(w, fmt)
    searched = dequantized_rows(x, fmt).astype(np.float64) @ dequantize(quantize(w, step, fmt), step, fmt)
    np.testing.assert_allclose(searched, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert not np.any(y.reshape(-1, 24)[0])
    # one row's outlier does not coarsen the others: the row next to the large one keeps its precision
    exact = x.reshape(-1, 48).astype(np.float64) @ w
    assert np.abs(y.reshape(-1, 24)[3] - exact[3]).max() < 0.05 * np.abs(exact[3]).max()


@pytest.mark.parametrize("rank", [2, 3])
def test_an_int8_session_over_the_bundles_own_graph_computes_it_as_written(rank):
    """The per-token graph as calibration measures it and a bundle holds it (not moved onto the integer kernels):
    ONNX Runtime's own Q/DQ fusion, on where its integer kernels are exact, would make of it a kernel that refuses
    a zero point per row; make_session runs it as written."""
    model, _ = _one_layer_graph(64, 40, rank, seed=4)
    x = (np.random.default_rng(5).standard_t(3, size=(2, 7, 64) if rank == 3 else (9, 64)) * 4).astype(np.float32)
    (as_written,) = make_session(model.SerializeToString(), optimization="none").run(["y"], {"x": x})
    (int8,) = make_session(model.SerializeToString(), "int8").run(["y"], {"x": x})
    np.testing.assert_allclose(int8, as_written, rtol=1e-5, atol=1e-5 * np.abs(as_written).max())


@pytest.mark.parametrize("codes, opset", [("int8", 21), ("uint8", 21), ("int8", 17)])
def test_the_integer_kernels_compute_the_graph_as_written(codes, opset, monkeypatch):
    """Each kernel's form where this CPU computes it exactly: int8 codes (uint8 x int8, VNNI's) where
    s8_kernels_exact says so, else uint8 codes + 128 (uint8 x uint8; forced here by making the probe say no); on
    steps of many rows and of one (a decode step's own path). Before opset 18 (no Pad axes) the rows keep the
    graph's (tokens, K) view, and its reshape back stays."""
    from kvforge.runtime.ort import per_token

    if codes == "uint8":
        monkeypatch.setattr(per_token, "s8_kernels_exact", lambda: False)
    exact = per_token.s8_kernels_exact() if codes == "int8" else u8_kernels_exact()
    if not exact:
        pytest.skip(f"ONNX Runtime's {codes} integer kernel is not exact on this CPU")
    model, _ = _one_layer_graph(64, 40, 3, seed=2, opset=opset)
    rng = np.random.default_rng(3)
    steps = [(rng.standard_t(3, size=(2, 7, 64)) * 4).astype(np.float32)]  # heavy tails, 14 rows
    steps += [x[None, None] for x in (steps[0][0, 0], np.abs(steps[0][1, 2]), -np.abs(steps[0][1, 3]),
                                      np.zeros(64, np.float32))]  # one row: signs mixed, all >= 0, <= 0, zeros
    as_written = make_session(model.SerializeToString(), optimization="none")
    expected = [as_written.run(["y"], {"x": x})[0] for x in steps]
    assert integer_per_token_matmuls(model) == 1
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops["MatMulIntegerToFloat"] == 1 and ops["DequantizeLinear"] == 0 and ops["MatMul"] == 0
    # a step of one row quantizes it with one DynamicQuantizeLinear (per tensor is per row there); others run the
    # graph's own row scales; either way the rows keep the activation's leading axes (no reshape back)
    assert ops["If"] == 1 and ops["QuantizeLinear"] == 0 and ops["Reshape"] == (0 if opset >= 18 else 2)
    kernel = next(n for n in model.graph.node if n.op_type == "MatMulIntegerToFloat")
    stored = next(i for i in model.graph.initializer if i.name == kernel.input[1])
    assert stored.data_type == (TensorProto.INT8 if codes == "int8" else TensorProto.UINT8)
    integer = make_session(model.SerializeToString())
    for x, y in zip(steps, expected):
        np.testing.assert_allclose(integer.run(["y"], {"x": x})[0], y, rtol=1e-5, atol=1e-5 * np.abs(y).max())


def test_an_encoder_defaults_to_per_token_int8_without_data(micro_bundle, tmp_path):
    fp32 = micro_bundle("bert-micro")
    q = calibrate(fp32.path, tmp_path / "int8", precision="int8")
    record = q.manifest["precision"]["quantization"]
    assert record["activations"] == "per-token dynamic" and record["method"] is None
    assert q.manifest["calibration"]["data"] is None  # nothing to calibrate: each row is scaled when it runs
    assert all(a["scale"] == "per-token dynamic" for a in q.manifest["calibration"]["scales"]["activations"].values())
    texts = ["a short one", "a sentence with more words in it than the first, and a comma",
             "numbers 12 345 and symbols %$#"]
    with runtime.load(fp32.path, backend="torch") as reference, runtime.load(q.path) as s:
        exact, ours = reference.embed(texts), s.embed(texts)
        feeds = {k: v for k, v in s.feeds(s.tokenize(texts)).items()
                 if k in {i.name for i in q.load_graph(external_data=False).graph.input}}
        (fast,) = s.backend.run("model", feeds)[:1]
        if u8_kernels_exact():  # the session's graph: the integer kernels where this CPU's are exact
            graph = onnx.load_from_string(s.backend._graph(q.manifest["graph"]))
            assert collections.Counter(n.op_type for n in graph.graph.node)["MatMulIntegerToFloat"] > 0
    cosine = (exact * ours).sum(1) / np.linalg.norm(exact, axis=1) / np.linalg.norm(ours, axis=1)
    assert cosine.min() > 0.999
    (plain,) = make_session(str(q.graph_file), optimization="none").run(["last_hidden_state"], feeds)
    # float rounding apart, the same function: where a later layer's row value sits on a rounding boundary, the
    # two round it one step apart, so a few elements differ by about a step and the rest by float rounding
    diff = np.abs(fast - plain) / np.abs(plain).max()
    assert diff.max() < 3e-3 and np.mean(diff) < 3e-5 and np.mean(diff > 1e-5) < 0.02
    # the static form is there for TensorRT
    static = calibrate(fp32.path, tmp_path / "static", precision="int8", activations="static", samples=4, seq_len=16)
    assert static.manifest["precision"]["quantization"]["activations"] == "per-tensor static"
    assert static.manifest["lint"]["passed"]
    lint = q.manifest["lint"]
    assert not lint["passed"]  # for TensorRT: its scales are computed, its codes uint8; the lint says what to do
    qdq = [f for f in lint["findings"] if f["rule"] == "qdq"]
    assert qdq and all("--activations static" in f["message"] for f in qdq)
    assert {f["rule"] for f in lint["findings"]} == {"qdq", "dtype"}


@pytest.mark.parametrize("options, message", [
    (dict(precision="fp8", activations="per-token", method="mse"), "--method"),
    (dict(precision="int4", activations="per-token"), "int4 is weight-only"),
    (dict(precision="int8", activations="per-token", percentile=99.0), "--percentile"),
    (dict(precision="int8", activations="per-row"), "'per-row' is not one of"),
])
def test_per_token_options_that_cannot_apply_are_named(micro_bundle, tmp_path, options, message):
    with pytest.raises(KvforgeError, match=message):
        calibrate(micro_bundle("bert-micro").path, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("level", [0, 4])
def test_a_tied_per_token_head_runs_on_the_embeddings_codes_and_slices_before_its_rows(tiny_fp32, tmp_path, level):
    """A tied head with per-token activations stores one table of codes (the embedding reads its rows). ONNX
    Runtime's variant runs the head on the integer kernel (level 4: one 8-bit MatMulNBits) and still projects only
    the rows asked for: the hidden state is sliced before the head's per-token quantization, whose Reshape,
    row scales and reshape back no longer end at a MatMul. Held to the graph as written (the exact Q/DQ)."""
    q = calibrate(tiny_fp32.path, tmp_path / "q", recipe="fixed", precision="int8", activations="per-token",
                  samples=8, seq_len=64, quantize_lm_head=True)
    assert q.manifest["calibration"]["scales"]["weights"]["lm_head"]["shared_with_embedding"]
    from kvforge.bundle import Bundle
    from kvforge.runtime.ort.variant import variant_path

    graph = onnx.load(str(variant_path(Bundle(q.path), attention=True, accuracy_level=level))).graph
    producer = {o: n for n in graph.node for o in n.output}
    node = producer["logits"]
    while node.op_type in ("Reshape", "Mul"):
        node = producer[node.input[0]]
    if level == 4 or u8_kernels_exact():
        assert node.op_type == ("MatMulNBits" if level == 4 else "MatMulIntegerToFloat")
    if level == 0 and u8_kernels_exact():  # an If per activation (4 a layer, the head's), on its own row count
        ops = collections.Counter(n.op_type for n in graph.node)
        assert ops["If"] == ops["Size"] == 4 * q.model_config["n_layers"] + 1, ops
    ids = np.random.default_rng(0).integers(0, q.model_config["vocab_size"], (2, 12))
    with runtime.load(q.path, accuracy_level=level) as fast, runtime.load(q.path, variant=False) as exact:
        last, cache = fast.forward(ids, last_logits_only=True)
        full, _ = exact.forward(ids)
        step, _ = fast.forward(np.array([[5], [6]]), cache=cache, last_logits_only=True)
        whole, _ = exact.forward(np.concatenate([ids, [[5], [6]]], axis=1))
        _, cache = fast.forward(ids[:1], last_logits_only=True)  # batch 1: a decode step of one row
        one, _ = fast.forward(np.array([[5]]), cache=cache, last_logits_only=True)
    assert last.shape == step.shape == (2, 1, q.model_config["vocab_size"])
    # level 0 computes the graph's function (the integer kernels' rounding only); level 4 quantizes the activations
    # per block of 32 instead of per row: held to a bound on the logits' scale
    tol = 1e-4 if level == 0 else 0.05 * np.abs(full).max()
    np.testing.assert_allclose(last[:, 0], full[:, -1], atol=tol, rtol=0 if level else 1e-4)
    np.testing.assert_allclose(step[:, 0], whole[:, -1], atol=tol, rtol=0 if level else 1e-4)
    np.testing.assert_allclose(one[:, 0], whole[:1, -1], atol=tol, rtol=0 if level else 1e-4)


def test_a_decoder_takes_per_token_with_either_recipe_and_tensorrt_refuses_it(micro_bundle, tmp_path):
    from kvforge.tensorrt_env import check_precision_supported

    b = micro_bundle("llama3-micro")
    # the automatic recipe searches only the per-token spaces when asked for them (random data: no held-out text,
    # so the first space's choices are taken)
    auto = calibrate(b.path, tmp_path / "auto", precision="fp8", activations="per-token", random_data=True,
                     samples=4, seq_len=16)
    assert auto.manifest["precision"]["quantization"]["activations"] == "per-token dynamic"
    assert auto.manifest["calibration"]["recipe"]["chosen"]["space"] == "per-token smoothed"
    assert all(a["scale"] == "per-token dynamic" for a in auto.manifest["calibration"]["scales"]["activations"].values())
    with pytest.raises(KvforgeError, match="FP8 activations are scaled per token.*--activations static"):
        check_precision_supported(auto.quantization, "9.0", "H100")
    q = calibrate(b.path, tmp_path / "int8", precision="int8", activations="per-token", recipe="fixed")
    ids = np.random.default_rng(0).integers(0, q.model_config["vocab_size"], (2, 12))
    with runtime.load(b.path, backend="torch") as reference, runtime.load(q.path) as s:
        exact, ours = reference.forward(ids)[0], s.forward(ids)[0]
    assert np.abs(ours - exact).max() < 0.05 * np.abs(exact).max()
    with runtime.load(q.path, accuracy_level=4) as fast:  # opt-in: the per-token MatMuls as 8-bit MatMulNBits
        graph = onnx.load(str(fast.backend.graph_path), load_external_data=False).graph
        ops = collections.Counter(n.op_type for n in graph.node)
        assert ops["MatMulNBits"] >= 2 * q.model_config["n_layers"] and not ops["QuantizeLinear"]
        level4 = fast.forward(ids)[0]
    assert np.abs(level4 - exact).max() < 0.05 * np.abs(exact).max() and not np.array_equal(level4, ours)
    with pytest.raises(KvforgeError, match="--activations static"):
        check_precision_supported(q.quantization, "9.0", "H100")

    # SmoothQuant's static factors go with per-token ranges: x / s quantized per row, diag(s) W per channel
    smoothed = calibrate(b.path, tmp_path / "smoothed", precision="int8", activations="per-token", recipe="fixed",
                         smoothquant=0.5, random_data=True, samples=4, seq_len=16)
    assert smoothed.manifest["precision"]["quantization"]["smoothquant_alpha"] == 0.5
    assert smoothed.manifest["calibration"]["data"] is not None  # its factors are calibrated
    graph = smoothed.load_graph(external_data=False).graph
    assert sum(n.name.endswith(".input_smooth") for n in graph.node) == len(
        smoothed.manifest["calibration"]["scales"]["activations"])
    with runtime.load(smoothed.path) as s:
        assert np.abs(s.forward(ids)[0] - exact).max() < 0.05 * np.abs(exact).max()


@pytest.mark.parametrize("preset", ["bert-micro", "roberta-micro", "perceiver-micro"])
def test_an_encoders_onnxruntime_graph_computes_what_the_bundles_graph_does(micro_bundle, preset):
    """The runtime's graph for an encoder: each attention layer that masks only padded keys as one
    MultiHeadAttention; on padded batches it computes the bundle's graph as written (float rounding apart)."""
    b = micro_bundle(preset)
    texts = ["one", "two words here", "a much longer text than the others, which pads the rest of the batch"]
    with runtime.load(b.path) as s:
        feeds = {k: v for k, v in s.feeds(s.tokenize(texts)).items()
                 if k in {i.name for i in b.load_graph(external_data=False).graph.input}}
        ours = s.backend.run("model", feeds)
        graph = s.backend._graph(b.manifest["graph"])
    plain = make_session(str(b.graph_file), optimization="none").run(None, feeds)
    ops = collections.Counter(n.op_type for n in onnx.load_from_string(graph).graph.node) if isinstance(graph, bytes) else {}
    if preset != "perceiver-micro":
        assert ops["MultiHeadAttention"] == b.model_config["n_layers"] and ops["Where"] == 0
    for mine, theirs in zip(ours, plain):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=2e-5 * max(1.0, np.abs(theirs).max()))


def test_at_accuracy_level_4_a_per_token_matmul_is_one_8_bit_matmul_nbits():
    """accuracy_level=4 (the ONNX Runtime backend's opt-in): the per-token MatMul becomes one 8-bit MatMulNBits at
    level 4 over the activation before its QuantizeLinear, with the same weights (the channel's scale in every block
    of 32): what numpy computes as llama.cpp's Q8 dot products do (each block of 32 inputs int8 over max|x| / 127)
    within 1e-5 of the output's scale, and within a few percent of the exact product. The rows' scale computation,
    the Q/DQ pair, the Mul by the row scales and the activation's (tokens, K) view go: one node."""
    from kvforge.runtime.ort.per_token import NBITS_BLOCK

    k, n = 96, 40
    model, w = _one_layer_graph(k, n, 3, seed=6)
    x = (np.random.default_rng(7).standard_t(3, size=(2, 5, k)) * 4).astype(np.float32)
    x[1, 3, :NBITS_BLOCK] *= 50  # an outlier block: its own scale
    assert integer_per_token_matmuls(model, accuracy_level=4) == 1
    ops = collections.Counter(n.op_type for n in model.graph.node)
    assert ops == {"MatMulNBits": 1}, ops  # the rows' scales, the Q/DQ pair and the (tokens, K) view all gone
    (got,) = make_session(model.SerializeToString()).run(["y"], {"x": x})
    w_scale = (np.abs(w).max(0) / 127).astype(np.float32)
    wq = np.clip(np.round(w / w_scale), -127, 127)
    xb = x.reshape(-1, k // NBITS_BLOCK, NBITS_BLOCK)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    xq = np.rint(xb * (np.float32(1) / d).astype(np.float32))
    oracle = np.einsum("mbk,bkn->mn", (xq * d).astype(np.float64), wq.reshape(k // NBITS_BLOCK, NBITS_BLOCK, n)) * w_scale
    scale = np.abs(oracle).max()
    assert np.abs(got.reshape(oracle.shape) - oracle).max() < 1e-5 * scale
    exact = x.reshape(-1, k).astype(np.float64) @ w
    assert 1e-4 * scale < np.abs(got.reshape(exact.shape) - exact).max() < 5e-2 * scale


def test_a_mixtures_experts_run_per_token_on_the_integer_kernels_inside_their_skips(micro_bundle, tmp_path):
    """A mixture of experts with per-token INT8: ONNX Runtime's variant puts each expert's dispatch under an If on
    whether any token chose it (moe.py) after its MatMuls are on the integer kernels, so no expert runs in float;
    a decode step of one row after a prefill is held to the Torch reference, and so is the bundle's graph as
    written, where an expert no token chose reads (1, 0, K): its per-token reshape back asks for a length of 0
    (allowzero), not a copy of the rows' width."""
    b = micro_bundle("mixtral-micro")
    q = calibrate(b.path, tmp_path / "int8", precision="int8", activations="per-token", recipe="fixed",
                  random_data=True, samples=4, seq_len=16)
    from kvforge.bundle import Bundle
    from kvforge.runtime.ort.variant import variant_path

    graph = onnx.load(str(variant_path(Bundle(q.path), attention=True))).graph
    experts = [n for n in graph.node if n.op_type == "If" and any(
        m.op_type == "ScatterND" for nodes in _branches(n) for m in nodes)]
    inside = collections.Counter(m.op_type for n in experts for nodes in _branches(n) for m in nodes)
    assert experts and inside["MatMulIntegerToFloat"] >= 2 * len(experts) and not inside["MatMul"], inside
    ids = np.random.default_rng(0).integers(0, q.model_config["vocab_size"], (1, 9))
    steps = {}
    with runtime.load(b.path, backend="torch") as reference:
        exact = reference.forward(np.concatenate([ids, [[5]]], axis=1))[0][:, -1]
    for variant in (True, False):
        with runtime.load(q.path, variant=variant) as s:
            _, cache = s.forward(ids, last_logits_only=True)
            steps[variant], _ = s.forward(np.array([[5]]), cache=cache, last_logits_only=True)
        assert np.abs(steps[variant][:, 0] - exact).max() < 0.05 * np.abs(exact).max(), variant
    # a one-row step: the variant's one DynamicQuantizeLinear is the graph's per-row quantization
    np.testing.assert_allclose(steps[True], steps[False], rtol=1e-4, atol=1e-4 * np.abs(exact).max())
