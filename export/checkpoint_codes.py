"""A pre-quantized checkpoint's codes into the exported graph: each kept weight becomes its codes behind a
DequantizeLinear, so the bundle holds the model its authors validated, not a re-quantization of it.

The float graph is exported first, from the checkpoint's own dequantization (model_defs/quantized.py). Then
each weight that has codes is replaced, under the same tensor name, by

    DequantizeLinear(codes, scale[, zero_point], block_size along `in`)   (per axis where one block spans `in`)
    [ -> Reshape into blocks -> Add(offset) -> Reshape back ]             (GGUF's block minimum, K-quants' dmin)
    [ -> Gather(inverse order) along `in` ]                               (GPTQ's act-order)

which computes exactly `WeightCodes.dequantize()`: the checkpoint's dequantization, bit for bit (checked here
against the exported initializer before it is replaced; a weight whose codes do not reproduce it is refused). A
tensor of a type no Q/DQ expresses was converted to other codes by its reader, which recorded the error; its
initializer is found by the checkpoint's own dequantization. Where every kept weight is exact and no activation
is quantized (QuantizedCheckpoint.exact), export validates the graph as written; else its float graph, before
the codes go in.
A linear weight is stored [in, out] for MatMul; an embedding table (and a head tied to it) [vocab, hidden], as
the codes are. W8A8 checkpoints also quantize each such MatMul's input: QuantizeLinear -> DequantizeLinear with
the checkpoint's static scale, or the per-token dynamic form (scale = max |x| over the row / 127 or / 448,
composed of float ops: ONNX's QuantizeLinear takes one scale per tensor or axis, not per row; also per token
group and per tensor where the checkpoint says so).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvforge.errors import KvforgeError
from kvforge.model_defs.quantized import QuantizedCheckpoint, WeightCodes

# dynamic scales: max |x| over this, as compressed-tensors computes them ((q_max - q_min) / 2: int8's 255 / 2)
_HALF_RANGE = {"int8": 127.5, "fp8": 448.0}


def keep_codes(model, quantized: QuantizedCheckpoint, base_dir: str = "") -> list[str]:
    """Replace the graph's float weights by the checkpoint's codes, in place; returns the parameters kept.
    base_dir: where the graph's external data is, for a model loaded without it (each weight compared is read
    from it alone)."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    readers: dict[str, list] = {}
    for n in g.node:
        for i, name in enumerate(n.input):
            readers.setdefault(name, []).append((n, i))
    by_shape: dict[tuple, list[str]] = {}
    for name, init in inits.items():
        by_shape.setdefault(tuple(init.dims), []).append(name)
    head, tail, kept = [], [], []
    for param, codes in sorted(quantized.codes.items()):
        found = _find(param, codes, inits, by_shape, base_dir)
        if found is None:
            raise KvforgeError(f"the exported graph holds no tensor equal to {param}'s dequantized codes "
                               f"({codes.source}); export with --dequantize for a float bundle")
        name, transposed = found
        g.initializer.remove(inits.pop(name))
        head += _dequantize_nodes(g, name, codes, transposed)
        if codes.activation:
            for node, index in readers.get(name, []):
                if node.op_type == "MatMul" and index == 1:
                    tail.append((node, _activation_nodes(g, node, name, codes.activation)))
        kept.append(param)
    before = {id(node): nodes for node, nodes in tail}
    nodes = list(head)
    for n in g.node:
        nodes += before.get(id(n), [])
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    return kept


def _find(param: str, codes: WeightCodes, inits: dict, by_shape: dict, base_dir: str = "") -> tuple[str, bool] | None:
    """The initializer holding the codes' weight (the parameter's name first, then any of its shape holding the
    same values: a tied head is exported under the head's name), and whether it is stored transposed ([in, out]).
    The initializer is read whole, the weight made a chunk of rows at a time against it."""
    from onnx import numpy_helper

    out, k = codes.shape
    names = [f"model.{param}"] + by_shape.get((k, out), []) + by_shape.get((out, k), [])
    for name in dict.fromkeys(names):
        if name not in inits:
            continue
        value = numpy_helper.to_array(inits[name], base_dir)
        if value.dtype != np.float32:
            continue
        for transposed in (True, False):
            if codes.matches(value, transposed):
                return name, transposed
    return None


def _dequantize_nodes(g, name: str, codes: WeightCodes, transposed: bool) -> list:
    """Initializers and nodes that compute tensor `name` ([in, out] where transposed, else [out, in])."""
    from onnx import TensorProto, helper, numpy_helper

    lay = (lambda a: np.ascontiguousarray(a.T)) if transposed else (lambda a: np.ascontiguousarray(a))  # noqa: E731
    axis = 0 if transposed else 1  # the `in` axis
    out, k = codes.shape
    per_axis = codes.block == k
    shaped = (lambda a: a[:, 0]) if per_axis else lay  # noqa: E731  one scale per output row: a 1-D per-axis scale
    q, s, z = f"{name}_quantized", f"{name}_scale", f"{name}_zero_point"
    g.initializer.append(numpy_helper.from_array(lay(codes.codes), q))
    g.initializer.append(numpy_helper.from_array(shaped(codes.scale).astype(np.float32), s))
    inputs = [q, s]
    zero_point = codes.zero_point
    if zero_point is None and codes.kind in ("uint4", "uint8", "fp8"):  # unsigned and FP8 codes name their zero
        zero_point = np.zeros(codes.scale.shape, codes.codes.dtype)
    if zero_point is not None:
        if codes.kind == "fp8":
            g.initializer.append(helper.make_tensor(z, TensorProto.FLOAT8E4M3FN, list(shaped(zero_point).shape),
                                                    np.zeros(zero_point.size).tolist()))
        else:
            g.initializer.append(numpy_helper.from_array(shaped(zero_point), z))
        inputs.append(z)
    attrs = {"axis": 1 - axis} if per_axis else {"axis": axis, "block_size": codes.block}
    plain = f"{name}_dequantized"
    nodes = [helper.make_node("DequantizeLinear", inputs, [plain], name=f"{name}_dq", **attrs)]
    current = plain
    if codes.offset is not None:
        blocks = k // codes.block
        # [in, out] -> [in/B, B, out] (+ offset [in/B, 1, out]); [out, in] -> [out, in/B, B] (+ [out, in/B, 1])
        split = [blocks, codes.block, out] if transposed else [out, blocks, codes.block]
        offset = lay(codes.offset).reshape([blocks, 1, out] if transposed else [out, blocks, 1]).astype(np.float32)
        g.initializer.extend([numpy_helper.from_array(np.array(split, np.int64), f"{name}_blocks"),
                              numpy_helper.from_array(offset, f"{name}_offset"),
                              numpy_helper.from_array(np.array([k, out] if transposed else [out, k], np.int64),
                                                      f"{name}_shape")])
        nodes += [helper.make_node("Reshape", [current, f"{name}_blocks"], [f"{name}_in_blocks"], name=f"{name}_split"),
                  helper.make_node("Add", [f"{name}_in_blocks", f"{name}_offset"], [f"{name}_offset_added"],
                                   name=f"{name}_add_offset"),
                  helper.make_node("Reshape", [f"{name}_offset_added", f"{name}_shape"], [f"{name}_blocked"],
                                   name=f"{name}_join")]
        current = f"{name}_blocked"
    if codes.input_order is not None:
        g.initializer.append(numpy_helper.from_array(np.argsort(codes.input_order).astype(np.int64), f"{name}_order"))
        nodes.append(helper.make_node("Gather", [current, f"{name}_order"], [f"{name}_ordered"], name=f"{name}_unorder",
                                      axis=axis))
        current = f"{name}_ordered"
    nodes.append(helper.make_node("Identity", [current], [name], name=f"{name}_weight"))
    return nodes


def _activation_nodes(g, matmul, weight: str, activation: dict[str, Any]) -> list:
    """The MatMul's input quantized as the checkpoint says: one static scale (and zero point) per tensor, or
    dynamic scales per token, per token group or per tensor."""
    from onnx import TensorProto, helper, numpy_helper

    fmt, scale = activation["format"], activation.get("scale")
    x, p = matmul.input[0], f"{weight}.input"
    const = lambda value, name, dtype=np.float32: g.initializer.append(  # noqa: E731
        numpy_helper.from_array(np.array(value, dtype), f"{p}_{name}"))
    if scale is not None:
        const(scale, "scale")
        zp_type = TensorProto.INT8 if fmt == "int8" else TensorProto.FLOAT8E4M3FN
        g.initializer.append(helper.make_tensor(f"{p}_zero_point", zp_type, [], [activation.get("zero_point", 0)]))
        matmul.input[0] = f"{p}_dequantized"
        return [helper.make_node("QuantizeLinear", [x, f"{p}_scale", f"{p}_zero_point"], [f"{p}_quantized"], name=f"{p}_q"),
                helper.make_node("DequantizeLinear", [f"{p}_quantized", f"{p}_scale", f"{p}_zero_point"],
                                 [f"{p}_dequantized"], name=f"{p}_dq")]
    # dynamic: scale = max |x| over the token (its group, the tensor) / the format's half range, then round and
    # clip (int8) or cast (fp8, saturating) and scale back, as compressed-tensors' forward computes it
    granularity = activation.get("granularity", "token")
    nodes, source = [], x
    const(_HALF_RANGE[fmt], "range")
    const(np.finfo(np.float32).tiny, "tiny")
    if granularity == "token group":
        const([-1, int(activation["group_size"])], "groups", np.int64)
        const([0], "start", np.int64)
        const([-1], "end", np.int64)
        nodes += [helper.make_node("Shape", [x], [f"{p}_shape"], name=f"{p}_shape"),
                  helper.make_node("Slice", [f"{p}_shape", f"{p}_start", f"{p}_end"], [f"{p}_lead"], name=f"{p}_lead"),
                  helper.make_node("Concat", [f"{p}_lead", f"{p}_groups"], [f"{p}_group_shape"], name=f"{p}_group_shape",
                                   axis=0),
                  helper.make_node("Reshape", [x, f"{p}_group_shape"], [f"{p}_grouped"], name=f"{p}_group")]
        source = f"{p}_grouped"
    nodes.append(helper.make_node("Abs", [source], [f"{p}_abs"], name=f"{p}_abs"))
    if granularity == "tensor":
        nodes.append(helper.make_node("ReduceMax", [f"{p}_abs"], [f"{p}_amax"], name=f"{p}_amax", keepdims=0))
    else:
        const([-1], "axes", np.int64)
        nodes.append(helper.make_node("ReduceMax", [f"{p}_abs", f"{p}_axes"], [f"{p}_amax"], name=f"{p}_amax", keepdims=1))
    nodes += [helper.make_node("Div", [f"{p}_amax", f"{p}_range"], [f"{p}_raw_scale"], name=f"{p}_raw_scale"),
              helper.make_node("Max", [f"{p}_raw_scale", f"{p}_tiny"], [f"{p}_scale"], name=f"{p}_scale"),
              helper.make_node("Div", [source, f"{p}_scale"], [f"{p}_scaled"], name=f"{p}_scaled")]
    if fmt == "int8":
        const(-128.0, "low")
        const(127.0, "high")
        nodes += [helper.make_node("Round", [f"{p}_scaled"], [f"{p}_rounded"], name=f"{p}_round"),
                  helper.make_node("Clip", [f"{p}_rounded", f"{p}_low", f"{p}_high"], [f"{p}_codes"], name=f"{p}_clip")]
    else:
        nodes += [helper.make_node("Cast", [f"{p}_scaled"], [f"{p}_fp8"], name=f"{p}_to_fp8", to=TensorProto.FLOAT8E4M3FN),
                  helper.make_node("Cast", [f"{p}_fp8"], [f"{p}_codes"], name=f"{p}_from_fp8", to=TensorProto.FLOAT)]
    out = f"{p}_dequantized"
    if granularity == "token group":
        nodes += [helper.make_node("Mul", [f"{p}_codes", f"{p}_scale"], [f"{p}_grouped_dq"], name=f"{p}_dq"),
                  helper.make_node("Reshape", [f"{p}_grouped_dq", f"{p}_shape"], [out], name=f"{p}_ungroup")]
    else:
        nodes.append(helper.make_node("Mul", [f"{p}_codes", f"{p}_scale"], [out], name=f"{p}_dq"))
    matmul.input[0] = out
    return nodes
