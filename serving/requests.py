"""Triton generate-extension requests: their inputs, checked, as a prompt and a GenerationConfig.

Kept free of Triton so that what a request may say is tested on its own; the
Python-backend model (triton_model.py) only moves tensors in and out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvforge.errors import KvforgeError
from kvforge.runtime import GenerationConfig

if TYPE_CHECKING:  # pragma: no cover
    from .kinds import Service

DEFAULT_MAX_TOKENS = 16  # as vLLM's and OpenAI's completions

# name -> (Triton data type, dims): the generate extension's names (those of the vLLM and TensorRT-LLM backends)
INPUTS = {
    "text_input": ("TYPE_STRING", [1]),
    "max_tokens": ("TYPE_INT32", [1]),
    "temperature": ("TYPE_FP32", [1]),
    "top_p": ("TYPE_FP32", [1]),
    "top_k": ("TYPE_INT32", [1]),
    "repetition_penalty": ("TYPE_FP32", [1]),
    "seed": ("TYPE_INT64", [1]),
    "stop": ("TYPE_STRING", [-1]),
    "stream": ("TYPE_BOOL", [1]),
    "ignore_eos": ("TYPE_BOOL", [1]),  # as vLLM's sampling parameter: a fixed length (benchmarks)
    "speculative": ("TYPE_STRING", [1]),  # "prompt-lookup" or "none": overrides the server's --speculative
    "adapter": ("TYPE_STRING", [1]),  # a LoRA adapter of the bundle by name (kvforge lora add)
}
CLIENT_SPECULATION = ("prompt-lookup", "none")  # what a request may ask for itself: nothing that opens a file
OUTPUTS = {
    "text_output": ("TYPE_STRING", [1]),
    "token_ids": ("TYPE_INT64", [-1]),
    "finish_reason": ("TYPE_STRING", [1]),
}


class BadRequest(KvforgeError):
    """A request the model refuses (Triton answers it with 400)."""


@dataclass
class Job:
    prompt: list[int]
    config: object  # runtime.GenerationConfig
    stream: bool
    stop: list[str]


def _scalar(inputs: dict, name: str, kind, default):
    value = inputs.get(name)
    if value is None:
        return default
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise BadRequest(f"{name} takes one value, got {flat.size}")
    v = flat[0]
    if kind is str:
        return v.decode("utf-8", errors="strict") if isinstance(v, bytes) else str(v)
    return kind(v)


def parse_text(value) -> str:
    """text_input: one non-empty UTF-8 string."""
    try:
        text = _scalar({"text_input": value}, "text_input", str, None)
    except UnicodeDecodeError:
        raise BadRequest("text_input is not valid UTF-8") from None
    if not text:
        raise BadRequest("text_input is required: the prompt, a non-empty string")
    return text


def parse(inputs: dict, service: Service) -> Job:
    """The request's inputs (name -> numpy array; absent ones missing) -> a Job, or BadRequest naming the field."""

    prompt = service.encode(parse_text(inputs.get("text_input")))
    if not prompt:
        raise BadRequest("text_input encodes to no tokens")
    room = service.room(len(prompt))
    if room <= 0:
        raise BadRequest(f"text_input is {len(prompt)} tokens; {service.limit}, which leaves no room to generate")
    max_tokens = _scalar(inputs, "max_tokens", int, None)
    if max_tokens is not None and max_tokens <= 0:
        raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}")
    if max_tokens is not None and max_tokens > room:
        raise BadRequest(f"max_tokens {max_tokens} goes beyond the context: the prompt is {len(prompt)} tokens and "
                         f"{service.limit}, so at most {room} can follow it")
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    options = dict(max_new_tokens=max_tokens,
                   temperature=_scalar(inputs, "temperature", float, 0.0),
                   top_p=_scalar(inputs, "top_p", float, 1.0),
                   top_k=_scalar(inputs, "top_k", int, 0),
                   repetition_penalty=_scalar(inputs, "repetition_penalty", float, 1.0),
                   seed=_scalar(inputs, "seed", int, None),
                   ignore_eos=bool(_scalar(inputs, "ignore_eos", bool, False)),
                   speculative=_scalar(inputs, "speculative", str, None),
                   adapter=_scalar(inputs, "adapter", str, None))
    if options["speculative"] not in (None, *CLIENT_SPECULATION):
        raise BadRequest(f"speculative takes {' or '.join(map(repr, CLIENT_SPECULATION))}, got "
                         f"{options['speculative']!r} (a draft model is the server's --speculative)")
    try:
        config = GenerationConfig(**options)
    except KvforgeError as e:
        raise BadRequest(str(e)) from None
    stop = inputs.get("stop")
    stops = [] if stop is None else [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in np.asarray(stop).reshape(-1)]
    if any(not s for s in stops):
        raise BadRequest("stop strings must not be empty")
    return Job(prompt, config, bool(_scalar(inputs, "stream", bool, False)), stops)


class StopText:
    """Text released as it is generated, held back while it could be the start of a stop string.

    push(delta) -> (text to release now, whether a stop string has appeared); the released text never
    includes the stop string (as OpenAI's and vLLM's completions).
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.text = ""
        self.released = 0

    def push(self, delta: str, last: bool = False) -> tuple[str, bool]:
        self.text += delta
        hits = [i for i in (self.text.find(s, max(0, self.released - len(s) + 1)) for s in self.stops) if i >= 0]
        if hits:
            end, stopped = min(hits), True
        else:
            hold = 0 if last else max((k for s in self.stops for k in range(1, len(s))
                                       if self.text.endswith(s[:k])), default=0)
            end, stopped = len(self.text) - hold, False
        out = self.text[self.released:end]
        self.released = max(self.released, end)
        return out, stopped

# an embedding model's Triton inputs and outputs (the same text_input; a vector back)
EMBEDDING_INPUTS = {"text_input": ("TYPE_STRING", [1])}
EMBEDDING_OUTPUTS = {"embedding": ("TYPE_FP32", [-1])}
