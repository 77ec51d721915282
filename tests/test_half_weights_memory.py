"""Sessions over a float16 graph on the CPU (kvforge/ort_session.py `cast_half_weights_when_used`): ONNX Runtime's
CPU kernels compute in float32, and by default it keeps a float32 copy of every half weight (folded when the
session loads, or all cast at the start of a run). The export's validation session and calibration's sessions
cast each weight where it is used instead. Measured in a fresh process (its peak resident memory, from the
kernel) on a chain of float16 MatMuls whose weights are in an external data file; the outputs are compared with
a default ONNX Runtime session's (the oracle: the same graph as ONNX Runtime runs it by default)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import onnx
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

    path, how, feed = sys.argv[1], sys.argv[2], sys.argv[4]
    if feed == "x":  # a float16 activation
        feeds = {"x": np.random.default_rng(1).standard_normal((2, %d)).astype(np.float16)}
    else:  # token ids
        feeds = {feed: np.arange(8).reshape(2, 4) * 3001}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the kernel's peak resident set (VmHWM) starts again from now: the imports' is not counted
    before = status("VmRSS:")
    if how == "validation":
        y = OrtRunner(path, "float16").session.run(None, feeds)[0]
    elif how == "calibration":
        y = make_session(path, half_weights=True).run(None, feeds)[0]
    else:  # ONNX Runtime's defaults
        y = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.save(sys.argv[3], y)
    print(json.dumps({"grew": status("VmHWM:") - before}))
""" % DIM)


def _run(path, how, out, feed="x"):
    done = subprocess.run([sys.executable, "-c", PROBE, str(path), how, str(out), feed], capture_output=True,
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


VOCAB, WIDTH = 32768, 1024
TABLE_F32 = VOCAB * WIDTH * 4  # the tied table's float32 copy: 128 MiB


def _tied_head(path):
    """A float16 embedding read by the lookup (Gather) and, through a Transpose, by the head (MatMul): what a
    tied head exports as."""
    rng = np.random.default_rng(2)
    table = (rng.standard_normal((VOCAB, WIDTH)) * 0.05).astype(np.float16)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["h"]),
             helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
             helper.make_node("MatMul", ["h", "table_t"], ["logits"])]
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "t"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT16, ["b", "t", VOCAB])],
                              [numpy_helper.from_array(table, "table")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path), save_as_external_data=True, location="head.onnx.data")


def test_a_tied_heads_table_is_read_in_place_not_transposed_again(tmp_path):
    path = tmp_path / "head.onnx"
    _tied_head(path)
    runs = {how: _run(path, how, tmp_path / f"{how}.npy", feed="ids")
            for how in ("default", "validation", "calibration")}
    for how in ("validation", "calibration"):
        grew, got = runs[how]
        # the mapped table and one float32 copy of it (cast), not a transposed copy of that besides
        assert grew < VOCAB * WIDTH * 2 + 1.5 * TABLE_F32, (how, grew, runs["default"][0])
        # the same products summed in another blocking: apart by float16 roundings at most
        np.testing.assert_allclose(got.astype(np.float32), runs["default"][1].astype(np.float32), rtol=0, atol=2e-3)


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
