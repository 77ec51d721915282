"""The default recipe: what `kvforge calibrate --precision P` does when no tuning option is given.

A real checkpoint's activations carry outlier channels (SmolLM2's layer-28 FFN input reaches 2386 where its
bulk is under 10), and one per-tensor INT8 scale stretched over them rounds everything else to zero: the
fixed defaults (max, no smoothing) cost SmolLM2 +131% perplexity. The recipe is therefore chosen by
measurement on the calibration data, in three steps:

1. Per activation (W8A8: int8, fp8). Each quantized activation (the input q/k/v share, the one gate/up share,
   ...) gets the SmoothQuant alpha (none, or one of ALPHAS) and the clipping of its per-tensor range (CLIPS, a
   fraction of the observed max after smoothing), or per-token scales (a space's choice: each row's range is its
   own, computed at run time), that together minimize its layers' relative output error
   ||Q(X / s) Q(diag(s) W) - X W||^2 / ||X W||^2 on SAMPLE_ROWS calibration rows drawn from every batch, the
   weights rounded per output channel as the graph will store them. The static choices are plain Q/DQ (a Mul by
   1/s before the QuantizeLinear, a scale): ONNX Runtime and TensorRT run them as any other; per-token scales
   are ONNX Runtime's only, searched where the recipe's activations are not fixed to static.
2. Whole graph (every precision). The quantized graph is measured against the float graph on held-out windows
   of the calibration text (windows no calibration sample covers; never the evaluation text). W8A8 measures
   step 1's choices searched in each space of SPACES (smoothing and clipping, clipping alone, the fixed recipe's
   max without smoothing, and per-token scales with and without smoothing: local error does not always rank what
   perplexity feels) and keeps the best (candidates rank by KL divergence from the float graph, RANKED_BY, and
   meet the target on it: Search.meets); where that misses the target, the best space's weights rounded by GPTQ
   (its Hessians from a second pass, divided by the space's smoothing) are measured too, and kept if better
   (FP8's error is mostly its weights': E4M3 keeps three mantissa bits). INT4 tries blocks 128, 64 and 32 rounded to nearest, then 128 and 32
   with GPTQ, and keeps the first that is within the target (else the best): larger blocks are smaller and as
   fast. Its blocks have a float minimum each (qdq.minimum_blocks: Q4_1 / Q4_K's form) unless the recipe says no
   (TensorRT).
3. While the target is missed: W8A8 keeps the linear layers with the largest local error in float, 1,
   2, 4, ... of them, within FLOAT_BUDGET of the quantized weights; INT4 with minimums keeps layer types as
   INT8 blocks (Search.promote), within INT8_BUDGET.

4. The vocabulary projection (where the recipe leaves it to measurement, Search.choose_head): measured quantized
   in the chosen form (W8A8 per-token: Q8_0's weight-only blocks; static: as the layers; INT4: as the layers),
   with step 3 while the target is missed; kept quantized where the target holds or its own cost is at most
   HEAD_COST_SHARE of the target's KL, else float.

Everything tried, measured and chosen is recorded in the manifest (`calibration.recipe`), and the search stops
trying new candidates once `time_bound` seconds have passed (what was measured by then decides).
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Callable, NamedTuple

import numpy as np

from kvforge.errors import KvforgeError

from .budget import BUDGET_METRICS, HeldOutEvaluator, budget_window
from .qdq import QMAX, dequantize, dequantized_rows, quantize, smoothquant_factors, stored_scale, weight_scales

ALPHAS = (None, 0.5, 0.65, 0.8)  # None: no smoothing
CLIPS = (1.0, 0.8, 0.6, 0.45, 0.3, 0.2)  # of the activation's observed max (after smoothing)


class Space(NamedTuple):
    """A space of per-activation choices: SmoothQuant alphas, and either clips of a static per-tensor range or
    per-token scales computed at run time (ONNX Runtime only; clips do not apply: each row's range is its own)."""
    alphas: tuple
    clips: tuple
    per_token: bool = False


# step 2's W8A8 candidates: each activation's choice searched within each space; "max" is the fixed recipe's
# (max, no smoothing), so the automatic recipe is never worse than it on the held-out text. The per-token spaces
# are tried where the recipe's activations are not fixed to static (TensorRT takes only static scales)
SPACES = {"smoothed and clipped": Space(ALPHAS, CLIPS), "clipped": Space((None,), CLIPS), "max": Space((None,), (1.0,)),
          "per-token smoothed": Space(ALPHAS, (1.0,), True), "per-token": Space((None,), (1.0,), True)}


def spaces_for(activations: str | None) -> dict[str, Space]:
    """The spaces a recipe's activations allow: "static", "per-token", or None (both, chosen by measurement)."""
    return {name: sp for name, sp in SPACES.items()
            if activations is None or sp.per_token == (activations == "per-token")}
SAMPLE_ROWS = 512  # calibration rows per activation for the local search
# The targets: perplexity change on text the float model writes itself. The mean KL(float || quantized) of its
# next-token distributions is the expected rise of the negative log-likelihood per token on such text, so a target
# of p% is met where the held-out windows' mean KL <= ln(1 + p / 100) (Search.meets). Candidates are ranked by
# that KL too (perplexity change on the windows breaks ties). A perplexity change measured on ~2000 tokens of a
# given text is not the figure to steer by: errors can raise the probability of the text that happens to follow.
# On SmolLM2 INT8 the static smoothed space measured +0.43% there (KL 0.039) against +1.00% for per-token smoothed
# (KL 0.008), where held-out Alice measures +2.69% and +0.63% (KL 0.042 and 0.008); on Gemma 3 270M INT4 blocks of
# 32 measured -2.7% there, "within" +4%, with KL 0.52 and top-1 0.63.
TARGET_PPL_PCT = {"int8": 1.0, "fp8": 1.0, "int4": 4.0}
RANKED_BY = ("kl_divergence_mean", "perplexity_delta_pct")
FLOAT_BUDGET = 0.10  # at most this fraction of the quantized weights' elements kept in float
# (block size, GPTQ): the largest block first, rounded to nearest; GPTQ where nearest falls short (on SmolLM2,
# whose float weights were dequantized from 4-bit blocks of 32, GPTQ measured worse than nearest at every size)
INT4_CANDIDATES = ((128, False), (64, False), (32, False), (128, True), (32, True))
# INT4 with minimums (ONNX Runtime's form): layer types kept as INT8 blocks of PROMOTED_BLOCK (llama.cpp's
# Q8_0) where INT4 misses its target, as Q4_K_M keeps some of its tensors in more bits; at most this fraction of
# the quantized weights' elements
INT8_BUDGET = 0.35
PROMOTED_BLOCK = 32
# the head quantized is kept, target met or not, where it adds at most this share of the target's KL: on Gemma 3
# 270M INT8 (which misses +1% in every space) its Q8_0 blocks cost +0.0000 against a target of 0.00995, and a float
# head is 671 MB a decode step reads
HEAD_COST_SHARE = 0.1
TIME_BOUND_S = 900.0
HOLD_OUT_TOKENS = 2048  # calibration text kept out of the samples, for step 2 and 3's measurements


def choose_activations(targets, weights: dict[str, np.ndarray], observers, channel_amax: dict[str, np.ndarray],
                       fmt: str, float_dtype, progress, plain=frozenset(), alphas=ALPHAS,
                       clips=CLIPS) -> tuple[dict, dict, dict]:
    """Step 1 over one space of choices: (activation -> amax, activation -> smoothing factors, activation -> its
    choice and errors); choose_in_spaces's arguments."""
    return choose_in_spaces(targets, weights, observers, channel_amax, fmt, float_dtype, progress, plain,
                            {"": Space(alphas, clips)})[""]


def choose_in_spaces(targets, weights: dict[str, np.ndarray], observers, channel_amax: dict[str, np.ndarray],
                     fmt: str, float_dtype, progress, plain=frozenset(), spaces=SPACES) -> dict[str, tuple]:
    """Step 1: per space of choices (name -> Space), (activation -> amax, activation -> smoothing factors,
    activation -> its choice and errors).

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
        allowed = {space: Space((None,) if act in plain else sp.alphas, sp.clips, sp.per_token)
                   for space, sp in spaces.items()}
        grid = _errors(x, w, channel_amax[act], fmt, float_dtype,
                       list(dict.fromkeys((a, sp.per_token) for sp in allowed.values() for a in sp.alphas)),
                       list(dict.fromkeys(c for sp in allowed.values() for c in sp.clips)))
        y_layers = None
        for space, sp in allowed.items():
            amax, smooth, chosen = results[space]
            alpha, clip = min(((a, c) for a in sp.alphas for c in sp.clips),
                              key=lambda ac: grid[(*ac, sp.per_token)][2])
            s, a, err = grid[(alpha, clip, sp.per_token)]
            amax[act] = a
            if s is not None:
                smooth[act] = s
            # each layer's own error under the chosen quantization: the ranking for step 3
            per_layer, start = {}, 0
            xq, wq = _quantized_pair(x, w, s, a, fmt, float_dtype, sp.per_token)
            if y_layers is None:
                y_layers, begin = [], 0
                for n in widths:
                    y_layers.append(x @ w[:, begin:begin + n])
                    begin += n
            for t, n, y in zip(ts, widths, y_layers):
                per_layer[t.layer] = _rel_err(xq @ wq[:, start:start + n], y)
                start += n
            chosen[act] = {"layers": [t.layer for t in ts], "smoothquant_alpha": alpha, "clip": clip,
                           **({"scale": "per-token dynamic"} if sp.per_token else {}),
                           "output_error": float(err), "layer_errors": per_layer}
        progress("recipe", i + 1, len(by_act))
    return results


def _rel_err(y_hat: np.ndarray, y: np.ndarray) -> float:
    return float(np.sum((y_hat - y) ** 2) / max(float(np.sum(y * y)), 1e-30))


def _quantized_pair(x, w, s, amax: float, fmt: str, float_dtype, per_token: bool = False):
    """The rows and the weight as the Q/DQ graph computes them: (x / s) fake-quantized per tensor against amax (or
    per row, per_token), diag(s) w per output channel."""
    ws = w * s[:, None] if s is not None else w
    scale_w = weight_scales(ws, fmt, dtype=float_dtype)
    wq = dequantize(quantize(ws, scale_w, fmt), scale_w, fmt)
    xs = x / s if s is not None else x
    if per_token:
        return dequantized_rows(xs, fmt, float_dtype), wq
    scale_x = stored_scale(max(amax, 1e-8) / QMAX[fmt], float_dtype).astype(np.float32)
    return dequantize(quantize(xs, scale_x, fmt), scale_x, fmt), wq


def _errors(x, w, channel_amax, fmt: str, float_dtype, alphas, clips) -> dict[tuple, tuple]:
    """(alpha, clip, per-token) -> (factors, amax, relative output error on the rows) for every (alpha,
    per-token) of `alphas` and clip (one entry, clip 1.0, per alpha where per-token: each row is its own range)."""
    y = x @ w
    grid = {}
    for alpha, per_token in alphas:
        s = smoothquant_factors(channel_amax, w, alpha) if alpha is not None else None
        full = float((channel_amax / s).max()) if s is not None else float(channel_amax.max())
        ws = w * s[:, None] if s is not None else w
        scale_w = weight_scales(ws, fmt, dtype=float_dtype)
        wq = dequantize(quantize(ws, scale_w, fmt), scale_w, fmt)
        xs = x / s if s is not None else x
        if per_token:
            grid[(alpha, 1.0, True)] = (s, full, _rel_err(dequantized_rows(xs, fmt, float_dtype) @ wq, y))
            continue
        for clip in clips:
            a = clip * full
            scale_x = stored_scale(max(a, 1e-8) / QMAX[fmt], float_dtype).astype(np.float32)
            grid[(alpha, clip, False)] = (s, a, _rel_err(dequantize(quantize(xs, scale_x, fmt), scale_x, fmt) @ wq, y))
    return grid


def float_order(chosen: dict[str, dict], sizes: dict[str, int]) -> tuple[list[str], int]:
    """Layers by local error, worst first, and how many of them FLOAT_BUDGET allows (by weight elements)."""
    errors = {layer: e for c in chosen.values() for layer, e in c["layer_errors"].items() if layer in sizes}
    order = sorted(errors, key=errors.get, reverse=True)
    total, allowed, used = sum(sizes.values()), 0, 0
    for layer in order:
        used += sizes[layer]
        if used > FLOAT_BUDGET * total:
            break
        allowed += 1
    return order, allowed


class Search:
    """Step 2 and 3's measurements: candidates against the float graph on held-out windows."""

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
        return m["kl_divergence_mean"] <= kl_target(self.target)

    @staticmethod
    def better(m: dict[str, float], than: dict[str, float] | None) -> bool:
        """Whether measurement m ranks before than (None: nothing yet), by RANKED_BY."""
        return than is None or tuple(m[k] for k in RANKED_BY) < tuple(than[k] for k in RANKED_BY)

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
            if self.better(m, best[1]):
                best = (result, m, kept)
            n = n * 2 if n * 2 <= allowed or n == allowed else allowed
        return best

    def promote(self, quantize: Callable, first, first_m, sizes: dict[str, int], what=None):
        """INT4's step 3: layer types (each layer's name with its indices as *: every layer's v_proj) stored as INT8
        blocks. Each type is measured alone; then the types that helped (lowered the KL divergence), most gain per
        element first, are added one at a time while the target is missed and INT8_BUDGET allows. quantize(int8
        layer names) -> quantize's result; first: the INT4 result and first_m its metrics. Returns (result, metrics,
        the INT8 layers)."""
        types: dict[str, list[str]] = {}
        for layer in sizes:
            types.setdefault(re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", layer), []).append(layer)
        total = sum(sizes.values())
        size = {t: sum(sizes[layer] for layer in ls) for t, ls in types.items()}
        best, base = (first, first_m, []), first_m[RANKED_BY[0]]
        gains = {}
        for t in sorted(types, key=size.get):
            if self.out_of_time():
                break
            if size[t] > INT8_BUDGET * total or len(types) == 1:
                continue
            result = quantize(types[t])
            m = self.measure(result[0], {**(what or {}), "int8_layers": [t]})
            gains[t] = base - m[RANKED_BY[0]]
            if self.better(m, best[1]):
                best = (result, m, types[t])
        order = sorted((t for t in gains if gains[t] > 0), key=lambda t: gains[t] / size[t], reverse=True)
        kept, used = [], 0
        for t in order:
            if self.meets(best[1]) or self.out_of_time():
                break
            if used + size[t] > INT8_BUDGET * total:
                continue
            kept.append(t)
            used += size[t]
            if len(kept) == 1:  # measured alone above
                continue
            layers = [layer for layer in sizes if any(layer in types[k] for k in kept)]  # in graph order
            result = quantize(layers)
            m = self.measure(result[0], {**(what or {}), "int8_layers": list(kept)})
            if self.better(m, best[1]):
                best = (result, m, layers)
        return best

    def choose_head(self, quantize: Callable, first, order: list[str], allowed: int, what: dict):
        """The vocabulary projection quantized or kept float (the largest layer of a small model: its weight is
        most of what a decode step reads), by measurement. quantize(extra_exclude, head) -> quantize's result;
        first: (the float-head result, its metrics, []) as measured. The head quantized is measured, then with
        layers kept in float (keep_in_float: order, allowed) while the target is missed; it is chosen where that
        meets the target or where its own cost is at most HEAD_COST_SHARE of the target's KL (then it is not
        what misses the target), else the float head goes through keep_in_float as before, and the better of
        the two is kept. Returns ((result, metrics, the layers kept in float), whether the head is quantized, the
        record: the head's cost in KL divergence and perplexity against the float head's candidate)."""
        head = quantize([], True)
        hm = self.measure(head[0], {**what, "lm_head": "quantized", "kept_in_float": []})
        cost = {k: round(hm[k] - first[1][k], 6) for k in RANKED_BY}
        with_head = self.keep_in_float(lambda extra: quantize(extra, True), order, allowed, (head, hm, []),
                                       {**what, "lm_head": "quantized"})
        if self.meets(with_head[1]) or cost[RANKED_BY[0]] <= HEAD_COST_SHARE * kl_target(self.target):
            best, quantized = with_head, True
        else:
            without = self.keep_in_float(lambda extra: quantize(extra, False), order, allowed, first, what)
            quantized = self.better(with_head[1], without[1]) and not self.meets(without[1])
            best = with_head if quantized else without
        return best, quantized, {"quantized": quantized, "cost": cost}

    def record(self, chosen: dict[str, Any], measured: dict[str, float]) -> dict[str, Any]:
        return {
            "mode": "auto",
            "target": {"perplexity_delta_pct": self.target, "kl_divergence_mean": kl_target(self.target)},
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
           held_out: tuple[list[int], str] | None, gptq_for_block: Callable, progress, head_choice: bool = False):
    """Steps 2 and 3. quantize(extra_exclude, block_size=, rounder=, scales=, per_token=, head=) -> (model, targets,
    excluded, record); starved: patterns always kept in float; chosen: step 1's (amax, smoothing, record) per space
    of spaces_for(recipe.activations) (W8A8, else None); the returned recipe's activations are the chosen space's;
    held_out: the ids to measure on and their name (CalibrationSet.held_out, held_out_source);
    gptq_for_block(block_size, zero_points, smoothing factors=None) -> a GPTQ rounder; head_choice: the vocabulary
    projection quantized is measured too (choose_head), and the recipe's quantize_lm_head says what was chosen.
    Returns (quantize's result, the recipe with what was chosen, the manifest's record)."""
    if held_out is None or len(held_out[0]) <= budget_window(bundle):
        # random tokens, or too little text to hold some out: step 1 decides alone in the first space (static where
        # the activations are not fixed: the form every backend runs; INT4: its fixed defaults)
        space = next(iter(chosen)) if chosen else None
        amax, smooth, picked = chosen[space] if chosen else (None, None, None)
        if chosen:
            recipe = _with_space(recipe, space)
            result = quantize(starved, scales=(amax, smooth), per_token=SPACES[space].per_token)
        else:
            result = quantize(starved)
        recipe = dataclasses.replace(recipe, quantize_lm_head=bool(recipe.quantize_lm_head))
        return result, recipe, {"mode": "auto", "measured_on": None,
                                "chosen": {"space": space, "activations": _read(picked, result)} if chosen else {},
                                "note": "no held-out text to measure candidates on"}
    s = Search(bundle, float_model, held_out, recipe.precision, progress,
               session_format=recipe.session_format)
    if recipe.weight_only:
        return _weight_only_search(s, float_model, recipe, quantize, starved, gptq_for_block, head_choice)
    best = None
    for space, (amax, smooth, picked) in chosen.items():  # step 2: each space's choices, the whole graph measured
        if best is not None and s.out_of_time():
            break
        result = quantize(starved, scales=(amax, smooth), per_token=SPACES[space].per_token)
        m = s.measure(result[0], {"space": space, "kept_in_float": []})
        if s.better(m, best and best[1]):
            best = (result, m, space)
    first, m, space = best
    amax, smooth, picked = chosen[space]
    per_token = SPACES[space].per_token
    rounder, rounding = None, "nearest"
    if not s.meets(m) and not s.out_of_time():  # the weights' own error: GPTQ rounding against the space's smoothing
        rounder = gptq_for_block(None, False, smooth)
        gptq = quantize(starved, scales=(amax, smooth), per_token=per_token, rounder=rounder)
        gm = s.measure(gptq[0], {"space": space, "weight_rounding": "gptq", "kept_in_float": []})
        if s.better(gm, m):
            first, m, rounding = gptq, gm, "gptq"
        else:
            rounder = None
    order, allowed = float_order(picked, sizes_of(float_model, first[1]))
    what = {"space": space, "weight_rounding": rounding}
    # the head measured quantized: per-token, as Q8_0's weight-only blocks (its activation then stays float: the
    # final norm's outlier channels cost a per-row scale +0.0067 KL on SmolLM2, where the blocks cost ~0); with
    # static ranges (TensorRT's form) as the layers are
    head_form = "blocks" if per_token else True
    run = lambda extra, head=recipe.quantize_lm_head: quantize(  # noqa: E731
        starved + extra, scales=(amax, smooth), per_token=per_token, rounder=rounder,
        head=head_form if head else False)
    record = {"space": space, "activations": picked, "weight_rounding": rounding}
    if head_choice:
        (result, measured, kept), quantized, record["lm_head"] = s.choose_head(run, (first, m, []), order, allowed, what)
        record["lm_head"]["form"] = "int8 blocks of 32, weight-only" if head_form == "blocks" else "as the layers"
        recipe = dataclasses.replace(recipe, quantize_lm_head=quantized)
    else:
        result, measured, kept = s.keep_in_float(run, order, allowed, (first, m, []), what)
    recipe = dataclasses.replace(_with_space(recipe, space), gptq=rounding == "gptq")
    record["activations"] = _read(picked, result)
    return result, recipe, s.record({**record, "kept_in_float": kept}, measured)


def _weight_only_search(s: Search, float_model, recipe, quantize: Callable, starved: list[str],
                        gptq_for_block: Callable, head_choice: bool):
    """search()'s steps 2, 3 and 4 for a weight-only recipe (INT4): the block candidates, the layer types kept as
    INT8 blocks (with minimums, ONNX Runtime's form), the head. search()'s arguments and return."""
    best, zp = None, bool(recipe.zero_points)
    for block, use_gptq in INT4_CANDIDATES:
        if best is not None and (s.meets(best[1]) or s.out_of_time()):
            break
        result = quantize(starved, block_size=block, rounder=gptq_for_block(block, zp) if use_gptq else None,
                          zero_points=zp)
        m = s.measure(result[0], {"block_size": block, "weight_rounding": "gptq" if use_gptq else "nearest",
                                  "zero_points": zp})
        if s.better(m, best and best[1]):
            best = (result, m, (block, use_gptq))
    result, measured, (block, use_gptq) = best
    recipe = dataclasses.replace(recipe, block_size=block, gptq=use_gptq)
    chosen = {"block_size": block, "weight_rounding": "gptq" if use_gptq else "nearest", "zero_points": zp}
    rounder = gptq_for_block(block, zp) if use_gptq else None
    int8: list = []
    if zp and not s.meets(measured):  # ONNX Runtime's form: the most sensitive layer types as INT8 blocks
        result, measured, int8 = s.promote(
            lambda layers: quantize(starved, block_size=block, rounder=rounder, zero_points=zp, int8=layers),
            result, measured, sizes_of(float_model, result[1]), {"block_size": block})
        chosen["int8_layers"] = int8
    if head_choice:
        (result, measured, _), quantized, chosen["lm_head"] = s.choose_head(
            lambda extra, head: quantize(starved + extra, block_size=block, rounder=rounder, zero_points=zp,
                                         int8=int8, head=head), (result, measured, []), [], 0,
            {"block_size": block, "weight_rounding": chosen["weight_rounding"]})
        recipe = dataclasses.replace(recipe, quantize_lm_head=quantized)
    return result, recipe, s.record(chosen, measured)


def _read(picked: dict[str, dict], result) -> dict[str, dict]:
    """Step 1's choices for the activations quantize's result quantizes (a float head's was searched too, and a
    head in weight-only blocks reads its activation in float)."""
    _, targets, _, record = result
    weight_only = set(record.get("int8_layers") or ())
    read = {t.activation for t in targets if t.layer not in weight_only}
    return {a: c for a, c in picked.items() if a in read}


def kl_target(perplexity_pct: float) -> float:
    """The mean KL(float || quantized) at which text the float model writes reads perplexity_pct% more perplexed."""
    return float(np.log1p(perplexity_pct / 100))


def sizes_of(float_model, targets) -> dict[str, int]:
    """Each target layer's weight elements."""
    inits = {i.name: i for i in float_model.graph.initializer}
    return {t.layer: int(np.prod(inits[t.weight].dims)) for t in targets}


def _with_space(recipe, space: str):
    """The recipe with its activations those of the chosen space."""
    return dataclasses.replace(recipe, activations="per-token" if SPACES[space].per_token else "static")


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
    if chosen.get("lm_head"):
        head = chosen["lm_head"]
        parts.append(f"lm_head {'quantized' if head['quantized'] else 'kept float'} "
                     f"(quantized: KL {head['cost']['kl_divergence_mean']:+.2g})")
    if "kept_in_float" in chosen:
        kept = chosen["kept_in_float"]
        parts.append(f"{len(kept)} layers kept in float" + (f" ({', '.join(kept[:4])}{', ...' if len(kept) > 4 else ''})"
                                                           if kept else ""))
    if record.get("measured_on") is None:
        return f"recipe auto: {'; '.join(parts) or 'defaults'} ({record.get('note')})"
    r, target = record["result"], record["target"]
    met = "" if record["met"] else ", NOT met: the best candidate is kept"
    return (f"recipe auto: {'; '.join(parts)}; on {record['measured_on']['tokens']} tokens of "
            f"{record['measured_on']['data']}: "
            f"KL {r['kl_divergence_mean']:.4f} vs float (target <= {target['kl_divergence_mean']:.4f}: "
            f"+{target['perplexity_delta_pct']}% perplexity on the float model's own text{met}), "
            f"perplexity {r['perplexity_delta_pct']:+.2f}%, top-1 {r['top1_agreement']:.4f}; "
            f"{len(record['tried'])} candidates in {record['seconds']:.0f} s")
