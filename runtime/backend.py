"""The backend base class: public activate/forward/deactivate wrap `*_impl` hooks.

A backend runs one forward step of the KV-cache graph. It owns its cache
storage (ONNX Runtime OrtValues, Torch tensors, device buffers), so a cache
moves from one step to the next without a trip through numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvforge.errors import KvforgeError

from .step_inputs import StepInputs


@dataclass
class KVCache:
    """An opaque per-sequence-batch cache: backend-native tensors in IO-spec order.

    `values` holds, for each layer, the tensors named by `io.kv_cache.past`
    (key, value), flattened; `length` is the past length they cover.
    """

    backend: str
    batch: int
    length: int
    values: list[Any]
    owner: str | None = None  # the model (its graph's hash) whose session made it
    layout: Any = None  # backend-private state of a cache not laid out as the mask (ONNX Runtime's packed rows)


class Runner:
    """What every backend shares, whatever it runs: its name, the options it takes (a misspelt one is refused, not
    ignored), and a lifecycle (public activate/deactivate around `*_impl` hooks). `Backend` below runs a decoder's
    KV-cache step; the encoder and encoder-decoder backends (runtime/graph_backends.py) run their graphs."""

    name = "base"
    option_names: tuple[str, ...] = ()  # what load(..., **options) may pass this backend (for the error message)

    def __init__(self, **options):
        if options:  # a misspelt option must not be ignored silently
            known = ", ".join(self.option_names) or "none"
            raise KvforgeError(f"unknown {self.name} backend option(s) {sorted(options)}; it takes: {known}")
        self.active = False

    @property
    def settings(self) -> dict:
        """The options this backend runs with, by name (those that change its speed or its results): what
        `kvforge bench` and the benchmarks record beside their figures. Empty where a backend names none."""
        return {}

    # -- lifecycle -------------------------------------------------------------
    def activate(self) -> None:
        if not self.active:
            self.activate_impl()
            self.active = True

    def deactivate(self) -> None:
        if self.active:
            self.deactivate_impl()
            self.active = False

    def check_active(self) -> None:
        if not self.active:
            raise KvforgeError(f"the {self.name} backend is not active; use the Session as a context manager or call activate()")

    def activate_impl(self) -> None:
        raise NotImplementedError

    def deactivate_impl(self) -> None:
        pass


class SessionLifecycle:
    """What every session does with its backend (`self.backend`, a Runner): a context manager that activates it
    on enter (and on first use) and releases it on exit; `self._lock` serializes the session's calls."""

    backend: Runner

    def activate(self):
        with self._lock:
            self.backend.activate()
        return self

    def deactivate(self) -> None:
        with self._lock:
            self.backend.deactivate()

    def __enter__(self):
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()


def torch_source(bundle, source: str | None = None, float_reference: bool = False) -> str:
    """The model source the torch backend rebuilds a bundle from: `source`, else the one the bundle's lineage records.
    A quantized bundle is refused (the torch model is its float origin) unless float_reference asks for exactly that
    (what `kvforge compare` measures against)."""
    quant = bundle.quantization_format
    if quant and not float_reference:
        raise KvforgeError(
            f"{bundle.path} is quantized ({quant}); the torch backend would run the float model it was made from, not "
            "this bundle. Run it on onnxruntime (or tensorrt); `kvforge compare` measures it against that float reference")
    source = source or bundle.recorded_source
    if source is None:
        raise KvforgeError(f"{bundle.path} records no source model; pass source=... for the torch backend")
    return source


class Backend(Runner):
    """One interface over the runtimes for a decoder's KV-cache step; subclasses implement the `_impl` hooks."""

    def __init__(self, config: dict[str, Any], io, **options):
        super().__init__(**options)
        self.config = config
        self.io = io

    # -- inference -------------------------------------------------------------
    def forward(
        self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, cache: KVCache,
        last_only: bool = False, inputs: StepInputs | None = None,
    ) -> tuple[np.ndarray, KVCache]:
        """One step: float32 logits (B, T, V), or (B, 1, V) with last_only, and the cache extended by T. inputs: the
        graph's inputs beyond the KV-cache contract, each kind by what it is (runtime/step_inputs.py: LoRA adapter
        rows and weights, a vision-language decoder's image feature rows and per-token RoPE offsets)."""
        self.check_active()
        if cache.backend != self.name:
            raise KvforgeError(f"this cache belongs to the {cache.backend} backend, not {self.name}")
        return self.forward_impl(input_ids, attention_mask, position_ids, cache, last_only, inputs)

    def prepare_mixed(self) -> bool:
        """Make forward_mixed's one-call form ready where the backend has one (it is used once made ready); whether
        it has."""
        return False

    def forward_mixed(self, decode: tuple, prompt: tuple, last_only: bool = False, inputs: tuple = (None, None)
                      ) -> tuple[tuple, tuple]:
        """A mixed step: `decode` and `prompt` are each (input_ids, attention_mask, position_ids, cache) of a
        forward(), the first one token for each of its rows, the second one row's prompt tokens (a chunk);
        returns each part's (logits, cache), as their two forward() calls would. A backend that can computes
        both in one call (every weight read once); this one makes the two calls. inputs: each part's StepInputs."""
        return (self.forward(*decode, last_only, inputs[0]), self.forward(*prompt, last_only, inputs[1]))

    def empty_cache(self, batch: int) -> KVCache:
        return KVCache(self.name, batch, 0, self.empty_cache_impl(batch))

    def drop_oldest(self, cache: KVCache, n: int) -> KVCache:
        """The cache without its first n positions (columns that are padding for every row still generating).

        A capped (windowed) layer holds only the newest min(length, W) positions: it loses only as many
        as fall out of that (often none).
        """
        tensors = len(cache.values)
        drops = [h - k for h, k in zip(self.tensor_lengths(cache.length, tensors),
                                       self.tensor_lengths(cache.length - n, tensors))]
        return KVCache(self.name, cache.batch, cache.length - n, self.drop_oldest_impl(cache.values, drops), cache.owner)

    def regroup(self, parts: list[tuple[KVCache, list[int]]], length: int) -> KVCache:
        """One cache from rows of several: each part's listed rows, every one aligned right at `length` positions.

        A part shorter than `length` is padded on the left with zeros (positions its rows' attention masks hide);
        one longer loses its oldest positions, which must be padding for every row kept. A capped (windowed)
        layer holds min(length, W) positions, as a cache of that length would. What continuous batching uses to
        join newly prefilled requests to the running batch and to let finished ones go.
        """
        merged = []
        for j, target in enumerate(self.tensor_lengths(length, len(parts[0][0].values))):
            rows = []
            for cache, keep in parts:
                a = self.to_numpy(cache.values[j])[keep]
                have = a.shape[2]
                if have >= target:
                    a = a[:, :, have - target:]
                else:
                    a = np.concatenate([np.zeros((*a.shape[:2], target - have, *a.shape[3:]), a.dtype), a], axis=2)
                rows.append(a)
            merged.append(np.ascontiguousarray(np.concatenate(rows, axis=0)))
        batch = sum(len(keep) for _, keep in parts)
        return KVCache(self.name, batch, length, self.from_numpy_impl(merged), parts[0][0].owner)

    def rollback(self, before: KVCache, after: KVCache, length: int) -> KVCache:
        """`after`, a continuation of `before` by one step, cut back to its first `length` positions
        (before.length <= length <= after.length), every row the same: what speculative decoding keeps of a
        verification step once it knows how many drafted tokens were accepted. An uncapped layer is a slice of
        `after`. A capped (windowed) layer holds only its newest W positions, so the step may have pushed out
        positions the cut cache holds again: those come back from `before`, followed by `after`'s new ones.
        Raises NotImplementedError where neither holds them (a step of more new positions than the window): the
        caller then feeds the kept tokens over `before` again (runtime/speculative.py)."""
        if length == after.length:
            return after
        held_b, held_a, held = (self.io.cache_lengths(n) for n in (before.length, after.length, length))
        per_layer = len(after.values) // len(held)
        values = []
        for j, (b, a) in enumerate(zip(before.values, after.values)):
            layer = j // per_layer
            lo, a_lo, b_lo = length - held[layer], after.length - held_a[layer], before.length - held_b[layer]
            if lo >= a_lo:  # after still holds every position kept
                values.append(self.slice_impl(a, lo - a_lo, length - a_lo))
            elif lo >= b_lo and before.length >= a_lo:  # the oldest ones from before, the new ones from after
                values.append(self.join_impl(self.slice_impl(b, lo - b_lo, held_b[layer]),
                                             self.slice_impl(a, before.length - a_lo, length - a_lo)))
            else:
                raise NotImplementedError(f"layer {layer}'s window lost positions {lo}..{a_lo} that no cache holds")
        return KVCache(self.name, after.batch, length, values, after.owner)

    def vacate(self, cache: KVCache, rows: list[int]) -> KVCache:
        """The cache with these rows emptied: they hold no position (their attention-mask rows must be all zeros
        from now on) and keep their place, for place() to fill. Nothing moves: the masks hide a row's positions
        here; a packed cache sets the rows' lengths to 0 (ort_backend.py). The cache given is consumed: continue
        the one returned."""
        return cache

    def place(self, cache: KVCache, rows: list[int], part: KVCache) -> KVCache:
        """The cache with part's rows (all of them, in order) in these rows of it, which must be empty (vacate()),
        every row aligned right at max(cache.length, part.length). Here a regroup (a copy of every row); a packed
        cache copies only part's own positions into the rows' buffers. The cache given is consumed."""
        length = max(cache.length, part.length)
        merged = self.regroup([(cache, list(range(cache.batch))), (part, list(range(part.batch)))], length)
        order = list(range(cache.batch))
        for i, r in enumerate(rows):
            order[r] = cache.batch + i
        return self.regroup([(merged, order)], length)

    def cache_arrays(self, cache: KVCache) -> list[np.ndarray]:
        """The cache as numpy arrays (for inspection and tests; copies)."""
        return [self.to_numpy(v) for v in cache.values]

    def from_arrays(self, arrays: list[np.ndarray], length: int) -> KVCache:
        """A cache of `length` positions, every row real (no padding), from numpy arrays in the contract's layout
        (what cache_arrays gives): (batch, kv_heads, positions, head_dim) per tensor, at least as many positions
        as the layer holds (a capped layer keeps the newest min(length, W)). What the batcher's prefix cache
        restores a cached prefix with."""
        values = [np.ascontiguousarray(a[:, :, a.shape[2] - n:])
                  for a, n in zip(arrays, self.tensor_lengths(length, len(arrays)))]
        return KVCache(self.name, arrays[0].shape[0], length, self.from_numpy_impl(values))

    def tensor_lengths(self, length: int, tensors: int) -> list[int]:
        """The positions each of a cache's `tensors` tensors holds at `length` (io.cache_lengths per layer: a capped
        layer's newest min(length, W)), in the order of the cache's values."""
        held = self.io.cache_lengths(length)
        return [held[j // (tensors // len(held))] for j in range(tensors)]

    def merge_lora(self, slots: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """Add an adapter's deltas to the model's weights (a reference with the adapter merged): the Torch
        backend's; a graph's weights are the bundle's."""
        raise KvforgeError(f"the {self.name} backend runs the bundle's weights; an adapter is merged into the Torch "
                           "reference only")

    # -- hooks -----------------------------------------------------------------
    def forward_impl(self, input_ids, attention_mask, position_ids, cache, last_only, inputs: StepInputs | None = None
                     ) -> tuple[np.ndarray, KVCache]:
        raise NotImplementedError

    def empty_cache_impl(self, batch: int) -> list[Any]:
        raise NotImplementedError

    def drop_oldest_impl(self, values: list[Any], drops: list[int]) -> list[Any]:
        """Each cache tensor without its first drops[j] positions."""
        raise NotImplementedError  # a backend without it ends a batch at the batch's width (generate.py)

    def slice_impl(self, value, start: int, stop: int):
        """A cache tensor's positions start..stop (axis 2), as this backend's tensor (here through numpy)."""
        return self.from_numpy_impl([np.ascontiguousarray(self.to_numpy(value)[:, :, start:stop])])[0]

    def join_impl(self, first, second):
        """Two cache tensors' positions, one after the other (axis 2), as this backend's tensor."""
        return self.from_numpy_impl([np.concatenate([self.to_numpy(first), self.to_numpy(second)], axis=2)])[0]

    def to_numpy(self, value) -> np.ndarray:
        raise NotImplementedError

    def from_numpy_impl(self, arrays: list[np.ndarray]) -> list[Any]:
        """Cache tensors (this backend's own) holding these arrays."""
        raise NotImplementedError
