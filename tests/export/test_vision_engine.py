"""Engine plans of a vision-language bundle (issue 37), checked on the CPU: one engine per graph, the vision graph's
profile over images (tiles), the decoder's prefill and decode profiles with the image_features rows a step takes;
ONNX shape inference passes at every corner (0 feature rows included)."""

from __future__ import annotations

from kvforge.export.engine import build_plan, plan_text
from kvforge.images import ImageProcessing


def test_a_vision_language_bundle_plans_both_graphs(micro_bundle):
    bundle = micro_bundle("llava-micro")
    plan = build_plan(bundle.path, max_batch=3, max_context=48, opt_context=24)
    graphs = {g["role"]: g for g in plan["graphs"]}
    assert [g["engine"] for g in plan["graphs"]] == ["vision.engine", "decoder.engine"]
    size = bundle.manifest["model"]["vision"]["image_size"]
    (images,) = graphs["vision"]["profiles"]
    assert images["shapes"]["pixel_values"] == {"min": [1, 3, size, size], "opt": [1, 3, size, size],
                                                "max": [3, 3, size, size]}
    prefill, decode = graphs["decoder"]["profiles"]
    dim = bundle.io.input("image_features").shape[-1]
    assert prefill["shapes"]["image_features"] == {"min": [0, dim], "opt": [9, dim], "max": [3 * 48, dim]}
    assert decode["shapes"]["image_features"] == {"min": [0, dim], "opt": [0, dim], "max": [0, dim]}
    assert decode["shapes"]["past_key_values.0.key"]["max"][2] == 47 and prefill["shapes"]["input_ids"]["max"] == [3, 48]
    assert graphs["decoder"]["shape_check"]["points"] == 6 and graphs["vision"]["shape_check"]["points"] == 3
    assert "engine vision.engine from vision.onnx (vision)" in plan_text(plan)


def test_split_images_widen_the_vision_profile():
    """An image cut into tiles (Idefics3's processing) is that many vision-graph rows: the profile's max covers it."""
    tiles = ImageProcessing(size={"longest_edge": 120}, max_image_size={"longest_edge": 40}, do_image_splitting=True,
                            do_center_crop=False)
    assert tiles.max_tiles == 3 * 3 + 1
    assert ImageProcessing(size={"longest_edge": 40}, max_image_size={"longest_edge": 40}, do_image_splitting=True,
                           do_center_crop=False).max_tiles == 1
