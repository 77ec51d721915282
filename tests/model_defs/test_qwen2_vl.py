"""Qwen2-VL against transformers, on a random-weight checkpoint made here with its image processor: kvforge's
preprocessing equals the processor's pixel_values (smart resize, patches laid out in merge blocks) and grids; image
features (the vision tower's 2-D RoPE over each image's own patch grid, the patch merger), logits on prefill and a
cached decode step with 1 and 2 images (the decoder's multimodal RoPE: time / height / width positions) equal
transformers' (1e-4); the exported bundle generates what transformers.generate does, one prompt, a batch of rows
whose images differ in size, and through the continuous batcher; INT8 keeps transformers' features."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge import runtime
from kvforge.errors import KvforgeError
from kvforge.export import export
from kvforge.images import ImageProcessing, rope_offsets
from kvforge.model_defs import load

from ..conftest import assert_checked_on_text, make_qwen2_vl

Image = pytest.importorskip("PIL.Image")
ATOL = 1e-4
IMAGE_PAD = 259
SIZES = [(37, 52), (80, 20), (15, 15), (200, 300), (13, 41)]


def _image(seed: int, size) -> "Image.Image":
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen2vl")
    hf, images, tokenizer = make_qwen2_vl(root / "hf")
    return hf, images, tokenizer, root


def _inputs(images, tokenizer, text: str, pictures: list):
    """What Qwen2VLProcessor gives: the processor's pixel_values and grids, each <|image_pad|> repeated once per
    token of its image's grid, and mm_token_type_ids (1 at image tokens)."""
    out = images(images=pictures, return_tensors="pt")
    pieces = text.split("<|image_pad|>")
    expanded = pieces[0]
    for (t, h, w), piece in zip(out["image_grid_thw"].tolist(), pieces[1:]):
        expanded += "<|image_pad|>" * (t * h * w // 4) + piece
    ids = torch.tensor([tokenizer(expanded)["input_ids"]])
    return {"input_ids": ids, "pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
            "mm_token_type_ids": (ids == IMAGE_PAD).int()}


def test_pixel_values_and_grids_are_the_processors(qwen):
    _, images, _, _ = qwen
    ours = ImageProcessing.from_hf({"image_processor_type": "Qwen2VLImageProcessorPil", **images.to_dict()})
    for i, size in enumerate(SIZES):
        picture = _image(i, size)
        out = images(images=[picture], return_tensors="np")
        (tile,), grids = ours.process_tiles([picture])
        t, h, w = out["image_grid_thw"][0].tolist()
        assert tile.shape[:2] == (h, w) and grids == [(0, 0)] and ours.prompt_grid(picture) == (h // 2, w // 2)
        assert np.abs(tile.reshape(h * w, -1) - out["pixel_values"]).max() <= 1e-6, size
    with pytest.raises(KvforgeError, match="aspect ratios up to 200"):
        ours.process_tiles([_image(9, (2, 500))])


@pytest.mark.parametrize("count", [1, 2])
@torch.no_grad()
def test_features_and_multimodal_rope_logits_are_transformers(qwen, count):
    hf, images, tokenizer, root = qwen
    ours = load(root / "hf").model
    pictures = [_image(10 + k, SIZES[k]) for k in range(count)]
    text = "See " + " and ".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in pictures) + " now"
    inputs = _inputs(images, tokenizer, text, pictures)
    expected = hf(**inputs, use_cache=True)
    hf_features = hf.model.get_image_features(pixel_values=inputs["pixel_values"],
                                              image_grid_thw=inputs["image_grid_thw"])
    hf_features = getattr(hf_features, "pooler_output", hf_features)
    hf_features = torch.cat(list(hf_features)) if isinstance(hf_features, (list, tuple)) else hf_features
    features, grids, at = [], [], 0
    for _, h, w in inputs["image_grid_thw"].tolist():  # each image's patches, (rows, cols, C*T*P*P)
        features.append(ours.image_features(inputs["pixel_values"][at:at + h * w].reshape(1, h, w, -1))[0])
        grids.append((h // 2, w // 2))
        at += h * w
    features = torch.cat(features)
    assert (features - hf_features.reshape(-1, hf.config.text_config.hidden_size)).abs().max() < ATOL
    ids = inputs["input_ids"]
    offsets, after = rope_offsets(ids[0].tolist(), IMAGE_PAD, grids)
    positions = torch.arange(ids.shape[1])[None]
    logits, cache = ours(ids, features, torch.ones_like(ids), positions,
                         rope_positions=positions[:, None] + torch.from_numpy(offsets)[None])
    assert (logits - expected.logits).abs().max() < ATOL
    nxt = expected.logits[:, -1:].argmax(-1)
    step = hf(input_ids=nxt, past_key_values=expected.past_key_values, use_cache=True)
    here = torch.tensor([[ids.shape[1]]])
    logits, _ = ours(nxt, None, torch.ones(1, ids.shape[1] + 1, dtype=torch.int64), here, past_key_values=cache,
                     rope_positions=(here + after)[:, None].expand(1, 3, 1))
    assert (logits - step.logits).abs().max() < ATOL


# The bundle's tests are in the slow tier (README's third command, run by .ci/run): Qwen2-VL's two graphs are
# traced for them alone (20 s); the default tier keeps its processor and its Torch model with multimodal RoPE
# against transformers (above), and vision-language export through LLaVA and kvforge's own kind
@pytest.mark.slow
@torch.no_grad()
def test_the_bundle_generates_as_transformers_alone_batched_and_in_the_batcher(qwen, tmp_path):
    hf, images, tokenizer, root = qwen
    bundle = export(root / "hf", tmp_path / "bundle")
    assert bundle.manifest["validation"]["passed"]
    assert_checked_on_text(bundle, "text")
    assert [t.name for t in bundle.io.inputs][-2:] == ["image_features", "rope_offsets"]
    jobs = [("Look <|vision_start|><|image_pad|><|vision_end|> here", [_image(20, (37, 52))]),
            ("A <|vision_start|><|image_pad|><|vision_end|>, then <|vision_start|><|image_pad|><|vision_end|>?",
             [_image(21, (80, 20)), _image(22, (30, 30))])]
    with runtime.load(bundle.path) as session:
        alone = []
        for text, pictures in jobs:
            inputs = _inputs(images, tokenizer, text, pictures)
            ids = inputs["input_ids"][0].tolist()
            assert session._prompts(text, pictures)[0][0] == ids  # the processor's expansion, per image grid
            expected = hf.generate(**inputs, max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
            got = session.generate(text, images=pictures, max_new_tokens=6)
            assert got.tokens == expected
            alone.append(got.tokens)
        together = session.generate([t for t, _ in jobs], images=[p for _, p in jobs], max_new_tokens=6)
        assert [r.tokens for r in together] == alone  # left padding: each row's positions as alone
        with session.batcher(max_batch=2, prefill_chunk=9) as batcher:
            requests = [batcher.submit(t, images=p, max_new_tokens=6) for t, p in jobs]
            assert [r.result(timeout=120).tokens for r in requests] == alone
    # On the CPU the decoder runs ONNX Runtime's packed cache, which runs a step over a past at batch 2 one token
    # at a time: each call takes its own tokens' rope offsets. Logits as the exported graph's (one call) to 1e-4.
    rng = np.random.default_rng(23)
    ids, offsets = rng.integers(3, 250, (2, 3)), rng.integers(-3, 4, (2, 3, 3))
    got = []
    for variant in (False, True):
        with runtime.load(bundle.path, variant=variant) as session:
            assert session.backend.packed is variant
            _, cache = session.forward(ids, None, np.ones((2, 3), np.int64), rope_offsets=offsets)
            got.append(session.forward(ids[:, ::-1].copy(), None, np.ones((2, 6), np.int64), cache=cache,
                                       rope_offsets=offsets[..., ::-1].copy())[0])
    np.testing.assert_allclose(got[1], got[0], atol=ATOL)
    # the engine plan: the vision graph over patch grids, the decoder with its rope offsets
    from kvforge.export.engine import build_plan

    plan = build_plan(bundle.path, max_batch=2, max_context=64)
    vision, decoder = plan["graphs"]
    assert vision["profiles"][0]["shapes"]["pixel_values"]["min"][1:3] == [2, 2]
    assert decoder["profiles"][1]["shapes"]["rope_offsets"]["max"] == [2, 3, 1]


@pytest.mark.slow  # the same bundle's structure (above)
def test_int8_keeps_transformers_features(qwen, tmp_path):
    from kvforge.calibration import calibrate
    from kvforge.verify import compare

    hf, images, tokenizer, root = qwen
    data = tmp_path / "images"
    data.mkdir()
    for k, size in enumerate(SIZES[:4]):
        _image(40 + k, size).save(data / f"{k}.png")
    fp32 = export(root / "hf", tmp_path / "fp32")
    int8 = calibrate(fp32.path, tmp_path / "int8", precision="int8", data=data, seq_len=32, samples=16)
    report = compare(int8.path, data=data, steps=4, prompts=2, seq_len=24).result
    picture = _image(60, (45, 70))
    inputs = images(images=[picture], return_tensors="pt")
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
    want = getattr(want, "pooler_output", want)
    want = (torch.cat(list(want)) if isinstance(want, (list, tuple)) else want).reshape(-1).double().numpy()
    with runtime.load(int8.path) as session:
        got = session.feature_sets([picture])[0].reshape(-1).astype(np.float64)
    cosine = float(got @ want / (np.linalg.norm(got) * np.linalg.norm(want)))
    assert 0.99 <= cosine < 1 - 1e-6 and report["image_feature_cosine_min"] >= 0.99
    print(f"qwen2_vl int8: image-feature cosine {cosine:.5f} vs transformers; greedy agreement "
          f"{report['greedy_agreement']:.3f}")
