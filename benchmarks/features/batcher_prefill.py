"""Prefix caching and chunked prefill in the continuous batcher on SmolLM2-135M-Instruct (FP32, ONNX Runtime; issue 34).

1. Time to first token of a request whose 1,024-token system prompt is cached, against the same request when it
   is not (a fresh prefix cache: the whole prompt is prefilled). Each request is the system prompt and a user turn
   of its own (~20 tokens), alone in the batcher; the two cases alternate, medians over --runs. Target: cached
   >= 5x lower.
2. Inter-token latency of 8 decoding streams while a 4,096-token prompt arrives: each stream's intervals between
   tokens before the long prompt arrives (steady decode; their median) against those during its prefill (from
   its arrival to its first token; their p99). Target: p99 during <= 2x the median, with chunked prefill; the
   same without chunking (prefill_chunk 0) is stated. Each --chunks value is one run, chunked ones with
   mixed_steps (each chunk rides in the decode call); the long prompt's time to first token is recorded beside it
   (what chunking costs the long prompt). The step floor says what a step carrying k prompt tokens over a
   4,000-position cache costs beside the plain decode step, as one mixed call and as two calls (see step_floor),
   and the decode profile where a decode step of 8 rows spends its kernel time.
3. What the cache layout costs: 16 clients in-process (each prompt a shared 192-token prefix and a 64-token tail,
   128 new tokens, 2 requests per client), with the batcher's own clock of its forward calls and its cache copies
   (joins and leaves regroup the batch's cache; a restored prefix is copied into its row's cache): the share of
   the batcher's time spent copying. And whether ONNX Runtime here can read a block table at all: a
   com.microsoft PagedAttention node is given to a CPU session (the error it gets is recorded).

    python3 -m benchmarks.features.batcher_prefill [--bundle DIR] [--runs 5] [--chunks 0,256,64,40]
DIR: an FP32 SmolLM2 bundle (`kvforge export smollm2 --dequantize -o DIR`); made in a temporary directory if not
given. Writes benchmarks/results/batcher_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness import RESULTS, ROOT, load_average, machine, utc_time, write_result

SYSTEM_TOKENS = 1024
LONG_TOKENS = 4096
STREAMS = 8
OUT = RESULTS / "batcher_prefill.json"


def bundle_path(given: Path | None, work: Path) -> Path:
    if given is not None:
        return given
    from kvforge.export import export

    path = work / "smollm2-fp32"
    export("smollm2", path, force=True, dequantize=True)
    return path


def text_ids(tokenizer, n: int, offset: int = 0) -> list[int]:
    """n token ids of real English (this repository's README, repeated as needed), starting `offset` tokens in."""
    words = tokenizer.encode((ROOT / "README.md").read_text())
    ids = (words * (1 + (n + offset) // len(words)))[offset:offset + n]
    return ids


def first_token_s(batcher, prompt: list[int]) -> float:
    start = time.perf_counter()
    request = batcher.submit(prompt, max_new_tokens=1, ignore_eos=True)
    next(iter(request))
    elapsed = time.perf_counter() - start
    request.result(timeout=600)
    return elapsed


def ttft(session, runs: int) -> dict:
    """Cached vs uncached time to first token, alternating; one batcher per uncached request (an empty cache)."""
    from kvforge import runtime

    system = text_ids(session.tokenizer, SYSTEM_TOKENS)
    turns = [text_ids(session.tokenizer, 20, offset=5000 + 37 * i) for i in range(runs + 1)]
    cached, uncached = [], []
    with runtime.Batcher(session, max_batch=1) as warm:
        first_token_s(warm, system + turns[-1])  # caches the system prompt's 64 blocks
        for i in range(runs):
            order = ("cached", "uncached") if i % 2 == 0 else ("uncached", "cached")
            for which in order:
                if which == "cached":
                    cached.append(first_token_s(warm, system + turns[i]))
                else:
                    with runtime.Batcher(session, max_batch=1) as cold:
                        uncached.append(first_token_s(cold, system + turns[i]))
        stats = warm.prefix_stats
    c, u = statistics.median(cached), statistics.median(uncached)
    return {"system_tokens": SYSTEM_TOKENS, "turn_tokens": 20, "runs": runs, "cached_s": cached, "uncached_s": uncached,
            "cached_median_s": c, "uncached_median_s": u, "speedup": u / c, "target_speedup": 5.0,
            "hit_tokens_per_cached_request": stats.hit_tokens / runs}


def itl_during_long_prefill(session, chunk: int) -> dict:
    """8 streams decoding; after each has ~24 tokens, a 4,096-token prompt arrives. Their inter-token intervals
    before it arrived and during its prefill (the streams ask for enough tokens to outlast it)."""
    from kvforge import runtime

    decode_tokens = 100 + (LONG_TOKENS // max(chunk - STREAMS, 1) if chunk else 0)
    prompts = [text_ids(session.tokenizer, 64, offset=100 * i) for i in range(STREAMS)]
    long_prompt = text_ids(session.tokenizer, LONG_TOKENS, offset=9000)
    stamps: list[list[float]] = [[] for _ in range(STREAMS)]
    with runtime.Batcher(session, max_batch=STREAMS + 1, prefill_chunk=chunk, prefix_cache_tokens=0,
                         mixed_steps=bool(chunk)) as batcher:
        requests = [batcher.submit(p, max_new_tokens=decode_tokens, ignore_eos=True) for p in prompts]

        def follow(i):
            for _ in requests[i]:
                stamps[i].append(time.perf_counter())

        threads = [threading.Thread(target=follow, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 24:
            time.sleep(0.01)
        arrived = time.perf_counter()
        long_request = batcher.submit(long_prompt, max_new_tokens=1, ignore_eos=True)
        next(iter(long_request))
        first = time.perf_counter()
        long_request.result(timeout=600)
        for r in requests:
            r.cancel()
        for t in threads:
            t.join()
    before, during = [], []
    for s in stamps:
        for a, b in zip(s, s[1:]):
            if b <= arrived and a >= s[4]:  # steady decode: past the streams' own prefill and joins
                before.append(b - a)
            elif a >= arrived and b <= first or a < arrived < b:
                during.append(b - a)
    during.sort()
    p99 = during[min(len(during) - 1, int(0.99 * len(during)))] if during else float("nan")
    median = statistics.median(before)
    return {"prefill_chunk": chunk, "mixed_steps": bool(chunk), "streams": STREAMS, "long_prompt_tokens": LONG_TOKENS,
            "median_itl_before_s": median, "p99_itl_during_prefill_s": p99, "max_itl_during_prefill_s": max(during),
            "ratio_p99_to_median": p99 / median, "target_ratio": 2.0, "intervals_before": len(before),
            "intervals_during": len(during), "long_prompt_ttft_s": first - arrived}


def step_floor(session) -> dict:
    """What a step that carries a prompt chunk costs beside the plain decode step: the decode step of 8 rows at
    ~300 positions alone, and with a chunk of k tokens of one row over a 4,000-position cache in the same step
    (forward_mixed: one call of the mixed graph on ONNX Runtime), and as two forward calls, each reading every
    weight (what a step was before the mixed graph). Chained steps, medians of 5."""
    import numpy as np

    def cache_of(rows: int, past: int):
        ids = np.asarray([text_ids(session.tokenizer, past, offset=3000 + 400 * r) for r in range(rows)], np.int64)
        return session.forward(ids, np.ones((rows, past), np.int64), cache=None, last_logits_only=True)[1]

    def timed(rows_cache, prompt_cache, new: int, mixed: bool) -> float:
        times = []
        for k in range(5):
            x = np.asarray([text_ids(session.tokenizer, 1, offset=7 * k + r) for r in range(STREAMS)], np.int64)
            mask = np.ones((STREAMS, 300 + k + 1), np.int64)
            start = time.perf_counter()
            if new == 0:
                _, rows_cache = session.forward(x, mask, cache=rows_cache, last_logits_only=True)
            else:
                chunk = np.asarray([text_ids(session.tokenizer, new, offset=11 * k)], np.int64)
                chunk_mask = np.ones((1, 4000 + (k + 1) * new), np.int64)
                if mixed:
                    (_, rows_cache), (_, prompt_cache) = session.forward_mixed((x, mask, rows_cache),
                                                                               (chunk, chunk_mask, prompt_cache))
                else:
                    _, rows_cache = session.forward(x, mask, cache=rows_cache, last_logits_only=True)
                    _, prompt_cache = session.forward(chunk, chunk_mask, cache=prompt_cache, last_logits_only=True)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    rows, prompt = cache_of(STREAMS, 300), cache_of(1, 4000)
    decode = timed(rows, None, 0, False)
    out = {"decode_8_rows_s": decode, "mixed_graph": session.prepare_mixed(), "chunk_over_4000": []}
    for new in (1, 8, 16, 32):
        one_call, two_calls = timed(rows, prompt, new, True), timed(rows, prompt, new, False)
        out["chunk_over_4000"].append({"tokens": new, "mixed_step_s": one_call, "two_calls_s": two_calls,
                                       "ratio_mixed": one_call / decode, "ratio_two_calls": two_calls / decode})
    return out


def decode_profile(session, rows: int = STREAMS, past: int = 350, steps: int = 12) -> dict:
    """Where a decode step of `rows` rows at ~`past` positions spends its kernel time (ONNX Runtime's profiler over
    `steps` chained steps of the packed variant): per op type, ms per step and share."""
    import collections
    import json as _json

    import numpy as np
    import onnxruntime as ort

    backend = session.backend
    ids = np.asarray([text_ids(session.tokenizer, past, offset=500 * r) for r in range(rows)], np.int64)
    _, cache = session.forward(ids, np.ones((rows, past), np.int64), last_logits_only=True)
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "decode")
    plain, backend.session = backend.session, ort.InferenceSession(str(backend.graph_path), opts,
                                                                   providers=["CPUExecutionProvider"])
    cache.layout.store.bindings.clear()  # bind the buffers to the profiling session
    try:
        mask = np.ones((rows, past), np.int64)
        for k in range(steps):
            mask = np.concatenate([mask, np.ones((rows, 1), np.int64)], axis=1)
            x = np.asarray([text_ids(session.tokenizer, 1, offset=13 * k + r) for r in range(rows)], np.int64)
            _, cache = session.forward(x, mask, cache=cache, last_logits_only=True)
        events = _json.loads(Path(backend.session.end_profiling()).read_text())
    finally:
        backend.session = plain
    by = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by[e["args"]["op_name"]] += e["dur"] / 1e3 / steps
    total = sum(by.values())
    return {"rows": rows, "past": past, "kernel_ms_per_step": total,
            "ops": [{"op": op, "ms_per_step": ms, "share": ms / total} for op, ms in by.most_common(8)]}


def copy_share(session, clients: int = 16, per_client: int = 2) -> dict:
    """The batcher's forward and copy seconds over a serving-like run (module doc, 3)."""
    from kvforge import runtime

    prefix = text_ids(session.tokenizer, 192, offset=20000)
    tails = [text_ids(session.tokenizer, 64, offset=30000 + 64 * i) for i in range(clients * per_client)]
    with runtime.Batcher(session, max_batch=clients) as batcher:
        def client(i):
            for k in range(per_client):
                batcher.submit(prefix + tails[i * per_client + k], max_new_tokens=128, ignore_eos=True).result(timeout=900)

        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        seconds = dict(batcher.seconds)
    busy = sum(seconds.values())
    return {"clients": clients, "requests": clients * per_client, "wall_s": wall,
            "tokens_per_s": clients * per_client * 128 / wall, "seconds": seconds,
            "copy_share_of_batcher_time": seconds["copy"] / busy, "copy_share_of_wall": seconds["copy"] / wall}


def paged_attention_on_cpu() -> str:
    """What ONNX Runtime's CPU provider says to a PagedAttention node (com.microsoft)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    names = ["query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens",
             "block_table"]
    types = [TensorProto.FLOAT16] * 5 + [TensorProto.INT32] * 3  # the op is defined for float16 and bfloat16
    node = helper.make_node("PagedAttention", names, ["output", "key_cache_out", "value_cache_out"],
                            domain="com.microsoft", num_heads=2, kv_num_heads=2)
    shapes = [[4, 16], [4, 16], [4, 16], [2, 4, 2, 8], [2, 4, 2, 8], [2], [1], [1, 2]]  # 4 tokens, 2 heads of 8, 2 blocks of 4
    graph = helper.make_graph([node], "paged", [helper.make_tensor_value_info(n, t, d) for n, t, d in zip(names, types, shapes)],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT16, None) for o in node.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - the message is the finding
        return f"{type(e).__name__}: {str(e)[:400]}"
    return f"a CPU session accepted it (onnxruntime {ort.__version__}, onnx {onnx.__version__})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--chunks", default="0,256,64,24,16")
    parser.add_argument("--skip-ttft", action="store_true")
    args = parser.parse_args()
    load_before = load_average()

    from kvforge import runtime

    with tempfile.TemporaryDirectory() as tmp:
        bundle = bundle_path(args.bundle, Path(tmp))
        with runtime.load(bundle) as session:
            session.generate(text_ids(session.tokenizer, 300), max_new_tokens=4)  # warm-up
            result = {"model": "SmolLM2-135M-Instruct", "bundle": str(bundle), "backend": session.backend_name,
                      "dtype": "float32", "defaults": vars(runtime.BatchOptions()), "machine": machine(),
                      "load_before": load_before}
            if not args.skip_ttft:
                result["ttft"] = ttft(session, args.runs)
                print(json.dumps(result["ttft"], indent=1))
            result["paged_attention_on_cpu"] = paged_attention_on_cpu()
            print(result["paged_attention_on_cpu"])
            result["copy_share"] = copy_share(session)
            print(json.dumps(result["copy_share"]))
            result["decode_profile"] = decode_profile(session)
            print(json.dumps(result["decode_profile"]))
            result["step_floor"] = step_floor(session)
            print(json.dumps(result["step_floor"]))
            result["itl"] = []
            for chunk in [int(c) for c in args.chunks.split(",")]:
                row = itl_during_long_prefill(session, chunk)
                print(json.dumps(row))
                result["itl"].append(row)
    result["time"] = utc_time()
    write_result("batcher_prefill", result, OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
