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


def observe(model, activations: list[str], items: Callable[[], Any], n_batches: int, feeds: Callable[[Any], dict],
            smooth_needed: bool, float_dtype, progress: Progress, hessians=None, keep_rows: dict[str, int] | None = None,
            sample_rows: int = 0):
    """Pass 1 over the calibration set: the float graph with the activations exposed as outputs.

    items() iterates the calibration batches, feeds(item) makes a batch's graph inputs. Returns the
    observers (amax recorded), per-channel amax (for SmoothQuant) and the batch runner (item ->
    activations, for pass 2's histograms); fills `hessians` (GPTQ's X^T X) when given. sample_rows: about this
    many rows of each activation, evenly spaced within every batch, are kept in its observer's `sampled`.
    """
    from onnx import TensorProto, helper

    probe = type(model)()
    probe.CopyFrom(model)
    del probe.graph.output[1:]  # keep the first output (logits, a hidden state); drop presents
    elem = TensorProto.FLOAT16 if float_dtype == np.float16 else TensorProto.FLOAT
    for name in activations:  # activations carry the model dtype
        probe.graph.output.append(helper.make_tensor_value_info(name, elem, None))
    sess = make_session(probe.SerializeToString())
    names = [o.name for o in sess.get_outputs()][1:]

    def run(item):
        return dict(zip(names, sess.run(names, feeds(item))))

    observers = {n: TensorObserver(n, keep_rows=(keep_rows or {}).get(n, 0)) for n in activations}
    channel_amax: dict[str, np.ndarray] = {}
    for i, item in enumerate(items()):
        for name, x in run(item).items():
            x = x.astype(np.float32)
            observers[name].observe_range(x)
            if hessians is not None:
                hessians.add(name, x)
            if sample_rows:
                flat = x.reshape(-1, x.shape[-1])
                picks = np.linspace(0, len(flat) - 1, min(len(flat), -(-sample_rows // n_batches))).astype(np.int64)
                observers[name].sampled.append(flat[picks])
            if smooth_needed:
                m = np.abs(x).reshape(-1, x.shape[-1]).max(axis=0)
                channel_amax[name] = np.maximum(channel_amax.get(name, 0), m)
        progress("observe", i + 1, n_batches)
    return observers, channel_amax, run


def activation_scales(model, targets, observers, channel_amax, run, items, n_batches: int, precision: str, method: str,
                      percentile: float, smoothquant: float | None, progress: Progress):
    """Each activation's amax (after SmoothQuant's per-channel division, when asked) by `method`, and the
    SmoothQuant factors (or None). A method other than max takes a second pass for its histograms."""
    import onnx

    activations = list(dict.fromkeys(t.activation for t in targets))
    smooth = None
    if smoothquant is not None:
        smooth = {}
        inits = {i.name: i for i in model.graph.initializer}
        for act in activations:
            weights = [onnx.numpy_helper.to_array(inits[t.weight]) for t in targets if t.activation == act]
            smooth[act] = smoothquant_factors(channel_amax[act], np.concatenate(weights, axis=1), smoothquant)
        # the quantized tensor is x / s: its range is the per-channel amax divided by s
        for act in activations:
            observers[act].amax = float((channel_amax[act] / smooth[act]).max())
    if method != "max":
        for i, item in enumerate(items()):
            for name, x in run(item).items():
                x = x.astype(np.float32)
                observers[name].observe_histogram(x / smooth[name] if smooth and name in smooth else x)
            progress("histogram", i + 1, n_batches)
    return {a: observers[a].compute_amax(method, precision, percentile) for a in activations}, smooth
