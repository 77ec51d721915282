"""The Triton Python-backend model that serves a kvforge bundle (the repository's model.py imports it).

Decoupled: execute() hands each request to a continuous batcher (kvforge.runtime.Batcher)
and returns at once; a thread per request sends its responses. With `stream` true a
response goes out per token (text_output: the new text, token_ids: the new token);
otherwise one response holds the whole completion (what Triton's non-streaming
generate endpoint requires). A request the model refuses gets an INVALID_ARG error
(HTTP 400) that names the field. A client that goes away (a closed stream, a
cancelled gRPC call) is noticed within POLL_S and its row leaves the batch.

Custom metrics on the server's metrics endpoint: kvforge_batch_rows (rows in the
running batch, and prompts being prefilled), kvforge_waiting_requests,
kvforge_generated_tokens_total, kvforge_requests_total{finish_reason}, and the
prefix cache's kvforge_prefix_cache_hit_tokens_total (prompt tokens restored
instead of prefilled), kvforge_prefix_cache_blocks (blocks held) and
kvforge_prefix_cache_pinned_blocks (blocks running rows restored from: 0 once
they have all left), and speculative decoding's kvforge_speculative_steps_total
(verification steps), kvforge_speculative_drafted_tokens_total and
kvforge_speculative_accepted_tokens_total (accepted / drafted is the acceptance
rate; (accepted + steps) / steps the tokens per step).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from kvforge import runtime
from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError

from .kinds import Service
from .openai_app import OpenAIServer
from .requests import INPUTS, StopText, parse, parse_text

API_KEY_ENV = "KVFORGE_API_KEY"  # the OpenAI front's key comes from the environment, never from config.pbtxt
POLL_S = 0.1  # how often cancellations and the metrics are looked at
# Every call into Triton (a sender's send or is_cancelled, a metric's increment or set) goes through the stub's
# shared-memory allocator, which takes no lock of its own: two threads in it at once corrupt the heap the server
# also reads (tritonserver then dies with SIGSEGV or a boost lock_exception, or the model spins). So every such
# call is made holding the model's lock (`self.lock`), from whichever thread.
# The batcher's thread must get the interpreter back as soon as a step's kernels return, not after Python's
# default 5 ms switch interval spent in the threads that send responses (a decode step is 8-25 ms here).
SWITCH_S = 0.0005


class TritonPythonModel:
    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils
        sys.setswitchinterval(SWITCH_S)
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        bundle = Path(args["model_repository"]) / args["model_version"] / "bundle"
        self.service = None  # the OpenAI front answers 503 until it is set
        self.openai = None
        if params.get("openai_port"):  # up before the model loads: clients learn it is loading
            key = os.environ.get(API_KEY_ENV) or None
            self.openai = OpenAIServer(lambda: self.service, args["model_name"], params.get("openai_host", "127.0.0.1"),
                                       int(params["openai_port"]), api_key=key, reuse_port=True).start()
        session = runtime.load(bundle, backend=params.get("backend", "auto")).activate()
        self.service = Service(session, Bundle(bundle).kind, runtime.BatchOptions.from_params(params))
        self.session = session
        self.live: dict[int, tuple] = {}  # runner request id -> (request, response sender)
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self._metrics()
        self.service.on_finish = self._finished
        self.watcher = threading.Thread(target=self._watch, name="kvforge-watch", daemon=True)
        self.watcher.start()

    def _metrics(self):
        family = self.pb.MetricFamily
        # the families must outlive their metrics (Triton refuses a metric whose family is gone)
        self.families = {
            "rows": family(name="kvforge_batch_rows", description="Rows in the running continuous batch", kind=family.GAUGE),
            "waiting": family(name="kvforge_waiting_requests", description="Requests waiting for a row or cache tokens",
                              kind=family.GAUGE),
            "tokens": family(name="kvforge_generated_tokens_total", description="Tokens generated", kind=family.COUNTER),
            "finish": family(name="kvforge_requests_total", description="Finished requests by finish reason",
                             kind=family.COUNTER),
            "hit": family(name="kvforge_prefix_cache_hit_tokens_total", description="Prompt tokens restored from the "
                          "prefix cache instead of prefilled", kind=family.COUNTER),
            "blocks": family(name="kvforge_prefix_cache_blocks", description="Blocks of prompt KV in the prefix cache",
                             kind=family.GAUGE),
            "pinned": family(name="kvforge_prefix_cache_pinned_blocks", description="Prefix-cache blocks that running "
                             "rows restored from", kind=family.GAUGE),
            "steps": family(name="kvforge_speculative_steps_total", description="Speculative decoding's verification "
                            "steps", kind=family.COUNTER),
            "drafted": family(name="kvforge_speculative_drafted_tokens_total", description="Tokens drafted for "
                              "speculative decoding", kind=family.COUNTER),
            "accepted": family(name="kvforge_speculative_accepted_tokens_total", description="Drafted tokens the "
                               "model accepted", kind=family.COUNTER),
        }
        self.rows_metric = self.families["rows"].Metric(labels={})
        self.waiting_metric = self.families["waiting"].Metric(labels={})
        self.tokens_metric = self.families["tokens"].Metric(labels={})
        self.prefix_metrics = {name: self.families[name].Metric(labels={}) for name in ("hit", "blocks", "pinned")}
        self.hit_tokens = 0  # the prefix cache's count last put in the counter
        self.spec_metrics = {name: self.families[name].Metric(labels={}) for name in ("steps", "drafted", "accepted")}
        self.spec_counted = dict.fromkeys(self.spec_metrics, 0)  # the batcher's counts last put in the counters
        self.finish_metrics: dict[str, object] = {}

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                if not self.service.generates:
                    self._embed(request, sender)
                    continue
                job = parse({name: self._input(request, name) for name in INPUTS}, self.service)
                handle = self.service.submit(job.prompt, job.config)
            except KvforgeError as e:  # a bad request, or one that can never fit the batcher's budget
                self._fail(sender, str(e), self.pb.TritonError.INVALID_ARG)
                continue
            except Exception as e:  # noqa: BLE001 - anything else still answers the client
                self._fail(sender, f"{type(e).__name__}: {e}", self.pb.TritonError.INTERNAL)
                continue
            with self.lock:
                self.live[handle.id] = (handle, sender)
            threading.Thread(target=self._respond, args=(handle, sender, job), daemon=True).start()
        return None

    def _embed(self, request, sender) -> None:
        """An embedding model's answer: the text's vector (serving/kinds.py), in one final response."""
        text = parse_text(self._input(request, "text_input"))
        vectors, _ = self.service.embed([text])
        response = self.pb.InferenceResponse(output_tensors=[self.pb.Tensor("embedding", vectors[0].astype(np.float32))])
        with self.lock:
            sender.send(response, flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _input(self, request, name):
        tensor = self.pb.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def _fail(self, sender, message: str, code) -> None:
        with self.lock:
            sender.send(self.pb.InferenceResponse(error=self.pb.TritonError(message, code)),
                        flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _response(self, text: str, tokens: list[int], finish: str | None):
        pb = self.pb
        tensors = [pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
                   pb.Tensor("token_ids", np.array(tokens, dtype=np.int64))]
        if finish:  # the last response only: less to carry per streamed token
            tensors.append(pb.Tensor("finish_reason", np.array([finish.encode()], dtype=np.object_)))
        return pb.InferenceResponse(output_tensors=tensors)

    def _send(self, handle, sender, response, final: bool) -> None:
        """Send unless the client has gone; the final flag is sent whatever happens, and takes the request off the
        watch list first (Triton frees a sender once its final flag is out: asking it anything after that crashes
        the server)."""
        flag = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        with self.lock:  # one thread at a time talks to the senders (the watcher asks them too)
            if not final:  # asking is_cancelled() is a round trip to the server: per token, the watcher asks instead
                try:
                    sender.send(response)
                except Exception:  # noqa: BLE001 - the client is gone: stop generating for it
                    handle.cancel()
                return
            self.live.pop(handle.id, None)
            try:
                if not sender.is_cancelled():
                    sender.send(response, flags=flag)
                    return
            except Exception:  # noqa: BLE001
                pass
            sender.send(flags=flag)  # nobody to answer, but Triton holds the request (and the model) until it is closed

    def _respond(self, handle, sender, job) -> None:
        stops = StopText(job.stop)
        tokens: list[int] = []
        finish = None
        try:
            last_text, last_tokens = "", []  # what the final streamed event carries
            for event in handle:
                tokens.append(event.token)
                text, stopped = stops.push(event.text, event.last)
                finish = "stop" if stopped else event.finish_reason
                if stopped:
                    handle.cancel()
                if stopped or event.last:
                    last_text, last_tokens = text, [event.token]
                    break
                if job.stream:
                    self._send(handle, sender, self._response(text, [event.token], None), False)
            else:  # ended without a last token: cancelled (the client went away) or nothing asked for
                finish = handle.result().finish_reason
            # counted before the final response goes out: a client that has its answer sees it in the metrics
            self.service.finished(finish or "length", len(tokens))
            final = (self._response(last_text, last_tokens, finish) if job.stream
                     else self._response(stops.text[:stops.released], tokens, finish))
            self._send(handle, sender, final, True)
        except Exception as e:  # noqa: BLE001 - the error goes to this client; the model goes on
            error = self.pb.InferenceResponse(error=self.pb.TritonError(f"generation failed: {e}", self.pb.TritonError.INTERNAL))
            if handle.id in self.live:
                self._send(handle, sender, error, True)
            self.service.finished("error", 0)

    def _finished(self, reason: str, tokens: int) -> None:
        """Every endpoint's finished request (Triton's and the OpenAI front's) in the metrics."""
        with self.lock:
            if tokens:
                self.tokens_metric.increment(tokens)
            if reason not in self.finish_metrics:
                self.finish_metrics[reason] = self.families["finish"].Metric(labels={"finish_reason": reason})
            self.finish_metrics[reason].increment(1)

    def _watch(self) -> None:
        while not self.closing.wait(POLL_S):
            with self.lock:  # a sender in `live` has not sent its final response yet
                for handle, sender in self.live.values():
                    if sender.is_cancelled():
                        handle.cancel()
                self.rows_metric.set(self.service.running)
                self.waiting_metric.set(self.service.waiting)
                cache = self.service.prefix_cache
                if cache is not None:
                    stats = cache.stats
                    self.prefix_metrics["hit"].increment(stats.hit_tokens - self.hit_tokens)
                    self.hit_tokens = stats.hit_tokens
                    self.prefix_metrics["blocks"].set(stats.cached_blocks)
                    self.prefix_metrics["pinned"].set(cache.pinned())
                spec = self.service.speculation
                if spec is not None:
                    for name, metric in self.spec_metrics.items():
                        now = getattr(spec, name)
                        if now > self.spec_counted[name]:
                            metric.increment(now - self.spec_counted[name])
                            self.spec_counted[name] = now

    def finalize(self):
        self.closing.set()
        if self.openai is not None:
            self.openai.stop()
        self.service.close()
        self.watcher.join(5)
        deadline = time.monotonic() + 5
        while self.live and time.monotonic() < deadline:  # let the response threads send their last words
            time.sleep(POLL_S)
        self.session.deactivate()
        self.rows_metric = self.waiting_metric = self.tokens_metric = None  # metrics go before their families
        self.prefix_metrics.clear()
        self.spec_metrics.clear()
        self.finish_metrics.clear()
        self.families.clear()

