"""`calibrate(bundle, out, precision=...)`: a float bundle -> a Q/DQ bundle, written atomically."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from kvforge import resources
from kvforge.bundle import Bundle
from kvforge.derived import write_derived
from kvforge.ecosystem import write_ecosystem_files
from kvforge.outputs import check_output_path
from kvforge.tokenizer import Tokenizer

from .auto import HOLD_OUT_TOKENS
from .budget import budget_ids
from .kinds import quantizer_of
from .passes import Progress
from .recipe import Recipe

EXTERNAL_FROM = 1 << 30  # a calibrated graph whose weights pass this many bytes keeps them in model.onnx.data


def calibrate(bundle_path: str | Path, out: str | Path, *, options: Recipe | None = None, force: bool = False,
              progress: Progress | None = None, **fields: Any) -> Bundle:
    """Quantize a float bundle: INT8 / FP8 W8A8 calibrated on data, or INT4 weight-only.

    options: the calibration's Recipe (calibration/recipe.py: every option, what it means and its default);
    `fields` are Recipe fields given by name instead (`precision="int8", samples=64`), or over `options`'
    own. The recipe is checked against the bundle before any work, and the bundle's kind picks its quantizer
    (calibration/kinds.py). Recipe.recipe "auto" (a decoder LM's default; encoders and encoder-decoders take
    "fixed"; method, percentile, smoothquant, block_size, gptq and accuracy_budget need "fixed" stated)
    chooses smoothing, clipping, layers kept in float and INT4's block size and rounding by measurement on the
    calibration text (calibration/auto.py); "fixed" takes the options as given, with max ranges, no smoothing,
    block 128 and rounding to nearest where they are not.
    """
    if options is not None and not isinstance(options, Recipe):
        raise TypeError(f"calibrate()'s options are a Recipe, not {type(options).__name__}: name the fields "
                        f"(precision=..., recipe=...)")
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(Recipe)})
    if unknown:
        raise TypeError(f"calibrate() got options that are not Recipe fields: {unknown}")
    recipe_given = dataclasses.replace(options or Recipe(), **fields)
    progress = progress or (lambda phase, done, total: None)
    started = time.time()
    bundle = Bundle(bundle_path)
    quantizer = quantizer_of(bundle.kind)
    recipe = recipe_given.checked(bundle, quantizer.fits_budget, quantizer.activations)
    check_output_path(out, force, [bundle.path])
    weights = sum(f.stat().st_size for f in bundle.path.iterdir() if f.suffix in (".onnx", ".data"))
    width = resources.dtype_bytes(bundle.dtype)
    # the float logits that candidates are measured against, on the held-out windows (float32 per vocabulary entry)
    held_out_tokens = (HOLD_OUT_TOKENS if recipe.auto and not recipe.random_data else 0) + \
        (recipe.budget_tokens if recipe.accuracy_budget else 0)
    scratch = held_out_tokens * bundle.model_config.get("vocab_size", 0) * 4
    resources.check(resources.calibrate_plan(weights // width, weights, scratch), out)  # before any work
    bundle.verify(full=True)  # a truncated, altered or non-finite graph is named here, not mid-calibration
    # the budget's held-out text is read and checked now, not after the calibration
    held_out = budget_ids(bundle, recipe.budget_data, recipe.budget_tokens) if recipe.accuracy_budget else None
    quantized = quantizer.quantize(bundle, recipe, held_out, progress)
    return write_calibrated(bundle, out, force, quantized.models, quantized.quantization, quantized.calibration,
                            recipe.lineage_options(data_read=quantized.calibration["data"] is not None), started)


def write_calibrated(bundle: Bundle, out, force: bool, models: dict[str, Any], quantization: dict[str, Any],
                     calibration: dict[str, Any], options: dict[str, Any], started: float) -> Bundle:
    """Write the quantized graphs (file name -> ModelProto) as the bundle derived from the float one
    (kvforge.derived.write_derived: its tokenizer, config and adapters carried, its lineage extended, every file
    hashed). Two graphs (an encoder-decoder) keep their weights in one shared file."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_model

    from kvforge.export.lint import lint, merge_lint  # the export package imports torch: only when writing
    from kvforge.onnx_graph import external_bytes, save_with_data

    def write(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        shared = len(models) > 1
        # a graph may still read float weights from the input bundle's data file (calibration reads each when it
        # is used): they stay in a data file, as does everything of a graph over EXTERNAL_FROM
        inits = [i for m in models.values() for i in m.graph.initializer]
        big = not shared and (sum(len(i.raw_data) + external_bytes(i) for i in inits) > EXTERNAL_FROM
                              or any(external_bytes(i) for i in inits))
        for name, model in models.items():
            if big:  # the float weights are copied from the input's data file in pieces, the codes moved out
                save_with_data(model, tmp / name, bundle.path, "model.onnx.data")
            else:
                load_external_data_for_model(model, str(bundle.path))
                onnx.save(model, str(tmp / name))
        entries: dict[str, Any] = {}
        if shared:
            from kvforge.export.seq2seq_export import share_weights

            entries["weight_sharing"] = share_weights([tmp / name for name in models])
        precision_record = {"dtype": bundle.dtype, "quantization": quantization}
        tokenizer = Tokenizer.from_file(bundle.tokenizer_file) if bundle.tokenizer_file else None
        roles = {name: role for role, name in bundle.graphs.items()}
        entries.update(
            external_data="model.onnx.data" if big or shared else None,
            precision=precision_record,
            # regenerated for the quantized graph (the float bundle's config.json carried over as it is)
            ecosystem=write_ecosystem_files(tmp, bundle.model_config, bundle.io, bundle.manifest["graph"],
                                            precision_record, tokenizer, from_bundle=bundle.path),
            calibration=calibration,
            lint=merge_lint({roles[name]: lint(tmp / name) for name in models}),
        )
        return entries, {"options": options, "seconds": {"total": round(time.time() - started, 2)}}

    return write_derived(bundle, out, force, "calibrate", write)
