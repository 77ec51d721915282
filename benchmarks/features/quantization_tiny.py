"""Accuracy of every quantization recipe on `tiny`, against its FP32 bundle, over the held-out corpus.

For each recipe: perplexity and its change, top-1 next-token agreement and
mean KL divergence from FP32, and calibration time. The headline INT8 recipe
is also calibrated in a fresh process on 128 x 256 tokens to measure time and
peak memory. Writes JSON and prints a Markdown table (the README's).

    python3 -m benchmarks.features.quantization_tiny [--out benchmarks/results/quantization_tiny.json] [--only TEXT]

--only re-measures the recipes whose label contains TEXT and merges them into
the existing results file (the other rows and the headline cost stay).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result

RECIPES = [
    ("int8", {"method": "max"}),
    ("int8", {"method": "percentile", "percentile": 99.99}),
    ("int8", {"method": "entropy"}),
    ("int8", {"method": "mse"}),
    ("int8", {"method": "max", "smoothquant": 0.5}),
    ("int8", {"method": "percentile", "percentile": 99.99, "smoothquant": 0.5}),
    ("int8", {"method": "entropy", "smoothquant": 0.5}),
    ("int8", {"method": "mse", "smoothquant": 0.5}),
    ("fp8", {"method": "max"}),
    ("fp8", {"method": "percentile", "percentile": 99.99}),
    ("fp8", {"method": "entropy"}),
    ("fp8", {"method": "mse"}),
    ("fp8", {"method": "max", "smoothquant": 0.5}),
    ("fp8", {"method": "mse", "smoothquant": 0.5}),
    ("int8", {"method": "mse", "smoothquant": 0.5, "quantize_lm_head": True}),
    ("int4", {"block_size": 128, "quantize_lm_head": True}),
    ("fp8", {"method": "max", "exclude": [r"layers\.0\."]}),
    ("fp8", {"method": "max", "exclude": [r"layers\.0\.", r"layers\.3\."]}),
    ("fp8", {"method": "max", "accuracy_budget": {"top1_agreement": 0.985}}),
    ("int4", {"block_size": 32}),
    ("int4", {"block_size": 64}),
    ("int4", {"block_size": 128}),
    ("int8", {"method": "mse", "smoothquant": 0.5, "gptq": True}),
    ("fp8", {"method": "max", "gptq": True}),
    ("fp8", {"method": "mse", "gptq": True}),
    ("int4", {"block_size": 32, "gptq": True}),
    ("int4", {"block_size": 128, "gptq": True}),
]
HEADLINE = ("int8", {"method": "mse", "smoothquant": 0.5})

CHILD = r"""
import json, resource, sys, time
from kvforge.calibration import calibrate
t = time.perf_counter()
calibrate(sys.argv[1], sys.argv[2], recipe="fixed", precision="int8", method="mse", smoothquant=0.5, samples=128, seq_len=256, force=True)
print(json.dumps({"seconds": time.perf_counter() - t, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def evaluate(bundle, reference_logits, chunks):
    from kvforge import metrics, runtime
    from kvforge.runtime.evaluate import window_logits

    nll, agree, kl = [], [], []
    with runtime.load(bundle) as s:
        for (logits, targets), ref in zip(window_logits(s, chunks), reference_logits):
            nll.append(-np.take_along_axis(metrics.log_softmax(logits), targets[..., None], -1).ravel())
            agree.append(metrics.top1_agreement(logits, ref))
            kl.append(metrics.kl_divergence(logits, ref).mean())
    return float(np.exp(np.mean(np.concatenate(nll)))), float(np.mean(agree)), float(np.mean(kl))


def label(precision, options):
    parts = [precision.upper()]
    if precision == "int4":
        parts.append(f"block {options['block_size']}")
    else:
        m = options["method"]
        parts.append(f"{m} {options['percentile']}" if m == "percentile" else m)
        parts.append(f"SmoothQuant {options['smoothquant']}" if "smoothquant" in options else "no SmoothQuant")
    if options.get("gptq"):
        parts.append("GPTQ")
    if options.get("quantize_lm_head"):
        parts.append("lm_head quantized too")
    if options.get("exclude"):
        parts.append("kept in float: " + " ".join(e.replace("\\", "").rstrip(".") for e in options["exclude"]))
    if options.get("accuracy_budget"):
        parts.append("--accuracy-budget " + " ".join(f"{k}={v}" for k, v in options["accuracy_budget"].items()))
    if "kept_in_float" in options:
        parts.append(f"(kept {' '.join(options['kept_in_float']) or 'nothing'} in float)")
    return ", ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULTS / "quantization_tiny.json")
    ap.add_argument("--only", help="re-measure the recipes whose label contains this, merged into --out")
    args = ap.parse_args()
    load_before = load_average()
    recipes = [r for r in RECIPES if not args.only or args.only in label(*r)]
    from kvforge import runtime
    from kvforge.calibration import calibrate
    from kvforge.export import export
    from kvforge.model_defs.evaluate import heldout_text
    from kvforge.runtime.evaluate import window_logits, windows
    from kvforge.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fp32 = export("tiny", tmp / "fp32")
        tok = Tokenizer.from_file(fp32.tokenizer_file)
        chunks = windows(tok.encode(heldout_text(), add_special_tokens=False), 256)
        with runtime.load(fp32.path) as s:
            reference = [logits for logits, _ in window_logits(s, chunks)]
        ref_ppl, _, _ = evaluate(fp32.path, reference, chunks)
        rows = []
        for precision, options in recipes:
            t = time.perf_counter()
            q = calibrate(fp32.path, tmp / "q", recipe="fixed", precision=precision, force=True, **options)
            seconds = time.perf_counter() - t
            ppl, top1, kl = evaluate(q.path, reference, chunks)
            budget = q.manifest["calibration"].get("accuracy_budget")
            if budget:
                options = {**options, "kept_in_float": budget["kept_in_float"]}
            rows.append({"recipe": label(precision, options), "precision": precision, "options": options,
                         "perplexity": ppl, "perplexity_delta_pct": 100 * (ppl / ref_ppl - 1),
                         "top1_agreement": top1, "kl_divergence_mean": kl, "calibration_s": seconds})
            print(f"{rows[-1]['recipe']:45s} ppl {ppl:.3f} ({rows[-1]['perplexity_delta_pct']:+.2f}%)  top-1 {top1:.4f}  KL {kl:.5f}", flush=True)
        if args.only:
            previous = json.loads(args.out.read_text())
            measured = {r["recipe"]: r for r in rows}
            order = [label(*r) for r in RECIPES]
            kept = {r["recipe"]: r for r in previous["recipes"] if r["recipe"] not in measured}
            def position(row):  # a budget row's label ends with what it kept in float
                name = row["recipe"].split(", (kept")[0]
                return order.index(name) if name in order else len(order)
            rows = sorted({**kept, **measured}.values(), key=position)
            headline_cost = previous["headline"]["calibration_128x256"]
        else:
            child = subprocess.run([sys.executable, "-c", CHILD, str(fp32.path), str(tmp / "headline")],
                                   capture_output=True, text=True, check=True)
            headline_cost = json.loads(child.stdout.strip().splitlines()[-1])
    result = {
        "benchmark": "quantization_tiny", "corpus": "tiny held-out", "tokens": int(chunks.size - len(chunks)),
        "windows": int(len(chunks)), "fp32_perplexity": ref_ppl, "recipes": rows,
        "headline": {"recipe": label(*HEADLINE), "calibration_128x256": headline_cost},
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result("quantization_tiny", result, args.out)
    print(f"\nFP32 perplexity {ref_ppl:.3f} over {result['tokens']} held-out tokens\n")
    print("| recipe | perplexity | change | top-1 agreement | KL (nats) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['recipe']} | {r['perplexity']:.3f} | {r['perplexity_delta_pct']:+.2f}% | {100 * r['top1_agreement']:.2f}% | {r['kl_divergence_mean']:.5f} |")
    print(f"\nheadline calibration ({result['headline']['recipe']}, 128 x 256 tokens): {headline_cost}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
