"""Calibration of a vision-language bundle: the vision graph on images, the decoder on text and image prompts.

    --data DIR        the directory's images (PNG, JPEG, WebP, ...; up to `samples`) calibrate the vision graph; a
                      single .txt or .jsonl file beside them is the decoder's text (else the built-in text)
    --data FILE       the decoder's text; the images are synthetic (kvforge/images.py synthetic_images)
    no --data         synthetic images and the built-in text
    --random-data     random pixels and random tokens

The vision graph is observed on the preprocessed images (the bundle's image processing, as the runtime does).
The decoder is observed on the text windows (as a decoder LM's calibration) and on one prompt per image: its
image tokens followed by a text window, with that image's features from the float vision graph at those
positions, so the decoder's layers see the ranges that image features bring. Each graph's linear layers get their
own scales (the fixed recipe: a vision-language model fits no accuracy budget); lm_head stays in float unless asked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvforge.bundle import FEATURES, OFFSETS, PIXELS, Bundle
from kvforge.images import ImageProcessing, image_folder, rope_offsets, same_size_batches, synthetic_images
from kvforge.ort_session import make_session, prefill_feeds

from .data import load_calibration_set
from .multi_graph import graph_targets, quantize_graphs
from .recipe import Quantized, Recipe

SYNTHETIC_IMAGES = 32  # images made when none are given: enough for max/percentile ranges, a minute on big encoders


def calibration_images(bundle: Bundle, data, samples: int, random_data: bool, seed: int = 0
                       ) -> tuple[list[np.ndarray], str | Path | None, dict[str, Any]]:
    """(pixel_values (3, H, W) of the calibration images' tiles, the decoder's text data (None: the built-in
    text), a record)."""
    processing = ImageProcessing(**bundle.model_config["image_processing"])
    if random_data:
        vision = bundle.model_config["vision"]
        side = vision["image_size"]
        rng = np.random.default_rng(seed)
        count = min(samples, SYNTHETIC_IMAGES)
        if processing.patch_layout is not None:  # flattened patches of a nominal image (Qwen2-VL's input)
            shape = (side // vision["patch_size"],) * 2 + (int(bundle.io.extra["vision"]["inputs"][0]["shape"][-1]),)
        else:
            shape = (3,) + ((side, side) if processing.variable_size else processing.output_size)
        pixels = list(rng.uniform(-2, 2, (count, *shape)).astype(np.float32))
        return pixels, None, {"images": "random pixels", "image_count": count}
    text = data
    if data is not None and Path(data).is_dir():
        files, text = image_folder(data)
        files = files[:samples]
        return processing.process_tiles(files)[0], text, {"images": str(data), "image_count": len(files)}
    count = min(samples, SYNTHETIC_IMAGES)
    return processing.process_tiles(synthetic_images(count, seed))[0], text, {"images": f"synthetic (seed {seed})",
                                                                           "image_count": count}


def decoder_items(bundle: Bundle, recipe: Recipe, text, features: list[np.ndarray],
                  grids: list[tuple[int, int]] | None = None) -> tuple[list, dict[str, Any]]:
    """The decoder's calibration items ((ids (B, T), feature rows (R, C), multimodal RoPE's offsets (B, 3, T) or
    None)): the text windows in batches, then one prompt per image (its image tokens, then a text window). grids:
    each image's token grid, where the decoder turns multimodal RoPE (Qwen2-VL)."""
    image_token = int(bundle.io.extra["vision"]["image_token_id"])
    cset = load_calibration_set(bundle, text, samples=recipe.samples, seq_len=recipe.seq_len,
                                random_data=recipe.random_data)
    dim = features[0].shape[-1]
    none = np.zeros((0, dim), features[0].dtype)
    items = [(batch, none, None if grids is None else np.zeros((len(batch), 3, batch.shape[1]), np.int64))
             for batch in cset.batches(recipe.batch_size)]
    windows = cset.samples
    max_context = bundle.io.max_context or bundle.text_config["max_seq_len"]
    for i, image in enumerate(features):
        per_image = len(image)
        length = min(max(windows.shape[1], per_image + 8), max_context)
        window = windows[i % len(windows)][:max(length - per_image, 0)]
        window = window[window != image_token]  # a text's own image tokens would take no features
        ids = np.concatenate([np.full(per_image, image_token, np.int64), window])[None]
        offsets = None if grids is None else rope_offsets(ids[0].tolist(), image_token, [grids[i]])[0][None]
        items.append((ids, image, offsets))
    record = {"data": cset.source, "data_sha256": cset.sha256, "random_data": cset.random,
              "samples": int(len(windows)), "seq_len": int(windows.shape[1]), "batch_size": recipe.batch_size,
              "image_prompts": len(features)}
    return items, record


def quantize_vision_language(bundle: Bundle, recipe: Recipe, held_out, progress: Callable) -> Quantized:
    """Both graphs quantized by the recipe (held_out is None: no accuracy budget for this kind)."""
    import onnx

    graphs = bundle.graphs
    bundle.load_graph(external_data=False)  # refuses external data outside the bundle
    models = {role: onnx.load(str(bundle.path / name)) for role, name in graphs.items()}
    float_dtype = np.float16 if bundle.dtype == "float16" else np.float32
    found = graph_targets(models, recipe)
    items: dict[str, list] | None = None
    feeds: dict[str, Callable] = {}
    record: dict[str, Any] = {"data": None}
    if recipe.needs_data:
        pixels, text, image_record = calibration_images(bundle, recipe.data, recipe.samples, recipe.random_data)
        images = same_size_batches(pixels, recipe.batch_size)
        vision = make_session(bundle.path / graphs["vision"])
        features = [f for b in images for f in vision.run(None, {PIXELS: b})[0]]
        processing = ImageProcessing(**bundle.model_config["image_processing"])
        mrope = bundle.text_config.get("mrope_section") is not None
        grids = [processing.token_grid(t) for t in pixels] if mrope else None
        prompts, text_record = decoder_items(bundle, recipe, text, features, grids)
        items = {"vision": images, "decoder": prompts}
        decoder_config = bundle.text_config

        def decoder_feeds(item):
            out = {**prefill_feeds(item[0], decoder_config, bundle.io, bundle.dtype), FEATURES: item[1]}
            if item[2] is not None:
                out[OFFSETS] = item[2]
            return out

        feeds = {"vision": lambda batch: {PIXELS: batch}, "decoder": decoder_feeds}
        record = {**text_record, **image_record}
    return quantize_graphs(models, graphs, found, items, feeds, recipe, float_dtype, progress, record)
