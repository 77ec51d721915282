"""FP16/BF16 graphs keep normalization, softmax and their reductions in FP32."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from kvforge.export import export
from kvforge.export.onnx_export import example_inputs
from kvforge.export.validate import OrtRunner

FP32 = onnx.TensorProto.FLOAT
REDUCTIONS = {"ReduceMean", "ReduceSum", "ReduceMax", "Softmax", "LayerNormalization"}


@pytest.mark.parametrize("name,dtype", [("gpt2-micro", "float16"), ("llama3-micro", "bfloat16")])
def test_norm_and_softmax_reductions_run_in_fp32(half_bundle, name, dtype):
    bundle = half_bundle(name, dtype)
    model = onnx.shape_inference.infer_shapes(onnx.load(str(bundle.graph_file)))
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.value_info) + list(model.graph.input)}
    reductions = [n for n in model.graph.node if n.op_type in REDUCTIONS]
    assert reductions, "expected norm/softmax reductions in the graph"
    for node in reductions:
        assert types.get(node.input[0]) == FP32, f"{node.op_type} {node.name} reduces in {types.get(node.input[0])}"
    # ... and the weights really are half precision
    half = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}[dtype]
    matmul_inputs = {types.get(n.input[1]) for n in model.graph.node if n.op_type == "MatMul"}
    assert half in matmul_inputs


def test_fp16_layernorm_does_not_overflow_on_large_activations(tmp_path):
    """Activations ~300: their squares (9e4) exceed FP16's max (65504); FP32 statistics keep it finite."""
    from kvforge.model_defs import load, save_checkpoint

    model, tok = load("gpt2-micro")
    with torch.no_grad():
        model.embed.weight.mul_(300.0)
    ckpt = save_checkpoint(model, tmp_path / "loud", tok)
    bundle = export(ckpt, tmp_path / "fp16", dtype="float16")
    runner = OrtRunner(bundle.graph_file, "float16")
    args = example_inputs(model.config, torch.float32, 2, 6, 3, seed=0)
    out = runner.run(args)
    assert all(np.isfinite(o.astype(np.float32)).all() for o in out)
    assert bundle.manifest["validation"]["passed"]
