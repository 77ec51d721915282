"""Accuracy measurements on any backend: perplexity and next-token agreement, numpy only."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from kvforge import metrics
from kvforge.errors import KvforgeError

from .session import Session


def windows(ids: Sequence[int], seq_len: int) -> np.ndarray:
    """Non-overlapping windows of seq_len + 1 tokens (inputs and next-token targets)."""
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise KvforgeError(f"need more than {seq_len} tokens, got {len(ids)}")
    arr = np.asarray(ids[: n * seq_len + 1], np.int64)
    return np.stack([arr[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])


def window_logits(session: Session, chunks: np.ndarray, batch_size: int = 8):
    """Yield (logits (b, T, V), targets (b, T)) for each batch of windows."""
    for i in range(0, len(chunks), batch_size):
        batch = chunks[i : i + batch_size]
        logits, _ = session.forward(np.ascontiguousarray(batch[:, :-1]))
        yield logits, batch[:, 1:]


def perplexity(session: Session, ids: Sequence[int], seq_len: int = 256, batch_size: int = 8) -> float:
    """exp(mean next-token cross-entropy) over non-overlapping windows."""
    total, count = 0.0, 0
    for logits, targets in window_logits(session, windows(ids, seq_len), batch_size):
        logp = metrics.log_softmax(logits)
        total -= float(np.take_along_axis(logp, targets[..., None], axis=-1).sum())
        count += targets.size
    return math.exp(total / count)
