"""Serving throughput: continuous batching in-process and through Triton Inference Server, on the ~125M Llama.

The checkpoint is benchmarks/peers/runtime_125m.py's (hidden 768, 12 layers, GQA 12/4, vocab
32000, random weights, a locally trained BPE tokenizer), exported FP32 and
calibrated INT8 (MSE + SmoothQuant 0.5, as int8_speed_125m.py). For each
precision and for 1, 4, 8 and 16 concurrent clients, each client sends one
request (a 64-token prompt of its own, 128 new tokens, EOS ignored) and all
start together; measured:

- in-process: a runtime.Batcher over one Session (no server), requests
  submitted from one thread per client;
- server: `kvforge serve`'s Triton Inference Server (one instance, batch 16),
  clients streaming over HTTP (generate_stream, one event per token), so that
  time to first token is what a client sees.

Reported per setting: total generated tokens/s (all clients' tokens over the
wall time from the first request to the last token), p50/p95 time to first
token, medians over runs. Also, in the same run: batch-1 decode tokens/s
(runtime.bench, decode steps only) and the decode-step times at batch 1 and 8
that bound what batching can give on this machine; the server's overhead per
request (server vs in-process, one client).

    python3 -m benchmarks.features.serving_125m [--runs 3] [--precisions fp32,int8]
Needs the serve extra (`pip install -e '.[serve]'`) and transformers.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result
from benchmarks.peers.runtime_125m import make_checkpoint

CLIENTS = (1, 4, 8, 16)
PROMPT_LEN, NEW_TOKENS = 64, 128
MODEL = "llama125m"


def prompts_of_length(tokenizer, n: int, count: int) -> list[str]:
    """`count` different texts that encode to exactly n tokens (slices of the held-out text, re-checked)."""
    from kvforge.model_defs.evaluate import heldout_text

    ids = tokenizer.encode(heldout_text(), add_special_tokens=False)
    found, start = [], 0
    while len(found) < count and start + n < len(ids):
        for extra in range(0, 8):
            text = tokenizer.decode(ids[start:start + n + extra])
            if len(tokenizer.encode(text)) == n:
                found.append(text)
                break
        start += 3 * n
    if len(found) < count:
        raise SystemExit(f"could not find {count} prompts of {n} tokens")
    return found


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def run_in_process(batcher, prompts: list[str]) -> dict:
    ttft, done = [], threading.Barrier(len(prompts) + 1)
    start = time.perf_counter()
    requests = [batcher.submit(p, max_new_tokens=NEW_TOKENS, ignore_eos=True) for p in prompts]

    def client(r):
        first = None
        for e in r:
            if first is None:
                first = time.perf_counter() - start
        ttft.append(first)
        done.wait()

    threads = [threading.Thread(target=client, args=(r,)) for r in requests]
    for t in threads:
        t.start()
    done.wait()
    wall = time.perf_counter() - start
    tokens = sum(len(r.result().tokens) for r in requests)
    return {"tokens": tokens, "wall_s": wall, "ttft_s": ttft}


def run_server(port: int, prompts: list[str]) -> dict:
    ttft, counts, errors = [0.0] * len(prompts), [0] * len(prompts), []
    gate = threading.Barrier(len(prompts))
    start_box: list[float] = []

    def client(i):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        body = json.dumps({"text_input": prompts[i], "max_tokens": NEW_TOKENS, "ignore_eos": True, "stream": True})
        gate.wait()
        if not start_box:
            start_box.append(time.perf_counter())
        t0 = time.perf_counter()
        conn.request("POST", f"/v2/models/{MODEL}/generate_stream", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        while True:
            line = resp.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    errors.append(event["error"])
                    break
                if counts[i] == 0:
                    ttft[i] = time.perf_counter() - t0
                counts[i] += 1
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start_box[0]
    if errors:
        raise SystemExit(f"server errors: {errors[:3]}")
    return {"tokens": sum(counts), "wall_s": wall, "ttft_s": ttft}


def summarize(runs: list[dict]) -> dict:
    rates = [r["tokens"] / r["wall_s"] for r in runs]
    ttfts = [t for r in runs for t in r["ttft_s"]]
    return {"tokens_per_s": statistics.median(rates), "tokens_per_s_runs": [round(x, 1) for x in rates],
            "ttft_p50_ms": 1e3 * percentile(ttfts, 50), "ttft_p95_ms": 1e3 * percentile(ttfts, 95),
            "request_s": statistics.median(r["wall_s"] for r in runs), "tokens_per_run": runs[0]["tokens"]}


def step_times(session, batch: int, reps: int = 15) -> dict:
    """Median decode-step time at `batch` rows over a 64 + 64-token cache, and a batch x 64 prefill's time."""
    rng = np.random.default_rng(1)
    ids = rng.integers(10, 8000, (batch, PROMPT_LEN)).astype(np.int64)
    t = time.perf_counter()
    _, cache = session.forward(ids, last_logits_only=True)
    prefill = time.perf_counter() - t
    mask = np.ones((batch, PROMPT_LEN), np.int64)
    for _ in range(NEW_TOKENS // 2):  # the middle of a request's decode
        mask = np.ones((batch, mask.shape[1] + 1), np.int64)
        _, cache = session.forward(ids[:, :1], mask, cache=cache, last_logits_only=True)
    times = []
    for _ in range(reps):
        mask = np.ones((batch, mask.shape[1] + 1), np.int64)
        t = time.perf_counter()
        _, cache = session.forward(ids[:, :1], mask, cache=cache, last_logits_only=True)
        times.append(time.perf_counter() - t)
    return {"prefill_s": prefill, "step_s": statistics.median(times)}


def measure(bundle: Path, tmp: Path, runs: int, prompts: list[str]) -> dict:
    from kvforge import runtime
    from kvforge.runtime.bench import benchmark
    from kvforge.serving import TritonServer, write_repository

    out: dict = {}
    with runtime.load(bundle) as session:
        out["batch1_decode"] = benchmark(session, 1, PROMPT_LEN, NEW_TOKENS, runs=runs)
        steps = {b: step_times(session, b) for b in (1, 8)}
        out["step_ms"] = {b: 1e3 * s["step_s"] for b, s in steps.items()}
        # what 8 clients can reach at best here: one batch-8 prefill, then 128 batch-8 steps, nothing else
        ideal8 = 8 * NEW_TOKENS / (steps[8]["prefill_s"] + NEW_TOKENS * steps[8]["step_s"])
        out["ideal_8_clients_tokens_per_s"] = ideal8
        with runtime.Batcher(session, max_batch=16) as batcher:
            run_in_process(batcher, prompts[:max(CLIENTS)])  # warm-up: every batch shape's buffers exist before timing
            out["in_process"] = {n: summarize([run_in_process(batcher, prompts[:n]) for _ in range(runs)]) for n in CLIENTS}
    repo = write_repository(bundle, tmp / f"repo-{bundle.name}", model_name=MODEL, batching=runtime.BatchOptions(max_batch=16), force=True)
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0) as server:
        run_server(server.http_port, prompts[:max(CLIENTS)])  # warm-up
        out["server"] = {n: summarize([run_server(server.http_port, prompts[:n]) for _ in range(runs)]) for n in CLIENTS}
    decode1 = out["batch1_decode"]["decode_tokens_per_s"]
    ip, sv = out["in_process"], out["server"]
    out["ratios"] = {
        "server_8_clients_over_1": sv[8]["tokens_per_s"] / sv[1]["tokens_per_s"],
        "in_process_8_over_batch1_decode": ip[8]["tokens_per_s"] / decode1,
        "ideal_8_over_batch1_decode": ideal8 / decode1,
        "in_process_8_over_ideal": ip[8]["tokens_per_s"] / ideal8,
        "step_batch8_over_batch1": steps[8]["step_s"] / steps[1]["step_s"],
    }
    out["server_overhead_per_request_ms"] = 1e3 * (sv[1]["request_s"] - ip[1]["request_s"])
    out["server_overhead_ttft_ms"] = sv[1]["ttft_p50_ms"] - ip[1]["ttft_p50_ms"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--precisions", default="fp32,int8")
    parser.add_argument("--out", default=str(RESULTS / "serving_125m.json"))
    args = parser.parse_args()

    from kvforge.calibration import calibrate
    from kvforge.export import export
    from kvforge.model_defs.checkpoint import TINY_DIR
    from kvforge.tokenizer import Tokenizer

    results: dict = {"machine": machine(), "load_before": load_average(),
                     "setup": {"prompt_tokens": PROMPT_LEN, "new_tokens": NEW_TOKENS, "clients": list(CLIENTS),
                               "runs": args.runs, "server": "Triton Inference Server (nvidia-pytriton), 1 instance, batch 16"}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_checkpoint(tmp / "ckpt")
        bundles = {"fp32": export(tmp / "ckpt", tmp / "fp32").path}
        if "int8" in args.precisions:
            bundles["int8"] = calibrate(bundles["fp32"], tmp / "int8", recipe="fixed", precision="int8", method="mse", smoothquant=0.5,
                                        data=TINY_DIR / "calibration.txt", samples=64, seq_len=256).path
        prompts = prompts_of_length(Tokenizer.from_file(tmp / "ckpt" / "tokenizer.json"), PROMPT_LEN, max(CLIENTS))
        for name in args.precisions.split(","):
            print(f"measuring {name} ...", flush=True)
            results[name] = measure(bundles[name], tmp, args.runs, prompts)
            r = results[name]
            for where in ("in_process", "server"):
                for n in CLIENTS:
                    s = r[where][n]
                    print(f"  {where:10s} {n:2d} clients: {s['tokens_per_s']:7.1f} tok/s  TTFT p50 {s['ttft_p50_ms']:7.1f} ms"
                          f"  p95 {s['ttft_p95_ms']:7.1f} ms", flush=True)
            print(f"  ratios {json.dumps({k: round(v, 2) for k, v in r['ratios'].items()})}; server overhead "
                  f"{r['server_overhead_per_request_ms']:.1f} ms/request", flush=True)
    results["time"] = utc_time()
    write_result("serving_125m", results, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
