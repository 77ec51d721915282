"""Quantization accuracy on the trained `tiny-moe` (latent attention + a mixture of experts), with routing.

For each recipe, over tiny's held-out corpus (256-token windows): perplexity and its change from the FP32
bundle, top-1 next-token agreement, and per MoE layer the routing agreement: the fraction of tokens whose
set of chosen experts (top-k) is the same as in FP32. Routers stay in float, so a changed choice comes from
the quantized layers before them. Also the calibration's per-expert token counts (how many of the
calibration tokens reached the least-used expert).

Targets (issue 15): perplexity increase INT8 <= 1%, FP8 <= 0.5%, INT4 (block 128) <= 3%.

    python3 -m benchmarks.features.moe_quantization [--windows N]
Writes benchmarks/results/moe_quantization.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result

RECIPES = [
    ("int8", {"method": "max"}),
    ("int8", {"method": "mse", "smoothquant": 0.5}),
    ("fp8", {"method": "max"}),
    ("fp8", {"method": "mse"}),
    ("int4", {"block_size": 128}),
    ("int4", {"block_size": 128, "gptq": True}),
]
TARGETS = {"int8": 1.0, "fp8": 0.5, "int4": 3.0}  # perplexity increase, percent


def label(precision: str, options: dict) -> str:
    parts = [precision.upper()]
    if precision == "int4":
        parts.append(f"block {options['block_size']}")
    else:
        parts.append(options["method"])
        if "smoothquant" in options:
            parts.append(f"SmoothQuant {options['smoothquant']}")
    if options.get("gptq"):
        parts.append("GPTQ")
    return ", ".join(parts)


def probe(bundle, chunks):
    """(mean next-token NLL per token list, logits per window, {moe layer: (tokens, k) expert indices}) of the
    bundle's graph with its routers' choices added as outputs."""
    import onnx

    from kvforge import metrics
    from kvforge.calibration.experts import router_choices
    from kvforge.ort_session import make_session, prefill_feeds

    model = onnx.load(str(bundle.graph_file))
    choices = router_choices(model)
    for name in choices.values():
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.INT64, None))
    quant = (bundle.manifest["precision"].get("quantization") or {}).get("format")
    sess = make_session(model.SerializeToString(), quant)
    dtype = bundle.manifest["precision"]["dtype"]
    nll, logits_all, routes = [], [], {m: [] for m in choices}
    for window in chunks:
        ids = np.ascontiguousarray(window[None, :-1])
        out = sess.run(["logits", *choices.values()], prefill_feeds(ids, bundle.model_config, bundle.io, dtype))
        logits = out[0]
        nll.append(-np.take_along_axis(metrics.log_softmax(logits), window[None, 1:, None], -1).ravel())
        logits_all.append(logits)
        for m, idx in zip(choices, out[1:]):
            routes[m].append(idx.reshape(-1, idx.shape[-1]))
    return np.concatenate(nll), logits_all, {m: np.concatenate(v) for m, v in routes.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULTS / "moe_quantization.json")
    ap.add_argument("--windows", type=int, default=None, help="use only the first N held-out windows")
    args = ap.parse_args()
    load_before = load_average()
    from kvforge import metrics
    from kvforge.calibration import calibrate
    from kvforge.calibration.experts import routing_agreement
    from kvforge.export import export
    from kvforge.model_defs.evaluate import heldout_text
    from kvforge.runtime.evaluate import windows
    from kvforge.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fp32 = export("tiny-moe", tmp / "fp32")
        tok = Tokenizer.from_file(fp32.tokenizer_file)
        chunks = windows(tok.encode(heldout_text(), add_special_tokens=False), 256)[: args.windows]
        ref_nll, ref_logits, ref_routes = probe(fp32, chunks)
        ref_ppl = float(np.exp(ref_nll.mean()))
        print(f"FP32 perplexity {ref_ppl:.3f} over {ref_nll.size} tokens", flush=True)
        rows = []
        for precision, options in RECIPES:
            t = time.perf_counter()
            q = calibrate(fp32.path, tmp / "q", recipe="fixed", precision=precision, force=True, **options)
            seconds = time.perf_counter() - t
            nll, logits, routes = probe(q, chunks)
            ppl = float(np.exp(nll.mean()))
            top1 = float(np.mean([metrics.top1_agreement(a, b) for a, b in zip(logits, ref_logits)]))
            experts = q.manifest["calibration"].get("experts") or {}
            fewest = {m: min(e["tokens"] for e in layer.values()) for m, layer in experts.items()} if experts else None
            row = {
                "recipe": label(precision, options), "precision": precision, "options": options,
                "perplexity": ppl, "perplexity_delta_pct": 100 * (ppl / ref_ppl - 1), "top1_agreement": top1,
                "routing_agreement": {m: routing_agreement(ref_routes[m], routes[m]) for m in ref_routes},
                "calibration_fewest_expert_tokens": fewest, "calibration_s": round(seconds, 1),
            }
            rows.append(row)
            routing = " ".join(f"{m.split('.')[1]}:{a:.3f}" for m, a in row["routing_agreement"].items())
            print(f"{row['recipe']:32s} ppl {ppl:.3f} ({row['perplexity_delta_pct']:+.2f}%)  top-1 {top1:.4f}  "
                  f"routing {routing}", flush=True)
    best = {}
    for p, limit in TARGETS.items():
        candidates = [r for r in rows if r["precision"] == p]
        pick = min(candidates, key=lambda r: r["perplexity_delta_pct"])
        best[p] = {"recipe": pick["recipe"], "perplexity_delta_pct": round(pick["perplexity_delta_pct"], 3),
                   "target_pct": limit, "met": pick["perplexity_delta_pct"] <= limit,
                   "routing_agreement": pick["routing_agreement"]}
    result = {
        "benchmark": "moe_quantization", "model": "tiny-moe", "corpus": "tiny held-out",
        "tokens": int(ref_nll.size), "windows": int(len(chunks)), "fp32_perplexity": ref_ppl,
        "recipes": rows, "best_per_precision": best,
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result("moe_quantization", result, args.out)
    print(json.dumps(best, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
