"""`kvforge build`: an ONNX bundle -> a TensorRT engine bundle, strongly typed, with prefill and decode profiles.

Precision lives in the graph (docs/design.md): the network is created strongly
typed (TensorRT 10: the STRONGLY_TYPED creation flag; TensorRT 11: always, the
flag is ignored or absent), no precision flag is set, and TF32 is off unless
asked for, so an FP32 graph is computed in FP32 and a Q/DQ graph in what its
Q/DQ say.

One engine with two optimization profiles, not two engines: the weights are
stored once (two engines would hold two copies, on disk and in GPU memory),
TensorRT still picks kernels per profile for that profile's opt shapes, and a
session switches profile at most twice per generation (prefill -> decode ->
the next prefill), an asynchronous call that costs far less than one step.

    profile 0 "prefill"  sequence_length 1..max_context, past 0          (used for seq > 1)
    profile 1 "decode"   sequence_length 1, past 0..max_context - 1      (used for seq == 1)

Every corner (min, opt, max) of each profile is a consistent point of the
graph: total_sequence_length = past_sequence_length + sequence_length <=
max_context. Before any build, on the CPU: the limits are checked, the graph's
inputs and outputs are compared with the IO spec, and ONNX shape inference
runs at each corner with concrete shapes (strict mode), so a shape conflict is
reported with the profile and point that cause it, not as a TensorRT error
after minutes of building.

Everything that needs no TensorRT is a pure function here (limits, profiles,
checks, precision summary, the dry-run plan, the engine manifest); the
TensorRT part (`_build_engine`) is kept thin.
"""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import kvforge
from kvforge.bundle import (
    BATCH,
    PAST,
    SEQ,
    TOTAL,
    Bundle,
    IOSpec,
    check_output_path,
    now_utc,
    sha256_file,
    staged_bundle,
    window_dims,
    write_manifest,
)
from kvforge.errors import KvforgeError
from kvforge.runtime.trt_backend import (
    DECODE,
    ENGINE_FILE,
    HARDWARE_COMPATIBILITY,
    INSTALL,
    PREFILL,
    concrete_shape,
    is_engine_bundle,
    check_precision_supported,
    require_tensorrt_gpu,
    tensorrt_version,
)

from .lint import _TYPE_NAMES, _value_types, lint

DEFAULT_MAX_BATCH = 8  # runtime.evaluate scores windows in batches of 8
DEFAULT_OPT_BATCH = 1
DEFAULT_OPT_CONTEXT = 256
DEFAULT_OPTIMIZATION_LEVEL = 3  # TensorRT's default; 0..5 trade build time for kernel search
POINTS = ("min", "opt", "max")
_ELEM_TYPES = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32", 11: "float64", 9: "bool"}
# Initializers larger than this are replaced by typed graph inputs for shape inference (shapes, not values, matter).
_SKELETON_MAX_ELEMENTS = 1024

Progress = Callable[[str, int, int], None]


# -- limits and options ---------------------------------------------------------------------
@dataclass(frozen=True)
class Limits:
    max_batch: int
    max_context: int
    opt_batch: int
    opt_context: int


def resolve_limits(io: IOSpec, max_batch: int | None = None, max_context: int | None = None,
                   opt_batch: int | None = None, opt_context: int | None = None) -> Limits:
    """Fill the defaults and refuse limits that no engine could honour, before any work."""
    bundle_max = io.max_context
    if max_context is None:
        if bundle_max is None:
            raise KvforgeError("the bundle records no max context; pass --max-context")
        max_context = bundle_max
    max_batch = DEFAULT_MAX_BATCH if max_batch is None else max_batch
    for flag, value in (("--max-batch", max_batch), ("--opt-batch", opt_batch), ("--opt-context", opt_context)):
        if value is not None and value < 1:
            raise KvforgeError(f"{flag} must be at least 1, got {value}")
    if max_context < 2:
        raise KvforgeError(f"--max-context must be at least 2 (a prompt token and a new one), got {max_context}")
    if bundle_max is not None and max_context > bundle_max:
        raise KvforgeError(f"--max-context {max_context} exceeds the bundle's max context {bundle_max} "
                           "(export with a larger --max-context to build for more)")
    opt_batch = min(DEFAULT_OPT_BATCH, max_batch) if opt_batch is None else opt_batch
    opt_context = min(DEFAULT_OPT_CONTEXT, max_context) if opt_context is None else opt_context
    if opt_batch > max_batch:
        raise KvforgeError(f"--opt-batch {opt_batch} exceeds --max-batch {max_batch}")
    if opt_context > max_context:
        raise KvforgeError(f"--opt-context {opt_context} exceeds --max-context {max_context}")
    return Limits(max_batch, max_context, opt_batch, opt_context)


@dataclass(frozen=True)
class BuildOptions:
    builder_optimization_level: int = DEFAULT_OPTIMIZATION_LEVEL
    hardware_compatibility: str = "none"  # none, ampere_plus, same_compute_capability
    version_compatible: bool = False
    tf32: bool = False  # let FP32 matmuls round inputs to TF32 (faster, not what an FP32 graph says)
    timing_cache: str | None = None

    def __post_init__(self):
        if not 0 <= self.builder_optimization_level <= 5:
            raise KvforgeError(f"--builder-optimization-level must be 0..5, got {self.builder_optimization_level}")
        if self.hardware_compatibility not in HARDWARE_COMPATIBILITY:
            raise KvforgeError(f"--hardware-compatibility {self.hardware_compatibility!r} is not one of {HARDWARE_COMPATIBILITY}")


# -- profiles -------------------------------------------------------------------------------
def profile_points(limits: Limits, io: IOSpec) -> dict[str, dict[str, dict[str, int]]]:
    """The symbolic dimensions' values at each corner of the two profiles (capped caches: min(past, W), min(total, W))."""
    L = limits

    def point(batch: int, seq: int, past: int) -> dict[str, int]:
        return io.dim_values(batch, seq, past)

    return {
        PREFILL: {"min": point(1, 1, 0), "opt": point(L.opt_batch, L.opt_context, 0), "max": point(L.max_batch, L.max_context, 0)},
        DECODE: {"min": point(1, 1, 0), "opt": point(L.opt_batch, 1, L.opt_context - 1), "max": point(L.max_batch, 1, L.max_context - 1)},
    }


def synthesize_profiles(io: IOSpec, limits: Limits) -> list[dict[str, Any]]:
    """Prefill and decode profiles over every input of the IO spec: min/opt/max shapes per input name."""
    used_for = {PREFILL: f"{SEQ} > 1", DECODE: f"{SEQ} == 1"}
    profiles = []
    for index, (name, points) in enumerate(profile_points(limits, io).items()):
        shapes = {t.name: {p: list(concrete_shape(t.shape, points[p], t.name)) for p in POINTS} for t in io.inputs}
        profiles.append({"index": index, "name": name, "used_for": used_for[name], "dims": points, "shapes": shapes})
    return profiles


def check_profiles(io: IOSpec, profiles: list[dict[str, Any]], max_context: int) -> None:
    """Each corner of each profile must be a point the graph can compute; raise with the first that is not.

    The symbolic dimensions are read back from the shapes (so hand-written
    profiles are checked too): one value per symbol at each corner, static
    dimensions as in the IO spec, total = past + sequence <= max_context,
    min <= opt <= max.
    """
    for prof in profiles:
        where = f"profile {prof['name']!r}"
        missing = [t.name for t in io.inputs if t.name not in prof["shapes"]]
        if missing:
            raise KvforgeError(f"{where} gives no shapes for the inputs {missing}")
        for point in POINTS:
            values: dict[str, tuple[int, str]] = {}
            for t in io.inputs:
                shape = prof["shapes"][t.name][point]
                if len(shape) != len(t.shape):
                    raise KvforgeError(f"{where} {point}: {t.name} has rank {len(shape)}, the IO spec says {len(t.shape)} ({t.shape})")
                for axis, (dim, v) in enumerate(zip(t.shape, shape)):
                    if isinstance(dim, int) and v != dim:
                        raise KvforgeError(f"{where} {point}: {t.name} dimension {axis} is {v}, the graph's is fixed at {dim}")
                    if isinstance(dim, str):
                        seen = values.setdefault(dim, (v, t.name))
                        if seen[0] != v:
                            raise KvforgeError(f"{where} {point}: {dim} is {seen[0]} in {seen[1]} but {v} in {t.name}")
            v = {k: x for k, (x, _) in values.items()}
            if all(k in v for k in (TOTAL, PAST, SEQ)) and v[TOTAL] != v[PAST] + v[SEQ]:
                raise KvforgeError(f"{where} {point}: attention_mask's {TOTAL} {v[TOTAL]} != {PAST} {v[PAST]} + {SEQ} {v[SEQ]}")
            total = v.get(TOTAL, v.get(PAST, 0) + v.get(SEQ, 0))
            if total > max_context:
                raise KvforgeError(f"{where} {point}: {total} tokens exceed the max context {max_context}")
            for k, lo in ((BATCH, 1), (SEQ, 1), (PAST, 0)):
                if k in v and v[k] < lo:
                    raise KvforgeError(f"{where} {point}: {k} {v[k]} is below {lo}")
            expected = io.dim_values(v.get(BATCH, 1), v.get(SEQ, 0), total - v.get(SEQ, 0))  # capped: min(., W)
            for w in {w for w in io.windows if w is not None}:
                for k in window_dims(w):
                    if k in v and v[k] != expected[k]:
                        raise KvforgeError(f"{where} {point}: {k} {v[k]} should be {expected[k]} (a cache capped at {w} "
                                           f"positions over {total} tokens)")
        for name, box in prof["shapes"].items():
            if not all(a <= b <= c for a, b, c in zip(box["min"], box["opt"], box["max"])):
                raise KvforgeError(f"{where}: {name} needs min <= opt <= max, got {box['min']} / {box['opt']} / {box['max']}")


def _graph_signature(values, kind: str) -> list[tuple[str, str, list]]:
    out = []
    for v in values:
        tt = v.type.tensor_type
        dims = [d.dim_param if d.WhichOneof("value") == "dim_param" else (d.dim_value if d.WhichOneof("value") == "dim_value" else "?")
                for d in tt.shape.dim]
        out.append((v.name, _ELEM_TYPES.get(tt.elem_type, f"type {tt.elem_type}"), dims))
    return out


def check_graph(model, io: IOSpec) -> None:
    """The graph's inputs and outputs must be the IO spec's: names in order, dtypes and (symbolic) dimensions."""
    problems = []
    for kind, graph_values, spec in (("input", model.graph.input, io.inputs), ("output", model.graph.output, io.outputs)):
        initializers = {i.name for i in model.graph.initializer}
        sig = [s for s in _graph_signature(graph_values, kind) if s[0] not in initializers]
        names = [s[0] for s in sig]
        if names != [t.name for t in spec]:
            problems.append(f"graph {kind}s {names} differ from the IO spec's {[t.name for t in spec]}")
            continue
        for (name, dtype, dims), t in zip(sig, spec):
            if dtype != t.dtype:
                problems.append(f"{kind} {name} is {dtype} in the graph, {t.dtype} in the IO spec")
            if dims != list(t.shape):
                problems.append(f"{kind} {name} has dimensions {dims} in the graph, {list(t.shape)} in the IO spec")
    if problems:
        raise KvforgeError("the graph does not match the manifest's IO spec: " + "; ".join(problems[:6]))


def _shape_skeleton(model):
    """A copy for shape inference: large initializers become typed inputs (their shapes matter, not their values)."""
    import onnx
    from onnx import helper

    skel = onnx.ModelProto()
    skel.CopyFrom(model)
    g = skel.graph
    keep = []
    for init in g.initializer:
        n = 1
        for d in init.dims:
            n *= d
        if n > _SKELETON_MAX_ELEMENTS:
            g.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        else:
            keep.append(init)
    del g.initializer[:]
    g.initializer.extend(keep)
    return skel


def infer_profile_shapes(model, io: IOSpec, profiles: list[dict[str, Any]]) -> int:
    """ONNX shape inference (strict) at every profile corner; outputs must come out as the IO spec says.

    Returns the number of points checked. Raises KvforgeError naming the
    profile, the point and its dimensions when the graph cannot take them.
    """
    import onnx

    skel = _shape_skeleton(model)
    spec_inputs = {t.name for t in io.inputs}
    checked = 0
    for prof in profiles:
        for point in POINTS:
            m = onnx.ModelProto()
            m.CopyFrom(skel)
            for inp in m.graph.input:
                if inp.name not in spec_inputs:
                    continue
                dims = inp.type.tensor_type.shape.dim
                for d, v in zip(dims, prof["shapes"][inp.name][point]):
                    d.Clear()
                    d.dim_value = int(v)
            dims_text = ", ".join(f"{k}={v}" for k, v in prof.get("dims", {}).get(point, {}).items())
            where = f"profile {prof['name']!r} at its {point} point ({dims_text})"
            try:
                inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
            except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as e:
                first = str(e).strip().splitlines()
                raise KvforgeError(f"{where}: ONNX shape inference fails: {' '.join(first[:3])}") from e
            values = prof.get("dims", {}).get(point)
            if values:
                for out, t in zip(inferred.graph.output, io.outputs):
                    expected = concrete_shape(t.shape, values, t.name)
                    got = [d.dim_value if d.WhichOneof("value") == "dim_value" else None for d in out.type.tensor_type.shape.dim]
                    if got and any(g is not None and g != e for g, e in zip(got, expected)):
                        raise KvforgeError(f"{where}: output {t.name} comes out as {got}, the IO spec says {list(expected)}")
            checked += 1
    return checked


# -- precision -----------------------------------------------------------------------------
def precision_summary(model, manifest: dict[str, Any]) -> dict[str, Any]:
    """What the strongly typed build will compute in: the graph's float dtype, its Q/DQ by dtype, the recipe."""
    types = _value_types(_shape_skeleton(model))
    qdq: dict[str, collections.Counter] = {"QuantizeLinear": collections.Counter(), "DequantizeLinear": collections.Counter()}
    ops = collections.Counter(n.op_type for n in model.graph.node)
    for node in model.graph.node:
        if node.op_type in qdq:
            tensor = node.output[0] if node.op_type == "QuantizeLinear" else node.input[0]
            qdq[node.op_type][_TYPE_NAMES.get(types.get(tensor, 0), "?")] += 1
    q = manifest.get("precision", {}).get("quantization") or {}
    return {
        "dtype": manifest.get("precision", {}).get("dtype"),
        "quantization": q.get("format"),
        "weights": q.get("weights"),
        "activations": q.get("activations"),
        "kv_cache": q.get("kv_cache"),
        "quantized_layers": len(q.get("quantized_layers", [])),
        "excluded_layers": len(q.get("excluded_layers", [])),
        "qdq": {op: dict(sorted(c.items())) for op, c in qdq.items()},
        "matmuls": ops.get("MatMul", 0) + ops.get("Gemm", 0),
    }


# -- the plan ------------------------------------------------------------------------------
def _source_bundle(bundle) -> Bundle:
    b = bundle if isinstance(bundle, Bundle) else Bundle(bundle)
    if is_engine_bundle(b.manifest):
        raise KvforgeError(f"{b.path} is already a TensorRT engine bundle; build from the ONNX bundle it was built from")
    return b


def _load_graph(bundle: Bundle):
    return bundle.load_graph(external_data=False)


def build_plan(bundle, max_batch: int | None = None, max_context: int | None = None, opt_batch: int | None = None,
               opt_context: int | None = None, options: BuildOptions | None = None) -> dict[str, Any]:
    """Everything a build would do, checked on the CPU: limits, profiles, shape inference, precision, lint."""
    b = _source_bundle(bundle)
    b.verify(full=True)  # the plan is for the files the manifest records, not a truncated or altered copy
    options = options or BuildOptions()
    io = b.io
    if b.model_config.get("architecture", "decoder") != "decoder":  # one engine per graph: export/engine_graphs.py
        from .engine_graphs import multi_graph_plan

        plan = multi_graph_plan(b, max_batch, max_context, opt_batch, opt_context, options)
        tc = options.timing_cache
        return {
            "bundle": str(b.path), "graph": b.manifest["graph"], "stage": b.manifest.get("stage"),
            "opset": b.manifest.get("opset"), "architecture": b.model_config["architecture"], **plan,
            "bundle_max_context": io.max_context,
            "builder": {"strongly_typed": True, "tf32": options.tf32,
                        "builder_optimization_level": options.builder_optimization_level,
                        "hardware_compatibility": options.hardware_compatibility,
                        "version_compatible": options.version_compatible,
                        "timing_cache": None if tc is None else {"path": str(tc), "exists": Path(tc).is_file()}},
            "tensorrt": {"installed": tensorrt_version() is not None, "version": tensorrt_version()},
        }
    limits = resolve_limits(io, max_batch, max_context, opt_batch, opt_context)
    profiles = synthesize_profiles(io, limits)
    check_profiles(io, profiles, limits.max_context)
    model = _load_graph(b)
    check_graph(model, io)
    points = infer_profile_shapes(model, io, profiles)
    tc = options.timing_cache
    return {
        "bundle": str(b.path),
        "graph": b.manifest["graph"],
        "stage": b.manifest.get("stage"),
        "opset": b.manifest.get("opset"),
        "limits": asdict(limits),
        "bundle_max_context": io.max_context,
        "profiles": profiles,
        "shape_check": {"method": "ONNX shape inference, strict, at every profile corner", "points": points, "passed": True},
        "precision": precision_summary(model, b.manifest),
        "lint": lint(model),
        "builder": {
            "strongly_typed": True,
            "tf32": options.tf32,
            "builder_optimization_level": options.builder_optimization_level,
            "hardware_compatibility": options.hardware_compatibility,
            "version_compatible": options.version_compatible,
            "timing_cache": None if tc is None else {"path": str(tc), "exists": Path(tc).is_file()},
        },
        "tensorrt": {"installed": tensorrt_version() is not None, "version": tensorrt_version()},
    }


def plan_text(plan: dict[str, Any]) -> str:
    """The dry-run plan for people: one block per profile, then precision, lint and builder settings."""
    lim = plan["limits"]
    lines = [
        f"build plan for {plan['bundle']} ({plan['graph']}, stage {plan['stage']}, opset {plan['opset']})",
        f"limits: max batch {lim['max_batch']} (opt {lim['opt_batch']}), max context {lim['max_context']} "
        f"(opt {lim['opt_context']}; the bundle allows {plan['bundle_max_context']})",
    ]
    if "graphs" in plan:  # an encoder or encoder-decoder: one engine per graph
        from .engine_graphs import multi_graph_text

        return "\n".join(lines + multi_graph_text(plan) + _builder_lines(plan))
    p = plan["precision"]
    for prof in plan["profiles"]:
        lines.append(f"profile {prof['index']} {prof['name']!r} (used when {prof['used_for']}):")
        width = max(len(n) for n in prof["shapes"])
        for name, box in prof["shapes"].items():
            lines.append(f"  {name:<{width}}  min {box['min']}  opt {box['opt']}  max {box['max']}")
    sc = plan["shape_check"]
    lines.append(f"shape check: passed ({sc['method']}: {sc['points']} points)")
    counts = "; ".join(f"{op} " + ", ".join(f"{t} x{n}" for t, n in c.items()) for op, c in p["qdq"].items() if c) or "none"
    quant = (f"quantization {p['quantization']} ({p['weights']} weights, {p['activations'] or 'float'} activations"
             + (f", {p['kv_cache']} KV cache" if p["kv_cache"] else "") + f"; {p['quantized_layers']} layers quantized, "
             f"{p['excluded_layers']} in float)") if p["quantization"] else "no quantization"
    lines.append(f"precision: {p['dtype']} graph, {quant}; Q/DQ nodes: {counts}; {p['matmuls']} MatMul/Gemm")
    lt = plan["lint"]
    lines.append(f"lint: {'passed' if lt['passed'] else 'FAILED'} ({lt['errors']} errors, {lt['warnings']} warnings)")
    for f in lt["findings"][:10]:
        where = f" [{f['op']} {f['node']}]" if f["node"] else ""
        lines.append(f"  {f['severity']}: {f['rule']}{where}: {f['message']}")
    return "\n".join(lines + _builder_lines(plan))


def _builder_lines(plan: dict[str, Any]) -> list[str]:
    bo = plan["builder"]
    tc = bo["timing_cache"]
    trt = plan["tensorrt"]
    return [
        f"builder: strongly typed, TF32 {'on' if bo['tf32'] else 'off'}, optimization level {bo['builder_optimization_level']}, "
        f"hardware compatibility {bo['hardware_compatibility']}, version compatible {'yes' if bo['version_compatible'] else 'no'}, "
        + (f"timing cache {tc['path']} ({'reused' if tc['exists'] else 'new'})" if tc else "no timing cache file"),
        f"tensorrt: {trt['version']} installed" if trt["installed"] else f"tensorrt: not installed here; the build itself needs it. {INSTALL}",
    ]


# -- the manifest --------------------------------------------------------------------------
def engine_manifest(source: dict[str, Any], *, source_path: str, tensorrt_version: str, gpu_name: str,
                    compute_capability: str, profiles: list[dict[str, Any]], limits: dict[str, int],
                    options: dict[str, Any], timing_cache: dict[str, Any] | None, lint_result: dict[str, Any],
                    seconds: dict[str, float]) -> dict[str, Any]:
    """The engine bundle's manifest from the source manifest and the facts of the build (pure: testable with any facts)."""
    files = source.get("files", {})
    graph, data = source["graph"], source.get("external_data")
    manifest = {k: v for k, v in source.items() if k not in ("format", "format_version", "files", "validation", "lint")}
    manifest.update(
        stage="build",
        graph=ENGINE_FILE,
        external_data=None,
        io={**source["io"], "max_context": limits["max_context"]},
        engine={
            "file": ENGINE_FILE,
            "tensorrt_version": tensorrt_version,
            "gpu": {"name": gpu_name, "compute_capability": compute_capability},
            "strongly_typed": True,
            "tf32": bool(options.get("tf32", False)),
            "builder_optimization_level": options.get("builder_optimization_level", DEFAULT_OPTIMIZATION_LEVEL),
            "hardware_compatibility": options.get("hardware_compatibility", "none"),
            "version_compatible": bool(options.get("version_compatible", False)),
            "limits": dict(limits),
            "profiles": profiles,
            "source": {
                "bundle": source_path,
                "stage": source.get("stage"),
                "graph": graph,
                "onnx_sha256": files.get(graph, {}).get("sha256"),
                "external_data_sha256": files.get(data, {}).get("sha256") if data else None,
            },
            "timing_cache": timing_cache,
        },
        lint=lint_result,
        lineage=source.get("lineage", []) + [{
            "stage": "build",
            "tool": f"kvforge {kvforge.__version__}",
            "time": now_utc(),
            "input": {"source": source_path, "kind": "bundle", "sha256": files.get(graph, {}).get("sha256")},
            "options": {**limits, **options},
            "versions": {"tensorrt": tensorrt_version},
            "seconds": seconds,
        }],
    )
    return manifest


# -- the build -----------------------------------------------------------------------------
def _build_engine(trt, graph: Path, profiles: list[dict[str, Any]], options: BuildOptions,
                  timing_cache: bytes | None) -> tuple[bytes, bytes]:
    """Parse, configure and build with TensorRT; returns (serialized engine, serialized timing cache).

    Direct TensorRT calls rather than Polygraphy's loaders, so that TensorRT's
    own error messages end up in the one KvforgeError a failed build raises.
    """
    from kvforge.runtime.trt_backend import _Log

    log = _Log.get(trt)
    log.errors.clear()
    builder = trt.Builder(log)
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)  # TensorRT 11: always strongly typed
    network = builder.create_network(1 << int(flag) if flag is not None else 0)
    parser = trt.OnnxParser(network, log)
    if not parser.parse_from_file(str(graph)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise KvforgeError(f"TensorRT {trt.__version__} cannot parse {graph}: " + " | ".join(errors[:5] or [log.take()]))
    config = builder.create_builder_config()
    if not options.tf32 and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)
    config.builder_optimization_level = options.builder_optimization_level
    if options.hardware_compatibility != "none":
        level = getattr(trt.HardwareCompatibilityLevel, options.hardware_compatibility.upper(), None)
        if level is None:
            raise KvforgeError(f"TensorRT {trt.__version__} has no hardware compatibility level {options.hardware_compatibility!r}")
        config.hardware_compatibility_level = level
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)  # the plan embeds the lean runtime it needs
    network_inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    for prof in profiles:
        p = builder.create_optimization_profile()
        for name, box in prof["shapes"].items():
            if name in network_inputs:
                p.set_shape(name, box["min"], box["opt"], box["max"])
        if config.add_optimization_profile(p) != prof["index"]:
            raise KvforgeError(f"TensorRT refused the {prof['name']!r} profile: {log.take()}")
    cache = config.create_timing_cache(timing_cache or b"")
    if cache is None or not config.set_timing_cache(cache, ignore_mismatch=False):
        raise KvforgeError(f"the timing cache {options.timing_cache} was written by another TensorRT version or GPU "
                           "(or is damaged); delete it or pass another --timing-cache")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise KvforgeError(f"TensorRT {trt.__version__} could not build an engine from {graph}: {log.take()}")
    return bytes(serialized), bytes(config.get_timing_cache().serialize())


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build(bundle, out, max_batch: int | None = None, max_context: int | None = None, opt_batch: int | None = None,
          opt_context: int | None = None, options: BuildOptions | None = None, force: bool = False,
          progress: Progress | None = None) -> Bundle:
    """Build a TensorRT engine bundle at OUT from the ONNX bundle BUNDLE (see the module docstring).

    All CPU checks run first; then a missing TensorRT or GPU raises
    MissingDependencyError; nothing is written unless the build succeeds.
    """
    import hashlib

    progress = progress or (lambda phase, done, total: None)
    options = options or BuildOptions()
    started = time.time()
    progress("check", 0, 1)
    plan = build_plan(bundle, max_batch, max_context, opt_batch, opt_context, options)
    progress("check", 1, 1)
    trt, device = require_tensorrt_gpu()
    check_output_path(out, force, [plan["bundle"]])
    source = Bundle(plan["bundle"])  # build_plan verified its files against the manifest
    check_precision_supported(source.manifest["precision"].get("quantization"), device["compute_capability"], device["name"])
    if "graphs" in plan:
        from .engine_graphs import build_graphs

        return build_graphs(trt, device, source, plan, out, force, options, started, progress)
    tc_path = Path(options.timing_cache) if options.timing_cache else None
    tc_in = tc_path.read_bytes() if tc_path and tc_path.is_file() else None

    progress("build", 0, 1)
    t0 = time.time()
    engine_bytes, tc_out = _build_engine(trt, source.graph_file, plan["profiles"], options, tc_in)
    build_s = time.time() - t0
    progress("build", 1, 1)
    timing = None
    if tc_path:
        _write_atomic(tc_path, tc_out)  # reused by the next build, whatever happens to this bundle
        timing = {"path": str(tc_path), "loaded_sha256": hashlib.sha256(tc_in).hexdigest() if tc_in else None,
                  "saved_sha256": sha256_file(tc_path)}

    progress("write", 0, 1)
    with staged_bundle(out, force, [plan["bundle"]]) as tmp:
        (tmp / ENGINE_FILE).write_bytes(engine_bytes)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (source.path / name).is_file():
                shutil.copy2(source.path / name, tmp / name)
        opts = {k: v for k, v in asdict(options).items() if k != "timing_cache"}
        manifest = engine_manifest(
            source.manifest, source_path=str(source.path), tensorrt_version=trt.__version__, gpu_name=device["name"],
            compute_capability=device["compute_capability"], profiles=plan["profiles"], limits=plan["limits"],
            options=opts, timing_cache=timing, lint_result=plan["lint"],
            seconds={"build": round(build_s, 2), "total": round(time.time() - started, 2)},
        )
        write_manifest(tmp, manifest)
    progress("write", 1, 1)
    return Bundle(out)
