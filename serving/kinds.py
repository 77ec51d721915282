"""What the server offers for each model kind (kvforge/kinds.py lists the kinds): one registry, no kind names in code.

    SERVED[kind.name].runner(session, batching)   generation: submit(ids, config) -> Request (batching: BatchOptions)
    SERVED[kind.name].embeds                                         /v1/embeddings (and Triton's `embedding`)

A decoder generates through the continuous batcher (kvforge.runtime.Batcher); an encoder-decoder through a
serial runner (one request at a time: its session has no cache that rows could join); encoders and the Perceiver
answer embeddings: the mean of the last hidden state over the tokens (a Perceiver: over its latents),
L2-normalized as OpenAI's embeddings are. The Triton model and the OpenAI front share one Service per model
instance, so both endpoints feed the same batch.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple

import numpy as np

from kvforge.adapters import list_adapters
from kvforge.errors import KvforgeError
from kvforge.kinds import check_registry
from kvforge.runtime import BatchOptions, Batcher
from kvforge.runtime.serial import SerialRunner

from .requests import EMBEDDING_INPUTS, EMBEDDING_OUTPUTS, INPUTS, OUTPUTS


class ServedKind(NamedTuple):
    runner: Callable[..., Any] | None  # (session, BatchOptions) -> a runner with submit(ids, config)
    embeds: bool
    room: Callable[[Any, int], int]  # (session, prompt tokens) -> how many tokens may follow (<= 0: none)
    limit: str  # how messages state that bound ({context}: the session's max_context)
    triton_io: tuple[dict, dict]  # the Triton model's inputs and outputs (name -> (data type, dims))
    images: bool = False  # requests may carry images (OpenAI image_url parts): the runner's submit takes them


def _batcher(session, batching: BatchOptions):
    return Batcher(session, batching)


def _vision_batcher(session, batching: BatchOptions):
    return session.batcher(batching)


def _serial(session, batching: BatchOptions):
    return SerialRunner(session)


def _shared_context(session, prompt: int) -> int:
    return session.max_context - prompt


def _own_target(session, prompt: int) -> int:
    return session.max_context if prompt <= session.max_context else 0


def _inputs_only(session, prompt: int) -> int:
    return 0


GENERATE_IO = (INPUTS, OUTPUTS)
EMBED_IO = (EMBEDDING_INPUTS, EMBEDDING_OUTPUTS)
SERVED: dict[str, ServedKind] = {
    "decoder": ServedKind(_batcher, False, _shared_context, "the model's context is {context} tokens", GENERATE_IO),
    "encoder-decoder": ServedKind(_serial, False, _own_target,
                                  "the model takes sources and writes targets of up to {context} tokens", GENERATE_IO),
    "encoder": ServedKind(None, True, _inputs_only, "the model reads up to {context} tokens", EMBED_IO),
    "perceiver": ServedKind(None, True, _inputs_only, "the model reads up to {context} tokens", EMBED_IO),
    # the continuous batcher over its decoder, each request with its own images (runtime/vision_session.py)
    "vision-language": ServedKind(_vision_batcher, False, _shared_context, "the model's context is {context} tokens",
                                  GENERATE_IO, images=True),
}
check_registry("serving", SERVED)


class Service:
    """One loaded model as the endpoints see it: its session, its runner (generation) and embeddings."""

    def __init__(self, session, kind, batching: BatchOptions | None = None):
        self.session = session
        self.kind = kind
        served = SERVED[kind.name]
        self.runner = served.runner(session, batching or BatchOptions()) if served.runner else None
        self.embeds = served.embeds
        self._served = served
        self._lock = threading.Lock()
        self.on_finish: Callable[[str, int], None] | None = None  # (finish reason, tokens): the server's metrics

    def finished(self, reason: str, tokens: int) -> None:
        """A request ended (every endpoint reports here, so the metrics count them all)."""
        if self.on_finish is not None:
            self.on_finish(reason, tokens)

    @property
    def max_context(self) -> int:
        return getattr(self.session, "max_context", None) or self.session.max_length

    @property
    def limit(self) -> str:
        return self._served.limit.format(context=self.max_context)

    def room(self, prompt: int) -> int:
        """How many tokens may follow a prompt of this many (<= 0: it does not fit)."""
        return self._served.room(self.session, prompt)

    @property
    def images(self) -> bool:
        """Requests may carry images."""
        return self._served.images

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.session.tokenizer is None:
            raise KvforgeError(f"{self.session.source} has no tokenizer: send token ids")
        if self.images:  # its image placeholders become the image tokens
            return self.session.encode(text, add_special_tokens)
        return self.session.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @property
    def generates(self) -> bool:
        return self.runner is not None

    def adapters(self) -> list[str]:
        """The LoRA adapters the bundle holds now (read at each call: one added while the server runs is served
        by its next request); none for a bundle without slots."""
        if getattr(self.session, "adapters", None) is None:
            return []
        return [a.name for a in list_adapters(self.session.source)]

    def served_models(self, model_name: str) -> list[str]:
        """What requests may name: the model, and `model:adapter` for each of its adapters."""
        return [model_name] + [f"{model_name}:{a}" for a in self.adapters()]

    @property
    def running(self) -> int:
        return self.runner.running if self.runner else 0

    @property
    def waiting(self) -> int:
        return self.runner.waiting if self.runner else 0

    @property
    def prefix_cache(self):
        """The runner's prefix cache (runtime.PrefixCache), or None: none, or prefix caching off."""
        return getattr(self.runner, "prefix_cache", None)

    @property
    def speculation(self):
        """What the runner's speculating rows did (runtime.speculative.SpeculationStats), or None: no such runner."""
        return getattr(self.runner, "speculation", None)

    def submit(self, prompt: list[int], config, images: list | None = None):
        if images:
            if not self.images:
                raise KvforgeError(f"{self.session.source} takes no images")
            return self.runner.submit(prompt, config, images=images)
        return self.runner.submit(prompt, config)

    def embed(self, inputs: list[str] | list[list[int]]) -> tuple[np.ndarray, int]:
        """Vectors (n, dim), pooled and normalized as the checkpoint says (a sentence-transformers directory's
        modules.json, EncoderSession.embedding_defaults), else mean-pooled and L2-normalized as OpenAI's are; and
        the number of tokens they read."""
        rows = self.session.tokenize(inputs)
        recorded = self.session.config.get("embedding") is not None
        with self._lock:  # one graph call at a time; the server's threads queue here
            vectors = self.session.embed(rows, normalize=None if recorded else True)
        self.finished("embedding", 0)
        return vectors, sum(len(r) for r in rows)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
