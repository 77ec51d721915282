"""Streaming calibration observers: constant memory, and independent of batching.

Two passes over the calibration data. Pass 1 records each tensor's amax
(max |x|). Pass 2 fills a histogram of |x| over the fixed range [0, amax]
with a fixed number of bins. Both are order-independent (a max and sums of
counts), so the same data gives the same scales whatever the batch size or
order, and memory does not grow with the number of samples: nothing but the
running amax and the histogram is kept.

Methods turn a histogram into an amax to quantize against:
- max: the observed amax;
- percentile: the |x| below which `percentile` % of values fall;
- mse: the clipping threshold minimizing the expected squared quantization
  error under the histogram, for the target format (INT8 uniform grid or the
  FP8 E4M3 grid);
- entropy: TensorRT's KL-divergence calibration: the threshold whose
  quantized distribution diverges least from the clipped reference.
"""

from __future__ import annotations

import numpy as np

from kvforge.errors import KvforgeError

BINS = 2048
METHODS = ("max", "percentile", "entropy", "mse")


class TensorObserver:
    """Statistics of one tensor, fed batch by batch."""

    def __init__(self, name: str, bins: int = BINS, keep_rows: int = 0):
        self.name = name
        self.bins = bins
        self.amax = 0.0
        self.count = 0
        self.hist: np.ndarray | None = None
        self.keep_rows = keep_rows  # keep the first rows (last axis = features) seen, up to this many
        self.rows: list[np.ndarray] = []
        self.sampled: list[np.ndarray] = []  # rows drawn from every batch (passes.observe's sample_rows)

    def observe_range(self, x: np.ndarray) -> None:
        if x.size == 0:
            return
        a = float(np.max(np.abs(x)))
        if not np.isfinite(a):
            raise KvforgeError(f"calibration tensor {self.name!r} holds NaN or infinite values")
        self.amax = max(self.amax, a)
        self.count += x.size
        kept = sum(len(r) for r in self.rows)
        if kept < self.keep_rows:
            self.rows.append(np.array(x.reshape(-1, x.shape[-1])[: self.keep_rows - kept], np.float32))

    def observe_histogram(self, x: np.ndarray) -> None:
        if self.hist is None:
            self.hist = np.zeros(self.bins, np.int64)
        if x.size == 0 or self.amax == 0.0:
            return
        h, _ = np.histogram(np.abs(x).ravel(), bins=self.bins, range=(0.0, self.amax))
        self.hist += h

    def compute_amax(self, method: str, fmt: str, percentile: float = 99.99) -> float:
        if self.count == 0:
            raise KvforgeError(f"calibration tensor {self.name!r} was never observed")
        if self.amax == 0.0 or method == "max":
            return self.amax if self.amax > 0 else 1e-8
        if self.hist is None or self.hist.sum() == 0:
            raise KvforgeError(f"calibration tensor {self.name!r} has no histogram (pass 2 did not run)")
        edges = np.linspace(0.0, self.amax, self.bins + 1)
        if method == "percentile":
            return _percentile_amax(self.hist, edges, percentile)
        if method == "mse":
            return _mse_amax(self.hist, edges, fmt)
        if method == "entropy":
            return _entropy_amax(self.hist, edges, fmt)
        raise KvforgeError(f"unknown calibration method {method!r}; choose from {METHODS}")


def _percentile_amax(hist: np.ndarray, edges: np.ndarray, percentile: float) -> float:
    if not 0.0 < percentile <= 100.0:
        raise KvforgeError(f"percentile must be in (0, 100], got {percentile}")
    cdf = np.cumsum(hist) / hist.sum()
    idx = int(np.searchsorted(cdf, percentile / 100.0))
    return float(edges[min(idx + 1, len(edges) - 1)])


def fake_quant(x: np.ndarray, amax: float, fmt: str) -> np.ndarray:
    """Quantize-dequantize |x| values symmetric against `amax` in the target format."""
    if fmt == "int8":
        scale = amax / 127.0
        return np.clip(np.round(x / scale), -127, 127) * scale
    if fmt == "fp8":
        import ml_dtypes

        scale = amax / 448.0
        return np.clip(x / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    raise KvforgeError(f"unknown quantization format {fmt!r}")


def _mse_amax(hist: np.ndarray, edges: np.ndarray, fmt: str) -> float:
    centers = (edges[:-1] + edges[1:]) / 2
    weights = hist.astype(np.float64)
    best, best_err = edges[-1], np.inf
    for t in np.geomspace(edges[-1] * 1e-3, edges[-1], 128):  # geometric: outliers may stretch the range
        err = float(np.sum(weights * (fake_quant(np.minimum(centers, t), t, fmt) - centers) ** 2))
        if err < best_err:
            best, best_err = t, err
    return float(best)


def _entropy_amax(hist: np.ndarray, edges: np.ndarray, fmt: str) -> float:
    """TensorRT's entropy calibration, generalized to any quantization grid.

    For each candidate threshold t (a bin edge): P is the histogram below t
    with the outliers above folded into its last bin; Q is the same bins
    without the outliers, merged by the value each bin's center quantizes to
    (in `fmt`, against t) and spread evenly over the group's non-empty bins.
    The threshold with the smallest KL(P || Q) wins.
    """
    hist = hist.astype(np.float64)
    centers = (edges[:-1] + edges[1:]) / 2
    bins = len(hist)
    best_i, best_kl = bins, np.inf
    # candidate bin counts, geometrically spaced: outliers may stretch the range far beyond the bulk
    for i in np.unique(np.geomspace(8, bins, 256).astype(int)):
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()
        if p.sum() == 0:
            continue
        _, group = np.unique(fake_quant(centers[:i], edges[i], fmt), return_inverse=True)
        mass = np.bincount(group, weights=hist[:i])
        occupied = np.bincount(group, weights=(hist[:i] > 0).astype(np.float64))
        q = np.where(hist[:i] > 0, mass[group] / np.maximum(occupied[group], 1), 0.0)
        if q.sum() == 0:
            continue
        p, q = p / p.sum(), q / q.sum()
        nz = p > 0
        if (nz & (q == 0)).any():
            continue  # Q cannot represent P's mass there: infinite divergence
        kl = float(np.sum(p[nz] * np.log(p[nz] / q[nz])))
        if kl < best_kl:
            best_i, best_kl = i, kl
    return float(edges[best_i])
