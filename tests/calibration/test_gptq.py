"""GPTQ weight rounding: the layer output error it minimizes, its edge cases, and GPTQ-calibrated `tiny` bundles."""

from __future__ import annotations

import numpy as np
import pytest

from kvforge import metrics, runtime
from kvforge.calibration import calibrate
from kvforge.calibration.gptq import HessianAccumulator, gptq_quantize
from kvforge.calibration.qdq import dequantize, quantize, weight_scales
from kvforge.errors import KvforgeError
from kvforge.runtime.evaluate import window_logits

FORMATS = [("int8", None), ("fp8", None), ("int4", 32), ("int4", 40), ("int4-zp", 32)]  # 40 does not divide K = 100


def _layer(seed=0, K=100, N=48, rows=3000):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, K)) @ rng.standard_normal((K, K)) * 0.3).astype(np.float32)  # correlated inputs
    w = rng.standard_normal((K, N)).astype(np.float32)
    return x, w


def _hessian(x):
    acc = HessianAccumulator(["x"])
    for i in range(0, len(x), 700):  # streamed in uneven batches
        acc.add("x", x[i:i + 700])
    return acc.hessian("x")


@pytest.mark.parametrize("fmt,block", FORMATS)
def test_gptq_lowers_the_layer_output_error_on_the_same_grid(fmt, block):
    from kvforge.calibration.qdq import minimum_blocks

    x, w = _layer()
    zero_points = fmt.endswith("-zp")  # asymmetric INT4 blocks: signed codes, a scale and a float offset per block
    fmt = fmt.removesuffix("-zp")
    codes, scales, *offset = gptq_quantize(w, _hessian(x), fmt, block, zero_points=zero_points)
    offset = offset[0] if offset else None
    assert (offset is not None) == zero_points
    rtn_scales, rtn_offset = minimum_blocks(w, block) if zero_points else (weight_scales(w, fmt, block), None)
    rtn = dequantize(quantize(w, rtn_scales, fmt, block, offset=rtn_offset), rtn_scales, fmt, block, offset=rtn_offset)
    assert codes.shape == w.shape and codes.dtype == quantize(w, rtn_scales, fmt, block, offset=rtn_offset).dtype
    assert scales.shape == rtn_scales.shape and scales.dtype == np.float32
    if fmt != "int4":  # per-channel scales are the weight's own; int4 blocks take theirs as GPTQ reaches them
        np.testing.assert_array_equal(scales, rtn_scales)
    ours = dequantize(codes, scales, fmt, block, offset=offset)
    gptq_err = np.linalg.norm(x @ (w - ours))
    rtn_err = np.linalg.norm(x @ (w - rtn))
    assert gptq_err < 0.85 * rtn_err, (gptq_err, rtn_err)
    # every code is on the grid: re-quantizing the dequantized weight gives the same codes
    np.testing.assert_array_equal(quantize(ours, scales, fmt, block, offset=offset).astype(np.float32),
                                  codes.astype(np.float32))


def test_uncorrelated_inputs_make_gptq_round_to_nearest():
    _, w = _layer()
    codes, scales = gptq_quantize(w, np.eye(w.shape[0], dtype=np.float32), "fp8")
    np.testing.assert_array_equal(codes.astype(np.float32), quantize(w, weight_scales(w, "fp8"), "fp8").astype(np.float32))


def test_dead_channels_and_rank_deficient_inputs():
    x, w = _layer(K=64, rows=20)  # fewer samples than inputs: H is singular
    x[:, 5] = 0.0  # an input channel that never fires
    codes, scales = gptq_quantize(w, _hessian(x), "int8")
    out = dequantize(codes, scales, "int8")
    assert np.isfinite(out).all()
    assert np.abs(out - w).max() <= 2 * scales.max()  # no runaway updates


def test_hessian_accumulator_errors_and_smoothing():
    acc = HessianAccumulator(["a"])
    with pytest.raises(KvforgeError, match="activation a is not finite"):
        acc.add("a", np.array([[1.0, np.nan]], np.float32))
    acc.add("a", np.array([[1.0, 2.0], [3.0, 4.0]], np.float32))
    acc.add("ignored", np.ones((3, 7), np.float32))
    s = np.array([2.0, 4.0], np.float32)
    h = acc.hessian("a", s)  # the smoothed input is x / s
    x = np.array([[1.0, 2.0], [3.0, 4.0]]) / s
    np.testing.assert_allclose(h, x.T @ x / 2, rtol=1e-6)
    with pytest.raises(KvforgeError, match="Hessian is \\(2, 2\\), the weight has 3 input rows"):
        gptq_quantize(np.ones((3, 2), np.float32), h, "int8")


def test_the_hessian_does_not_depend_on_the_batching():
    """GPTQ rounds on H, so calibrating with another --batch-size must give the same H to the bit."""
    x = (np.random.default_rng(5).standard_normal((6, 33, 40)) * 3).astype(np.float32)
    hessians = []
    for batch in (1, 4, 6):
        acc = HessianAccumulator(["x"])
        for i in range(0, len(x), batch):
            acc.add("x", x[i:i + batch])
        hessians.append(acc.hessian("x"))
    assert all(np.array_equal(hessians[0], h) for h in hessians[1:])
    np.testing.assert_allclose(hessians[0], np.einsum("stk,stl->kl", x, x, dtype=np.float64) / (6 * 33), rtol=1e-5, atol=1e-4)


# -- on tiny ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def heldout(tiny_heldout):
    return tiny_heldout[:12]


def _kl(candidate, reference, chunks):
    with runtime.load(candidate) as c, runtime.load(reference) as r:
        return float(np.mean([metrics.kl_divergence(a, b).mean()
                              for (a, _), (b, _) in zip(window_logits(c, chunks), window_logits(r, chunks))]))


@pytest.mark.slow
@pytest.mark.parametrize("precision,options", [("int4", {"block_size": 32}), ("fp8", {"method": "max"})])
def test_gptq_bundles_of_tiny_are_closer_to_fp32(tmp_path, tiny_fp32, heldout, precision, options):
    fixed = dict(recipe="fixed", precision=precision, samples=16, seq_len=128, **options)
    nearest = calibrate(tiny_fp32.path, tmp_path / "nearest", **fixed)
    gptq = calibrate(tiny_fp32.path, tmp_path / "gptq", gptq=True, **fixed)
    kl_nearest, kl_gptq = _kl(nearest.path, tiny_fp32.path, heldout), _kl(gptq.path, tiny_fp32.path, heldout)
    assert kl_gptq < 0.9 * kl_nearest, (kl_gptq, kl_nearest)
    m = gptq.manifest
    assert m["lint"]["passed"], m["lint"]["findings"]
    q = m["precision"]["quantization"]
    assert q["weight_rounding"] == "gptq" and q["gptq_damp"] == 0.01
    assert nearest.manifest["precision"]["quantization"]["weight_rounding"] == "nearest"
    assert m["calibration"]["data"] == "built-in tiny corpus" and m["calibration"]["samples"] == 16
    assert m["lineage"][-1]["options"]["gptq"] is True


def test_gptq_int4_reads_data_for_other_models(micro_bundle, tmp_path):
    b = micro_bundle("llama3-micro")
    q = calibrate(b.path, tmp_path / "prose", recipe="fixed", precision="int4", gptq=True, samples=4, seq_len=32, block_size=16)
    assert q.manifest["calibration"]["data"].startswith("built-in English prose")
    q = calibrate(b.path, tmp_path / "q", recipe="fixed", precision="int4", gptq=True, random_data=True, samples=4, seq_len=32, block_size=16)
    assert q.manifest["calibration"]["random_data"] is True
    assert q.manifest["precision"]["quantization"]["weight_rounding"] == "gptq"
