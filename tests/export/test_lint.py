"""`kvforge lint`: each TensorRT rule fires on a graph that breaks it, naming the node."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from kvforge.errors import KvforgeError
from kvforge.export.lint import lint


def _model(nodes, inputs, outputs, inits=(), opset=21, extra_opsets=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra_opsets], ir_version=10)


def _vi(name, t=TP.FLOAT, shape=(2, 4)):
    return helper.make_tensor_value_info(name, t, list(shape))


def _errors(result, rule):
    return [f for f in result["findings"] if f["rule"] == rule and f["severity"] == "error"]


def test_clean_graph_passes():
    m = _model([helper.make_node("Relu", ["x"], ["y"], name="relu0")], [_vi("x")], [_vi("y")])
    r = lint(m)
    assert r["passed"] and r["findings"] == [] and all(r["targets"].values())


def test_opset_outside_targets():
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x")], [_vi("y")], opset=8)
    r = lint(m)
    assert not r["passed"]
    assert any("opset 8 is outside TensorRT 10.15's range 9..24" in f["message"] for f in _errors(r, "opset"))


def test_unsupported_and_custom_ops_are_named():
    nodes = [
        helper.make_node("Unique", ["x"], ["u"], name="dedupe"),
        helper.make_node("SkipLayerNormalization", ["x", "x", "g"], ["y"], name="fused_ln", domain="com.microsoft"),
    ]
    m = _model(nodes, [_vi("x"), _vi("g", shape=(4,))], [_vi("u"), _vi("y")],
               extra_opsets=[helper.make_opsetid("com.microsoft", 1)])
    r = lint(m)
    ops = {(f["node"], f["rule"]) for f in r["findings"]}
    assert ("dedupe", "operator") in ops and ("fused_ln", "operator") in ops
    assert any("com.microsoft" in f["message"] for f in _errors(r, "opset"))


def test_dtype_limits():
    nodes = [
        helper.make_node("Not", ["x"], ["y"], name="not_on_float"),  # Not takes BOOL only
        helper.make_node("Relu", ["d"], ["e"], name="double_relu"),
    ]
    m = _model(nodes, [_vi("x"), _vi("d", TP.DOUBLE)], [_vi("y", TP.BOOL), _vi("e", TP.DOUBLE)])
    r = lint(m)
    assert [f["node"] for f in _errors(r, "dtype")] == ["not_on_float"]
    assert any(f["node"] == "double_relu" and f["severity"] == "warning" for f in r["findings"])


def test_control_flow_on_the_output_path_only():
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"])], "then", [], [_vi("t")])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["o"])], "else", [], [_vi("o")])
    branch = helper.make_node("If", ["c"], ["y"], name="branchy", then_branch=then, else_branch=other)
    dead = helper.make_node("If", ["c"], ["unused"], name="dead_if", then_branch=then, else_branch=other)
    m = _model([branch, dead], [_vi("x"), _vi("c", TP.BOOL, ())], [_vi("y")])
    r = lint(m)
    assert [f["node"] for f in _errors(r, "control-flow")] == ["branchy"]


def _qdq_model(scale, zero_point=None, scale_type=np.float32, opset=21, q_type=TP.INT8, block=None):
    w = numpy_helper.from_array(np.ones((4, 4), np.int8) if q_type == TP.INT8 else np.ones((4, 4), np.int8), "w_q")
    inits = [w, numpy_helper.from_array(np.asarray(scale, scale_type), "w_scale")]
    inputs = ["w_q", "w_scale"]
    if zero_point is not None:
        inits.append(numpy_helper.from_array(np.asarray(zero_point, np.int8), "w_zp"))
        inputs.append("w_zp")
    attrs = {"axis": 1} if np.ndim(scale) else {}
    if block:
        attrs["block_size"] = block
    dq = helper.make_node("DequantizeLinear", inputs, ["w"], name="dq_w", **attrs)
    mm = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    return _model([dq, mm], [_vi("x", shape=(2, 4))], [_vi("y", shape=(2, 4))], inits=inits, opset=opset)


def test_qdq_rules():
    assert lint(_qdq_model([0.1, 0.2, 0.1, 0.3], zero_point=[0, 0, 0, 0]))["passed"]
    r = lint(_qdq_model([0.1, 0.2, 0.1, 0.3], zero_point=[0, 3, 0, 0]))
    assert any("zero point must be zero" in f["message"] and f["node"] == "dq_w" for f in _errors(r, "qdq"))
    r = lint(_qdq_model([0.1, -0.2, 0.1, 0.3]))
    assert any("scales must be positive" in f["message"] for f in _errors(r, "qdq"))
    r = lint(_qdq_model([0.1, 0.2, 0.1, 0.3], scale_type=np.float16))
    assert any("scale dtype FP16 differs from the FP32 tensor 'x' it meets in MatMul" in f["message"] for f in _errors(r, "qdq"))


@pytest.mark.parametrize("rows,passed", [(8, True), (6, False)])
def test_int4_blocks_must_be_whole(rows, passed):
    """TensorRT infers an INT4 block size as K / scale rows, so a ragged last block would be misread."""
    import ml_dtypes

    w = numpy_helper.from_array(np.ones((rows, 4), ml_dtypes.int4), "w_q")
    scale = numpy_helper.from_array(np.full((2, 4), 0.1, np.float32), "w_scale")
    dq = helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], name="dq_w", axis=0, block_size=4)
    mm = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    r = lint(_model([dq, mm], [_vi("x", shape=(2, rows))], [_vi("y", shape=(2, 4))], inits=[w, scale]))
    blocks = [f for f in _errors(r, "qdq") if "not a multiple of block_size 4" in f["message"]]
    assert r["passed"] is passed and [f["node"] for f in blocks] == ([] if passed else ["dq_w"])


def test_lint_reads_files_and_names_bad_ones(tmp_path):
    with pytest.raises(KvforgeError, match="no ONNX file"):
        lint(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(KvforgeError, match="not a readable ONNX model"):
        lint(tmp_path / "junk.onnx")
