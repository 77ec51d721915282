"""Soak: 10,000 tokens through one Session, with its resident memory sampled along the way.

The built-in `tiny` FP32 bundle on ONNX Runtime, one Session for the whole run: generations of 500 tokens
from varied prompts (single prompts, streams and left-padded batches of three, in turn), until 10,000 tokens
have been generated. RSS (VmRSS) is read after every generation; after a warm-up of the first 2,000 tokens it
must stay flat: the last reading within 5% of the first one after the warm-up; the exit status says whether it
did (0 flat, 1 not).

A reliability test run by hand, not by pytest (minutes; not a test_*.py file, so the suite does not collect it),
from the repository root; it writes benchmarks/results/soak.json through the benchmarks' harness:

    python3 -m tests.reliability.soak [--tokens 10000]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=10_000)
    ap.add_argument("--per-generation", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=2_000)
    ap.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = ap.parse_args()
    load_before = load_average()
    from kvforge import runtime
    from kvforge.export import export
    from kvforge.model_defs.evaluate import heldout_text

    text = heldout_text()
    samples = []
    with tempfile.TemporaryDirectory() as tmp:
        bundle = export("tiny", Path(tmp) / "tiny")
        started = time.time()
        with runtime.load(bundle.path) as s:
            generated, i = 0, 0
            while generated < args.tokens:
                start = (i * 997) % (len(text) - 400)
                prompts = [text[start + k * 50 : start + k * 50 + 60 + 40 * k] for k in range(3)]
                n = min(args.per_generation, args.tokens - generated)
                kind = ("generate", "stream", "batch")[i % 3]
                if kind == "generate":
                    generated += len(s.generate(prompts[0], max_new_tokens=n, ignore_eos=True).tokens)
                elif kind == "stream":
                    generated += sum(1 for _ in s.stream(prompts[1], max_new_tokens=n, ignore_eos=True))
                else:
                    per_row = max(1, n // 3)
                    generated += sum(len(r.tokens) for r in s.generate(prompts, max_new_tokens=per_row, ignore_eos=True))
                samples.append({"tokens": generated, "kind": kind, "rss_mb": round(rss_mb(), 1), "seconds": round(time.time() - started, 1)})
                print(f"{generated:6d} tokens  {kind:8s}  rss {samples[-1]['rss_mb']:.1f} MB", flush=True)
                i += 1
    after = [x for x in samples if x["tokens"] > args.warmup]
    first, last = after[0]["rss_mb"], samples[-1]["rss_mb"]
    growth = (last - first) / first
    result = {
        "benchmark": "soak", "bundle": "tiny fp32", "backend": "onnxruntime", "tokens": samples[-1]["tokens"],
        "warmup_tokens": args.warmup, "rss_mb_after_warmup": first, "rss_mb_end": last, "rss_mb_max": max(x["rss_mb"] for x in after),
        "growth_after_warmup": growth, "flat": abs(growth) < 0.05, "samples": samples,
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result("soak", result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    return 0 if result["flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
