"""Continuous batching: requests that join and leave a running batch compute what they would alone."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvforge import runtime
from kvforge.errors import KvforgeError

PROMPTS = ["def add(a, b):", "class Stack", "import os\nimport", "x = 1", "for i in range(10):", "# a comment",
           "while True:", "return self."]


@pytest.fixture(scope="module")
def tiny(tiny_fp32):
    with runtime.load(tiny_fp32.path) as session:
        yield session


def _staggered(batcher, prompts, options, pause=0.005):
    requests = []
    for p, o in zip(prompts, options):
        requests.append(batcher.submit(p, **o))
        time.sleep(pause)  # arrivals while the batch runs: joins between steps
    return [r.result(timeout=120) for r in requests]


def _a_hole_is_filled(session, monkeypatch, prompts: list) -> None:
    """A long row and a short one run; the short one ends, its place becomes a hole, and a third request that
    arrives then fills it (place_rows, not a regroup) while the long row runs on: all three get their results
    alone."""
    options = [dict(max_new_tokens=n, ignore_eos=True) for n in (40, 3, 6)]
    alone = [session.generate(p, **o) for p, o in zip(prompts, options)]
    calls, real = [], session.place_rows
    monkeypatch.setattr(session, "place_rows", lambda cache, rows, part: calls.append(rows) or real(cache, rows, part))
    with runtime.Batcher(session, max_batch=2) as batcher:
        long = batcher.submit(prompts[0], **options[0])
        short = batcher.generate(prompts[1], **options[1])
        assert not long.done  # (40 tokens: it runs on while the third joins)
        third = batcher.generate(prompts[2], **options[2])
        results = [long.result(timeout=120), short, third]
    monkeypatch.undo()
    assert [r.tokens for r in results] == [a.tokens for a in alone]
    assert calls == [[1]]  # the third took the short row's place


def test_joining_and_leaving_rows_get_their_single_request_results(tiny, monkeypatch):
    options = [dict(max_new_tokens=6 + 4 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    alone = [tiny.generate(p, **o) for p, o in zip(PROMPTS, options)]
    with runtime.Batcher(tiny, max_batch=3) as batcher:
        batched = _staggered(batcher, PROMPTS, options)
        assert batcher.peak_batch == 3  # rows ran together ...
        assert batcher.steps < sum(len(r.tokens) for r in batched) * 0.6  # ... so far fewer steps than tokens
    _a_hole_is_filled(tiny, monkeypatch, PROMPTS[:3])
    for a, b in zip(alone, batched):
        assert b.tokens == a.tokens and b.text == a.text and b.finish_reason == "length"


def test_per_request_sampling_seeds_and_stop_tokens(tiny):
    options = [dict(max_new_tokens=12, temperature=0.5 + 0.1 * i, top_p=0.9, top_k=50 * (i % 2), seed=i)
               for i in range(len(PROMPTS))]
    # one greedy row that stops early on a token it is known to produce, mid-batch
    greedy = tiny.generate(PROMPTS[3], max_new_tokens=12, ignore_eos=True).tokens
    options[3] = dict(max_new_tokens=12, stop_token_ids=[greedy[4]])
    alone = [tiny.generate(p, **o) for p, o in zip(PROMPTS, options)]
    assert alone[3].finish_reason == "stop" and len(alone[3].tokens) <= 5
    with runtime.Batcher(tiny, max_batch=8) as batcher:
        batched = _staggered(batcher, PROMPTS, options, pause=0)
    assert [b.tokens for b in batched] == [a.tokens for a in alone]
    assert [b.finish_reason for b in batched] == [a.finish_reason for a in alone]


def test_stream_events_and_text(tiny):
    with runtime.Batcher(tiny, max_batch=4) as batcher:
        other = batcher.submit(PROMPTS[0], max_new_tokens=20, ignore_eos=True)
        request = batcher.submit(PROMPTS[1], max_new_tokens=10, ignore_eos=True)
        events = list(request)
        result = request.result()
        assert other.result(timeout=60).finish_reason == "length"
    assert [e.index for e in events] == list(range(10)) and [e.token for e in events] == result.tokens
    assert [e.last for e in events] == [False] * 9 + [True] and events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == result.text
    assert list(request) == []  # a second iteration ends at once


@pytest.mark.parametrize("preset", ["mistral-micro", "gemma-micro"])
def test_capped_window_caches_join_and_trim(micro_bundle, preset, monkeypatch):
    """Windowed layers hold min(length, W) positions: rows of different lengths still match their runs alone, also
    where a joining row fills a hole (the base Backend's place: these caches are not packed)."""
    rng = np.random.default_rng(0)
    with runtime.load(micro_bundle(preset).path) as session:
        V = session.vocab_size
        prompts = [rng.integers(3, V, size=n).tolist() for n in (3, 17, 6, 11, 2, 25)]
        options = [dict(max_new_tokens=n, ignore_eos=True) for n in (20, 4, 15, 9, 30, 6)]
        alone = [session.generate(p, **o) for p, o in zip(prompts, options)]
        with runtime.Batcher(session, max_batch=4) as batcher:
            batched = _staggered(batcher, prompts, options)
        assert [b.tokens for b in batched] == [a.tokens for a in alone]
        _a_hole_is_filled(session, monkeypatch, prompts[:3])


def test_context_limit_ends_a_row_as_it_would_alone(micro_bundle):
    bundle = micro_bundle("mistral-micro")
    with runtime.load(bundle.path) as session:
        C, V = session.max_context, session.vocab_size
        long = [3 + i % (V - 3) for i in range(C - 4)]  # four tokens of room
        alone = session.generate(long, max_new_tokens=10, ignore_eos=True)
        assert alone.finish_reason == "context" and len(alone.tokens) == 4
        with runtime.Batcher(session, max_batch=2) as batcher:
            short = batcher.submit([5, 6, 7], max_new_tokens=12, ignore_eos=True)
            edge = batcher.submit(long, max_new_tokens=10, ignore_eos=True)
            assert edge.result(timeout=60).tokens == alone.tokens and edge.result().finish_reason == "context"
            assert short.result(timeout=60).tokens == session.generate([5, 6, 7], max_new_tokens=12, ignore_eos=True).tokens
            with pytest.raises(KvforgeError, match="exceeds the bundle's maximum context"):
                batcher.submit(long + [5] * 5)


def test_back_pressure_waits_and_what_never_fits_is_refused(tiny):
    # a budget that holds one request at a time: the others wait, none fails
    reserves = [len(tiny.encode(p)) + 8 for p in PROMPTS[:4]]
    budget = 2 * min(reserves) - 1  # no two fit together
    assert budget >= max(reserves)
    with runtime.Batcher(tiny, max_batch=8, max_cache_tokens=budget) as batcher:
        options = [dict(max_new_tokens=8, ignore_eos=True)] * 4
        results = _staggered(batcher, PROMPTS[:4], options, pause=0)
        assert batcher.peak_batch == 1
        with pytest.raises(KvforgeError, match=rf"budget is {budget}; it can never run"):
            batcher.submit(PROMPTS[0], max_new_tokens=64)
    assert [r.tokens for r in results] == [tiny.generate(p, **o).tokens for p, o in zip(PROMPTS[:4], options)]


def test_cancel_frees_the_slot_and_others_carry_on(tiny):
    with runtime.Batcher(tiny, max_batch=2) as batcher:
        doomed = batcher.submit(PROMPTS[0], max_new_tokens=500, ignore_eos=True)
        keeper = batcher.submit(PROMPTS[1], max_new_tokens=30, ignore_eos=True)
        waiting = batcher.submit(PROMPTS[2], max_new_tokens=10, ignore_eos=True)  # needs doomed's slot
        first = next(iter(doomed))
        doomed.cancel()
        assert doomed.result(timeout=60).finish_reason == "cancelled"
        assert first.index == 0 and 1 <= len(doomed.result().tokens) < 500
        assert waiting.result(timeout=60).tokens == tiny.generate(PROMPTS[2], max_new_tokens=10, ignore_eos=True).tokens
        assert keeper.result(timeout=60).tokens == tiny.generate(PROMPTS[1], max_new_tokens=30, ignore_eos=True).tokens
        queued = [batcher.submit(p, max_new_tokens=400, ignore_eos=True) for p in PROMPTS[:4]]
    # close() cancels what is still running or waiting
    assert all(q.result(timeout=60).finish_reason == "cancelled" for q in queued)
    with pytest.raises(KvforgeError, match="closed"):
        batcher.submit(PROMPTS[0])


def test_submit_from_many_threads(tiny):
    results: dict[int, object] = {}
    with runtime.Batcher(tiny, max_batch=8) as batcher:
        def client(i):
            results[i] = batcher.generate(PROMPTS[i], max_new_tokens=8, ignore_eos=True)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert [results[i].tokens for i in range(len(PROMPTS))] == [
        tiny.generate(p, max_new_tokens=8, ignore_eos=True).tokens for p in PROMPTS]


def test_bad_requests_are_refused_at_submit(tiny):
    with runtime.Batcher(tiny, max_batch=2) as batcher:
        for kwargs, message in [
            (dict(prompt=[]), "a prompt is a str, a list of token ids"),
            (dict(prompt=[1, tiny.vocab_size]), "outside the vocabulary"),
            (dict(prompt=["a", "b"]), "one prompt"),
            (dict(prompt="x", temperature=-1), "temperature must be >= 0"),
            (dict(prompt="x", max_new_tokens=-1), "max_new_tokens"),
            (dict(prompt="x", bogus=1), "unknown generation option"),
        ]:
            prompt = kwargs.pop("prompt")
            with pytest.raises(KvforgeError, match=message):
                batcher.submit(prompt, **kwargs)
        empty = batcher.submit("x", max_new_tokens=0)
        assert empty.result(timeout=5).tokens == [] and list(empty) == []
    for bad in (dict(max_batch=0), dict(max_batch=2.5), dict(max_cache_tokens=0)):
        with pytest.raises(KvforgeError, match="must be an int"):
            runtime.Batcher(tiny, **bad)


def test_a_failing_step_fails_its_requests_not_the_batcher(tiny, monkeypatch):
    with runtime.Batcher(tiny, max_batch=2) as batcher:
        real = tiny.forward
        monkeypatch.setattr(tiny, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost")))
        failed = batcher.submit(PROMPTS[0], max_new_tokens=4)
        with pytest.raises(KvforgeError, match="device lost"):
            failed.result(timeout=60)
        monkeypatch.setattr(tiny, "forward", real)
        assert batcher.generate(PROMPTS[1], max_new_tokens=4, ignore_eos=True).tokens == \
            tiny.generate(PROMPTS[1], max_new_tokens=4, ignore_eos=True).tokens
