"""Prefill/decode timing for a Session: medians over runs, measured in-process."""

from __future__ import annotations

import resource
import statistics
import time

import numpy as np

from kvforge.errors import KvforgeError

from .session import Session


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def settings(session: Session) -> dict:
    """The options the session's backend runs with (Runner.settings: ONNX Runtime's accuracy level, threads, ...),
    recorded beside the figures they were measured with."""
    return dict(getattr(session.backend, "settings", {}))


def timed_greedy(session: Session, ids: np.ndarray, new_tokens: int) -> dict:
    """One timed generation: prefill `ids` (batch, prompt), then greedy decode to `new_tokens` tokens.

    prefill_s covers the prefill and the first token's choice (time to first
    token); decode_s the new_tokens - 1 cached decode steps after it.
    """
    batch, prompt_len = ids.shape
    t0 = time.perf_counter()
    logits, cache = session.forward(ids, last_logits_only=True)
    token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
    t1 = time.perf_counter()
    mask = np.ones((batch, prompt_len), np.int64)
    tokens = [token[:, 0]]
    for _ in range(new_tokens - 1):
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        logits, cache = session.forward(token, mask, cache=cache, last_logits_only=True)
        token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        tokens.append(token[:, 0])
    t2 = time.perf_counter()
    return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "decode_steps": new_tokens - 1,
            "tokens": np.stack(tokens, axis=1).tolist()}


def benchmark(session: Session, batch: int, prompt_len: int, new_tokens: int, runs: int, warmup: int = 1, seed: int = 0) -> dict:
    """Time prefill (batch x prompt_len tokens) and `new_tokens` greedy decode steps.

    TTFT is the prefill plus the choice of the first token. Decode tokens/s
    counts batch x (new_tokens - 1) tokens over the decode steps alone.
    """
    if prompt_len < 1 or new_tokens < 1 or batch < 1 or runs < 1:
        raise KvforgeError(f"batch, prompt length, new tokens and runs must be >= 1, got {batch}, {prompt_len}, {new_tokens}, {runs}")
    if prompt_len + new_tokens - 1 > session.max_context:  # the last new token is chosen, never fed back
        raise KvforgeError(f"prompt {prompt_len} + {new_tokens} new tokens need {prompt_len + new_tokens - 1} positions; "
                           f"the bundle's max context is {session.max_context}")
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, session.vocab_size, (batch, prompt_len), dtype=np.int64)
    prefill, decode = [], []
    for i in range(warmup + runs):
        t = timed_greedy(session, ids, new_tokens)
        if i >= warmup:
            prefill.append(t["prefill_s"])
            decode.append(t["decode_s"])
    med_prefill, med_decode = statistics.median(prefill), statistics.median(decode)
    return {
        "backend": session.backend_name,
        "backend_settings": settings(session),
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "runs": runs,
        "prefill_tokens_per_s": batch * prompt_len / med_prefill,
        # with one new token there is no decode step to time: null, not a rate
        "decode_tokens_per_s": batch * (new_tokens - 1) / med_decode if new_tokens > 1 else None,
        "ttft_ms": 1000 * med_prefill,  # prefill plus the first token's choice
        "decode_ms_per_token": 1000 * med_decode / (new_tokens - 1) if new_tokens > 1 else None,
        "peak_rss_mb": peak_rss_mb(),
    }


def timed_stream(session: Session, prompt: list[int], new_tokens: int, speculative,
                 ignore_eos: bool = True) -> tuple[float, float, list[int]]:
    """(time to the first token, decode tokens/s after it, the tokens) of one greedy stream of up to new_tokens
    tokens (exactly that many with ignore_eos)."""
    t0 = time.perf_counter()
    first, tokens = None, []
    for event in session.stream(prompt, max_new_tokens=new_tokens, ignore_eos=ignore_eos, speculative=speculative):
        tokens.append(event.token)
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - t0, (len(tokens) - 1) / (end - first), tokens


def benchmark_speculative(session: Session, prompt: list[int], new_tokens: int, runs: int, warmup: int,
                          speculative) -> dict:
    """Greedy decode tokens/s of one prompt (batch 1) with and without speculation, runs interleaved: medians,
    their ratio, and what speculation did (acceptance rate, tokens per target step). `same_tokens`: whether the
    two produced the same tokens (they must, to rounding)."""
    if new_tokens < 2 or runs < 1:
        raise KvforgeError(f"a speculative benchmark needs >= 2 new tokens and >= 1 run, got {new_tokens}, {runs}")
    plain, fast, same = [], [], True
    for i in range(warmup + runs):
        _, a, tokens_a = timed_stream(session, prompt, new_tokens, None)
        _, b, tokens_b = timed_stream(session, prompt, new_tokens, speculative)
        same = same and tokens_a == tokens_b
        if i >= warmup:
            plain.append(a)
            fast.append(b)
    stats = session.generate(prompt, max_new_tokens=new_tokens, ignore_eos=True, speculative=speculative).speculation
    med_plain, med_fast = statistics.median(plain), statistics.median(fast)
    return {"backend": session.backend_name, "backend_settings": settings(session), "prompt_len": len(prompt),
            "new_tokens": new_tokens, "runs": runs,
            "speculative": {k: str(v) if k == "draft" and v is not None else v for k, v in dict(speculative).items()},
            "plain_decode_tokens_per_s": med_plain, "speculative_decode_tokens_per_s": med_fast,
            "speedup": med_fast / med_plain, "acceptance_rate": stats["acceptance_rate"],
            "tokens_per_step": stats["tokens_per_step"], "same_tokens": same, "peak_rss_mb": peak_rss_mb()}
