"""Fusions for the ONNX Runtime variant: decomposed RMSNorm and RoPE become ORT's fused kernels.

The exporter writes RMSNorm and rotary embeddings as chains of small
elementwise ops (standard ONNX, what TensorRT reads). ONNX Runtime's CPU
provider pays a kernel launch and a pass over memory for each, which at batch
1 is a good part of a decode step. Its own optimizers do not recognise these
chains, so the variant rewrites them:

- x -> Pow 2 -> ReduceMean(-1) -> Add eps -> Sqrt -> Reciprocal -> Mul x -> Mul weight
  becomes SimplifiedLayerNormalization(x, weight, epsilon), and with the
  residual Add that produces x, SkipSimplifiedLayerNormalization (which also
  returns the sum for the next residual);
- x * cos + cat(-x[half:], x[:half]) * sin, with cos/sin = Cos/Sin(cat(f, f))
  and f the graph's own angles, becomes com.microsoft RotaryEmbedding over
  the half-angle tables Cos(f), Sin(f). The tables are indexed by each
  token's flat (batch, position) index, so the angles are exactly those the
  graph computes (any position ids, left padding, any RoPE scaling).

Only float32 chains are matched; anything that differs from the pattern in
any way (another consumer of an intermediate, a different axis, exponent or
slice) is left as it is. Same arithmetic, fewer kernels.
"""

from __future__ import annotations


import numpy as np

from kvforge.onnx_graph import MS_DOMAIN, GraphIndex, node_attribute, replace_nodes, scalar_value, use_ms_domain


def fuse_rms_norms(model) -> int:
    """Rewrite float32 RMSNorm chains as SimplifiedLayerNormalization; returns how many."""
    from onnx import helper

    g = GraphIndex(model.graph)
    removed, added, count = set(), {}, 0
    for pow_ in list(model.graph.node):
        if pow_.op_type != "Pow" or scalar_value(g.const(pow_.input[1])) != 2.0:
            continue
        x = pow_.input[0]
        mean = g.only_consumer(pow_.output[0], "ReduceMean")
        if mean is None or node_attribute(mean, "keepdims", 1) != 1:
            continue
        axes = g.axes(mean)
        if axes is None or axes.tolist() != [-1]:
            continue
        add = g.only_consumer(mean.output[0], "Add")
        eps = scalar_value(g.const(g.other_input(add, mean.output[0]) or "")) if add is not None else None
        sqrt = g.only_consumer(add.output[0], "Sqrt") if eps is not None else None
        recip = g.only_consumer(sqrt.output[0], "Reciprocal") if sqrt is not None else None
        scaled = g.only_consumer(recip.output[0], "Mul") if recip is not None else None
        if scaled is None or g.other_input(scaled, recip.output[0]) != x:
            continue
        weighted = g.only_consumer(scaled.output[0], "Mul")
        weight_name = g.other_input(weighted, scaled.output[0]) if weighted is not None else None
        weight = g.const(weight_name) if weight_name else None
        if weight is None or weight.ndim != 1 or weight.dtype != np.float32:
            continue
        chain = (pow_, mean, add, sqrt, recip, scaled, weighted)
        removed |= {id(n) for n in chain}
        added[id(weighted)] = [helper.make_node(
            "SimplifiedLayerNormalization", [x, weight_name], [weighted.output[0]],
            name=f"{pow_.name or weighted.output[0]}_rmsnorm", axis=-1, epsilon=eps, stash_type=1,
        )]
        count += 1
    replace_nodes(model.graph, removed, added)
    return count


def fuse_skip_rms_norms(model) -> int:
    """Residual Add -> SimplifiedLayerNormalization becomes com.microsoft SkipSimplifiedLayerNormalization; returns how many.

    Only where the graph's shape information says both addends are the same
    (batch, seq, hidden) shape, which is what the fused kernel takes.
    """
    from onnx import helper

    g = GraphIndex(model.graph)
    removed, added, count = set(), {}, 0
    for norm in list(model.graph.node):
        if norm.op_type != "SimplifiedLayerNormalization" or len(norm.output) != 1:
            continue
        add = g.producer.get(norm.input[0])
        if add is None or add.op_type != "Add" or len(add.input) != 2 or id(add) in removed:
            continue
        a, b = (g.dims(x) for x in add.input)
        if a is None or a != b or len(a) != 3 or any(g.const(x) is not None for x in add.input):
            continue
        removed |= {id(add), id(norm)}
        added[id(norm)] = [helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]],
            [norm.output[0], "", "", add.output[0]], domain=MS_DOMAIN, name=f"{norm.name}_skip",
            epsilon=node_attribute(norm, "epsilon", 1e-5),
        )]
        count += 1
    if count:
        use_ms_domain(model)
        replace_nodes(model.graph, removed, added)
    return count


def _slice_bounds(g: GraphIndex, node) -> tuple[int, int] | None:
    """(start, end) of a Slice on the last axis with step 1, else None."""
    if node.op_type != "Slice" or len(node.input) < 3:
        return None
    starts, ends = g.const(node.input[1]), g.const(node.input[2])
    axes = g.const(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    steps = g.const(node.input[4]) if len(node.input) > 4 and node.input[4] else None
    if starts is None or ends is None or starts.size != 1 or ends.size != 1:
        return None
    if steps is not None and steps.reshape(-1).tolist() != [1]:
        return None
    if axes is None or axes.reshape(-1).tolist() not in ([-1], [3]):  # the head dim of (B, heads, T, D)
        return None
    return int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])


def _angle_source(g: GraphIndex, table: str, op: str) -> str | None:
    """f for table = Unsqueeze(op(Concat(f, f)), [1]), else None."""
    unsq = g.producer.get(table)
    if unsq is None or unsq.op_type != "Unsqueeze":
        return None
    axes = g.axes(unsq)
    trig = g.producer.get(unsq.input[0])
    if axes is None or axes.tolist() != [1] or trig is None or trig.op_type != op:
        return None
    cat = g.producer.get(trig.input[0])
    if cat is None or cat.op_type != "Concat" or node_attribute(cat, "axis") != -1 or len(cat.input) != 2 or cat.input[0] != cat.input[1]:
        return None
    return cat.input[0]


def fuse_rotary(model) -> int:
    """Rewrite float32 rotate-half RoPE chains as com.microsoft RotaryEmbedding; returns how many."""
    from onnx import helper, numpy_helper

    g = GraphIndex(model.graph)
    removed, added, tables, count = set(), {}, {}, 0
    for cat in list(model.graph.node):
        if cat.op_type != "Concat" or node_attribute(cat, "axis") != -1 or len(cat.input) != 2:
            continue
        neg, low = g.producer.get(cat.input[0]), g.producer.get(cat.input[1])
        if neg is None or neg.op_type != "Neg" or low is None or g.only_consumer(neg.output[0], "Concat") is not cat:
            continue
        high = g.producer.get(neg.input[0])
        if high is None or g.only_consumer(high.output[0], "Neg") is not neg or g.only_consumer(low.output[0], "Concat") is not cat:
            continue
        hb, lb = _slice_bounds(g, high), _slice_bounds(g, low)
        if hb is None or lb is None or high.input[0] != low.input[0]:
            continue
        half = hb[0]
        if lb != (0, half) or hb[1] < np.iinfo(np.int32).max:  # x[..., half:] and x[..., :half]
            continue
        x = high.input[0]
        dims = g.dims(x)
        if dims is not None and len(dims) != 4:  # the kernel's (batch, heads, seq, head_dim) layout
            continue
        mul_sin = g.only_consumer(cat.output[0], "Mul")
        sin_t = g.other_input(mul_sin, cat.output[0]) if mul_sin is not None else None
        add = g.only_consumer(mul_sin.output[0], "Add") if mul_sin is not None else None
        mul_cos = g.producer.get(g.other_input(add, mul_sin.output[0]) or "") if add is not None else None
        if mul_cos is None or mul_cos.op_type != "Mul" or g.only_consumer(mul_cos.output[0], "Add") is not add:
            continue
        cos_t = g.other_input(mul_cos, x)
        f = _angle_source(g, cos_t, "Cos") if cos_t else None
        if f is None or _angle_source(g, sin_t, "Sin") != f:
            continue
        if f not in tables:
            tables[f] = _half_tables(f, half, len(tables))
            # the tables go right after f's producer (all layers share them)
            anchor = g.consumers[f][0]
            added.setdefault(id(anchor), []).extend(tables[f][1])
        cos_cache, sin_cache, ids = tables[f][0]
        removed |= {id(n) for n in (cat, neg, high, low, mul_sin, mul_cos, add)}
        added.setdefault(id(add), []).append(helper.make_node(
            "RotaryEmbedding", [x, ids, cos_cache, sin_cache], [add.output[0]], domain=MS_DOMAIN,
            name=f"{add.name or add.output[0]}_rope", interleaved=0,
        ))
        count += 1
    if count:
        model.graph.initializer.extend([
            numpy_helper.from_array(np.array(0, np.int64), "kvforge_rope_start"),
            numpy_helper.from_array(np.array(1, np.int64), "kvforge_rope_step"),
        ])
        use_ms_domain(model)
        replace_nodes(model.graph, removed, added)
    return count


def _half_tables(f: str, half: int, index: int):
    """Nodes computing cos/sin tables (B*T, half) of the angles f (B, T, half), and ids (B, T) indexing their rows."""
    from onnx import helper

    p = f"kvforge_rope{index}"
    nodes = [
        helper.make_node("Cos", [f], [f"{p}_cos"]),
        helper.make_node("Sin", [f], [f"{p}_sin"]),
        helper.make_node("Shape", [f], [f"{p}_bt"], start=0, end=2),
        helper.make_node("ReduceProd", [f"{p}_bt"], [f"{p}_rows"], keepdims=0),
        helper.make_node("Range", ["kvforge_rope_start", f"{p}_rows", "kvforge_rope_step"], [f"{p}_range"]),
        helper.make_node("Reshape", [f"{p}_range", f"{p}_bt"], [f"{p}_ids"]),
        helper.make_node("Reshape", [f"{p}_cos", f"{p}_table_shape"], [f"{p}_cos_cache"]),
        helper.make_node("Reshape", [f"{p}_sin", f"{p}_table_shape"], [f"{p}_sin_cache"]),
    ]
    # (rows, half): -1 rows, `half` columns
    nodes.insert(0, helper.make_node("Constant", [], [f"{p}_table_shape"], value=helper.make_tensor(
        f"{p}_table_shape_value", 7, [2], [-1, half])))
    return (f"{p}_cos_cache", f"{p}_sin_cache", f"{p}_ids"), nodes
