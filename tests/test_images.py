"""kvforge's image preprocessing (Pillow and NumPy, no Torch) against transformers' CLIP image processor (the
oracle, its Pillow backend): pixel_values within 1e-6 over image sizes, modes and processor settings."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from kvforge.errors import KvforgeError
from kvforge.images import ImageProcessing, load_image

Image = pytest.importorskip("PIL.Image")

SETTINGS = [
    {"size": {"shortest_edge": 30}, "crop_size": {"height": 30, "width": 30}},  # LLaVA's shape, small
    {"size": {"shortest_edge": 24}, "crop_size": {"height": 40, "width": 20}},  # a crop taller than the image: padded
    {"size": {"height": 33, "width": 21}, "do_center_crop": False, "resample": 2, "image_mean": [0.5, 0.5, 0.5],
     "image_std": [0.5, 0.5, 0.5]},  # SigLIP-style: a fixed size, bilinear, mean/std 0.5
    {"size": {"shortest_edge": 17}, "crop_size": {"height": 17, "width": 17}, "do_normalize": False},
]


def _images():
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (47, 61, 3), dtype=np.uint8))
    tall = Image.fromarray(rng.integers(0, 256, (90, 31, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (40, 40, 4), dtype=np.uint8), "RGBA")  # composited onto white
    gray = Image.fromarray(rng.integers(0, 256, (25, 52), dtype=np.uint8), "L")
    palette = rgb.convert("P")
    return [rgb, tall, rgba, gray, palette]


@pytest.mark.parametrize("setting", SETTINGS, ids=["clip", "padded-crop", "fixed-size", "no-normalize"])
def test_pixel_values_are_the_hugging_face_processors(setting):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    hf = CLIPImageProcessorPil(**setting)
    ours = ImageProcessing.from_hf(hf.to_dict())
    images = _images()
    if "crop_size" not in setting or setting.get("do_center_crop") is False:
        images = images[:1]  # without a crop, sizes differ per image: one at a time
    expected = hf(images=images, return_tensors="np")["pixel_values"]
    got = ours(images)
    assert got.shape == expected.shape and got.dtype == np.float32
    assert np.abs(got - expected).max() <= 1e-6
    assert got.std() > 0.1  # not a constant image


def test_images_come_from_paths_bytes_and_data_urls(tmp_path):
    image = _images()[0]
    image.save(tmp_path / "a.png")
    raw = (tmp_path / "a.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    processing = ImageProcessing(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30})
    expected = processing([image])
    for source in (tmp_path / "a.png", str(tmp_path / "a.png"), raw, url):
        np.testing.assert_array_equal(processing([source]), expected)
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=90)
    assert processing([buf.getvalue()]).shape == (1, 3, 30, 30)


@pytest.mark.parametrize("source, message", [
    (b"not an image", "not an image Pillow can read"),
    ("data:image/png;base64,@@@", "not base64"),
    ("data:image/png,abc", "must be base64"),
    ("https://example.com/cat.png", "does not fetch images"),
    ("/no/such/image.png", "no image at"),
])
def test_bad_images_are_refused_by_name(source, message):
    with pytest.raises(KvforgeError, match=message):
        load_image(source)


def test_processor_options_kvforge_does_not_reproduce_are_refused():
    with pytest.raises(KvforgeError, match=r"\['do_pad'\]"):
        ImageProcessing.from_hf({"image_processor_type": "CLIPImageProcessor", "do_pad": True})
    with pytest.raises(KvforgeError, match="SiglipImageProcessor"):
        ImageProcessing.from_hf({"image_processor_type": "SiglipImageProcessor"})
    with pytest.raises(KvforgeError, match="image_std has a zero"):
        ImageProcessing(image_std=[0.5, 0.0, 0.5])
