"""Quantized decode against its memory roofline, and against ONNX Runtime GenAI's quantized builds (issue 18).

On the runtime benchmark's ~125M Llama checkpoint (runtime_125m.py: hidden 768, 12 layers, 12/4 heads, FFN
2048, vocab 32000, random weights, a local tokenizer), in one run:

- kvforge bundles: FP32; INT8 W8A8 (MSE, SmoothQuant 0.5, 64 x 256 tokens of tiny's calibration text) with the
  vocabulary projection in float and quantized; INT4 weight-only, block 128 and 32, each with the head in float
  and quantized. All run on the ONNX Runtime backend as users get it (the ORT variant: GroupQueryAttention over a
  packed shared-buffer cache, fused siblings);
- ONNX Runtime GenAI's builds of the same checkpoint: `-p int8 -e cpu` and `-p int4 -e cpu`.

Batch 1, prompt 64, 128 new tokens, greedy; contenders interleaved run by run in balanced orders with a pause
before each (as runtime_125m.py), medians. The roofline of each bundle is the bytes of its weights as stored
that a decode step reads (every initializer but the embedding table, which is gathered) over this machine's
read bandwidth, measured three times in the same run (median). FP32's decode time per token is also measured
at 64, 1024 and 4096 tokens of context, with the packed cache and with the bundle's attention (what the backend
ran before issue 18), in alternating blocks.

    python3 -m benchmarks.peers.quantized_decode_125m [--runs 6] [--skip-genai] [--work DIR]

--work keeps the checkpoint, bundles and GenAI builds in DIR and reuses them on the next run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import (RESULTS, bandwidth_gbs, decode_rate, interleaved_runs, load_average, machine,
                                onnx_weight_bytes, utc_time, write_result)
from benchmarks.peers.runtime_125m import NEW_TOKENS, PROMPT_LEN, GenAI, make_checkpoint

INT8 = dict(recipe="fixed", precision="int8", method="mse", smoothquant=0.5)
BUNDLES = {  # name -> calibrate() options (None: the FP32 export)
    "fp32": None,
    "int8": INT8,
    "int8+head": dict(INT8, quantize_lm_head=True),
    "int4-b128": dict(recipe="fixed", precision="int4", block_size=128),
    "int4-b32": dict(recipe="fixed", precision="int4", block_size=32),
    "int4-b128+head": dict(recipe="fixed", precision="int4", block_size=128, quantize_lm_head=True),
    "int4-b32+head": dict(recipe="fixed", precision="int4", block_size=32, quantize_lm_head=True),
}
CONTEXTS = (64, 1024, 4096)


def build(work: Path) -> dict:
    from kvforge.bundle import Bundle
    from kvforge.calibration import calibrate
    from kvforge.export import export
    from kvforge.model_defs.checkpoint import TINY_DIR

    if not (work / "ckpt" / "config.json").is_file():
        make_checkpoint(work / "ckpt")
    bundles = {}
    for name, options in BUNDLES.items():
        path = work / name
        if not (path / "kvforge.json").is_file():
            if options is None:
                export(work / "ckpt", path, force=True)
            else:
                calibrate(work / "fp32", path, data=TINY_DIR / "calibration.txt", samples=64, seq_len=256, force=True, **options)
        bundles[name] = Bundle(path)
    return bundles


def context_ms(path: Path, blocks: int = 3, steps: int = 12) -> dict:
    """FP32 decode ms/token at each context, packed cache vs the bundle's attention, in alternating blocks."""
    from kvforge import runtime

    out = {}
    rng = np.random.default_rng(1)
    for attention in ("auto", "graph"):
        out[attention] = {}
    sessions = {a: runtime.load(path, attention=a) for a in ("auto", "graph")}
    for ctx in CONTEXTS:
        prompt = rng.integers(0, 32000, (1, ctx), dtype=np.int64)
        times = {a: [] for a in sessions}
        for _ in range(blocks):
            for a, s in sessions.items():
                with s:
                    _, cache = s.forward(prompt, last_logits_only=True)
                    for i in range(steps):
                        mask = np.ones((1, ctx + i + 1), np.int64)
                        t = time.perf_counter()
                        _, cache = s.forward(np.array([[7]], np.int64), mask, cache=cache, last_logits_only=True)
                        times[a].append(time.perf_counter() - t)
        for a in sessions:
            out[a][str(ctx)] = 1000 * statistics.median(times[a])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--skip-genai", action="store_true")
    ap.add_argument("--work", type=Path, default=None, help="keep (and reuse) the checkpoint, bundles and GenAI builds here")
    ap.add_argument("--out", type=Path, default=RESULTS / "quantized_decode_125m.json")
    args = ap.parse_args()
    load_before = load_average()
    from kvforge import runtime
    from kvforge.runtime.bench import timed_greedy

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        bundles = build(work)
        weight_bytes = {n: onnx_weight_bytes(b.graph_file) for n, b in bundles.items()}
        sessions = {n: runtime.load(b.path).activate() for n, b in bundles.items()}
        assert all(s.backend.packed for s in sessions.values()), "every bundle should run the packed attention"
        prompt = np.random.default_rng(0).integers(3, 8000, (1, PROMPT_LEN), dtype=np.int64)
        contenders = {n: (lambda s=s: timed_greedy(s, prompt, NEW_TOKENS)) for n, s in sessions.items()}
        if not args.skip_genai:
            for p in ("int8", "int4"):
                g = GenAI(work / "ckpt", work, precision=p)
                contenders[f"genai-{p}"] = lambda g=g: g.run(prompt)
        bandwidth: list[float] = []
        runs = interleaved_runs(contenders, args.runs, decode_rate,
                                lambda i: i in (-1, args.runs // 2) and bandwidth.append(bandwidth_gbs()))
        for s in sessions.values():
            s.deactivate()
        contexts = context_ms(bundles["fp32"].path)
        bandwidth.append(bandwidth_gbs())
        tokens_fp32 = runs["fp32"][0]["tokens"]

    bw = statistics.median(bandwidth)
    summary = {}
    for name, rs in runs.items():
        decode = statistics.median(decode_rate(r) for r in rs)
        entry = {"decode_tokens_per_s": decode, "decode_ms_per_token": 1000 / decode,
                 "prefill_tokens_per_s": statistics.median(PROMPT_LEN / r["prefill_s"] for r in rs),
                 "greedy_first_16_agree_with_fp32": rs[0]["tokens"][:16] == tokens_fp32[:16]}
        if name in weight_bytes:
            roofline = bw * 1e9 / weight_bytes[name]
            entry.update(weight_bytes_per_token=weight_bytes[name], roofline_tokens_per_s=roofline,
                         fraction_of_roofline=decode / roofline)
        summary[name] = entry
    ratios = {}
    for ours, theirs in (("int8", "genai-int8"), ("int8+head", "genai-int8"), ("int4-b128", "genai-int4"),
                         ("int4-b32", "genai-int4"), ("int4-b128+head", "genai-int4"), ("int4-b32+head", "genai-int4")):
        if theirs in summary:
            ratios[f"{ours}_vs_{theirs}"] = summary[ours]["decode_tokens_per_s"] / summary[theirs]["decode_tokens_per_s"]
    growth = {a: {c: ms - contexts[a]["64"] for c, ms in v.items()} for a, v in contexts.items()}
    result = {
        "benchmark": "quantized_decode_125m", "batch": 1, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
        "runs": args.runs, "bandwidth_gbs": bw, "bandwidth_samples_gbs": bandwidth, "contenders": summary,
        "ratios": ratios, "fp32_decode_ms_per_token_at_context": contexts,
        "fp32_decode_growth_over_64_ms": growth,
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result("quantized_decode_125m", result, args.out)
    for name, e in summary.items():
        extra = f", {100 * e['fraction_of_roofline']:.0f}% of roofline {e['roofline_tokens_per_s']:.0f}" if "fraction_of_roofline" in e else ""
        print(f"{name:16s} {e['decode_tokens_per_s']:6.1f} tok/s ({e['decode_ms_per_token']:.2f} ms){extra}")
    print(json.dumps(ratios, indent=1))
    print(json.dumps(contexts, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
