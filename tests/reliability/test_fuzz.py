"""Fuzzing the Session: random shapes, dtypes, ids, masks, caches and generation options.

Every input either gives the Torch reference's answer or raises a KvforgeError, within a time bound: never
another exception, a crash or a hang.
"""

from __future__ import annotations

import signal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge import runtime
from kvforge.errors import KvforgeError

VOCAB = 259


@pytest.fixture(scope="module")
def sessions(micro_bundle):
    path = micro_bundle("qwen2-micro").path  # a full and a windowed (capped) layer; max context 256
    with runtime.load(path) as ort, runtime.load(path, backend="torch") as ref:
        yield ort, ref


class _Timeout(Exception):
    pass


def _bounded(fn, seconds=30):
    """fn(), or a failure if it runs longer than `seconds` (a hang)."""
    def alarm(*_):
        raise _Timeout(f"no answer in {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _array(rng, kind, shape, low, high):
    values = rng.integers(low, high, shape)
    return {"int64": values.astype(np.int64), "int32": values.astype(np.int32), "float32": values.astype(np.float32),
            "list": values.tolist()}[kind]


_FUZZ = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FUZZ
@given(batch=st.integers(0, 3), seq=st.integers(0, 5), past=st.integers(0, 12), low=st.integers(-3, VOCAB + 3),
       ids_kind=st.sampled_from(["int64", "int64", "int64", "int32", "float32", "list"]),
       mask=st.sampled_from(["none", "ones", "left-pad", "row-all-padding", "wrong-width", "twos", "int32"]),
       positions=st.sampled_from(["none", "derived", "negative", "beyond"]), seed=st.integers(0, 2**16))
def test_forward_answers_as_the_reference_or_refuses(sessions, batch, seq, past, low, ids_kind, mask, positions, seed):
    ort, ref = sessions
    rng = np.random.default_rng(seed)
    caches = [None, None]
    if past and batch:  # a cache from a prefill of `past` tokens (valid), on each side
        prefix = rng.integers(0, VOCAB, (batch, past)).astype(np.int64)
        caches = [s.forward(prefix)[1] for s in (ort, ref)]
    ids = _array(rng, ids_kind, (batch, seq), low, low + 8)
    total = (past if past and batch else 0) + seq
    m = {"none": None, "ones": np.ones((batch, total), np.int64), "wrong-width": np.ones((batch, total + 1), np.int64),
         "twos": np.full((batch, total), 2, np.int64), "int32": np.ones((batch, total), np.int32)}.get(mask)
    if mask in ("left-pad", "row-all-padding"):
        m = np.ones((batch, total), np.int64)
        if batch:
            m[0, : rng.integers(0, total + 1) if mask == "left-pad" else total] = 0
    pos = None
    if positions != "none" and m is not None and m.dtype == np.int64 and m.shape == (batch, total):
        pos = np.maximum(m.cumsum(-1) - 1, 0)[:, total - seq:] if seq else np.zeros((batch, 0), np.int64)
        pos = pos - 5 if positions == "negative" else pos + 10_000 if positions == "beyond" else pos
    answers = []
    for s, cache in zip((ort, ref), caches):
        try:
            answers.append(_bounded(lambda: s.forward(ids, m, position_ids=pos, cache=cache)))
        except KvforgeError as e:
            answers.append(e)
    (a, b) = answers
    assert type(a) is type(b), (a, b)  # both refuse, or both answer
    if isinstance(a, KvforgeError):
        assert str(a) == str(b) and str(a)
        return
    np.testing.assert_allclose(a[0], b[0], atol=1e-4, rtol=0)
    assert a[1].length == b[1].length == total


@_FUZZ
@given(prompt=st.one_of(st.lists(st.integers(-2, VOCAB + 2), min_size=0, max_size=8), st.text(max_size=12),
                        st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), min_size=1, max_size=3)),
       max_new_tokens=st.integers(-1, 6), temperature=st.one_of(st.floats(-0.5, 2.0), st.just(float("nan"))), top_k=st.integers(-1, 10),
       top_p=st.one_of(st.floats(-0.5, 1.5), st.just(float("nan"))), seed=st.one_of(st.none(), st.integers(0, 5)))
def test_generate_answers_as_the_reference_or_refuses(sessions, prompt, max_new_tokens, temperature, top_k, top_p, seed):
    ort, ref = sessions
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, ignore_eos=True)
    answers = []
    for s in (ort, ref):
        try:
            answers.append(_bounded(lambda: s.generate(prompt, **options)))
        except KvforgeError as e:
            answers.append(e)
    a, b = answers
    assert type(a) is type(b), (a, b)
    if isinstance(a, KvforgeError):
        assert str(a) == str(b) and str(a)
        return
    rows_a, rows_b = (x if isinstance(x, list) else [x] for x in (a, b))
    greedy = temperature == 0 or top_k == 1
    for ra, rb in zip(rows_a, rows_b):
        assert len(ra.tokens) == len(rb.tokens) <= max(max_new_tokens, 0)
        assert all(0 <= t < VOCAB for t in ra.tokens)
        if greedy:
            assert ra.tokens == rb.tokens
