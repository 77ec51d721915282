"""Numerical comparison metrics (docs/design.md, Verification), in numpy: no Torch needed.

All functions take (candidate, reference). Logit metrics treat the last axis
as the vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvforge.errors import KvforgeError


def windows(ids, seq_len: int) -> np.ndarray:
    """Non-overlapping windows of seq_len + 1 tokens (inputs plus next-token targets), int64 (n, seq_len + 1)."""
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise KvforgeError(f"need more than {seq_len} tokens, got {len(ids)}")
    arr = np.asarray(ids[: n * seq_len + 1], np.int64)
    return np.stack([arr[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])


CHUNK_VALUES = 1 << 22  # values per piece of a row-wise metric: float64 temporaries of 32 MB whatever the vocabulary


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def row_slices(rows: int, row_values: int, values: int) -> list[slice]:
    """Slices over `rows` rows of `row_values` values each, about `values` values a slice (one row at least):
    what a large array is computed over a piece at a time, its temporaries a piece's, not the whole's."""
    step = max(1, values // max(1, row_values))
    return [slice(start, start + step) for start in range(0, rows, step)]


def _row_pieces(*arrays, values: int | None = None):
    """The arrays (..., V) as (rows, V), and slices of rows holding about `values` (CHUNK_VALUES) each: a metric
    computed row by row over the pieces is the metric of the whole, without float64 copies of a large vocabulary's
    logits (Gemma 3's 262k: 67 MB an array for a batch of 32 positions, eight of them in a KL divergence)."""
    arrays = np.broadcast_arrays(*(np.asarray(a) for a in arrays))  # (V,) against (1, V), as the whole would
    v = arrays[0].shape[-1] if arrays[0].ndim else 1
    flat = [a.reshape(-1, v) for a in arrays]
    return flat, row_slices(len(flat[0]), v, values or CHUNK_VALUES)


def max_abs(candidate, reference) -> float:
    c, r = np.asarray(candidate), np.asarray(reference)
    if not c.size:
        return 0.0
    (c, r), pieces = _row_pieces(c, r)
    return max(float(np.abs(_f64(c[p]) - _f64(r[p])).max()) for p in pieces)


def rel_l2(candidate, reference) -> float:
    """||c - r|| / ||r|| (0 when both are empty or equal)."""
    c, r = _f64(candidate), _f64(reference)
    num = float(np.linalg.norm((c - r).ravel()))
    den = float(np.linalg.norm(r.ravel()))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


def cosine(candidate, reference) -> float:
    c, r = _f64(candidate).ravel(), _f64(reference).ravel()
    den = float(np.linalg.norm(c) * np.linalg.norm(r))
    return float(c @ r) / den if den > 0 else (1.0 if not c.any() and not r.any() else 0.0)


def log_softmax(logits) -> np.ndarray:
    x = _f64(logits)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _log_softmax_and_probs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """log_softmax(x) and softmax(x) of a float64 (rows, V) from one exponential."""
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    z = e.sum(axis=-1, keepdims=True)
    x -= np.log(z)
    e /= z
    return x, e


def _window_sums(cand: np.ndarray, ref: np.ndarray, targets: np.ndarray) -> tuple:
    """WindowStats' sums over rows of logits (rows, V): both negative log-likelihoods, the KL divergence
    KL(ref || cand), top-1 agreements, the largest difference and the sums of squares and products."""
    c, r = _f64(cand), _f64(ref)
    lc, _ = _log_softmax_and_probs(c)
    lr, pr = _log_softmax_and_probs(r)
    nll_c, nll_r = target_nll(lc, targets), target_nll(lr, targets)
    lr -= lc
    kl = float(np.einsum("ij,ij->", pr, lr))
    agree = int((cand.argmax(-1) == ref.argmax(-1)).sum())
    d = c - r
    return (nll_c, nll_r, kl, agree, float(np.abs(d).max()), float(np.einsum("ij,ij->", d, d)),
            float(np.einsum("ij,ij->", r, r)), float(np.einsum("ij,ij->", c, c)), float(np.einsum("ij,ij->", c, r)))


def target_nll(logp: np.ndarray, targets: np.ndarray) -> float:
    """The summed negative log-likelihood of `targets` (...) under log-probabilities `logp` (..., V)."""
    return -float(np.take_along_axis(logp, np.asarray(targets)[..., None], axis=-1).sum())


def perplexity(nll: float, count: int) -> float:
    """exp(mean negative log-likelihood per token): every perplexity kvforge reports is computed here."""
    return math.exp(nll / count)


def top1_agreement(candidate, reference) -> float:
    """Fraction of positions whose argmax token agrees."""
    c, r = np.asarray(candidate), np.asarray(reference)
    return float((c.argmax(-1) == r.argmax(-1)).mean())


def kl_divergence(candidate, reference) -> np.ndarray:
    """KL(P_reference || P_candidate) per position, in nats (computed a piece of positions at a time)."""
    shape = np.broadcast_shapes(np.shape(candidate), np.shape(reference))[:-1]
    (c, r), pieces = _row_pieces(candidate, reference)
    out = np.empty(len(r), np.float64)
    for p in pieces:
        lr, lc = log_softmax(r[p]), log_softmax(c[p])
        out[p] = (np.exp(lr) * (lr - lc)).sum(axis=-1)
    return out.reshape(shape)


def tensor_metrics(candidate, reference) -> dict[str, float]:
    c, r = np.asarray(candidate), np.asarray(reference)
    if c.shape != r.shape:
        raise ValueError(f"shape mismatch: candidate {c.shape} vs reference {r.shape}")
    return {"max_abs": max_abs(c, r), "rel_l2": rel_l2(c, r), "cosine": cosine(c, r)}


def logits_metrics(candidate, reference) -> dict[str, float]:
    out = tensor_metrics(candidate, reference)
    out["top1_agreement"] = top1_agreement(candidate, reference)
    out["kl_divergence_mean"] = float(kl_divergence(candidate, reference).mean())
    return out


def worst(metrics: list[dict[str, float]]) -> dict[str, float]:
    """Combine per-case metrics: the largest errors, the smallest agreements."""
    if not metrics:
        return {}
    keys = metrics[0].keys()
    lowest_is_worst = {"cosine", "top1_agreement"}
    return {k: (min if k in lowest_is_worst else max)(m[k] for m in metrics) for k in keys}


# -- tolerances: bounds on the metrics of a comparison (compare, check, the calibration budget) -----------------
# Metrics where larger is better: a tolerance is a floor. Every other bounded metric has a ceiling.
HIGHER_IS_BETTER = frozenset({"top1_agreement", "greedy_agreement", "greedy_prefix_match", "logits_cosine", "present_cosine",
                              "embedding_cosine_mean", "embedding_cosine_min", "hidden_cosine_min", "pooler_cosine_min",
                              "image_feature_cosine_mean", "image_feature_cosine_min"})

# The scalar metrics of a report (all floats), in table order.
REPORT_METRICS = (
    "perplexity_reference", "perplexity_candidate", "perplexity_delta_pct", "top1_agreement", "kl_divergence_mean",
    "logits_max_abs", "logits_rel_l2", "logits_cosine", "greedy_agreement", "greedy_prefix_match",
    "present_max_abs", "present_rel_l2", "present_cosine",
)
ENCODER_METRICS = (
    "embedding_cosine_mean", "embedding_cosine_min", "hidden_cosine_min", "hidden_max_abs", "hidden_rel_l2",
    "top1_agreement", "kl_divergence_mean", "logits_max_abs", "logits_rel_l2", "pooler_cosine_min",
)

# a vision-language model's: its image features, then the decoder's on image + text prompts
VISION_METRICS = (
    "image_feature_cosine_mean", "image_feature_cosine_min", "image_feature_rel_l2",
    "perplexity_reference", "perplexity_candidate", "perplexity_delta_pct", "top1_agreement", "kl_divergence_mean",
    "logits_max_abs", "logits_rel_l2", "greedy_agreement", "greedy_prefix_match",
)


def check_tolerances(result: dict[str, Any], tolerances: dict[str, float]) -> list[str]:
    """The violated bounds, one sentence each."""
    failures = []
    for key, bound in tolerances.items():
        value = result.get(key)
        if value is None:
            failures.append(f"{key}: not measured")
        elif key in HIGHER_IS_BETTER:
            if not value >= bound:
                failures.append(f"{key} {value:.6g} < {bound:g}")
        elif key == "perplexity_delta_pct":
            if not abs(value) <= bound:
                failures.append(f"|{key}| {abs(value):.4g} > {bound:g}")
        elif not value <= bound:
            failures.append(f"{key} {value:.4g} > {bound:g}")
    return failures


def parse_tolerances(items: list[str] | dict[str, Any] | None) -> dict[str, float]:
    """"key=value" strings (CLI) or a mapping -> {metric: bound}, with the keys checked."""
    if not items:
        return {}
    pairs = items.items() if isinstance(items, dict) else [split_tolerance(s) for s in items]
    out = {}
    known = set(REPORT_METRICS) | set(ENCODER_METRICS) | set(VISION_METRICS)
    for key, value in pairs:
        if key not in known:
            raise KvforgeError(f"unknown tolerance {key!r}; choose from {sorted(known)}")
        try:
            out[key] = float(value)
        except (TypeError, ValueError) as e:
            raise KvforgeError(f"tolerance {key}={value!r} is not a number") from e
        bound = out[key]
        low = -1.0 if key.endswith("cosine") else 0.0
        if key in HIGHER_IS_BETTER and not low <= bound <= 1.0:
            raise KvforgeError(f"tolerance {key}={value!r}: " + ("a cosine bound lies in [-1, 1]" if low else "an agreement bound lies in [0, 1]"))
        if key not in HIGHER_IS_BETTER and not 0.0 <= bound < float("inf"):
            raise KvforgeError(f"tolerance {key}={value!r}: the bound is a finite number >= 0 "
                               + ("(on |change|)" if key == "perplexity_delta_pct" else "(an upper limit)"))
    return out


def split_tolerance(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise KvforgeError(f"a tolerance is METRIC=VALUE (e.g. top1_agreement=0.97), got {item!r}")
    key, value = item.split("=", 1)
    return key.strip(), value.strip()


# -- perplexity and the logits metrics over held-out windows, streamed ----------------------------------------
class WindowStats:
    """Streaming sums over every window position: perplexities and the logits metrics."""

    # pieces of positions summed at once on this many threads (numpy's ufuncs let the interpreter go); the sums
    # are added in the pieces' order, so the result does not depend on the threads
    THREADS = 2

    def __init__(self):
        self.nll_c = self.nll_r = self.kl = 0.0
        self.count = self.agree = 0
        self.max_abs = self.diff_sq = self.ref_sq = self.cand_sq = self.dot = 0.0

    def add(self, cand: np.ndarray, ref: np.ndarray, targets: np.ndarray) -> None:
        """Add the positions of logits (..., V) against their next tokens (...), a piece of positions at a time."""
        from concurrent.futures import ThreadPoolExecutor

        # pieces of CHUNK_VALUES / (4 x THREADS) values (512k with two threads): the float64 temporaries of the
        # pieces in flight together stay under a quarter of one whole piece's (two 4M-value pieces at once raised
        # SmolLM2's INT8 calibration peak by 0.3 GiB), and are no slower (logits of a 49,152-token vocabulary:
        # pieces of 1M values as fast as 4M, 256k faster, on one thread)
        (cand, ref), pieces = _row_pieces(cand, ref, values=CHUNK_VALUES // (4 * max(1, self.THREADS)))
        targets = np.asarray(targets).reshape(-1)
        piece = lambda p: _window_sums(cand[p], ref[p], targets[p])  # noqa: E731
        if len(pieces) > 1 and self.THREADS > 1:
            with ThreadPoolExecutor(self.THREADS) as pool:
                sums = list(pool.map(piece, pieces))
        else:
            sums = [piece(p) for p in pieces]
        for nll_c, nll_r, kl, agree, max_abs, diff_sq, ref_sq, cand_sq, dot in sums:
            self.nll_c += nll_c
            self.nll_r += nll_r
            self.kl += kl
            self.agree += agree
            self.max_abs = max(self.max_abs, max_abs)
            self.diff_sq += diff_sq
            self.ref_sq += ref_sq
            self.cand_sq += cand_sq
            self.dot += dot
        self.count += targets.size

    def result(self) -> dict[str, float]:
        ppl_c, ppl_r = perplexity(self.nll_c, self.count), perplexity(self.nll_r, self.count)
        return {
            "perplexity_reference": ppl_r,
            "perplexity_candidate": ppl_c,
            "perplexity_delta_pct": 100.0 * (ppl_c - ppl_r) / ppl_r,
            "top1_agreement": self.agree / self.count,
            "kl_divergence_mean": self.kl / self.count,
            "logits_max_abs": self.max_abs,
            "logits_rel_l2": math.sqrt(self.diff_sq / self.ref_sq) if self.ref_sq else 0.0,
            "logits_cosine": self.dot / math.sqrt(self.cand_sq * self.ref_sq) if self.cand_sq and self.ref_sq else 1.0,
        }
