"""Prefix caching and chunked prefill in the continuous batcher: cached prompt blocks are reused, long prompts are
fed in chunks between decode steps, and neither changes a greedy output."""

from __future__ import annotations

import contextlib
import random
import time

import numpy as np
import pytest

from kvforge import runtime
from kvforge.errors import KvforgeError
from kvforge.model_defs.config import PRESETS
from kvforge.runtime.prefix_cache import PrefixCache

from ..conftest import second_sweep

MICRO = sorted(n for n in PRESETS if n.endswith("-micro"))  # every decoder design


@pytest.fixture(scope="module")
def tiny(tiny_fp32):
    with runtime.load(tiny_fp32.path) as session:
        yield session


@pytest.fixture(scope="module")
def mistral(micro_bundle):  # every layer's cache capped at a window of 8
    with runtime.load(micro_bundle("mistral-micro").path) as session:
        yield session


def _prompts(seed: int, vocab: int, system: int, n: int = 10) -> list[list[int]]:
    """System-prompt-like traffic: a shared prefix, a second shared layer for some, own tails, and repeats."""
    rng = random.Random(seed)
    sys_ids = [rng.randrange(3, vocab) for _ in range(system)]
    few_shot = [rng.randrange(3, vocab) for _ in range(system // 2)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))]
        prompts.append(sys_ids + (few_shot if i % 3 == 0 else []) + tail)
    prompts.append(list(prompts[1]))  # the same prompt again: all but its last token can come from the cache
    prompts.append(sys_ids[:16])  # a prompt of exactly full blocks: its last token is still fed
    prompts.append(sys_ids[:16])
    return prompts


def _workload(session, prompts, seed: int, cancel=(), max_batch: int = 4, **options):
    """Random arrivals, some cancelled; returns the batcher's results (None where cancelled) and its stats."""
    rng = random.Random(seed)
    new = [6 + rng.randrange(8) for _ in prompts]
    with runtime.Batcher(session, max_batch=max_batch, **options) as batcher:
        # the first prompt alone first: its blocks are cached before the rest arrive
        first = batcher.submit(prompts[0], max_new_tokens=new[0], ignore_eos=True).result(timeout=120)
        requests = []
        for i, p in enumerate(prompts[1:], 1):
            requests.append(batcher.submit(p, max_new_tokens=new[i], ignore_eos=True))
            if i in cancel:
                requests[-1].cancel()
            time.sleep(rng.choice([0, 0, 0.002, 0.01]))
        results = [first] + [r.result(timeout=120) for r in requests]
        stats = batcher.prefix_stats
        assert batcher.prefix_cache.pinned() == 0  # every row that restored blocks let them go
    return new, results, stats


class _Forwards:
    """Records each forward call's (rows, tokens fed per row, whether it carried a cache) on a session; a mixed step
    (forward_mixed) is recorded as its two parts, the decode rows' first, and counted in `mixed`."""

    def __init__(self, session, monkeypatch):
        self.calls: list[tuple[int, int, bool]] = []
        self.mixed = 0
        real, real_mixed = session.forward, session.forward_mixed

        def forward(ids, mask, cache=None, **kwargs):
            self.calls.append((ids.shape[0], ids.shape[1], cache is not None))
            return real(ids, mask, cache=cache, **kwargs)

        def forward_mixed(rows, prompt, **kwargs):
            self.calls += [(x[0].shape[0], x[0].shape[1], x[2] is not None) for x in (rows, prompt)]
            self.mixed += 1
            return real_mixed(rows, prompt, **kwargs)

        monkeypatch.setattr(session, "forward", forward)
        monkeypatch.setattr(session, "forward_mixed", forward_mixed)


def _check_against_alone(session, prompts, new, results, cancel=()):
    for i, (p, n, got) in enumerate(zip(prompts, new, results)):
        if i in cancel:
            assert got.finish_reason in ("cancelled", "length")
            continue
        alone = session.generate(p, max_new_tokens=n, ignore_eos=True)
        assert got.tokens == alone.tokens, f"prompt {i} ({len(p)} tokens)"


@pytest.mark.parametrize("design", ["packed-gqa", "graph-attention", "torch"])
def test_greedy_outputs_with_prefix_cache_equal_each_prompt_alone(design, tiny, tiny_fp32):
    """tiny (Llama-style, GQA) on ONNX Runtime's packed GroupQueryAttention cache, on the bundle's own attention,
    and on the Torch backend."""
    cancel = {3, 7}
    if design == "packed-gqa":
        assert tiny.backend.packed
        context = contextlib.nullcontext(tiny)
    else:
        context = runtime.load(tiny_fp32.path, **(dict(attention="graph") if design == "graph-attention"
                                                  else dict(backend="torch")))
    prompts = _prompts(1, 4096, system=40, n=10 if design != "torch" else 5)  # torch: slower on tiny, fewer
    with context as session:
        new, results, stats = _workload(session, prompts, seed=2, cancel=cancel, prefix_block=8, prefix_cache_tokens=2048)
        _check_against_alone(session, prompts, new, results, cancel)
    # the prompts after the first share its 40-token system prompt (5 blocks); every hit is whole blocks
    assert stats.hits >= 3 and stats.hit_tokens >= 3 * 40
    assert stats.hit_tokens % 8 == 0
    assert stats.cached_blocks > 5 and stats.cached_tokens == stats.cached_blocks * 8


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_sliding_window_reuses_only_prefixes_within_the_window(mistral, micro_bundle, backend):
    """mistral-micro caps every layer at 8 positions: blocks of 4 are cached and reused only up to position 8."""
    prompts = _prompts(3, 259, system=20)
    cancel = {5}
    context = (contextlib.nullcontext(mistral) if backend == "onnxruntime"
               else runtime.load(micro_bundle("mistral-micro").path, backend="torch"))
    with context as session:
        new, results, stats = _workload(session, prompts, seed=4, cancel=cancel, prefix_block=4, prefix_cache_tokens=512)
        _check_against_alone(session, prompts, new, results, cancel)
    assert stats.hits >= 3
    assert stats.hit_tokens == 8 * stats.hits  # never more than the window: 2 blocks of 4
    # a prompt longer than the window caches only the blocks within it (fed first, before they slide out)
    with runtime.Batcher(mistral, prefix_block=4, prefix_cache_tokens=512) as batcher:
        batcher.generate(list(range(10, 30)), max_new_tokens=2, ignore_eos=True)
        assert batcher.prefix_stats.cached_blocks == 2
        batcher.generate(list(range(10, 17)), max_new_tokens=2, ignore_eos=True)
        assert batcher.prefix_stats.hit_tokens == 4  # 7 tokens: one full block within the last-token rule


def test_disabled_prefix_cache_prefills_as_before(tiny):
    prompts = _prompts(5, 4096, system=40, n=4)
    with runtime.Batcher(tiny, prefix_cache_tokens=0) as batcher:
        assert batcher.prefix_cache is None and batcher.prefix_stats is None
        results = [batcher.generate(p, max_new_tokens=5, ignore_eos=True) for p in prompts]
    _check_against_alone(tiny, prompts, [5] * len(prompts), results)
    with pytest.raises(KvforgeError, match="prefix_block"):
        runtime.Batcher(tiny, prefix_block=0)
    with pytest.raises(KvforgeError, match="prefix_cache_tokens"):
        runtime.Batcher(tiny, prefix_cache_tokens=-1)


def test_models_do_not_share_cached_blocks(tiny, tiny_fp32, mistral):
    shared = PrefixCache(block_size=4, max_tokens=1024)
    prompt = list(range(20, 28))  # within mistral's window: 2 blocks of 4 are cacheable
    with runtime.Batcher(tiny, prefix_cache=shared) as batcher:
        batcher.generate(prompt, max_new_tokens=3, ignore_eos=True)
        batcher.generate(prompt, max_new_tokens=3, ignore_eos=True)
    hit = shared.stats.hit_tokens
    assert hit == 4  # 7 tokens may come from the cache: 1 whole block
    with runtime.Batcher(mistral, prefix_cache=shared) as batcher:  # another model, the same token ids
        alone = mistral.generate(prompt, max_new_tokens=3, ignore_eos=True)
        assert batcher.generate(prompt, max_new_tokens=3, ignore_eos=True).tokens == alone.tokens
    assert shared.stats.hit_tokens == hit  # nothing came from tiny's blocks
    with runtime.load(tiny_fp32.path, backend="torch") as torch_session, \
            runtime.Batcher(torch_session, prefix_cache=shared) as batcher:  # the same model on another runtime
        batcher.generate(prompt, max_new_tokens=3, ignore_eos=True)
    assert shared.stats.hit_tokens == hit
    assert shared.stats.cached_blocks == 3 * 2  # each of the three kept its own 2 blocks


def _fake(k):
    return [np.full((1, 2, 1), k, np.float32)]


def test_lru_budget_evicts_unreferenced_blocks_only():
    cache = PrefixCache(block_size=2, max_tokens=6)  # 3 blocks
    ns = PrefixCache.namespace("model-a")
    a, b = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    keys, first = cache.missing(ns, a, 4)
    assert first == 0 and cache.insert(keys, a, first, _fake) == 2
    hit = cache.lookup(ns, a, 4)  # a row restores both of a's blocks: they are referenced
    assert hit.tokens == 4 and cache.pinned() == 2
    assert hit.arrays()[0][0, 0, :, 0].tolist() == [0, 0, 1, 1]  # block k's positions hold k
    keys, first = cache.missing(ns, b, 4)
    assert cache.insert(keys, b, first, _fake) == 1  # b's first block fits; the second would evict a pinned block
    assert cache.stats.cached_blocks == 3 and cache.stats.evicted_blocks == 0
    assert cache.lookup(ns, a, 4).tokens == 4  # a is intact (and pinned twice now)
    cache.release(hit.keys)
    cache.release(hit.keys)
    keys, first = cache.missing(ns, b, 4)
    assert first == 1 and cache.insert(keys, b, first, _fake) == 1  # now a's leaf (least recently used) goes
    s = cache.stats
    assert s.evicted_blocks == 1 and s.cached_blocks == 3 and s.cached_tokens == 6
    assert cache.lookup(ns, a, 4).tokens == 2  # a's first block is still there: a parent goes after its children
    assert cache.lookup(ns, b, 4).tokens == 4
    assert cache.lookup(PrefixCache.namespace("model-b"), b, 4).tokens == 0  # keys are per model
    assert cache.lookup(ns, b, 3).tokens == 2  # only whole blocks within the limit
    s = cache.stats
    assert s.lookups == 6 and s.hits == 5 and s.hit_tokens == 4 + 4 + 2 + 4 + 2


@pytest.mark.parametrize("preset", second_sweep(MICRO))
def test_chunked_prefill_and_prefix_cache_change_no_greedy_output(preset, micro_bundle, monkeypatch):
    """Every decoder design (the micro presets: windows capped and not, ALiBi, learned positions, MoE, latent
    attention, ...): random arrivals, shared prefixes, cancellations and two prompts longer than the step budget,
    each result equal to its prompt generated alone. Every forward call feeds at most the budget per row, and the
    running rows decode between a long prompt's chunks."""
    chunk = 7  # not a multiple of the block: chunks end mid-block
    with runtime.load(micro_bundle(preset).path) as session:
        prompts = _prompts(7, session.vocab_size, system=24, n=8)
        long_prompt = prompts[0][:24] + [(5 * i) % (session.vocab_size - 3) + 3 for i in range(40)]
        prompts[2:2] = [long_prompt, list(long_prompt)]  # the second starts with the first's cached blocks
        forwards = _Forwards(session, monkeypatch)
        new, results, stats = _workload(session, prompts, seed=8, cancel={5, 9}, max_batch=3, prefix_block=4,
                                        prefix_cache_tokens=1024, prefill_chunk=chunk)
        monkeypatch.undo()
        _check_against_alone(session, prompts, new, results, cancel={5, 9})
    assert all(tokens <= chunk for _, tokens, _ in forwards.calls)
    pieces = [i for i, (rows, tokens, cached) in enumerate(forwards.calls) if rows == 1 and tokens > 1 and cached]
    decodes = {i for i, (_, tokens, _) in enumerate(forwards.calls) if tokens == 1}
    assert any(decodes & set(range(a + 1, b)) for a, b in zip(pieces, pieces[1:]))  # decode steps between chunks
    assert stats.hits >= 3


def test_prefill_budget_counts_the_running_rows_and_zero_turns_chunking_off(tiny, monkeypatch):
    prompt = list(range(3, 103))
    forwards = _Forwards(tiny, monkeypatch)
    with runtime.Batcher(tiny, max_batch=4, prefill_chunk=32, prefix_cache_tokens=0, mixed_steps=True) as batcher:
        assert batcher.mixed  # the packed cache's mixed graph: one call per chunk and decode step
        short = [batcher.submit(prompt[:5 + i], max_new_tokens=60, ignore_eos=True) for i in range(3)]
        for r in short:  # all three decode before the long prompt arrives
            next(iter(r))
        long = batcher.submit(prompt, max_new_tokens=3, ignore_eos=True)
        results = [r.result(timeout=120) for r in short + [long]]
    monkeypatch.undo()
    fed = [tokens for rows, tokens, _ in forwards.calls if rows == 1 and tokens > 1]
    assert max(fed) == 32 - 3 and sum(fed) >= 99  # 3 rows decode: 29 tokens left for the prompt per step
    assert forwards.mixed >= 3  # the chunks were fed with the rows' decode steps (forward_mixed)
    assert results[-1].tokens == tiny.generate(prompt, max_new_tokens=3, ignore_eos=True).tokens
    forwards = _Forwards(tiny, monkeypatch)
    with runtime.Batcher(tiny, prefill_chunk=0, prefix_cache_tokens=0) as batcher:
        assert batcher.generate(prompt, max_new_tokens=2, ignore_eos=True).tokens == results[-1].tokens[:2]
    assert forwards.calls[0][1] == 100  # the whole prompt at once
    for bad in (dict(prefill_chunk=-1), dict(prefill_chunk=2.5), dict(prefill_chunk=True)):
        with pytest.raises(KvforgeError, match="prefill_chunk must be an int >= 0"):
            runtime.Batcher(tiny, **bad)
    with pytest.raises(KvforgeError, match="mixed_steps must be True or False, got 1"):
        runtime.Batcher(tiny, mixed_steps=1)


@pytest.mark.slow
def test_smollm2_chunked_and_cached_greedy_outputs_equal_each_prompt_alone(smollm2_fp32_bundle):
    """The real SmolLM2-135M-Instruct: chat prompts sharing a system prompt (several blocks), random arrivals, a
    cancellation, and prompts longer than the step budget; each result is its prompt's greedy output alone."""
    with runtime.load(smollm2_fp32_bundle.path) as session:
        system = "You are a careful assistant. Answer in one short sentence, and never use lists or headings. "
        questions = ["What is the capital of France?", "Why is the sky blue?", "Name a prime number above 50.",
                     "What does a compiler do?", "How many legs does a spider have?", "What is 7 times 8?"]
        prompts = [session.tokenizer.encode(system * 2 + q) for q in questions]
        assert min(len(p) for p in prompts) > 40  # longer than the budget below: every prompt is chunked
        new, results, stats = _workload(session, prompts, seed=11, cancel={3}, max_batch=3, prefix_block=16,
                                        prefix_cache_tokens=2048, prefill_chunk=24)
        _check_against_alone(session, prompts, new, results, cancel={3})
    assert stats.hits >= 3 and stats.hit_tokens >= 3 * 32
