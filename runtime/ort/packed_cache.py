"""The packed cache of the ONNX Runtime backend's GroupQueryAttention variant (see attention.py).

The session's IO contract lays a cache out as its attention mask does: a
left-padded batch's rows hold padding columns, and each step's `present`
is the past with the new positions concatenated. GroupQueryAttention instead
reads one preallocated buffer per cache tensor, (batch, kv_heads, capacity,
head_dim), shared between past and present, with each row's real positions
packed from index 0 and the row's own length. A step writes only its new
positions; nothing is concatenated or copied.

This module turns a step of the session's contract (ids, a left-padded
attention mask, position ids) into the kernel's feeds, and packed caches
back into the contract's layout. Rules:

- every mask row must be zeros then ones (left padding), and its past
  columns must hold as many ones as the cache holds positions for the row;
  that is what generate(), the batcher and compare() pass. A mask with holes
  is refused (the bundle's attention, `attention='graph'`, takes any mask);
- a prefill from an empty cache runs as one prompt, each row's real tokens
  moved to the front (right padding, which the kernel masks by length);
- a decode step (one token per row) runs as one step;
- a multi-token step over a non-empty cache runs as one step at batch 1 and
  token by token otherwise (the kernel takes several new tokens over a past
  only at batch 1);
- logits at padding positions are not computed (they are unspecified in the
  contract too: the mask hides those positions from everything).

Caches are values: a step writes only past every row's length, so the cache
it started from still reads the same. Continuing a cache that another step
has already continued (a branch) copies the buffers first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvforge.errors import KvforgeError


@dataclass
class Store:
    """The buffers, shared by the caches of one line of steps; `version` counts the writes."""

    arrays: list[np.ndarray]
    version: int = 0
    bindings: dict = field(default_factory=dict)  # per session that ran these arrays: its Binding of them


@dataclass
class Binding:
    """A session's IO binding of a store's arrays as past and present, made once per arrays: a step then rebinds
    only its small inputs."""

    binding: object
    arrays: list  # the arrays `binding` binds
    weights: dict | None = None  # the LoRA adapter weights `binding` binds (runtime/step_inputs.py), by identity


@dataclass
class Packed:
    """KVCache.layout of a packed cache: each row's real length, and the store's version it reads."""

    lengths: np.ndarray  # (B,) int64
    store: Store
    version: int = 0


@dataclass
class Step:
    """One kernel call: right-aligned ids and positions, the rows' lengths after it, and which logits to compute."""

    ids: np.ndarray
    positions: np.ndarray
    seqlens_k: np.ndarray  # int32 (B,): length after the step - 1
    total: np.ndarray  # int32 [1]: also the positions the buffers must hold (the kernel writes up to it)
    logits_rows: np.ndarray  # int64 (B, K) flat rows of (B * T)
    lengths: np.ndarray  # int64 (B,) real positions held after the step
    cols: np.ndarray  # int64 (B, T'): which of the caller's T tokens each of ids' columns is
    logits_at: list[int] = field(default_factory=list)  # output positions (of the caller's T) these logits fill


def new_tokens(mask: np.ndarray, lengths: np.ndarray, past: int) -> np.ndarray:
    """How many of each row's new tokens are real; refuses a mask the packed layout cannot follow."""
    ones = mask.sum(axis=1)
    width = mask.shape[1]
    left_padded = mask == (np.arange(width)[None, :] >= (width - ones)[:, None])
    if not left_padded.all():
        row = int(np.flatnonzero(~left_padded.all(axis=1))[0])
        raise KvforgeError(
            f"attention_mask row {row} is not left-padded (zeros, then ones); the ONNX Runtime backend's packed cache "
            "follows left-padded batches only. Load the session with attention='graph' to run the bundle's attention, "
            "which takes any mask")
    held = mask[:, :past].sum(axis=1)
    if (held != lengths).any():
        row = int(np.flatnonzero(held != lengths)[0])
        raise KvforgeError(f"attention_mask row {row} marks {int(held[row])} of its past {past} columns real, but the cache "
                           f"holds {int(lengths[row])} positions for it: the mask does not belong to this cache")
    return ones - held


def plan(ids: np.ndarray, positions: np.ndarray, mask: np.ndarray, lengths: np.ndarray, past: int,
         last_only: bool) -> list[Step]:
    """The kernel calls that compute one step of the session's contract over a packed cache."""
    B, T = ids.shape
    new = new_tokens(mask, lengths, past)
    if not lengths.any() or T == 1:
        return [_one_call(ids, positions, lengths, new, T, last_only, first=not lengths.any())]
    if B == 1:  # several tokens over a past: the kernel's subsequent prompt, batch 1 only
        return [_one_call(ids, positions, lengths, new, T, last_only, first=False)]
    steps, held = [], lengths
    for t in range(T):
        real = (new >= T - t).astype(np.int64)  # left-padded: a row's real tokens are its last `new`
        keep = not last_only or t == T - 1
        step = _one_call(ids[:, t:t + 1], positions[:, t:t + 1], held, real, 1, not keep, first=False)
        step.logits_at = [t] if keep else []
        step.cols = np.full((B, 1), t, np.int64)
        steps.append(step)
        held = step.lengths
    return steps


def _one_call(ids, positions, lengths, new, T, last_only, first: bool) -> Step:
    B = ids.shape[0]
    if T == 1 and not first:  # a decode step: nothing to move
        written = lengths + 1
        return Step(ids, positions, lengths.astype(np.int32), np.array([written.max()], np.int32),
                    np.arange(B, dtype=np.int64)[:, None], lengths + new, np.zeros((B, 1), np.int64), [0])
    # each row's real new tokens first (right padding): the kernel masks what lies past a row's length
    shift = T - new
    cols = (np.arange(T)[None, :] + shift[:, None]) % T
    ids_r = np.take_along_axis(ids, cols, axis=1)
    pos_r = np.take_along_axis(positions, cols, axis=1)
    after = lengths + new
    # the kernel writes all T positions of a row from its past length on; a row whose new tokens are all
    # padding still gets one written (and not counted)
    written = lengths + T
    seqlens = (written - 1) if not first else np.maximum(new, 1) - 1
    total = T if first else int(written.max())
    base = np.arange(B)[:, None] * T
    if last_only:
        rows = base + np.maximum(new - 1, 0)[:, None]
        at = [T - 1]
    else:
        rows = base + (np.arange(T)[None, :] - shift[:, None]) % T  # output position i of a row reads right-aligned i - shift
        at = list(range(T))
    return Step(ids_r, pos_r, seqlens.astype(np.int32), np.array([total], np.int32), rows.astype(np.int64),
                after.astype(np.int64), cols.astype(np.int64), at)


def unpack(array: np.ndarray, lengths: np.ndarray, length: int) -> np.ndarray:
    """One packed buffer in the contract's layout: (B, KV, length, D), each row's positions aligned right, zeros
    in padding columns."""
    out = np.zeros((*array.shape[:2], length, *array.shape[3:]), array.dtype)
    for b, n in enumerate(lengths.tolist()):
        n = min(n, length)
        if n:
            out[b, :, length - n:] = array[b, :, :n]
    return out


def grown(arrays: list[np.ndarray], capacity: int, limit: int, step: int = 256) -> list[np.ndarray]:
    """The buffers with room for `capacity` positions, the old contents kept: rounded up to `step` positions (a
    prefill leaves room for the tokens it is followed by) and at least doubled, but never past `limit`."""
    have = arrays[0].shape[2]
    if capacity <= have:
        return arrays
    size = max(capacity, min(max(-(-capacity // step) * step, 2 * have), limit))
    out = []
    for a in arrays:
        b = np.zeros((*a.shape[:2], size, *a.shape[3:]), a.dtype)
        b[:, :, :have] = a
        out.append(b)
    return out


def regroup(parts: list[tuple[object, list[int]]], length: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Rows of several packed caches as one store: buffers and lengths (at most `length` each).

    Only each row's held positions are copied, into buffers made by np.zeros (calloc: pages nobody writes cost
    neither a fill nor memory): a short row joining a batch whose capacity a long row set copies its own length,
    not the capacity (a 4,096-token row joining 8 rows of 300 on SmolLM2 copied 1.7 GB twice, 2.3 s, before)."""
    capacity = max(c.values[0].shape[2] for c, _ in parts)
    held = [np.minimum(np.asarray(c.layout.lengths)[keep], length) for c, keep in parts]
    rows = sum(len(keep) for _, keep in parts)
    arrays = []
    for j in range(len(parts[0][0].values)):
        like = parts[0][0].values[j]
        out = np.zeros((rows, like.shape[1], capacity, *like.shape[3:]), like.dtype)
        i = 0
        for (cache, keep), lengths in zip(parts, held):
            src = cache.values[j]
            for r, n in zip(keep, lengths.tolist()):
                if n:
                    out[i, :, :n] = src[r, :, :n]
                i += 1
        arrays.append(out)
    return arrays, np.concatenate(held) if held else np.zeros(0, np.int64)
