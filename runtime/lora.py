"""A session's LoRA adapters: which are loaded, and each step's LoRA inputs (export/onnx_export.py).

A step feeds the adapters its rows take, side by side along their ranks, and a mask that gives each row its own
adapter's columns: each adapter the batch uses is read once per step, and no other. The joined arrays are kept per
set of adapters (a few sets: the batch's changes only when a row with another adapter joins or leaves), so a
decode loop feeds the same arrays step after step (the ONNX Runtime backend then binds them once). Adapters load
from the bundle's adapters/ on first use: one added with `kvforge lora add` while a server runs is served by its
next request that names it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from kvforge.adapters import MASK, check_name, graph_inputs, rank_of, read_adapter, row_mask
from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError

JOINED_SETS = 8  # sets of adapters whose joined inputs are kept


class AdapterSet:
    """The adapters a session has loaded, and the joined inputs of the sets of them that steps used lately."""

    def __init__(self, spec: dict[str, Any], bundle_path: str, dtype: str = "float32"):
        self.spec = spec
        self.bundle_path = bundle_path
        self.dtype = np.float16 if dtype == "float16" else np.float32
        self.slots: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        self._joined: OrderedDict[tuple[str, ...], dict[str, np.ndarray]] = OrderedDict()

    def load(self, name: str) -> None:
        """Read adapter `name` from the bundle (checked against its slots)."""
        if name not in self.slots:
            _, self.slots[name] = read_adapter(Bundle(self.bundle_path), check_name(name))

    def unload(self, name: str) -> None:
        self.slots.pop(name, None)
        for key in [k for k in self._joined if name in k]:
            del self._joined[key]

    def _inputs(self, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        joined = self._joined.get(names)
        if joined is None:
            joined = self._joined[names] = graph_inputs(self.spec, [self.slots[n] for n in names], self.dtype)
            while len(self._joined) > JOINED_SETS:
                self._joined.popitem(last=False)
        self._joined.move_to_end(names)
        return joined

    def feeds(self, adapters: list[str | None] | None, batch: int) -> dict[str, np.ndarray]:
        """The LoRA inputs of a step of `batch` rows, row i taking adapters[i] (None: none)."""
        if adapters is None:
            adapters = [None] * batch
        if len(adapters) != batch:
            raise KvforgeError(f"adapters names {len(adapters)} rows' adapters for a step of {batch} rows")
        names = tuple(dict.fromkeys(a for a in adapters if a is not None))
        for name in names:
            self.load(name)
        mask = row_mask([rank_of(self.slots[n]) for n in names], [None if a is None else names.index(a) for a in adapters],
                        self.dtype)
        return {MASK: mask, **self._inputs(names)}


def no_slots(adapters: list[str | None] | None, source: str) -> None:
    """A bundle without slots: refuse a step that names an adapter."""
    if adapters is not None and any(a is not None for a in adapters):
        raise KvforgeError(f"{source} has no LoRA slots, so it takes no adapter ({next(a for a in adapters if a)!r}); "
                           "export it with --lora-max-rank R")
