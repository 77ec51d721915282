"""Requests run one after another through a session's stream(): the Batcher's interface for a session whose
cache rows cannot join a running batch (an encoder-decoder, whose cross-attention is per source).

    runner = SerialRunner(session)
    request = runner.submit("translate: hello", max_new_tokens=16)
    print(request.result().text)

One worker thread takes the waiting requests in arrival order; submit() and cancel() may be called from any
thread, and a cancelled request stops before its next token.
"""

from __future__ import annotations

from kvforge.errors import KvforgeError

from .batcher import Request, RequestQueue
from .generate import GenerationConfig, TextStream


class SerialRunner(RequestQueue):
    thread_name = "kvforge-serial"

    def __init__(self, session):
        super().__init__()
        self.session = session
        self._current: Request | None = None

    def submit(self, prompt, config: GenerationConfig | None = None, **kwargs) -> Request:
        """Queue one prompt (text or token ids); returns at once."""
        config = config or GenerationConfig.from_kwargs(**kwargs)
        rows, single = self.session.prompt_rows(prompt)
        if not single:
            raise KvforgeError("submit() takes one prompt; submit each of a batch on its own")
        self.session.check_sources(rows)
        return self._enqueue(Request(next(self._ids), rows[0], config, self.session.stop_tokens(config), 0,
                                     TextStream(self.session.tokenizer)))

    @property
    def running(self) -> int:
        return int(self._current is not None)

    def _closing_running(self) -> None:
        if self._current is not None:
            self._current.cancel()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                request = self._current = self._waiting.popleft()
            try:
                for event in self.session.stream(request.prompt, request.config):
                    if request.cancelled:
                        break
                    scored = None if event.logprob is None else (event.logprob, list(event.top_logprobs or []))
                    request.emit(event.token, event.finish_reason if event.last else None, scored)
                request.end("cancelled")  # a no-op unless it was cancelled before its last token
            except BaseException as e:  # noqa: BLE001 - a failed request fails alone
                error = e if isinstance(e, KvforgeError) else KvforgeError(f"generation failed: {type(e).__name__}: {e}")
                request.end("error", error)
            finally:
                self._current = None
