"""Per-token INT8 MatMuls (calibration/qdq.py's `per_token` form) on ONNX Runtime's integer kernels.

The bundle's graph quantizes an activation a row (a token) at a time: a QuantizeLinear -> DequantizeLinear pair
on axis 0 of its (tokens, K) view, with a uint8 zero point per row, into MatMuls whose weights are
DequantizeLinears of int8 codes (a scale per output channel, zero point 0). ONNX Runtime fuses only per-tensor
activation scales into its integer kernels, so as written that runs in float. Here each such MatMul becomes

    y_rn = s_r * sum_k (q_rk - z_r) w_kn c_n = s_r * MatMulIntegerToFloat([q_r, z_r ... z_r], [w; e]; c)_rn

one integer kernel and a Mul by the row scales: the codes get E extra rows e_jn (each within int8) that sum to
-sum_k w_kn, and the row's codes as many columns holding its zero point, so the kernel subtracts the zero
point's term itself, in int32: the same function up to float rounding. The codes stay int8 where ONNX Runtime's
uint8 x int8 kernel is exact here (VNNI; kvforge.ort_session's `s8_kernels_exact` probes it once): at 128 rows it
ran 5x the speed of the uint8 x uint8 one on this machine, which is what a prefill is. Elsewhere (AVX2 without
VNNI sums pairs of uint8 x int8 products in 16 bits and saturates) they are stored as uint8 (+128, zero point
128, the same values), for the uint8 x uint8 kernel, which widens to 16 bits (`u8_kernels_exact`); where
neither is exact the graph runs as written.
At MatMulNBits accuracy level 4 (the backend's opt-in `accuracy_level=4`, docs/ort-variant.md) each such MatMul is
instead one 8-bit MatMulNBits over the activation before its QuantizeLinear, at level 4: the weight's codes in
blocks of NBITS_BLOCK along K (each block the channel's scale: the same weights), the activation quantized to int8
per block inside the kernel (max|x| / 127, as llama.cpp's Q8 dot products), not per row with a zero point. The
rows' scale computation, the QuantizeLinear, the Mul by the row scales and the activation's (tokens, K) view and
its reshape back go (MatMulNBits takes (..., K)): one node where there were a dozen.
"""

from __future__ import annotations

import numpy as np

from kvforge.onnx_graph import GraphIndex, drop_dead_nodes, node_attribute, replace_nodes, use_ms_domain
from kvforge.ort_session import s8_kernels_exact, u8_kernels_exact

from .codes import pack_nbits


def _zero_point_rows(codes: np.ndarray) -> np.ndarray:
    """int8 rows (E, N), E as few as can be, each column summing to minus that column of `codes` (K, N)."""
    total = -codes.astype(np.int64).sum(0)
    e = int(-(-np.abs(total).max() // 127))
    if e == 0:
        return np.zeros((0, codes.shape[1]), np.int8)
    part, rest = np.divmod(np.abs(total), e)  # each column's |sum| in e parts differing by at most one
    rows = part[None, :] + (np.arange(e)[:, None] < rest[None, :])
    return (rows * np.sign(total)[None, :]).astype(np.int8)


NBITS_BLOCK = 32  # the level-4 form's activation blocks along K (llama.cpp's Q8_0 block)


def integer_per_token_matmuls(model, base_dir: str = "", accuracy_level: int = 0) -> int:
    """Rewrite the graph's per-token INT8 MatMuls (float32 only) onto the integer kernels; returns how many.
    base_dir: where the graph's external data lies, for a graph loaded without it (the codes are read from there,
    and their uint8 form goes into the graph). accuracy_level 4: as 8-bit MatMulNBits at that level (above)."""
    signed = accuracy_level != 4 and s8_kernels_exact()
    if accuracy_level != 4 and not (signed or u8_kernels_exact()):
        return 0
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    index = GraphIndex(g)
    producer, consumers, outputs = index.producer, index.consumers, index.outputs

    dropped: set[int] = set()  # the (tokens, K) views' reshapes back that the level-4 form makes needless
    added: dict[int, list] = {}  # id of a MatMul replaced -> the nodes in its place
    rows_done: dict[str, tuple[str, str]] = {}  # activation DequantizeLinear output -> (row scales, zero points) as columns
    matmuls = [n for n in g.node if n.op_type == "MatMul"]  # held: replace_nodes keys them by id
    for node in matmuls:
        dq = producer.get(node.input[0])
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is None or q.op_type != "QuantizeLinear" or node_attribute(dq, "axis", 1) != 0 \
                or node_attribute(q, "axis", 1) != 0 \
                or list(q.input[1:3]) != list(dq.input[1:3]) or len(dq.input) < 3:
            continue
        weight = _weight_codes(producer.get(node.input[1]), inits, base_dir)
        if weight is None:
            continue
        codes, w_scale = weight
        base = node.name or node.output[0]
        if accuracy_level == 4 and codes.shape[0] % NBITS_BLOCK == 0:
            x, out = q.input[0], node.output[0]
            view = producer.get(x)
            if view is not None and view.op_type == "Reshape" and out not in outputs:
                # MatMulNBits takes (..., K): the activation as it came, with no (tokens, K) view and no reshape back
                back = _reshapes_back(out, consumers, outputs)
                if back is not None:
                    x, (out, reshapes) = view.input[0], back
                    dropped |= {id(r) for r in reshapes}
            added[id(node)] = _nbits_node(x, out, base, codes, w_scale, g)
            continue
        added[id(node)] = _integer_nodes(node, q, dq, codes, w_scale, rows_done, g, signed)
    if not added:
        return 0
    replace_nodes(g, set(added) | dropped, added)
    use_ms_domain(model)
    drop_dead_nodes(model)  # the activations' and weights' DequantizeLinears, and the int8 codes
    return len(added)


def _weight_codes(dq, inits: dict, base_dir: str):
    """(int8 codes [K, N], float32 scales [N]) behind a per-output-channel DequantizeLinear `dq`, or None."""
    from onnx import TensorProto, numpy_helper

    if dq is None or dq.op_type != "DequantizeLinear" or node_attribute(dq, "axis", 1) not in (1, -1) \
            or len(dq.input) < 2:
        return None
    codes, scale = inits.get(dq.input[0]), inits.get(dq.input[1])
    zp = inits.get(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
    if codes is None or scale is None or codes.data_type != TensorProto.INT8 or len(codes.dims) != 2 \
            or scale.data_type != TensorProto.FLOAT or list(scale.dims) != [codes.dims[1]]:
        return None
    if zp is not None and np.any(numpy_helper.to_array(zp, base_dir)):
        return None
    return numpy_helper.to_array(codes, base_dir), numpy_helper.to_array(scale, base_dir)


def _integer_nodes(node, q, dq, codes: np.ndarray, w_scale: np.ndarray, rows_done: dict, g, signed: bool) -> list:
    """The level-0 form of one per-token MatMul `node` (its activation's pair q, dq): MatMulIntegerToFloat over the
    rows' codes and their zero-point columns, times the row scales (module docstring). rows_done: each activation's
    row scales and zero points as columns, made once per activation; signed: the codes int8 (else uint8 + 128)."""
    from onnx import helper, numpy_helper

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
    stored = np.concatenate([codes, extra]).astype(np.int8)
    g.initializer.extend([
        numpy_helper.from_array(stored if signed else (stored.astype(np.int16) + 128).astype(np.uint8),
                                f"{base}.integer_codes"),
        numpy_helper.from_array(w_scale.astype(np.float32), f"{base}.codes_scale"),
        numpy_helper.from_array(np.array(0, np.int8) if signed else np.array(128, np.uint8), f"{base}.codes_zero_point"),
        numpy_helper.from_array(np.array(0, np.uint8), f"{base}.rows_zero_point"),
        numpy_helper.from_array(np.array(1.0, np.float32), f"{base}.rows_unit_scale")])
    return new + [
        helper.make_node("MatMulIntegerToFloat",
                         [rows, f"{base}.integer_codes", f"{base}.rows_unit_scale", f"{base}.codes_scale",
                          f"{base}.rows_zero_point", f"{base}.codes_zero_point"],
                         [f"{base}.integer"], name=f"{base}.integer", domain="com.microsoft"),
        helper.make_node("Mul", [f"{base}.integer", row_scale], list(node.output), name=f"{base}.row_scales")]


def _reshapes_back(out: str, consumers: dict, outputs: set) -> tuple[str, list] | None:
    """Where a 2-D MatMul output `out` only goes back to its activation's shape: one Reshape, or (sibling MatMuls
    fused, variant.py) a Split along the last axis whose every part goes to one Reshape. Returns (the output the
    MatMul computes on the un-viewed activation, the Reshapes that then go), the Split rewired to give the Reshapes'
    outputs along its last axis; None where it is not so."""
    after = consumers.get(out, [])
    if len(after) != 1:
        return None
    if after[0].op_type == "Reshape":
        return after[0].output[0], [after[0]]
    split = after[0]
    if split.op_type != "Split" or node_attribute(split, "axis", 0) not in (1, -1):
        return None
    parts = [consumers.get(o, []) for o in split.output]
    if any(len(p) != 1 or p[0].op_type != "Reshape" or o in outputs for p, o in zip(parts, split.output)):
        return None
    for i, (p,) in enumerate(parts):
        split.output[i] = p.output[0]
    for a in split.attribute:
        if a.name == "axis":
            a.i = -1
    return out, [p for (p,) in parts]


def _nbits_node(x: str, out: str, base: str, codes: np.ndarray, scale: np.ndarray, g) -> list:
    """One 8-bit MatMulNBits at accuracy level 4 computing x @ (codes * scale) with x quantized per NBITS_BLOCK inputs
    in the kernel: the codes [K, N] as unsigned bytes (+128, zero point 128) per output column [N, K/B, B], each
    block the column's scale."""
    from onnx import helper, numpy_helper

    k, n = codes.shape
    packed, scales, zero_points = pack_nbits(codes, np.repeat(scale.astype(np.float32)[None], k // NBITS_BLOCK, axis=0),
                                             None, NBITS_BLOCK, bits=8)
    g.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(packed), f"{base}.nbits"),
                          numpy_helper.from_array(scales, f"{base}.nbits_scale"),
                          numpy_helper.from_array(zero_points, f"{base}.nbits_zero_point")])
    return [helper.make_node("MatMulNBits", [x, f"{base}.nbits", f"{base}.nbits_scale", f"{base}.nbits_zero_point"],
                             [out], name=f"{base}.nbits", domain="com.microsoft", K=k, N=n, bits=8,
                             block_size=NBITS_BLOCK, accuracy_level=4)]
