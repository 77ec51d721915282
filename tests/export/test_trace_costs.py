"""The fixed costs export removes from every torch.onnx trace (docs/design.md, "The test suite")."""

from __future__ import annotations

import torch
from torch import nn

from kvforge.export import lazy_weights, onnx_export


class _Halves(nn.Module):
    """Two Slices of one input and an op after each."""

    def forward(self, x):
        return x[..., :3] * 2.0, x[..., 3:] + 1.0


def _trace(monkeypatch):
    monkeypatch.setenv("KVFORGE_TRACE_CACHE", "0")  # a fresh torch.onnx export each time
    return onnx_export.trace(_Halves().eval(), (torch.randn(2, 7),), None, ["x"], ["a", "b"],
                             onnx_export.DEFAULT_OPSET, optimize=False)


def test_the_torchlib_registry_is_built_once_per_process(monkeypatch):
    """torch.onnx.export builds its registry of ONNX functions on every call; export builds it once: two fresh
    traces call torch's builder at most once between them, and the traced graphs are the same."""
    from torch.onnx._internal.exporter import _registration

    original = _registration.ONNXRegistry.__dict__["from_torchlib"]
    calls = []

    def counted(cls, *args, **kwargs):
        calls.append(1)
        return original.__func__(cls, *args, **kwargs)

    monkeypatch.setattr(_registration.ONNXRegistry, "from_torchlib", classmethod(counted))
    monkeypatch.setattr(onnx_export, "_REGISTRIES", {})
    first, second = _trace(monkeypatch), _trace(monkeypatch)
    assert len(calls) == 1
    assert _registration.ONNXRegistry.__dict__["from_torchlib"].__func__ is counted  # put back after each export
    assert [n.op_type for n in first.model.graph] == [n.op_type for n in second.model.graph]


def test_the_optimizer_runs_without_the_quadratic_slice_rule_and_puts_it_back(monkeypatch):
    """While kvforge's optimize runs onnxscript's optimizer, the default rewrite rules lack SlicesSplit (seen from
    inside the optimizer call); afterwards the table is onnxscript's own again, and the optimized graph is the one
    onnxscript's optimizer alone makes of the same trace."""
    from onnxscript import rewriter

    rules = rewriter._DEFAULT_REWRITE_RULES
    assert "SlicesSplit" in {getattr(r, "name", None) for r in rules}
    plain = _trace(monkeypatch)
    plain.optimize()
    ours = _trace(monkeypatch)
    seen = []
    optimize = type(ours).optimize

    def spying(program):
        seen.append({getattr(r, "name", None) for r in rewriter._DEFAULT_REWRITE_RULES})
        return optimize(program)

    monkeypatch.setattr(type(ours), "optimize", spying)
    lazy_weights.optimize(ours)
    assert len(seen) == 1 and "SlicesSplit" not in seen[0] and "CastCast" in seen[0]
    assert rewriter._DEFAULT_REWRITE_RULES is rules
    assert [n.op_type for n in ours.model.graph] == [n.op_type for n in plain.model.graph]
