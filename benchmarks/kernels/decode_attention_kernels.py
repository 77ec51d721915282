"""Decode attention over a packed cache buffer: ONNX Runtime's GroupQueryAttention against a grouped MatMul
formulation, one layer of SmolLM2-135M's shape (9 query heads, 3 KV heads, head 64), one new token per row (issue 34).

Why: in an 8-row decode step of SmolLM2 FP32, GroupQueryAttention is 31% of the kernel time
(benchmarks/features/batcher_prefill.py's decode profile), and a step that carries one token of a 4,000-position
prompt costs 2.4x the plain step. The CPU kernel runs one task per row and query head, so each KV head is read once
per query head of its group; the grouped form reads it once: scores = q (B, KV, G, D) @ K^T over the whole buffer
(B, KV, capacity, D), plus a bias that hides positions at or past each row's length, softmax, @ V. (It leaves out
the new token's own key and value, which the kernel also writes into the buffer; those are one position more.)

Each case: medians of 7 rounds of 30 calls, one per layer, each over a buffer of its own (30 layers' caches, as
a decode step reads them: a single buffer would stay in the CPU's caches); the grouped form's output is checked
against numpy.

    python3 -m benchmarks.kernels.decode_attention_kernels
Writes benchmarks/results/decode_attention_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
CASES = [(1, 4000, 4096), (8, 355, 512), (16, 400, 512)]  # rows, positions held (the longest row), buffer capacity
OUT = RESULTS / "decode_attention_kernels.json"


def _session(nodes, inputs, outputs):
    import onnxruntime as ort
    from onnx import helper

    model = helper.make_model(helper.make_graph(nodes, "attention", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _timed(session, bindings, rounds: int = 7) -> float:
    """Seconds per call: each round calls once per binding (per layer)."""
    for binding in bindings:
        session.run_with_iobinding(binding)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for binding in bindings:
            session.run_with_iobinding(binding)
        times.append((time.perf_counter() - start) / len(bindings))
    return statistics.median(times)


def case(rows: int, held: int, capacity: int) -> dict:
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper

    B, H, KV, D, G = rows, HEADS, KV_HEADS, HEAD_DIM, HEADS // KV_HEADS
    rng = np.random.default_rng(0)
    k_bufs = [rng.standard_normal((B, KV, capacity, D), np.float32) for _ in range(LAYERS)]
    v_bufs = [rng.standard_normal((B, KV, capacity, D), np.float32) for _ in range(LAYERS)]
    lengths = np.maximum(held - 30 * np.arange(B), 1)
    q = rng.standard_normal((B, 1, H * D), np.float32)
    k = rng.standard_normal((B, 1, KV * D), np.float32)
    v = rng.standard_normal((B, 1, KV * D), np.float32)
    scale = D ** -0.5

    def info(name, dtype, shape):
        return helper.make_tensor_value_info(name, dtype, shape)

    gqa = _session([helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens", "total"],
                                     ["out", "ck", "cv"], domain="com.microsoft", num_heads=H, kv_num_heads=KV,
                                     scale=scale)],
                   [info("q", T.FLOAT, [B, 1, H * D]), info("k", T.FLOAT, [B, 1, KV * D]), info("v", T.FLOAT, [B, 1, KV * D]),
                    info("pk", T.FLOAT, [B, KV, capacity, D]), info("pv", T.FLOAT, [B, KV, capacity, D]),
                    info("seqlens", T.INT32, [B]), info("total", T.INT32, [1])],
                   [info("out", T.FLOAT, [B, 1, H * D]), info("ck", T.FLOAT, [B, KV, capacity, D]),
                    info("cv", T.FLOAT, [B, KV, capacity, D])])
    bindings = []
    for k_buf, v_buf in zip(k_bufs, v_bufs):
        binding = gqa.io_binding()
        for past, present, array in (("pk", "ck", k_buf.copy()), ("pv", "cv", v_buf.copy())):
            buffer = ort.OrtValue.ortvalue_from_numpy(array)
            binding.bind_ortvalue_input(past, buffer)
            binding.bind_ortvalue_output(present, buffer)
        for name, value in (("q", q), ("k", k), ("v", v), ("seqlens", lengths.astype(np.int32)),
                            ("total", np.array([lengths.max() + 1], np.int32))):
            binding.bind_cpu_input(name, value)
        binding.bind_output("out")
        bindings.append(binding)
    gqa_s = _timed(gqa, bindings)

    grouped = _session([helper.make_node("FusedMatMul", ["q4", "pk"], ["s"], domain="com.microsoft", transB=1, alpha=scale),
                        helper.make_node("Add", ["s", "bias"], ["sb"]),
                        helper.make_node("Softmax", ["sb"], ["p"], axis=-1),
                        helper.make_node("MatMul", ["p", "pv"], ["out"])],
                       [info("q4", T.FLOAT, [B, KV, G, D]), info("pk", T.FLOAT, [B, KV, capacity, D]),
                        info("pv", T.FLOAT, [B, KV, capacity, D]), info("bias", T.FLOAT, [B, 1, 1, capacity])],
                       [info("out", T.FLOAT, [B, KV, G, D])])
    q4 = np.ascontiguousarray(q.reshape(B, KV, G, D))
    bias = np.where(np.arange(capacity)[None, None, None, :] < lengths[:, None, None, None], 0, -np.inf).astype(np.float32)
    bindings = []
    for k_buf, v_buf in zip(k_bufs, v_bufs):
        binding = grouped.io_binding()
        for name, value in {"q4": q4, "pk": k_buf, "pv": v_buf, "bias": bias}.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output("out")
        bindings.append(binding)
    grouped_s = _timed(grouped, bindings)
    feeds = {"q4": q4, "pk": k_bufs[0], "pv": v_bufs[0], "bias": bias}
    k_buf, v_buf = k_bufs[0], v_bufs[0]
    scores = np.einsum("bkgd,bkld->bkgl", q4, k_buf) * scale + bias
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    error = float(np.abs(np.einsum("bkgl,bkld->bkgd", probs, v_buf) - grouped.run(None, feeds)[0]).max())
    kv_bytes = int(2 * KV * D * 4 * lengths.sum())
    return {"rows": B, "longest_row": held, "capacity": capacity, "kv_bytes_held": kv_bytes,
            "gqa_ms": gqa_s * 1e3, "grouped_matmul_ms": grouped_s * 1e3, "gqa_over_grouped": gqa_s / grouped_s,
            "grouped_max_abs_error": error}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options: --help only
    load_before = load_average()
    results = []
    for rows, held, capacity in CASES:
        results.append(case(rows, held, capacity))
        print(json.dumps(results[-1]))
    write_result("decode_attention_kernels", {"shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
                                              "machine": machine(), "load_before": load_before, "time": utc_time(),
                                              "cases": results}, OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
