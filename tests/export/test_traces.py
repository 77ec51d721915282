"""A trace is made once per structure (export/traces.py): an export of other weights of the same structure reuses
it, with its own weights bound, and computes what its Torch reference computes; anything else the trace could read
(a config value, a module attribute, a constant tensor, an option) makes a trace of its own."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from kvforge.export import traces
from kvforge.export.onnx_export import FlatKVModel, example_inputs, export_onnx, input_names, output_names
from kvforge.model_defs.architectures import preset_config
from kvforge.model_defs.model import build_model, init_random_weights

ATOL = 1e-4  # FP32 graph vs FP32 Torch, as the export tests


def _model(seed: int, **changes):
    cfg = dataclasses.replace(preset_config("llama3-micro"), n_layers=2, **changes)
    return init_random_weights(build_model(cfg), seed=seed)


@torch.no_grad()
def _assert_matches_torch(path, model):
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cfg = model.config
    flat = FlatKVModel(model)
    for n, (b, t, p) in enumerate(((1, 4, 0), (2, 1, 6))):
        args = example_inputs(cfg, torch.float32, b, t, p, seed=n)
        out = sess.run(None, {name: a.numpy() for name, a in zip(input_names(cfg), args)})
        for name, o, r in zip(output_names(cfg), out, flat(*args)):
            np.testing.assert_allclose(o, r.numpy(), atol=ATOL, rtol=0, err_msg=f"{name} at {(b, t, p)}")


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """How many times torch.onnx traced, with fresh stores of templates (this process's and a cache of its own)."""
    monkeypatch.setattr(traces, "_templates", type(traces._templates)())
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    calls = []
    real = torch.onnx.export
    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_other_weights_of_one_structure_reuse_its_trace_and_compute_their_own_function(tmp_path, counted):
    first, second = _model(seed=1), _model(seed=2)
    export_onnx(first, tmp_path / "first.onnx")
    traced_once = len(counted)
    export_onnx(second, tmp_path / "second.onnx")
    assert traced_once == 1 and len(counted) == 1  # the second export traced nothing
    _assert_matches_torch(tmp_path / "second.onnx", second)
    _assert_matches_torch(tmp_path / "first.onnx", first)  # and the first bundle kept its own weights
    a, b = (onnx.load(str(tmp_path / f"{n}.onnx")) for n in ("first", "second"))
    assert [n.op_type for n in a.graph.node] == [n.op_type for n in b.graph.node]
    # no weight of the first export is left in the template the second copied
    template = next(iter(traces._templates.values()))
    weights = traces.module_tensors(FlatKVModel(first, 1))
    assert all(traces._absent(v.const_value) for name, v in template.graph.initializers.items() if name in weights)


def test_what_the_trace_reads_besides_weights_makes_a_trace_of_its_own(tmp_path, counted):
    base = _model(seed=1)
    export_onnx(base, tmp_path / "base.onnx")
    assert len(counted) == 1
    theta = _model(seed=1, rope_theta=base.config.rope_theta * 7)  # a config value baked into the graph
    eps = _model(seed=1)
    for layer in eps.layers:
        layer.attn_norm.eps = 0.5  # a module attribute outside the config
    args = example_inputs(base.config, torch.float32, 1, 6, 0)
    with torch.no_grad():
        reference = FlatKVModel(base)(*args)[0]
        for n, variant in enumerate((theta, eps)):
            assert (FlatKVModel(variant)(*args)[0] - reference).abs().max() > 100 * ATOL  # a different function
            export_onnx(variant, tmp_path / f"{n}.onnx")
            assert len(counted) == 2 + n
            _assert_matches_torch(tmp_path / f"{n}.onnx", variant)


def test_the_key_describes_constants_by_content_and_refuses_what_it_cannot_describe():
    module = torch.nn.Linear(3, 2)
    key = traces.structure_key(module, (torch.zeros(1, 3),))
    module.weight.data.normal_()  # a weight's value is not structure
    assert traces.structure_key(module, (torch.zeros(1, 3),)) == key
    assert traces.structure_key(module, (torch.zeros(2, 3),)) != key  # an example input's shape is
    module.offset = torch.zeros(2)  # a plain tensor attribute: traced in as a constant
    with_offset = traces.structure_key(module, (torch.zeros(1, 3),))
    module.offset = torch.ones(2)
    assert with_offset != key and traces.structure_key(module, (torch.zeros(1, 3),)) != with_offset
    module.act = lambda x: x * 2  # a function by its code and what it closes over
    doubled = traces.structure_key(module, (torch.zeros(1, 3),))
    module.act = lambda x: x * 2
    assert traces.structure_key(module, (torch.zeros(1, 3),)) == doubled
    module.act = lambda x: x * 3
    assert traces.structure_key(module, (torch.zeros(1, 3),)) != doubled
    scale = 2.0
    module.act = lambda x: x * scale
    closed = traces.structure_key(module, (torch.zeros(1, 3),))
    scale = 3.0  # noqa: F841 - read by the lambda's closure
    assert traces.structure_key(module, (torch.zeros(1, 3),)) != closed
    module.helper = object()  # no description by content: no key, so traced afresh each time
    assert traces.structure_key(module, (torch.zeros(1, 3),)) is None


def test_another_process_reads_the_stored_template_and_a_damaged_one_is_traced_again(tmp_path, counted, monkeypatch):
    first, second = _model(seed=1), _model(seed=2)
    export_onnx(first, tmp_path / "first.onnx")
    stored = list((tmp_path / "cache" / "traces").glob("*/template.onnx"))
    assert len(counted) == 1 and len(stored) == 1
    weights = traces.module_tensors(FlatKVModel(first, 1))
    kept = onnx.load(str(stored[0]), load_external_data=False).graph.initializer
    assert {i.name for i in kept if i.data_location == onnx.TensorProto.EXTERNAL} == set(weights)  # no weight stored
    traces._templates.clear()  # as a new process finds it
    export_onnx(second, tmp_path / "second.onnx")
    assert len(counted) == 1
    _assert_matches_torch(tmp_path / "second.onnx", second)
    traces._templates.clear()
    stored[0].write_bytes(b"not a model")
    export_onnx(second, tmp_path / "again.onnx")
    assert len(counted) == 2
    _assert_matches_torch(tmp_path / "again.onnx", second)
    monkeypatch.setenv("KVFORGE_TRACE_CACHE", "0")  # the user's way to trace every export afresh
    export_onnx(second, tmp_path / "fresh.onnx")
    assert len(counted) == 3


def test_a_cache_that_cannot_be_written_keeps_the_trace_in_the_process_and_the_export_goes_on(tmp_path, counted,
                                                                                                monkeypatch, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("KVFORGE_CACHE", str(blocked))
    model = _model(seed=5)
    with caplog.at_level("WARNING", logger="kvforge.export"):
        export_onnx(model, tmp_path / "m.onnx")
    assert len(counted) == 1 and "traces are not kept on disk" in caplog.text and str(blocked) in caplog.text
    _assert_matches_torch(tmp_path / "m.onnx", model)
    assert blocked.read_text() == "not a directory"
    export_onnx(_model(seed=6), tmp_path / "again.onnx")  # still reused within the process
    assert len(counted) == 1


def test_the_key_tells_tied_weights_and_forward_hooks():
    def pair():
        return torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))

    untied, tied = pair(), pair()
    tied[1].weight = tied[0].weight  # one tensor under two names: torch.onnx keeps one initializer for both
    assert traces.structure_key(untied) != traces.structure_key(tied)
    assert traces.structure_key(untied) == traces.structure_key(pair())
    hooked = pair()
    hooked[0].register_forward_hook(lambda module, args, out: out * 2)  # traced with the module
    assert traces.structure_key(hooked) != traces.structure_key(untied)
