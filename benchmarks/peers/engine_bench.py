"""TensorRT engines of one model at every precision vs the Torch reference on the same GPU: prefill and decode speed.

For each precision (default fp32, fp16, int8, fp8; fp8 only on compute
capability >= 8.9) the script exports SOURCE (default: tiny), calibrates the
quantized ones, builds an engine (`kvforge build`, one shared timing cache),
and times it with `kvforge.runtime.bench.benchmark`: prefill tokens/s, time
to first token, decode tokens/s; medians over runs. The Torch reference
(FP32, and FP16 when asked for) runs on the same GPU through the same Session
API. Contenders are interleaved run by run so that a noisy neighbour hits
them alike. The result goes to benchmarks/results/engine_<source>.json.

    python3 -m benchmarks.peers.engine_bench [--source tiny] [--precisions fp32,fp16,int8,fp8]
        [--batch 1] [--prompt-len 64] [--new-tokens 128] [--runs 5] [--max-context 512]

Needs TensorRT and an NVIDIA GPU (`bash scripts/install.sh --gpu`), and a CUDA
build of torch for the reference; without TensorRT or a GPU it exits with the
missing-dependency message and status 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result

PRECISIONS = ("fp32", "fp16", "int8", "fp8")


def _bundle(source: str, precision: str, root: Path, fp32):
    from kvforge.calibration import calibrate
    from kvforge.export import export

    if precision == "fp32":
        return fp32
    if precision == "fp16":
        return export(source, root / "fp16", dtype="float16")
    return calibrate(fp32.path, root / precision, recipe="fixed", precision=precision, method="mse" if precision == "int8" else "max",
                     smoothquant=0.5 if precision == "int8" else None, samples=64, seq_len=256,
                     random_data=source != "tiny")  # speed does not depend on the calibration text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="tiny")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    load_before = load_average()

    from kvforge.errors import KvforgeError, MissingDependencyError
    from kvforge.tensorrt_env import require_tensorrt_gpu

    try:
        trt, device = require_tensorrt_gpu()
    except MissingDependencyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    import torch

    from kvforge import runtime
    from kvforge.export import export
    from kvforge.export.engine import BuildOptions, build
    from kvforge.runtime.bench import benchmark

    cc = tuple(int(x) for x in device["compute_capability"].split("."))
    precisions = [p for p in args.precisions.split(",") if p]
    skipped = {}
    if "fp8" in precisions and cc < (8, 9):
        precisions.remove("fp8")
        skipped["fp8"] = f"needs compute capability >= 8.9, this GPU has {device['compute_capability']}"
    result_name = f"engine_{Path(args.source).name}"
    out = args.out or RESULTS / f"{result_name}.json"

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        fp32 = export(args.source, root / "fp32")
        builds, sessions = {}, {}
        for p in precisions:
            onnx_bundle = _bundle(args.source, p, root, fp32)
            t = time.perf_counter()
            engine = build(onnx_bundle.path, root / f"{p}-engine", max_batch=max(args.batch, 1), max_context=args.max_context,
                           opt_batch=args.batch, opt_context=min(args.prompt_len, args.max_context),
                           options=BuildOptions(timing_cache=str(root / "timing.cache")))
            builds[p] = {"seconds": round(time.perf_counter() - t, 1),
                         "engine_mb": round(engine.manifest["files"]["model.engine"]["bytes"] / 2**20, 2)}
            sessions[f"tensorrt-{p}"] = runtime.load(engine.path).activate()
        if torch.cuda.is_available():
            sessions["torch-fp32"] = runtime.load(args.source, backend="torch", device="cuda").activate()
            if "fp16" in precisions:
                sessions["torch-fp16"] = runtime.load(args.source, backend="torch", device="cuda", dtype="float16").activate()
        else:
            skipped["torch"] = "this torch has no CUDA; the reference would not run on the same GPU"

        runs = {name: [] for name in sessions}
        for i in range(args.runs):
            for name, s in sessions.items():
                try:
                    runs[name].append(benchmark(s, args.batch, args.prompt_len, args.new_tokens, runs=1, warmup=1 if i == 0 else 0))
                except KvforgeError as e:
                    skipped[name] = str(e)
            print(f"run {i}: " + ", ".join(f"{n} {r[-1]['decode_tokens_per_s']:.0f} tok/s" for n, r in runs.items() if r), flush=True)
        for s in sessions.values():
            s.deactivate()

    keys = ("prefill_tokens_per_s", "decode_tokens_per_s", "ttft_ms", "decode_ms_per_token")
    med = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in runs.items() if rs}
    base = med.get("torch-fp32")
    result = {
        "benchmark": "engine_bench",
        "source": args.source,
        "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "runs": args.runs,
        "max_context": args.max_context,
        "machine": {**machine(), "gpu": device["name"], "compute_capability": device["compute_capability"],
                    "tensorrt": trt.__version__, "torch": torch.__version__},
        "load_before": load_before, "time": utc_time(),
        "builds": builds,
        "medians": med,
        "speedup_vs_torch_fp32": {n: {k: m[k] / base[k] for k in ("prefill_tokens_per_s", "decode_tokens_per_s")}
                                  for n, m in med.items()} if base else None,
        "skipped": skipped,
    }
    write_result(result_name, result, out)
    for n, m in med.items():
        print(f"{n:>14}: prefill {m['prefill_tokens_per_s']:9.0f} tok/s, TTFT {m['ttft_ms']:7.2f} ms, "
              f"decode {m['decode_tokens_per_s']:8.1f} tok/s")
    for n, why in skipped.items():
        print(f"{n}: skipped ({why})")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
