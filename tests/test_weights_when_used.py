"""Sessions over a graph whose weights are computed from its initializers (kvforge/ort_session.py
`compute_weights_when_used`): a float16 graph on the CPU, whose kernels compute in float32 (by default ONNX Runtime
keeps a float32 copy of every half weight, folded when the session loads or all cast at the start of a run), and a
checkpoint's codes behind DequantizeLinear nodes. The export's validation session and calibration's sessions
compute each weight where it is used instead. Measured in a fresh process (its peak resident memory, from the
kernel) on a chain of float16 MatMuls whose weights are in an external data file; the outputs are compared with
a default ONNX Runtime session's (the oracle: the same graph as ONNX Runtime runs it by default)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

LAYERS, DIM = 24, 2048
WEIGHT_F32 = DIM * DIM * 4  # one weight's float32 copy: 16 MiB
HALF_BYTES = LAYERS * DIM * DIM * 2  # the data file: 192 MiB


def _chain(path):
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "x"
    for i in range(LAYERS):
        inits.append(numpy_helper.from_array((rng.standard_normal((DIM, DIM)) / DIM ** 0.5).astype(np.float16),
                                             f"w{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"h{i}"]))
        prev = f"h{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["b", DIM])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT16, ["b", DIM])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path), save_as_external_data=True, location="chain.onnx.data")


PROBE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import onnxruntime as ort
    from kvforge.export.validate import OrtRunner
    from kvforge.ort_session import make_session

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    path, how, feed, dtype = sys.argv[1], sys.argv[2], sys.argv[4], sys.argv[5]
    if feed == "x":  # a float16 activation
        feeds = {"x": np.random.default_rng(1).standard_normal((2, %d)).astype(np.float16)}
    else:  # token ids
        feeds = {feed: np.arange(8).reshape(2, 4) * 3001}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the kernel's peak resident set (VmHWM) starts again from now: the imports' is not counted
    before = status("VmRSS:")
    if how == "validation":
        y = OrtRunner(path, dtype).session.run(None, feeds)[0]
    elif how == "calibration":
        y = make_session(path, half_weights=True).run(None, feeds)[0]
    else:  # ONNX Runtime's defaults
        y = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.save(sys.argv[3], y)
    print(json.dumps({"grew": status("VmHWM:") - before}))
""" % DIM)


def _run(path, how, out, feed="x", dtype="float16"):
    done = subprocess.run([sys.executable, "-c", PROBE, str(path), how, str(out), feed, dtype], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["grew"], np.load(out)


def test_half_weights_are_cast_where_used_not_copied_whole(tmp_path):
    path = tmp_path / "chain.onnx"
    _chain(path)
    default_grew, expected = _run(path, "default", tmp_path / "default.npy")
    # ONNX Runtime's default holds every weight as float32: the bound below would fail for it
    assert default_grew > HALF_BYTES + 8 * WEIGHT_F32, default_grew
    for how in ("validation", "calibration"):
        grew, got = _run(path, how, tmp_path / f"{how}.npy")
        # the mapped half weights, and a few layers' float32 casts at a time (not 24)
        assert grew < HALF_BYTES + 6 * WEIGHT_F32, (how, grew, default_grew)
        np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), rtol=0, atol=2e-3)


VOCAB, WIDTH = 65536, 1024
TABLE_F32 = VOCAB * WIDTH * 4  # the head's float32 copy: 256 MiB (four of onnx_graph.HALF_BLOCK_BYTES)


def _head(path, tied: bool):
    """A float16 embedding read by the lookup (Gather) and by the head (MatMul): through a Transpose, as a tied
    head exports, or an untied head's own [in, out] weight."""
    rng = np.random.default_rng(2)
    table = (rng.standard_normal((VOCAB, WIDTH)) * 0.05).astype(np.float16)
    inits = [numpy_helper.from_array(table, "table")]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["h"])]
    if tied:
        nodes += [helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
                  helper.make_node("MatMul", ["h", "table_t"], ["logits"])]
    else:
        inits.append(numpy_helper.from_array((rng.standard_normal((WIDTH, VOCAB)) * 0.05).astype(np.float16), "head"))
        nodes.append(helper.make_node("MatMul", ["h", "head"], ["logits"]))
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "t"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT16, ["b", "t", VOCAB])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path), save_as_external_data=True, location="head.onnx.data")


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_heads_weight_is_read_in_place_and_cast_a_block_at_a_time(tmp_path, tied):
    path = tmp_path / "head.onnx"
    _head(path, tied)
    weights = {i.name: numpy_helper.to_array(i, str(tmp_path)) for i in onnx.load(str(path)).graph.initializer}
    ids = np.arange(8).reshape(2, 4) * 3001  # the probe's feed
    head = weights["table"].T if tied else weights["head"]
    expected = weights["table"][ids].astype(np.float32) @ head.astype(np.float32)  # in float32, as the CPU computes
    for how in ("validation", "calibration"):
        grew, got = _run(path, how, tmp_path / f"{how}.npy", feed="ids")
        # the mapped weight and a block's float32 copy (a quarter of it), not a whole copy (nor a transposed one:
        # ONNX Runtime's defaults grow by both, ~546 MB here)
        assert grew < VOCAB * WIDTH * 2 + 0.5 * TABLE_F32, (how, grew)
        # the same products, rounded to float16 once
        np.testing.assert_allclose(got.astype(np.float32), expected, rtol=0, atol=2e-3)


def test_the_blocks_of_a_weight_are_views_of_its_bytes(tmp_path):
    from kvforge.onnx_graph import read_half_weights_in_blocks

    path = tmp_path / "head.onnx"
    _head(path, tied=False)
    model = onnx.load(str(path), load_external_data=False)
    assert read_half_weights_in_blocks(model, block_bytes=TABLE_F32 // 3 + 1) == 1  # the head; the lookup is no MatMul
    blocks = [i for i in model.graph.initializer if i.name.startswith("head__rows")]
    assert [list(b.dims) for b in blocks] == [[342, VOCAB], [342, VOCAB], [340, VOCAB]]
    whole = numpy_helper.to_array(onnx.load(str(path)).graph.initializer[1])
    for b, start in zip(blocks, (0, 342, 684)):
        np.testing.assert_array_equal(numpy_helper.to_array(b, str(tmp_path)), whole[start:start + b.dims[0]])


def test_only_a_weight_read_through_its_own_transpose_is_rewritten():
    from kvforge.onnx_graph import matmul_transposed_weights

    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    v = numpy_helper.from_array(np.ones((4, 3), np.float32), "v")
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["y"]),
             helper.make_node("Transpose", ["v"], ["vt"], perm=[1, 0]),  # read twice: left as it is
             helper.make_node("MatMul", ["x", "vt"], ["z"]),
             helper.make_node("Relu", ["vt"], ["r"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "yzr"], [w, v])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert matmul_transposed_weights(model) == 1
    ops = [(n.op_type, n.domain, list(n.input)) for n in model.graph.node]
    assert ops[0] == ("FusedMatMul", "com.microsoft", ["x", "w"]) and ("Transpose", "", ["v"]) in ops
    assert len(ops) == 4


def test_only_the_large_weights_matmul_is_replaced_in_a_long_graph(tmp_path):
    """Hundreds of other nodes stay as they were (protobuf gives node objects read in turn the same ids once freed,
    so a rewrite that forgot to hold them dropped other nodes), and the blocked graph computes what the whole
    weight does, on ONNX Runtime's defaults."""
    import onnxruntime as ort

    from kvforge.onnx_graph import read_half_weights_in_blocks

    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Relu", [f"x{i}"], [f"x{i + 1}"]) for i in range(400)]
    nodes.insert(200, helper.make_node("MatMul", ["x0", "w"], ["y"]))  # among them
    w = numpy_helper.from_array((rng.standard_normal((64, 4096)) * 0.1).astype(np.float16), "w")
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, shape) for n, shape in (("y", [2, 4096]),
                                                                                         ("x200", [2, 64]))]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x0", TensorProto.FLOAT16, [2, 64])], outputs,
                              [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    blocked = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    assert read_half_weights_in_blocks(blocked, block_bytes=1 << 18) == 1  # 1 MiB as float32: four blocks
    ops = [n.op_type for n in blocked.graph.node]
    assert ops.count("Relu") == 400 and ops.count("MatMul") == 4 and ops.count("Slice") == 4 and ops.count("Add") == 3
    onnx.save(blocked, str(tmp_path / "blocked.onnx"))
    onnx.checker.check_model(str(tmp_path / "blocked.onnx"))
    x = {"x0": rng.standard_normal((2, 64)).astype(np.float16)}
    want = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, x)
    got = ort.InferenceSession(str(tmp_path / "blocked.onnx"), providers=["CPUExecutionProvider"]).run(None, x)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0].astype(np.float32), want[0].astype(np.float32), rtol=0, atol=2e-3)


def _coded_table(path) -> np.ndarray:
    """A tied embedding kept as a checkpoint's codes, as export/checkpoint_codes.py writes them: int8 codes with a
    float32 scale per block of 32 along `in`, dequantized at the graph's head and read by the lookup and, through
    a Transpose, by the head. Returns the table the codes stand for (numpy's dequantization)."""
    rng = np.random.default_rng(4)
    codes = rng.integers(-127, 128, (VOCAB, WIDTH), dtype=np.int8)
    scale = (rng.random((VOCAB, WIDTH // 32)) * 1e-3 + 1e-4).astype(np.float32)
    nodes = [helper.make_node("DequantizeLinear", ["codes", "scale"], ["table_dq"], axis=1, block_size=32),
             helper.make_node("Identity", ["table_dq"], ["table"]),
             helper.make_node("Gather", ["table", "ids"], ["h"]),
             helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "table_t"], ["logits"])]
    graph = helper.make_graph(nodes, "coded", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "t"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "t", VOCAB])],
                              [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scale, "scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(path), save_as_external_data=True, location="coded.onnx.data")
    return (codes.astype(np.float32).reshape(VOCAB, -1, 32) * scale[..., None]).reshape(VOCAB, WIDTH)


def test_a_coded_tables_rows_are_dequantized_where_read(tmp_path):
    """The validation session of a codes graph gathers the lookup's codes and dequantizes the head a block of rows
    at a time: it holds the mapped codes and one block's float32 copy, not the table's."""
    path = tmp_path / "coded.onnx"
    table = _coded_table(path)
    ids = np.arange(8).reshape(2, 4) * 3001  # the probe's feed
    expected = table[ids].astype(np.float64) @ table.T.astype(np.float64)
    default_grew, _ = _run(path, "default", tmp_path / "default.npy", feed="ids", dtype="float32")
    assert default_grew > TABLE_F32, default_grew  # ONNX Runtime's defaults fold the table's float32 copy
    grew, got = _run(path, "validation", tmp_path / "validation.npy", feed="ids", dtype="float32")
    assert grew < VOCAB * WIDTH + 0.5 * TABLE_F32, (grew, default_grew)  # the int8 codes, a block of float32 rows
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


def _dq_graph(codes: np.ndarray, scale: np.ndarray, tail: list, inputs: list, outputs: list):
    nodes = [helper.make_node("DequantizeLinear", ["codes", "scale"], ["w"], axis=1, block_size=32), *tail]
    graph = helper.make_graph(nodes, "g", inputs, outputs,
                              [numpy_helper.from_array(codes, "codes"), numpy_helper.from_array(scale, "scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def test_the_rewrites_of_a_coded_table_compute_what_the_graph_does(tmp_path):
    """The lookup gathered from the codes, the head computed a block of rows at a time and each weight moved to
    its reader give what ONNX Runtime computes on the graph as written, bit for bit; the head's blocks read the
    codes' bytes in the data file."""
    import onnxruntime as ort

    from kvforge.onnx_graph import (compute_weights_where_read, gather_dequantized_rows,
                                    read_dequantized_weights_in_blocks)

    rng = np.random.default_rng(5)
    codes = rng.integers(-127, 128, (300, 64), dtype=np.int8)
    scale = rng.random((300, 2)).astype(np.float32)
    tail = [helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Gather", ["w", "ids"], ["e"]),
            helper.make_node("FusedMatMul", ["r", "w"], ["y"], domain="com.microsoft", transB=1)]
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
              helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])]
    outputs = [helper.make_tensor_value_info("e", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    onnx.save(_dq_graph(codes, scale, tail, inputs, outputs), str(tmp_path / "m.onnx"), save_as_external_data=True,
              location="m.data", size_threshold=0)
    model = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    assert compute_weights_where_read(model) == 2  # the lookup's and the head's own copies
    ops = [(n.op_type, list(n.output)) for n in model.graph.node]
    assert [o for o, _ in ops] == ["Relu", "DequantizeLinear", "Gather", "DequantizeLinear", "FusedMatMul"]
    assert read_dequantized_weights_in_blocks(model, block_bytes=300 * 64 * 4 // 3) == 1  # three blocks of 100
    assert gather_dequantized_rows(model) == 1
    blocks = [i for i in model.graph.initializer if "__rows" in i.name]
    assert sorted(list(b.dims) for b in blocks) == [[100, 2]] * 3 + [[100, 64]] * 3
    assert not any(n.op_type == "DequantizeLinear" and "codes" in n.input for n in model.graph.node)  # never whole
    onnx.save(model, str(tmp_path / "rewritten.onnx"))
    feeds = {"ids": np.array([[0, 299, 150], [7, 7, 100]]), "x": rng.standard_normal((2, 64)).astype(np.float32)}
    want = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ort.InferenceSession(str(tmp_path / "rewritten.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)
    table = (codes.astype(np.float32).reshape(300, 2, 32) * scale[..., None]).reshape(300, 64)
    np.testing.assert_array_equal(got[0], table[feeds["ids"]])  # numpy's dequantization of the gathered rows
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6, atol=1e-5)
