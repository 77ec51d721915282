"""What a step's LoRA slots cost on ONNX Runtime's CPU kernels, by formulation (issue 36's batch-8 figure).

SmolLM2-135M-Instruct's 210 slots (30 layers x q, k, v, o, gate, up, down) alone, in one ORT graph, on the
shapes a decode step feeds them, for three ways to give each row its own adapter:

- mask (what kvforge exports): y = ((x @ A) * mask) @ B, A [in, W] and B [W, out] the step's adapters side by
  side along their ranks (W = adapters x rank); every row is multiplied by every adapter, then masked;
- gather: y = (x @ A[ids]) @ B[ids], A [n, in, r] stacked, each row's adapter gathered (a copy per row);
- transposed mask: the mask form with the adapters as the GEMMs' first operand (A^T [W, in] @ x^T), so that ORT
  does not pack the adapter weights on every call;
- row-wise: each row's own adapter stacked per row, A [B, in, r] and B [B, r, out], a batched MatMul (what a
  per-row gather gives, with the copy made once per set of adapters instead of every step); rows sharing an
  adapter read it once each.

Each case runs --runs times after a warm-up (median). Alongside: the bytes of the adapters a step must read at
least once, over this machine's read bandwidth measured in the same run, which bounds any formulation from below.

    python3 -m benchmarks.kernels.lora_formulations [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import RESULTS, bandwidth_gbs, load_average, machine, utc_time, write_result

SLOTS = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)] * 30
RANK = 16
CASES = {"batch 1, one adapter": (1, 1), "batch 8, 8 adapters": (8, 8), "batch 8, one adapter": (8, 1)}  # (rows, distinct adapters)


def _model(kind: str):
    from onnx import TensorProto as TP
    from onnx import helper

    f = TP.FLOAT
    inputs = [helper.make_tensor_value_info("x", f, ["B", 576]), helper.make_tensor_value_info("x2", f, ["B", 1536])]
    nodes, outs = [], []
    if kind in ("gather", "rowwise"):
        nodes += [helper.make_node("Unsqueeze", ["x", "one"], ["x3"]), helper.make_node("Unsqueeze", ["x2", "one"], ["x23"])]
    if kind == "gather":
        inputs.append(helper.make_tensor_value_info("ids", TP.INT64, ["B"]))
    elif kind != "rowwise":
        inputs.append(helper.make_tensor_value_info("mask", f, ["B", "W"]))
    if kind == "transposed":
        nodes += [helper.make_node("Transpose", [n], [n + "T"], perm=[1, 0]) for n in ("x", "x2", "mask")]
    for i, (fi, fo) in enumerate(SLOTS):
        x = "x" if fi == 576 else "x2"
        a, b = f"a{i}", f"b{i}"
        if kind == "mask":
            inputs += [helper.make_tensor_value_info(a, f, [fi, "W"]), helper.make_tensor_value_info(b, f, ["W", fo])]
            nodes += [helper.make_node("MatMul", [x, a], [f"h{i}"]), helper.make_node("Mul", [f"h{i}", "mask"], [f"m{i}"]),
                      helper.make_node("MatMul", [f"m{i}", b], [f"y{i}"])]
        elif kind == "transposed":
            inputs += [helper.make_tensor_value_info(a, f, ["W", fi]), helper.make_tensor_value_info(b, f, [fo, "W"])]
            nodes += [helper.make_node("MatMul", [a, x + "T"], [f"h{i}"]), helper.make_node("Mul", [f"h{i}", "maskT"], [f"m{i}"]),
                      helper.make_node("MatMul", [b, f"m{i}"], [f"t{i}"]), helper.make_node("Transpose", [f"t{i}"], [f"y{i}"], perm=[1, 0])]
        elif kind == "rowwise":
            inputs += [helper.make_tensor_value_info(a, f, ["B", fi, "R"]), helper.make_tensor_value_info(b, f, ["B", "R", fo])]
            nodes += [helper.make_node("MatMul", [x + "3", a], [f"h{i}"]), helper.make_node("MatMul", [f"h{i}", b], [f"t{i}"]),
                      helper.make_node("Squeeze", [f"t{i}", "one"], [f"y{i}"])]
        else:
            inputs += [helper.make_tensor_value_info(a, f, ["N", fi, "R"]), helper.make_tensor_value_info(b, f, ["N", "R", fo])]
            nodes += [helper.make_node("Gather", [a, "ids"], [f"ga{i}"], axis=0), helper.make_node("Gather", [b, "ids"], [f"gb{i}"], axis=0),
                      helper.make_node("MatMul", [x + "3", f"ga{i}"], [f"h{i}"]), helper.make_node("MatMul", [f"h{i}", f"gb{i}"], [f"y{i}"])]
        outs.append(f"y{i}")
    nodes.append(helper.make_node("Concat", outs, ["out"], axis=-1))  # every slot's output is used
    inits = [helper.make_tensor("one", TP.INT64, [1], [1])] if kind in ("gather", "rowwise") else []
    graph = helper.make_graph(nodes, kind, inputs, [helper.make_tensor_value_info("out", f, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _feeds(kind: str, rows: int, adapters: int, rng) -> dict[str, np.ndarray]:
    width = adapters * RANK
    feeds = {"x": rng.standard_normal((rows, 576), np.float32), "x2": rng.standard_normal((rows, 1536), np.float32)}
    if kind == "rowwise":
        pass
    elif kind == "gather":
        feeds["ids"] = np.arange(rows, dtype=np.int64) % adapters
    else:
        mask = np.zeros((rows, width), np.float32)
        for r in range(rows):
            j = r % adapters
            mask[r, j * RANK:(j + 1) * RANK] = 1
        feeds["mask"] = mask
    for i, (fi, fo) in enumerate(SLOTS):
        if kind == "mask":
            a, b = (fi, width), (width, fo)
        elif kind == "transposed":
            a, b = (width, fi), (fo, width)
        elif kind == "rowwise":
            a, b = (rows, fi, RANK), (rows, RANK, fo)
        else:
            a, b = (adapters, fi, RANK), (adapters, RANK, fo)
        feeds[f"a{i}"] = 0.02 * rng.standard_normal(a, np.float32)
        feeds[f"b{i}"] = 0.02 * rng.standard_normal(b, np.float32)
    return feeds


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--out", type=Path, default=RESULTS / "lora_formulations.json")
    args = ap.parse_args()
    load_before = load_average()
    from kvforge.ort_session import make_session

    rng = np.random.default_rng(0)
    bandwidth = [bandwidth_gbs()]
    ms: dict[str, dict[str, float]] = {}
    for kind in ("mask", "gather", "transposed", "rowwise"):
        session = make_session(_model(kind))
        for case, (rows, adapters) in CASES.items():
            feeds = _feeds(kind, rows, adapters, rng)
            session.run(None, feeds)
            times = []
            for _ in range(args.runs):
                start = time.perf_counter()
                session.run(None, feeds)
                times.append(time.perf_counter() - start)
            ms.setdefault(case, {})[kind] = 1000 * statistics.median(times)
            print(f"{case:22s} {kind:10s} {ms[case][kind]:6.2f} ms", flush=True)
    bandwidth.append(bandwidth_gbs())
    bw = statistics.median(bandwidth)
    per_adapter = sum((fi + fo) * RANK * 4 for fi, fo in SLOTS)
    floor = {case: 1000 * adapters * per_adapter / (bw * 1e9) for case, (_, adapters) in CASES.items()}
    result = {"benchmark": "lora_formulations", "slots": len(SLOTS), "rank": RANK, "runs": args.runs,
              "bandwidth_gbs": bw, "bandwidth_samples_gbs": bandwidth, "adapter_bytes": per_adapter,
              "step_ms": ms, "read_once_floor_ms": floor,
              "machine": machine(), "load_before": load_before, "time": utc_time()}
    write_result("lora_formulations", result, args.out)
    for case, f in floor.items():
        print(f"{case:22s} reading the adapters once: {f:.2f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
