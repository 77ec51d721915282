"""Run a BF16 graph on a CPU that has no BF16 kernels: exact-rounding FP32 emulation.

ONNX Runtime's CPU provider lacks BF16 kernels for most ops. The emulation
keeps the graph's arithmetic but holds every BF16 tensor as FP32 whose value
is rounded to BF16 exactly where the original graph stores BF16: initializers,
graph inputs, Cast(to=BF16) and every node output typed BF16 (a Cast to BF16
and back, which ONNX Runtime implements with round-to-nearest-even). Ops then
compute in FP32 on BF16 values, as GPU BF16 kernels do with FP32 accumulation.
"""

from __future__ import annotations

from pathlib import Path

BF16, FLOAT = 16, 1


def emulate_bfloat16(path_or_model):
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path_or_model)) if isinstance(path_or_model, (str, Path)) else path_or_model
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    typed = list(inferred.graph.value_info) + list(model.graph.output)
    bf16_values = {v.name for v in typed if v.type.tensor_type.elem_type == BF16}
    graph = model.graph
    for init in graph.initializer:
        if init.data_type == BF16:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype("float32"), init.name))
    for v in list(graph.input) + list(graph.output) + list(graph.value_info):
        if v.type.tensor_type.elem_type == BF16:
            v.type.tensor_type.elem_type = FLOAT

    nodes = []
    for node in graph.node:
        for a in node.attribute:
            if a.name == "to" and a.i == BF16:  # Cast(to=BF16): round, stay in FP32
                a.i = FLOAT
                out = node.output[0]
                node.output[0] = out + "__pre_round"
                nodes.append(node)
                nodes += _round(out + "__pre_round", out, helper)
                break
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == BF16:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype("float32"), a.t.name))
        else:
            rounded = [o for o in node.output if o in bf16_values]
            for o in rounded:
                node.output[list(node.output).index(o)] = o + "__pre_round"
            nodes.append(node)
            for o in rounded:
                nodes += _round(o + "__pre_round", o, helper)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]
    return model


def _round(src: str, dst: str, helper):
    return [
        helper.make_node("Cast", [src], [dst + "__bf16"], to=BF16),
        helper.make_node("Cast", [dst + "__bf16"], [dst], to=FLOAT),
    ]
