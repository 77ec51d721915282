"""Export traces each layer design once and copies it for the other layers (export/replicate.py): the copies are
the Torch reference's layers, with their own weights, caches and data-dependent sizes."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from kvforge.export import onnx_export
from kvforge.export import replicate as replicate_module
from kvforge.export.onnx_export import FlatKVModel, example_inputs, export_onnx, input_names, output_names
from kvforge.export.replicate import NotReplicable, replicate, traced_prefix
from kvforge.model_defs.architectures import preset_config
from kvforge.model_defs.model import build_model, init_random_weights

ATOL = 1e-4  # FP32 graph vs FP32 Torch, as the export tests


def _model(preset: str, n_layers: int, seed: int = 0):
    cfg = dataclasses.replace(preset_config(preset), n_layers=n_layers)
    return init_random_weights(build_model(cfg), seed=seed)


@torch.no_grad()
def _assert_matches_torch(path, model, shapes=((1, 1, 0), (2, 5, 0), (3, 1, 9), (2, 3, 6))):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cfg = model.config
    assert [i.name for i in sess.get_inputs()] == input_names(cfg)
    assert [o.name for o in sess.get_outputs()] == output_names(cfg)
    flat = FlatKVModel(model)
    for n, (b, t, p) in enumerate(shapes):
        args = example_inputs(cfg, torch.float32, b, t, p, seed=n)
        out = sess.run(None, {name: a.numpy() for name, a in zip(input_names(cfg), args)})
        for name, o, r in zip(output_names(cfg), out, flat(*args)):
            np.testing.assert_allclose(o, r.numpy(), atol=ATOL, rtol=0, err_msg=f"{name} at {(b, t, p)}")


def test_layers_of_one_design_share_a_traced_layer():
    model = _model("llama3-micro", 6)
    assert traced_prefix(model.layers) == (1, [0] * 6)
    model.layers[4].attn.window = 3  # a different window: its own graph
    assert traced_prefix(model.layers) == (5, [0, 1, 2, 3, 4, 3])
    gemma = build_model(preset_config("gemma-micro"))  # alternating windowed and global layers
    k, rep = traced_prefix(gemma.layers)
    windows = [gemma.config.layer_window(i) for i in range(gemma.config.n_layers)]
    assert k == 2 and len(set(windows)) == 2
    assert all(windows[rep[i]] == windows[i] for i in range(len(rep)))
    deepseek = build_model(preset_config("deepseek-micro"))  # a dense first layer, then a mixture
    assert traced_prefix(deepseek.layers)[0] == 2


# Gemma's five layers (two designs, alternating) are a structure of their own (12 s of tracing): in the slow tier;
# the default tier keeps a deep copy of one design (Llama) and of a mixture here, and Gemma's two designs copied
# in the gemma-micro preset's export (four layers, tests/export/test_export.py) and traced_prefix's test above
@pytest.mark.parametrize("preset,n_layers", [("llama3-micro", 6), pytest.param("gemma-micro", 5, marks=pytest.mark.slow),
                                             ("mixtral-micro", 2)])
def test_a_deep_model_is_traced_as_its_prefix_and_matches_torch(tmp_path, monkeypatch, preset, n_layers):
    model = _model(preset, n_layers, seed=3)
    traced = []
    real = onnx_export.trace

    def spy(module, *args, **kwargs):
        traced.append(len(module.model.layers))
        return real(module, *args, **kwargs)

    monkeypatch.setattr(onnx_export, "trace", spy)
    path = export_onnx(model, tmp_path / "model.onnx")
    assert traced == [traced_prefix(model.layers)[0]] and traced[0] < n_layers
    graph = ir.load(path).graph
    scopes = {f"layers.{i}." for i in range(n_layers)}
    named = {s for s in scopes for name in graph.initializers if f"model.{s}" in name}
    assert named == scopes  # every layer's weights are its own initializers
    _assert_matches_torch(path, model)


def test_a_copy_reads_its_own_weights(tmp_path):
    """Layers that differ only in weights: a copy that read its design's traced weights would match a model
    whose layer 3 is layer 0's; the export matches the model, not that one."""
    model = _model("llama3-micro", 4, seed=5)
    path = export_onnx(model, tmp_path / "model.onnx")
    wrong = _model("llama3-micro", 4, seed=5)
    wrong.layers[3].load_state_dict(wrong.layers[0].state_dict())
    _assert_matches_torch(path, model)
    with pytest.raises(AssertionError):
        _assert_matches_torch(path, wrong, shapes=((1, 4, 0),))


def test_a_layer_that_reads_another_layers_values_is_not_copied():
    model = _model("llama3-micro", 3)
    program = onnx_export._trace_flat(model, 21, n_layers=2)
    graph = program.model.graph
    scope = "pkg.torch.onnx.name_scopes"
    first = [n for n in graph if "model.layers.0.attn'" in n.metadata_props.get(scope, "") and n.op_type == "MatMul"]
    second = [n for n in graph if "model.layers.1.attn'" in n.metadata_props.get(scope, "") and n.op_type == "MatMul"]
    second[-1].replace_input_with(0, first[-1].inputs[0])  # layer 1's output projection reads layer 0's heads
    tensors = {f"model.{k}": v for k, v in model.state_dict(keep_vars=True).items()}
    with pytest.raises(NotReplicable, match="another layer's value|read outside it"):
        replicate(program.model, 2, [0, 1, 1], tensors, output_names(model.config), input_names(model.config))


def test_a_model_that_cannot_be_copied_is_traced_whole(tmp_path, monkeypatch, caplog):
    model = _model("llama3-micro", 2, seed=1)

    def refuse(*args, **kwargs):
        raise NotReplicable("layer 1 reads another layer's value 'x'")

    monkeypatch.setattr(replicate_module, "replicate", refuse)
    with caplog.at_level(logging.WARNING, logger="kvforge.export"):
        path = export_onnx(model, tmp_path / "model.onnx")
    assert "tracing all 2 layers: layer 1 reads another layer's value" in caplog.text
    _assert_matches_torch(path, model)


@torch.no_grad()
def test_an_encoders_layers_are_copied_too(tmp_path, monkeypatch):
    """An encoder (BERT: post-norm, its last hidden state the last layer's output, no cache) takes the same path."""
    from kvforge.export import encoder_export
    from kvforge.model_defs.architectures import build

    cfg = dataclasses.replace(preset_config("bert-micro"), n_layers=4)
    model = build(cfg).eval()
    gen = torch.Generator().manual_seed(7)
    for p in model.parameters():
        p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    traced = []
    real = encoder_export.trace
    monkeypatch.setattr(encoder_export, "trace",
                        lambda module, *a, **kw: traced.append(len(module.model.layers)) or real(module, *a, **kw))
    path = encoder_export.export_encoder_onnx(model, tmp_path / "model.onnx", 21)
    assert traced == [1]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = encoder_export.input_names(cfg)
    assert [o.name for o in sess.get_outputs()] == encoder_export.output_names(cfg)
    for n, (batch, seq) in enumerate([(1, 3), (3, 9)]):
        args = encoder_export.example_inputs(cfg, batch, seq, [seq, seq - 2, 1][:batch], seed=n)
        out = sess.run(None, {k: a.numpy() for k, a in zip(names, args)})
        for name, o, r in zip(encoder_export.output_names(cfg), out, encoder_export.FlatEncoder(model)(*args)):
            np.testing.assert_allclose(o, r.numpy(), atol=ATOL, rtol=0, err_msg=name)
