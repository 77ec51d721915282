"""How the torch.onnx step of an export grows with the number of layers (the test suite's main cost).

One model design (llama3-micro's: dim 64, GQA, RoPE, SwiGLU) at 1, 2, 4, 8 and 16 layers, random weights, each
exported by kvforge's export_onnx (torch.onnx's dynamo export with the bundle's dynamic shapes, then the optimizer)
in this process after one warm-up export, three ways interleaved in one run: tracing every layer (`every_layer`, as
export did before export/replicate.py), tracing the one layer design and copying it (`replicated`), both with the
store of traces off (KVFORGE_TRACE_CACHE=0), and `reused`: the default, an export of a structure this process
already traced (another seed's weights bound to its template, export/traces.py). The median over runs of each
depth; a least-squares line gives each way's fixed part and part per layer.

    python3 -m benchmarks.kernels.export_trace_layers [--runs 3] [--out benchmarks/results/export_trace_layers.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import tempfile
import time
import warnings
from pathlib import Path

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result

DEPTHS = (1, 2, 4, 8, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "export_trace_layers.json"))
    args = ap.parse_args()
    load_before = load_average()
    warnings.filterwarnings("ignore")
    import torch

    from kvforge.export.onnx_export import export_onnx
    from kvforge.model_defs.config import ModelConfig
    from kvforge.model_defs.model import build_model, init_random_weights

    torch.set_num_threads(1)  # as one xdist worker of the test suite runs it on a 2-core machine
    base = ModelConfig.from_name("llama3-micro")
    work = Path(tempfile.mkdtemp(prefix="kvforge-trace-"))
    os.environ["KVFORGE_CACHE"] = str(work / "cache")  # no template of an earlier run
    export_onnx(init_random_weights(build_model(base)).eval(), work / "warm.onnx")
    ways = {"every_layer": True, "replicated": False, "reused": False}
    seconds: dict[str, dict[int, list[float]]] = {way: {n: [] for n in DEPTHS} for way in ways}
    for run in range(args.runs):
        for n in DEPTHS:
            cfg = dataclasses.replace(base, n_layers=n)
            model = init_random_weights(build_model(cfg)).eval()
            os.environ["KVFORGE_TRACE_CACHE"] = "1"  # other weights of this structure, traced and kept: `reused` binds
            export_onnx(init_random_weights(build_model(cfg), seed=run + 1).eval(), work / f"m{n}-{run}-first.onnx")
            for way, every in ways.items():
                os.environ["KVFORGE_TRACE_CACHE"] = "1" if way == "reused" else "0"
                start = time.perf_counter()
                export_onnx(model, work / f"m{n}-{run}-{way}.onnx", every_layer=every)
                seconds[way][n].append(time.perf_counter() - start)
                print(f"run {run}: {n} layers, {way}: {seconds[way][n][-1]:.1f} s", flush=True)
    result = {
        "benchmark": "export_trace_layers", "date": utc_time(), "machine": machine(), "load_before": load_before,
        "torch": torch.__version__, "runs": args.runs,
        "design": "llama3-micro", "threads": 1,
    }
    for way in ways:
        median = {n: statistics.median(v) for n, v in seconds[way].items()}
        # least-squares line through (layers, seconds): the fixed cost and the cost per layer
        xs, ys = list(median), list(median.values())
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        per_layer = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        result[way] = {
            "seconds_median_by_layers": {str(n): round(s, 2) for n, s in median.items()},
            "seconds_all_runs": {str(n): [round(s, 2) for s in v] for n, v in seconds[way].items()},
            "fit_fixed_s": round(my - per_layer * mx, 2), "fit_per_layer_s": round(per_layer, 2),
        }
    result["speedup_by_layers"] = {str(n): round(statistics.median(seconds["every_layer"][n])
                                                 / statistics.median(seconds["replicated"][n]), 2) for n in DEPTHS}
    result["reuse_speedup_by_layers"] = {str(n): round(statistics.median(seconds["replicated"][n])
                                                       / statistics.median(seconds["reused"][n]), 2) for n in DEPTHS}
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    write_result("export_trace_layers", result, args.out)
    print(json.dumps({way: {k: result[way][k] for k in ("seconds_median_by_layers", "fit_fixed_s", "fit_per_layer_s")}
                      for way in ways} | {k: result[k] for k in ("speedup_by_layers", "reuse_speedup_by_layers")}))


if __name__ == "__main__":
    main()
