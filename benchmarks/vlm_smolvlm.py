"""Vision-language serving cost on a SmolVLM-shaped model (issue 37): the vision graph's latency per image, and
decode tokens/s with one image in context against the same prompt length without one.

The model (random weights, ~240M parameters, built from kvforge's components):
- image encoder: SigLIP-base-shaped (512 x 512 images in 16 x 16 patches = 1024 patches, 12 layers of 768, 12
  heads, FFN 3072, no class token, post-layernorm), as SmolVLM-256M's;
- connector: a gated projection to the decoder's width, then a Perceiver resampler with 64 latents (3 layers,
  9 heads of 64, 3 K/V heads): 64 image tokens per image, SmolVLM's count (it gets there by pixel shuffle);
- decoder: SmolLM2-135M's shape (30 layers of 576, 9 heads / 3 K/V heads, FFN 1536, vocab 49152, tied head).

Exported by kvforge (FP32, validated), run on ONNX Runtime by the VisionLanguageSession (the decoder graph as
exported: the ORT variant's packed cache is not used for vision-language bundles yet). INT8 is not measured:
calibrating a vision-language bundle is not built yet.

Per run: the vision graph on one image (and on 4, per image), then greedy decoding of --new-tokens tokens after
a prompt of 64 image tokens + 16 text tokens, and after 80 text tokens (same context length), interleaved.
Decode tokens/s counts the tokens after the first (the prefill is timed apart). The roofline is the decoder's
weight bytes over this machine's read bandwidth measured in the same run. Medians over --runs.

    python3 benchmarks/vlm_smolvlm.py [--runs 5] [--new-tokens 32]
Writes benchmarks/results/vlm_smolvlm.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from runtime_125m import bandwidth_gbs  # noqa: E402

IMAGE_TOKEN = 49151
CONFIG = dict(
    vision=dict(image_size=512, patch_size=16, dim=768, n_layers=12, n_heads=12, ffn_dim=3072, class_token=False,
                patch_bias=True, pre_norm=False, post_norm=True, norm_eps=1e-6, activation="gelu_tanh",
                feature_layer=-1, feature_select="full"),
    decoder=dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536, max_seq_len=2048,
                 rope_theta=100000.0, tie_embeddings=True, family="llama", bos_token_id=1, eos_token_id=2),
    image_token_id=IMAGE_TOKEN, projector="resampler", projector_activation="silu", projector_ffn_dim=1536,
    resampler=dict(dim=576, n_latents=64, n_layers=3, n_heads=9, head_dim=64, n_kv_heads=3, ffn_dim=2304),
    image_processing=dict(size={"height": 512, "width": 512}, do_center_crop=False, image_mean=[0.5] * 3,
                          image_std=[0.5] * 3, resample=2),
)


def bundle_path(cache: Path) -> Path:
    """The exported bundle, made once per config (kept under --cache)."""
    from kvforge.export import export
    from kvforge.model_defs import save_checkpoint
    from kvforge.model_defs.model import init_random_weights
    from kvforge.model_defs.vision import VisionLanguageConfig, build_vision_language

    key = hashlib.sha256(json.dumps(CONFIG, sort_keys=True).encode()).hexdigest()[:12]
    bundle = cache / f"smolvlm-shaped-{key}"
    if not (bundle / "kvforge.json").is_file():
        checkpoint = cache / f"smolvlm-shaped-{key}-checkpoint"
        if not checkpoint.exists():
            save_checkpoint(init_random_weights(build_vision_language(VisionLanguageConfig(**CONFIG)), seed=0), checkpoint)
        started = time.time()
        export(checkpoint, bundle, force=True)
        print(f"exported in {time.time() - started:.0f} s", flush=True)
    return bundle


def timed_generate(session, ids: list[int], images: list, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds including the vision graph, decode tokens/s after the first token)."""
    start = time.perf_counter()
    stamps = []
    for _ in session.stream(ids, images=images, max_new_tokens=new_tokens, ignore_eos=True):
        stamps.append(time.perf_counter())
    return stamps[0] - start, (len(stamps) - 1) / (stamps[-1] - stamps[0])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "kvforge" / "bench-vlm")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "vlm_smolvlm.json")
    args = ap.parse_args()
    from PIL import Image

    from kvforge import runtime
    from kvforge.bundle import Bundle

    args.cache.mkdir(parents=True, exist_ok=True)
    path = bundle_path(args.cache)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)) for _ in range(4)]
    text = rng.integers(3, 49000, 80).tolist()
    with_image = [1] + text[:8] + [IMAGE_TOKEN] * 64 + text[8:15]
    without = [1] + text[:79]
    assert len(with_image) == len(without) == 80
    bandwidth = [bandwidth_gbs()]
    one, four, prefill_img, decode_img, prefill_txt, decode_txt = [], [], [], [], [], []
    with runtime.load(path) as session:
        session.image_features(images[:1])  # warm-up
        timed_generate(session, with_image, images[:1], 4)
        for _ in range(args.runs):
            start = time.perf_counter()
            session.image_features(images[:1])
            one.append(time.perf_counter() - start)
            start = time.perf_counter()
            session.image_features(images)
            four.append((time.perf_counter() - start) / 4)
            p, d = timed_generate(session, with_image, images[:1], args.new_tokens)
            prefill_img.append(p)
            decode_img.append(d)
            p, d = timed_generate(session, without, [], args.new_tokens)
            prefill_txt.append(p)
            decode_txt.append(d)
            print(f"image {one[-1] * 1000:.0f} ms (4: {four[-1] * 1000:.0f} ms each); decode with image "
                  f"{decode_img[-1]:.1f} tok/s, without {decode_txt[-1]:.1f} tok/s", flush=True)
    bandwidth.append(bandwidth_gbs())
    bw = statistics.median(bandwidth)
    manifest = Bundle(path).manifest
    dec = CONFIG["decoder"]
    decoder_params = (dec["vocab_size"] * dec["dim"]
                      + dec["n_layers"] * (dec["dim"] * dec["dim"] * 2 + 2 * dec["dim"] * dec["dim"] // 3
                                           + 3 * dec["dim"] * dec["ffn_dim"] + 2 * dec["dim"]) + dec["dim"])
    roofline = bw * 1e9 / (4 * decoder_params)
    result = {
        "benchmark": "vlm_smolvlm", "model": "SmolVLM-shaped (random weights)", "config": CONFIG,
        "parameters": {"total_graph_bytes": sum(f["bytes"] for f in manifest["files"].values() if f.get("bytes")),
                       "decoder": decoder_params},
        "dtype": "float32", "backend": "onnxruntime (the bundle's graphs)", "runs": args.runs,
        "new_tokens": args.new_tokens, "prompt_tokens": 80, "image_tokens": 64,
        "vision_ms_per_image": {"batch_1": 1000 * statistics.median(one), "batch_4": 1000 * statistics.median(four)},
        "prefill_ms": {"with_image_including_vision": 1000 * statistics.median(prefill_img),
                       "text_only": 1000 * statistics.median(prefill_txt)},
        "decode_tokens_per_s": {"one_image_in_context": statistics.median(decode_img),
                                "text_only_same_length": statistics.median(decode_txt)},
        "decode_with_image_vs_text": statistics.median(decode_img) / statistics.median(decode_txt),
        "bandwidth_gbs": bw, "bandwidth_samples_gbs": bandwidth,
        "decode_roofline_tokens_per_s": roofline,
        "decode_fraction_of_roofline": statistics.median(decode_img) / roofline,
        "samples": {"vision_ms": [1000 * x for x in one], "decode_with_image": decode_img, "decode_text": decode_txt},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("vision_ms_per_image", "prefill_ms", "decode_tokens_per_s",
                                             "decode_fraction_of_roofline", "bandwidth_gbs")}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
