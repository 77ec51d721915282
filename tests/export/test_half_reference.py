"""The half reference (export/validate_inputs.py HalfReference): each operation on half values computed in
float32 and its result rounded to the dtype, checked against that arithmetic written out in plain Torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvforge.export.onnx_export import FlatKVModel
from kvforge.export.validate_inputs import HalfReference, half_mode
from kvforge.model_defs import load


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_each_operation_computes_in_float32_and_rounds_its_result(dtype):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=gen).to(dtype), torch.randn(32, 64, generator=gen).to(dtype)
    with half_mode(dtype):
        y = F.linear(x, w)
        z = torch.nn.functional.silu(y) * 3.0
        up = y.float()  # what the model asks for in float32 stays float32 ...
        norm = up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + 1e-6)  # ... and so does what follows from it
        inplace = y.clone()
        inplace.mul_(0.5)
    expected_y = F.linear(x.float(), w.float()).to(dtype)
    assert y.dtype == dtype and torch.equal(y, expected_y)
    assert torch.equal(z, (F.silu(expected_y.float()).to(dtype).float() * 3.0).to(dtype))
    assert up.dtype == norm.dtype == torch.float32
    assert torch.equal(norm, (up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + 1e-6)))
    assert torch.equal(inplace, (expected_y.float() * 0.5).to(dtype))


def test_a_vocabulary_sized_linear_is_upcast_in_row_blocks_with_the_same_result():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 256, generator=gen).half()
    w = (0.05 * torch.randn(70_000, 256, generator=gen)).half()  # 17.9M values: past the one-block size
    with half_mode(torch.float16):
        y = F.linear(x, w)
    assert torch.equal(y, F.linear(x.float(), w.float()).half())


def test_the_half_reference_is_the_fp32_reference_within_the_dtypes_rounding():
    model, _ = load("llama3-micro")
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    positions = torch.arange(9).expand(2, 9)
    empty = [t for layer in model.empty_cache(2) for t in layer]
    with torch.no_grad():
        ref32 = FlatKVModel(model).eval()(ids, mask, positions, *empty)
    half = HalfReference(model, torch.float16)(ids, mask, positions, *empty)
    assert half[0].dtype == torch.float32  # the model computes its logits in float32 (a half graph too)
    assert all(o.dtype == torch.float16 for o in half[1:])  # its cache is half
    eps = torch.finfo(torch.float16).eps
    for a, b in zip(half, ref32):
        rel = float((a.float() - b).norm() / b.norm())
        assert eps / 8 < rel < 16 * eps, rel  # rounded (not FP32's exact values), by a few ulps at most
