"""Reading ONNX graphs: element type names, every value's type, constants. Shared by export's lint and engine
plan, calibration's Q/DQ rewrite and the runtime's ONNX Runtime rewrites (docs/design.md, Layers).

`onnx` is imported where it is used: the core is imported by users of the ONNX Runtime path alone.
"""

from __future__ import annotations

from typing import Any

# TensorProto element types by their names in TensorRT's tables (FP8 covers every 8-bit float).
TYPE_NAMES = {
    1: "FP32", 10: "FP16", 16: "BF16", 6: "INT32", 7: "INT64", 9: "BOOL", 3: "INT8", 2: "UINT8",
    17: "FP8", 18: "FP8", 19: "FP8", 20: "FP8", 22: "INT4", 21: "UINT4", 23: "FP4", 11: "DOUBLE",
    5: "INT16", 4: "UINT16", 12: "UINT32", 13: "UINT64", 8: "STRING",
}


def value_types(model) -> dict[str, int]:
    """Every value's element type: inferred where shape inference can, else as declared; initializers and Constants."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # inference is best-effort here: fall back to declared types
        inferred = model
    g = inferred.graph
    types = {}
    for v in list(g.value_info) + list(g.input) + list(g.output):
        types[v.name] = v.type.tensor_type.elem_type
    for init in g.initializer:
        types[init.name] = init.data_type
    for node in g.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    types[node.output[0]] = a.t.data_type
    return types


def constant(graph, name: str) -> Any:
    """The value of an initializer or Constant output as an array; None when it is computed (or stored outside)."""
    from onnx import numpy_helper

    for init in graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init) if not init.external_data else None
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
    return None
