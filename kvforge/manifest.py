"""The bundle manifest's schema (kvforge.json), applied every time a bundle is opened (docs/bundle.md).

Every field kvforge reads is typed here, every path in the manifest must name a
file inside the bundle, and the values commands branch on are enumerated; what
does not fit is one error, "bundle ... is damaged: <field> <what it holds>,
expected <what>". The model entry is checked field by field against the config
of its architecture (kvforge/model_fields.py, generated from model_defs).
"""

from __future__ import annotations

from typing import Any

from kvforge.errors import KvforgeError
from kvforge.kinds import DEFAULT_KIND, get_kind
from kvforge.model_fields import MODEL_FIELDS
from kvforge.schema import (
    AnyJSON, DictOf, Enum, ListOf, Num, Opt, Pattern, Rec, RelPath, SchemaError, Union, annotation_spec, check,
)

STAGES = ("export", "calibrate", "build")
# a bundle's files lie at its top level, but for its LoRA adapters' (kvforge/adapters.py): adapters/NAME/FILE
ADAPTERS = "adapters"
DTYPES = ("float32", "float16", "bfloat16")
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool",
                 "float8_e4m3fn")
QUANT_FORMATS = ("int8", "fp8", "int4", "checkpoint")  # checkpoint: a pre-quantized checkpoint's own codes
ARCHITECTURES = tuple(MODEL_FIELDS)


SHA256 = Pattern(r"[0-9a-f]{64}", "a sha256 hex digest")
COUNT = Num(low=0, integer=True)
POSITIVE = Num(low=1, integer=True)
METRIC = Opt(Num(finite=False))  # measured numbers: a divergence may be infinite, an undefined one null

TENSOR = Rec({"name": str, "dtype": Enum(*TENSOR_DTYPES), "shape": ListOf(Union(str, COUNT))},
             required=("name", "dtype", "shape"))
CACHE_NAMES = ListOf(ListOf(str, min_len=1))
IO = Rec({
    "inputs": ListOf(TENSOR, min_len=1),
    "outputs": ListOf(TENSOR, min_len=1),
    "kv_cache": Rec({"past": CACHE_NAMES, "present": CACHE_NAMES, "layout": str, "windows": Opt(ListOf(Opt(POSITIVE)))},
                    required=("past", "present")),
    "max_context": Opt(POSITIVE),
    "extra": Rec({
        "architecture": Enum(*ARCHITECTURES),
        "per_token_outputs": ListOf(str),
        # where bundles written before `graphs` was always written named their graphs (kvforge.bundle reads them)
        "decoder_graph": RelPath(),
        "encoder": Rec({"graph": RelPath(), "inputs": ListOf(TENSOR), "outputs": ListOf(TENSOR)},
                       required=("inputs", "outputs")),
        "cross_cache": Rec({"inputs": CACHE_NAMES, "encoder_outputs": CACHE_NAMES}, required=("inputs", "encoder_outputs")),
        "max_source_length": POSITIVE,
        # LoRA slots (export --lora-max-rank): per slot (a module name) its [in, out] features
        "lora": Rec({"max_rank": POSITIVE, "targets": ListOf(str), "mask": str, "slots": DictOf(ListOf(POSITIVE))},
                    required=("max_rank", "targets", "mask", "slots")),
    }),
}, required=("inputs", "outputs", "kv_cache"))

QUANTIZATION = Rec({
    "format": Enum(*QUANT_FORMATS), "recipe": Opt(Enum("auto", "fixed")), "weights": str, "weight_rounding": str, "gptq_damp": Opt(Num(low=0)),
    "weight_only": Opt(bool),  # the activations stay float (int4; int8 with --weights-only)
    "zero_points": Opt(bool),  # int4 blocks asymmetric: a float minimum each (ONNX Runtime's form)
    "int8_layers": Opt(ListOf(str)),  # an int4 graph's layers stored as INT8 blocks (the automatic recipe's step 3)
    "activations": Opt(str), "method": Opt(str), "percentile": Opt(Num(low=0, high=100)),
    "smoothquant_alpha": Opt(Num(low=0, high=1)), "block_size": Opt(POSITIVE), "kv_cache": Opt(Enum("int8", "fp8")),
    "quantized_layers": ListOf(str), "excluded_layers": ListOf(Union(str, DictOf(AnyJSON))),
    "checkpoint": Opt(Rec({"format": str, "config": DictOf(AnyJSON), "kept": DictOf(DictOf(AnyJSON)),
                           "converted": DictOf(DictOf(AnyJSON)), "kept_float": DictOf(str)},
                          required=("format", "config", "kept", "converted", "kept_float"))),
}, required=("format",))
PRECISION = Rec({"dtype": Enum(*DTYPES), "quantization": Opt(QUANTIZATION)}, required=("dtype",))

FILES = DictOf(Rec({"bytes": COUNT, "sha256": SHA256}, required=("bytes", "sha256")))
LINEAGE = ListOf(Rec({
    "stage": Enum(*STAGES), "tool": str, "time": str,
    # export from a Hugging Face directory: its tensors the model does not read, and why
    "input": Rec({"source": Opt(str), "kind": str, "sha256": Opt(str), "ignored": Opt(DictOf(str))}),
    "options": DictOf(AnyJSON), "versions": DictOf(Opt(str)), "seconds": DictOf(METRIC),
}, required=("stage", "tool", "time")))

# what a comparison measured for one output; the first two are always measured (inspect shows them)
METRICS = Rec({"max_abs": Num(finite=False), "rel_l2": Num(finite=False), "cosine": METRIC, "top1_agreement": METRIC,
               "kl_divergence_mean": METRIC, "reference_magnitude": METRIC}, required=("max_abs", "rel_l2"))
# where a decoder's FP32 validation came closest to (or went past) its bound: the error as a multiple of the
# reference's own FP32 noise, what is left of the bound, and the first layer whose cache departs
_NOISE_RECORD = {"ratio": METRIC, "excess": METRIC, "first_layer": Opt(COUNT)}
VALIDATION = Rec({
    "dtype": str, "reference": str, "tolerances": DictOf(Opt(Num(low=0))), "inputs": str, "cases": COUNT,
    "logits": METRICS, "present": METRICS, "outputs": DictOf(METRICS), "encoder": DictOf(METRICS),
    "decoder": DictOf(METRICS),
    "noise": Rec({"logits": METRICS, "present": METRICS}),
    "worst": Opt(Rec({"case": str, "output": Opt(str), **_NOISE_RECORD})),
    "first_failure": Opt(Rec({"case": str, "output": Opt(str), "failing_outputs": COUNT, **_NOISE_RECORD})),
    "case_results": ListOf(Rec({"case": str, "shape": ListOf(COUNT), "worst_output": Opt(str), **_NOISE_RECORD,
                                "routing_margin": Num(low=0)})),  # a mixture routed at a tie there: not judged
    "lockstep": Rec({"steps": COUNT, "logits": METRICS, "present": METRICS, "greedy_matching_steps": COUNT,
                     "greedy_first_divergence": Opt(COUNT), "greedy_divergence_margin": METRIC,
                     "greedy_near_tie_slack": METRIC}, required=("steps", "greedy_matching_steps")),
    "passed": bool, "failures": ListOf(str), "graph": str,
}, required=("reference", "cases", "passed"))
FINDING = Rec({"severity": Enum("error", "warning", "info"), "rule": str, "message": str, "node": Opt(str),
               "op": Opt(str), "graph": Opt(str)}, required=("severity", "rule", "message"))
LINT = Rec({
    "passed": bool, "opset": Opt(COUNT), "targets": DictOf(bool), "errors": COUNT, "warnings": COUNT,
    "findings": ListOf(FINDING), "graphs": DictOf(Rec({"passed": bool, "errors": COUNT, "warnings": COUNT},
                                                     required=("passed", "errors", "warnings"))),
}, required=("passed", "errors", "warnings", "findings"))
ECOSYSTEM = DictOf(Rec({"config": Opt(RelPath()), "reason": Opt(str), "model_type": Opt(str), "from": Opt(str)}))
# calibration/auto.py's record of what the automatic recipe measured and chose
RECIPE = Rec({
    "mode": Enum("auto"), "target": DictOf(Opt(Num())), "measured_on": Opt(Rec({"data": str, "tokens": COUNT, "reference": str})),
    "met": bool, "result": DictOf(METRIC), "chosen": DictOf(AnyJSON), "tried": ListOf(AnyJSON),
    "float_budget": Num(low=0), "time_bound_s": Opt(Num(low=0)), "seconds": Num(low=0), "note": str,
}, required=("mode", "chosen"))
CALIBRATION = Rec({
    "data": Opt(str), "data_sha256": Opt(str), "random_data": bool, "samples": COUNT, "seq_len": COUNT,
    "batch_size": COUNT, "scales": DictOf(DictOf(AnyJSON)), "accuracy_budget": Opt(DictOf(AnyJSON)),
    "experts": Opt(DictOf(AnyJSON)), "recipe": Opt(RECIPE),
})
SHAPE_RANGE = Rec({"min": ListOf(COUNT), "opt": ListOf(COUNT), "max": ListOf(COUNT)}, required=("min", "opt", "max"))
PROFILE = Rec({"index": COUNT, "name": str, "shapes": DictOf(SHAPE_RANGE)}, required=("index", "name", "shapes"))
LIMITS = Rec({"max_batch": POSITIVE, "max_context": POSITIVE}, required=("max_batch", "max_context"))
ENGINE = Rec({
    "file": RelPath(), "tensorrt_version": str, "gpu": Rec({"name": str, "compute_capability": str},
                                                          required=("name", "compute_capability")),
    "strongly_typed": bool, "tf32": bool, "builder_optimization_level": Num(low=0, high=5, integer=True),
    "hardware_compatibility": str, "version_compatible": bool, "limits": LIMITS, "profiles": ListOf(PROFILE, min_len=1),
    "source": Rec({"bundle": Opt(str), "stage": Opt(str), "graph": Opt(str), "onnx_sha256": Opt(str),
                   "external_data_sha256": Opt(str)}),
    "timing_cache": Opt(DictOf(AnyJSON)),
}, required=("file", "tensorrt_version", "gpu", "limits", "profiles", "hardware_compatibility", "version_compatible"))

# export/oracle.py: the end-to-end check against transformers, or why it was not run
ORACLE = Rec({
    "oracle": Enum("transformers"), "compared": bool, "reason": str, "transformers": str,
    "inputs": Enum("text", "token ids"), "texts": COUNT,
    "tokens": COUNT, "token_ids_equal": bool, "outputs": ListOf(str), "scope": str, "noise": str,
    "noise_multiple": Num(low=0),
    "worst": Rec({"output": str, "metric": str, "value": Num(low=0), "noise": Num(low=0), "ratio": Num(low=0)}),
    "passed": bool,
}, required=("oracle", "compared"))

MANIFEST_SCHEMA = Rec({
    "format": Enum("kvforge-bundle"), "format_version": COUNT, "stage": Enum(*STAGES),
    # graphs: role -> file, every graph of the bundle (`graph` the one that generates); absent in bundles written
    # before export always wrote it (kvforge.bundle derives it from their layout)
    "graph": RelPath(), "external_data": Opt(RelPath()), "graphs": DictOf(RelPath()),
    "model": DictOf(AnyJSON),  # field by field below, by architecture
    "io": IO, "precision": PRECISION, "opset": Opt(POSITIVE), "files": FILES, "lineage": LINEAGE,
    "validation": Opt(VALIDATION), "lint": Opt(LINT), "ecosystem": Opt(ECOSYSTEM), "calibration": Opt(CALIBRATION),
    "oracle": Opt(ORACLE), "weight_sharing": Opt(Rec({"stored_bytes": COUNT, "shared_bytes": COUNT})),
    "engine": Opt(ENGINE), "engines": Opt(DictOf(DictOf(AnyJSON))),
}, required=("format", "graph", "model", "io", "precision", "files"))

# the model entries every backend and `inspect` read, by architecture (the rest have defaults in the configs)
_COMMON = ("family", "vocab_size", "n_layers", "dim", "n_heads", "n_kv_heads", "max_seq_len")
MODEL_REQUIRED = {"decoder": (*_COMMON, "head_dim"), "encoder": _COMMON, "perceiver": _COMMON, "encoder-decoder": _COMMON,
                  "vision-language": ("vision", "decoder", "image_token_id", "image_processing")}
# written beside the config's own fields so that every backend reads the same names
MODEL_EXTRA = {"family": str, "architecture": Enum(*ARCHITECTURES), "n_kv_heads": POSITIVE,
               "head_dim": POSITIVE, "residual_scale": float, "attn_softcap": Opt(float)}
_MODEL_SPECS: dict[str, Rec] = {}


def model_spec(architecture: str) -> Rec:
    if architecture not in _MODEL_SPECS:
        fields = {name: annotation_spec(annotation) for name, annotation in MODEL_FIELDS[architecture].items()}
        for name, spec in MODEL_EXTRA.items():
            fields.setdefault(name, spec)
        fields["architecture"] = Enum(architecture)
        _MODEL_SPECS[architecture] = Rec(fields, required=MODEL_REQUIRED[architecture])
    return _MODEL_SPECS[architecture]


def validate_manifest(manifest: Any, where: str) -> None:
    """Raise KvforgeError("<where> is damaged: ...") naming the first field that does not fit the schema."""
    try:
        check(manifest, MANIFEST_SCHEMA, "manifest")
        model = manifest["model"]
        architecture = model.get("architecture", DEFAULT_KIND)
        check(architecture, Enum(*ARCHITECTURES), "manifest.model.architecture")
        check(model, model_spec(architecture), "manifest.model")
        _check_paths(manifest)
        _check_graphs(manifest, architecture)
        _check_cache_tensors(manifest["io"])
    except SchemaError as e:
        field = e.path.removeprefix("manifest.").removeprefix("manifest")
        raise KvforgeError(f"{where} is damaged: {repr(field) if field else 'the manifest'} {e.problem}") from e


def _check_paths(m: dict[str, Any]) -> None:
    """Every file the manifest names for kvforge to open is one of the bundle's recorded files."""
    named = {"graph": m["graph"]}
    if m.get("external_data"):
        named["external_data"] = m["external_data"]
    for role, name in m.get("graphs", {}).items():
        named[f"graphs.{role}"] = name
    if m.get("engine"):
        named["engine.file"] = m["engine"]["file"]
    for name in m["files"]:
        check_file_name(name, f"manifest.files[{name[:60]!r}]")
    for field, name in named.items():
        if name not in m["files"]:
            raise SchemaError(f"manifest.{field}", f"{name!r} is not one of the bundle's recorded files")


def _check_graphs(m: dict[str, Any], architecture: str) -> None:
    """`graphs` (where written) names one file per graph role of the bundle's kind, `graph` among them."""
    if "graphs" not in m:
        return
    roles = get_kind(architecture).graph_roles
    if sorted(m["graphs"]) != sorted(roles):
        raise SchemaError("manifest.graphs", f"has the roles {sorted(m['graphs'])}; {architecture} bundles have "
                                             f"{list(roles)}")
    if m["graph"] not in m["graphs"].values():
        raise SchemaError("manifest.graph", f"{m['graph']!r} is not one of the files 'graphs' names "
                                            f"({', '.join(m['graphs'].values())})")


def check_file_name(name: str, where: str) -> None:
    """SchemaError unless `name` is one a bundle's files may have: a plain name at its top level, or an adapter's
    file, adapters/NAME/FILE."""
    parts = name.split("/")
    if len(parts) > 1 and parts[0] == ADAPTERS:
        check(name, RelPath(directories=True), where)
        if len(parts) != 3:
            raise SchemaError(where, f"lies in {ADAPTERS}/ but is not {ADAPTERS}/NAME/FILE (an adapter's file)")
    else:
        check(name, RelPath(), where)


def _check_cache_tensors(io: dict[str, Any]) -> None:
    """Each cache name is a graph input (past) or output (present) of four dimensions whose heads and features
    are sizes: the runtimes make empty caches from those two numbers."""
    for side, names, tensors in (("past", io["kv_cache"]["past"], io["inputs"]), ("present", io["kv_cache"]["present"], io["outputs"])):
        shapes = {t["name"]: t["shape"] for t in tensors}
        for i, layer in enumerate(names):
            for name in layer:
                where = f"manifest.io.kv_cache.{side}[{i}]"
                if name not in shapes:
                    raise SchemaError(where, f"names {name!r}, which is not one of the graph's {'inputs' if side == 'past' else 'outputs'}")
                shape = shapes[name]
                if len(shape) != 4 or not all(isinstance(shape[d], int) for d in (1, 3)):
                    raise SchemaError(where, f"names {name!r} of shape {shape}: a cache has 4 dimensions, the 2nd and 4th sizes")
    if len(io["kv_cache"]["past"]) != len(io["kv_cache"]["present"]):
        raise SchemaError("manifest.io.kv_cache", "has a different number of past and present layers")


def validation_summary(v: dict[str, Any]) -> str:
    """One line for an export's validation record, whatever the architecture: per output its worst case (a
    decoder's logits, an encoder's outputs, an encoder-decoder's two graphs) and the lockstep decode if one ran."""
    parts = {"logits": v["logits"]} if "logits" in v else dict(v.get("outputs", {}))
    for graph in ("encoder", "decoder"):
        parts.update({f"{graph} {name}": metric for name, metric in v.get(graph, {}).items()})
    shown = "; ".join(f"{name} max abs {x['max_abs']:.2e}, rel L2 {x['rel_l2']:.2e}" for name, x in parts.items())
    lock = v.get("lockstep")
    return (f"{'passed' if v['passed'] else 'FAILED'} vs {v['reference']} over {v['cases']} shapes"
            + (f"; {shown}" if shown else "")
            + (f"; {lock['steps']}-step lockstep, greedy {lock['greedy_matching_steps']}/{lock['steps']}" if lock else ""))


def oracle_summary(o: dict[str, Any] | None) -> str:
    """One line for an export's end-to-end check against transformers (export/oracle.py)."""
    if not o:
        return "transformers end to end: not run"
    if not o["compared"]:
        return f"transformers end to end: not compared ({o['reason']})"
    w = o["worst"]
    inputs = (f"token ids equal on {o['texts']} texts" if o.get("token_ids_equal")
              else f"on {o['texts']} rows of token ids (no tokenizer)")
    return f"transformers end to end: {inputs}, {w['output']} within {w['ratio']:.1f}x its FP32 rounding"


# export/lint.py's rules that a graph fails whatever runs it (a node reading nothing, weights missing from their
# file), not TensorRT's alone: a bundle in an ONNX Runtime form still reports these as a failed lint
GRAPH_DEFECT_RULES = ("structure", "external-data")


def lint_summary(m: dict[str, Any]) -> str:
    """One line for a bundle's TensorRT lint (export/lint.py): passed, FAILED with its first error, or, for a
    quantization TensorRT cannot take by design (per-token activations, asymmetric INT4 blocks, a checkpoint's
    unsigned codes: ONNX Runtime's forms, which the automatic recipe may choose), that it is not a TensorRT bundle
    and why, instead of one error per node (or a pass that a build would then refuse)."""
    from kvforge.tensorrt_env import tensorrt_refusal

    result = m.get("lint") or {}
    errors = [f for f in result.get("findings", []) if f["severity"] == "error"]
    defects = [f for f in errors if f["rule"] in GRAPH_DEFECT_RULES]
    refusal = tensorrt_refusal((m.get("precision") or {}).get("quantization"))
    if refusal and not defects:  # (whether or not the graph's nodes pass: a build is refused first)
        return f"lint: for ONNX Runtime, not TensorRT ({refusal})"
    if result.get("passed"):
        return "lint passed"
    first = (defects or errors or [None])[0]
    return (f"lint FAILED ({result.get('errors')} errors, {result.get('warnings')} warnings"
            + (f"; first: {first['message']}" if first else "") + ")")


def print_manifest(path, m: dict[str, Any], console) -> None:
    """A validated manifest for people (`kvforge inspect`): model, precision, IO, files, validation, engine, lint,
    lineage."""
    from rich.table import Table

    cfg = m["model"]
    text = cfg["decoder"] if isinstance(cfg.get("decoder"), dict) else cfg  # a vision-language model's decoder
    vision = cfg.get("vision") if isinstance(cfg.get("vision"), dict) else None
    console.print(f"[bold]{path}[/]  stage {m.get('stage')}, graph {m.get('graph')}, opset {m.get('opset')}")
    console.print(
        f"model: {cfg['family']} {text['n_layers']} layers x {text['dim']}, heads {text['n_heads']}/{text.get('n_kv_heads')}, "
        f"vocab {text['vocab_size']}"
        + (f"; image encoder {vision['n_layers']} layers x {vision['dim']}, {vision['image_size']} px images in "
           f"{vision['patch_size']} px patches" if vision else "")
        + f"; precision {m['precision']['dtype']}"
        + (f", quantized {m['precision']['quantization']}" if m["precision"].get("quantization") else "")
    )
    io = m["io"]
    table = Table(title=f"IO (max context {io.get('max_context')})")
    for col in ("", "name", "dtype", "shape"):
        table.add_column(col)
    for kind in ("inputs", "outputs"):
        for t in io[kind]:
            table.add_row(kind[:-1], t["name"], t["dtype"], str(t["shape"]))
    console.print(table)
    files = Table(title="files")
    files.add_column("file")
    files.add_column("bytes", justify="right")
    files.add_column("sha256")
    for name, rec in m.get("files", {}).items():
        files.add_row(name, f"{rec['bytes']:,}", rec["sha256"][:16])
    console.print(files)
    if m.get("validation"):
        console.print("validation: " + validation_summary(m["validation"]))
    engine = m.get("engine")
    if engine:
        lim = engine["limits"]
        console.print(
            f"engine: TensorRT {engine['tensorrt_version']} for {engine['gpu']['name']} (compute capability "
            f"{engine['gpu']['compute_capability']}), max batch {lim['max_batch']}, max context {lim['max_context']}, "
            f"hardware compatibility {engine['hardware_compatibility']}, version compatible {engine['version_compatible']}"
        )
        for prof in engine["profiles"]:
            shapes = ", ".join(f"{n} {b['min']}..{b['max']}" for n, b in prof["shapes"].items() if n in ("input_ids", "attention_mask"))
            console.print(f"  profile {prof['index']} {prof['name']}: {shapes}")
    if m.get("lint"):
        console.print(f"{lint_summary(m)} (when written)")
    for entry in m.get("lineage", []):
        given = entry.get("input", {})
        console.print(f"lineage: {entry['stage']} by {entry['tool']} at {entry['time']} from {given.get('source')} "
                      f"({given.get('kind')}, sha256 {(given.get('sha256') or '-')[:16]}), options {entry.get('options', {})}")


def session_format(quant_format: str | None, weight_only: bool) -> str | None:
    """The kvforge.ort_session.QUANT_SESSION_CONFIG key of a Q/DQ format: the format itself, except weight-only
    INT8 ("int8-weights")."""
    return "int8-weights" if quant_format == "int8" and weight_only else quant_format
