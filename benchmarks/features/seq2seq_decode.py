"""Encoder-decoder decode cost against source length: ms per target token at source 64 vs 1024.

A T5-small-shaped model (d_model 512, 6 + 6 layers, 8 heads of 64, gated-GELU
FFN 1024, vocab 32128, random weights) exported by kvforge (FP32, validated),
run on ONNX Runtime through the runtime's Seq2SeqSession. The encoder runs
once per source and hands every decoder layer its cross-attention K/V; each
decoder step then reads the decoder's weights, its own cache and those
cross K/V. So the step's cost should grow with the source length only by
reading the longer cross K/V (and the attention over it):

    extra bytes per step = decoder layers x 2 (K, V) x heads x (1024 - 64) x head_dim x 4

which this machine's memory bandwidth, measured in the same run, turns into a
time: the bound the measured difference is held to (with the attention's
arithmetic over 960 more keys, ~2x the read is the criterion).

Medians over runs; the two source lengths interleaved run by run (a noisy
neighbour hits both alike); greedy, batch 1, 64 new tokens after the first
(the first step, which also carries the encoder's call, is timed apart).

    python3 -m benchmarks.features.seq2seq_decode [--runs 5] [--new-tokens 64]
Writes benchmarks/results/seq2seq_decode.json.
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

SHAPE = dict(vocab_size=32128, dim=512, n_layers=6, n_decoder_layers=6, n_heads=8, head_dim=64, ffn_dim=1024,
             max_seq_len=1024, relative_buckets=32, relative_max_distance=128, activation="gelu_tanh", gated_ffn=True,
             tie_embeddings=False, family="t5", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
SOURCES = (64, 1024)


def make_checkpoint(directory: Path) -> dict:
    from kvforge.model_defs import save_checkpoint
    from kvforge.model_defs.model import init_random_weights
    from kvforge.model_defs.seq2seq import Seq2SeqConfig, build_seq2seq

    model = init_random_weights(build_seq2seq(Seq2SeqConfig(**SHAPE)), seed=0)
    save_checkpoint(model, directory)
    return {"parameters": model.num_parameters()}


def timed_decode(session, source: np.ndarray, new_tokens: int) -> dict:
    """Greedy decode of new_tokens + 1 target tokens: the first step (with the encoder) and the rest, per token."""
    mask = np.ones_like(source)
    model = session.activate().backend
    cfg = session.config
    t0 = time.perf_counter()
    cross = model.encode(source, mask)
    empty = np.zeros((1, cfg["decoder_heads"], 0, cfg["decoder_head_dim"]), np.float32)
    past = [(empty, empty) for _ in cross]
    nxt = np.full((1, 1), cfg["decoder_start_token_id"], np.int64)
    logits, past = model.decode(nxt, mask, past, cross)
    first = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(new_tokens):
        nxt = logits[:, -1:].argmax(-1).astype(np.int64)
        logits, past = model.decode(nxt, mask, past, cross)
    return {"first_step_ms": 1e3 * first, "ms_per_token": 1e3 * (time.perf_counter() - t1) / new_tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "seq2seq_decode.json"))
    args = ap.parse_args()
    load_before = load_average()

    from kvforge import runtime
    from kvforge.export import export

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        info = make_checkpoint(tmp / "ckpt")
        t = time.time()
        bundle = export(tmp / "ckpt", tmp / "bundle")
        export_s = time.time() - t
        session = runtime.load(bundle.path).activate()
        rng = np.random.default_rng(0)
        sources = {n: rng.integers(2, SHAPE["vocab_size"], (1, n)).astype(np.int64) for n in SOURCES}
        for n in SOURCES:  # warm-up
            timed_decode(session, sources[n], 4)
        runs = {n: [] for n in SOURCES}
        bandwidths = []
        for r in range(args.runs):
            bandwidths.append(bandwidth_gbs(reps=5))
            for n in (SOURCES if r % 2 == 0 else SOURCES[::-1]):
                runs[n].append(timed_decode(session, sources[n], args.new_tokens))
            print(f"run {r + 1}: " + ", ".join(f"source {n}: {runs[n][-1]['ms_per_token']:.2f} ms/token" for n in SOURCES),
                  flush=True)
    bw = statistics.median(bandwidths)
    med = {n: {k: statistics.median(x[k] for x in runs[n]) for k in runs[n][0]} for n in SOURCES}
    layers, H, D = SHAPE["n_decoder_layers"], SHAPE["n_heads"], SHAPE["head_dim"]
    extra_bytes = layers * 2 * H * (SOURCES[1] - SOURCES[0]) * D * 4
    read_ms = extra_bytes / (bw * 1e9) * 1e3
    delta = med[SOURCES[1]]["ms_per_token"] - med[SOURCES[0]]["ms_per_token"]
    # the decoder's weights a step reads: every decoder parameter but the cross K/V projections (run once, in the
    # encoder graph) and the embedding (gathered)
    dim, ffn, V = SHAPE["dim"], SHAPE["ffn_dim"], SHAPE["vocab_size"]
    step_weights = 4 * (layers * (4 * dim * H * D + 2 * dim * H * D + 3 * dim * ffn) + V * dim)
    result = {
        "benchmark": "seq2seq_decode", "machine": machine(), "load_before": load_before, "time": utc_time(),
        "model": {**SHAPE, **info}, "export_seconds": round(export_s, 1), "runs": args.runs, "new_tokens": args.new_tokens,
        "bandwidth_gbs": round(bw, 2),
        "source_64": {k: round(v, 3) for k, v in med[SOURCES[0]].items()},
        "source_1024": {k: round(v, 3) for k, v in med[SOURCES[1]].items()},
        "delta_ms_per_token": round(delta, 3),
        "extra_cross_kv_bytes_per_step": extra_bytes,
        "extra_cross_kv_read_ms_at_bandwidth": round(read_ms, 3),
        "decoder_weight_bytes_per_step": step_weights,
        "decoder_weight_read_ms_at_bandwidth": round(step_weights / (bw * 1e9) * 1e3, 3),
        "criterion": "delta <= 2 x the extra cross K/V read at the measured bandwidth",
        "passed": delta <= 2 * read_ms,
        "per_run": {str(n): runs[n] for n in SOURCES},
    }
    write_result("seq2seq_decode", result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "per_run"}, indent=2))


if __name__ == "__main__":
    main()
