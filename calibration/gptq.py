"""GPTQ weight rounding (Frantar et al., 2022): round a weight so the layer's output, not the weight, stays close.

Round-to-nearest rounds each weight on its own. GPTQ rounds the input rows of
a [K, N] weight one at a time and spreads each row's rounding error over the
rows not yet rounded, weighted by how the layer's inputs co-vary (H = X^T X
over calibration activations), which minimizes ||X W - X Q|| row by row. The
grid is the same as round-to-nearest's (per-channel INT8/FP8 scales from the
weight; INT4 block scales from the block's current values when it is
reached), so the graph, its Q/DQ and TensorRT's view of it do not change;
only which grid point each weight takes does.

H is accumulated while calibration streams its batches (K x K per distinct
activation, float32: memory grows with the model's widths, never with the
sample count).
"""

from __future__ import annotations

import numpy as np

from kvforge.errors import KvforgeError

from .qdq import QMAX, dequantize, minimum_blocks, quantize, weight_scales

DAMP = 0.01  # fraction of mean(diag(H)) added to the diagonal (the paper's default)
_LAZY = 128  # rows per lazy-batch update


class HessianAccumulator:
    """X^T X per activation tensor, streamed over batches."""

    def __init__(self, names):
        self.h: dict[str, np.ndarray] = {}
        self.rows: dict[str, int] = {}
        self.names = set(names)

    def add(self, name: str, x: np.ndarray) -> None:
        """x: [samples, ..., K]. Summed one sample at a time, in order, so H is bit-identical whatever the batching."""
        if name not in self.names:
            return
        samples = x.reshape(x.shape[0], -1, x.shape[-1]) if x.ndim > 2 else x[None]
        for sample in samples:
            sample = np.ascontiguousarray(sample, np.float32)
            h = sample.T @ sample
            if not np.isfinite(h).all():  # checked on the K x K product: any NaN/inf row shows there, at a fraction of the cost
                raise KvforgeError(f"activation {name} is not finite on the calibration data; GPTQ cannot use it")
            self.h[name] = self.h[name] + h if name in self.h else h
            self.rows[name] = self.rows.get(name, 0) + sample.shape[0]

    def hessian(self, name: str, smooth: np.ndarray | None = None) -> np.ndarray:
        """H of the tensor the weight actually sees: with SmoothQuant's x / s, diag(1/s) H diag(1/s)."""
        h = self.h[name] / max(1, self.rows[name])
        if smooth is not None:
            inv = 1.0 / smooth.astype(np.float32)
            h = h * inv[:, None] * inv[None, :]
        return h


def _inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper Cholesky factor U of inv(H + damp * mean(diag) I): inv = U^T U."""
    h = h.astype(np.float64).copy()
    dead = np.diag(h) <= 0  # an input channel that was always zero: no error is spread through it
    h[dead, :] = 0.0
    h[:, dead] = 0.0
    h[dead, dead] = 1.0
    mean = float(np.mean(np.diag(h)))
    for attempt in range(6):
        try:
            hd = h + (damp * (10.0 ** attempt)) * mean * np.eye(h.shape[0])
            inv = np.linalg.inv(hd)
            return np.linalg.cholesky(inv).T
        except np.linalg.LinAlgError:
            continue
    raise KvforgeError("the calibration activations' Hessian is not positive definite even with damping; use round-to-nearest")


def gptq_quantize(w: np.ndarray, h: np.ndarray, fmt: str, block_size: int | None = None,
                  damp: float = DAMP, dtype=np.float32, zero_points: bool = False) -> tuple:
    """GPTQ-round a [K, N] weight onto the `fmt` grid; returns (quantized codes, scales) like qdq.quantize/weight_scales,
    and the blocks' offsets where `zero_points` (asymmetric INT4 blocks: qdq.minimum_blocks).

    Per output channel scales of `w`, or given a block size (the weight-only formats) per block of `block_size`
    rows along K, each block's scale taken from its rows as they stand when GPTQ reaches it (earlier rows' errors
    included).
    Scales are exact in the model dtype `dtype`, as the graph will store them.
    """
    if fmt not in QMAX:
        raise KvforgeError(f"GPTQ does not know the format {fmt!r}")
    K, N = w.shape
    if h.shape != (K, K):
        raise KvforgeError(f"GPTQ: the Hessian is {h.shape}, the weight has {K} input rows")
    W = w.astype(np.float64).copy()
    U = _inverse_cholesky(h, damp)
    blocked = block_size is not None
    offsets = None
    if blocked:
        lazy = block_size * max(1, _LAZY // block_size)  # a scale block never straddles two lazy batches
        scales = np.zeros((-(-K // block_size), N), np.float32)
        offsets = np.zeros(scales.shape, np.float32) if zero_points else None  # the blocks' offsets
    else:
        lazy = _LAZY
        scales = weight_scales(w.astype(np.float32), fmt, dtype=dtype)
    codes = []
    for i1 in range(0, K, lazy):
        i2 = min(i1 + lazy, K)
        W1 = W[i1:i2].copy()
        err = np.zeros_like(W1)
        for i in range(i2 - i1):
            row = i1 + i
            if blocked and row % block_size == 0:
                end = min(i + block_size, i2 - i1)
                if zero_points:
                    block_scale, block_offset = minimum_blocks(W1[i:end].astype(np.float32), end - i, dtype)
                    scales[row // block_size], offsets[row // block_size] = block_scale[0], block_offset[0]
                else:
                    scales[row // block_size] = weight_scales(W1[i:end].astype(np.float32), fmt, end - i, dtype)[0]
            s = scales[row // block_size][None] if blocked else scales  # this row's scales
            z = offsets[row // block_size][None] if offsets is not None else None
            q = quantize(W1[i][None], s, fmt, 1, offset=z)  # block size 1: one row, its own scale row (ignored per-channel)
            deq = dequantize(q, s, fmt, 1, offset=z)[0]
            codes.append(q[0])
            e = (W1[i] - deq) / U[row, row]
            W1[i + 1:] -= np.outer(U[row, row + 1:i2], e)
            err[i] = e
        W[i2:] -= U[i1:i2, i2:].T @ err
    return (np.stack(codes), scales) + ((offsets,) if offsets is not None else ())


def gptq_rounder(hessians, smooth, fmt: str, block_size, dtype, progress, total: int, zero_points: bool = False):
    """round_weight(target, w) for qdq.rewrite: each target's weight rounded by GPTQ once (later rewrites of the
    same graph reuse it), from its activation's Hessian (divided by the SmoothQuant factors where given);
    zero_points: asymmetric INT4 blocks (a minimum each: qdq.minimum_blocks)."""
    rounded: dict[str, tuple] = {}

    def round_weight(t, w):
        if t.weight not in rounded:
            h = hessians.hessian(t.activation, smooth.get(t.activation) if smooth else None)
            rounded[t.weight] = gptq_quantize(w, h, fmt, block_size, dtype=dtype, zero_points=zero_points)
        progress("gptq", len(rounded), total)
        return rounded[t.weight]
    return round_weight
