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

Everything that needs no TensorRT is a pure function (limits, profiles, checks
and precision summary in engine_plan.py; the dry-run plan and the engine
manifest here); the
TensorRT part (`engine_plan.compile_engine`) is kept thin.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvforge.bundle import Bundle, sha256_file
from kvforge.derived import derived_manifest, write_derived
from kvforge.errors import KvforgeError
from kvforge.outputs import check_output_path
from kvforge.tensorrt_env import (
    ENGINE_FILE,
    INSTALL,
    is_engine_bundle,
    check_precision_supported,
    require_tensorrt_gpu,
    tensorrt_version,
)

from .engine_plan import (
    DEFAULT_OPTIMIZATION_LEVEL,
    BuildOptions,
    Progress,
    check_graph,
    check_profiles,
    compile_engine,
    infer_profile_shapes,
    precision_summary,
    resolve_limits,
    synthesize_profiles,
    write_atomic,
)
from .engine_graphs import build_graphs, multi_graph_plan, multi_graph_text
from .lint import lint


def _source_bundle(bundle) -> Bundle:
    b = bundle if isinstance(bundle, Bundle) else Bundle(bundle)
    if is_engine_bundle(b.manifest):
        raise KvforgeError(f"{b.path} is already a TensorRT engine bundle; build from the ONNX bundle it was built from")
    return b


def _load_graph(bundle: Bundle):
    return bundle.load_graph(external_data=False)


def build_plan(bundle, max_batch: int | None = None, *, max_context: int | None = None, opt_batch: int | None = None,
               opt_context: int | None = None, options: BuildOptions | None = None) -> dict[str, Any]:
    """Everything a build would do, checked on the CPU: limits, profiles, shape inference, precision, lint."""
    b = _source_bundle(bundle)
    b.verify(full=True)  # the plan is for the files the manifest records, not a truncated or altered copy
    options = options or BuildOptions()
    io = b.io
    if not b.kind.kv_cache:  # no KV cache to profile prefill and decode over: one engine per graph (engine_graphs.py)
        plan = multi_graph_plan(b, max_batch, max_context, opt_batch, opt_context, options)
        tc = options.timing_cache
        return {
            "bundle": str(b.path), "graph": b.manifest["graph"], "stage": b.manifest.get("stage"),
            "opset": b.manifest.get("opset"), "architecture": b.architecture, **plan,
            "bundle_max_context": io.max_context,
            "builder": {"strongly_typed": True, "tf32": options.tf32,
                        "builder_optimization_level": options.builder_optimization_level,
                        "hardware_compatibility": options.hardware_compatibility,
                        "version_compatible": options.version_compatible,
                        "timing_cache": None if tc is None else {"path": str(tc), "exists": Path(tc).is_file()}},
            "tensorrt": {"installed": tensorrt_version() is not None, "version": tensorrt_version()},
        }
    limits = resolve_limits(io, max_batch, max_context=max_context, opt_batch=opt_batch, opt_context=opt_context)
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
def engine_records(source: dict[str, Any], *, source_path: str, tensorrt_version: str, gpu_name: str,
                   compute_capability: str, profiles: list[dict[str, Any]], limits: dict[str, int],
                   options: dict[str, Any], timing_cache: dict[str, Any] | None, lint_result: dict[str, Any],
                   seconds: dict[str, float]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The build's own manifest entries and lineage fields (kvforge.derived.derived_manifest adds them to the
    source's), from the source manifest and the facts of the build (pure: testable with any facts)."""
    files = source.get("files", {})
    graph, data = source["graph"], source.get("external_data")
    entries = dict(
        graph=ENGINE_FILE,
        graphs={"model": ENGINE_FILE},  # a decoder LM's one graph
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
    )
    lineage = {"options": {**limits, **options}, "versions": {"tensorrt": tensorrt_version}, "seconds": seconds}
    return entries, lineage


def engine_manifest(source: dict[str, Any], *, source_path: str, **facts: Any) -> dict[str, Any]:
    """The engine bundle's manifest but its files: what `build` writes (pure: engine_records' facts)."""
    return derived_manifest(source, source_path, "build", *engine_records(source, source_path=source_path, **facts))


# -- the build -----------------------------------------------------------------------------
def build(bundle, out, *, max_batch: int | None = None, max_context: int | None = None, opt_batch: int | None = None,
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
    plan = build_plan(bundle, max_batch, max_context=max_context, opt_batch=opt_batch, opt_context=opt_context,
                      options=options)
    progress("check", 1, 1)
    trt, device = require_tensorrt_gpu()
    check_output_path(out, force, [plan["bundle"]])
    source = Bundle(plan["bundle"])  # build_plan verified its files against the manifest
    check_precision_supported(source.quantization, device["compute_capability"], device["name"])
    if "graphs" in plan:
        return build_graphs(trt, device, source, plan, out, force, options, started, progress)
    tc_path = Path(options.timing_cache) if options.timing_cache else None
    tc_in = tc_path.read_bytes() if tc_path and tc_path.is_file() else None

    progress("build", 0, 1)
    t0 = time.time()
    engine_bytes, tc_out = compile_engine(trt, source.graph_file, plan["profiles"], options, tc_in)
    build_s = time.time() - t0
    progress("build", 1, 1)
    timing = None
    if tc_path:
        write_atomic(tc_path, tc_out)  # reused by the next build, whatever happens to this bundle
        timing = {"path": str(tc_path), "loaded_sha256": hashlib.sha256(tc_in).hexdigest() if tc_in else None,
                  "saved_sha256": sha256_file(tc_path)}

    progress("write", 0, 1)
    source_path = str(source.path.resolve())

    def write(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        (tmp / ENGINE_FILE).write_bytes(engine_bytes)
        opts = {k: v for k, v in asdict(options).items() if k != "timing_cache"}
        return engine_records(
            source.manifest, source_path=source_path, tensorrt_version=trt.__version__, gpu_name=device["name"],
            compute_capability=device["compute_capability"], profiles=plan["profiles"], limits=plan["limits"],
            options=opts, timing_cache=timing, lint_result=plan["lint"],
            seconds={"build": round(build_s, 2), "total": round(time.time() - started, 2)},
        )

    # the tokenizer, config.json and a slotted bundle's adapters carried (the engine serves them, and takes more)
    engine = write_derived(source, out, force, "build", write)
    progress("write", 1, 1)
    return engine
