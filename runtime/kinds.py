"""What the runtime asks of each model kind: how its bundle opens as a session (kvforge/kinds.py lists the kinds).

`SESSIONS[kind.name].open(bundle, backend, **options)` is the kind's session; runtime.load() does the same for
every kind. runs_engines: the session runs a TensorRT engine bundle (`kvforge build`'s output); the others run
on onnxruntime or torch, and load() refuses their engine bundles with a message that says so.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from kvforge.kinds import check_registry

from .encoder_session import EncoderSession
from .seq2seq_session import Seq2SeqSession
from .session import open_decoder
from .vision_session import VisionLanguageSession


class SessionKind(NamedTuple):
    open: Callable[..., Any]  # (bundle, backend, **options) -> the session
    runs_engines: bool


SESSIONS: dict[str, SessionKind] = {
    "decoder": SessionKind(open_decoder, runs_engines=True),
    "encoder": SessionKind(EncoderSession, runs_engines=False),
    "perceiver": SessionKind(EncoderSession, runs_engines=False),
    "encoder-decoder": SessionKind(Seq2SeqSession, runs_engines=False),
    "vision-language": SessionKind(VisionLanguageSession, runs_engines=False),
}
check_registry("runtime", SESSIONS)


def session_of(kind: Any) -> SessionKind:
    return SESSIONS[kind.name]
