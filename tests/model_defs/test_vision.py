"""Vision-language models on the Torch reference against transformers (the oracle): a LLaVA (CLIP image encoder,
MLP projector, Llama decoder) made locally with random weights, every one perturbed; image features, the merged
embeddings and the logits on prefill and cached decode, with one and two images and a batch, within 1e-4."""

from __future__ import annotations

import pytest
import torch

from kvforge.errors import KvforgeError
from kvforge.model_defs import load

from ..conftest import LLAVA_TEXT as TEXT
from ..conftest import IDEFICS2_LATENTS, assert_checked_on_text, make_idefics2, make_llava

ATOL = 1e-4
IMAGE_TOKEN = 299  # the test LLaVA's (tests/conftest.py make_llava)
PATCHES = 9  # (30 / 10) ** 2


def _prompt(images: int, seed: int, text: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randint(3, 290, (text,), generator=gen)]
    for _ in range(images):
        parts += [torch.full((PATCHES,), IMAGE_TOKEN), torch.randint(3, 290, (3,), generator=gen)]
    return torch.cat(parts)[None]


def _pixels(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, 30, 30, generator=torch.Generator().manual_seed(seed))


def _load(path):
    return load(path)[0]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava") / "hf"
    return make_llava(path), _load(path)


@torch.no_grad()
def test_image_features_and_the_merged_embeddings_are_transformers(llava):
    hf, ours = llava
    pixels = _pixels(2, seed=1)
    expected = hf.model.get_image_features(pixel_values=pixels)
    expected = torch.cat(list(expected.pooler_output if hasattr(expected, "pooler_output") else expected))
    got = ours.image_features(pixels)
    assert got.shape == (2, PATCHES, TEXT["hidden_size"])
    assert (got.reshape(-1, got.shape[-1]) - expected.reshape(-1, got.shape[-1])).abs().max() < ATOL
    ids = _prompt(2, seed=2)
    embeds = hf.model.get_input_embeddings()(ids)
    mask = (ids == IMAGE_TOKEN)[..., None].expand_as(embeds)
    merged = embeds.masked_scatter(mask, expected.reshape(-1, embeds.shape[-1]))
    assert (ours.embeddings(ids, got) - merged).abs().max() < ATOL


@pytest.mark.parametrize("images", [1, 2])
@torch.no_grad()
def test_prefill_and_cached_decode_logits_are_transformers(llava, images):
    hf, ours = llava
    ids, pixels = _prompt(images, seed=3), _pixels(images, seed=4)
    expected = hf(input_ids=ids, pixel_values=pixels, use_cache=True)
    logits, cache = ours(ids, pixel_values=pixels)
    assert (logits - expected.logits).abs().max() < ATOL
    past = expected.past_key_values
    for step in range(3):  # decode: text tokens over the image's cache, no features
        nxt = expected.logits[:, -1].argmax(-1, keepdim=True)
        expected = hf(input_ids=nxt, past_key_values=past, use_cache=True)
        past = expected.past_key_values
        logits, cache = ours(nxt, past_key_values=cache)
        assert (logits - expected.logits).abs().max() < ATOL, step


@torch.no_grad()
def test_a_batch_of_rows_with_their_own_images_is_each_row_alone(llava):
    hf, ours = llava
    ids = torch.cat([_prompt(1, seed=5), _prompt(1, seed=6)])
    pixels = _pixels(2, seed=7)
    expected = hf(input_ids=ids, pixel_values=pixels).logits
    logits, _ = ours(ids, pixel_values=pixels)
    assert (logits - expected).abs().max() < ATOL
    alone, _ = ours(ids[1:], pixel_values=pixels[1:])
    assert (logits[1:] - alone).abs().max() < 1e-5
    with pytest.raises(KvforgeError, match="has 18 image tokens but 9 image features"):
        ours(ids, pixel_values=pixels[:1])


def test_llava_checkpoints_are_read_strictly(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    make_llava(tmp_path / "full", vision_feature_select_strategy="full", vision_feature_layer=-1)
    model = _load(tmp_path / "full")
    assert model.config.image_tokens == PATCHES + 1 and len(model.vision.layers) == 3
    tensors = load_file(str(tmp_path / "full" / "model.safetensors"))
    del tensors[next(k for k in tensors if k.endswith("layers.1.mlp.fc1.weight") and "vision" in k)]
    tensors["multi_modal_projector.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "full" / "model.safetensors"))
    with pytest.raises(KvforgeError, match=r"missing tensors \(1\).*layers.1.mlp.fc1.weight(.|\n)*unexpected tensors "
                                           r"\(1\).*multi_modal_projector.extra.weight"):
        _load(tmp_path / "full")
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    config["vision_feature_layer"] = [-2, -1]
    (tmp_path / "full" / "config.json").write_text(json.dumps(config))
    with pytest.raises(KvforgeError, match="several layers"):
        _load(tmp_path / "full")


def test_the_two_graphs_export_validate_and_run_as_transformers(llava, tmp_path):
    """vision.onnx and decoder.onnx of the LLaVA on ONNX Runtime: validation against the Torch reference passes,
    and a prefill with two images then cached decode steps give transformers' logits (1e-4)."""
    import numpy as np

    from kvforge.export.vision_export import (DECODER_GRAPH, FEATURES, VISION_GRAPH, export_vision_language_onnx,
                                              io_spec, validate_vision_language)
    from kvforge.ort_session import make_session

    hf, ours = llava
    export_vision_language_onnx(ours, tmp_path, opset=21)
    report = validate_vision_language(tmp_path, ours, "float32", 256)
    assert report["passed"], report["failures"]
    assert report["greedy"]["matching"] == report["greedy"]["steps"] > 0
    io = io_spec(ours.config, torch.float32, 256)
    vision, decoder = make_session(str(tmp_path / VISION_GRAPH)), make_session(str(tmp_path / DECODER_GRAPH))
    assert [i.name for i in decoder.get_inputs()] == [t.name for t in io.inputs]
    assert [str(d) for d in decoder.get_inputs()[-1].shape] == ["image_feature_rows", str(TEXT["hidden_size"])]
    ids, pixels = _prompt(2, seed=8), _pixels(2, seed=9)
    with torch.no_grad():
        expected = hf(input_ids=ids, pixel_values=pixels, use_cache=True)
    features = vision.run(None, {"pixel_values": pixels.numpy()})[0]
    names = [i.name for i in decoder.get_inputs()]
    head_dim = TEXT["hidden_size"] // TEXT["num_attention_heads"]
    past = {n: np.zeros((1, 2, 0, head_dim), np.float32) for n in names if n.startswith("past_key_values")}
    mask = np.ones(ids.shape, np.int64)
    feeds = {"input_ids": ids.numpy(), "attention_mask": mask, "position_ids": np.arange(ids.shape[1])[None],
             FEATURES: features.reshape(-1, features.shape[-1]), **past}
    out = decoder.run(None, feeds)
    assert np.abs(out[0] - expected.logits.numpy()).max() < ATOL
    hf_past = expected.past_key_values
    for step in range(2):
        nxt = expected.logits[:, -1:].argmax(-1)
        with torch.no_grad():
            expected = hf(input_ids=nxt, past_key_values=hf_past, use_cache=True)
        hf_past = expected.past_key_values
        mask = np.ones((1, mask.shape[1] + 1), np.int64)
        feeds = {"input_ids": nxt.numpy(), "attention_mask": mask, "position_ids": np.asarray([[mask.shape[1] - 1]]),
                 FEATURES: np.zeros((0, TEXT["hidden_size"]), np.float32),
                 **dict(zip([n for n in names if n.startswith("past_key_values")], out[1:]))}
        out = decoder.run(None, feeds)
        assert np.abs(out[0] - expected.logits.numpy()).max() < ATOL, step


@pytest.mark.parametrize("images", [1, 2])
@torch.no_grad()
def test_idefics2_features_and_logits_are_transformers(tmp_path, images):
    hf = make_idefics2(tmp_path / "hf")
    ours = _load(tmp_path / "hf")
    assert ours.config.image_tokens == IDEFICS2_LATENTS
    gen = torch.Generator().manual_seed(images)
    text = torch.randint(3, 290, (5 + 3 * images,), generator=gen)
    ids = torch.cat([text[:5]] + [torch.cat([torch.full((IDEFICS2_LATENTS,), IMAGE_TOKEN), text[5 + 3 * i:8 + 3 * i]])
                                  for i in range(images)])[None]
    pixels = _pixels(images, seed=10 + images)
    expected = hf(input_ids=ids, pixel_values=pixels[None], use_cache=True)
    features = ours.image_features(pixels)
    assert features.shape == (images, IDEFICS2_LATENTS, hf.config.text_config.hidden_size)
    hf_features = hf.model.get_image_features(pixel_values=pixels[None])
    hf_features = getattr(hf_features, "pooler_output", hf_features)
    hf_features = torch.cat(list(hf_features)) if isinstance(hf_features, (list, tuple)) else hf_features
    assert (features.reshape(hf_features.shape) - hf_features).abs().max() < ATOL
    logits, cache = ours(ids, pixel_values=pixels)
    assert (logits - expected.logits).abs().max() < ATOL
    nxt = expected.logits[:, -1:].argmax(-1)
    step = hf(input_ids=nxt, past_key_values=expected.past_key_values, use_cache=True)
    logits, _ = ours(nxt, past_key_values=cache)
    assert (logits - step.logits).abs().max() < ATOL


@pytest.mark.slow  # Idefics2's two graphs, traced for this test and the slow tier's Idefics2 calibration
# (tests/calibration/test_vision_calibration.py): 23 s of tracing; the default tier keeps Idefics2's Torch model
# against transformers (above) and vision-language export through LLaVA
def test_an_idefics2_bundle_exports_and_validates(tmp_path):
    """Both graphs of the Idefics2 (the resampler's grouped attention over [features; latents] included) pass
    export validation against the Torch reference; the bundle runs an image on ONNX Runtime as transformers does."""
    import numpy as np
    from PIL import Image

    from kvforge import runtime
    from kvforge.export import export

    hf = make_idefics2(tmp_path / "hf")
    bundle = export(tmp_path / "hf", tmp_path / "bundle")
    assert bundle.manifest["validation"]["passed"] and bundle.io.extra["vision"]["image_tokens"] == IDEFICS2_LATENTS
    assert_checked_on_text(bundle, "token ids")
    ids = [1, 5, 6] + [IMAGE_TOKEN] * IDEFICS2_LATENTS + [7, 8]
    image = np.random.default_rng(0).integers(0, 256, (30, 30, 3), dtype=np.uint8)
    with runtime.load(bundle.path) as session:
        pixels = session.processing([Image.fromarray(image)])  # the fixed-size processing the import recorded
        got = session.generate(ids, images=[Image.fromarray(image)], max_new_tokens=5)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), pixel_values=torch.from_numpy(pixels)[None], max_new_tokens=5,
                               do_sample=False)[0, len(ids):]
    assert got.tokens == expected.tolist()



def test_qwen2_5_vl_is_refused_by_name_with_what_it_needs(tmp_path):
    """A Qwen2.5-VL checkpoint made with transformers: the import names what kvforge does not build (its windowed
    vision attention) instead of building an approximation (Qwen2-VL itself: tests/model_defs/test_qwen2_vl.py)."""
    import transformers

    transformers.Qwen2_5_VLConfig(text_config=dict(hidden_size=48, num_hidden_layers=1, num_attention_heads=4,
                                                   vocab_size=300)).save_pretrained(tmp_path)
    with pytest.raises(KvforgeError, match=r"model_type='qwen2_5_vl' is not built by kvforge: .*windows of patches"):
        load(tmp_path)

