"""INT8 vs FP32 decode speed of the ~125M Llama on the ONNX Runtime backend, measured in one run.

The checkpoint is the runtime benchmark's (hidden 768, 12 layers, 12/4 heads,
FFN 2048, vocab 32000, random weights, a locally trained tokenizer). The FP32
bundle is calibrated to INT8 (MSE + SmoothQuant 0.5) on `tiny`'s built-in
calibration text tokenized with the checkpoint's tokenizer. Both bundles are
then benchmarked alternately (batch 1, prompt 64, 128 new tokens, greedy;
a pause before each run, and the order balanced so that each contender
follows each other one equally often, as in benchmarks/peers/runtime_125m.py), and the script
reports the medians and their ratio. ONNX Runtime GenAI's INT8
build of the same checkpoint (`-p int8 -e cpu`: 8-bit weight-only MatMulNBits,
its CPU defaults) runs in the same loop, so the issue's figure to beat is
measured on this machine alongside.

    python3 -m benchmarks.features.int8_speed_125m [--runs 8] [--skip-genai]
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

from benchmarks.harness import RESULTS, interleaved_runs, load_average, machine, utc_time, write_result
from benchmarks.peers.runtime_125m import NEW_TOKENS, PROMPT_LEN, GenAI, make_checkpoint


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--skip-genai", action="store_true", help="no ONNX Runtime GenAI INT8 contender")
    ap.add_argument("--out", type=Path, default=RESULTS / "int8_speed_125m.json")
    args = ap.parse_args()
    load_before = load_average()
    from kvforge import runtime
    from kvforge.calibration import calibrate
    from kvforge.export import export
    from kvforge.model_defs.checkpoint import TINY_DIR
    from kvforge.runtime.bench import benchmark

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_checkpoint(tmp / "ckpt")
        fp32 = export(tmp / "ckpt", tmp / "fp32")
        t = time.perf_counter()
        int8 = calibrate(fp32.path, tmp / "int8", recipe="fixed", precision="int8", method="mse", smoothquant=0.5,
                         data=TINY_DIR / "calibration.txt", samples=64, seq_len=256)
        calib_s = time.perf_counter() - t
        # the same recipe with the vocabulary projection quantized too (GenAI's INT8 build quantizes it): at batch 1
        # the 32000 x 768 FP32 lm_head is a third of what every decode step reads
        int8_head = calibrate(fp32.path, tmp / "int8-head", recipe="fixed", precision="int8", method="mse", smoothquant=0.5,
                              data=TINY_DIR / "calibration.txt", samples=64, seq_len=256, quantize_lm_head=True)
        sessions = {"fp32": runtime.load(fp32.path).activate(), "int8": runtime.load(int8.path).activate(),
                    "int8+lm_head": runtime.load(int8_head.path).activate()}
        genai = None if args.skip_genai else GenAI(tmp / "ckpt", tmp, precision="int8")
        prompt = np.random.default_rng(0).integers(3, 8000, (1, PROMPT_LEN), dtype=np.int64)
        def genai_run() -> dict:
            g = genai.run(prompt)
            return {"prefill_tokens_per_s": PROMPT_LEN / g["prefill_s"], "decode_tokens_per_s": g["decode_steps"] / g["decode_s"],
                    "ttft_ms": 1000 * g["prefill_s"]}

        contenders = {name: (lambda s=s: benchmark(s, 1, PROMPT_LEN, NEW_TOKENS, runs=1, warmup=0)) for name, s in sessions.items()}
        if genai:
            contenders["genai-int8"] = genai_run
        runs = interleaved_runs(contenders, args.runs, lambda r: r["decode_tokens_per_s"])
        sizes = {n: sum(f["bytes"] for f in b.manifest["files"].values())
                 for n, b in (("fp32", fp32), ("int8", int8), ("int8+lm_head", int8_head))}
    med = {n: {k: statistics.median(r[k] for r in rs) for k in ("prefill_tokens_per_s", "decode_tokens_per_s", "ttft_ms")}
           for n, rs in runs.items()}
    result = {
        "benchmark": "int8_speed_125m", "batch": 1, "prompt_len": 64, "new_tokens": 128, "runs": args.runs,
        "recipe": "int8, mse, SmoothQuant 0.5, 64 x 256 tokens of tiny's calibration text", "calibration_s": calib_s,
        "bundle_bytes": sizes, "medians": med,
        "decode_speedup": med["int8"]["decode_tokens_per_s"] / med["fp32"]["decode_tokens_per_s"],
        "prefill_speedup": med["int8"]["prefill_tokens_per_s"] / med["fp32"]["prefill_tokens_per_s"],
        "decode_speedup_lm_head_int8": med["int8+lm_head"]["decode_tokens_per_s"] / med["fp32"]["decode_tokens_per_s"],
        "decode_vs_genai_int8": (med["int8"]["decode_tokens_per_s"] / med["genai-int8"]["decode_tokens_per_s"]
                                 if "genai-int8" in med else None),
        "decode_lm_head_int8_vs_genai_int8": (med["int8+lm_head"]["decode_tokens_per_s"] / med["genai-int8"]["decode_tokens_per_s"]
                                              if "genai-int8" in med else None),
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result("int8_speed_125m", result, args.out)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
