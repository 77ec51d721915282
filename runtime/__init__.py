"""kvforge.runtime: embeddable sessions over ONNX Runtime and Torch, with KV-cache generation.

    from kvforge import runtime
    with runtime.load("runs/tiny-fp32") as session:          # backend="auto": ONNX Runtime
        print(session.generate("def add(a, b):", max_new_tokens=16).text)
        with runtime.Batcher(session, max_batch=8) as batcher:   # many requests, one continuous batch
            print(batcher.submit("class Stack", max_new_tokens=16).result().text)

Importing this package imports no Torch; the torch backend loads it on activation.
"""

from .backend import Backend, KVCache
from .batcher import BatchOptions, Batcher, Request
from .drafting import Speculation, parse_speculative
from .encoder_session import EncoderSession
from .generate import GenerationConfig, GenerationResult, TokenEvent
from .sampling import SamplingConfig
from .loading import load
from .prefix_cache import PrefixCache, PrefixStats
from .session import BACKENDS, Session, available_backends
from .vision_session import VisionLanguageSession

__all__ = [
    "BACKENDS",
    "Backend",
    "BatchOptions",
    "Batcher",
    "EncoderSession",
    "GenerationConfig",
    "GenerationResult",
    "KVCache",
    "PrefixCache",
    "PrefixStats",
    "Request",
    "SamplingConfig",
    "Session",
    "Speculation",
    "TokenEvent",
    "VisionLanguageSession",
    "available_backends",
    "load",
    "parse_speculative",
]
