"""ONNX Runtime's kernels for INT4 weight-only MatMuls at decode (batch 1): how fast the exact one is (issue 18).

kvforge's INT4 bundles are weight-only: block-wise int4 codes along K (block 32 or 128, symmetric, one float
scale per block and output channel), activations in float. ONNX Runtime fuses the bundle's DequantizeLinear ->
MatMul into com.microsoft MatMulNBits; kvforge runs it at accuracy level 0, which keeps the activation in float:
the bundle's function. ONNX Runtime GenAI's INT4 build (`-p int4 -e cpu`) runs MatMulNBits at accuracy level 4,
which quantizes each block of the activation to int8 on the fly: faster integer kernels, another function.

Measured here, on the ~125M Llama's decode MatMuls (12 layers of q/k/v fused 768x1280, o 768x768, gate/up fused
768x4096, down 2048x768; and the 768x32000 vocabulary projection on its own), for block 32 and 128:

- qdq: the bundle's form (DequantizeLinear of int4 codes -> MatMul) in a session made as the runtime makes it,
  which ORT turns into MatMulNBits at accuracy 0;
- nbits-acc0 / nbits-acc4: MatMulNBits written directly at accuracy 0 (the same function) and 4 (GenAI's).

Reported: median ms per call (all weights read once) cold (candidates interleaved call by call) and warm (back to
back), GB/s of the weights as stored (4-bit codes + float scales), the fraction of this machine's read bandwidth
(measured in the same run), and the largest error relative to the output's scale against the exact function
(float64). The accuracy-0 rows show the exact kernel is bound by compute, not memory, on two cores: the time it
takes is what an INT4 decode step cannot go below.

    python3 -m benchmarks.kernels.int4_matmul_kernels [--runs 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.harness import RESULTS, bandwidth_gbs, load_average, machine, utc_time, write_result


LAYERS = 12
SHAPES = [(768, 1280), (768, 768), (768, 4096), (2048, 768)]  # (K, N) of qkv, o, gate/up, down
HEAD = (768, 32000)


def weights(rng, block: int, shapes):
    out = []
    for i, (k, n) in enumerate(shapes):
        codes = rng.integers(-8, 8, (k, n), dtype=np.int8)
        scale = ((rng.random((k // block, n)) + 0.5) * 1e-2).astype(np.float32)
        out.append((f"w{i}", codes, scale))
    return out


def build(kind: str, ws, block: int, accuracy: int = 0):
    import ml_dtypes
    from onnx import TensorProto, helper, numpy_helper as nh

    nodes, inits, outputs = [], [], []
    for name, codes, scale in ws:
        k, n = codes.shape
        if kind == "qdq":
            inits += [nh.from_array(codes.astype(ml_dtypes.int4), f"{name}_q"), nh.from_array(scale, f"{name}_s")]
            nodes += [helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s"], [f"{name}_w"], axis=0, block_size=block),
                      helper.make_node("MatMul", [f"x{k}", f"{name}_w"], [name])]
        else:
            # [N, blocks, block / 2] bytes, two codes per byte (low nibble first), stored + 8 (the implicit zero point)
            u = (codes.T.astype(np.int16) + 8).astype(np.uint8).reshape(n, k // block, block // 2, 2)
            packed = (u[..., 0] | (u[..., 1] << 4)).astype(np.uint8)
            inits += [nh.from_array(packed, f"{name}_b"), nh.from_array(np.ascontiguousarray(scale.T).reshape(-1), f"{name}_s")]
            nodes.append(helper.make_node("MatMulNBits", [f"x{k}", f"{name}_b", f"{name}_s"], [name], domain="com.microsoft",
                                          K=k, N=n, bits=4, block_size=block, accuracy_level=accuracy))
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, n]))
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, k]) for k in sorted({c.shape[0] for _, c, _ in ws})]
    graph = helper.make_graph(nodes, kind, inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def measure(sessions, feeds, runs):
    cold = {name: [] for name in sessions}
    warm = {name: [] for name in sessions}
    for s in sessions.values():
        for _ in range(3):
            s.run(None, feeds)
    for _ in range(runs):
        for name, s in sessions.items():
            t = time.perf_counter()
            s.run(None, feeds)
            cold[name].append(time.perf_counter() - t)
    for name, s in sessions.items():
        for _ in range(runs):
            t = time.perf_counter()
            s.run(None, feeds)
            warm[name].append(time.perf_counter() - t)
    return {n: statistics.median(v) for n, v in cold.items()}, {n: statistics.median(v) for n, v in warm.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--out", default=str(RESULTS / "int4_matmul_kernels.json"))
    args = parser.parse_args()
    load_before = load_average()

    from kvforge.ort_session import make_session

    rng = np.random.default_rng(0)
    feeds = {f"x{k}": rng.standard_normal((1, k)).astype(np.float32) for k in (768, 2048)}
    results = {}
    for part, shapes in (("layers", SHAPES * LAYERS), ("head", [HEAD])):
        for block in (32, 128):
            ws = weights(rng, block, shapes)
            exact = {name: feeds[f"x{c.shape[0]}"].astype(np.float64) @ (c.astype(np.float64) * np.repeat(s, block, axis=0))
                     for name, c, s in ws}
            stored = sum(c.size // 2 + s.nbytes for _, c, s in ws)
            sessions = {"qdq": make_session(build("qdq", ws, block).SerializeToString(), "int4"),
                        "nbits-acc0": make_session(build("nbits", ws, block, 0).SerializeToString()),
                        "nbits-acc4": make_session(build("nbits", ws, block, 4).SerializeToString())}
            cold, warm = measure(sessions, {k: v for k, v in feeds.items() if k in {i.name for i in sessions["qdq"].get_inputs()}}, args.runs)
            bandwidth = bandwidth_gbs() * 1e9
            for name, s in sessions.items():
                inputs = {i.name: feeds[i.name] for i in s.get_inputs()}
                out = dict(zip([o.name for o in s.get_outputs()], s.run(None, inputs)))
                err = max(float(np.abs(out[n] - exact[n]).max() / np.abs(exact[n]).max()) for n in exact)
                key = f"{part}-b{block}-{name}"
                results[key] = {"cold_ms": 1e3 * cold[name], "warm_ms": 1e3 * warm[name], "stored_bytes": stored,
                                "cold_GB_per_s": stored / cold[name] / 1e9,
                                "cold_fraction_of_bandwidth": stored / cold[name] / bandwidth,
                                "bandwidth_GB_per_s": bandwidth / 1e9, "max_rel_error": err}
                print(f"{key:24s} cold {1e3 * cold[name]:7.3f} ms ({stored / cold[name] / 1e9:5.1f} GB/s, "
                      f"{100 * stored / cold[name] / bandwidth:4.1f}% of {bandwidth / 1e9:.1f})  warm {1e3 * warm[name]:7.3f} ms  "
                      f"max rel error {err:.1e}", flush=True)
    write_result("int4_matmul_kernels", {"runs": args.runs, "candidates": results, "machine": machine(),
                                         "load_before": load_before, "time": utc_time()}, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
