"""Vision-language serving cost on a SmolVLM-shaped model (issue 37): the vision graph's latency per image, and
decode tokens/s with one image in context against the same prompt length without one.

The model (random weights, ~235M parameters, SmolVLM-256M's design, built from kvforge's components):
- image encoder: SigLIP-base-shaped (512 x 512 images in 16 x 16 patches = 1024 patches, 12 layers of 768, 12
  heads, FFN 3072, no class token, post-layernorm), as SmolVLM-256M's;
- connector: SmolVLM's (Idefics3's) pixel shuffle by 4 (each 4 x 4 block of patches one feature of 16 x 768) and
  a linear map to the decoder's width: 64 image tokens per image;
- decoder: SmolLM2-135M's shape (30 layers of 576, 9 heads / 3 K/V heads, FFN 1536, vocab 49152, tied head).

Exported by kvforge (FP32, validated; SmolLM2's tokenizer) and calibrated INT8 by kvforge (both graphs, default
recipe: synthetic images for the vision graph, the built-in text and one prompt per image for the decoder), run on
ONNX Runtime by the VisionLanguageSession in two modes (--modes), each precision's sessions of both in the same runs:
`packed`, the ORT variant with GroupQueryAttention over a packed cache, which the decoder runs by default since issue
52 (the image features bound per call); `graph`, the decoder graph as exported (variant=False), what vision-language
bundles ran before.

Images are one 512 x 512 tile each here (SmolVLM's processor would also cut a large image into such tiles, each
one more pass of the vision graph). Per run, each precision and mode in turn: the vision graph on one image (and on 4, per image), then greedy decoding of
--new-tokens tokens after a prompt of 64 image tokens + 16 text tokens, and after 80 text tokens (same context
length). Decode tokens/s counts the tokens after the first (the prefill is timed apart). The roofline is the
decoder graph's weight bytes over this machine's read bandwidth measured in the same run. Medians over --runs;
INT8 / FP32 ratios from the same runs. The INT8 image features' cosine with FP32's is reported (the images
here are random pixels).

    python3 -m benchmarks.features.vlm_smolvlm [--runs 5] [--new-tokens 32] [--precisions float32,int8] [--modes packed,graph]
Writes benchmarks/results/vlm_smolvlm.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import RESULTS, bandwidth_gbs, load_average, machine, utc_time, write_result

IMAGE_TOKEN = 49151
CONFIG = dict(
    vision=dict(image_size=512, patch_size=16, dim=768, n_layers=12, n_heads=12, ffn_dim=3072, class_token=False,
                patch_bias=True, pre_norm=False, post_norm=True, norm_eps=1e-6, activation="gelu_tanh",
                feature_layer=-1, feature_select="full", position_buckets=True),
    decoder=dict(vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_dim=1536, max_seq_len=2048,
                 rope_theta=100000.0, tie_embeddings=True, family="llama", bos_token_id=1, eos_token_id=2),
    image_token_id=IMAGE_TOKEN, projector="pixel_shuffle", projector_scale=4,
    image_processing=dict(size={"height": 512, "width": 512}, do_center_crop=False, image_mean=[0.5] * 3,
                          image_std=[0.5] * 3, resample=2),
)


# the decoder runs compared (runtime.load options; what each is)
MODES = {
    "packed": ({}, "the ONNX Runtime variant with GroupQueryAttention over a packed cache (the default since issue 52)"),
    "graph": ({"variant": False}, "the decoder graph as exported (what vision-language bundles ran before issue 52)"),
}


def bundle_path(cache: Path) -> Path:
    """The exported bundle, made once per config (kept under --cache)."""
    from kvforge.export import export
    from kvforge.model_defs import save_checkpoint
    from kvforge.model_defs.model import init_random_weights
    from kvforge.model_defs.vision import VisionLanguageConfig, build_vision_language

    # SmolLM2's tokenizer (the decoder's vocabulary): the calibration reads the built-in text with it
    key = hashlib.sha256(json.dumps({**CONFIG, "tokenizer": "smollm2"}, sort_keys=True).encode()).hexdigest()[:12]
    bundle = cache / f"smolvlm-shaped-{key}"
    if not (bundle / "kvforge.json").is_file():
        checkpoint = cache / f"smolvlm-shaped-{key}-checkpoint"
        if not checkpoint.exists():
            from kvforge.model_defs.checkpoint import packaged_file
            from kvforge.model_defs.gguf import gguf_tokenizer, read_gguf_tokenizer

            tokenizer = gguf_tokenizer(read_gguf_tokenizer(packaged_file("smollm2")))
            save_checkpoint(init_random_weights(build_vision_language(VisionLanguageConfig(**CONFIG)), seed=0), checkpoint,
                            tokenizer=tokenizer)
        started = time.time()
        export(checkpoint, bundle, force=True)
        print(f"exported in {time.time() - started:.0f} s", flush=True)
    return bundle


def int8_path(fp32: Path) -> Path:
    """The INT8 bundle calibrated from the FP32 one (kept beside it)."""
    from kvforge.calibration import calibrate

    out = fp32.with_name(fp32.name + "-int8")
    if not (out / "kvforge.json").is_file():
        started = time.time()
        calibrate(fp32, out, precision="int8", force=True)
        print(f"calibrated in {time.time() - started:.0f} s", flush=True)
    return out


def decoder_weight_bytes(bundle) -> int:
    """The decoder graph's initializer bytes (what a decode step reads), external data included."""
    import onnx

    model = onnx.load(str(bundle.path / bundle.manifest["graph"]), load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        size = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        total += int(np.prod(t.dims, dtype=np.int64)) * size
    return total


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
    ap.add_argument("--out", type=Path, default=RESULTS / "vlm_smolvlm.json")
    ap.add_argument("--precisions", type=lambda s: s.split(","), default=["float32", "int8"])
    ap.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES),
                    help="decoder runs to compare, in the same runs: " + "; ".join(f"{k}: {v[1]}" for k, v in MODES.items()))
    args = ap.parse_args()
    load_before = load_average()
    if not set(args.precisions) <= {"float32", "int8"} or not args.precisions:
        ap.error("--precisions: float32 and/or int8")
    if not set(args.modes) <= set(MODES) or not args.modes:
        ap.error(f"--modes: some of {sorted(MODES)}")
    from PIL import Image

    from kvforge import runtime
    from kvforge.bundle import Bundle

    args.cache.mkdir(parents=True, exist_ok=True)
    fp32 = bundle_path(args.cache)
    paths = {"float32": fp32}
    if "int8" in args.precisions:
        paths["int8"] = int8_path(fp32)
    paths = {p: paths[p] for p in args.precisions}
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)) for _ in range(4)]
    text = rng.integers(3, 49000, 80).tolist()
    with_image = [1] + text[:8] + [IMAGE_TOKEN] * 64 + text[8:15]
    without = [1] + text[:79]
    assert len(with_image) == len(without) == 80
    bandwidth = [bandwidth_gbs()]
    keys = ("one", "four", "prefill_img", "decode_img", "prefill_txt", "decode_txt")
    runs = [(p, mode) for p in paths for mode in args.modes]
    samples = {run: {k: [] for k in keys} for run in runs}
    sessions = {(p, mode): runtime.load(paths[p], **MODES[mode][0]).activate() for p, mode in runs}
    features = {}
    for (p, mode), session in sessions.items():
        features[p] = session.image_features(images).astype(np.float64)  # warm-up
        timed_generate(session, with_image, images[:1], 4)
    packed = {f"{p}/{mode}": bool(session.backend.packed) for (p, mode), session in sessions.items()}
    for _ in range(args.runs):
        bandwidth.append(bandwidth_gbs())  # read bandwidth varies on this machine: sampled every run
        for (p, mode), session in sessions.items():
            got = samples[p, mode]
            start = time.perf_counter()
            session.image_features(images[:1])
            got["one"].append(time.perf_counter() - start)
            start = time.perf_counter()
            session.image_features(images)
            got["four"].append((time.perf_counter() - start) / 4)
            a, b = timed_generate(session, with_image, images[:1], args.new_tokens)
            got["prefill_img"].append(a)
            got["decode_img"].append(b)
            a, b = timed_generate(session, without, [], args.new_tokens)
            got["prefill_txt"].append(a)
            got["decode_txt"].append(b)
            print(f"{p} {mode}: image {got['one'][-1] * 1000:.0f} ms (4: {got['four'][-1] * 1000:.0f} ms each); decode "
                  f"with image {got['decode_img'][-1]:.1f} tok/s, without {got['decode_txt'][-1]:.1f} tok/s", flush=True)
    for session in sessions.values():
        session.deactivate()
    bandwidth.append(bandwidth_gbs())
    bw = statistics.median(bandwidth)
    med = {run: {k: statistics.median(v) for k, v in got.items()} for run, got in samples.items()}
    per_precision = {}
    for p, mode in runs:
        bundle = Bundle(paths[p])
        weight_bytes = decoder_weight_bytes(bundle)
        roofline = bw * 1e9 / weight_bytes
        m = med[p, mode]
        per_precision.setdefault(p, {})[mode] = {
            "decoder": MODES[mode][1], "packed_cache": packed[f"{p}/{mode}"],
            "bundle_bytes": sum(f["bytes"] for f in bundle.manifest["files"].values() if f.get("bytes")),
            "decoder_weight_bytes": weight_bytes,
            "vision_ms_per_image": {"batch_1": 1000 * m["one"], "batch_4": 1000 * m["four"]},
            "prefill_ms": {"with_image_including_vision": 1000 * m["prefill_img"], "text_only": 1000 * m["prefill_txt"]},
            "decode_tokens_per_s": {"one_image_in_context": m["decode_img"], "text_only_same_length": m["decode_txt"]},
            "decode_with_image_vs_text": m["decode_img"] / m["decode_txt"],
            "decode_roofline_tokens_per_s": roofline,
            "decode_fraction_of_roofline": m["decode_img"] / roofline,
            "samples": {"vision_ms": [1000 * x for x in samples[p, mode]["one"]],
                        "decode_with_image": samples[p, mode]["decode_img"], "decode_text": samples[p, mode]["decode_txt"]},
        }
    result = {
        "benchmark": "vlm_smolvlm", "model": "SmolVLM-shaped (random weights)", "config": CONFIG,
        "backend": "onnxruntime", "runs": args.runs,
        "new_tokens": args.new_tokens, "prompt_tokens": 80, "image_tokens": 64,
        "precisions": per_precision,
        "bandwidth_gbs": bw, "bandwidth_samples_gbs": bandwidth,
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    mode = args.modes[0]
    if "int8" in paths and "float32" in paths:
        f, q = features["float32"].reshape(4, -1), features["int8"].reshape(4, -1)
        cos = (f * q).sum(-1) / (np.linalg.norm(f, axis=-1) * np.linalg.norm(q, axis=-1))
        result["int8_vs_float32"] = {
            "decoder": mode,
            "vision_speedup_batch_1": med["float32", mode]["one"] / med["int8", mode]["one"],
            "decode_speedup_with_image": med["int8", mode]["decode_img"] / med["float32", mode]["decode_img"],
            "image_feature_cosine_min": float(cos.min()),
        }
    if set(args.modes) == set(MODES):  # the same runs: the packed cache's gain on the decode with an image
        result["packed_vs_graph"] = {p: {k: med[p, "packed"][x] / med[p, "graph"][x] for k, x in (
            ("decode_with_image", "decode_img"), ("decode_text_only", "decode_txt"),
            ("prefill_with_image_speedup", "prefill_img"))} for p in paths}
        for p in paths:  # (prefill: a time, so its speedup is graph over packed)
            result["packed_vs_graph"][p]["prefill_with_image_speedup"] **= -1
    write_result("vlm_smolvlm", result, args.out)
    print(json.dumps({"bandwidth_gbs": bw, **{f"{p}/{mode}": {k: r[k] for k in (
        "vision_ms_per_image", "prefill_ms", "decode_tokens_per_s", "decode_fraction_of_roofline")}
        for p, modes in per_precision.items() for mode, r in modes.items()},
        "int8_vs_float32": result.get("int8_vs_float32"), "packed_vs_graph": result.get("packed_vs_graph")}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
