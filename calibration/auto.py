"""The default recipe: what `kvforge calibrate --precision P` does when no tuning option is given.

A real checkpoint's activations carry outlier channels (SmolLM2's layer-28 FFN input reaches 2386 where its
bulk is under 10), and one per-tensor INT8 scale stretched over them rounds everything else to zero: the
fixed defaults (max, no smoothing) cost SmolLM2 +131% perplexity. The recipe is therefore chosen by
measurement on the calibration data, in three steps:

1. Per activation (W8A8: int8, fp8). Each quantized activation (the input q/k/v share, the one gate/up share,
   ...) gets the SmoothQuant alpha (none, or one of ALPHAS) and the clipping of its per-tensor range (CLIPS, a
   fraction of the observed max after smoothing) that together minimize its layers' relative output error
   ||Q(X / s) Q(diag(s) W) - X W||^2 / ||X W||^2 on SAMPLE_ROWS calibration rows drawn from every batch, the
   weights rounded per output channel as the graph will store them. Both choices are plain Q/DQ (a Mul by
   1/s before the QuantizeLinear, a scale): ONNX Runtime and TensorRT run them as any other.
2. Whole graph (every precision). The quantized graph is measured against the float graph on held-out windows
   of the calibration text (windows no calibration sample covers; never the evaluation text). W8A8 measures
   step 1's choices searched over three spaces (smoothing and clipping, clipping alone, and the fixed recipe's
   max without smoothing: local error does not always rank what perplexity feels) and keeps the best. INT4 tries
   blocks 128, 64 and 32 rounded to nearest, then 128 and 32 with GPTQ, and keeps the first that is within the
   target (else the best): larger blocks are smaller and as fast.
3. While perplexity misses the target, the linear layers with the largest local error (W8A8) are kept in
   float, 1, 2, 4, ... of them, within FLOAT_BUDGET of the quantized weights.

Everything tried, measured and chosen is recorded in the manifest (`calibration.recipe`), and the search stops
trying new candidates once `time_bound` seconds have passed (what was measured by then decides).
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Callable

import numpy as np

from kvforge.errors import KvforgeError

from .budget import BUDGET_METRICS, HeldOutEvaluator, budget_window
from .qdq import QMAX, dequantize, quantize, smoothquant_factors, stored_scale, weight_scales

ALPHAS = (None, 0.5, 0.65, 0.8)  # None: no smoothing
CLIPS = (1.0, 0.8, 0.6, 0.45, 0.3, 0.2)  # of the activation's observed max (after smoothing)
# step 2's W8A8 candidates: each activation's choice searched over these (alphas, clips); the last is the fixed
# recipe's (max, no smoothing), so the automatic recipe is never worse than it on the held-out text
SPACES = {"smoothed and clipped": (ALPHAS, CLIPS), "clipped": ((None,), CLIPS), "max": ((None,), (1.0,))}
SAMPLE_ROWS = 512  # calibration rows per activation for the local search
TARGET_PPL_PCT = {"int8": 1.0, "fp8": 1.0, "int4": 4.0}  # perplexity change on the held-out calibration windows
FLOAT_BUDGET = 0.10  # at most this fraction of the quantized weights' elements kept in float
# (block size, GPTQ): the largest block first, rounded to nearest; GPTQ where nearest falls short (on SmolLM2,
# whose float weights were dequantized from 4-bit blocks of 32, GPTQ measured worse than nearest at every size)
INT4_CANDIDATES = ((128, False), (64, False), (32, False), (128, True), (32, True))
TIME_BOUND_S = 900.0
HOLD_OUT_TOKENS = 2048  # calibration text kept out of the samples, for step 2 and 3's measurements


def choose_activations(targets, weights: dict[str, np.ndarray], observers, channel_amax: dict[str, np.ndarray],
                       fmt: str, float_dtype, progress, plain=frozenset(), alphas=ALPHAS,
                       clips=CLIPS) -> tuple[dict, dict, dict]:
    """Step 1 over one space of choices: (activation -> amax, activation -> smoothing factors, activation -> its
    choice and errors); choose_in_spaces's arguments."""
    return choose_in_spaces(targets, weights, observers, channel_amax, fmt, float_dtype, progress, plain,
                            {"": (alphas, clips)})[""]


def choose_in_spaces(targets, weights: dict[str, np.ndarray], observers, channel_amax: dict[str, np.ndarray],
                     fmt: str, float_dtype, progress, plain=frozenset(), spaces=SPACES) -> dict[str, tuple]:
    """Step 1: per space of choices (name -> (alphas, clips)), (activation -> amax, activation -> smoothing
    factors, activation -> its choice and errors).

    weights: initializer name -> [K, N] float32 (a mapping that may read each when asked); observers: pass 1's,
    with rows sampled (passes.observe); plain: activations that are clipped but never smoothed. Each activation's
    weights are read and each (alpha, clip) measured once for all the spaces; a space takes the first smallest
    error in its own order."""
    by_act: dict[str, list] = {}
    for t in targets:
        by_act.setdefault(t.activation, []).append(t)
    results = {space: ({}, {}, {}) for space in spaces}
    for i, (act, ts) in enumerate(by_act.items()):
        if not observers[act].sampled:  # no calibration row reached it (a starved expert): its max, as observed
            for amax, _, chosen in results.values():
                amax[act] = observers[act].amax or 1e-8
                chosen[act] = {"layers": [t.layer for t in ts], "smoothquant_alpha": None, "clip": 1.0,
                               "output_error": None, "layer_errors": {}}
            continue
        parts = [weights[t.weight] for t in ts]  # each read once (weights may read them from disk)
        widths = [part.shape[1] for part in parts]
        w = np.concatenate(parts, axis=1)
        del parts
        x = np.concatenate(observers[act].sampled)
        allowed = {space: ((None,) if act in plain else alphas, clips) for space, (alphas, clips) in spaces.items()}
        grid = _errors(x, w, channel_amax[act], fmt, float_dtype,
                       list(dict.fromkeys(a for alphas, _ in allowed.values() for a in alphas)),
                       list(dict.fromkeys(c for _, clips in allowed.values() for c in clips)))
        y_layers = None
        for space, (alphas, clips) in allowed.items():
            amax, smooth, chosen = results[space]
            alpha, clip = min(((a, c) for a in alphas for c in clips), key=lambda ac: grid[ac][2])
            s, a, err = grid[(alpha, clip)]
            amax[act] = a
            if s is not None:
                smooth[act] = s
            # each layer's own error under the chosen quantization: the ranking for step 3
            per_layer, start = {}, 0
            xq, wq = _quantized_pair(x, w, s, a, fmt, float_dtype)
            if y_layers is None:
                y_layers, begin = [], 0
                for n in widths:
                    y_layers.append(x @ w[:, begin:begin + n])
                    begin += n
            for t, n, y in zip(ts, widths, y_layers):
                per_layer[t.layer] = _rel_err(xq @ wq[:, start:start + n], y)
                start += n
            chosen[act] = {"layers": [t.layer for t in ts], "smoothquant_alpha": alpha, "clip": clip,
                           "output_error": float(err), "layer_errors": per_layer}
        progress("recipe", i + 1, len(by_act))
    return results


def _rel_err(y_hat: np.ndarray, y: np.ndarray) -> float:
    return float(np.sum((y_hat - y) ** 2) / max(float(np.sum(y * y)), 1e-30))


def _quantized_pair(x, w, s, amax: float, fmt: str, float_dtype):
    """The rows and the weight as the Q/DQ graph computes them: (x / s) fake-quantized per tensor against amax,
    diag(s) w per output channel."""
    ws = w * s[:, None] if s is not None else w
    scale_w = weight_scales(ws, fmt, dtype=float_dtype)
    wq = dequantize(quantize(ws, scale_w, fmt), scale_w, fmt)
    xs = x / s if s is not None else x
    scale_x = stored_scale(max(amax, 1e-8) / QMAX[fmt], float_dtype).astype(np.float32)
    return dequantize(quantize(xs, scale_x, fmt), scale_x, fmt), wq


def _errors(x, w, channel_amax, fmt: str, float_dtype, alphas, clips) -> dict[tuple, tuple]:
    """(alpha, clip) -> (factors, amax, relative output error on the rows) for every pair."""
    y = x @ w
    grid = {}
    for alpha in alphas:
        s = smoothquant_factors(channel_amax, w, alpha) if alpha is not None else None
        full = float((channel_amax / s).max()) if s is not None else float(channel_amax.max())
        ws = w * s[:, None] if s is not None else w
        scale_w = weight_scales(ws, fmt, dtype=float_dtype)
        wq = dequantize(quantize(ws, scale_w, fmt), scale_w, fmt)
        xs = x / s if s is not None else x
        for clip in clips:
            a = clip * full
            scale_x = stored_scale(max(a, 1e-8) / QMAX[fmt], float_dtype).astype(np.float32)
            grid[(alpha, clip)] = (s, a, _rel_err(dequantize(quantize(xs, scale_x, fmt), scale_x, fmt) @ wq, y))
    return grid


def float_order(chosen: dict[str, dict], sizes: dict[str, int]) -> tuple[list[str], int]:
    """Layers by local error, worst first, and how many of them FLOAT_BUDGET allows (by weight elements)."""
    errors = {layer: e for c in chosen.values() for layer, e in c["layer_errors"].items()}
    order = sorted(errors, key=errors.get, reverse=True)
    total, allowed, used = sum(sizes.values()), 0, 0
    for layer in order:
        used += sizes[layer]
        if used > FLOAT_BUDGET * total:
            break
        allowed += 1
    return order, allowed


class Search:
    """Step 2 and 3's measurements: candidates against the float graph on held-out calibration windows."""

    def __init__(self, bundle, float_model, held_out: tuple[list[int], str], precision: str, progress,
                 time_bound: float = TIME_BOUND_S, session_format: str | None = None):
        """session_format: how ONNX Runtime runs the candidates (Recipe.session_format; default: the precision)."""
        self.ev = HeldOutEvaluator(bundle, float_model, held_out)
        self.precision, self.progress = precision, progress
        self.session_format = session_format or precision
        self.target = TARGET_PPL_PCT[precision]
        self.started, self.time_bound = time.time(), time_bound
        self.tried: list[dict[str, Any]] = []

    def out_of_time(self) -> bool:
        return time.time() - self.started > self.time_bound

    def measure(self, model, what: dict[str, Any]) -> dict[str, float]:
        m = self.ev.metrics(model, self.session_format)
        self.tried.append({**what, **{k: m[k] for k in BUDGET_METRICS}})
        self.progress("recipe", len(self.tried), len(self.tried) + 1)
        return m

    def meets(self, m: dict[str, float]) -> bool:
        return m["perplexity_delta_pct"] <= self.target

    def keep_in_float(self, quantize: Callable, order: list[str], allowed: int, first, what=None):
        """Step 3: the first of 1, 2, 4, ... worst layers in float that meets the target (else the best seen).
        quantize(extra_exclude) -> (model, targets, excluded, record); first: quantize([]) and its metrics."""
        best = first
        n = 1
        while not self.meets(best[1]) and n <= allowed and not self.out_of_time():
            kept = order[:n]
            try:
                result = quantize([f"^{re.escape(layer)}$" for layer in kept])
            except KvforgeError:  # nothing left to quantize
                break
            m = self.measure(result[0], {**(what or {}), "kept_in_float": kept})
            if m["perplexity_delta_pct"] < best[1]["perplexity_delta_pct"]:
                best = (result, m, kept)
            n = n * 2 if n * 2 <= allowed or n == allowed else allowed
        return best

    def record(self, chosen: dict[str, Any], measured: dict[str, float]) -> dict[str, Any]:
        return {
            "mode": "auto",
            "target": {"perplexity_delta_pct": self.target},
            "measured_on": {"data": self.ev.data, "tokens": int(self.ev.chunks[:, :-1].size),
                            "reference": "the float input graph on ONNX Runtime"},
            "met": self.meets(measured),
            "result": {k: measured[k] for k in BUDGET_METRICS},
            "chosen": chosen,
            "tried": self.tried,
            "float_budget": FLOAT_BUDGET,
            "time_bound_s": self.time_bound,
            "seconds": round(time.time() - self.started, 1),
        }


def search(bundle, float_model, recipe, quantize: Callable, starved: list[str], chosen: dict | None,
           held_out: list[int] | None, gptq_for_block: Callable, progress):
    """Steps 2 and 3. quantize(extra_exclude, block_size=, rounder=, scales=) -> (model, targets, excluded, record);
    starved: patterns always kept in float; chosen: step 1's (amax, smoothing, record) per space of SPACES (W8A8,
    else None); held_out: the calibration text's
    held-out ids; gptq_for_block(block_size) -> a GPTQ rounder. Returns (quantize's result, the recipe with what
    was chosen, the manifest's record)."""
    if held_out is None or len(held_out) <= budget_window(bundle):
        # random tokens, or too little text to hold some out: step 1 decides alone (INT4: its fixed defaults)
        space = next(iter(SPACES))
        amax, smooth, picked = chosen[space] if chosen else (None, None, None)
        result = quantize(starved, scales=(amax, smooth)) if chosen else quantize(starved)
        return result, recipe, {"mode": "auto", "measured_on": None,
                                "chosen": {"space": space, "activations": picked} if chosen else {},
                                "note": "no held-out calibration text to measure candidates on"}
    s = Search(bundle, float_model, (held_out, "held-out calibration text"), recipe.precision, progress,
               session_format=recipe.session_format)
    if recipe.weight_only:
        best = None
        for block, use_gptq in INT4_CANDIDATES:
            if best is not None and (s.meets(best[1]) or s.out_of_time()):
                break
            result = quantize(starved, block_size=block, rounder=gptq_for_block(block) if use_gptq else None)
            m = s.measure(result[0], {"block_size": block, "weight_rounding": "gptq" if use_gptq else "nearest"})
            if best is None or m["perplexity_delta_pct"] < best[1]["perplexity_delta_pct"]:
                best = (result, m, (block, use_gptq))
        result, measured, (block, use_gptq) = best
        recipe = dataclasses.replace(recipe, block_size=block, gptq=use_gptq)
        return result, recipe, s.record({"block_size": block, "weight_rounding": "gptq" if use_gptq else "nearest"},
                                        measured)
    best = None
    for space, (amax, smooth, picked) in chosen.items():  # step 2: each space's choices, the whole graph measured
        if best is not None and s.out_of_time():
            break
        result = quantize(starved, scales=(amax, smooth))
        m = s.measure(result[0], {"space": space, "kept_in_float": []})
        if best is None or m["perplexity_delta_pct"] < best[1]["perplexity_delta_pct"]:
            best = (result, m, space)
    first, m, space = best
    amax, smooth, picked = chosen[space]
    inits = {i.name: i for i in float_model.graph.initializer}
    sizes = {t.layer: int(np.prod(inits[t.weight].dims)) for t in first[1]}
    order, allowed = float_order(picked, sizes)
    result, measured, kept = s.keep_in_float(lambda extra: quantize(starved + extra, scales=(amax, smooth)), order,
                                             allowed, (first, m, []), {"space": space})
    return result, recipe, s.record({"space": space, "activations": picked, "kept_in_float": kept}, measured)


def recipe_summary(record: dict[str, Any]) -> str:
    """One line for `kvforge calibrate` and the pipeline: what the automatic recipe chose and measured."""
    chosen = record.get("chosen") or {}
    parts = []
    if chosen.get("block_size"):
        parts.append(f"block {chosen['block_size']}, {chosen['weight_rounding']} rounding")
    acts = [c for c in (chosen.get("activations") or {}).values() if c.get("output_error") is not None]
    if chosen.get("space"):
        parts.append(f"ranges: {chosen['space']}")
    if acts:
        smoothed = sum(c["smoothquant_alpha"] is not None for c in acts)
        clipped = sum(c["clip"] < 1.0 for c in acts)
        parts.append(f"{smoothed} of {len(acts)} activations smoothed, {clipped} clipped")
    if "kept_in_float" in chosen:
        kept = chosen["kept_in_float"]
        parts.append(f"{len(kept)} layers kept in float" + (f" ({', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''})"
                                                           if kept else ""))
    if record.get("measured_on") is None:
        return f"recipe auto: {'; '.join(parts) or 'defaults'} ({record.get('note')})"
    r = record["result"]
    return (f"recipe auto: {'; '.join(parts)}; on {record['measured_on']['tokens']} held-out calibration tokens: "
            f"perplexity {r['perplexity_delta_pct']:+.2f}% vs float (target <= {record['target']['perplexity_delta_pct']}%"
            f"{'' if record['met'] else ', NOT met: the best candidate is kept'}), top-1 {r['top1_agreement']:.4f}; "
            f"{len(record['tried'])} candidates in {record['seconds']:.0f} s")
