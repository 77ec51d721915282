"""A session's LoRA adapters: which are loaded, and each step's LoRA inputs (export/onnx_export.py).

A step feeds the adapters its rows take, side by side along their ranks, and a mask that gives each row its own
adapter's columns: each adapter the batch uses is read once per step, and no other. The joined arrays are kept per
set of adapters (a few sets: the batch's changes only when a row with another adapter joins or leaves), so a
decode loop feeds the same arrays step after step (the ONNX Runtime backend then binds them once). Adapters load
from the bundle's adapters/ on first use: one added with `kvforge lora add` while a server runs is served by its
next request that names it. A request naming an adapter checks the bundle's copy again (a stat of its record): one
replaced with `lora add --force` is read again, then serves every row that names it (rows already decoding
included); one removed is refused to new requests, while rows already decoding with it finish with it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from kvforge.adapters import MASK, RECORD, adapter_dir, check_name, graph_inputs, rank_of, read_adapter, row_mask
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
        self.versions: dict[str, str | None] = {}  # name -> the sha256 of the weights loaded under it
        self._seen: dict[str, tuple[int, int, int]] = {}  # name -> its record file's (inode, mtime, size) when read
        self._joined: OrderedDict[tuple[str, ...], dict[str, np.ndarray]] = OrderedDict()

    def load(self, name: str) -> None:
        """Make adapter `name` the bundle's copy now (checked against its slots): read it if it is not loaded or
        the bundle's copy was replaced since; refuse it if the bundle no longer has it."""
        bundle = Bundle(self.bundle_path)
        try:
            st = (adapter_dir(bundle, check_name(name)) / RECORD).stat()
            seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            seen = None  # gone: read_adapter names what the bundle has
        if seen is not None and self._seen.get(name) == seen and name in self.slots:
            return
        info, slots = read_adapter(bundle, name)
        self.unload(name)
        self.slots[name], self.versions[name], self._seen[name] = slots, info.sha256, seen

    def unload(self, name: str) -> None:
        self.slots.pop(name, None)
        self.versions.pop(name, None)
        self._seen.pop(name, None)
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
        names = tuple(sorted({a for a in adapters if a is not None}))  # a set's joined inputs, in any row order
        for name in names:
            if name not in self.slots:  # loaded ones are not checked again each step (load_adapter does, per request)
                self.load(name)
        mask = row_mask([rank_of(self.slots[n]) for n in names], [None if a is None else names.index(a) for a in adapters],
                        self.dtype)
        return {MASK: mask, **self._inputs(names)}


def no_slots(adapters: list[str | None] | None, source: str) -> None:
    """A bundle without slots: refuse a step that names an adapter."""
    if adapters is not None and any(a is not None for a in adapters):
        raise KvforgeError(f"{source} has no LoRA slots, so it takes no adapter ({next(a for a in adapters if a)!r}); "
                           "export it with --lora-max-rank R")
