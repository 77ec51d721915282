"""OpenAI's API over a served bundle: requests checked into jobs, and results shaped as OpenAI's objects.

Kept free of HTTP: openai_app.py serves it. What a request may say follows OpenAI's reference (and vLLM's
extensions `top_k`, `repetition_penalty`, `ignore_eos`, and kvforge's `speculative`: "prompt-lookup" or "none",
overriding the server's --speculative); a field OpenAI defines that kvforge does not implement
(`logit_bias`, non-zero `presence_penalty`/`frequency_penalty`, `echo`, `suffix`, `best_of` > 1, an
`encoding_format` other than float/base64) and any unknown field is refused by name with a 400, never ignored
silently. Errors carry OpenAI's error object and the HTTP status its client maps to an exception class.
"""

from __future__ import annotations

import base64
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvforge.chat import split_images
from kvforge.checks import is_int, is_number
from kvforge.errors import KvforgeError
from kvforge.images import load_image
from kvforge.runtime import GenerationConfig
from kvforge.runtime.generate import MAX_TOP_LOGPROBS

from .requests import CLIENT_SPECULATION, StopText
from .tools import (check_chat_messages, check_tool_choice, check_tools, parse_tool_calls, render_chat, tool_constraint,
                    tool_format)

MAX_N = 4
MAX_STOP = 4
COMPLETIONS_MAX_LOGPROBS = 5
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's /v1/completions default; chat defaults to what the context leaves
# fields clients send that change nothing here (OpenAI's bookkeeping, or parallel_tool_calls: one call per turn)
IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls"}
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "logprobs",
          "response_format", "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "repetition_penalty",
          "ignore_eos", "speculative"} | IGNORED
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "tool_parser"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "suffix", "best_of"}
EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "user"}


class ApiError(KvforgeError):
    """A request the API refuses: OpenAI's error object and the HTTP status that goes with it."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                             503: "service_unavailable"}.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def _finite(v) -> bool:
    """A JSON number that is not NaN or infinite (Python's json reads both)."""
    return is_number(v) and bool(np.isfinite(v))


def _field(body: dict, name: str, check, what: str, default=None):
    """body[name] (or default when absent or null), refused with a 400 naming the field unless check(value)."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise ApiError(f"'{name}' must be {what}, got {value!r:.80}", param=name)
    return value


def check_fields(body: Any, allowed: set[str], endpoint: str) -> dict:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(f"{endpoint} does not take {', '.join(map(repr, unknown))}; it takes {sorted(allowed - IGNORED)}",
                       param=unknown[0])
    return body


def check_model(body: dict, served: list[str]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("'model' is required: the name of a served model (GET /v1/models lists them)", param="model")
    if model not in served:
        raise ApiError(f"the model {model!r} does not exist here; this server serves {served}", 404, param="model",
                       code="model_not_found")
    return model


@dataclass
class Job:
    """One request, checked: its prompt ids, one GenerationConfig per choice, and how to answer."""

    chat: bool
    model: str
    prompt: list[int]
    configs: list[GenerationConfig]
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # top alternatives per token (None: no logprobs)
    tools: list[dict] | None = None
    tool_format: Any = None
    id: str = field(default_factory=lambda: "")
    images: list[Any] = field(default_factory=list)  # a vision-language prompt's images (read from data URLs), in order
    created: int = field(default_factory=lambda: int(time.time()))


def _sampling(body: dict) -> dict[str, Any]:
    for name in ("presence_penalty", "frequency_penalty"):
        if _field(body, name, _finite, "a number", 0) != 0:
            raise ApiError(f"'{name}' is not supported (only 0); kvforge offers 'repetition_penalty' (> 1 discourages "
                           "tokens already in the sequence)", param=name)
    if body.get("logit_bias"):
        raise ApiError("'logit_bias' is not supported", param="logit_bias")
    temperature = _field(body, "temperature", lambda v: _finite(v) and 0 <= v <= 2, "a number in [0, 2]", 1.0)
    top_k = _field(body, "top_k", lambda v: is_int(v) and v >= -1, "an int >= 0 (-1 or 0: no limit)", 0)
    return dict(temperature=float(temperature),
                top_p=float(_field(body, "top_p", lambda v: _finite(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)),
                top_k=max(top_k, 0),
                repetition_penalty=float(_field(body, "repetition_penalty", lambda v: _finite(v) and v > 0,
                                                "a number > 0", 1.0)),
                ignore_eos=_field(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false", False),
                speculative=_field(body, "speculative", lambda v: v in CLIENT_SPECULATION, " or ".join(
                    map(repr, CLIENT_SPECULATION)) + " (a draft model is the server's --speculative)", None))


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise ApiError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them", param="stop")
    return stops


def _max_tokens(body: dict, names: tuple[str, ...], prompt: int, service, default: int | None) -> int:
    given = [(n, body[n]) for n in names if body.get(n) is not None]
    for name, value in given:
        if not is_int(value) or value < 1:
            raise ApiError(f"'{name}' must be an int >= 1, got {value!r}", param=name)
    room = service.room(prompt)
    if room <= 0:
        raise ApiError(f"{service.limit}, and the prompt is {prompt} tokens: no room to generate",
                       param="messages" if "max_completion_tokens" in names else "prompt", code="context_length_exceeded")
    if given:
        name, value = given[0]
        if value > room:
            raise ApiError(f"{service.limit}; the prompt is {prompt} tokens and '{name}' asks for {value}, so at most "
                           f"{room} can follow it", param=name, code="context_length_exceeded")
        return value
    return room if default is None else min(default, room)


def adapter_of(model: str, served: list[str]) -> str | None:
    """The LoRA adapter a served model name selects: `base:adapter` (served[0] is the base model's name)."""
    return model[len(served[0]) + 1:] if model != served[0] else None


def _configs(body: dict, max_tokens: int, response_format: dict | None, logprobs: int | None,
             adapter: str | None = None) -> list[GenerationConfig]:
    n = _field(body, "n", lambda v: is_int(v) and 1 <= v <= MAX_N, f"an int in 1..{MAX_N}", 1)
    seed = _field(body, "seed", lambda v: is_int(v) and v >= 0, "an int >= 0", None)
    options = dict(max_new_tokens=max_tokens, adapter=adapter, **_sampling(body))
    try:
        GenerationConfig(**options)
    except KvforgeError as e:
        raise ApiError(str(e)) from None
    try:
        # choice i samples with seed + i: a seeded request is reproducible and its n choices differ
        return [GenerationConfig(seed=None if seed is None else seed + i, response_format=response_format,
                                 logprobs=logprobs, **options) for i in range(n)]
    except KvforgeError as e:  # the options passed above: what is wrong is the format
        raise ApiError(str(e), param="response_format") from None


def _response_format(body: dict) -> dict | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ApiError("'response_format' must be an object with a 'type' (text, json_object, json_schema)",
                       param="response_format")
    return None if fmt["type"] == "text" else fmt


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _field(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    options = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    if options and not stream:
        raise ApiError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise ApiError(f"stream_options takes 'include_usage', not {unknown}", param="stream_options")
    return stream, bool(options.get("include_usage", False))


def chat_job(body: Any, service, served: list[str]) -> Job:
    """A /v1/chat/completions request -> a Job (ApiError naming the field otherwise)."""
    body = check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    model = check_model(body, served)
    images: list[Any] = []
    if service.images:  # a vision-language model: its template takes the messages' image parts
        template_messages, images = _image_messages(body)
    try:  # the conversation's shape first: it is wrong whatever the model
        if not service.images:
            check_chat_messages(body.get("messages"))
    except KvforgeError as e:
        raise ApiError(str(e), param="messages") from None
    session = service.session
    if session.tokenizer is None or session.tokenizer.chat_template is None:
        raise ApiError(f"{model} has no chat template (its checkpoint's tokenizer_config.json or GGUF file names none): "
                       "use /v1/completions with a prompt", param="messages")
    try:
        tools = check_tools(body.get("tools"))
    except KvforgeError as e:
        raise ApiError(str(e), param="tools") from None
    try:
        tool_choice = check_tool_choice(body.get("tool_choice"), tools)
    except KvforgeError as e:
        raise ApiError(str(e), param="tool_choice") from None
    parser = _field(body, "tool_parser", lambda v: isinstance(v, str), "a tool-call format name", None)
    try:
        fmt = tool_format(session.tokenizer, parser) if tools else None
    except KvforgeError as e:
        raise ApiError(str(e), param="tool_parser") from None
    try:
        if service.images:
            prompt = service.encode(session.tokenizer.render_chat(template_messages, True), add_special_tokens=False)
        else:
            prompt = render_chat(session.tokenizer, body.get("messages"), tools=tools, tool_choice=tool_choice,
                                 tool_parser=parser)
    except KvforgeError as e:
        raise ApiError(str(e), param="messages") from None
    forced = tool_constraint(tools, tool_choice, fmt) if tools else None
    if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
        raise ApiError("'logprobs' must be true or false", param="logprobs")
    top = _field(body, "top_logprobs", lambda v: is_int(v) and 0 <= v <= MAX_TOP_LOGPROBS,
                 f"an int in 0..{MAX_TOP_LOGPROBS}", None)
    if top is not None and not body.get("logprobs"):
        raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    logprobs = (top or 0) if body.get("logprobs") else None
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), len(prompt), service, None)
    stream, usage = _stream(body)
    fmt_given = _response_format(body)
    if forced is not None and fmt_given is not None:
        raise ApiError("'response_format' and a forced tool call ('tool_choice' required or a named function) "
                       "cannot both constrain the reply", param="response_format")
    configs = _configs(body, max_tokens, forced or fmt_given, logprobs, adapter_of(model, served))
    return Job(True, model, prompt, configs, stream, usage, _stops(body), logprobs,
               tools if tools and tool_choice != "none" else None, fmt, "chatcmpl-" + secrets.token_hex(12), images=images)


def _image_messages(body: dict) -> tuple[list[dict], list[Any]]:
    """A vision-language chat's messages as its template takes them, and their images: OpenAI image_url parts
    whose url is a data URL (the server reads no files and fetches nothing), each read (so checked) now."""
    if body.get("tools"):
        raise ApiError("tools are not served for vision-language models yet", param="tools")
    try:
        messages, urls = split_images(body.get("messages"))
        for i, m in enumerate(body["messages"]):
            if isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") == "image"
                                                         for p in m["content"]):
                raise KvforgeError(f"messages[{i}] has an 'image' part: send images as image_url parts with a data "
                                   "URL (data:image/png;base64,...)")
        images = []
        for n, url in enumerate(urls):
            if not url.startswith("data:"):
                raise KvforgeError(f"image {n} is not a data URL (data:image/png;base64,...): the server reads no "
                                   "files and fetches nothing")
            images.append(load_image(url))
    except KvforgeError as e:
        raise ApiError(str(e), param="messages") from None
    return messages, images


def completion_job(body: Any, service, served: list[str]) -> Job:
    """A /v1/completions request -> a Job."""
    body = check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    model = check_model(body, served)
    if body.get("echo"):
        raise ApiError("'echo' is not supported", param="echo")
    if body.get("suffix"):
        raise ApiError("'suffix' (insertion) is not supported", param="suffix")
    if _field(body, "best_of", is_int, "an int", 1) != 1:
        raise ApiError("'best_of' other than 1 is not supported (use n)", param="best_of")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list, as clients often send
    if isinstance(prompt, str) and prompt:
        ids = service.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        ids = list(prompt)
        vocab = service.session.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(f"prompt token ids {bad[:8]} are outside the vocabulary (0..{vocab - 1})", param="prompt")
    else:
        raise ApiError("'prompt' must be a non-empty string or a list of token ids (one prompt per request)",
                       param="prompt")
    if not ids:
        raise ApiError("the prompt encodes to no tokens", param="prompt")
    logprobs = _field(body, "logprobs", lambda v: is_int(v) and 0 <= v <= COMPLETIONS_MAX_LOGPROBS,
                      f"an int in 0..{COMPLETIONS_MAX_LOGPROBS}", None)
    max_tokens = _max_tokens(body, ("max_tokens",), len(ids), service, DEFAULT_COMPLETION_TOKENS)
    stream, usage = _stream(body)
    configs = _configs(body, max_tokens, _response_format(body), logprobs, adapter_of(model, served))
    return Job(False, model, ids, configs, stream, usage, _stops(body), logprobs, id="cmpl-" + secrets.token_hex(12))


# -- answers ------------------------------------------------------------------------------------------------
class Choice:
    """One choice's text as it is generated: stop strings held back and cut, token counts and logprobs kept."""

    def __init__(self, index: int, job: Job, tokenizer):
        self.index = index
        self.job = job
        self.tokenizer = tokenizer
        self.stops = StopText(job.stop)
        self.tokens = 0
        self.finish: str | None = None
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []

    def push(self, event) -> tuple[str, bool]:
        """A TokenEvent -> (text to release, whether the choice has ended)."""
        self.tokens += 1
        if self.job.logprobs is not None:
            self.logprobs.append((event.token, float(event.logprob), list(event.top_logprobs or [])))
        text, stopped = self.stops.push(event.text, event.last)
        if stopped:
            self.finish = "stop"
        elif event.last:
            self.finish = "stop" if event.finish_reason == "stop" else "length"
        return text, self.finish is not None

    @property
    def text(self) -> str:
        return self.stops.text[:self.stops.released]

    def _token(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer is not None else str(token)

    def logprobs_object(self, start: int = 0) -> dict | None:
        if self.job.logprobs is None:
            return None
        rows = self.logprobs[start:]
        if self.job.chat:
            def entry(token, lp):
                text = self._token(token)
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in top]} for t, lp, top in rows]}
        texts = [self._token(t) for t, _, _ in rows]
        offsets = np.cumsum([0] + [len(t) for t in texts[:-1]]).tolist() if texts else []
        return {"tokens": texts, "token_logprobs": [lp for _, lp, _ in rows],
                "top_logprobs": [{self._token(a): b for a, b in top} for _, _, top in rows], "text_offset": offsets}


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def final_message(choice: Choice) -> tuple[dict, str]:
    """The assistant message of a finished chat choice and its finish reason (tool calls parsed out)."""
    job, text = choice.job, choice.text
    if job.tools:
        content, calls = parse_tool_calls(text, job.tool_format, job.tools)
        if calls:
            return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, choice.finish or "length"


def response(job: Job, choices: list[Choice]) -> dict:
    """The whole (non-streamed) answer."""
    out = []
    for c in choices:
        if job.chat:
            message, finish = final_message(c)
            out.append({"index": c.index, "message": message, "finish_reason": finish, "logprobs": c.logprobs_object()})
        else:
            out.append({"index": c.index, "text": c.text, "finish_reason": c.finish or "length",
                        "logprobs": c.logprobs_object()})
    return {"id": job.id, "object": "chat.completion" if job.chat else "text_completion", "created": job.created,
            "model": job.model, "choices": out, "usage": usage(len(job.prompt), sum(c.tokens for c in choices))}


def chunk(job: Job, choices: list[dict], with_usage: dict | None = None) -> dict:
    out = {"id": job.id, "object": "chat.completion.chunk" if job.chat else "text_completion", "created": job.created,
           "model": job.model, "choices": choices}
    if job.include_usage:
        out["usage"] = with_usage
    return out


def delta_choice(job: Job, choice: Choice, text: str, first_logprob: int, finish: str | None = None,
                 first: bool = False, extra: dict | None = None) -> dict:
    """One streamed choice: the new text (chat: a delta, the role in the first one) and the new tokens' logprobs."""
    logprobs = choice.logprobs_object(first_logprob)
    if job.chat:
        delta = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        delta.update(extra or {})
        return {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish}


# -- embeddings ---------------------------------------------------------------------------------------------
@dataclass
class EmbeddingJob:
    model: str
    texts: list[str] | None
    ids: list[list[int]] | None
    base64: bool
    dimensions: int | None  # what the client expects; checked against the model's width


def embedding_job(body: Any, service, served: list[str]) -> EmbeddingJob:
    body = check_fields(body, EMBEDDING_FIELDS, "/v1/embeddings")
    model = check_model(body, served)
    fmt = _field(body, "encoding_format", lambda v: v in ("float", "base64"), "'float' or 'base64'", "float")
    inp = body.get("input")
    texts = ids = None
    if isinstance(inp, str):
        texts = [inp]
    elif isinstance(inp, list) and inp and all(isinstance(t, str) for t in inp):
        texts = inp
    elif isinstance(inp, list) and inp and all(is_int(t) for t in inp):
        ids = [inp]
    elif isinstance(inp, list) and inp and all(isinstance(r, list) and r and all(is_int(t) for t in r) for r in inp):
        ids = inp
    else:
        raise ApiError("'input' must be a string, a list of strings, a list of token ids or a list of those "
                       "(none empty)", param="input")
    if texts is not None and any(not t for t in texts):
        raise ApiError("'input' holds an empty string", param="input")
    if len(texts or ids) > 2048:
        raise ApiError("'input' holds more than 2048 items", param="input")
    dims = _field(body, "dimensions", lambda v: is_int(v) and v >= 1, "an int >= 1", None)
    return EmbeddingJob(model, texts, ids, fmt == "base64", dims)


def embedding_response(job: EmbeddingJob, vectors: np.ndarray, tokens: int) -> dict:
    def encode(v: np.ndarray):
        return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() if job.base64 else v.astype(float).tolist()

    return {"object": "list", "model": job.model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
