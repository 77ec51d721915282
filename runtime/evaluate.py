"""Accuracy measurements on any backend: perplexity and next-token agreement, numpy only."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvforge import metrics
from kvforge.metrics import windows

from .session import Session


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
        total += metrics.target_nll(metrics.log_softmax(logits), targets)
        count += targets.size
    return metrics.perplexity(total, count)
