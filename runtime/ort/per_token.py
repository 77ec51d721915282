"""Per-token INT8 MatMuls (calibration/qdq.py's `per_token` form) on ONNX Runtime's integer kernels.

The bundle's graph quantizes an activation a row (a token) at a time: a QuantizeLinear -> DequantizeLinear pair
on axis 0 of its (tokens, K) view, with a uint8 zero point per row, into MatMuls whose weights are
DequantizeLinears of int8 codes (a scale per output channel, zero point 0). ONNX Runtime fuses only per-tensor
activation scales into its integer kernels, so as written that runs in float. Here each such MatMul becomes

    y_rn = s_r * sum_k (q_rk - z_r) w_kn c_n = s_r * MatMulIntegerToFloat([q_r, z_r ... z_r], [w; e]; c)_rn

one integer kernel and a Mul by the row scales: the codes get E extra rows e_jn (each within int8) that sum to
-sum_k w_kn, and the row's codes as many columns holding its zero point, so the kernel subtracts the zero
point's term itself, in int32: the same function up to float rounding. The codes are stored as uint8 (+128,
zero point 128, the same values): ONNX Runtime's uint8 x uint8 kernel widens to 16 bits, where its uint8 x int8
one on AVX2 without VNNI sums pairs of products in 16 bits and saturates. `u8_kernels_exact` probes that once;
where it fails the graph runs as written.
"""

from __future__ import annotations

import functools

import numpy as np

from kvforge.onnx_graph import drop_dead_nodes, use_ms_domain


@functools.lru_cache(maxsize=None)
def u8_kernels_exact() -> bool:
    """Whether ONNX Runtime's CPU MatMulIntegerToFloat computes uint8 x uint8 exactly here, at the extremes
    (every product 255 x 255 with zero point 128 on the weights, where a 16-bit pairwise sum would saturate)."""
    from onnx import TensorProto, helper, numpy_helper

    from kvforge.ort_session import import_onnxruntime

    ort = import_onnxruntime()
    k, n = 64, 8
    w = np.full((k, n), 255, np.uint8)
    w[:, 1::2] = 0
    a = np.full((1, k), 255, np.uint8)
    a[0, ::3] = 254
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.ones(n, np.float32), "w_s"),
             numpy_helper.from_array(np.array(128, np.uint8), "w_z"), numpy_helper.from_array(np.array(1.0, np.float32), "a_s"),
             numpy_helper.from_array(np.array(0, np.uint8), "a_z")]
    node = helper.make_node("MatMulIntegerToFloat", ["a", "w", "a_s", "w_s", "a_z", "w_z"], ["y"], domain="com.microsoft")
    graph = helper.make_graph([node], "u8_probe", [helper.make_tensor_value_info("a", TensorProto.UINT8, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        y = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
    except Exception:  # noqa: BLE001 - a build without the contrib kernel: the graph runs as written
        return False
    exact = a.astype(np.float64) @ (w.astype(np.float64) - 128)
    return bool(np.array_equal(y.astype(np.float64), exact))


def _zero_point_rows(codes: np.ndarray) -> np.ndarray:
    """int8 rows (E, N), E as few as can be, each column summing to minus that column of `codes` (K, N)."""
    total = -codes.astype(np.int64).sum(0)
    e = int(-(-np.abs(total).max() // 127))
    if e == 0:
        return np.zeros((0, codes.shape[1]), np.int8)
    part, rest = np.divmod(np.abs(total), e)  # each column's |sum| in e parts differing by at most one
    rows = part[None, :] + (np.arange(e)[:, None] < rest[None, :])
    return (rows * np.sign(total)[None, :]).astype(np.int8)


def integer_per_token_matmuls(model, base_dir: str = "") -> int:
    """Rewrite the graph's per-token INT8 MatMuls (float32 only) onto the integer kernels; returns how many.
    base_dir: where the graph's external data lies, for a graph loaded without it (the codes are read from there,
    and their uint8 form goes into the graph)."""
    from onnx import TensorProto, helper, numpy_helper

    if not u8_kernels_exact():
        return 0
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}

    def axis(node, default):
        return next((a.i for a in node.attribute if a.name == "axis"), default)

    def weight_codes(name):
        """(int8 codes [K, N], float32 scales [N]) behind a per-output-channel DequantizeLinear, or None."""
        dq = producer.get(name)
        if dq is None or dq.op_type != "DequantizeLinear" or axis(dq, 1) not in (1, -1) or len(dq.input) < 2:
            return None
        codes, scale = inits.get(dq.input[0]), inits.get(dq.input[1])
        zp = inits.get(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        if codes is None or scale is None or codes.data_type != TensorProto.INT8 or len(codes.dims) != 2 \
                or scale.data_type != TensorProto.FLOAT or list(scale.dims) != [codes.dims[1]]:
            return None
        if zp is not None and np.any(numpy_helper.to_array(zp, base_dir)):
            return None
        return numpy_helper.to_array(codes, base_dir), numpy_helper.to_array(scale, base_dir)

    added: dict[int, list] = {}
    rows_done: dict[str, tuple[str, str]] = {}  # activation DequantizeLinear output -> (row scales, zero points) as columns
    count = 0
    for index, node in enumerate(g.node):
        if node.op_type != "MatMul":
            continue
        dq = producer.get(node.input[0])
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is None or q.op_type != "QuantizeLinear" or axis(dq, 1) != 0 or axis(q, 1) != 0 \
                or list(q.input[1:3]) != list(dq.input[1:3]) or len(dq.input) < 3:
            continue
        weight = weight_codes(node.input[1])
        if weight is None:
            continue
        codes, w_scale = weight
        base = node.name or node.output[0]
        new = []
        if dq.output[0] not in rows_done:
            p = f"{dq.output[0]}_integer"
            g.initializer.append(numpy_helper.from_array(np.array([-1, 1], np.int64), f"{p}.column"))
            new += [helper.make_node("Reshape", [dq.input[1], f"{p}.column"], [f"{p}.row_scale"]),
                    helper.make_node("Reshape", [dq.input[2], f"{p}.column"], [f"{p}.row_zero_point"])]
            rows_done[dq.output[0]] = (f"{p}.row_scale", f"{p}.row_zero_point")
        row_scale, row_zp = rows_done[dq.output[0]]
        extra = _zero_point_rows(codes)
        rows = q.output[0]
        if len(extra):  # the row's codes, then its zero point once per extra weight row
            g.initializer.append(numpy_helper.from_array(np.array([1, len(extra)], np.int64), f"{base}.zero_point_columns"))
            new += [helper.make_node("Expand", [row_zp, f"{base}.zero_point_columns"], [f"{base}.row_zero_points"]),
                    helper.make_node("Concat", [rows, f"{base}.row_zero_points"], [f"{base}.rows"], axis=1)]
            rows = f"{base}.rows"
        g.initializer.extend([
            numpy_helper.from_array((np.concatenate([codes, extra]).astype(np.int16) + 128).astype(np.uint8), f"{base}.codes_u8"),
            numpy_helper.from_array(w_scale.astype(np.float32), f"{base}.codes_scale"),
            numpy_helper.from_array(np.array(128, np.uint8), f"{base}.codes_zero_point"),
            numpy_helper.from_array(np.array(0, np.uint8), f"{base}.rows_zero_point"),
            numpy_helper.from_array(np.array(1.0, np.float32), f"{base}.rows_unit_scale")])
        new += [helper.make_node("MatMulIntegerToFloat",
                                 [rows, f"{base}.codes_u8", f"{base}.rows_unit_scale", f"{base}.codes_scale",
                                  f"{base}.rows_zero_point", f"{base}.codes_zero_point"],
                                 [f"{base}.integer"], name=f"{base}.integer", domain="com.microsoft"),
                helper.make_node("Mul", [f"{base}.integer", row_scale], list(node.output), name=f"{base}.row_scales")]
        added[index] = new
        count += 1
    if not count:
        return 0
    nodes = []
    for index, node in enumerate(g.node):
        nodes += added.get(index, [node])
    del g.node[:]
    g.node.extend(nodes)
    use_ms_domain(model)
    drop_dead_nodes(model)  # the activations' and weights' DequantizeLinears, and the int8 codes
    return count
