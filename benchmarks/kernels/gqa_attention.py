"""ONNX Runtime's GroupQueryAttention with a shared-buffer cache vs the exported attention, per decode step (issue 18).

Measures, in one run on the ~125M Llama's attention shape (12 layers, 12 query / 4 KV heads, head 64, batch 1):
- com.microsoft GroupQueryAttention, one node per layer, past and present bound to the same preallocated
  OrtValue (4096 positions) through IO binding, so a step writes one position and reads the context;
- the whole FP32 decode step of the exported ~125M model on kvforge's ONNX Runtime backend today (its
  attention concatenates each layer's whole cache every step), at the same contexts.
The growth of the step's time with context is what the shared-buffer cache must make smaller.

    python3 -m benchmarks.kernels.gqa_attention
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import load_average, machine, utc_time, write_result
from benchmarks.peers.runtime_125m import make_checkpoint

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BUFFER = 12, 12, 4, 64, 4096
CONTEXTS = (64, 512, 1024, 2000)


def gqa_times(contexts, reps: int = 25) -> dict[int, float]:
    import onnxruntime as ort
    from onnx import TensorProto as T, helper

    inputs = [helper.make_tensor_value_info("q", T.FLOAT, [1, 1, HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("k", T.FLOAT, [1, 1, KV_HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("v", T.FLOAT, [1, 1, KV_HEADS * HEAD_DIM]),
              helper.make_tensor_value_info("seqlens_k", T.INT32, [1]), helper.make_tensor_value_info("total", T.INT32, [])]
    outputs, nodes, prev = [], [], "q"
    cache_shape = [1, KV_HEADS, BUFFER, HEAD_DIM]
    for layer in range(LAYERS):
        inputs += [helper.make_tensor_value_info(f"past_k{layer}", T.FLOAT, cache_shape),
                   helper.make_tensor_value_info(f"past_v{layer}", T.FLOAT, cache_shape)]
        outputs += [helper.make_tensor_value_info(f"present_k{layer}", T.FLOAT, cache_shape),
                    helper.make_tensor_value_info(f"present_v{layer}", T.FLOAT, cache_shape)]
        nodes.append(helper.make_node("GroupQueryAttention", [prev, "k", "v", f"past_k{layer}", f"past_v{layer}", "seqlens_k", "total"],
                                      [f"out{layer}", f"present_k{layer}", f"present_v{layer}"], domain="com.microsoft",
                                      num_heads=HEADS, kv_num_heads=KV_HEADS))
        prev = f"out{layer}"
    outputs.insert(0, helper.make_tensor_value_info(prev, T.FLOAT, [1, 1, HEADS * HEAD_DIM]))
    model = helper.make_model(helper.make_graph(nodes, "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    caches = [ort.OrtValue.ortvalue_from_numpy(rng.standard_normal(cache_shape).astype(np.float32)) for _ in range(2 * LAYERS)]
    q, k, v = (rng.standard_normal((1, 1, n * HEAD_DIM)).astype(np.float32) for n in (HEADS, KV_HEADS, KV_HEADS))
    out = {}
    for ctx in contexts:
        times = []
        for _ in range(reps):
            b = session.io_binding()
            for name, value in (("q", q), ("k", k), ("v", v), ("seqlens_k", np.array([ctx - 1], np.int32)),
                                ("total", np.array(ctx, np.int32))):
                b.bind_cpu_input(name, value)
            for layer in range(LAYERS):  # past and present: one buffer
                for kind in "kv":
                    buf = caches[2 * layer + (kind == "v")]
                    b.bind_ortvalue_input(f"past_{kind}{layer}", buf)
                    b.bind_ortvalue_output(f"present_{kind}{layer}", buf)
            b.bind_output(outputs[0].name)
            t = time.perf_counter()
            session.run_with_iobinding(b)
            times.append(time.perf_counter() - t)
        out[ctx] = statistics.median(times[5:])
    return out


def model_step_times(bundle, contexts, reps: int = 12) -> dict[int, float]:
    from kvforge import runtime

    out = {}
    with runtime.load(bundle) as session:
        for ctx in contexts:
            ids = np.ones((1, ctx), np.int64)
            _, cache = session.forward(ids, last_logits_only=True)
            mask = np.ones((1, ctx + 1), np.int64)
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                session.forward(ids[:, :1], mask, cache=cache, last_logits_only=True)
                times.append(time.perf_counter() - t)
            out[ctx] = statistics.median(times[2:])
    return out


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options: --help only
    load_before = load_average()
    from kvforge.export import export

    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp) / "ckpt")
        bundle = export(Path(tmp) / "ckpt", Path(tmp) / "fp32").path
        model = model_step_times(bundle, CONTEXTS)
    gqa = gqa_times(CONTEXTS)
    for ctx in CONTEXTS:
        print(f"context {ctx:5d}: kvforge FP32 step {1e3 * model[ctx]:7.2f} ms (+{1e3 * (model[ctx] - model[CONTEXTS[0]]):5.2f} over "
              f"{CONTEXTS[0]}); GQA shared-buffer attention, 12 layers {1e3 * gqa[ctx]:6.3f} ms")
    out = write_result("gqa_attention", {
        "contexts": list(CONTEXTS), "model_step_ms": {c: 1e3 * t for c, t in model.items()},
        "gqa_attention_ms": {c: 1e3 * t for c, t in gqa.items()},
        "machine": machine(), "load_before": load_before, "time": utc_time()})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
