"""The calibration passes over data: observe the float graph's activations, then turn them into scales.

Shared by the decoder and encoder path (api.py) and the encoder-decoder path (seq2seq.py).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kvforge.ort_session import make_session

from .observers import TensorObserver
from .qdq import smoothquant_factors

Progress = Callable[[str, int, int], None]  # (phase, done, total)


RUN_BYTES = 1 << 30  # the exposed activations of one graph run at most (a batch is run in parts beyond it)


class Probe:
    """The float graph with activations exposed as its outputs, run on ONNX Runtime part by part of a batch.

    Only what the activations need is kept of the graph (the vocabulary projection and the cache outputs go
    unless asked for). The weights stay in the bundle's data file (base_dir), which ONNX Runtime maps; the
    session is made when first run and dropped by release(), so that the weights are not held while later
    stages run (a graph loaded with its weights gets its session at once, kept: its bytes would be a copy). A
    batch whose activations would pass RUN_BYTES (max_rows batch rows per run) is run in parts, each part's
    activations given out before the next is computed."""

    def __init__(self, model, activations: list[str], float_dtype, feeds: Callable[[Any], dict], base_dir: str = "",
                 max_rows: int | None = None):
        from onnx import TensorProto, helper

        from kvforge.onnx_graph import drop_dead_nodes

        probe = type(model)()
        probe.CopyFrom(model)
        del probe.graph.output[:]
        elem = TensorProto.FLOAT16 if float_dtype == np.float16 else TensorProto.FLOAT
        for name in activations:  # activations carry the model dtype
            probe.graph.output.append(helper.make_tensor_value_info(name, elem, None))
        drop_dead_nodes(probe)
        self.names, self.feeds, self.base_dir, self.max_rows = list(activations), feeds, base_dir, max_rows
        self.half = float_dtype == np.float16
        self.graph: bytes | None = probe.SerializeToString()
        del probe
        self._session = None
        if not base_dir:  # a graph holding its weights is as large as they are: its session is made now and kept
            self._session = make_session(self.graph, half_weights=self.half)
            self.graph = None

    def parts(self, item, max_rows: int | None = None) -> list[dict[str, np.ndarray]]:
        """The item's feeds, split along the batch axis into runs of at most max_rows rows (the probe's own
        bound where not given). Only a probe given a bound splits: its feeds are a prefill's, batch first."""
        feeds = self.feeds(item)
        if not self.max_rows:
            return [feeds]
        rows = next(iter(feeds.values())).shape[0]
        limit = min(max_rows or self.max_rows, self.max_rows)
        if rows <= limit:
            return [feeds]
        return [{k: (v[i:i + limit] if v.ndim and v.shape[0] == rows else v) for k, v in feeds.items()}
                for i in range(0, rows, limit)]

    def run_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._session is None:
            self._session = make_session(self.graph, external_dir=self.base_dir or None, half_weights=self.half)
        return dict(zip(self.names, self._session.run(self.names, feeds)))

    def runs(self, item, max_rows: int | None = None):
        """Each part of the item's activations in turn (name -> array). A pass whose statistics do not depend on
        the batching (histograms, GPTQ's sums) runs one row at a time: its activations are the batch's / rows."""
        for feeds in self.parts(item, max_rows):
            yield self.run_feeds(feeds)

    def release(self) -> None:
        """Drop the session (and the weights it maps) until the next run; a probe of a graph that holds its
        weights keeps it."""
        if self.graph is not None:
            self._session = None


def rows_per_run(model, activations: list[str], seq_len: int, itemsize: int) -> int:
    """Batch rows per probe run so that its exposed activations stay within RUN_BYTES: each activation's width
    from the weight its MatMul reads ([K, N]: K), or from its declared shape's fixed sizes (a cache: heads x
    head size); one unknown counts as the widest known."""
    inits = {i.name: i for i in model.graph.initializer}
    wanted, widths = set(activations), {}
    for node in model.graph.node:
        if node.op_type == "MatMul" and node.input[0] in wanted and node.input[1] in inits \
                and len(inits[node.input[1]].dims) == 2:
            widths[node.input[0]] = int(inits[node.input[1]].dims[0])
    declared = {v.name: v for v in (*model.graph.value_info, *model.graph.output)}
    for name in activations:
        if name not in widths and name in declared:
            fixed = [d.dim_value for d in declared[name].type.tensor_type.shape.dim if d.dim_value]
            if fixed:
                widths[name] = int(np.prod(fixed))
    widest = max(widths.values(), default=1)
    per_row = seq_len * itemsize * sum(widths.get(n, widest) for n in activations)
    return max(1, RUN_BYTES // max(per_row, 1))


def observe(model, activations: list[str], items: Callable[[], Any], n_batches: int, feeds: Callable[[Any], dict],
            smooth_needed: bool, float_dtype, progress: Progress, hessians=None, keep_rows: dict[str, int] | None = None,
            sample_rows: int = 0, base_dir: str = "", max_rows: int | None = None):
    """Pass 1 over the calibration set: the float graph with the activations exposed as outputs (a Probe).

    items() iterates the calibration batches, feeds(item) makes a batch's graph inputs. Returns the
    observers (amax recorded), per-channel amax (for SmoothQuant) and the Probe (for pass 2's histograms); fills
    `hessians` (GPTQ's X^T X) when given. sample_rows: about this many rows of each activation, evenly spaced
    within every run, are kept in its observer's `sampled`. base_dir: where the graph's external data lies (a
    graph loaded without it); max_rows: batch rows per run (Probe).
    """
    probe = Probe(model, activations, float_dtype, feeds, base_dir, max_rows)
    observers = {n: TensorObserver(n, keep_rows=(keep_rows or {}).get(n, 0)) for n in activations}
    channel_amax: dict[str, np.ndarray] = {}
    for i, item in enumerate(items()):
        parts = probe.parts(item)
        for part in parts:
            for name, x in probe.run_feeds(part).items():
                x = x.astype(np.float32)
                observers[name].observe_range(x)
                if hessians is not None:
                    hessians.add(name, x)
                if sample_rows:
                    flat = x.reshape(-1, x.shape[-1])
                    count = min(len(flat), -(-sample_rows // (n_batches * len(parts))))
                    picks = np.linspace(0, len(flat) - 1, count).astype(np.int64)
                    observers[name].sampled.append(flat[picks])
                if smooth_needed:
                    m = np.abs(x).reshape(-1, x.shape[-1]).max(axis=0)
                    channel_amax[name] = np.maximum(channel_amax.get(name, 0), m)
        progress("observe", i + 1, n_batches)
    return observers, channel_amax, probe


def activation_scales(model, targets, observers, channel_amax, probe: Probe | None, items, n_batches: int,
                      precision: str, method: str, percentile: float, smoothquant: float | None, progress: Progress,
                      base_dir: str = ""):
    """Each activation's amax (after SmoothQuant's per-channel division, when asked) by `method`, and the
    SmoothQuant factors (or None). A method other than max takes a second pass (the Probe's) for its histograms."""
    import onnx

    activations = list(dict.fromkeys(t.activation for t in targets))
    smooth = None
    if smoothquant is not None:
        smooth = {}
        inits = {i.name: i for i in model.graph.initializer}
        for act in activations:
            weights = [onnx.numpy_helper.to_array(inits[t.weight], base_dir) for t in targets if t.activation == act]
            smooth[act] = smoothquant_factors(channel_amax[act], np.concatenate(weights, axis=1), smoothquant)
        # the quantized tensor is x / s: its range is the per-channel amax divided by s
        for act in activations:
            observers[act].amax = float((channel_amax[act] / smooth[act]).max())
    if method != "max":
        for i, item in enumerate(items()):
            for part in probe.runs(item, max_rows=1):
                for name, x in part.items():
                    x = x.astype(np.float32)
                    observers[name].observe_histogram(x / smooth[name] if smooth and name in smooth else x)
            progress("histogram", i + 1, n_batches)
    return {a: observers[a].compute_amax(method, precision, percentile) for a in activations}, smooth
