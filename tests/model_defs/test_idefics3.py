"""Idefics3 (SmolVLM's design) against transformers, on a random-weight checkpoint made here with its processor:
kvforge's preprocessing equals the processor's pixel_values (aspect-keeping resize, tiles, the whole image) and its
prompt ids (tiles' row/column tokens around the image tokens); image features and logits equal transformers' (1e-4)
with 1 and 2 images, split and unsplit, on prefill and a cached decode step; the exported bundle generates what
transformers.generate does, one prompt and a batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import runtime
from kvforge.export import export
from kvforge.images import ImageProcessing
from kvforge.model_defs import load

from ..conftest import assert_checked_on_text, make_idefics3

Image = pytest.importorskip("PIL.Image")
ATOL = 1e-4
SIZES = [(37, 52), (80, 20), (15, 15), (64, 64), (13, 41), (120, 119)]
# The exports (Idefics3's two graphs, Idefics2's with its own processor: four traces no other test shares, 45 s of
# a default run) are in the slow tier, which .ci/run runs; the default tier keeps the processors and the Torch
# model against transformers here, and vision-language export through LLaVA and Idefics2 (tests/model_defs/test_vision.py)
_SLOW = pytest.mark.slow


def _image(seed: int, size) -> "Image.Image":
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    root = tmp_path_factory.mktemp("idefics3")
    hf, processor = make_idefics3(root / "hf")
    return hf, processor, root


@pytest.mark.parametrize("split", [True, False])
def test_pixel_values_and_tiles_are_the_processors(split, tmp_path):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    hf = Idefics3ImageProcessorPil(size={"longest_edge": 120}, max_image_size={"longest_edge": 40},
                                   do_image_splitting=split)
    ours = ImageProcessing.from_hf({"image_processor_type": "Idefics3ImageProcessorPil", **hf.to_dict()})
    for i, size in enumerate(SIZES):
        image = _image(i, size)
        out = hf(images=[image], return_tensors="np", return_row_col_info=True)
        pixels, grids = ours.process([image])
        assert pixels.shape == out["pixel_values"][0].shape
        assert np.abs(pixels - out["pixel_values"][0]).max() <= 1e-6, size
        assert grids == [(out["rows"][0][0], out["cols"][0][0])] == [ours.grid(image)]
    if split:
        assert any(g != (0, 0) for g in (ours.grid(_image(0, s)) for s in SIZES))


@pytest.mark.parametrize("images", [1, 2])
@torch.no_grad()
def test_features_merged_embeddings_and_logits_are_transformers(idefics3, images):
    hf, processor, root = idefics3
    ours = load(root / "hf").model
    assert ours.config.image_tokens == 4 and ours.config.image_prompt == "idefics3"
    pictures = [_image(10 + k, SIZES[k]) for k in range(images)]
    text = "<image>" * images + "Describe."
    inputs = processor(text=[text], images=[pictures], return_tensors="pt")
    expected = hf(**inputs, use_cache=True)
    pixels = inputs["pixel_values"][0]
    hf_features = hf.model.get_image_features(pixel_values=inputs["pixel_values"],
                                              pixel_attention_mask=inputs["pixel_attention_mask"])
    hf_features = getattr(hf_features, "pooler_output", hf_features)
    hf_features = torch.cat(list(hf_features)) if isinstance(hf_features, (list, tuple)) else hf_features
    features = ours.image_features(pixels[: hf_features.shape[0]])
    assert (features.reshape(-1, 48) - hf_features.reshape(-1, 48)).abs().max() < ATOL
    embeds = ours.embeddings(inputs["input_ids"], features.reshape(-1, 48))
    hf_embeds = hf.model.inputs_merger(inputs["input_ids"], hf.model.get_input_embeddings()(inputs["input_ids"]),
                                       hf_features.reshape(-1, 4, 48))
    assert (embeds - hf_embeds).abs().max() < ATOL
    logits, cache = ours(inputs["input_ids"], features)
    assert (logits - expected.logits).abs().max() < ATOL
    nxt = expected.logits[:, -1:].argmax(-1)
    step = hf(input_ids=nxt, past_key_values=expected.past_key_values, use_cache=True)
    logits, _ = ours(nxt, past_key_values=cache)
    assert (logits - step.logits).abs().max() < ATOL


@_SLOW
@torch.no_grad()
def test_the_bundle_writes_the_processors_prompt_and_generates_as_transformers(idefics3, tmp_path):
    hf, processor, root = idefics3
    bundle = export(root / "hf", tmp_path / "bundle")
    assert bundle.manifest["validation"]["passed"]
    assert_checked_on_text(bundle, "text")
    jobs = [("<image>What is in the picture?", [_image(20, (80, 50))]),
            ("Compare <image> with <image>.", [_image(21, (30, 30)), _image(22, (20, 110))])]
    with runtime.load(bundle.path) as session:
        results = []
        for text, pictures in jobs:
            inputs = processor(text=[text], images=[pictures], return_tensors="pt")
            ids = inputs["input_ids"][0].tolist()
            assert session._prompts(text, pictures)[0][0] == ids  # the processor's prompt, tiles' tokens and all
            expected = hf.generate(**inputs, max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
            got = session.generate(text, images=pictures, max_new_tokens=6)
            assert got.tokens == expected
            results.append(got.tokens)
        together = session.generate([t for t, _ in jobs], images=[p for _, p in jobs], max_new_tokens=6)
        assert [r.tokens for r in together] == results


@_SLOW
def test_an_int8_idefics3_keeps_transformers_features_on_split_images(idefics3, tmp_path):
    """Calibration of the vision graph on images split into tiles, then compare over the tiles' features."""
    from kvforge.calibration import calibrate
    from kvforge.verify import compare

    hf, processor, root = idefics3
    data = tmp_path / "images"
    data.mkdir()
    for k, size in enumerate(SIZES):
        _image(40 + k, size).save(data / f"{k}.png")
    fp32 = export(root / "hf", tmp_path / "fp32")
    int8 = calibrate(fp32.path, tmp_path / "int8", precision="int8", data=data, seq_len=32, samples=16)
    assert int8.manifest["calibration"]["image_count"] == len(SIZES)
    report = compare(int8.path, data=data, steps=4, prompts=2, seq_len=24).result
    assert report["feature_sets"] > report["image_count"] == len(SIZES)  # tiles and whole images
    pictures = [_image(60, (70, 45))]
    inputs = processor(text=["<image>"], images=[pictures], return_tensors="pt")
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=inputs["pixel_values"],
                                           pixel_attention_mask=inputs["pixel_attention_mask"])
    want = getattr(want, "pooler_output", want)
    want = (torch.cat(list(want)) if isinstance(want, (list, tuple)) else want).reshape(-1, 4 * 48).double().numpy()
    with runtime.load(int8.path) as session:
        got = session.image_features(pictures).reshape(len(want), -1).astype(np.float64)
    cosines = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert 0.99 <= cosines.min() < 1 - 1e-6, cosines
    assert report["image_feature_cosine_min"] >= 0.99
    print(f"idefics3 int8: image-feature cosine min {cosines.min():.5f} vs transformers; greedy agreement "
          f"{report['greedy_agreement']:.3f}")


# -- Idefics2's processor: images keep their own (bounded) sizes; four quarters and the whole where it splits ------
@pytest.mark.parametrize("split", [False, True])
def test_idefics2_pixel_values_are_the_processors_unpadded(split):
    from transformers.models.idefics2.image_processing_pil_idefics2 import Idefics2ImageProcessorPil

    hf = Idefics2ImageProcessorPil(size={"shortest_edge": 30, "longest_edge": 60}, do_image_splitting=split)
    ours = ImageProcessing.from_hf({"image_processor_type": "Idefics2ImageProcessorPil", **hf.to_dict()})
    assert ours.variable_size and ours.side_bounds == (30, 60)
    for i, size in enumerate(SIZES):
        image = _image(70 + i, size)
        out = hf(images=[image], return_tensors="np")
        tiles, grids = ours.process_tiles([image])
        assert len(tiles) == out["pixel_values"].shape[1] == (5 if split else 1) and grids == [ours.grid(image)]
        for k, tile in enumerate(tiles):  # the processor pads each batch to its largest image, with a pixel mask
            h, w = tile.shape[1:]
            assert out["pixel_attention_mask"][0, k].sum() == h * w
            assert np.abs(out["pixel_values"][0, k, :, :h, :w] - tile).max() <= 1e-6


@_SLOW
@torch.no_grad()
def test_an_idefics2_bundle_with_its_processor_generates_as_transformers(tmp_path):
    """Idefics2 with its own image processor (bounded aspect-keeping resize): images of their own sizes go through
    the vision graph one size at a time (its positions bucketized from each image's grid), as transformers' padded
    batch with its pixel mask computes them; prompts carry the processor's fake tokens."""
    from transformers import Idefics2Processor, PreTrainedTokenizerFast
    from transformers.models.idefics2.image_processing_pil_idefics2 import Idefics2ImageProcessorPil

    from ..conftest import idefics3_tokenizer, make_idefics2

    hf = make_idefics2(tmp_path / "hf", image_token_id=259)
    images = Idefics2ImageProcessorPil(size={"shortest_edge": 20, "longest_edge": 50})
    images.save_pretrained(tmp_path / "hf")
    tokenizer = idefics3_tokenizer()
    tokenizer.save(tmp_path / "hf")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    processor = Idefics2Processor(images, fast, image_seq_len=4)
    bundle = export(tmp_path / "hf", tmp_path / "bundle")
    assert bundle.manifest["validation"]["passed"]
    assert bundle.io.extra["vision"]["inputs"][0]["shape"][2:] == ["height", "width"]
    text = "Look: <image>and <image>what now?"
    pictures = [_image(80, (33, 47)), _image(81, (90, 20))]
    inputs = processor(text=[text], images=[pictures], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    with runtime.load(bundle.path) as session:
        assert session._prompts(text, pictures)[0][0] == ids
        features = session.image_features(pictures)
        hf_features = hf.model.get_image_features(pixel_values=inputs["pixel_values"],
                                                  pixel_attention_mask=inputs["pixel_attention_mask"])
        hf_features = getattr(hf_features, "pooler_output", hf_features)
        hf_features = torch.cat(list(hf_features)) if isinstance(hf_features, (list, tuple)) else hf_features
        assert np.abs(features.reshape(hf_features.shape) - hf_features.numpy()).max() < ATOL
        expected = hf.generate(**inputs, max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
        assert session.generate(text, images=pictures, max_new_tokens=6).tokens == expected
        # a batch of rows whose images differ in size: each row as alone
        other, picture = "<image>Describe it.", [_image(82, (50, 21))]
        alone = session.generate(other, images=picture, max_new_tokens=6).tokens
        together = session.generate([text, other], images=[pictures, picture], max_new_tokens=6)
        assert [r.tokens for r in together] == [expected, alone]
    # an engine plan for the vision graph covers every size the processing makes (shape inference at each corner)
    from kvforge.export.engine import build_plan

    vision = build_plan(bundle.path, max_batch=2, max_context=64)["graphs"][0]
    assert vision["profiles"][0]["shapes"]["pixel_values"] == {"min": [1, 3, 20, 20], "opt": [1, 3, 30, 30],
                                                               "max": [2, 3, 50, 50]}
    assert vision["shape_check"]["passed"]
