"""`kvforge lint`: each TensorRT rule fires on a graph that breaks it, naming the node."""

from __future__ import annotations

import re

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
    return helper.make_tensor_value_info(name, t, None if shape is None else list(shape))


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


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def test_parser_constant_inputs_and_attributes():
    """onnx-tensorrt's notes: CumSum's axis, Slice's axes and TopK's K are constants; K < 3840, sorted=1;
    ScatterND without reduction. The same ops written as TensorRT takes them pass."""
    x, idx = _vi("x", shape=(4, 8)), _vi("i", TP.INT64, (2, 1))
    bad = [
        helper.make_node("CumSum", ["x", "axis_in"], ["c"], name="cumsum_dyn_axis"),
        helper.make_node("Slice", ["x", "st", "en", "axes_in"], ["s"], name="slice_dyn_axes"),
        helper.make_node("TopK", ["x", "k_in"], ["v", "vi"], name="topk_dyn_k"),
        helper.make_node("TopK", ["x", "k_big"], ["v2", "vi2"], name="topk_big_k", sorted=1),
        helper.make_node("TopK", ["x", "k2"], ["v3", "vi3"], name="topk_unsorted", sorted=0),
        helper.make_node("ScatterND", ["x", "i", "u"], ["sc"], name="scatter_add", reduction="add"),
        helper.make_node("ScatterElements", ["x", "ie", "ue"], ["se"], name="scatter_elements_max", reduction="max"),
    ]
    ins = [x, idx, _vi("axis_in", TP.INT64, ()), _vi("axes_in", TP.INT64, (1,)), _vi("k_in", TP.INT64, (1,)), _vi("u", shape=(2, 8)),
           _vi("ie", TP.INT64, (4, 8)), _vi("ue", shape=(4, 8))]
    outs = [_vi(n, shape=None) for n in ("c", "s", "v", "vi", "v2", "vi2", "v3", "vi3", "sc", "se")]
    r = lint(_model(bad, ins, outs, [_i64("st", [0]), _i64("en", [2]), _i64("k_big", [4000]), _i64("k2", [2])]))
    flagged = {(f["node"], f["rule"]) for f in r["findings"] if f["severity"] == "error"}
    assert flagged == {("cumsum_dyn_axis", "constant-input"), ("slice_dyn_axes", "constant-input"),
                       ("topk_dyn_k", "constant-input"), ("topk_big_k", "attribute"), ("topk_unsorted", "attribute"),
                       ("scatter_add", "attribute")}
    assert [(f["node"], f["severity"]) for f in r["findings"] if f["node"] == "scatter_elements_max"] == [
        ("scatter_elements_max", "warning")]
    good = [
        helper.make_node("CumSum", ["x", "axis"], ["c"]),
        helper.make_node("Slice", ["x", "st", "en", "axes"], ["s"]),
        helper.make_node("TopK", ["x", "k2"], ["v", "vi"]),
        helper.make_node("ScatterND", ["x", "i", "u"], ["sc"]),
    ]
    inits = [_i64("axis", 1), _i64("st", [0]), _i64("en", [2]), _i64("axes", [1]), _i64("k2", [2])]
    r = lint(_model(good, [x, idx, _vi("u", shape=(2, 8))], [_vi(n, shape=None) for n in ("c", "s", "v", "vi", "sc")], inits))
    assert r["passed"], r["findings"]


def test_data_dependent_shapes_may_not_reach_a_graph_output():
    """MoE-style routing: NonZero picks the tokens of an expert, they are gathered, transformed and scattered back
    into a tensor of the input's shape: fine. Returning the gathered tokens themselves is not."""
    mask = _vi("m", TP.FLOAT, (6,))  # TensorRT's NonZero takes FP32/FP16 only
    x = _vi("x", shape=(6, 4))
    nodes = [
        helper.make_node("NonZero", ["m"], ["nz"], name="route"),
        helper.make_node("Transpose", ["nz"], ["rows"], perm=[1, 0]),
        helper.make_node("GatherND", ["x", "rows"], ["picked"], name="gather"),
        helper.make_node("Relu", ["picked"], ["expert_out"]),
        helper.make_node("ScatterND", ["x", "rows", "expert_out"], ["y"], name="scatter_back"),
    ]
    r = lint(_model(nodes, [mask, x], [_vi("y", shape=(6, 4))]))
    assert r["passed"], r["findings"]
    assert [f["rule"] for f in r["findings"]] == ["data-dependent-shape"] and r["warnings"] == 1  # NonZero noted
    r = lint(_model(nodes, [mask, x], [_vi("y", shape=(6, 4)), _vi("expert_out", shape=None)]))
    errors = _errors(r, "data-dependent-shape")
    assert len(errors) == 1 and "graph output 'expert_out'" in errors[0]["message"] and "from route" in errors[0]["message"]
    # a shape computed from such values: Reshape to the count of chosen tokens
    count = [helper.make_node("Shape", ["picked"], ["n"]), helper.make_node("Reshape", ["x", "n2"], ["z"])]
    m = _model(nodes + count, [mask, x], [_vi("y", shape=(6, 4)), _vi("z", shape=None)])
    m.graph.node[-1].input[1] = "n"
    assert len(_errors(lint(m), "data-dependent-shape")) == 1


@pytest.mark.parametrize("location, size, message", [
    ("w.data", 64, None),
    ("../outside.data", 64, r"'\.\./outside\.data' climbs out of the bundle"),
    ("/tmp/elsewhere.data", 64, "is an absolute path"),
    ("w.data", 8, r"ends at byte 64 of 'w.data', which holds 8"),
    ("gone.data", 64, "data file 'gone.data' is not beside the graph"),
], ids=["inside", "climbs-out", "absolute", "short", "missing"])
def test_lint_follows_external_data(tmp_path, location, size, message):
    """A graph file's external data must be its own: a file beside it, long enough for what it names."""
    import onnx

    graph_dir = tmp_path / "bundle"
    graph_dir.mkdir()
    w = numpy_helper.from_array(np.arange(16, dtype=np.float32).reshape(4, 4), "w")
    w.data_location = TP.EXTERNAL
    del w.external_data[:]
    for key, value in (("location", location), ("offset", "0"), ("length", "64")):
        w.external_data.add(key=key, value=value)
    w.ClearField("raw_data")
    (graph_dir / "w.data").write_bytes(np.arange(16, dtype=np.float32).tobytes()[:size])
    (tmp_path / "outside.data").write_bytes(bytes(64))
    m = _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [_vi("x", shape=(2, 4))], [_vi("y")], [w])
    onnx.save(m, str(graph_dir / "model.onnx"))
    result = lint(graph_dir / "model.onnx")
    found = [f["message"] for f in _errors(result, "external-data")]
    if message is None:
        assert result["passed"] and not found, result["findings"]
    else:
        assert not result["passed"] and len(found) == 1 and re.search(message, found[0]), found
