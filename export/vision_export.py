"""A vision-language model's two graphs and their validation against the Torch reference (issue 37).

    vision.onnx   pixel_values    float32 [images, C, H, W]        -> image_features [images, P, C_text]
                  (H, W the encoder's size, or any: "height", "width", where the processing keeps each image's)
    decoder.onnx  the decoder's KV-cache contract (export/onnx_export.py), plus
                  image_features  model dtype [image_feature_rows, C_text]

The decoder graph merges the features into the text embeddings at the image tokens, in reading order
(model_defs/vision.py: merge_image_features): a prefill passes the rows of the images its prompts hold, in the
order their image tokens come (row by row), a decode step passes none ([0, C_text]). P (features per image) is
fixed by the config; the graphs do not check that a prompt's image tokens match the rows given: the runtime does.

Validation runs both graphs on ONNX Runtime against the FP32 (or float64) reference: the vision graph on 1-3
images; the decoder on prefills holding one image, two images in one row and a batch of rows with their own
image, then decode steps over those caches without features; and a greedy lockstep from an image prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvforge import metrics
from kvforge.bundle import (BATCH, FEATURE_ROWS, FEATURES, HEIGHT, IMAGE_TOKENS, IMAGES, OFFSETS, PIXELS, SEQ, WIDTH,
                            IOSpec, TensorSpec)
from kvforge.images import ImageProcessing, rope_offsets
from kvforge.errors import KvforgeError

from .encoder_export import failures_of, output_metrics
from .onnx_export import NP_DTYPES, cache_names, example_inputs, example_sizes, group_cache, input_names, rename_dims
from .onnx_export import io_spec as decoder_io_spec
from .onnx_export import layer_windows, output_names, save_program, trace
from .validate import OrtRunner

VISION_GRAPH, DECODER_GRAPH = "vision.onnx", "decoder.onnx"
LOCKSTEP_STEPS = 6
# as the encoder-decoder's (export/seq2seq_export.py): absolute bounds on FP32, relative on half precision
TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"max_abs": 1e-4, "max_abs_of_magnitude": 2e-6, "greedy_min": LOCKSTEP_STEPS},
    "float16": {"rel_l2": 1e-2},
    "bfloat16": {"rel_l2": 5e-2},
}


def _variable(cfg) -> bool:
    """The image processing keeps each image's size: the vision graph takes any height and width."""
    return ImageProcessing(**cfg.image_processing).variable_size


def _patches(cfg) -> bool:
    """The vision graph takes each image's flattened patches (rows, cols, C*T*P*P): Qwen2-VL's."""
    return cfg.vision_config.patch_input == "patches"


def _mrope(cfg) -> bool:
    """The decoder turns multimodal RoPE: its graph takes rope_offsets (batch, 3, sequence)."""
    return cfg.decoder_config.mrope_section is not None


def example_pixels(cfg, n: int, size: tuple[int, int], generator) -> torch.Tensor:
    """Random pixel_values for n images of size (height, width) pixels: images, or their flattened patches."""
    v = cfg.vision_config
    if not _patches(cfg):
        return torch.randn(n, v.channels, *size, generator=generator)
    m, width = v.merge_size, v.channels * v.temporal_patch_size * v.patch_size ** 2
    rows, cols = (max(m, side // v.patch_size // m * m) for side in size)
    return torch.randn(n, rows, cols, width, generator=generator)


def _pixel_dims(cfg) -> list:
    v = cfg.vision_config
    if _patches(cfg):
        return [HEIGHT, WIDTH, v.channels * v.temporal_patch_size * v.patch_size ** 2]
    side = v.image_size
    return [v.channels, HEIGHT, WIDTH] if _variable(cfg) else [v.channels, side, side]


def _image_sizes(cfg, n: int) -> list[tuple[int, int]]:
    """The sizes the validation's images take: the encoder's own, and where it takes any size, smaller and wider
    ones too (whole patches and not)."""
    side, patch = cfg.vision_config.image_size, cfg.vision_config.patch_size
    if not _variable(cfg):
        return [(side, side)] * n
    return [(side, side), (max(side - 2 * patch, patch), side + patch + 3), (side + patch, max(side // 2, patch))][:n]


def io_spec(cfg, dtype: torch.dtype, max_context: int) -> IOSpec:
    """The decoder graph's IO (the KV-cache contract and image_features); the vision graph's IO and the image
    tokens in extra.vision (the graphs' files: the manifest's `graphs`)."""
    dec = cfg.decoder_config
    io = decoder_io_spec(dec, dtype, max_context)
    kv = NP_DTYPES[dtype]
    io.inputs.append(TensorSpec(FEATURES, kv, [FEATURE_ROWS, dec.dim]))
    if _mrope(cfg):
        io.inputs.append(TensorSpec(OFFSETS, "int64", [BATCH, 3, SEQ]))
    io.extra["vision"] = {
        "image_token_id": cfg.image_token_id, "image_tokens": cfg.image_tokens,
        "inputs": [TensorSpec(PIXELS, "float32", [IMAGES, *_pixel_dims(cfg)]).to_dict()],
        "outputs": [TensorSpec(FEATURES, kv, [IMAGES, IMAGE_TOKENS if _patches(cfg) else cfg.image_tokens,
                                              dec.dim]).to_dict()],
    }
    return io


class VisionGraph(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model.image_features(pixel_values)


class DecoderGraph(torch.nn.Module):
    """The decoder with flat inputs in contract order: ids, mask, positions, the cache, then image_features."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, *rest):
        cache, extra = group_cache(self.model.config.decoder_config, rest)
        features, offsets = extra[0], (extra[1] if len(extra) > 1 else None)
        embeds = self.model.embeddings(input_ids, features)
        rope = None if offsets is None else position_ids[:, None, :] + offsets  # multimodal RoPE's three streams
        logits, present = self.model.decoder(input_ids, attention_mask, position_ids, cache, inputs_embeds=embeds,
                                             rope_positions=rope)
        return (logits, *[t for kv in present for t in kv])


def export_vision_language_onnx(model, directory: Path, opset: int, external_data: bool | None = None) -> None:
    """Write vision.onnx and decoder.onnx of `model` (a VisionLanguageModel in its target dtype, eval mode)."""
    cfg, dec = model.config, model.config.decoder_config
    dyn = torch.export.Dim.DYNAMIC
    size = _image_sizes(cfg, 2)[-1]  # where the size is free, an example whose sides differ
    pixels = example_pixels(cfg, 2, size, torch.Generator().manual_seed(0))
    sides = (1, 2) if _patches(cfg) else (2, 3)
    axes = {0: dyn, **{a: dyn for a in sides}} if _variable(cfg) else {0: dyn}
    program = trace(VisionGraph(model).eval(), (pixels,), {PIXELS: axes}, [PIXELS], [FEATURES], opset)
    named = {0: IMAGES, sides[0]: HEIGHT, sides[1]: WIDTH} if _variable(cfg) else {0: IMAGES}
    _name_axes(program.model.graph, {PIXELS: named, FEATURES: {0: IMAGES, 1: IMAGE_TOKENS} if _patches(cfg) else
                                     {0: IMAGES}})
    save_program(program, directory / VISION_GRAPH, external_data)

    batch, seq, past = example_sizes(layer_windows(dec))
    args = list(example_inputs(dec, model.dtype, batch, seq, past, capped_past=4))
    rows = 4  # an example row count unlike the other dimensions, so that the exporter keeps it its own
    args[0] = args[0].clone()
    args[0].view(-1)[:rows] = cfg.image_token_id
    features = torch.randn(rows, dec.dim, generator=torch.Generator().manual_seed(1)).to(model.dtype)
    n_past = sum(len(dec.cache_entries(i)) for i in range(dec.n_layers))
    extras, extra_axes, names, named = [features], [{0: dyn}], [FEATURES], {FEATURES: {0: FEATURE_ROWS}}
    if _mrope(cfg):  # offsets unlike zero, so that the exporter keeps them an input of their own
        extras.append(torch.arange(3 * seq).reshape(1, 3, seq).expand(batch, 3, seq).contiguous() - 2)
        extra_axes.append({0: dyn, 2: dyn})
        names.append(OFFSETS)
        named[OFFSETS] = {0: BATCH, 2: SEQ}
    dynamic = {"input_ids": {0: dyn, 1: dyn}, "attention_mask": {0: dyn, 1: dyn}, "position_ids": {0: dyn, 1: dyn},
               "rest": tuple([{0: dyn, 2: dyn}] * n_past + extra_axes)}
    program = trace(DecoderGraph(model).eval(), (*args, *extras), dynamic, input_names(dec) + names,
                    output_names(dec), opset)
    rename_dims(program.model.graph, dec, extra=named)
    save_program(program, directory / DECODER_GRAPH, external_data)


def _name_axes(graph, axes: dict[str, dict[int, str]]) -> None:
    import onnx_ir as ir

    for value in list(graph.inputs) + list(graph.outputs):
        if value.name in axes and value.shape is not None:
            dims = list(value.shape)
            for axis, name in axes[value.name].items():
                dims[axis] = name
            value.shape = ir.Shape(dims)


def _prompt(cfg, images_per_row: list[int], text: int, seed: int) -> torch.Tensor:
    """Rows of random text with each row's images as image-token runs (equal lengths: rows pad with text)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = cfg.decoder_config.vocab_size
    length = text + max(images_per_row) * (cfg.image_tokens + 2)
    rows = []
    for n in images_per_row:
        row = torch.randint(0, vocab, (length,), generator=gen)
        row[row == cfg.image_token_id] = (cfg.image_token_id + 1) % vocab
        for i in range(n):
            start = text // 2 + i * (cfg.image_tokens + 2)
            row[start:start + cfg.image_tokens] = cfg.image_token_id
        rows.append(row)
    return torch.stack(rows)


@torch.no_grad()
def validate_vision_language(directory: Path, reference, dtype: str, max_context: int, progress=None,
                             seed: int = 0) -> dict[str, Any]:
    """Both graphs against `reference` (the FP32 or float64 model); the worst metrics and the failures."""
    cfg = reference.config
    dec = cfg.decoder_config
    v = cfg.vision_config
    tol = TOLERANCES[dtype]
    vis, run = OrtRunner(directory / VISION_GRAPH, dtype), OrtRunner(directory / DECODER_GRAPH, dtype)
    if run.names != input_names(dec) + [FEATURES] + ([OFFSETS] if _mrope(cfg) else []):
        raise KvforgeError(f"decoder graph inputs {run.names[:4]}... do not follow the IO contract")
    failures: list[str] = []
    vision_results, decoder_results = [], []
    gen = torch.Generator().manual_seed(seed)
    for n, size in zip((1, 2, 3), _image_sizes(cfg, 3) if _variable(cfg) else _image_sizes(cfg, 1) * 3):
        pixels = example_pixels(cfg, n, size, gen)
        want = reference.image_features(pixels.to(reference.decoder.dtype))
        got = vis.session.run(None, {PIXELS: pixels.numpy()})[0]
        result = {"image_features": output_metrics("features", got, want.float().numpy())}
        failures += failures_of(result, tol, f"vision graph, {n} image(s) of {tuple(pixels.shape[1:])}")
        vision_results.append(result)
    names = [n for layer in cache_names(dec, "past_key_values") for n in layer]

    def cand(ids, mask, features, past, offsets=None):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        feeds = {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "position_ids": positions.numpy(),
                 FEATURES: run.cast(features.reshape(-1, dec.dim))}
        if offsets is not None:
            feeds[OFFSETS] = offsets.numpy()
        feeds.update(zip(names, past))
        out = run.session.run(None, feeds)
        return out[0], out[1:]

    def ref(ids, mask, features, past, offsets=None):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        flat = [torch.from_numpy(np.asarray(p, np.float32)).to(reference.decoder.dtype) for p in past]
        cache, _ = group_cache(dec, flat)
        rope = None if offsets is None else positions[:, None, :] + offsets
        logits, present = reference.decoder(ids, mask, positions, cache, rope_positions=rope,
                                            inputs_embeds=reference.embeddings(ids, features.reshape(-1, dec.dim)))
        return logits.float().numpy(), [t for kv in present for t in kv]

    for i, (name, per_row) in enumerate([("one image", [1]), ("two images in a row", [2]), ("a batch of rows", [1, 1])]):
        ids = _prompt(cfg, per_row, text=6, seed=seed + i)
        pixels = example_pixels(cfg, sum(per_row), (v.image_size, v.image_size), gen)
        features = reference.image_features(pixels.to(reference.decoder.dtype))
        offsets, deltas = _offsets(cfg, ids, pixels)
        mask = torch.ones_like(ids)
        past = [np.zeros((ids.shape[0],) + s[1:], run.cast(torch.zeros(1)).dtype) for s in _empty_shapes(dec, 1)]
        lc, pc = cand(ids, mask, features, past, offsets)
        lr, _ = ref(ids, mask, features, [run.cast(torch.from_numpy(p)) for p in past], offsets)
        result = {"logits": output_metrics("logits", lc, lr)}
        for step in range(2):  # decode over the image's cache: no features
            nxt = torch.as_tensor(np.asarray(lr)[:, -1:].argmax(-1))
            mask = torch.ones(ids.shape[0], mask.shape[1] + 1, dtype=torch.int64)
            none = torch.zeros(0, dec.dim, dtype=reference.decoder.dtype)
            lr, _ = ref(nxt, mask, none, [run.cast(torch.from_numpy(np.asarray(p, np.float32))) for p in pc], deltas)
            lc, pc = cand(nxt, mask, none, pc, deltas)
            result[f"decode {step}"] = output_metrics("logits", lc, lr)
        failures += failures_of(result, tol, f"decoder, {name}")
        decoder_results.append(result)
        if progress:
            progress(i + 1, 4)
    lock = _greedy(cfg, reference, cand, ref, run, gen, min(LOCKSTEP_STEPS, max_context - 1 - cfg.image_tokens - 6))
    need = min(tol.get("greedy_min", 0), lock["steps"])
    if lock["matching"] < need:
        failures.append(f"greedy tokens from an image prompt agree on {lock['matching']} of {lock['steps']} steps, "
                        f"need {need}")
    if progress:
        progress(4, 4)
    return {"dtype": dtype, "reference": "torch float32", "tolerances": tol,
            "cases": len(vision_results) + len(decoder_results),
            "vision": {"image_features": metrics.worst([r["image_features"] for r in _finite_dropped(vision_results)])},
            "decoder": {"logits": metrics.worst([m for r in _finite_dropped(decoder_results) for m in r.values()])},
            "greedy": lock, "passed": not failures, "failures": failures}


def _finite_dropped(results: list[dict[str, dict]]) -> list[dict[str, dict]]:
    return [{k: {kk: vv for kk, vv in m.items() if kk != "finite"} for k, m in r.items()} for r in results]


def _empty_shapes(dec, batch: int) -> list[tuple[int, ...]]:
    return [(batch, heads, 0, dim) for i in range(dec.n_layers) for _, heads, dim in dec.cache_entries(i)]


def _offsets(cfg, ids: torch.Tensor, pixels: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Multimodal RoPE's offsets for prompt rows (batch, 3, T) and for the steps after them (batch, 3, 1), the
    images (pixels, in row order) each of its token grid; (None, None) for a decoder with plain RoPE."""
    if not _mrope(cfg):
        return None, None
    grid = ImageProcessing(**cfg.image_processing).token_grid(pixels[0])
    prompts, after = [], []
    for row in ids.tolist():
        count = sum(1 for t in row if t == cfg.image_token_id) // (grid[0] * grid[1])
        offsets, delta = rope_offsets(row, cfg.image_token_id, [grid] * count)
        prompts.append(torch.from_numpy(offsets))
        after.append(torch.full((3, 1), delta, dtype=torch.int64))
    return torch.stack(prompts), torch.stack(after)


def _greedy(cfg, reference, cand, ref, run, gen, steps: int) -> dict[str, Any]:
    """Greedy decoding from one image prompt on each side's own cache: the tokens each chooses."""
    dec = cfg.decoder_config
    v = cfg.vision_config
    ids = _prompt(cfg, [1], text=6, seed=99)
    pixels = example_pixels(cfg, 1, (v.image_size, v.image_size), gen)
    features = reference.image_features(pixels.to(reference.decoder.dtype))
    offsets, deltas = _offsets(cfg, ids, pixels)
    none = torch.zeros(0, dec.dim, dtype=reference.decoder.dtype)
    chosen = {}
    for side, step in (("candidate", cand), ("reference", ref)):
        mask = torch.ones_like(ids)
        past = [np.zeros(s, run.cast(torch.zeros(1)).dtype) for s in _empty_shapes(dec, 1)]
        logits, past = step(ids, mask, features, past, offsets)
        tokens = []
        for _ in range(max(steps, 1)):
            nxt = torch.as_tensor(np.asarray(logits)[:, -1:].argmax(-1))
            tokens.append(int(nxt))
            mask = torch.ones(1, mask.shape[1] + 1, dtype=torch.int64)
            past = [run.cast(torch.from_numpy(np.asarray(p, np.float32))) if side == "reference" else p for p in past]
            logits, past = step(nxt, mask, none, past, deltas)
        chosen[side] = tokens
    matching = 0
    for a, b in zip(chosen["candidate"], chosen["reference"]):
        if a != b:
            break
        matching += 1
    return {"steps": len(chosen["candidate"]), "matching": matching, "tokens": chosen}
