"""A decoder step's graph inputs beyond the KV-cache contract, each kind named for what it is.

A graph may take, besides input_ids/attention_mask/position_ids and the cache:
- LoRA slots (runtime/lora.py): each row's adapter mask, `adapter_rows` (B, slots), and the step's adapter set's
  stacked A/B matrices, `adapter_weights` (the same arrays step after step while the set is the same, so a
  backend uploads or binds them once);
- a vision-language decoder's image features (runtime/vision_session.py): `token_rows`, one row per occurrence of
  the `marker` token (the image token) in the step's tokens, taken row by row, left to right, as the graph
  scatters them;
- per-token inputs, `per_token`, whose last axis is the step's tokens (B, ..., T): Qwen2-VL's multimodal RoPE
  offsets.

A backend that feeds the step as given binds `feeds()`. One that computes a step in other calls (the ONNX Runtime
packed cache's reordered or token-by-token calls, TensorRT's token-by-token steps) takes `for_columns(ids, cols)`:
the inputs of a call whose row b holds the step's tokens ids[b, cols[b]], every kind re-selected to match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvforge.adapters import MASK
from kvforge.bundle import FEATURES, OFFSETS
from kvforge.errors import KvforgeError


@dataclass(frozen=True)
class StepInputs:
    adapter_rows: np.ndarray | None = None
    adapter_weights: dict[str, np.ndarray] = field(default_factory=dict)
    token_rows: dict[str, np.ndarray] = field(default_factory=dict)
    marker: int | None = None
    per_token: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, feeds: dict[str, np.ndarray] | None, marker: int | None = None) -> "StepInputs | None":
        """The inputs of a feed dict by graph input name (runtime/lora.py AdapterSet.feeds, a vision session's
        features and offsets); marker: the token id that takes feature rows. None for no inputs."""
        if not feeds:
            return None
        rest = dict(feeds)
        rows, offsets, features = rest.pop(MASK, None), rest.pop(OFFSETS, None), rest.pop(FEATURES, None)
        if features is not None and marker is None:
            raise KvforgeError(f"{FEATURES} was given to a graph that records no image token to take its rows "
                               "(io.extra.vision.image_token_id): this is not a vision-language decoder")
        return cls(rows, rest, {} if features is None else {FEATURES: features}, marker,
                   {} if offsets is None else {OFFSETS: offsets})

    def feeds(self) -> dict[str, np.ndarray]:
        """Every input by graph input name."""
        out = dict(self.adapter_weights)
        if self.adapter_rows is not None:
            out[MASK] = self.adapter_rows
        return {**out, **self.token_rows, **self.per_token}

    def step_feeds(self) -> dict[str, np.ndarray]:
        """The inputs that change from step to step: all but the adapter weights."""
        out = {} if self.adapter_rows is None else {MASK: self.adapter_rows}
        return {**out, **self.token_rows, **self.per_token}

    def for_columns(self, ids: np.ndarray, cols: np.ndarray) -> "StepInputs":
        """The inputs of a call whose row b holds this step's tokens ids[b, cols[b]] (cols: (B, T') indices into the
        step's T tokens, each at most once): per-token inputs gathered along their token axis, and the token rows of
        the marker tokens the call holds, in the order the call reads them."""
        per_token = {n: np.take_along_axis(a, cols.reshape(cols.shape[0], *([1] * (a.ndim - 2)), cols.shape[1]), axis=-1)
                     for n, a in self.per_token.items()}
        token_rows = self.token_rows
        if token_rows:
            marked = ids == self.marker
            index = np.full(ids.shape, -1, np.int64)
            index[marked] = np.arange(int(marked.sum()))  # row-major: the order the step's rows were given in
            given = len(next(iter(token_rows.values())))
            index[index >= given] = -1  # marker tokens beyond the rows given take none (as in the graph)
            taken = np.take_along_axis(index, cols, axis=1)
            taken = taken[taken >= 0]
            token_rows = {n: a[taken] for n, a in token_rows.items()}
        return StepInputs(self.adapter_rows, self.adapter_weights, token_rows, self.marker, per_token)
