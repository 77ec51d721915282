"""What an engine build plans and checks before TensorRT runs, and the thin TensorRT compile itself.

Shared by the one-graph build of a decoder (engine.py) and the one-engine-per-graph build of the other kinds
(engine_graphs.py): limits, profiles and their corners, the graph's IO against the spec, shape inference at
every corner, the precision summary, and `compile_engine` (docs/engine.md).
"""

from __future__ import annotations

import collections
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kvforge.bundle import (
    BATCH,
    FEATURE_ROWS,
    PAST,
    SEQ,
    TOTAL,
    IOSpec,
    window_dims,
)
from kvforge.adapters import LORA_WIDTH
from kvforge.errors import KvforgeError
from kvforge.onnx_graph import TYPE_NAMES, value_types
from kvforge.tensorrt_env import (
    DECODE,
    HARDWARE_COMPATIBILITY,
    PREFILL,
    TrtLogger,
    concrete_shape,
)


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


def resolve_limits(io: IOSpec, max_batch: int | None = None, *, max_context: int | None = None,
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
    lora = io.extra.get("lora")
    # LoRA slots: the step's adapters side by side, from one column (none) to every row its own at the max rank
    widths = {"min": 1, "opt": lora["max_rank"] * L.opt_batch, "max": lora["max_rank"] * L.max_batch} if lora else None

    vision = io.extra.get("vision")

    def point(batch: int, seq: int, past: int, corner: str) -> dict[str, int]:
        values = io.dim_values(batch, seq, past)
        if widths:
            values[LORA_WIDTH] = widths[corner]
        if vision:  # a vision-language decoder: a prefill's image tokens take feature rows, a decode step's none
            values[FEATURE_ROWS] = 0 if seq == 1 or corner == "min" else \
                (min(vision["image_tokens"], seq) * batch if corner == "opt" else batch * seq)
        return values

    return {
        PREFILL: {"min": point(1, 1, 0, "min"), "opt": point(L.opt_batch, L.opt_context, 0, "opt"),
                  "max": point(L.max_batch, L.max_context, 0, "max")},
        DECODE: {"min": point(1, 1, 0, "min"), "opt": point(L.opt_batch, 1, L.opt_context - 1, "opt"),
                 "max": point(L.max_batch, 1, L.max_context - 1, "max")},
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
    types = value_types(_shape_skeleton(model))
    qdq: dict[str, collections.Counter] = {"QuantizeLinear": collections.Counter(), "DequantizeLinear": collections.Counter()}
    ops = collections.Counter(n.op_type for n in model.graph.node)
    for node in model.graph.node:
        if node.op_type in qdq:
            tensor = node.output[0] if node.op_type == "QuantizeLinear" else node.input[0]
            qdq[node.op_type][TYPE_NAMES.get(types.get(tensor, 0), "?")] += 1
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
def compile_engine(trt, graph: Path, profiles: list[dict[str, Any]], options: BuildOptions,
                  timing_cache: bytes | None) -> tuple[bytes, bytes]:
    """Parse, configure and build with TensorRT; returns (serialized engine, serialized timing cache).

    Direct TensorRT calls rather than Polygraphy's loaders, so that TensorRT's
    own error messages end up in the one KvforgeError a failed build raises.
    """

    log = TrtLogger.get(trt)
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


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
