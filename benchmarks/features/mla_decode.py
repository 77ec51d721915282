"""Multi-head latent attention decode against multi-head attention of the same width, by context length.

Two kvforge models, random weights, FP32, exported (validated) and run by the runtime on ONNX Runtime, batch 1:

    mha   8 layers, dim 512, 8 heads of 64, every head its own K and V: 2 x 8 x 64 = 1024 cached values per
          token and layer
    mla   the same width and heads with DeepSeek's latent attention: a 128-wide latent + 32 RoPE dims cached
          (160 values per token and layer: 6.4x fewer), queries of 64 + 32, values of 64, kv_b_proj absorbed

At each context (64, 1024, 4096 past tokens; the past is built by a chunked prefill through the runtime), the
time of cached single-token decode steps, the median over the steps of all runs; the models alternate run by
run, and the memory bandwidth measured in the same run gives each one's weight + cache read bound. MHA runs
the runtime's default path (ONNX Runtime's GroupQueryAttention over a packed cache where it applies), MLA its
graph as exported.

    python3 -m benchmarks.features.mla_decode [--runs 3] [--steps 16]
Writes benchmarks/results/mla_decode.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import RESULTS, bandwidth_gbs, load_average, machine, utc_time, write_result
from benchmarks.peers.runtime_125m import export_random

CONTEXTS = (64, 1024, 4096)
BASE = dict(vocab_size=8192, dim=512, n_layers=8, n_heads=8, ffn_dim=1408, max_seq_len=4096 + 64,
            bos_token_id=1, eos_token_id=2)
MODELS = {
    "mha": dict(BASE, head_dim=64),
    "mla": dict(BASE, head_dim=32, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
}
CHUNK = 512


def cache_values_per_token(cfg) -> int:
    return sum(heads * dim for i in range(cfg.n_layers) for _, heads, dim in cfg.cache_entries(i))


def decode_ms(session, context: int, steps: int, seed: int) -> list[float]:
    """Fill a cache of `context` tokens (chunked prefill), then time `steps` single-token decode steps."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, BASE["vocab_size"], (1, context), dtype=np.int64)
    cache = None
    for start in range(0, context, CHUNK):
        chunk = ids[:, start:start + CHUNK]
        mask = np.ones((1, start + chunk.shape[1]), np.int64)
        logits, cache = session.forward(chunk, mask, cache=cache, last_logits_only=True)
    token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
    times = []
    for step in range(steps):
        mask = np.ones((1, context + step + 1), np.int64)
        t = time.perf_counter()
        logits, cache = session.forward(token, mask, cache=cache, last_logits_only=True)
        token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        times.append((time.perf_counter() - t) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default=str(RESULTS / "mla_decode.json"))
    args = ap.parse_args()
    load_before = load_average()
    from kvforge import runtime

    info, sessions = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, fields in MODELS.items():
            bundle, model, seconds = export_random(fields, tmp, name)
            weights = sum(p.numel() for n, p in model.named_parameters() if n != "embed.weight")
            info[name] = {"parameters": model.num_parameters(), "weight_bytes_read": 4 * weights,
                          "cache_values_per_token": cache_values_per_token(model.config),
                          "cache_inputs": [t.shape for t in bundle.io.inputs[3:5]], "export_seconds": seconds}
            sessions[name] = runtime.load(bundle.path).activate()
            del model
        for s in sessions.values():  # warm-up
            decode_ms(s, 64, 4, seed=99)
        samples = {n: {c: [] for c in CONTEXTS} for n in MODELS}
        bandwidths = []
        for r in range(args.runs):
            bandwidths.append(bandwidth_gbs(reps=5))
            for n in (list(MODELS) if r % 2 == 0 else list(MODELS)[::-1]):
                for c in CONTEXTS:
                    samples[n][c] += decode_ms(sessions[n], c, args.steps, seed=r)
            print(f"run {r + 1}: " + "; ".join(
                f"{n} " + ", ".join(f"{c}: {statistics.median(samples[n][c]):.2f} ms" for c in CONTEXTS) for n in MODELS),
                flush=True)
    bw = statistics.median(bandwidths)
    table = {}
    for n in MODELS:
        table[n] = {}
        for c in CONTEXTS:
            read = info[n]["weight_bytes_read"] + 4 * info[n]["cache_values_per_token"] * c
            ms = statistics.median(samples[n][c])
            table[n][str(c)] = {"decode_ms_per_token": round(ms, 3), "bytes_read": read,
                                "roofline_ms": round(read / (bw * 1e9) * 1e3, 3)}
    ratio = {str(c): round(table["mha"][str(c)]["decode_ms_per_token"] / table["mla"][str(c)]["decode_ms_per_token"], 3)
             for c in CONTEXTS}
    result = {
        "benchmark": "mla_decode", "runs": args.runs, "steps_per_run": args.steps, "bandwidth_gbs": round(bw, 2),
        "models": {n: {**MODELS[n], **info[n], "by_context": table[n]} for n in MODELS},
        "mha_over_mla_ms": ratio,
        "cache_ratio": round(info["mha"]["cache_values_per_token"] / info["mla"]["cache_values_per_token"], 2),
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result("mla_decode", result, args.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
