"""The OpenAI-compatible HTTP front: a Starlette app on uvicorn over a served model's Service.

    GET  /v1/models               the served model
    POST /v1/chat/completions     generating kinds with a chat template (tools, response_format, logprobs, n, SSE)
    POST /v1/completions          generating kinds (a decoder's continuous batch; an encoder-decoder's source)
    POST /v1/embeddings           encoders (mean-pooled, L2-normalized)
    GET  /health                  200 once the model is loaded, 503 before

`kvforge serve` runs it inside the Triton model's process (serving/triton_model.py), over the same Service
and continuous batcher as Triton's generate endpoint; OpenAIServer runs it in a thread of any process (tests,
applications embedding kvforge). Until the model has loaded every /v1 request gets 503. With an API key,
requests must carry `Authorization: Bearer KEY` (compared in constant time) or get 401.

Streaming answers are server-sent events: one `data: {chunk}` per token batch, then `data: [DONE]`. A client
that goes away cancels its requests in the batcher (a stream: at its next send; a plain request: within
DISCONNECT_POLL_S).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import threading
import time
from typing import Any, Callable

from kvforge.errors import KvforgeError, MissingDependencyError

from .openai_api import (ApiError, Choice, chat_job, chunk, completion_job, delta_choice, embedding_job,
                         embedding_response, final_message, response, usage)

DISCONNECT_POLL_S = 0.25
INSTALL = "Install the serve extra: `pip install -e '.[serve]'` (starlette and uvicorn serve the OpenAI API)."


def _starlette():
    try:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route
    except ImportError as e:
        raise MissingDependencyError("starlette (the OpenAI API's web framework)", INSTALL) from e
    return Starlette, Request, JSONResponse, StreamingResponse, Route


def _pump(handle, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int) -> None:
    """Move a runner request's TokenEvents onto the event loop's queue (a thread per request)."""
    try:
        for event in handle:
            loop.call_soon_threadsafe(queue.put_nowait, (index, event, None))
        loop.call_soon_threadsafe(queue.put_nowait, (index, None, None))
    except BaseException as e:  # noqa: BLE001 - the request's error goes to its client
        loop.call_soon_threadsafe(queue.put_nowait, (index, None, e))


class Generation:
    """A job's n requests in the runner, their events merged onto one asyncio queue."""

    def __init__(self, service, job):
        self.job = job
        self.service = service
        self.handles = []
        try:
            for config in job.configs:
                self.handles.append(service.submit(job.prompt, config, images=job.images))
        except BaseException:
            self.cancel()  # the choices already submitted do not run for nobody
            raise
        tokenizer = getattr(service.session, "tokenizer", None)
        self.choices = [Choice(i, job, tokenizer) for i in range(len(self.handles))]
        self.queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for i, h in enumerate(self.handles):
            threading.Thread(target=_pump, args=(h, loop, self.queue, i), daemon=True,
                             name=f"kvforge-openai-{h.id}").start()
        self.open = len(self.handles)

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()

    async def events(self):
        """(choice, released text, ended) per token, until every choice has ended."""
        ended = set()
        while self.open:
            index, event, error = await self.queue.get()
            if error is not None:
                self.cancel()
                raise error
            if event is None:
                self.open -= 1
                if index not in ended:  # cancelled before its last token (the client left)
                    ended.add(index)
                    choice = self.choices[index]
                    choice.finish = choice.finish or "stop"
                    self.service.finished("cancelled", choice.tokens)
                    yield choice, "", True
                continue
            if index in ended:
                continue
            choice = self.choices[index]
            text, done = choice.push(event)
            if done:
                ended.add(index)
                self.service.finished(choice.finish, choice.tokens)
                self.handles[index].cancel()  # a stop string: the runner lets the row go
            yield choice, text, done


def create_app(get_service: Callable[[], Any], model_name: str, api_key: str | None = None):
    """The ASGI app. get_service() -> the Service, or None while the model loads (503)."""
    Starlette, Request, JSONResponse, StreamingResponse, Route = _starlette()

    def error(e: ApiError) -> Any:
        return JSONResponse(e.body(), status_code=e.status)

    def authorized(request) -> bool:
        if api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())

    def service_or_error(request):
        if not authorized(request):
            raise ApiError("invalid API key: send 'Authorization: Bearer <key>' with the key this server was started with",
                           401, code="invalid_api_key")
        service = get_service()
        if service is None:
            raise ApiError(f"{model_name} is loading; retry shortly", 503)
        return service

    async def body_of(request) -> Any:
        try:
            return json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(f"the request body is not JSON: {e}") from None
        except RecursionError:  # Python's parser gives up on arrays or objects nested thousands deep
            raise ApiError("the request body is JSON nested too deeply to read") from None

    def endpoint(handler):
        async def wrapped(request):
            try:
                return await handler(request)
            except ApiError as e:
                return error(e)
            except KvforgeError as e:
                return error(ApiError(str(e)))
            except Exception as e:  # noqa: BLE001 - the server goes on; the client learns what happened
                return error(ApiError(f"internal error: {type(e).__name__}: {e}", 500))
        return wrapped

    async def models(request):
        service = service_or_error(request)
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "kvforge", "kind": service.kind.name,
             **({"parent": model_name} if name != model_name else {})}
            for name in service.served_models(model_name)]})

    async def health(request):
        return JSONResponse({"status": "ok" if get_service() is not None else "loading"},
                            status_code=200 if get_service() is not None else 503)

    def generating(service):
        if not service.generates:
            raise ApiError(f"{model_name} is {service.kind.article}: it does not generate text (it serves /v1/embeddings)")

    async def generate(request, make_job):
        service = service_or_error(request)
        body = await body_of(request)
        generating(service)
        job = make_job(body, service, service.served_models(model_name))
        try:
            gen = Generation(service, job)
        except KvforgeError as e:
            raise ApiError(str(e)) from None
        if job.stream:
            return StreamingResponse(_sse(gen), media_type="text/event-stream")
        return await _whole(request, gen)

    async def chat(request):
        return await generate(request, chat_job)

    async def completions(request):
        return await generate(request, completion_job)

    async def embeddings(request):
        service = service_or_error(request)
        body = await body_of(request)
        if not service.embeds:
            raise ApiError(f"{model_name} is {service.kind.article}: it generates text (/v1/completions); embeddings "
                           "come from encoder bundles")
        job = embedding_job(body, service, [model_name])
        vectors, tokens = await asyncio.to_thread(service.embed, job.texts or job.ids)
        if job.dimensions is not None and job.dimensions != vectors.shape[1]:
            raise ApiError(f"'dimensions' {job.dimensions}: this model's embeddings have {vectors.shape[1]} "
                           "(shortening is not supported)", param="dimensions")
        return JSONResponse(embedding_response(job, vectors, tokens))

    async def not_found(request, exc):
        return error(ApiError(f"no route {request.method} {request.url.path}; the API is under /v1", 404,
                              code="not_found"))

    async def wrong_method(request, exc):
        allowed = next((r.methods for r in routes if r.path == request.url.path), set()) - {"HEAD"}
        return error(ApiError(f"{request.url.path} takes {' or '.join(sorted(allowed))}, not {request.method}", 405,
                              code="method_not_allowed"))

    created = int(time.time())
    routes = [Route("/v1/models", endpoint(models), methods=["GET"]),
              Route("/v1/chat/completions", endpoint(chat), methods=["POST"]),
              Route("/v1/completions", endpoint(completions), methods=["POST"]),
              Route("/v1/embeddings", endpoint(embeddings), methods=["POST"]),
              Route("/health", health, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: wrong_method})


async def _whole(request, gen: Generation):
    """Wait for every choice (cancelling them if the client goes away) and answer with the whole response."""
    from starlette.responses import JSONResponse

    events = gen.events().__aiter__()
    while True:
        task = asyncio.ensure_future(events.__anext__())
        while not task.done():
            await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                gen.cancel()
        try:
            task.result()
        except StopAsyncIteration:
            break
        except KvforgeError as e:
            raise ApiError(str(e), 500) from None
    return JSONResponse(response(gen.job, gen.choices))


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse(gen: Generation):
    """The stream: a first chunk (chat: the role), deltas, the finish, usage when asked, then [DONE]. A tool-call
    reply is held back and sent as one delta at the end (its text must be parsed whole)."""
    job = gen.job
    sent_logprobs = [0] * len(gen.choices)
    held = bool(job.chat and job.tools)
    try:
        if job.chat:
            yield _data(chunk(job, [delta_choice(job, c, "", 0, first=True) for c in gen.choices]))
        async for choice, text, done in gen.events():
            if held and not done:
                continue
            if held:
                message, finish = final_message(choice)
                extra = {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]} \
                    if "tool_calls" in message else {}
                out = delta_choice(job, choice, message["content"] or "", sent_logprobs[choice.index], finish,
                                   extra=extra)
            else:
                finish = (choice.finish or "length") if done else None
                out = delta_choice(job, choice, text, sent_logprobs[choice.index], finish)
            sent_logprobs[choice.index] = len(choice.logprobs)
            if text or done or held or (out["logprobs"] and (out["logprobs"].get("content") or out["logprobs"].get("tokens"))):
                yield _data(chunk(job, [out]))
        if job.include_usage:
            yield _data(chunk(job, [], usage(len(job.prompt), sum(c.tokens for c in gen.choices))))
    except KvforgeError as e:
        yield _data(ApiError(f"generation failed: {e}", 500).body())
    finally:  # the client went away (the task is cancelled) or the stream ended: nothing keeps generating
        gen.cancel()
    yield "data: [DONE]\n\n"


class OpenAIServer:
    """uvicorn serving create_app(...) on a thread of this process; stop() shuts it down.

    reuse_port: several processes (Triton model instances) may listen on one port; the kernel spreads the
    connections between them."""

    def __init__(self, get_service: Callable[[], Any], model_name: str, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, reuse_port: bool = False):
        try:
            import uvicorn
        except ImportError as e:
            raise MissingDependencyError("uvicorn (serves the OpenAI API)", INSTALL) from e
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise KvforgeError(f"the OpenAI API cannot listen on {host}:{port}: {e.strerror}") from e
        self.sock.listen(128)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(create_app(get_service, model_name, api_key), log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="kvforge-openai")

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self, timeout_s: float = 30) -> OpenAIServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise KvforgeError(f"the OpenAI API did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(10)
        self.sock.close()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
