"""Candidate ONNX Runtime kernels for the INT8 (W8A8, static Q/DQ) MatMuls of a decode step (issue 18).

One graph per candidate holds the quantized MatMuls of the ~125M Llama's 12
layers (q/k/v fused 768x1280, o 768x768, gate/up fused 768x4096, down
2048x768: 75.5 MB of int8 weights), all reading one activation row (batch 1,
one token), each behind the graph's activation QuantizeLinear ->
DequantizeLinear with a static per-tensor scale, weights per-channel. The
candidates compute that function in different kernels:

- qdq: the bundle's form; ONNX Runtime's QDQ fusion turns it into
  MatMulIntegerToFloat (what the runtime runs today);
- nbits8-b{block}-acc0: com.microsoft MatMulNBits, 8-bit weights (int8 + 128,
  the per-channel scale repeated per block), over the fake-quantized activation
  in float (accuracy level 0: exact to the graph's function);
- nbits8-b{block}-acc4: the same with accuracy level 4 (ORT re-quantizes the
  activation per block to int8 itself: not the graph's function; shown for
  its speed).

Reported: median time per call (every weight read once) cold (the candidates
interleaved call by call, each finding its weights evicted) and warm (back to
back, the weights in the last-level cache), weight GB/s, and the largest
error relative to the output's scale against the exact function (numpy,
float64). Memory bandwidth is measured in the same run (a 1 GiB buffer
summed by both cores) as benchmarks/peers/runtime_125m.py does.

    python3 -m benchmarks.kernels.int8_matmul_kernels [--runs 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.harness import RESULTS, bandwidth_gbs, load_average, machine, utc_time, write_result


LAYERS = 12
SHAPES = [(768, 1280), (768, 768), (768, 4096), (2048, 768)]  # (K, N) of qkv, o, gate/up, down


def weights(rng):
    out = []
    for layer in range(LAYERS):
        for j, (k, n) in enumerate(SHAPES):
            w = rng.integers(-127, 128, (k, n), dtype=np.int8)
            scale = ((rng.random(n) + 0.5) * 2e-3).astype(np.float32)
            out.append((f"l{layer}_{j}", w, scale))
    return out


def build(kind: str, ws, x_scale: float, block: int = 0, accuracy: int = 0):
    from onnx import TensorProto, helper, numpy_helper as nh

    nodes, inits, outputs = [], [], []
    for name, w, scale in ws:
        k, n = w.shape
        # each MatMul's own activation Q -> DQ, as the exporter emits (ORT fuses a pair that feeds one MatMul only)
        inits += [nh.from_array(np.array(x_scale, np.float32), f"{name}_xs"), nh.from_array(np.array(0, np.int8), f"{name}_xz")]
        nodes += [helper.make_node("QuantizeLinear", [f"x{k}", f"{name}_xs", f"{name}_xz"], [f"{name}_xq"]),
                  helper.make_node("DequantizeLinear", [f"{name}_xq", f"{name}_xs", f"{name}_xz"], [f"{name}_xd"])]
        if kind == "qdq":
            inits += [nh.from_array(w, f"{name}_w"), nh.from_array(scale, f"{name}_s"), nh.from_array(np.zeros(n, np.int8), f"{name}_z")]
            nodes += [helper.make_node("DequantizeLinear", [f"{name}_w", f"{name}_s", f"{name}_z"], [f"{name}_wd"], axis=1),
                      helper.make_node("MatMul", [f"{name}_xd", f"{name}_wd"], [name])]
        else:
            blocks = k // block
            packed = (w.T.astype(np.int16) + 128).astype(np.uint8).reshape(n, blocks, block)
            inits += [nh.from_array(packed, f"{name}_b"), nh.from_array(np.repeat(scale, blocks), f"{name}_s")]
            nodes.append(helper.make_node("MatMulNBits", [f"{name}_xd", f"{name}_b", f"{name}_s"], [name], domain="com.microsoft",
                                          K=k, N=n, bits=8, block_size=block, accuracy_level=accuracy))
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, n]))
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, k]) for k in sorted({k for k, _ in SHAPES})]
    graph = helper.make_graph(nodes, kind, inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def session(model):
    import onnxruntime as ort

    from kvforge.ort_session import QUANT_DISABLED_OPTIMIZERS as _QUANT_DISABLED_OPTIMIZERS

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"],
                                disabled_optimizers=_QUANT_DISABLED_OPTIMIZERS["int8"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", default=str(RESULTS / "int8_matmul_kernels.json"))
    args = parser.parse_args()
    load_before = load_average()

    rng = np.random.default_rng(0)
    ws = weights(rng)
    x_scale = 0.02
    feeds = {f"x{k}": rng.standard_normal((1, k)).astype(np.float32) for k in sorted({k for k, _ in SHAPES})}
    exact = {}
    for name, w, scale in ws:
        k = w.shape[0]
        xq = np.clip(np.rint(feeds[f"x{k}"] / x_scale), -128, 127) * x_scale
        exact[name] = xq.astype(np.float64) @ (w.astype(np.float64) * scale.astype(np.float64))
    weight_bytes = sum(w.nbytes for _, w, _ in ws)
    candidates = {"qdq": dict(kind="qdq")}
    for block in (128, 256):
        for acc in (0, 4):
            candidates[f"nbits8-b{block}-acc{acc}"] = dict(kind="nbits", block=block, accuracy=acc)
    sessions = {name: session(build(x_scale=x_scale, ws=ws, **c)) for name, c in candidates.items()}
    names = [o.name for o in next(iter(sessions.values())).get_outputs()]
    # cold: candidates interleaved call by call, so each call finds its weights evicted by the others' (as the
    # weights of a model bigger than the cache are); warm: each candidate's calls back to back, its 75 MB staying
    # in this machine's last-level cache (480 MiB here: a 125M INT8 model's 174 MB fit in it)
    cold = {name: [] for name in sessions}
    warm = {name: [] for name in sessions}
    for name, s in sessions.items():
        for _ in range(3):
            s.run(None, feeds)
    for _ in range(args.runs):
        for name, s in sessions.items():
            t = time.perf_counter()
            s.run(None, feeds)
            cold[name].append(time.perf_counter() - t)
    for name, s in sessions.items():
        for _ in range(args.runs + 3):
            t = time.perf_counter()
            s.run(None, feeds)
            warm[name].append(time.perf_counter() - t)
        warm[name] = warm[name][3:]
    bandwidth = bandwidth_gbs() * 1e9
    results = {}
    for name, s in sessions.items():
        out = dict(zip(names, s.run(None, feeds)))
        err = max(float(np.abs(out[n] - exact[n]).max() / np.abs(exact[n]).max()) for n in names)
        c, w = statistics.median(cold[name]), statistics.median(warm[name])
        results[name] = {"cold_ms": 1e3 * c, "cold_GB_per_s": weight_bytes / c / 1e9,
                         "cold_fraction_of_bandwidth": weight_bytes / c / bandwidth,
                         "warm_ms": 1e3 * w, "warm_GB_per_s": weight_bytes / w / 1e9, "max_rel_error": err}
        print(f"{name:20s} cold {1e3 * c:8.3f} ms {weight_bytes / c / 1e9:5.1f} GB/s ({100 * weight_bytes / c / bandwidth:5.1f}% of "
              f"{bandwidth / 1e9:.1f} GB/s)  warm {1e3 * w:8.3f} ms {weight_bytes / w / 1e9:5.1f} GB/s  max rel error {err:.1e}")
    write_result("int8_matmul_kernels", {"weight_bytes": weight_bytes, "bandwidth_bytes_per_s": bandwidth,
                                         "runs": args.runs, "candidates": results, "machine": machine(),
                                         "load_before": load_before, "time": utc_time()}, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
