"""What the calibration of a bundle with several graphs (an encoder-decoder, a vision-language model) shares:
the linear layers each graph quantizes, and the per-graph observe / scale / rewrite loop. Each graph's layers get
their own scales; lm_head stays in float (as in decoders) unless asked."""

from __future__ import annotations

import re
from typing import Any, Callable


from kvforge.errors import KvforgeError

from .gptq import HessianAccumulator, gptq_rounder
from .passes import activation_scales, observe
from .qdq import check_weights_finite, find_targets, rewrite
from .recipe import Quantized, Recipe


def graph_targets(models: dict[str, Any], recipe: Recipe) -> dict[str, tuple[list, list]]:
    """Each graph's (targets, excluded layers); --exclude patterns must match a layer of some graph."""
    exclude = list(recipe.exclude)
    found = {role: find_targets(m, exclude, recipe.quantize_lm_head, require_matches=False) for role, m in models.items()}
    names = [t.layer for targets, _ in found.values() for t in targets] + [n for _, ex in found.values() for n in ex]
    unmatched = [p for p in exclude if not any(re.search(p, n) for n in names)]
    if unmatched:
        raise KvforgeError(f"--exclude {unmatched} matches no linear layer of any graph; their names look like "
                           f"{names[:3]}")
    for role, (targets, _) in found.items():
        check_weights_finite(models[role], targets)
    return found


def quantize_graphs(models: dict[str, Any], files: dict[str, str], found: dict[str, tuple[list, list]],
                    items: dict[str, list] | None, feeds: dict[str, Callable[[Any], dict]], recipe: Recipe,
                    float_dtype, progress: Callable, record: dict[str, Any]) -> Quantized:
    """Every graph (role -> ModelProto, written as files[role]) quantized by the recipe: observed on items[role]
    (each item made into inputs by feeds[role]; items None where the recipe reads no data)."""
    out, scales, layers, excluded_all = {}, {}, [], []
    for role, model in models.items():
        targets, excluded = found[role]
        act_amax = smooth = round_weight = observers = channel_amax = run = hessians = None
        batches = items[role] if items is not None else []
        report = lambda phase, done, total, role=role: progress(f"{phase} {role}", done, total)  # noqa: E731
        if items is not None:
            activations = list(dict.fromkeys(t.activation for t in targets))
            hessians = HessianAccumulator(activations) if recipe.gptq else None
            observers, channel_amax, run = observe(model, activations, lambda: iter(batches), len(batches),
                                                    feeds[role], recipe.smoothquant is not None, float_dtype, report,
                                                    hessians)
        if recipe.static_ranges:
            act_amax, smooth = activation_scales(model, targets, observers, channel_amax, run, lambda: iter(batches),
                                                 len(batches), recipe.precision, recipe.method, recipe.percentile,
                                                 recipe.smoothquant, report)
        if recipe.gptq:
            round_weight = gptq_rounder(hessians, smooth, recipe.precision, recipe.block_size, float_dtype, report,
                                        len(targets), bool(recipe.zero_points))
        scales[role] = rewrite(model, targets, recipe.precision, act_amax, recipe.block_size, smooth, float_dtype,
                               round_weight, per_token=recipe.per_token, zero_points=bool(recipe.zero_points))
        out[files[role]] = model
        layers += [t.layer for t in targets]
        excluded_all += excluded
    quantization = {**recipe.quantization_record(layers, excluded_all), "graphs": list(models)}
    return Quantized(out, quantization, {**record, "scales": scales, "accuracy_budget": None})
