"""`export(source, out)`: model -> validated ONNX bundle, written atomically."""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import onnx
import onnxruntime
import torch

import kvforge
from kvforge import resources
from kvforge.bundle import Bundle, now_utc, sha256_file, sha256_tree, write_manifest
from kvforge.ecosystem import write_ecosystem_files
from kvforge.errors import KvforgeError
from kvforge.kinds import kind_of
from kvforge.onnx_graph import save_with_data
from kvforge.model_defs import DEFAULT_MODEL, source_kind
from kvforge.model_defs.architectures import preset_config
from kvforge.model_defs.checkpoint import (PACKAGED, TRAINED, gguf_path, ignored_tensors, load_quantized, load_streamed,
                                           prequantized, source_parameters, streamed_codes, trained_dir)
from kvforge.model_defs.lora import add_slots, target_names
from kvforge.model_defs.quantized import QuantizedCheckpoint
from kvforge.model_defs.weights import for_tracing, streamed
from kvforge.outputs import check_output_path, staged_bundle

from . import oracle
from .checkpoint_codes import keep_codes
from .kinds import EXPORTS
from .lazy_weights import write_progress
from .lint import lint, merge_lint
from .onnx_export import DEFAULT_OPSET, EXTERNAL_DATA

DTYPES = ("float32", "float16", "bfloat16")
STREAM_INLINE_BYTES = 256 << 20  # a streamed export's weights up to this size are written into the graph file
MAX_LORA_RANK = 1024

# progress(phase, done, total): phases "load", "export", "weights" (each weight read from the source as the graph
# is written, where they are read then), "lint", "validate", "write"
Progress = Callable[[str, int, int], None]


class ExportValidationError(KvforgeError):
    """The exported graph missed tolerance; no bundle was written."""

    def __init__(self, summary: dict[str, Any]):
        failures = summary["failures"]
        shown = "\n  ".join(failures[:12]) + (f"\n  ... and {len(failures) - 12} more" if len(failures) > 12 else "")
        super().__init__(f"export validation failed ({summary['dtype']}, {len(failures)} checks):\n  {shown}\nno bundle was written")
        self.summary = summary


def source_digest(source) -> dict[str, Any]:
    """What the export was made from, with a hash that changes when its inputs do."""
    kind = source_kind(source)
    if kind == "gguf":  # one file; a packaged model keeps its name, so the bundle's source works on any machine
        file = gguf_path(source)
        name = str(source) if str(source) in PACKAGED else str(file.resolve())
        return {"source": name, "kind": "gguf", "sha256": sha256_file(file)}
    if kind == "preset" and str(source) in TRAINED:
        kind, path, name = "kvforge", trained_dir(str(source)), str(source)
    elif kind == "preset":
        blob = json.dumps({"preset": str(source), "config": preset_config(str(source)).to_dict(), "seed": 0}, sort_keys=True)
        return {"source": str(source), "kind": "preset", "sha256": hashlib.sha256(blob.encode()).hexdigest()}
    else:
        path = Path(source)
        name = str(path.resolve())  # absolute: the bundle is used from other directories than the one it was made in
    files = [p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".bin")]
    return {"source": name, "kind": kind, "sha256": sha256_tree(files, path)}


def resolve_max_context(cfg, max_context: int | None) -> int:
    """The context the bundle is exported for: the model's own bound unless asked, checked against it."""
    kind = kind_of(cfg)
    longest = getattr(cfg, kind.length_field)
    max_context = longest if max_context is None else max_context
    if max_context < 2:
        raise KvforgeError(f"max context {max_context} is too small (at least 2)")
    # a KV-cache decoder with computed positions may run past the length it was configured with
    if (not kind.kv_cache or cfg.position == "learned") and max_context > longest:
        learned = cfg.position in ("learned", "absolute", "padded")
        raise KvforgeError(f"max context {max_context} exceeds the {longest} "
                           + ("learned positions of this model" if learned else "positions this model takes"))
    return max_context


def export(
    source=None,
    out: str | Path = "bundle",
    *, dtype: str = "float32",
    opset: int = DEFAULT_OPSET,
    max_context: int | None = None,
    external_data: bool | None = None,
    force: bool = False,
    dequantize: bool = False,
    lora_max_rank: int | None = None,
    lora_targets: list[str] | None = None,
    transformers_check: bool = True,
    progress: Progress | None = None,
) -> Bundle:
    """Export SOURCE (anything `model_defs.load` takes) to a validated ONNX bundle at OUT.

    Validation against the FP32 Torch reference runs on every export; when it
    misses tolerance, ExportValidationError is raised and nothing is written.
    A pre-quantized source (a GGUF file, a quantized Hugging Face checkpoint) keeps its codes: the float graph
    of its dequantized weights gets each quantized weight back as codes behind a DequantizeLinear
    (export/checkpoint_codes.py), and that graph is validated (codes that quantize activations, or were
    converted from a type no Q/DQ expresses, depart from the float model by design: the float graph is validated
    before they go in); `dequantize` writes the float bundle instead, to calibrate it.
    transformers_check: once the bundle is written, compare it with transformers from text on the source's own
    files (export/oracle.py: the tokenizer's ids, then the outputs); a departure raises, naming the end (tokenizer,
    weights, graph), and nothing is written. The manifest's `oracle` says what was compared, or why not.
    lora_max_rank: give the targeted linear layers (lora_targets: short names such as q, v, gate; None: those of
    q, k, v, o, gate, up, down the model has) LoRA slots, inputs that take adapters of rank up to it per row
    (model_defs/lora.py); validation runs them with a random adapter.
    """

    if dtype not in DTYPES:
        raise KvforgeError(f"dtype {dtype!r} is not one of {DTYPES}")
    if not 18 <= opset <= 24:
        raise KvforgeError(f"opset {opset} is outside the supported range 18..24 (the exporter needs >= 18, TensorRT 10.15 reads <= 24)")
    if lora_max_rank is not None and (isinstance(lora_max_rank, bool) or not isinstance(lora_max_rank, int)
                                      or not 1 <= lora_max_rank <= MAX_LORA_RANK):
        raise KvforgeError(f"lora max rank must be an int in 1..{MAX_LORA_RANK}, got {lora_max_rank!r}")
    if lora_targets is not None and lora_max_rank is None:
        raise KvforgeError("lora targets choose the layers that get LoRA slots: give a lora max rank too")
    check_output_path(out, force, [source])  # fail before any work
    progress = progress or (lambda phase, done, total: None)
    source = DEFAULT_MODEL if source is None else source
    keeps_codes = _keeps_codes(source, dequantize)
    streaming = load_streamed(source) if lora_max_rank is None else None
    if streaming is not None and not EXPORTS[kind_of(streaming[0].config).name].streams:
        streaming = None  # this kind's export loads the model whole
    parameters = source_parameters(source)
    if parameters is not None:  # refuse a model this machine cannot hold before loading it
        scratch = streaming[2].scratch_bytes if streaming is not None else 0
        resources.check(resources.export_plan(parameters, resources.dtype_bytes(dtype), streaming is not None, scratch),
                        out)
    started = time.time()

    progress("load", 0, 1)
    if streaming is not None:
        # weights read from the checkpoint where they are used (model_defs/weights.py): the graph's as it is
        # written, the reference's one block at a time; the model is never held whole
        skeleton, tokenizer, weights = streaming
        model = for_tracing(skeleton, getattr(torch, dtype), weights)
        # the weights of a model past STREAM_INLINE_BYTES go to model.onnx.data as they are read (a graph file
        # holding them is made whole in memory); a small one stays one file, as a loaded model's does
        if external_data is None:
            external_data = weights.nbytes(getattr(torch, dtype)) > STREAM_INLINE_BYTES
        # a GGUF file's codes, matched against the streamed weights one at a time (None: a float checkpoint)
        quantized = streamed_codes(source, skeleton, weights) if keeps_codes else None
        reference = streamed(skeleton, weights)
    else:
        # FP32: the reference every dtype is measured against (a pre-quantized checkpoint's dequantization)
        (reference, tokenizer), quantized = load_quantized(source, codes=keeps_codes)
        quantized = None if dequantize else quantized
    if quantized is not None and dtype != "float32":  # before any work
        raise KvforgeError(f"a pre-quantized checkpoint's codes are kept in a float32 bundle (its scales and offsets are "
                           f"float32), not {dtype}: leave --dtype out, or pass --dequantize for a {dtype} bundle")
    cfg = reference.config
    max_context = resolve_max_context(cfg, max_context)
    plan = EXPORTS[kind_of(cfg).name]
    targets = None
    if lora_max_rank is not None:
        if plan.lora_io is None:
            raise KvforgeError(f"LoRA slots are made for decoders; this model is {kind_of(cfg).article}")
        if quantized is not None:
            raise KvforgeError("LoRA slots over a pre-quantized checkpoint's codes are not made yet: pass --dequantize "
                               "(and calibrate the bundle) for a quantized base with slots")
        slots = add_slots(reference, lora_targets)
        targets = target_names(slots)
    if streaming is None:
        model = reference if dtype == "float32" else copy.deepcopy(reference).to(getattr(torch, dtype)).eval()
    progress("load", 1, 1)

    with staged_bundle(out, force, [source]) as tmp:
        progress("export", 0, 1)
        with write_progress(lambda done, total: progress("weights", done, total)):  # each streamed weight written
            graphs = plan.write(model, tmp, opset, external_data)
        export_seconds = time.time() - started
        # what tracing and writing left (the exporter's cycles, glibc's freed heap) back before the graph runs
        # beside the references
        gc.collect()
        resources.release_freed_memory()
        progress("export", 1, 1)
        quantization = None
        if quantized is not None and quantized.exact:
            # codes that stand for the float weights bit for bit go in before validation: the graph validated is
            # the one written, each weight dequantized where it is used, and the codes are dropped before the graph
            # runs (a Q4_K_M file's float graph maps 3.5x its codes)
            _check_codes_fit(graphs)
            quantization, quantized = keep_checkpoint_codes(tmp, graphs.main, quantized), None
        progress("lint", 0, 1)
        lint_result = merge_lint({role: lint(tmp / name) for role, name in graphs.files.items()})
        progress("lint", 1, 1)
        summary = plan.validate(tmp, reference, dtype, max_context, progress=lambda d, t: progress("validate", d, t),
                                tokenizer=tokenizer)
        if not summary["passed"]:
            raise ExportValidationError(summary)
        summary["graph"] = "as written" if quantized is None else \
            "the float graph, before the checkpoint's codes replaced its weights"
        progress("write", 0, 1)
        if quantized is not None:
            # codes that quantize activations, or were converted, depart from the float model by design: its float
            # graph was validated
            _check_codes_fit(graphs)
            quantization = keep_checkpoint_codes(tmp, graphs.main, quantized)
            lint_result = merge_lint({role: lint(tmp / name) for role, name in graphs.files.items()})
        if tokenizer is not None:
            tokenizer.save(tmp)
        io = plan.io_spec(cfg, model.dtype, max_context)
        if lora_max_rank is not None:
            io = plan.lora_io(io, model, lora_max_rank, targets)
        precision = {"dtype": dtype, "quantization": quantization}
        ecosystem = write_ecosystem_files(
            tmp, cfg.to_dict(), io, graphs.main, precision, tokenizer,
            hf_source=Path(source) if source_kind(source) == "hf" else None,
        )
        lineage = {
            "stage": "export",
            "tool": f"kvforge {kvforge.__version__}",
            "time": now_utc(),
            "input": {**source_digest(source), **({"ignored": ignored} if (ignored := ignored_tensors(source)) else {})},
            "options": {"dtype": dtype, "opset": opset, "max_context": max_context, "external_data": external_data,
                        "dequantize": dequantize,
                        **({"lora_max_rank": lora_max_rank, "lora_targets": targets} if lora_max_rank else {})},
            "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
            "seconds": {"export": round(export_seconds, 2), "total": round(time.time() - started, 2)},
        }
        manifest = {
            "stage": "export",
            "graph": graphs.main,
            "graphs": graphs.files,  # role -> file, every graph (Bundle.graphs)
            **({"weight_sharing": graphs.weight_sharing} if graphs.weight_sharing is not None else {}),
            "external_data": EXTERNAL_DATA if (tmp / EXTERNAL_DATA).exists() else None,
            "model": cfg.to_dict(),
            "io": io.to_dict(),
            "precision": precision,
            "opset": opset,
            "lineage": [lineage],
            "validation": summary,
            "lint": lint_result,
            "ecosystem": ecosystem,
        }
        files = write_manifest(tmp, manifest)["files"]
        progress("write", 1, 1)
        # transformers from text on the source's own files, against the written bundle (export/oracle.py); a
        # departure raises, and nothing is written
        progress("oracle", 0, 1)
        if not transformers_check:
            manifest["oracle"] = oracle.skipped("not asked for (--no-transformers-check)")
        elif lora_max_rank is not None:
            manifest["oracle"] = oracle.skipped("a graph with LoRA slots is compared by its adapters' tests")
        elif quantization is not None and quantization.get("activations"):
            manifest["oracle"] = oracle.skipped(
                f"the checkpoint's codes quantize activations ({quantization['activations']}): the graph departs "
                "from a float model by design (its float graph was validated before the codes went in)")
        else:
            manifest["oracle"] = oracle.check(source, tmp, kind_of(cfg).name, reference, tokenizer, dtype)
        write_manifest(tmp, manifest, files)
        progress("oracle", 1, 1)
    return Bundle(out)


def _keeps_codes(source, dequantize: bool) -> bool:
    """Whether the export keeps `source`'s quantized codes (they are read with the model, model_defs.load_quantized)."""
    return not dequantize and prequantized(source)


def keep_checkpoint_codes(directory: Path, graph: str, quantized: QuantizedCheckpoint) -> dict[str, Any]:
    """The checkpoint's codes into `directory`'s graph file (rewritten in place, external data kept external);
    returns the manifest's quantization record."""
    path = directory / graph
    # the float graph without its external data: each weight the codes replace is read alone to be matched, and
    # dropped; the weights that stay float are copied in pieces from the old data file into the new one
    model = onnx.load(str(path), load_external_data=False)
    kept = keep_codes(model, quantized, str(directory))
    data = directory / EXTERNAL_DATA
    if data.exists():
        old = Path(tempfile.mkdtemp(dir=directory, prefix=".float-"))
        data.rename(old / EXTERNAL_DATA)
        try:
            save_with_data(model, path, old, EXTERNAL_DATA)
        finally:
            shutil.rmtree(old)
    else:
        onnx.save(model, str(path))
    activations = {_activation_text(c.activation) for c in quantized.codes.values() if c.activation}
    return {"format": "checkpoint", "weights": "checkpoint codes", "activations": ", ".join(sorted(activations)) or None,
            "checkpoint": quantized.record(), "quantized_layers": kept, "excluded_layers": []}


def _activation_text(activation: dict[str, Any]) -> str:
    if activation.get("scale") is not None:
        return f"{activation['format']} static"
    granularity = activation.get("granularity", "token")
    if granularity == "token group":
        return f"{activation['format']} per token group of {activation['group_size']}"
    return f"{activation['format']} per {granularity}" + (" (dynamic)" if granularity == "tensor" else "")


def _check_codes_fit(graphs) -> None:
    if len(graphs.files) > 1:
        raise KvforgeError("keeping a checkpoint's codes is done for one-graph models; this one exports "
                           f"{len(graphs.files)} graphs: pass --dequantize for a float bundle")
