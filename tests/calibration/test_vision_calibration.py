"""Calibration and comparison of vision-language bundles (issue 37): LLaVA and Idefics2 made locally with
transformers (random weights), exported, calibrated INT8 / FP8 from a folder of PNG and JPEG files made here, and
compared. The oracle for the vision graph is transformers' own image features (get_image_features on the same
pixel_values): the INT8 graph's features have cosine >= 0.99 with them on images calibration did not see; the
compare report states the image-feature cosine and the decoder's greedy agreement."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvforge import runtime
from kvforge.calibration import calibrate
from kvforge.cli import main
from kvforge.errors import KvforgeError
from kvforge.export import export
from kvforge.tokenizer import Tokenizer
from kvforge.verify import compare

from ..conftest import make_idefics2, make_llava

Image = pytest.importorskip("PIL.Image")
MAKERS = {"llava": make_llava, "idefics2": make_idefics2}
TEXT = ("The harbour was quiet in the early morning. Fishing boats came in one by one, their holds full, and the "
        "gulls followed them over the grey water while the market opened its shutters. ") * 8


def _photo(rng, size) -> "Image.Image":
    """A picture-like image: a smooth gradient, a block of another colour, some noise."""
    h, w = size
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([x, y, 1 - x * y], -1) * rng.uniform(120, 255, 3)
    top, left = rng.integers(0, h // 2), rng.integers(0, w // 2)
    base[top:top + h // 3, left:left + w // 3] = rng.uniform(0, 255, 3)
    return Image.fromarray(np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def images_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl-data")
    rng = np.random.default_rng(0)
    for i in range(6):
        _photo(rng, (40 + 7 * i, 64 - 5 * i)).save(root / (f"p{i}.png" if i % 2 else f"p{i}.jpg"))
    (root / "captions.txt").write_text(TEXT, encoding="utf-8")
    return root


# Idefics2's bundle (its two graphs traced, then calibrated) is in the slow tier with its export test
# (tests/model_defs/test_vision.py): the default tier calibrates and compares LLaVA's
@pytest.fixture(scope="module", params=[p if p != "idefics2" else pytest.param(p, marks=pytest.mark.slow)
                                        for p in sorted(MAKERS)])
def vl_bundle(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = MAKERS[request.param](root / "hf")
    Tokenizer.byte_level().save(root / "hf")  # ids < 259: inside the test models' vocabularies of 300
    return request.param, hf, export(root / "hf", root / "fp32")


def _hf_features(name: str, hf, pixels: np.ndarray) -> np.ndarray:
    """transformers' image features for pixel_values (N, 3, H, W): LLaVA's projected patches, Idefics2's latents."""
    with torch.no_grad():
        x = torch.from_numpy(pixels)
        out = hf.model.get_image_features(pixel_values=x[None] if name == "idefics2" else x)
        out = getattr(out, "pooler_output", out)
        out = torch.cat(list(out)) if isinstance(out, (list, tuple)) else out
    return out.reshape(len(pixels), -1).numpy().astype(np.float64)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1)
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _assert_tower_runs_as_the_decoder(session, bundle) -> None:
    """The vision tower's ONNX Runtime session holds the config entries of the bundle's Q/DQ format, as the
    decoder's does (ORT's own record of each session's options): on a CPU whose fused INT8 kernels saturate (AVX2
    without VNNI) the INT8 tower ran them and its image features fell to cosine 0.986 against transformers'."""
    from kvforge.ort_session import session_config

    want = session_config(bundle.quantization_format)
    assert want or bundle.quantization_format == "int8"  # FP8 and INT4 always set entries; INT8 where inexact
    for role, ort_session in (("vision", session._vision), ("decoder", session.decoder.backend.session)):
        options = ort_session.get_session_options()
        got = {key: options.get_session_config_entry(key) for key in want}
        assert got == want, (role, got)


def test_int8_vision_graph_keeps_transformers_features_on_unseen_images(vl_bundle, images_dir, tmp_path):
    name, hf, fp32 = vl_bundle
    int8 = calibrate(fp32.path, tmp_path / "int8", precision="int8", data=images_dir, seq_len=32, samples=16)
    record = int8.manifest["calibration"]
    assert record["image_count"] == 6 and record["images"] == str(images_dir)
    assert record["data"].endswith("captions.txt") and record["image_prompts"] == 6
    quantized = int8.manifest["precision"]["quantization"]["quantized_layers"]
    assert any(n.startswith("vision.") for n in quantized) and any(n.startswith("decoder.") for n in quantized)
    unseen = [_photo(np.random.default_rng(100 + i), (50, 45)) for i in range(4)]
    with runtime.load(int8.path) as q, runtime.load(fp32.path) as f:
        _assert_tower_runs_as_the_decoder(q, int8)
        pixels = q.processing(unseen)
        got, exact = q.image_features(unseen), f.image_features(unseen)
    want = _hf_features(name, hf, pixels)
    assert _cosines(exact, want).min() > 1 - 1e-6  # the float graph is transformers'
    cosines = _cosines(got, want)
    assert cosines.min() >= 0.99, cosines
    assert cosines.min() < 1 - 1e-6  # the features did change: the vision graph is quantized

    report = compare(int8.path, data=images_dir, steps=4, prompts=2, seq_len=24)
    r = report.result
    assert r["image_count"] == 6 and r["images"] == str(images_dir) and r["data"].endswith("captions.txt")
    assert r["image_feature_cosine_min"] >= 0.99 and r["tolerances"]["image_feature_cosine_min"] == 0.99
    assert 0.0 <= r["greedy_agreement"] <= 1.0 and r["steps"] == 4 and r["prompts"] == 2
    print(f"{name} int8: image-feature cosine min {cosines.min():.5f} vs transformers; compare: "
          f"cosine mean {r['image_feature_cosine_mean']:.5f}, greedy agreement {r['greedy_agreement']:.3f}, "
          f"top-1 {r['top1_agreement']:.3f}")


def test_the_float_bundle_compares_equal_to_its_reference(vl_bundle, images_dir):
    _, _, fp32 = vl_bundle
    r = compare(fp32.path, data=images_dir, steps=4, prompts=2, seq_len=24).result
    assert r["passed"], r["failures"]
    assert r["image_feature_cosine_min"] > 1 - 1e-6 and r["greedy_agreement"] == 1.0 and r["greedy_prefix_match"] == 1.0


def test_fp8_and_int4_calibrate_both_graphs(vl_bundle, tmp_path):
    name, hf, fp32 = vl_bundle
    if name != "llava":
        pytest.skip("one family is enough for the other precisions")
    fp8 = calibrate(fp32.path, tmp_path / "fp8", precision="fp8", seq_len=32, samples=8)
    assert fp8.manifest["calibration"]["images"] == "synthetic (seed 0)" and fp8.manifest["calibration"]["image_count"] == 8
    int4 = calibrate(fp32.path, tmp_path / "int4", precision="int4")
    assert int4.manifest["calibration"]["data"] is None
    image = _photo(np.random.default_rng(7), (30, 30))
    for bundle, bound in ((fp8, 0.98), (int4, 0.98)):
        with runtime.load(bundle.path) as session:
            _assert_tower_runs_as_the_decoder(session, bundle)
            cos = _cosines(session.image_features([image]), _hf_features(name, hf, session.processing([image])))
        assert bound <= cos.min() < 1 - 1e-6, (bundle.path, cos)


def test_bad_image_data_is_named(vl_bundle, images_dir, tmp_path, micro_bundle):
    _, _, fp32 = vl_bundle
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises(KvforgeError, match="holds no image files"):
        calibrate(fp32.path, tmp_path / "a", data=empty)
    two = tmp_path / "two"
    two.mkdir()
    _photo(np.random.default_rng(1), (30, 30)).save(two / "a.png")
    (two / "a.txt").write_text(TEXT)
    (two / "b.jsonl").write_text('"more"\n')
    with pytest.raises(KvforgeError, match="holds 2 text files"):
        calibrate(fp32.path, tmp_path / "b", data=two)
    (two / "b.jsonl").unlink()
    (two / "broken.png").write_bytes(b"not a png")
    with pytest.raises(KvforgeError, match="broken.png is not an image Pillow can read"):
        calibrate(fp32.path, tmp_path / "c", data=two)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    # a decoder LM takes text: a directory is refused by the CLI in one line
    result = CliRunner().invoke(main, ["calibrate", str(micro_bundle("gpt2-micro").path), "-o", str(tmp_path / "d"), "--precision", "int8", "--data",
                                       str(images_dir)])
    assert result.exit_code == 1 and "is a directory" in result.output and "Traceback" not in result.output
