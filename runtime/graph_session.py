"""What the encoder and encoder-decoder sessions share: their bundle, tokenizer and backend (a Runner from
runtime/graph_backends.py, picked by name from the session's table), the lifecycle every session has
(runtime/backend.py SessionLifecycle) and one lock that serializes calls from several threads."""

from __future__ import annotations

import threading
from typing import Any

from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError
from kvforge.tokenizer import Tokenizer

from .backend import Runner, SessionLifecycle


class GraphSession(SessionLifecycle):
    backends: dict[str, type[Runner]] = {}  # backend name -> its class; the first is what "auto" picks

    def __init__(self, bundle: Bundle, backend: str = "auto", **options):
        if backend not in ("auto", *self.backends):
            raise KvforgeError(f"{bundle.kind.name} bundles run on the {' or '.join(self.backends)} backend, "
                               f"not {backend!r}")
        self.bundle = bundle
        self.source = str(bundle.path)
        self.config: dict[str, Any] = bundle.model_config
        self.io = bundle.io
        self.tokenizer = Tokenizer.from_file(bundle.tokenizer_file) if bundle.tokenizer_file else None
        self.backend_name = next(iter(self.backends)) if backend == "auto" else backend
        self.backend = self.backends[self.backend_name](bundle, **options)  # options are checked here
        self._lock = threading.RLock()

    @property
    def architecture(self) -> str:
        return self.bundle.kind.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source!r}, backend={self.backend_name!r})"
