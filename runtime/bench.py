"""Prefill/decode timing for a Session: medians over runs, measured in-process."""

from __future__ import annotations

import resource
import statistics
import time

import numpy as np

from .session import Session


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def benchmark(session: Session, batch: int, prompt_len: int, new_tokens: int, runs: int, warmup: int = 1, seed: int = 0) -> dict:
    """Time prefill (batch x prompt_len tokens) and `new_tokens` greedy decode steps.

    TTFT is the prefill plus the choice of the first token. Decode tokens/s
    counts batch x (new_tokens - 1) tokens over the decode steps alone.
    """
    if prompt_len + new_tokens > session.max_context:
        from kvforge.errors import KvforgeError

        raise KvforgeError(f"prompt {prompt_len} + {new_tokens} new tokens exceed the bundle's max context {session.max_context}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, session.vocab_size, (batch, prompt_len), dtype=np.int64)
    prefill, ttft, decode = [], [], []
    for i in range(warmup + runs):
        t0 = time.perf_counter()
        logits, cache = session.forward(ids, last_logits_only=True)
        token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        t1 = time.perf_counter()
        mask = np.ones((batch, prompt_len), np.int64)
        for _ in range(new_tokens - 1):
            mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
            logits, cache = session.forward(token, mask, None, cache, last_logits_only=True)
            token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        t2 = time.perf_counter()
        if i >= warmup:
            prefill.append(t1 - t0)
            ttft.append(t1 - t0)
            decode.append(t2 - t1)
    med_prefill, med_decode = statistics.median(prefill), statistics.median(decode)
    return {
        "backend": session.backend_name,
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "runs": runs,
        "prefill_tokens_per_s": batch * prompt_len / med_prefill,
        "decode_tokens_per_s": batch * (new_tokens - 1) / med_decode if new_tokens > 1 else 0.0,
        "ttft_ms": 1000 * statistics.median(ttft),
        "decode_ms_per_token": 1000 * med_decode / max(1, new_tokens - 1),
        "peak_rss_mb": peak_rss_mb(),
    }
