"""`kvforge build` for encoders, encoder-decoders and vision-language models: one engine per graph, profiles from
each graph's IO spec.

    encoder (BERT, RoBERTa, Perceiver)   model.onnx -> model.engine
        profile 0 "encode"      batch 1..max_batch, sequence_length 1..max_context

    encoder-decoder (T5, BART)           encoder_model.onnx -> encoder_model.engine
        profile 0 "encode"      batch 1..max_batch, encoder_sequence_length 1..max_context
                                         decoder_model.onnx -> decoder_model.engine
        profile 0 "first step"  decoder_sequence_length 1..max_context, past 0   (the start token, or teacher forcing)
        profile 1 "decode"      decoder_sequence_length 1, past 0..max_context - 1
                                (both: encoder_sequence_length 1..max_context, the source's)

    vision-language (LLaVA, Idefics2/3)  vision.onnx -> vision.engine
        profile 0 "images"      images 1..max_batch x the tiles one image can make
                                         decoder.onnx -> decoder.engine
        profile 0 "prefill", 1 "decode" as a decoder LM's (export/engine_plan.py), with image_feature_rows
                                0..max_batch x max_context in prefill (the prompts' image tokens), 0 in decode

Each engine is built strongly typed with the decoder engine's settings
(export/engine.py); the checks that need no TensorRT (every profile corner
consistent, ONNX shape inference at each, the graph's IO against the spec,
lint, precision) run first and make the dry-run plan. The two graphs of an
encoder-decoder share one weight file, which TensorRT's parser reads beside
each graph.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, NamedTuple

from kvforge.bundle import BATCH, HEIGHT, IMAGE_TOKENS, IMAGES, SEQ, WIDTH, Bundle, IOSpec, TensorSpec
from kvforge.derived import write_derived
from kvforge.errors import KvforgeError
from kvforge.images import ImageProcessing
from kvforge.tensorrt_env import concrete_shape

from .engine_plan import (POINTS, BuildOptions, Limits, check_graph, check_profiles, compile_engine, infer_profile_shapes,
                          precision_summary, resolve_limits, synthesize_profiles)
from .lint import lint
from .seq2seq_export import DEC_PAST, DEC_SEQ, DEC_TOTAL, ENC_SEQ


class GraphSpec(NamedTuple):
    role: str
    graph: str  # its file in the bundle
    io: IOSpec
    profiles: Callable[[IOSpec, Limits], list[dict[str, Any]]]
    check: Callable[[IOSpec, list[dict[str, Any]], int], None]  # (io, profiles, max context): every corner computable


def graph_specs(bundle: Bundle) -> list[GraphSpec]:
    """Each graph of an encoder, encoder-decoder or vision-language bundle (Bundle.graphs): its IO spec and its
    profiles."""
    graphs, io = bundle.graphs, bundle.io
    if not bundle.kind.multi_graph:
        (role, graph), = graphs.items()
        return [GraphSpec(role, graph, io, _whole_input_profiles, check_corners)]
    side, _ = bundle.kind.graph_roles  # the graph beside the decoder ("encoder", "vision"): its own IO in io.extra
    if side not in io.extra:
        raise KvforgeError(f"{bundle.path}'s manifest has no io.extra.{side} entry: the {side} graph's IO")
    side_io = IOSpec([TensorSpec.from_dict(t) for t in io.extra[side]["inputs"]],
                     [TensorSpec.from_dict(t) for t in io.extra[side]["outputs"]], [], [], max_context=io.max_context)
    if side == "encoder":
        return [GraphSpec("encoder", graphs["encoder"], side_io, _source_profiles, check_corners),
                GraphSpec("decoder", graphs["decoder"], io, _step_profiles, check_corners)]
    # a vision-language decoder: the KV-cache decoder's prefill and decode profiles (engine_plan.py)
    processing, v = ImageProcessing(**bundle.model_config["image_processing"]), bundle.model_config["vision"]
    # the sides the graph takes: pixels, or (Qwen2-VL: flattened patches) patches
    nominal = v["image_size"] // v["patch_size"] if v.get("patch_input") == "patches" else v["image_size"]
    side_io.extra.update(max_tiles=processing.max_tiles, side_bounds=processing.side_bounds, image_size=nominal,
                         merge_size=v.get("merge_size", 1))
    return [GraphSpec("vision", graphs["vision"], side_io, _image_profiles, check_corners),
            GraphSpec("decoder", graphs["decoder"], io, synthesize_profiles, check_profiles)]


def _profile(index: int, name: str, used_for: str, io: IOSpec, dims: dict[str, dict[str, int]]) -> dict[str, Any]:
    shapes = {t.name: {p: list(concrete_shape(t.shape, dims[p], t.name)) for p in POINTS} for t in io.inputs}
    return {"index": index, "name": name, "used_for": used_for, "dims": dims, "shapes": shapes}


def _whole_input_profiles(io: IOSpec, L: Limits) -> list[dict[str, Any]]:
    """A one-graph encoder: every call takes the whole input."""
    return [_profile(0, "encode", "every call", io, {
        "min": {BATCH: 1, SEQ: 1}, "opt": {BATCH: L.opt_batch, SEQ: L.opt_context},
        "max": {BATCH: L.max_batch, SEQ: L.max_context}})]


def _source_profiles(io: IOSpec, L: Limits) -> list[dict[str, Any]]:
    """An encoder-decoder's encoder: once per source."""
    return [_profile(0, "encode", "once per source", io, {
        "min": {BATCH: 1, ENC_SEQ: 1}, "opt": {BATCH: L.opt_batch, ENC_SEQ: L.opt_context},
        "max": {BATCH: L.max_batch, ENC_SEQ: L.max_context}})]


def _image_profiles(io: IOSpec, L: Limits) -> list[dict[str, Any]]:
    """A vision-language model's vision graph: the images (tiles) of the prompts a step prefills, up to max_batch
    prompts of as many tiles as the processing cuts one image into (a whole image: one)."""
    dims = {"min": {IMAGES: 1}, "opt": {IMAGES: L.opt_batch}, "max": {IMAGES: L.max_batch * io.extra.get("max_tiles", 1)}}
    if io.extra.get("side_bounds"):  # images keep their own sizes: each side within the processing's bounds
        low, high = io.extra["side_bounds"]
        opt = min(max(io.extra["image_size"], low), high)
        for corner, side in (("min", low), ("opt", opt), ("max", high)):
            dims[corner].update({HEIGHT: side, WIDTH: side})
            # features per image where its patch grid decides them (Qwen2-VL): a side x side grid's merge blocks
            dims[corner][IMAGE_TOKENS] = (side // io.extra.get("merge_size", 1)) ** 2
    return [_profile(0, "images", "every call", io, dims)]


def _step_profiles(io: IOSpec, L: Limits) -> list[dict[str, Any]]:
    """An encoder-decoder's decoder: the first step, then decode steps (total = past + new <= max context)."""

    def point(batch, source, seq, past):
        return {BATCH: batch, ENC_SEQ: source, DEC_SEQ: seq, DEC_PAST: past, DEC_TOTAL: past + seq}

    return [
        _profile(0, "first step", f"{DEC_PAST} == 0", io, {
            "min": point(1, 1, 1, 0), "opt": point(L.opt_batch, L.opt_context, 1, 0),
            "max": point(L.max_batch, L.max_context, L.max_context, 0)}),
        _profile(1, "decode", f"{DEC_PAST} > 0", io, {
            "min": point(1, 1, 1, 0), "opt": point(L.opt_batch, L.opt_context, 1, min(L.opt_context, L.max_context - 1)),
            "max": point(L.max_batch, L.max_context, 1, L.max_context - 1)}),
    ]


def check_corners(io: IOSpec, profiles: list[dict[str, Any]], max_context: int) -> None:
    """Every corner a point the graph can compute (the encoder-decoder's totals), min <= opt <= max."""
    for prof in profiles:
        for point in POINTS:
            v = prof["dims"][point]
            if DEC_TOTAL in v and (v[DEC_TOTAL] != v[DEC_PAST] + v[DEC_SEQ] or v[DEC_TOTAL] > max_context):
                raise KvforgeError(f"profile {prof['name']!r} {point}: {v} is not a point the decoder can compute")
        for name, box in prof["shapes"].items():
            if not all(a <= b <= c for a, b, c in zip(box["min"], box["opt"], box["max"])):
                raise KvforgeError(f"profile {prof['name']!r}: {name} needs min <= opt <= max, got {box}")


def multi_graph_plan(b: Bundle, max_batch, max_context, opt_batch, opt_context, options: BuildOptions) -> dict[str, Any]:
    """The dry-run plan of an encoder or encoder-decoder bundle: per graph, its profiles and checks."""
    import onnx

    limits = resolve_limits(b.io, max_batch, max_context=max_context, opt_batch=opt_batch, opt_context=opt_context)
    b.load_graph(external_data=False)  # refuses external data outside the bundle
    graphs = []
    for role, name, io, make_profiles, check in graph_specs(b):
        profiles = make_profiles(io, limits)
        check(io, profiles, limits.max_context)
        model = onnx.load(str(b.path / name), load_external_data=False)
        check_graph(model, io)
        points = infer_profile_shapes(model, io, profiles)
        graphs.append({
            "role": role, "graph": name, "engine": Path(name).with_suffix(".engine").name, "profiles": profiles,
            "shape_check": {"method": "ONNX shape inference, strict, at every profile corner", "points": points, "passed": True},
            "precision": precision_summary(model, b.manifest), "lint": lint(b.path / name),
        })
    return {"graphs": graphs, "limits": asdict(limits)}


def multi_graph_text(plan: dict[str, Any]) -> list[str]:
    lines = []
    for g in plan["graphs"]:
        lines.append(f"engine {g['engine']} from {g['graph']} ({g['role']}):")
        for prof in g["profiles"]:
            lines.append(f"  profile {prof['index']} {prof['name']!r} (used when {prof['used_for']}):")
            width = max(len(n) for n in prof["shapes"])
            for name, box in prof["shapes"].items():
                lines.append(f"    {name:<{width}}  min {box['min']}  opt {box['opt']}  max {box['max']}")
        lt, p = g["lint"], g["precision"]
        lines.append(f"  shape check: passed ({g['shape_check']['points']} points); lint: "
                     f"{'passed' if lt['passed'] else 'FAILED'} ({lt['errors']} errors, {lt['warnings']} warnings); "
                     f"precision: {p['dtype']} graph, {p['quantization'] or 'no quantization'}, {p['matmuls']} MatMul/Gemm")
    return lines


def build_graphs(trt, device, source: Bundle, plan: dict[str, Any], out, force: bool, options: BuildOptions,
                 started: float, progress) -> Bundle:
    """One engine per graph (TensorRT present); the engine bundle records each with its profiles."""

    built = {}
    for i, g in enumerate(plan["graphs"]):
        progress("build", i, len(plan["graphs"]))
        t0 = time.time()
        engine, _ = compile_engine(trt, source.path / g["graph"], g["profiles"], options, None)
        built[g["role"]] = (g, engine, round(time.time() - t0, 2))
    progress("build", len(plan["graphs"]), len(plan["graphs"]))
    files = source.manifest.get("files", {})
    settings = {k: v for k, v in asdict(options).items() if k != "timing_cache"}
    main, main_profiles = next((g["engine"], g["profiles"]) for g, _, _ in built.values()
                               if g["graph"] == source.manifest["graph"])

    def write(tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
        for g, engine, _ in built.values():
            (tmp / g["engine"]).write_bytes(engine)
        entries = dict(
            graph=main, external_data=None,
            engines={role: {"file": g["engine"], "profiles": g["profiles"], "source_graph": g["graph"],
                            "onnx_sha256": files.get(g["graph"], {}).get("sha256"), "seconds": s}
                     for role, (g, _, s) in built.items()},
            # `engine` describes the main graph's engine (the bundle's `graph`), as a one-engine bundle's does
            engine={"file": main, "tensorrt_version": trt.__version__, "gpu": {"name": device["name"],
                    "compute_capability": device["compute_capability"]}, "strongly_typed": True,
                    "limits": plan["limits"], "profiles": main_profiles, **settings},
            graphs={role: g["engine"] for role, (g, _, _) in built.items()},
        )
        lineage = {"options": plan["limits"], "versions": {"tensorrt": trt.__version__},
                   "seconds": {"total": round(time.time() - started, 2)}}
        return entries, lineage

    return write_derived(source, out, force, "build", write)
