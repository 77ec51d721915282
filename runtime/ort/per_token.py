"""Per-token INT8 MatMuls (calibration/qdq.py's `per_token` form) on ONNX Runtime's integer kernels.

The bundle's graph quantizes an activation a row (a token) at a time: a QuantizeLinear -> DequantizeLinear pair
on axis 0 of its (tokens, K) view, with a uint8 zero point per row, into MatMuls whose weights are
DequantizeLinears of int8 codes (a scale per output channel, zero point 0). ONNX Runtime fuses only per-tensor
activation scales into its integer kernels, so as written that runs in float. Here each such MatMul becomes

    y_rn = s_r * sum_k (q_rk - z_r) w_kn c_n = s_r * MatMulIntegerToFloat([q_r, z_r ... z_r], [w; e]; c)_rn

one integer kernel and a Mul by the row scales: the codes get E extra rows e_jn (each within int8) that sum to
-sum_k w_kn, and the row's codes as many columns holding its zero point, so the kernel subtracts the zero point's
term itself, in int32: the same function up to float rounding. A step of one row (a decode step at batch 1)
quantizes it with one DynamicQuantizeLinear instead (per tensor is per row there: the same scale, up to its
division's rounding, and zero point) over the activation padded with the zero columns (0.0 quantizes to the zero
point exactly): an If on the row count. At the model sizes this runs, a decode step's time goes largely to the
number of small nodes: SmolLM2-135M's INT8 step had 25 per activation here (the row scales' dozen, the (tokens, K)
view and its reshape back), now 7 (Size, Equal, If, Pad, DynamicQuantizeLinear, the kernel, the Mul): 17.4 -> 15.6
ms a step, old and new graphs in one process. The rows keep the activation's leading axes, so the view's reshape
back goes. The codes stay int8 where ONNX Runtime's uint8 x int8 kernel is exact here (VNNI; kvforge.ort_session's
`s8_kernels_exact` probes it once): at 128 rows it ran 5x the speed of the uint8 x uint8 one on this machine, which
is what a prefill is. Elsewhere (AVX2 without VNNI sums pairs of uint8 x int8 products in 16 bits and saturates)
they are stored as uint8 (+128, zero point 128, the same values), for the uint8 x uint8 kernel, which widens to 16
bits (`u8_kernels_exact`); where neither is exact the graph runs as written.
At MatMulNBits accuracy level 4 (the backend's opt-in `accuracy_level=4`, docs/ort-variant.md) each such MatMul is
instead one 8-bit MatMulNBits over the activation before its QuantizeLinear, at level 4: the weight's codes in
blocks of NBITS_BLOCK along K (each block the channel's scale: the same weights), the activation quantized to int8
per block inside the kernel (max|x| / 127, as llama.cpp's Q8 dot products), not per row with a zero point. The
rows' scale computation, the QuantizeLinear, the Mul by the row scales and the activation's (tokens, K) view and
its reshape back go (MatMulNBits takes (..., K)): one node where there were a dozen.
"""

from __future__ import annotations

import numpy as np

from kvforge.onnx_graph import GraphIndex, drop_dead_nodes, node_attribute, nodes_between, replace_nodes, use_ms_domain
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


def integer_per_token_matmuls(model, base_dir: str = "", accuracy_level: int = 0, leave: str | None = None) -> int:
    """Rewrite the graph's per-token INT8 MatMuls (float32 only) onto the integer kernels; returns how many.
    base_dir: where the graph's external data lies, for a graph loaded without it (the codes are read from there,
    and their uint8 form goes into the graph). accuracy_level 4: as 8-bit MatMulNBits at that level (above).
    leave: an activation whose MatMuls stay as written (the head's, rewritten after the variant slices its rows)."""
    signed = accuracy_level != 4 and s8_kernels_exact()
    if accuracy_level != 4 and not (signed or u8_kernels_exact()):
        return 0
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    index = GraphIndex(g)
    producer, consumers, outputs = index.producer, index.consumers, index.outputs

    dropped: set[int] = set()  # the (tokens, K) views' reshapes back that (..., K) forms make needless
    added: dict[int, list] = {}  # id of a MatMul replaced -> the nodes in its place
    activations: dict[str, list] = {}  # activation DequantizeLinear output -> its MatMuls [(node, q, codes, scales)]
    matmuls = [n for n in g.node if n.op_type == "MatMul"]  # held: replace_nodes keys them by id
    for node in matmuls:
        dq = producer.get(node.input[0])
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is None or q.op_type != "QuantizeLinear" or node_attribute(dq, "axis", 1) != 0 \
                or node_attribute(q, "axis", 1) != 0 \
                or list(q.input[1:3]) != list(dq.input[1:3]) or len(dq.input) < 3:
            continue
        view = producer.get(q.input[0])  # (the activation's (tokens, K) view, whose input `leave` names)
        if leave is not None and leave in (q.input[0], view.input[0] if view is not None else None):
            continue
        weight = _weight_codes(producer.get(node.input[1]), inits, base_dir)
        if weight is None:
            continue
        codes, w_scale = weight
        base = node.name or node.output[0]
        if accuracy_level == 4 and codes.shape[0] % NBITS_BLOCK == 0:
            x, out = q.input[0], node.output[0]
            if view is not None and view.op_type == "Reshape" and out not in outputs:
                # MatMulNBits takes (..., K): the activation as it came, with no (tokens, K) view and no reshape back
                back = _reshapes_back(out, consumers, outputs)
                if back is not None:
                    x, (out, reshapes) = view.input[0], back
                    dropped |= {id(r) for r in reshapes}
            added[id(node)] = _nbits_node(x, out, base, codes, w_scale, g)
            continue
        activations.setdefault(dq.output[0], []).append((node, q, codes, w_scale))
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    for group in activations.values():
        for (node, *_), nodes in zip(group, _integer_activation(group, index, g, signed, opset, dropped)):
            added[id(node)] = nodes
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


def _integer_activation(group: list, index, g, signed: bool, opset: int, dropped: set) -> list[list]:
    """The level-0 form of one activation's per-token MatMuls `group` [(MatMul, its QuantizeLinear, codes [K, N],
    scales [N])]: the nodes to put in each MatMul's place (module docstring), the first's preceded by the rows'
    quantization. That is an If on whether the step has one row: one DynamicQuantizeLinear (per tensor, which for
    one row is per row) of the activation padded with zero columns (quantized to the zero point exactly), else the
    graph's own row scales and QuantizeLinear, then the zero-point columns. Where the activation's (tokens, K)
    view is a Reshape to (-1, K) (opset >= 18), the rows keep the activation's leading axes, and each MatMul's
    reshape back goes (its rows already have them). dropped: gets those reshapes back. The If's condition reads
    the activation itself (its Size), so a pass that moves the nodes that depend on it (moe.py's) sees the If's
    dependence, which its branches' reads would hide. The graph's own rows' quantization is copied into the other
    branch (the nodes from the activation to the QuantizeLinear, onnx_graph.nodes_between); what it reads from
    elsewhere stays in the graph, read from the branch."""
    from onnx import helper, numpy_helper

    q = group[0][1]
    k = group[0][2].shape[0]
    p = f"{q.output[0]}_integer"
    view = index.producer.get(q.input[0])
    shape = index.const(view.input[1]) if view is not None and view.op_type == "Reshape" else None
    keep_axes = opset >= 18 and shape is not None and shape.tolist() == [-1, k]
    source = view.input[0] if keep_axes else q.input[0]
    between = {id(n) for n in nodes_between(index, source, q.output[0])}  # the graph's own rows' quantization
    upstream = [n for n in g.node if id(n) in between]  # (in graph order: the If branch's copy runs in it)
    extras = [_zero_point_rows(codes) for _, _, codes, _ in group]
    e = max(len(x) for x in extras)
    const = {"width": np.array(k, np.int64), "column": np.array([-1, 1], np.int64),
             "zero_point_columns": np.array([1, e], np.int64), "unit_scale": np.array(1.0, np.float32),
             "rows_zero_point": np.array(0, np.uint8), "padded_width": np.array([k + e], np.int64),
             "one": np.array([1], np.int64),
             "pads": np.array([0, e] if opset >= 18 else [0, 0, 0, e], np.int64), "last_axis": np.array([-1], np.int64)}
    g.initializer.extend(numpy_helper.from_array(v, f"{p}.{name}") for name, v in const.items())

    one = [helper.make_node("Pad", [source, f"{p}.pads", "", f"{p}.last_axis"][:4 if opset >= 18 else 2],
                            [f"{p}.one_row_padded"])] if e else []
    one.append(helper.make_node("DynamicQuantizeLinear", [f"{p}.one_row_padded" if e else source],
                                [f"{p}.one_row", f"{p}.one_row_scale", f"{p}.one_row_zero_point"]))
    branches = {"then_branch": _branch(f"{p}.one_row", one, f"{p}.one_row", f"{p}.one_row_scale"),
                "else_branch": _branch(f"{p}.rows", *_graphs_rows(p, q, upstream, source, e, keep_axes))}
    new = [helper.make_node("Size", [source], [f"{p}.size"]),
           helper.make_node("Equal", [f"{p}.size", f"{p}.width"], [f"{p}.one_row_step"]),
           helper.make_node("If", [f"{p}.one_row_step"], [f"{p}.rows", f"{p}.row_scale"], name=f"{p}.rows", **branches)]
    placed = []
    for (node, _, codes, w_scale), extra in zip(group, extras):
        base = node.name or node.output[0]
        stored = np.concatenate([codes, extra, np.zeros((e - len(extra), codes.shape[1]), np.int8)]).astype(np.int8)
        g.initializer.extend([
            numpy_helper.from_array(stored if signed else (stored.astype(np.int16) + 128).astype(np.uint8),
                                    f"{base}.integer_codes"),
            numpy_helper.from_array(w_scale.astype(np.float32), f"{base}.codes_scale"),
            numpy_helper.from_array(np.array(0, np.int8) if signed else np.array(128, np.uint8),
                                    f"{base}.codes_zero_point")])
        out, back = node.output[0], None
        if keep_axes:
            back = _reshapes_back(out, index.consumers, index.outputs)
            out = back[0] if back is not None else f"{base}.rows_out"
            dropped |= {id(r) for r in back[1]} if back is not None else set()
        new += [helper.make_node("MatMulIntegerToFloat",
                                 [f"{p}.rows", f"{base}.integer_codes", f"{p}.unit_scale", f"{base}.codes_scale",
                                  f"{p}.rows_zero_point", f"{base}.codes_zero_point"],
                                 [f"{base}.integer"], name=f"{base}.integer", domain="com.microsoft"),
                helper.make_node("Mul", [f"{base}.integer", f"{p}.row_scale"], [out], name=f"{base}.row_scales")]
        if keep_axes and back is None:  # the MatMul's (tokens, N) output, as the graph has it
            g.initializer.append(numpy_helper.from_array(np.array([-1, codes.shape[1]], np.int64), f"{base}.flat"))
            new.append(helper.make_node("Reshape", [out, f"{base}.flat"], list(node.output)))
        placed.append(new)
        new = []
    return placed


def _branch(name: str, nodes: list, rows: str, scale: str):
    """An If branch computing the rows (uint8) and their scale (float) from the outer graph's values."""
    from onnx import TensorProto, helper

    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(rows, TensorProto.UINT8, None),
                                               helper.make_tensor_value_info(scale, TensorProto.FLOAT, None)])


def _graphs_rows(p: str, q, upstream: list, source: str, e: int, keep_axes: bool) -> tuple[list, str, str]:
    """The graph's own rows as an If branch: its nodes from `source` to the QuantizeLinear `q` (`upstream`, in graph
    order) copied under new names, then the zero point's `e` columns and the rows' scales as a column; with
    keep_axes, both back on `source`'s leading axes. Returns (nodes, rows, scales)."""
    from onnx import helper

    names, nodes = {}, []
    for n in upstream:
        copy = helper.make_node(n.op_type, [names.get(i, i) for i in n.input],
                                [names.setdefault(o, f"{p}.rows/{o}") for o in n.output], domain=n.domain)
        copy.attribute.extend(n.attribute)
        nodes.append(copy)
    rows, scale, zp = (names.get(x, x) for x in (q.output[0], q.input[1], q.input[2]))
    nodes.append(helper.make_node("Reshape", [scale, f"{p}.column"], [f"{p}.rows/scale"]))
    scales = f"{p}.rows/scale"
    if e:
        nodes += [helper.make_node("Reshape", [zp, f"{p}.column"], [f"{p}.rows/zero_point"]),
                  helper.make_node("Expand", [f"{p}.rows/zero_point", f"{p}.zero_point_columns"], [f"{p}.rows/zps"]),
                  helper.make_node("Concat", [rows, f"{p}.rows/zps"], [f"{p}.rows/rows"], axis=1)]
        rows = f"{p}.rows/rows"
    if keep_axes:
        nodes += [helper.make_node("Shape", [source], [f"{p}.rows/lead"], end=-1),
                  helper.make_node("Concat", [f"{p}.rows/lead", f"{p}.padded_width"], [f"{p}.rows/shape"], axis=0),
                  helper.make_node("Concat", [f"{p}.rows/lead", f"{p}.one"], [f"{p}.rows/scale_shape"], axis=0),
                  # allowzero: no rows (a mixture's expert no token chose) is a length of 0, not a copied axis
                  helper.make_node("Reshape", [rows, f"{p}.rows/shape"], [f"{p}.rows/rows_nd"], allowzero=1),
                  helper.make_node("Reshape", [scales, f"{p}.rows/scale_shape"], [f"{p}.rows/scale_nd"],
                                   allowzero=1)]
        rows, scales = f"{p}.rows/rows_nd", f"{p}.rows/scale_nd"
    return nodes, rows, scales


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
