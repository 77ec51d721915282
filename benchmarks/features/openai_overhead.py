"""The OpenAI front's overhead: in-process batcher vs Triton's generate endpoint vs /v1/completions, SmolLM2-135M FP32.

Issue 33's figure. One float bundle of SmolLM2-135M-Instruct (--bundle; exported from `smollm2` with
dequantize=True when it is missing) is served four ways, and C concurrent clients (1 and 8) each send R requests
one after another (the same ~64-token prompt, 64 new tokens, EOS ignored, temperature 0):

- in_process: a runtime.Batcher (max_batch 8) over runtime.load(bundle), a thread per client iterating its
  request's TokenEvents (so time to first token and inter-token gaps are measured here too);
- triton: a real Triton Inference Server started as `kvforge serve` starts it (serving.write_repository with an
  OpenAI port, serving.TritonServer on free ports, 127.0.0.1), clients POSTing /v2/models/NAME/generate
  (non-streaming) over http.client, one keep-alive connection per client;
- openai: the OpenAI front in that same server's model process, clients using the official `openai` package,
  `client.completions.create(..., max_tokens=64, temperature=0, extra_body={"ignore_eos": True})`;
- openai_stream: the same with stream=True (and stream_options.include_usage for the token count): time to first
  token and the gaps between content chunks as the client sees them.

The four paths are interleaved within each repetition (balanced orders, a pause before each run), after one
warm-up run of each at 8 clients. Reported per path and client count: tokens/s overall (every client's tokens over
the wall time from the common start to the last response), request latency p50/p90 (pooled over repetitions),
and, where streamed, TTFT p50 and inter-token p50/p99; then per repetition the ratios (openai / triton and
openai / in_process tokens/s, openai latency - in_process latency) and their medians. Every response is checked
for its token count (64) and its greedy text against the in-process one. A tritonserver that dies during a run
(seen here: SIGSEGV in the Python backend, or a model process that stops answering, under 8 concurrent
non-streaming generate requests) is recorded in server_crashes with its log tail, stopped, restarted on fresh
ports, warmed up, and that run is redone (--max-restarts); requests time out after TIMEOUT_S.

    python3 -m benchmarks.features.openai_overhead [--runs 4] [--requests-1 2] [--requests-8 1]
        [--bundle /work/smolcheck/fp32]
Needs the serve extra (`pip install -e '.[serve]'`) and the `openai` package.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.harness import (RESULTS, ROOT, balanced_orders, bandwidth_gbs, load_average, machine, utc_time,
                                write_result)

MODEL = "smollm2"
PROMPT_LEN, NEW_TOKENS, MAX_BATCH = 64, 64, 8
PATHS = ("in_process", "triton", "openai", "openai_stream")
PAUSE_S = 0.5
TIMEOUT_S = 90  # per request: 5x an 8-client request here; a hung server (see server_crashes) is restarted
SEED_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
             "movable metal type, oil-based ink and a wooden screw press into a system that could produce books far "
             "faster than scribes. Within fifty years presses were running in more than two hundred cities across "
             "Europe, and the price of a book fell so sharply that ordinary merchants could own a small library. "
             "Historians still argue about how much of the Reformation and the scientific revolution followed from it.")


def fixed_prompt(tokenizer, n: int) -> str:
    """A text that encodes to exactly n tokens (a prefix of SEED_TEXT, re-checked)."""
    ids = tokenizer.encode(SEED_TEXT)
    for extra in range(0, 8):
        text = tokenizer.decode(ids[:n + extra])
        if len(tokenizer.encode(text)) == n:
            return text
    raise SystemExit(f"could not make a prompt of {n} tokens")


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values), q)) if values else None


class Run:
    """One path's run at C clients: each client's requests, timed; anomalies recorded, never raised mid-run."""

    def __init__(self, clients: int, requests: int):
        self.clients, self.requests = clients, requests
        self.latency: list[float] = []
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.tokens = 0
        self.texts: list[str] = []
        self.anomalies: list[str] = []
        self.errors = 0  # requests that raised (HTTP errors, dropped connections, timeouts)
        self.lock = threading.Lock()
        self.start = 0.0
        self.end = 0.0

    def go(self, make_client, one_request) -> dict:
        """make_client(i) -> per-client state (made before the clock starts); one_request(state) -> dict with
        tokens, text and optionally token times (absolute perf_counter values)."""
        gate = threading.Barrier(self.clients + 1)
        states = [make_client(i) for i in range(self.clients)]

        def client(i):
            gate.wait()
            for _ in range(self.requests):
                t0 = time.perf_counter()
                try:
                    out = one_request(states[i])
                except Exception as e:  # noqa: BLE001 - recorded; the figure says how many failed
                    with self.lock:
                        self.anomalies.append(f"{type(e).__name__}: {e}"[:300])
                        self.errors += 1
                    continue
                t1 = time.perf_counter()
                with self.lock:
                    self.latency.append(t1 - t0)
                    self.tokens += out["tokens"]
                    self.texts.append(out["text"])
                    self.end = max(self.end, t1)
                    if out["tokens"] != NEW_TOKENS:
                        self.anomalies.append(f"{out['tokens']} tokens, not {NEW_TOKENS} ({out.get('why', '')})")
                    times = out.get("times")
                    if times:
                        self.ttft.append(times[0] - t0)
                        self.gaps.extend(np.diff(times).tolist())

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(self.clients)]
        for t in threads:
            t.start()
        self.start = time.perf_counter()
        gate.wait()
        for t in threads:
            t.join(TIMEOUT_S * self.requests + 60)
        if any(t.is_alive() for t in threads):
            with self.lock:
                self.anomalies.append(f"a client thread was still running after {TIMEOUT_S * self.requests + 60} s")
                self.errors += 1
        for s in states:
            close = getattr(s, "close", None)
            if close is not None:
                close()
        wall = (self.end or time.perf_counter()) - self.start
        return {"tokens": self.tokens, "wall_s": wall, "tokens_per_s": self.tokens / wall if wall > 0 else 0.0,
                "latency_s": self.latency, "ttft_s": self.ttft, "gap_s": self.gaps, "texts": self.texts,
                "anomalies": self.anomalies, "errors": self.errors, "requests": len(self.latency)}


def in_process_path(batcher, prompt: str):
    def one(_state):
        request = batcher.submit(prompt, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        times = []
        for _ in request.events(timeout=TIMEOUT_S):
            times.append(time.perf_counter())
        result = request.result()
        return {"tokens": len(result.tokens), "text": result.text, "times": times, "why": result.finish_reason}
    return (lambda i: None), one


class _Conn:
    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)

    def close(self):
        self.conn.close()


def triton_path(served, prompt: str):
    body = json.dumps({"text_input": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True})

    def one(state: _Conn):
        state.conn.request("POST", f"/v2/models/{MODEL}/generate", body, {"Content-Type": "application/json"})
        resp = state.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")
        out = json.loads(data)
        ids = out.get("token_ids")
        ids = ids if isinstance(ids, list) else [ids]
        return {"tokens": len(ids), "text": out.get("text_output", ""), "why": out.get("finish_reason")}
    return (lambda i: _Conn(served.http_port)), one


def openai_path(served, prompt: str, stream: bool):
    from openai import OpenAI

    def make(i):
        return OpenAI(base_url=f"http://127.0.0.1:{served.openai_port}/v1", api_key="none", max_retries=0,
                      timeout=TIMEOUT_S)

    def one(client):
        if not stream:
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
            return {"tokens": out.usage.completion_tokens, "text": out.choices[0].text,
                    "why": out.choices[0].finish_reason}
        times, parts, tokens, why = [], [], None, None
        for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            if chunk.choices:
                if chunk.choices[0].text:
                    times.append(time.perf_counter())
                    parts.append(chunk.choices[0].text)
                why = chunk.choices[0].finish_reason or why
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return {"tokens": tokens if tokens is not None else -1, "text": "".join(parts), "times": times,
                "why": f"{why}, {len(times)} content chunks"}
    return make, one


def summarize(runs: list[dict]) -> dict:
    lat = [x for r in runs for x in r["latency_s"]]
    ttft = [x for r in runs for x in r["ttft_s"]]
    gaps = [x for r in runs for x in r["gap_s"]]
    if not runs:
        return {"tokens_per_s": None, "runs": 0}
    out = {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
           "tokens_per_s_runs": [round(r["tokens_per_s"], 2) for r in runs],
           "latency_p50_s": percentile(lat, 50), "latency_p90_s": percentile(lat, 90),
           "latency_p50_s_runs": [round(percentile(r["latency_s"], 50) or 0, 4) for r in runs],
           "requests": sum(r["requests"] for r in runs), "tokens": sum(r["tokens"] for r in runs)}
    if ttft:
        out.update(ttft_p50_ms=1e3 * percentile(ttft, 50), ttft_p90_ms=1e3 * percentile(ttft, 90),
                   inter_token_p50_ms=1e3 * percentile(gaps, 50), inter_token_p99_ms=1e3 * percentile(gaps, 99),
                   inter_token_gaps=len(gaps))
    return out


def ratios(runs: dict[str, list[dict]]) -> dict:
    """Per repetition, then the median over repetitions."""
    def per_rep(f):
        values = []
        for i in range(min(len(r) for r in runs.values())):  # repetitions every path completed
            try:
                values.append(f(*(runs[p][i] for p in PATHS)))
            except (TypeError, ZeroDivisionError):  # a run with no successful request (recorded in checks)
                pass
        return {"median": statistics.median(values) if values else None, "runs": [round(v, 4) for v in values]}

    def med(r):
        return percentile(r["latency_s"], 50)

    return {
        "openai_over_triton_tokens_per_s": per_rep(lambda ip, tr, oa, st: oa["tokens_per_s"] / tr["tokens_per_s"]),
        "openai_over_in_process_tokens_per_s": per_rep(lambda ip, tr, oa, st: oa["tokens_per_s"] / ip["tokens_per_s"]),
        "triton_over_in_process_tokens_per_s": per_rep(lambda ip, tr, oa, st: tr["tokens_per_s"] / ip["tokens_per_s"]),
        "openai_stream_over_in_process_tokens_per_s": per_rep(
            lambda ip, tr, oa, st: st["tokens_per_s"] / ip["tokens_per_s"]),
        "openai_minus_in_process_latency_ms": per_rep(lambda ip, tr, oa, st: 1e3 * (med(oa) - med(ip))),
        "openai_minus_triton_latency_ms": per_rep(lambda ip, tr, oa, st: 1e3 * (med(oa) - med(tr))),
        "triton_minus_in_process_latency_ms": per_rep(lambda ip, tr, oa, st: 1e3 * (med(tr) - med(ip))),
        "openai_stream_minus_in_process_latency_ms": per_rep(lambda ip, tr, oa, st: 1e3 * (med(st) - med(ip))),
        "openai_stream_minus_in_process_ttft_ms": per_rep(
            lambda ip, tr, oa, st: 1e3 * (percentile(st["ttft_s"], 50) - percentile(ip["ttft_s"], 50))),
    }


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "onnxruntime", "numpy", "openai", "httpx2", "uvicorn", "starlette", "nvidia-pytriton",
                 "kvforge"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def source_state() -> dict:
    """The commit measured, and whether the code it serves had uncommitted changes."""
    import subprocess

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    dirty = git("status", "--porcelain", "--", "serving", "runtime", "kvforge")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_changes": None if dirty is None else bool(dirty)}


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def ensure_bundle(path: Path) -> Path:
    from kvforge.bundle import Bundle

    if Bundle.is_bundle(path):
        return path
    from kvforge.export import export

    print(f"{path} is not a bundle: exporting smollm2 (float) there ...", flush=True)
    return export("smollm2", path, dequantize=True).path


def wait_openai(port: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the OpenAI front on 127.0.0.1:{port} was not healthy within {timeout_s:.0f} s")


class TooManyFailures(Exception):
    pass


class Served:
    """The server as `kvforge serve` starts it (a repository with an OpenAI port, TritonServer on free ports),
    restartable: a tritonserver that dies mid-run is recorded (exit code, log tail), stopped (which also kills the
    model's stub, left running and still serving /v1 by a server that crashed) and started afresh."""

    def __init__(self, bundle: Path, work: Path):
        self.bundle, self.work = bundle, work
        self.server = None
        self.starts = 0
        self.crashes: list[dict] = []
        self.http_port = self.openai_port = None

    def start(self) -> float:
        from kvforge.runtime import BatchOptions
        from kvforge.serving import TritonServer, write_repository
        from kvforge.serving.server import free_port

        self.starts += 1
        t = time.perf_counter()
        self.openai_port = free_port()
        repo = write_repository(self.bundle, self.work / f"repository-{self.starts}", model_name=MODEL,
                                batching=BatchOptions(max_batch=MAX_BATCH), openai_port=self.openai_port,
                                openai_host="127.0.0.1")
        self.server = TritonServer(repo, "127.0.0.1", http_port=0, grpc_port=0, metrics_port=0,
                                   log_file=str(self.work / f"tritonserver-{self.starts}.log"))
        self.server.start()
        check_ours(self.server)
        wait_openai(self.openai_port)
        self.http_port = self.server.http_port
        took = time.perf_counter() - t
        print(f"Triton up ({took:.1f} s): HTTP {self.http_port}, OpenAI {self.openai_port}", flush=True)
        return took

    def alive(self) -> bool:
        return self.server is not None and self.server.proc.poll() is None

    def failed(self, where: str, anomalies: list[str]) -> None:
        """Record a server that died (or whose requests failed or hung: it is then stopped, its stub with it)."""
        died = not self.alive()
        metrics = None
        if not died:  # what a hung model's metrics say (its watcher updates them every 0.1 s)
            try:
                url = f"http://127.0.0.1:{self.server.metrics_port}/metrics"
                with urllib.request.urlopen(url, timeout=5) as r:
                    metrics = [line for line in r.read().decode().splitlines() if line.startswith("kvforge_")]
            except OSError as e:
                metrics = [f"unreadable: {e}"]
        code = self.server.stop()
        tail = self.server.log_tail(60).splitlines()
        start = next((i for i, line in enumerate(tail) if line.startswith("Signal")), max(0, len(tail) - 15))
        self.crashes.append({"during": where, "what": "tritonserver died" if died else "requests failed or timed out "
                             "with the server up (stopped)", "exit_code": code, "client_errors": anomalies[:4],
                             "metrics_at_failure": metrics, "log_tail": tail[start:start + 16]})
        print(f"server failure during {where} ({'died' if died else 'requests failed/hung'}, exit {code}): "
              f"{anomalies[:1]}; restarting it", flush=True)

    def stop(self) -> int | None:
        return self.server.stop() if self.server is not None else None


def check_ours(server) -> None:
    """The server on http_port is the one started here, serving MODEL (TritonServer picks free ports and releases
    them before tritonserver binds them: on a shared machine another process could take one in between, and the
    readiness probe would then be answered by someone else's server)."""
    if server.proc.poll() is not None:
        raise SystemExit(f"tritonserver exited ({server.proc.returncode}) right after it was ready:\n"
                         f"{server.log_tail()}")
    try:
        with urllib.request.urlopen(server.url(f"/v2/models/{MODEL}/ready"), timeout=5) as r:
            if r.status == 200:
                return
    except OSError as e:
        raise SystemExit(f"{server.url()} does not serve {MODEL!r} ({e}); another process may hold the port:\n"
                         f"{server.log_tail()}") from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bundle", default="/work/smolcheck/fp32")
    parser.add_argument("--runs", type=int, default=4, help="repetitions (each runs every path at every client count)")
    parser.add_argument("--requests-1", type=int, default=2, help="requests per client at 1 client")
    parser.add_argument("--requests-8", type=int, default=1, help="requests per client at 8 clients")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval for this process (default: the Triton model's, "
                             "serving.triton_model.SWITCH_S, so the in-process batcher runs as the served one does)")
    parser.add_argument("--max-restarts", type=int, default=8, help="server crashes tolerated (each restarts it)")
    parser.add_argument("--out", default=str(RESULTS / "openai_overhead.json"))
    args = parser.parse_args()
    if args.runs < 1:
        raise SystemExit("--runs must be >= 1 (3 or more for the figure: medians over repetitions)")

    from kvforge import runtime
    from kvforge.serving import check_python_backend, triton_distribution
    from kvforge.serving.triton_model import SWITCH_S

    sys.setswitchinterval(SWITCH_S if args.switch_interval is None else args.switch_interval)

    started = time.perf_counter()
    load_before = load_average()
    bundle = ensure_bundle(Path(args.bundle))
    clients = {1: args.requests_1, 8: args.requests_8}
    triton_distribution()
    check_python_backend()  # as `kvforge serve` does before it starts the server
    bandwidth = [bandwidth_gbs()]
    results: dict = {
        "benchmark": "openai_overhead",
        "model": "SmolLM2-135M-Instruct, FP32 (float bundle)",
        "bundle": str(bundle),
        "machine": {**machine(), "cpu": cpu_model(), "load_average_before": load_before},
        "versions": versions(),
        "source": source_state(),
        "note": (f"This machine has {os.cpu_count()} CPU cores and is shared with other jobs (load average "
                 f"{load_before[0] if load_before else 'unknown'} at the start): absolute figures are noisy; the paths "
                 "are interleaved within "
                 "each repetition so the per-repetition ratios are the figures to read. The clients (http.client "
                 "threads, the openai package's threads) run in this benchmark's process on the same 2 cores as "
                 "the server, so client-side cost (the openai package's parsing, httpx) is part of every "
                 "server-path figure. This process (the in-process batcher and every client) runs with the Triton "
                 "model's thread switch interval (setup.switch_interval_s) unless --switch-interval says otherwise."),
    }
    with tempfile.TemporaryDirectory(prefix="kvforge-openai-bench-") as tmp:
        served = Served(bundle, Path(tmp))
        with runtime.load(bundle) as session, runtime.Batcher(session, max_batch=MAX_BATCH) as batcher:
            prompt = fixed_prompt(session.tokenizer, PROMPT_LEN)
            results["setup"] = {
                "prompt_tokens": len(session.tokenizer.encode(prompt)), "new_tokens": NEW_TOKENS, "ignore_eos": True,
                "temperature": 0, "clients": {str(c): {"requests_per_client": r} for c, r in clients.items()},
                "runs": args.runs, "max_batch": MAX_BATCH, "in_process_backend": session.backend_name,
                "server": "Triton Inference Server (nvidia-pytriton), 1 instance, max_batch 8, 127.0.0.1; the OpenAI "
                          "front in the model's process (serving.write_repository openai_port)",
                "paths": list(PATHS), "order": "balanced (Williams) orders of the four paths per repetition and "
                                               "client count, a pause before each run",
                "switch_interval_s": sys.getswitchinterval()}
            try:
                results["server_start_s"] = served.start()
                paths = {"in_process": in_process_path(batcher, prompt),
                         "triton": triton_path(served, prompt),
                         "openai": openai_path(served, prompt, stream=False),
                         "openai_stream": openai_path(served, prompt, stream=True)}

                def restart(where: str, anomalies: list[str]) -> None:
                    served.failed(where, anomalies)
                    if len(served.crashes) > args.max_restarts:
                        raise TooManyFailures(f"the server failed {len(served.crashes)} times (--max-restarts "
                                              f"{args.max_restarts}): measuring stopped there")
                    served.start()
                    for warm_name in ("triton", "openai"):  # the fresh server's buffers, before timing
                        warm_run = Run(MAX_BATCH, 1).go(*paths[warm_name])
                        if warm_run["errors"] or not served.alive():
                            return restart(f"the warm-up after a restart ({warm_name})", warm_run["anomalies"])

                def measured(name: str, c: int, requests: int, where: str) -> dict:
                    """One run; a run whose requests failed (the server died, or hung) is redone on a fresh,
                    warmed-up server. Wrong token counts are anomalies, recorded, never retried."""
                    while True:
                        run = Run(c, requests).go(*paths[name])
                        if name == "in_process":
                            return run
                        if run["errors"]:  # a dropped connection may come just before the dying server is reaped
                            deadline = time.monotonic() + 3
                            while served.alive() and time.monotonic() < deadline:
                                time.sleep(0.1)
                            restart(where, run["anomalies"])
                            continue
                        if not served.alive():  # complete: the server died after its last response
                            restart(where, ["(no client error: it died after the run's last response)"])
                        return run
                # the greedy text a request gets alone, the one every path's responses are checked against
                reference = batcher.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True).text
                warm: dict = {}
                orders = balanced_orders(len(PATHS))
                runs = {c: {p: [] for p in PATHS} for c in clients}
                try:
                    for name in PATHS:  # warm-up: every batch shape's buffers, the clients' imports and connections
                        warm[name] = measured(name, MAX_BATCH, 1, f"the {name} warm-up")
                        print(f"warm-up {name}: {warm[name]['tokens_per_s']:.1f} tok/s "
                              f"{len(warm[name]['anomalies'])} anomalies {warm[name]['anomalies'][:1]}", flush=True)
                    for rep in range(args.runs):
                        for c, requests in clients.items():
                            for name in (PATHS[k] for k in orders[rep % len(orders)]):
                                time.sleep(PAUSE_S)
                                runs[c][name].append(measured(name, c, requests,
                                                              f"{name}, {c} clients, repetition {rep}"))
                                if runs[c][name][-1]["anomalies"]:
                                    print(f"  {name}: {runs[c][name][-1]['anomalies'][0]}", flush=True)
                            print(f"run {rep} {c} clients: " + ", ".join(
                                f"{p} {runs[c][p][-1]['tokens_per_s']:.1f} tok/s p50 "
                                f"{1e3 * (percentile(runs[c][p][-1]['latency_s'], 50) or 0):.0f} ms" for p in PATHS),
                                flush=True)
                        if rep == args.runs // 2:
                            bandwidth.append(bandwidth_gbs())
                except TooManyFailures as e:  # what was measured is still written, marked incomplete
                    results["incomplete"] = str(e)
                    print(f"INCOMPLETE: {e}", flush=True)
            finally:
                code = served.stop()
                results["server_exit_code"] = code
                results["server_failure"] = served.server.failure if served.server else None
                if code not in (0, None) or results["server_failure"]:
                    results["server_log_tail"] = served.server.log_tail(40)
                results["server_starts"] = served.starts
                results["server_crashes"] = served.crashes
    bandwidth.append(bandwidth_gbs())
    if served.crashes:
        results["note"] += (f" The server failed {len(served.crashes)} times in this run ({served.starts} starts; "
                            "server_crashes has each failure's client errors and log tail): every run hit by a failure "
                            "was redone on a restarted, warmed-up server, so the figures are those of runs that "
                            "completed.")

    anomalies, mismatched = {}, {}
    for c in clients:
        results[f"{c}_clients"] = {p: summarize(runs[c][p]) for p in PATHS}
        results[f"{c}_clients"]["ratios"] = ratios(runs[c])
        for p in PATHS:
            found = [a for r in runs[c][p] for a in r["anomalies"]]
            if found:
                anomalies[f"{p} at {c} clients"] = found[:10]
            texts = [t for r in runs[c][p] for t in r["texts"]]
            differ = sum(t != reference for t in texts)
            if differ:
                mismatched[f"{p} at {c} clients"] = {"differ": differ, "of": len(texts),
                                                     "example": next(t for t in texts if t != reference)[:200]}
    for name, r in warm.items():
        if r["anomalies"]:
            anomalies[f"{name} warm-up"] = r["anomalies"][:10]
    results["checks"] = {"anomalies": anomalies or None,
                         "texts_differing_from_in_process_greedy": mismatched or None,
                         "reference_text_head": (reference or "")[:120]}
    results["bandwidth_gbs"] = statistics.median(bandwidth)
    results["bandwidth_samples_gbs"] = [round(b, 2) for b in bandwidth]
    results["machine"]["load_average_after"] = load_average()
    results["total_s"] = time.perf_counter() - started
    results["time"] = utc_time()

    write_result("openai_overhead", results, args.out)

    def ms(v):
        return "-" if v is None else f"{1e3 * v:.0f} ms"

    for c in clients:
        r = results[f"{c}_clients"]
        print(f"{c} clients:")
        for p in PATHS:
            s = r[p]
            extra = (f"  TTFT p50 {s['ttft_p50_ms']:.0f} ms  inter-token p50 {s['inter_token_p50_ms']:.1f} "
                     f"p99 {s['inter_token_p99_ms']:.1f} ms" if "ttft_p50_ms" in s else "")
            if s["tokens_per_s"] is None:
                print(f"  {p:14s} (no run)")
                continue
            print(f"  {p:14s} {s['tokens_per_s']:7.1f} tok/s  latency p50 {ms(s['latency_p50_s'])} "
                  f"p90 {ms(s['latency_p90_s'])}{extra}")
        print("  ratios " + json.dumps({k: None if v["median"] is None else round(v["median"], 3)
                                        for k, v in r["ratios"].items()}))
    if anomalies or mismatched:
        print("ANOMALIES: " + json.dumps({"anomalies": anomalies, "texts": mismatched}, indent=1)[:3000])
    print(f"wrote {args.out} ({results['total_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
