"""Calibration of a one-graph bundle (a decoder LM, an encoder, a Perceiver): observe, fit scales, rewrite.

The graph is run on the calibration set (prefill feeds: token ids, mask, empty caches where it has them), each
linear layer's input is observed, and the Q/DQ rewrite is applied to a copy of the float graph. A mixture's
experts that too few calibration tokens reach are covered (calibration/experts.py); an accuracy budget keeps the
layers that cost most in float (calibration/budget.py); an FP8 KV cache is quantized with its observed max.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from kvforge.bundle import Bundle
from kvforge.ort_session import prefill_feeds

from .budget import fit_budget
from .data import load_calibration_set
from .auto import HOLD_OUT_TOKENS, PROMOTED_BLOCK, SAMPLE_ROWS, choose_in_spaces, search, spaces_for
from .experts import KEEP_ROWS, cover_starved, find_experts, router_inputs
from .gptq import HessianAccumulator, gptq_rounder
from .passes import Probe, Progress, activation_scales, observe, rows_per_run
from .qdq import add_kv_cache_qdq, check_weights_finite, find_targets, rewrite
from .recipe import Quantized, Recipe


def quantize_one_graph(bundle: Bundle, recipe: Recipe, held_out, progress: Progress) -> Quantized:
    """The bundle's graph quantized by the recipe; held_out: the accuracy budget's token stream (or None)."""
    # the graph without its weights (a damage the manifest did not catch is named, not raised by protobuf): each
    # weight is read from the bundle's data file when it is used, and the sessions map that file
    model = bundle.load_graph(external_data=False)
    base = str(bundle.path)
    targets, _ = find_targets(model, list(recipe.exclude), bool(recipe.quantize_lm_head), base_dir=base)
    # the automatic recipe measures the vocabulary projection quantized (auto.search) where it may choose: its
    # activation is observed like the others', and its weight read from an untied copy of the graph (the graph
    # itself stays tied: a candidate that keeps the head float stores the table once, as it was)
    untied = model
    if recipe.quantize_lm_head is None and recipe.auto:
        untied = type(model)()
        untied.CopyFrom(model)
        with_head = find_targets(untied, list(recipe.exclude), True, base_dir=base)[0]
        targets += [t for t in with_head if t.layer == "lm_head"]
    head_choice = any(t.layer == "lm_head" for t in targets) and not recipe.quantize_lm_head
    check_weights_finite(untied, targets, base)
    activations = list(dict.fromkeys(t.activation for t in targets))
    presents = [n for layer in bundle.io.present for n in layer] if recipe.kv_cache else []
    float_dtype = np.float16 if bundle.dtype == "float16" else np.float32
    experts = find_experts(targets)  # a mixture's experts: each one's tokens are counted, the starved covered
    routers = router_inputs(model, {e.moe for e in experts}) if experts else {}
    extra = [n for n in dict.fromkeys(routers.values()) if n not in activations]

    act_amax, smooth, calibration, hessians, cset, chosen, probe = None, None, {"data": None}, None, None, None, None
    if recipe.needs_data:
        cset = load_calibration_set(bundle, recipe.data, samples=recipe.samples, seq_len=recipe.seq_len,
                                    random_data=recipe.random_data, hold_out=HOLD_OUT_TOKENS if recipe.auto else 0)
        hessians = HessianAccumulator(activations) if recipe.gptq else None  # auto INT4's: when a GPTQ candidate runs
        n_batches = -(-len(cset.samples) // recipe.batch_size)
        items = lambda: cset.batches(recipe.batch_size)  # noqa: E731
        searching = recipe.auto and not recipe.weight_only
        observed = activations + presents + extra
        feeds = lambda batch: prefill_feeds(batch, bundle.model_config, bundle.io, bundle.dtype)  # noqa: E731
        max_rows = rows_per_run(model, observed, cset.samples.shape[1], np.dtype(float_dtype).itemsize)
        if not (recipe.static_ranges or searching) and hessians is None and not presents:
            # rounding to nearest reads no activation (an automatic recipe's text is for its held-out measurements,
            # and a GPTQ candidate observes when it is tried: candidate_hessians)
            observers, channel_amax, probe = {}, {}, Probe(model, observed, float_dtype, feeds, base, max_rows)
        else:
            observers, channel_amax, probe = observe(
                model, observed, items, n_batches, feeds, recipe.smoothquant is not None or searching, float_dtype,
                progress, hessians, {n: KEEP_ROWS for n in routers.values()},
                sample_rows=SAMPLE_ROWS if searching else 0, base_dir=base, max_rows=max_rows)
        probe.release()  # its weights are mapped again only if a later pass runs it
        calibration = {
            "data": cset.source, "data_sha256": cset.sha256, "random_data": cset.random,
            "samples": int(len(cset.samples)), "seq_len": int(cset.samples.shape[1]), "batch_size": recipe.batch_size,
        }
    expert_record, starved_float = None, []
    if not recipe.weight_only and recipe.auto:
        # an expert's inputs are not smoothed: a starved one's range is computed unsmoothed (experts.py)
        # (nor is the head's: its 262k rows on Gemma make every smoothing tried a pass over the whole table)
        plain = {a for e in experts for a in (e.gate_up_input, e.down_input)} | \
            {t.activation for t in targets if t.layer == "lm_head"}
        weights = _Weights(untied, base)
        chosen = choose_in_spaces(targets, weights, observers, channel_amax, recipe.precision, float_dtype, progress,
                                  plain, spaces_for(recipe.activations))
        untied = weights = None  # the untied head's float copy
        act_amax, smooth, _ = next(iter(chosen.values()))
    elif recipe.static_ranges:
        act_amax, smooth = activation_scales(model, targets, observers, channel_amax, probe, items, n_batches,
                                             recipe.precision, recipe.method, recipe.percentile, recipe.smoothquant,
                                             progress, base)
        if probe is not None:
            probe.release()
    if not (recipe.weight_only or recipe.per_token) and experts:
        for amax in [act_amax] + [c[0] for c in (chosen or {}).values()]:  # every candidate's ranges cover them
            expert_record, starved_float = _cover_starved_experts(bundle, model, experts, observers, routers,
                                                                  amax, recipe)

    # the budget's rewrites reuse each weight's GPTQ rounding
    round_weight = gptq_rounder(hessians, smooth, recipe.precision, recipe.block_size, float_dtype, progress,
                                len(targets), bool(recipe.zero_points)) if recipe.gptq else None

    def candidate_hessians():
        """The automatic INT4 recipe's Hessians, summed on its first GPTQ candidate (it tries GPTQ only where
        rounding to nearest misses its target): a second pass of the observed graph over the calibration batches,
        which adds what the first pass would have added, in the same order."""
        nonlocal hessians
        if hessians is None:
            hessians = HessianAccumulator(activations)
            for item in items():
                for part in probe.runs(item, max_rows=1):  # H sums one sample at a time whatever the batching
                    for name, x in part.items():
                        hessians.add(name, x.astype(np.float32))
            probe.release()
        return hessians

    def quantize(extra_exclude: list[str], block_size=recipe.block_size, rounder=round_weight, scales=None,
                 per_token=recipe.per_token, zero_points=recipe.zero_points, int8=(), head=bool(recipe.quantize_lm_head)):
        """The Q/DQ rewrite of a copy of the float graph, with these layers also kept in float; scales: the
        activations' (amax, smoothing factors) when not the calibration's own; per_token: the activations scaled
        per row at run time (an automatic recipe's per-token space); zero_points: asymmetric INT4 blocks; int8:
        layers of a weight-only graph stored as INT8 blocks (PROMOTED_BLOCK, to nearest) instead; head: the
        vocabulary projection quantized too, as the layers are (True) or as weight-only INT8 blocks ("blocks":
        llama.cpp's Q8_0 form, with the other int8 layers)."""
        amax, factors = scales or (act_amax, smooth)
        q = type(model)()
        q.CopyFrom(model)
        q_targets, q_excluded = find_targets(q, list(recipe.exclude) + extra_exclude, bool(head), base_dir=base)
        int8 = [*int8, "lm_head"] if head == "blocks" else int8
        bar = lambda done, total: progress("quantize", done, total)  # noqa: E731 - a bar per layer, each rewrite
        rec = rewrite(q, [t for t in q_targets if t.layer not in int8], recipe.precision, amax, block_size, factors,
                      float_dtype, rounder, base, bar, per_token=per_token, zero_points=bool(zero_points))
        if int8:  # the rewrite above replaced the graph's nodes: the promoted MatMuls are found again
            late = [t for t in find_targets(q, quantize_lm_head="lm_head" in int8, require_matches=False,
                                            base_dir=base)[0] if t.layer in int8]
            promoted = rewrite(q, late, "int8", None, PROMOTED_BLOCK, None, float_dtype, None, base, bar)
            rec["weights"].update(promoted["weights"])
            rec["int8_layers"] = [t.layer for t in q_targets if t.layer in int8]
        if recipe.kv_cache:  # the cache keeps its max: an outlier key clipped would change every later step
            rec["kv_cache"] = add_kv_cache_qdq(q, {p: observers[p].compute_amax("max", "fp8") for p in presents},
                                               float_dtype)
        return q, q_targets, q_excluded, rec

    budget_report, recipe_record = None, None
    starved = [f"^{re.escape(name)}$" for name in starved_float]
    if recipe.accuracy_budget:
        (model, targets, excluded, record), budget_report = fit_budget(
            bundle, model, quantize, recipe.session_format, recipe.accuracy_budget, held_out, progress)
    elif recipe.auto:
        (model, targets, excluded, record), recipe, recipe_record = search(
            bundle, model, recipe, quantize, starved, chosen,
            (cset.held_out, cset.held_out_source) if cset and cset.held_out else None,
            lambda b, zp, factors=None: gptq_rounder(candidate_hessians(), factors, recipe.precision, b, float_dtype,
                                                     progress, len(targets), zp),
            progress, head_choice)
    else:
        model, targets, excluded, record = quantize(starved)
    quantization = recipe.quantization_record([t.layer for t in targets], excluded)
    int8_layers = record.pop("int8_layers", None)  # the scales record holds each layer's scales (int8 ones too)
    if int8_layers:
        quantization["int8_layers"] = int8_layers
    return Quantized({bundle.manifest["graph"]: model}, quantization,
                     {**calibration, "scales": record, "accuracy_budget": budget_report, "experts": expert_record,
                      "recipe": recipe_record})


class _Weights(Mapping):
    """A graph's weights by initializer name as float32 arrays, each read from the data file when asked for."""

    def __init__(self, model, base_dir: str):
        self.inits = {i.name: i for i in model.graph.initializer}
        self.base_dir = base_dir

    def __getitem__(self, name: str) -> np.ndarray:
        from onnx import numpy_helper

        return numpy_helper.to_array(self.inits[name], self.base_dir).astype(np.float32, copy=False)

    def __iter__(self):
        return iter(self.inits)

    def __len__(self) -> int:
        return len(self.inits)


def _cover_starved_experts(bundle: Bundle, model, experts, observers, routers, act_amax, recipe: Recipe):
    """(the experts' record, the layers kept in float): experts too few calibration tokens reached, covered."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    weights = {w: numpy_helper.to_array(inits[w], str(bundle.path)).astype(np.float32)
               for e in experts for w in (e.gate_weight, e.up_weight)}
    return cover_starved(experts, observers, routers, weights, act_amax, recipe.min_expert_tokens,
                         recipe.starved_experts, bundle.model_config["activation"], bundle.model_config["dim"])
