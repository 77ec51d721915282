"""A real Triton Inference Server (from the nvidia-pytriton wheel) on 127.0.0.1 serving the tiny bundle.

Every server here listens on free ports of 127.0.0.1 and is stopped by its fixture or test; requests
have timeouts, so nothing waits for ever.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import numpy as np
import pytest

from kvforge import runtime
from kvforge.errors import MissingDependencyError

try:
    from kvforge.serving import TritonServer, triton_distribution, write_repository

    triton_distribution()
    _ABSENT = None
except MissingDependencyError as e:  # the serve extra is not installed (it is, with `install.sh --test`)
    _ABSENT = str(e)
pytestmark = pytest.mark.skipif(_ABSENT is not None, reason=f"needs the serve extra: {_ABSENT}")

MODEL = "tiny"
PROMPTS = ["def add(a, b):", "class Stack", "import os\nimport", "x = 1", "for i in range(10):", "# a comment",
           "while True:", "return self.", "def fibonacci(n):", "if __name__", "print(", "try:", "with open(",
           "lambda x:", "from typing import", "async def"]


@pytest.fixture(scope="module")
def server(tiny_fp32, tmp_path_factory):
    repo = write_repository(tiny_fp32.path, tmp_path_factory.mktemp("triton") / "repo", model_name=MODEL, batching=runtime.BatchOptions(max_batch=8))
    srv = TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0)
    srv.start(timeout_s=90)  # a server that is not ready by then fails here with its log tail
    yield srv
    code = srv.stop()
    assert code == 0, srv.log_tail()


@pytest.fixture(scope="module")
def tiny(tiny_fp32):
    with runtime.load(tiny_fp32.path) as session:
        yield session


def _post(server, endpoint: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(server.url(f"/v2/models/{MODEL}/{endpoint}"), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, OSError) as e:  # the watchdog stopped a server whose stub died, or no answer
        pytest.fail(f"no answer from the server ({e}); {server.failure or 'server still running'}:\n{server.log_tail()}")


def _sse(server, body: dict, keep: int | None = None):
    """(events, arrival times) of a generate_stream call; with keep, the connection is closed after that many."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    conn.request("POST", f"/v2/models/{MODEL}/generate_stream", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events, times, start = [], [], time.monotonic()
    while keep is None or len(events) < keep:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            events.append(json.loads(line[6:]))
            times.append(time.monotonic() - start)
    conn.close()
    return events, times


def _metric(server, name: str, labels: str = "") -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    found = re.search(rf"^{name}{re.escape(labels)}\s+(\S+)$", text, flags=re.M)
    return float(found.group(1)) if found else 0.0


def _finishes(server) -> dict[str, float]:
    """kvforge_requests_total by finish reason."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r'^kvforge_requests_total\{finish_reason="(\w+)"\}\s+(\S+)$', text, flags=re.M)}


def test_ready_and_greedy_generate_equals_kvforge_generate(server, tiny_fp32):
    assert urllib.request.urlopen(server.url("/v2/health/ready"), timeout=10).status == 200
    cli = subprocess.run([sys.executable, "-m", "kvforge", "generate", str(tiny_fp32.path), "--prompt", PROMPTS[8],
                          "--max-new-tokens", "24", "--json"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr
    expected = json.loads(cli.stdout.strip().splitlines()[-1])
    status, body = _post(server, "generate", {"text_input": PROMPTS[8], "max_tokens": 24})
    assert status == 200, body
    assert body["token_ids"] == expected["tokens"] and body["text_output"] == expected["text"]
    assert body["finish_reason"] in ("length", "stop")


def test_sixteen_concurrent_requests_equal_their_single_results(server, tiny):
    bodies = [dict(text_input=p, max_tokens=12 + i, ignore_eos=True, **(dict(temperature=0.8, top_p=0.9, seed=i) if i % 3 == 0 else {}))
              for i, p in enumerate(PROMPTS)]
    expected = [tiny.generate(b["text_input"], max_new_tokens=b["max_tokens"], ignore_eos=True, temperature=b.get("temperature", 0.0),
                              top_p=b.get("top_p", 1.0), seed=b.get("seed")) for b in bodies]
    before = _metric(server, "kvforge_generated_tokens_total")
    results: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _post(server, "generate", bodies[i])))
               for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(results) == list(range(16))
    for i, (status, body) in results.items():
        assert status == 200, body
        assert body["token_ids"] == expected[i].tokens and body["text_output"] == expected[i].text
    assert _metric(server, "kvforge_generated_tokens_total") - before == sum(len(e.tokens) for e in expected)


def test_the_stream_streams_token_by_token(server):
    body = {"text_input": PROMPTS[0], "max_tokens": 150, "ignore_eos": True}
    status, whole = _post(server, "generate", body)
    assert status == 200
    events, times = _sse(server, {**body, "stream": True})
    assert len(events) == 150 and [e["token_ids"] for e in events] == whole["token_ids"]
    assert "".join(e["text_output"] for e in events) == whole["text_output"]
    assert [e.get("finish_reason") for e in events] == [None] * 149 + ["length"]  # on the last event only
    assert times[0] < 0.5 * times[-1]  # the first token arrived long before the last was made


def test_grpc_streaming_through_tritonclient(server):
    import tritonclient.grpc as grpcclient

    _, whole = _post(server, "generate", {"text_input": PROMPTS[2], "max_tokens": 20, "ignore_eos": True})
    received, done = [], threading.Event()

    def callback(result, error):
        if error is not None:
            received.append(error)
            done.set()
            return
        received.append(result)
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    inputs = []
    for name, value, dtype in [("text_input", np.array([PROMPTS[2].encode()], dtype=np.object_), "BYTES"),
                               ("max_tokens", np.array([20], np.int32), "INT32"),
                               ("ignore_eos", np.array([True]), "BOOL"), ("stream", np.array([True]), "BOOL")]:
        tensor = grpcclient.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer(MODEL, inputs, request_id="g1", enable_empty_final_response=True)
        assert done.wait(120)
    finally:
        client.stop_stream()
        client.close()
    tokens = [int(t) for r in received if r.as_numpy("token_ids") is not None for t in r.as_numpy("token_ids")]
    assert tokens == whole["token_ids"]


@pytest.mark.parametrize("body, field", [
    ({"max_tokens": 4}, "text_input is required"),
    ({"text_input": "x", "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"text_input": "x", "max_tokens": 4096}, "max_tokens 4096 goes beyond the context"),
    ({"text_input": "x", "temperature": -1.0}, "temperature must be >= 0"),
    ({"text_input": "x " * 1500}, "the model's context is 1024"),
    ({"text_input": "x", "adapter": "customer-a"}, "has no LoRA slots"),
])
def test_bad_requests_get_400_naming_the_field(server, body, field):
    for endpoint in ("generate", "generate_stream"):
        status, answer = _post(server, endpoint, body) if endpoint == "generate" else _stream_error(server, body)
        assert status == 400 and re.search(field, answer["error"]), (endpoint, answer)
    assert _post(server, "generate", {"text_input": "x", "max_tokens": 2})[0] == 200  # still serving


def _stream_error(server, body):
    req = urllib.request.Request(server.url(f"/v2/models/{MODEL}/generate_stream"), data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
            return r.status, json.loads(text.split("data: ", 1)[1])
    except urllib.error.HTTPError as e:  # the error comes as an event too
        return e.code, json.loads(e.read().decode().removeprefix("data: "))


def test_stop_strings_end_the_text_before_them(server, tiny):
    full = tiny.generate(PROMPTS[8], max_new_tokens=40, ignore_eos=True).text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip()
    status, body = _post(server, "generate", {"text_input": PROMPTS[8], "max_tokens": 40, "ignore_eos": True, "stop": [stop]})
    assert status == 200 and body["finish_reason"] == "stop"
    assert body["text_output"] == full[:full.index(stop)]


def test_a_hundred_clients_that_drop_mid_stream_leave_no_rows_or_pinned_blocks(server, tiny):
    """Each streams a prompt that starts with the same 48-token prefix (its rows restore cached blocks), reads two
    tokens and closes the connection: every request ends, at least 90 of them cancelled, the batch empties, no
    cached block stays pinned, and the model still answers as before. (Triton's HTTP front does not report every
    dropped stream as cancelled on a loaded machine: 5 of 100 ran to their end with four test workers on two
    cores. Those run as any request does and free everything when they end.)"""
    before = _finishes(server)
    cancelled = before.get("cancelled", 0.0)
    tokens = _metric(server, "kvforge_generated_tokens_total")
    hits = _metric(server, "kvforge_prefix_cache_hit_tokens_total")
    prefix = tiny.tokenizer.decode(list(range(300, 348)))
    prompts = [prefix + PROMPTS[i % len(PROMPTS)] + f" # {i}" for i in range(100)]
    # as many tokens as the context holds: a request must not end by length before the server sees its client go
    limits = [1024 - len(tiny.tokenizer.encode(p)) for p in prompts]
    got: dict[int, int] = {}

    def client(i):
        got[i] = len(_sse(server, {"text_input": prompts[i], "max_tokens": limits[i], "ignore_eos": True,
                                   "stream": True}, keep=2)[0])

    for wave in range(0, 100, 20):  # 20 at a time: more rows than the batch holds (8), so some wait first
        threads = [threading.Thread(target=client, args=(i,)) for i in range(wave, wave + 20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert sorted(got) == list(range(100)) and set(got.values()) == {2}
    deadline = time.monotonic() + 120

    def settled():
        return (sum(_finishes(server).values()) == sum(before.values()) + 100
                and _metric(server, "kvforge_batch_rows") == 0 and _metric(server, "kvforge_waiting_requests") == 0
                and _metric(server, "kvforge_prefix_cache_pinned_blocks") == 0)

    while not settled() and time.monotonic() < deadline:  # the gauges follow within POLL_S
        time.sleep(0.2)
    assert settled(), (_finishes(server), {name: _metric(server, name) for name in (
        "kvforge_batch_rows", "kvforge_waiting_requests", "kvforge_prefix_cache_pinned_blocks")})
    assert _finishes(server)["cancelled"] - cancelled >= 90, _finishes(server)
    assert _metric(server, "kvforge_generated_tokens_total") - tokens < sum(limits) / 5  # they stopped early
    assert _metric(server, "kvforge_prefix_cache_hit_tokens_total") - hits >= 90 * 32  # later rows restored blocks
    assert _metric(server, "kvforge_prefix_cache_blocks") >= 3  # the prefix's blocks stay cached for the next ones
    status, body = _post(server, "generate", {"text_input": prompts[0], "max_tokens": 6})
    assert status == 200 and body["token_ids"] == tiny.generate(prompts[0], max_new_tokens=6).tokens


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_kvforge_serve_runs_until_a_signal_and_stops_cleanly(tiny_fp32, sig):
    from kvforge.serving.server import free_port

    http_port, grpc_port, metrics_port, openai_port = free_port(), free_port(), free_port(), free_port()
    # SIGTERM's run also serves the OpenAI API (in the model's process, over the same batcher); SIGINT's does not
    # (and speculates by prompt lookup unless a request says "none")
    openai_args = (["--openai-port", str(openai_port), "--api-key", "k3y", "--speculative", "prompt-lookup",
                    "--draft-tokens", "4"] if sig == signal.SIGTERM else ["--no-openai"])
    proc = subprocess.Popen([sys.executable, "-m", "kvforge", "serve", str(tiny_fp32.path), "--model-name", MODEL,
                             "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
                             *openai_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        printed = []
        while not printed or "Ctrl-C or SIGTERM stops it." not in printed[-1]:  # ends: the server is up, or the CLI exits
            line = proc.stdout.readline()
            assert line, "".join(printed)
            printed.append(line)
        assert urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=10).status == 200
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/models/{MODEL}/generate",
                                     data=json.dumps({"text_input": "x", "max_tokens": 3}).encode())
        triton = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert len(triton["token_ids"]) == 3
        if sig == signal.SIGTERM:
            openai = pytest.importorskip("openai")
            assert f"OpenAI  http://127.0.0.1:{openai_port}/v1 (API key required)" in "".join(printed)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{openai_port}/v1", api_key="k3y", max_retries=0, timeout=60)
            out = client.completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0)
            assert out.choices[0].text == triton["text_output"] and out.usage.completion_tokens == 3
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()
            # the metrics count both endpoints' requests: one server, one batch
            metrics = types.SimpleNamespace(metrics_port=metrics_port)
            assert _metric(metrics, "kvforge_generated_tokens_total") == 6
            assert _metric(metrics, "kvforge_requests_total", '{finish_reason="length"}') == 2
            # a prompt that repeats itself: the server's prompt lookup drafts and the output is plain decoding's
            echo = "one two three four, one two three four, one two three four, one two"
            spec, plain = (client.completions.create(model=MODEL, prompt=echo, max_tokens=24, temperature=0,
                                                     extra_body={"ignore_eos": True, **extra})
                           for extra in ({}, {"speculative": "none"}))
            assert spec.choices[0].text == plain.choices[0].text and spec.usage.completion_tokens == 24
            # the model's watcher moves the counters every 0.1 s, one family at a time: read until two reads 0.3 s
            # apart agree (a read between two families' updates saw steps but not yet the accepted tokens)
            deadline, seen = time.monotonic() + 5, None
            while time.monotonic() < deadline:
                now = tuple(_metric(metrics, f"kvforge_speculative_{n}_total")
                            for n in ("steps", "drafted_tokens", "accepted_tokens"))
                if now == seen and now[0]:
                    break
                seen = now
                time.sleep(0.3)
            steps, drafted, accepted = seen
            assert 0 < steps < 24 + 3 + 3 and 0 < accepted <= drafted  # some of the 24 came several to a step
            with pytest.raises(openai.BadRequestError, match="speculative"):
                client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"speculative": "draft:/tmp"})
        else:
            with pytest.raises((urllib.error.URLError, OSError)):
                urllib.request.urlopen(f"http://127.0.0.1:{openai_port}/v1/models", timeout=2)
        started = time.monotonic()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        out = "".join(printed) + out
        assert proc.returncode == 0, out
        assert time.monotonic() - started < 30 and "stopped (0)" in out and f"model '{MODEL}'" in out
        with pytest.raises((urllib.error.URLError, OSError)):
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_an_encoder_serves_embeddings_through_triton_and_the_openai_api_in_its_process(micro_bundle, tmp_path):
    openai = pytest.importorskip("openai")
    from kvforge.serving.server import free_port

    bundle = micro_bundle("bert-micro")
    port = free_port()
    repo = write_repository(bundle.path, tmp_path / "repo", model_name="bert", openai_port=port)
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0) as server, runtime.load(bundle.path) as session:
        expected = session.embed(["the cat sat"], normalize=True)[0]
        req = urllib.request.Request(server.url("/v2/models/bert/generate"), data=json.dumps({"text_input": "the cat sat"}).encode())
        got = json.loads(urllib.request.urlopen(req, timeout=60).read())["embedding"]
        np.testing.assert_allclose(got, expected, atol=1e-6)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
        out = client.embeddings.create(model="bert", input=["the cat sat"])
        np.testing.assert_allclose(out.data[0].embedding, expected, atol=1e-6)
