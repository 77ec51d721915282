"""A Session under re-entrant and concurrent use: a stream takes the lock for each token's step only.

The thread that holds an open stream may call the session between tokens; other threads are not held up by a
stream left open and unconsumed (or abandoned and collected); every caller gets what it would get alone.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from kvforge import runtime

PROMPTS = [[10, 20, 30, 40, 50], [5, 6, 7], [200, 100, 50, 25, 12, 6]]


@pytest.fixture(scope="module")
def bundle(micro_bundle):
    return micro_bundle("qwen2-micro").path  # a full and a windowed (capped) layer


def _alone(session, prompt, n=16):
    return session.generate(prompt, max_new_tokens=n, ignore_eos=True).tokens


def _in_thread(fn, timeout=60):
    """Run fn in another thread; its result, or a failure if it does not finish in time (a deadlock)."""
    out = {}

    def run():
        try:
            out["result"] = fn()
        except BaseException as e:  # reported below
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the call did not finish in {timeout} s: the session is held"
    if "error" in out:
        raise out["error"]
    return out["result"]


def test_the_thread_holding_an_open_stream_may_use_the_session(bundle):
    with runtime.load(bundle) as s:
        alone = [_alone(s, p) for p in PROMPTS]
        stream = s.stream(PROMPTS[0], max_new_tokens=16, ignore_eos=True)
        first = [next(stream).token for _ in range(5)]
        # re-entrant: generate, another stream and a forward step, all between two tokens of the first stream
        assert _alone(s, PROMPTS[1]) == alone[1]
        assert [e.token for e in s.stream(PROMPTS[2], max_new_tokens=16, ignore_eos=True)] == alone[2]
        logits, cache = s.forward(np.array([PROMPTS[1]], np.int64))
        assert logits.shape == (1, 3, 259) and cache.length == 3
        rest = [e.token for e in stream]
    assert first + rest == alone[0]


def test_an_open_unconsumed_stream_does_not_hold_up_other_threads(bundle):
    with runtime.load(bundle) as s:
        alone = _alone(s, PROMPTS[1])
        stream = s.stream(PROMPTS[0], max_new_tokens=16, ignore_eos=True)
        next(stream)  # started, then left open: its caller went away without closing it
        assert _in_thread(lambda: _alone(s, PROMPTS[1])) == alone
        assert _in_thread(lambda: [e.token for e in s.stream(PROMPTS[1], max_new_tokens=16, ignore_eos=True)]) == alone
        stream.close()
        del stream
        gc.collect()  # an abandoned stream, collected
        assert _in_thread(lambda: _alone(s, PROMPTS[1])) == alone


def test_streams_interleaved_across_threads_each_get_their_own_tokens(bundle):
    with runtime.load(bundle) as s:
        alone = [_alone(s, p) for p in PROMPTS]
        results: dict[int, list[int]] = {}
        barrier = threading.Barrier(len(PROMPTS))

        def work(i):
            tokens = []
            for event in s.stream(PROMPTS[i], max_new_tokens=16, ignore_eos=True):
                if len(tokens) == 1:
                    barrier.wait(timeout=30)  # every stream is open and part-way at once
                tokens.append(event.token)
            results[i] = tokens

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert [results[i] for i in range(len(PROMPTS))] == alone
