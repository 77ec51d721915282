"""A session's LoRA adapters: which are loaded, stacked as the graph's LoRA inputs (export/onnx_export.py).

Every loaded adapter sits in one stack per slot, after an all-zero adapter 0 for rows without one, so that a
batch mixes any of them and a step feeds the same arrays until another adapter loads (the ONNX Runtime backend
then binds them once). The stack's rank is the largest loaded adapter's, not the bundle's max rank. Adapters load
from the bundle's adapters/ on first use: one added with `kvforge lora add` while a server runs is served by its
next request that names it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvforge.adapters import IDS, check_name, read_adapter, slot_input_names, stacked
from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError


class AdapterSet:
    """The adapters a session has loaded and their stacked inputs (`arrays`, replaced whole when one loads)."""

    def __init__(self, spec: dict[str, Any], bundle_path: str, dtype: str = "float32"):
        self.spec = spec
        self.bundle_path = bundle_path
        self.dtype = np.float16 if dtype == "float16" else np.float32
        self.names: list[str] = []
        self.slots: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
        self.arrays: dict[str, np.ndarray] = self._stack()

    def _stack(self) -> dict[str, np.ndarray]:
        out = {}
        for slot, (a, b) in stacked(self.spec, [self.slots[n] for n in self.names], self.dtype).items():
            names = slot_input_names(slot)
            out[names[0]], out[names[1]] = a, b
        return out

    def load(self, name: str) -> None:
        """Read adapter `name` from the bundle (checked against its slots) into the stack."""
        if name in self.slots:
            return
        _, slots = read_adapter(Bundle(self.bundle_path), check_name(name))
        self.slots[name] = slots
        self.names.append(name)
        self.arrays = self._stack()

    def unload(self, name: str) -> None:
        if name in self.slots:
            del self.slots[name]
            self.names.remove(name)
            self.arrays = self._stack()

    def feeds(self, adapters: list[str | None] | None, batch: int) -> dict[str, np.ndarray]:
        """The LoRA inputs of a step of `batch` rows, row i taking adapters[i] (None: none)."""
        if adapters is None:
            adapters = [None] * batch
        if len(adapters) != batch:
            raise KvforgeError(f"adapters names {len(adapters)} rows' adapters for a step of {batch} rows")
        for name in adapters:
            if name is not None:
                self.load(name)
        ids = np.asarray([0 if name is None else 1 + self.names.index(name) for name in adapters], np.int64)
        return {IDS: ids, **self.arrays}


def no_slots(adapters: list[str | None] | None, source: str) -> None:
    """A bundle without slots: refuse a step that names an adapter."""
    if adapters is not None and any(a is not None for a in adapters):
        raise KvforgeError(f"{source} has no LoRA slots, so it takes no adapter ({next(a for a in adapters if a)!r}); "
                           "export it with --lora-max-rank R")
