"""`calibrate(bundle, out, precision=...)`: a float bundle -> a Q/DQ bundle, written atomically."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import kvforge
from kvforge.bundle import Bundle, now_utc, write_manifest
from kvforge.ecosystem import write_ecosystem_files
from kvforge.errors import KvforgeError
from kvforge.kinds import kind_name
from kvforge.outputs import check_output_path, staged_bundle
from kvforge.tokenizer import Tokenizer
from kvforge.ort_session import prefill_feeds
from kvforge.checks import is_number

from .data import load_calibration_set
from .experts import KEEP_ROWS, STARVED, cover_starved, find_experts, router_inputs
from .gptq import DAMP, HessianAccumulator, gptq_rounder
from .observers import METHODS
from .passes import Progress, activation_scales, observe
from .qdq import FORMATS, add_kv_cache_qdq, find_targets, rewrite

MIN_OPSET = {"int8": 13, "fp8": 19, "int4": 21}
# TensorRT documents INT4 block sizes 64 and 128 (ModelOpt defaults to 128); others are linted as warnings
DEFAULT_BLOCK_SIZE = 128


def _check_sizes(**sizes) -> None:
    from kvforge.checks import positive_int_or_none

    for name, value in sizes.items():
        if not positive_int_or_none(value):
            raise KvforgeError(f"{name} must be a positive integer, got {value!r}")


def _check_weights_finite(model, targets) -> None:
    """A NaN or inf weight would quietly become a scale of 1 or inf (or NaN codes); name the layer instead."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    for t in targets:
        w = numpy_helper.to_array(inits[t.weight])
        bad = int(w.size - np.count_nonzero(np.isfinite(w)))
        if bad:
            raise KvforgeError(f"layer {t.layer}'s weight holds {bad} NaN or infinite values: the float bundle is broken; "
                               "re-export it from a sound checkpoint")


def calibrate(
    bundle_path: str | Path,
    out: str | Path,
    precision: str = "int8",
    method: str = "max",
    percentile: float = 99.99,
    data: str | Path | None = None,
    samples: int = 128,
    seq_len: int = 256,
    smoothquant: float | None = None,
    exclude: Sequence[str] = (),
    block_size: int | None = None,
    random_data: bool = False,
    batch_size: int = 8,
    quantize_lm_head: bool = False,
    force: bool = False,
    progress: Progress | None = None,
    kv_cache: str | None = None,
    accuracy_budget: dict[str, float] | None = None,
    budget_data: str | Path | None = None,
    budget_tokens: int = 4096,
    gptq: bool = False,
    min_expert_tokens: int = 16,
    starved_experts: str = "all-tokens",
) -> Bundle:
    """Quantize a float bundle: INT8 / FP8 W8A8 calibrated on data, or INT4 weight-only.

    gptq: round weights with GPTQ (error-compensating, from the calibration activations) instead of
    to nearest; INT4 then needs calibration data too. A mixture's expert that fewer than min_expert_tokens
    calibration tokens reach is calibrated on all of them ("all-tokens") or kept in float ("float"):
    calibration/experts.py.
    """

    progress = progress or (lambda phase, done, total: None)
    started = time.time()
    bundle = Bundle(bundle_path)
    if accuracy_budget:
        from .budget import parse_budget

        accuracy_budget = parse_budget(accuracy_budget)
    if precision not in FORMATS:
        raise KvforgeError(f"precision {precision!r} is not one of {FORMATS}")
    if method not in METHODS:
        raise KvforgeError(f"method {method!r} is not one of {METHODS}")
    if bundle.quantization:
        raise KvforgeError(f"{bundle.path} is already quantized ({bundle.manifest['precision']['quantization']['format']}); calibrate a float bundle")
    dtype = bundle.dtype
    if dtype == "bfloat16":
        raise KvforgeError("calibration runs the graph on ONNX Runtime's CPU provider, which has no bfloat16 kernels; calibrate a float32 or float16 bundle")
    if smoothquant is not None and (precision == "int4" or not 0.0 <= smoothquant <= 1.0):
        raise KvforgeError(f"--smoothquant takes an alpha in [0, 1] and applies to int8 and fp8, not weight-only int4 (got {smoothquant} for {precision})")
    if kv_cache not in (None, "fp8"):
        raise KvforgeError(f"--kv-cache {kv_cache!r} is not supported; the choice is fp8")
    decoder = bundle.architecture == "decoder"
    if kv_cache and not decoder:
        raise KvforgeError(f"--kv-cache: {bundle.path} is {kind_name(bundle.architecture)}, which has no KV cache")
    if accuracy_budget and not decoder:
        raise KvforgeError("--accuracy-budget measures a decoder's perplexity; for an encoder, calibrate and then "
                           "measure with `kvforge compare` (embedding cosine, top-1 agreement)")
    if kv_cache and precision == "int4":
        raise KvforgeError("--kv-cache fp8 is calibrated with the activations: use it with int8 or fp8, not weight-only int4")
    if kv_cache and bundle.manifest.get("opset", 0) < 19:
        raise KvforgeError("an FP8 KV cache needs opset >= 19; re-export with --opset 21")
    if block_size is not None and precision != "int4":
        raise KvforgeError(f"--block-size applies to int4's block-wise weights; {precision} weights are per channel")
    if precision == "int4":
        block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size  # None from here on for per-channel formats
    _check_sizes(samples=samples, seq_len=seq_len, batch_size=batch_size, block_size=block_size, budget_tokens=budget_tokens)
    if method == "percentile" and precision != "int4" and not (is_number(percentile) and 0.0 < percentile <= 100.0):
        raise KvforgeError(f"--percentile must be a number in (0, 100], got {percentile!r}")
    if starved_experts not in STARVED:
        raise KvforgeError(f"--starved-experts {starved_experts!r} is not one of {STARVED}")
    if not isinstance(min_expert_tokens, int) or isinstance(min_expert_tokens, bool) or min_expert_tokens < 0:
        raise KvforgeError(f"--min-expert-tokens must be an integer >= 0, got {min_expert_tokens!r}")
    if isinstance(exclude, str):  # one pattern, not its characters
        exclude = [exclude]
    if data is not None and random_data:
        raise KvforgeError("--data and --random-data name two different calibration sets; pass one of them")
    if bundle.manifest.get("opset", 0) < MIN_OPSET[precision]:
        raise KvforgeError(f"{precision} Q/DQ needs opset >= {MIN_OPSET[precision]}; re-export with --opset {max(21, MIN_OPSET[precision])}")
    check_output_path(out, force, [bundle.path])
    bundle.verify(full=True)  # a truncated, altered or non-finite graph is named here, not mid-calibration
    held_out = None
    if accuracy_budget:  # its held-out text is read and checked now, not after the calibration
        from .budget import budget_ids

        held_out = budget_ids(bundle, budget_data, budget_tokens)

    if bundle.architecture == "encoder-decoder":
        from .seq2seq import quantize_seq2seq

        models, quantization, record = quantize_seq2seq(
            bundle, precision, method, percentile, data, samples, seq_len, smoothquant, list(exclude), block_size,
            random_data, batch_size, quantize_lm_head, progress, _check_weights_finite, gptq)
        options = {"precision": precision, "method": method, "percentile": percentile, "samples": samples,
                   "seq_len": seq_len, "smoothquant": smoothquant, "exclude": list(exclude), "block_size": block_size,
                   "random_data": bool(random_data), "quantize_lm_head": quantize_lm_head, "kv_cache": None,
                   "accuracy_budget": None, "gptq": gptq}
        return write_calibrated(bundle, out, force, models, quantization, record, options, started)

    model = bundle.load_graph()  # a damage the manifest did not catch is named, not raised by protobuf
    targets, excluded = find_targets(model, list(exclude), quantize_lm_head)
    _check_weights_finite(model, targets)
    activations = list(dict.fromkeys(t.activation for t in targets))
    presents = [n for layer in bundle.io.present for n in layer] if kv_cache else []
    float_dtype = np.float16 if dtype == "float16" else np.float32
    experts = find_experts(targets)  # a mixture's experts: each one's tokens are counted, the starved covered
    routers = router_inputs(model, {e.moe for e in experts}) if experts else {}
    extra = [n for n in dict.fromkeys(routers.values()) if n not in activations]

    act_amax, smooth, calibration, hessians = None, None, {"data": None}, None
    if precision != "int4" or gptq:  # weight-only INT4 rounded to nearest needs no data
        cset = load_calibration_set(bundle, data, samples, seq_len, random_data)
        hessians = HessianAccumulator(activations) if gptq else None
        n_batches = -(-len(cset.samples) // batch_size)
        items = lambda: cset.batches(batch_size)  # noqa: E731
        observers, channel_amax, run = observe(
            model, activations + presents + extra, items, n_batches,
            lambda batch: prefill_feeds(batch, bundle.model_config, bundle.io, dtype),
            smoothquant is not None, float_dtype, progress, hessians, {n: KEEP_ROWS for n in routers.values()},
        )
        calibration = {
            "data": cset.source, "data_sha256": cset.sha256, "random_data": cset.random,
            "samples": int(len(cset.samples)), "seq_len": int(cset.samples.shape[1]), "batch_size": batch_size,
        }
    expert_record, starved_float = None, []
    if precision != "int4":
        act_amax, smooth = activation_scales(model, targets, observers, channel_amax, run, items, n_batches, precision,
                                             method, percentile, smoothquant, progress)
        if experts:
            from onnx import numpy_helper

            inits = {i.name: i for i in model.graph.initializer}
            weights = {w: numpy_helper.to_array(inits[w]).astype(np.float32) for e in experts for w in (e.gate_weight, e.up_weight)}
            expert_record, starved_float = cover_starved(
                experts, observers, routers, weights, act_amax, min_expert_tokens, starved_experts,
                bundle.model_config["activation"], bundle.model_config["dim"])

    # the budget's rewrites reuse each weight's GPTQ rounding
    round_weight = gptq_rounder(hessians, smooth, precision, block_size, float_dtype, progress, len(targets)) if gptq else None

    def quantize(extra_exclude: list[str]):
        """The Q/DQ rewrite of a copy of the float graph, with these layers also kept in float."""
        q = type(model)()
        q.CopyFrom(model)
        q_targets, q_excluded = find_targets(q, list(exclude) + extra_exclude, quantize_lm_head)
        rec = rewrite(q, q_targets, precision, act_amax, block_size, smooth, float_dtype, round_weight)
        if kv_cache:  # the cache keeps its max: an outlier key clipped would change every later step
            rec["kv_cache"] = add_kv_cache_qdq(q, {p: observers[p].compute_amax("max", "fp8") for p in presents}, float_dtype)
        return q, q_targets, q_excluded, rec

    progress("quantize", 0, 1)
    budget_report = None
    if accuracy_budget:
        from .budget import fit_budget

        (model, targets, excluded, record), budget_report = fit_budget(
            bundle, model, quantize, precision, accuracy_budget, held_out, progress)
    else:
        model, targets, excluded, record = quantize([f"^{re.escape(name)}$" for name in starved_float])
    progress("quantize", 1, 1)

    quantization = {
        "format": precision,
        "weights": "block-wise" if precision == "int4" else "per-channel",
        "weight_rounding": "gptq" if gptq else "nearest",
        "gptq_damp": DAMP if gptq else None,
        "activations": None if precision == "int4" else "per-tensor static",
        "method": None if precision == "int4" else method,
        "percentile": percentile if method == "percentile" and precision != "int4" else None,
        "smoothquant_alpha": smoothquant,
        "block_size": block_size,
        "kv_cache": kv_cache,
        "quantized_layers": [t.layer for t in targets],
        "excluded_layers": excluded,
    }
    options = {"precision": precision, "method": method, "percentile": percentile, "samples": samples,
               "seq_len": seq_len, "smoothquant": smoothquant, "exclude": list(exclude),
               "block_size": block_size, "random_data": bool(random_data and calibration["data"]),
               "quantize_lm_head": quantize_lm_head,
               "kv_cache": kv_cache, "accuracy_budget": accuracy_budget, "gptq": gptq}
    options.update(min_expert_tokens=min_expert_tokens, starved_experts=starved_experts)
    return write_calibrated(bundle, out, force, {"model.onnx": model}, quantization,
                            {**calibration, "scales": record, "accuracy_budget": budget_report, "experts": expert_record},
                            options, started)


def write_calibrated(bundle: Bundle, out, force: bool, models: dict[str, Any], quantization: dict[str, Any],
                     calibration: dict[str, Any], options: dict[str, Any], started: float) -> Bundle:
    """Stage the quantized graphs (file name -> ModelProto) with the float bundle's tokenizer and a manifest
    that extends its lineage. Two graphs (an encoder-decoder) keep their weights in one shared file."""
    import onnx

    from kvforge.export.lint import lint, merge_lint

    with staged_bundle(out, force, [bundle.path]) as tmp:
        shared = len(models) > 1
        big = not shared and sum(len(i.raw_data) for m in models.values() for i in m.graph.initializer) > (1 << 30)
        for name, model in models.items():
            onnx.save(model, str(tmp / name), save_as_external_data=big, location="model.onnx.data")
        sharing = None
        if shared:
            from kvforge.export.seq2seq_export import share_weights

            sharing = share_weights([tmp / name for name in models])
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (bundle.path / name).is_file():
                shutil.copy2(bundle.path / name, tmp / name)
        precision_record = {"dtype": bundle.dtype, "quantization": quantization}
        tokenizer = Tokenizer.from_file(bundle.tokenizer_file) if bundle.tokenizer_file else None
        ecosystem = write_ecosystem_files(tmp, bundle.model_config, bundle.io, bundle.manifest["graph"], precision_record,
                                          tokenizer, from_bundle=bundle.path)
        roles = {name: role for role, name in bundle.manifest.get("graphs", {"model": "model.onnx"}).items()}
        lint_result = merge_lint({roles.get(name, name): lint(tmp / name) for name in models})
        manifest: dict[str, Any] = {
            k: v for k, v in bundle.manifest.items() if k not in ("format", "format_version", "files", "validation", "lint")
        }
        manifest.update(
            stage="calibrate",
            external_data="model.onnx.data" if big or shared else None,
            precision=precision_record,
            ecosystem=ecosystem,
            calibration=calibration,
            lint=lint_result,
            lineage=bundle.manifest.get("lineage", []) + [{
                "stage": "calibrate",
                "tool": f"kvforge {kvforge.__version__}",
                "time": now_utc(),
                "input": {"source": str(bundle.path.resolve()), "kind": "bundle", "sha256": bundle.manifest["files"][bundle.manifest["graph"]]["sha256"]},
                "options": options,
                "seconds": {"total": round(time.time() - started, 2)},
            }],
        )
        if sharing is not None:
            manifest["weight_sharing"] = sharing
        write_manifest(tmp, manifest)
    return Bundle(out)
