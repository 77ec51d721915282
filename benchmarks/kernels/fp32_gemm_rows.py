"""FP32 matrix products at 1, 8 and 16 rows over SmolLM2-135M's weights: ONNX Runtime (MLAS), Torch and NumPy
(issue 34).

Why: an 8-row decode step of SmolLM2 FP32 spends 62% of its kernel time in MatMul
(benchmarks/features/batcher_prefill.py's decode profile), and serving throughput at 8 and 16 clients is that step's
speed. Each library multiplies M rows by every weight of the model as the ONNX Runtime variant lays them out (30
layers of fused q/k/v 576x960, o 576x576, fused gate/up 576x3072 and down 1536x576, then the 576x49152 head: 538
MB), one product after another, as a decode step does. The figure is the weights' bytes over the time: at one row
the product is bound by memory, so the gap between M=1 and M=8 is what the kernels lose to computing 8 rows. Read
bandwidth is measured in the same run (harness.bandwidth_gbs). Medians of 7 rounds; 2 threads each.

    python3 -m benchmarks.kernels.fp32_gemm_rows
Writes benchmarks/results/fp32_gemm_rows.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from benchmarks.harness import RESULTS, bandwidth_gbs, load_average, machine, utc_time, write_result

HIDDEN, INTERMEDIATE, LAYERS, VOCAB, QKV = 576, 1536, 30, 49152, 960
SHAPES = [(HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)] * LAYERS + [(HIDDEN, VOCAB)]
ROWS = (1, 8, 16)
OUT = RESULTS / "fp32_gemm_rows.json"


def _median(run, rounds: int = 7) -> float:
    run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def onnxruntime_s(weights: list[np.ndarray], x: dict[int, np.ndarray]) -> float:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    m = x[HIDDEN].shape[0]
    nodes, inits, outputs = [], [], []
    for i, w in enumerate(weights):
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [f"x{w.shape[0]}", f"w{i}"], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [m, w.shape[1]]))
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [m, k]) for k in (HIDDEN, INTERMEDIATE)]
    model = helper.make_model(helper.make_graph(nodes, "gemms", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {f"x{k}": v for k, v in x.items()}
    return _median(lambda: session.run(None, feeds))


def torch_s(weights: list[np.ndarray], x: dict[int, np.ndarray]) -> float:
    import torch

    torch.set_num_threads(2)
    ws = [torch.from_numpy(w) for w in weights]
    xs = {k: torch.from_numpy(v) for k, v in x.items()}

    def run():
        with torch.inference_mode():
            for w in ws:
                xs[w.shape[0]] @ w

    return _median(run)


def numpy_s(weights: list[np.ndarray], x: dict[int, np.ndarray]) -> float:
    return _median(lambda: [x[w.shape[0]] @ w for w in weights])


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options: --help only
    load_before = load_average()
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal(s, dtype=np.float32) * 0.02) for s in SHAPES]
    gb = sum(w.nbytes for w in weights) / 1e9
    result = {"weights_gb": gb, "machine": machine(), "load_before": load_before, "time": utc_time(),
              "bandwidth_gbs": bandwidth_gbs(), "rows": []}
    for m in ROWS:
        x = {k: rng.standard_normal((m, k), dtype=np.float32) for k in (HIDDEN, INTERMEDIATE)}
        row = {"rows": m}
        for name, fn in (("onnxruntime", onnxruntime_s), ("torch", torch_s), ("numpy", numpy_s)):
            seconds = fn(weights, x)
            row[name] = {"ms": seconds * 1e3, "weights_gbs": gb / seconds}
        result["rows"].append(row)
        print(json.dumps(row))
    result["bandwidth_after_gbs"] = bandwidth_gbs()
    write_result("fp32_gemm_rows", result, OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
