"""Numerical comparison metrics (docs/design.md, Verification), in numpy: no Torch needed.

All functions take (candidate, reference). Logit metrics treat the last axis
as the vocabulary.
"""

from __future__ import annotations

import numpy as np


def windows(ids, seq_len: int) -> np.ndarray:
    """Non-overlapping windows of seq_len + 1 tokens (inputs plus next-token targets), int64 (n, seq_len + 1)."""
    n = (len(ids) - 1) // seq_len
    if n < 1:
        from kvforge.errors import KvforgeError

        raise KvforgeError(f"need more than {seq_len} tokens, got {len(ids)}")
    arr = np.asarray(ids[: n * seq_len + 1], np.int64)
    return np.stack([arr[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def max_abs(candidate, reference) -> float:
    c, r = _f64(candidate), _f64(reference)
    return float(np.abs(c - r).max()) if c.size else 0.0


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


def top1_agreement(candidate, reference) -> float:
    """Fraction of positions whose argmax token agrees."""
    c, r = np.asarray(candidate), np.asarray(reference)
    return float((c.argmax(-1) == r.argmax(-1)).mean())


def kl_divergence(candidate, reference) -> np.ndarray:
    """KL(P_reference || P_candidate) per position, in nats."""
    lr, lc = log_softmax(reference), log_softmax(candidate)
    return (np.exp(lr) * (lr - lc)).sum(axis=-1)


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
