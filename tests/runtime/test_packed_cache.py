"""The ONNX Runtime backend's GroupQueryAttention over a packed, shared-buffer cache (issue 18).

The packed variant must compute what the bundle's graph computes, at every position a mask leaves real, for any
left-padded step the session's contract allows: prefill, decode, several tokens over a past (batch 1 and more),
caches continued twice, regrouped and cut; and must refuse what it cannot follow with an error that says what to do.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest

from kvforge import runtime
from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError
from kvforge.export import export
from kvforge.runtime.ort.variant import variant_path

ATOL = 2e-5  # float32 rounding of another summation order (tests/runtime/test_ort_fusions.py's tolerance)


def _left_padded(rng, lengths, vocab):
    T = max(lengths)
    ids = rng.integers(0, vocab, (len(lengths), T), dtype=np.int64)
    mask = (np.arange(T)[None, :] >= T - np.array(lengths)[:, None]).astype(np.int64)
    return ids, mask, np.clip(np.cumsum(mask, 1) - 1, 0, None)


@pytest.fixture(scope="module")
def sessions(micro_bundle):
    path = micro_bundle("llama3-micro").path
    with runtime.load(path, variant=False) as plain, runtime.load(path) as fast:
        assert fast.backend.packed and not plain.backend.packed
        yield plain, fast


def _step(sessions, caches, ids, mask, pos, last_only=False):
    (plain, fast), (ca, cb) = sessions, caches
    a, ca = plain.forward(ids, mask, position_ids=pos, cache=ca, last_logits_only=last_only)
    b, cb = fast.forward(ids, mask, position_ids=pos, cache=cb, last_logits_only=last_only)
    new_real = mask[:, -ids.shape[1]:] == 1
    if last_only:
        np.testing.assert_allclose(b, a, atol=ATOL, rtol=0)
    else:
        np.testing.assert_allclose(b[new_real], a[new_real], atol=ATOL, rtol=0)
    return ca, cb


def _assert_caches_agree(sessions, caches, mask):
    (plain, fast), (ca, cb) = sessions, caches
    real = mask[:, None, :, None] == 1
    for x, y in zip(plain.backend.cache_arrays(ca), fast.backend.cache_arrays(cb)):
        assert x.shape == y.shape
        held = real[:, :, real.shape[2] - x.shape[2]:]  # a capped (windowed) layer holds the newest W columns
        np.testing.assert_allclose(np.where(held, y, 0), np.where(held, x, 0), atol=ATOL, rtol=0)


def test_packed_cache_follows_every_left_padded_step(sessions):
    rng = np.random.default_rng(3)
    ids, mask, pos = _left_padded(rng, [5, 9, 1], 259)
    caches = _step(sessions, (None, None), ids, mask, pos, last_only=True)  # each row's last token sits elsewhere
    caches = _step(sessions, (None, None), ids, mask, pos)
    first = caches[1].values[0].shape[2]
    while caches[1].values[0].shape[2] == first:  # past the buffers' first capacity: they grow, keeping what they hold
        mask = np.concatenate([mask, np.ones((3, 1), np.int64)], 1)
        pos = pos[:, -1:] + 1
        caches = _step(sessions, caches, rng.integers(0, 259, (3, 1)), mask, pos)
    assert mask.shape[1] == first + 1  # it grew when the longest row needed one more position than it held
    # several tokens over a past: batch 3 runs token by token; batch 1 in one call
    mask3 = np.concatenate([mask, np.ones((3, 4), np.int64)], 1)
    pos3 = pos[:, -1:] + 1 + np.arange(4)
    more = rng.integers(0, 259, (3, 4))
    _step(sessions, caches, more, mask3, pos3)
    _step(sessions, caches, more, mask3, pos3, last_only=True)
    plain, fast = sessions
    one = (plain.regroup_cache([(caches[0], [1])], caches[0].length), fast.regroup_cache([(caches[1], [1])], caches[1].length))
    _step(sessions, one, more[1:2], mask3[1:2], pos3[1:2])
    _assert_caches_agree(sessions, caches, mask)


def test_packed_caches_are_values(sessions):
    """Continuing a cache twice (a branch) gives the same as continuing a fresh copy: the first continuation's
    writes do not show in the second."""
    rng = np.random.default_rng(4)
    ids, mask, pos = _left_padded(rng, [6, 3], 259)
    root = _step(sessions, (None, None), ids, mask, pos)
    mask = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
    pos = pos[:, -1:] + 1
    first = _step(sessions, root, rng.integers(0, 259, (2, 1)), mask, pos)
    second = _step(sessions, root, rng.integers(0, 259, (2, 1)), mask, pos)
    _step(sessions, first, rng.integers(0, 259, (2, 1)), np.concatenate([mask, np.ones((2, 1), np.int64)], 1), pos + 1)
    _assert_caches_agree(sessions, second, mask)


def test_regroup_and_drop_oldest_keep_each_rows_positions(sessions):
    """What continuous batching does: join rows of caches of other widths, cut padding columns."""
    plain, fast = sessions
    rng = np.random.default_rng(5)
    ids_a, mask_a, pos_a = _left_padded(rng, [7, 2], 259)
    ids_b, mask_b, pos_b = _left_padded(rng, [4], 259)
    a = _step(sessions, (None, None), ids_a, mask_a, pos_a)
    b = _step(sessions, (None, None), ids_b, mask_b, pos_b)
    joined = tuple(s.regroup_cache([(x[0], [1, 0]), (y[0], [0])], 9) for s, x, y in
                   zip(sessions, [(a[0],), (a[1],)], [(b[0],), (b[1],)]))
    mask = np.zeros((3, 10), np.int64)
    for row, n in enumerate([2, 7, 4]):
        mask[row, 9 - n:] = 1
    pos = mask[:, :9].sum(1, keepdims=True)
    joined = _step(sessions, joined, rng.integers(0, 259, (3, 1)), mask, pos)
    _assert_caches_agree(sessions, joined, mask)
    cut = tuple(s.backend.drop_oldest(c, 2) for s, c in zip(sessions, joined))  # columns 0-1: padding in every row
    mask = np.concatenate([mask[:, 2:], np.ones((3, 1), np.int64)], 1)
    cut = _step(sessions, cut, rng.integers(0, 259, (3, 1)), mask, pos + 1)
    _assert_caches_agree(sessions, cut, mask)


def test_a_mixed_step_computes_its_two_forward_calls(sessions):
    """forward_mixed (decode rows and one prompt row's chunk in one call of the mixed graph) against the bundle's
    own graph run as two forward calls: logits and both caches, for a chunk from an empty cache and over a past,
    for decode rows of different lengths, and for caches that another step already continued (values)."""
    (plain, fast), rng = sessions, np.random.default_rng(7)
    assert fast.prepare_mixed() and not plain.prepare_mixed()  # one call on the packed cache, two on the graph's
    V = fast.vocab_size
    ids, mask, pos = _left_padded(rng, [5, 11, 2], V)
    rows = [plain.forward(ids, mask, position_ids=pos, last_logits_only=True)[1],
            fast.forward(ids, mask, position_ids=pos, last_logits_only=True)[1]]
    prompt_ids = rng.integers(0, V, (1, 17))
    prompts = [None, None]
    fed = 0
    for step, n in enumerate([6, 1, 4, 6]):  # the prompt's chunks: from nothing, then over its own past
        mask = np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
        nxt = rng.integers(0, V, (3, 1))
        chunk, chunk_mask = prompt_ids[:, fed:fed + n], np.ones((1, fed + n), np.int64)
        (a, ra), (pa, qa) = (plain.forward_mixed((nxt, mask, rows[0]), (chunk, chunk_mask, prompts[0])))
        (b, rb), (pb, qb) = (fast.forward_mixed((nxt, mask, rows[1]), (chunk, chunk_mask, prompts[1])))
        np.testing.assert_allclose(b, a, atol=ATOL, rtol=0)
        np.testing.assert_allclose(pb, pa, atol=ATOL, rtol=0)
        assert b.shape == (3, 1, V) and pb.shape == (1, 1, V)
        if step == 2:  # continue the old caches again (a branch): what the first continuation wrote is not read
            again = fast.forward_mixed((nxt, mask, rows[1]), (chunk, chunk_mask, prompts[1]))
            np.testing.assert_allclose(again[0][0], b, atol=ATOL, rtol=0)
            np.testing.assert_allclose(again[1][0], pb, atol=ATOL, rtol=0)
        rows, prompts, fed = [ra, rb], [qa, qb], fed + n
        _assert_caches_agree(sessions, rows, mask)
        _assert_caches_agree(sessions, prompts, np.ones((1, fed), np.int64))
    # and the mixed step's caches go on as any other: a plain decode step of both
    one = np.ones((3, 1), np.int64)
    _step(sessions, rows, rng.integers(0, V, (3, 1)), np.concatenate([mask, one], axis=1), None, last_only=True)
    with pytest.raises(KvforgeError, match="one new token per decode row"):
        fast.forward_mixed((rng.integers(0, V, (3, 2)), np.concatenate([mask, one, one], axis=1), rows[1]),
                           (chunk, np.ones((1, chunk.shape[1]), np.int64), None))


def test_vacated_rows_are_filled_in_place(sessions):
    """The batcher's holes: a row vacated (nothing moves) and filled by another cache's row (its own positions
    copied in) gives, at the next steps, what the bundle's own graph gives over the same rows regrouped (the base
    Backend's place). The packed place copies nothing but the new row: every other row's buffer is untouched."""
    (plain, fast), rng = sessions, np.random.default_rng(3)
    V = fast.vocab_size
    ids, mask, pos = _left_padded(rng, [5, 11, 2], V)
    caches = [s.forward(ids, mask, position_ids=pos, last_logits_only=True)[1] for s in (plain, fast)]
    caches = [s.vacate_rows(c, [0]) for s, c in zip((plain, fast), caches)]
    mask[0] = 0
    new_ids = rng.integers(0, V, (1, 14))  # longer than the batch: the batch's columns grow on the left
    parts = [s.forward(new_ids, last_logits_only=True)[1] for s in (plain, fast)]
    before = [a.copy() for a in caches[1].values]
    caches = [s.place_rows(c, [0], part) for s, c, part in zip((plain, fast), caches, parts)]
    assert caches[1].length == 14 and caches[1].layout.lengths.tolist() == [14, 11, 2]
    for a, b in zip(before, caches[1].values):  # rows 1 and 2 are where they were, and row 0 holds the new row
        np.testing.assert_array_equal(b[1:, :, :11], a[1:, :, :11])
    mask = np.concatenate([np.ones((1, 14), np.int64), np.pad(mask[1:], ((0, 0), (3, 0)))])
    for _ in range(3):
        mask = np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
        caches = _step(sessions, caches, rng.integers(0, V, (3, 1)), mask, None, last_only=True)
    _assert_caches_agree(sessions, caches, mask)
    with pytest.raises(KvforgeError, match="fills empty rows"):
        fast.place_rows(caches[1], [1], parts[1])
    with pytest.raises(KvforgeError, match="distinct rows"):
        fast.place_rows(caches[1], [0, 0], parts[1])


def test_masks_the_packed_cache_cannot_follow_are_refused(sessions):
    _, fast = sessions
    ids = np.arange(6, dtype=np.int64).reshape(1, 6)
    holed = np.array([[1, 1, 0, 1, 1, 1]], np.int64)
    with pytest.raises(KvforgeError, match="not left-padded.*attention='graph'"):
        fast.forward(ids, holed)
    _, cache = fast.forward(ids)
    with pytest.raises(KvforgeError, match="marks 4 of its past 6 columns real, but the cache holds 6"):
        fast.forward(ids[:, :1], np.array([[0, 0, 1, 1, 1, 1, 1]], np.int64), cache=cache)
    # the bundle's attention takes any mask; it does not continue a packed cache, nor the other way round
    with runtime.load(fast.source, attention="graph") as graph:
        logits, unpacked = graph.forward(ids, holed)
        assert np.isfinite(logits).all()
        with pytest.raises(KvforgeError, match="this is a packed cache, and this session runs the bundle's attention"):
            graph.forward(ids[:, :1], cache=cache)
    with pytest.raises(KvforgeError, match="this is an unpacked cache, and this session runs a packed cache"):
        fast.forward(ids[:, :1], cache=unpacked)
    with pytest.raises(KvforgeError, match="attention 'flash' is not one of"):
        runtime.load(fast.source, attention="flash")


def test_windowed_layers_run_packed_past_their_window(micro_bundle):
    """gemma-micro's windowed layers (8 keys, on layers 0 and 2) run as GroupQueryAttention with the kernel's
    window over whole buffers. Against the bundle's graph (capped caches): a left-padded prefill longer than the
    window, decode past it, the contract's layout (a windowed layer's newest 8 positions), and a cache made from
    that layout (as the prefix cache restores one) continued by a chunk longer than the window at batch 1."""
    path = micro_bundle("gemma-micro").path
    rng = np.random.default_rng(3)
    with runtime.load(path, variant=False) as plain, runtime.load(path) as fast:
        assert fast.backend.packed and not plain.backend.packed and fast.io.windows == [8, None, 8, None]
        ids, mask, pos = _left_padded(rng, [12, 5], 259)
        caches = _step((plain, fast), (None, None), ids, mask, pos)
        for _ in range(6):
            mask = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
            pos = pos[:, -1:] + 1
            caches = _step((plain, fast), caches, rng.integers(0, 259, (2, 1)), mask, pos)
        _assert_caches_agree((plain, fast), caches, mask)
        assert [a.shape[2] for a in fast.cache_arrays(caches[1])] == [8, 8, 18, 18] * 2
        row = [a[:1] for a in plain.cache_arrays(caches[0])]  # row 0: 18 real positions
        restored = (plain.cache_from_arrays(row, 18), fast.cache_from_arrays(row, 18))
        chunk = rng.integers(0, 259, (1, 10))
        _step((plain, fast), restored, chunk, np.ones((1, 28), np.int64), np.arange(18, 28)[None])


def test_soft_capped_attention_is_packed(tmp_path):
    """Gemma 2's score soft-capping becomes the kernel's softcap (on a Llama without windows: the soft-cap alone)."""
    from kvforge.model_defs import ModelConfig, PRESETS, build_model, init_random_weights, save_checkpoint

    cfg = ModelConfig(**{**PRESETS["llama3-micro"], "attn_softcap": 2.0})
    save_checkpoint(init_random_weights(build_model(cfg), seed=1), tmp_path / "ckpt")
    bundle = export(tmp_path / "ckpt", tmp_path / "softcap")
    graph = onnx.load(str(variant_path(Bundle(bundle.path), attention=True))).graph
    gqa = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == cfg.n_layers
    assert all(onnx.helper.get_attribute_value(a) == 2.0 for n in gqa for a in n.attribute if a.name == "softcap")
    assert collections.Counter(n.op_type for n in graph.node)["Tanh"] == 0
    rng = np.random.default_rng(6)
    with runtime.load(bundle.path, variant=False) as plain, runtime.load(bundle.path) as fast:
        ids, mask, pos = _left_padded(rng, [8, 5], 259)
        caches = _step((plain, fast), (None, None), ids, mask, pos)
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
        _step((plain, fast), caches, rng.integers(0, 259, (2, 1)), mask, pos[:, -1:] + 1)


def test_half_precision_attention_is_packed(half_bundle):
    """A float16 graph's attention (scores cast to float32 for the softmax, probabilities cast back) is matched
    too; GroupQueryAttention keeps its softmax in float32, so the two differ by half precision's rounding."""
    from tests.runtime.test_ort_fusions import _assert_variant_equals_graph

    half = half_bundle("llama3-micro", "float16")
    ops = collections.Counter(n.op_type for n in onnx.load(str(variant_path(Bundle(half.path), attention=True))).graph.node)
    assert ops["GroupQueryAttention"] == half.model_config["n_layers"] and ops["Softmax"] == 0
    _assert_variant_equals_graph(half.path, packed=True, atol=1e-2)  # float16's step near |logit| ~ 4 is 4e-3
