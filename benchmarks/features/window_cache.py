"""Decode cost of windowed layers (capped caches) against full-attention layers, at 1x, 2x and 4x the window.

Three FP32 bundles of one Gemma-2-like shape (sandwich norms, soft-capping, GQA 8/4, head_dim 64,
width 512, 6 layers, random weights), exported by kvforge and run on the ONNX Runtime backend:
  windowed     every layer has a sliding window W = 1024 and keeps a capped cache of W positions
  global       no window: every layer's cache holds the whole context
  alternating  Gemma 2's pattern: even layers windowed, odd layers global
For each context C in (W, 2W, 4W): the cache is filled by a chunked prefill of C tokens, then the median
time of single-token decode steps is taken; contexts and models interleaved, runs repeated. A windowed
layer reads at most W cached positions per step, so the windowed model's decode time stays flat while the
global model's grows with C; the alternating model sits between. Also recorded: the cache each model holds
at each context, and this machine's memory bandwidth measured in the same run.

    python3 -m benchmarks.features.window_cache [--runs 5] [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import RESULTS, bandwidth_gbs, load_average, machine, utc_time, write_result

WINDOW = 1024
CONTEXTS = (WINDOW, 2 * WINDOW, 4 * WINDOW)
SHAPE = dict(
    vocab_size=4096, dim=512, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=1024, max_seq_len=4 * WINDOW + 64,
    norm_placement="sandwich", attn_scale=64 ** -0.5, attn_softcap=50.0, final_softcap=30.0, embed_scale=512 ** 0.5,
    activation="gelu_tanh", tie_embeddings=True, family="gemma2",
)
MODELS = {
    "windowed": dict(sliding_window=WINDOW),
    "global": dict(),
    "alternating": dict(sliding_window=WINDOW, sliding_window_layers=[0, 2, 4]),
}
CHUNK = 512  # prefill chunk


def make_bundles(work: Path) -> dict:
    from kvforge import runtime
    from kvforge.export import export
    from kvforge.model_defs import ModelConfig, build_model, init_random_weights, save_checkpoint

    sessions = {}
    for name, extra in MODELS.items():
        model = init_random_weights(build_model(ModelConfig(**SHAPE, **extra)), seed=0)
        ckpt = save_checkpoint(model, work / f"{name}-ckpt")
        bundle = export(ckpt, work / name)
        sessions[name] = runtime.load(bundle.path).activate()
    return sessions


def fill(session, context: int):
    """A cache of `context` tokens, filled in chunks (the graph takes a chunk over a past)."""
    rng = np.random.default_rng(context)
    cache = None
    for start in range(0, context, CHUNK):
        ids = rng.integers(3, SHAPE["vocab_size"], (1, min(CHUNK, context - start)), dtype=np.int64)
        mask = np.ones((1, start + ids.shape[1]), np.int64)
        _, cache = session.forward(ids, mask, cache=cache, last_logits_only=True)
    return cache


def decode_ms(session, cache, steps: int) -> float:
    token = np.array([[7]], np.int64)
    times = []
    for i in range(steps + 2):
        mask = np.ones((1, cache.length + 1), np.int64)
        t = time.perf_counter()
        _, cache = session.forward(token, mask, cache=cache, last_logits_only=True)
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def cache_mb(session, cache) -> float:
    return sum(a.nbytes for a in session.backend.cache_arrays(cache)) / 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=24, help="timed decode steps per measurement")
    ap.add_argument("--out", type=Path, default=RESULTS / "window_cache.json")
    args = ap.parse_args()
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        sessions = make_bundles(Path(tmp))
        caches = {(m, c): fill(s, c) for m, s in sessions.items() for c in CONTEXTS}
        held = {m: {str(c): round(cache_mb(sessions[m], caches[m, c]), 2) for c in CONTEXTS} for m in sessions}
        times = {(m, c): [] for m in sessions for c in CONTEXTS}
        keys = list(times)
        for run in range(args.runs):
            order = keys[run % len(keys):] + keys[:run % len(keys)]  # a different start each run
            for m, c in order:
                times[m, c].append(decode_ms(sessions[m], caches[m, c], args.steps))
            print(f"run {run}: " + ", ".join(f"{m}@{c} {times[m, c][-1]:.2f} ms" for m, c in keys), flush=True)
        bw = bandwidth_gbs()
    ms = {m: {str(c): statistics.median(times[m, c]) for c in CONTEXTS} for m in sessions}
    growth = {m: ms[m][str(CONTEXTS[-1])] / ms[m][str(CONTEXTS[0])] for m in sessions}
    result = {
        "benchmark": "window_cache", "window": WINDOW, "contexts": list(CONTEXTS), "shape": SHAPE,
        "models": {m: MODELS[m] for m in MODELS}, "runs": args.runs, "steps_per_measurement": args.steps,
        "decode_ms_per_token": ms,
        "growth_4w_over_1w": growth,
        "cache_mb_held": held,
        "bandwidth_gbs": bw,
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result("window_cache", result, args.out)
    print(json.dumps({k: result[k] for k in ("decode_ms_per_token", "growth_4w_over_1w", "cache_mb_held", "bandwidth_gbs")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
