"""Continuous batching over a Session: requests join and leave the running batch between decode steps.

    from kvforge import runtime
    with runtime.load("runs/tiny/fp32") as session, runtime.Batcher(session, max_batch=8) as batcher:
        request = batcher.submit("def add(a, b):", max_new_tokens=16, temperature=0.7, seed=0)
        for event in request:                 # tokens as they are generated
            print(event.text, end="")
        print(request.result().finish_reason)

One scheduler thread owns the batch. Between two decode steps it
- lets go of rows that finished (a stop token, their max_new_tokens, the
  context) or were cancelled, at once: their slots and cache tokens are free
  for the next step;
- admits waiting requests in arrival order while the batch has a free row and
  the cache-token budget holds their reservation (prompt + max_new_tokens,
  capped at the context);
- prefills admitted prompts within a per-step token budget (chunked prefill):
  prompts that fit the budget whole are prefilled together, and the first that
  does not gets a chunk of what is left; its next chunks come in the next
  steps, fed with the running rows' decode step (Session.forward_mixed: one
  call with mixed_steps on ONNX Runtime's packed cache, else two), so a long
  prompt delays their tokens by one chunk's time per step instead of by its
  whole prefill. Rows that leave become holes (nothing moves) that joining
  rows fill (only their own positions are copied).
  A prompt whose prefill is complete joins the running batch. Caches of
  different lengths are aligned right, each row left-padded (the attention mask
  hides the padding; position ids count each row's own tokens), so every row
  computes what it would alone.

A request that does not fit yet waits (back-pressure); one that can never fit
(a prompt beyond the context, a reservation beyond the budget) is refused at
submit() with an error that says why. submit() and cancel() may be called from
any thread; each request has its own sampling parameters, seed and stop ids,
its own response format (a matcher of its own, made at submit(): a format that
does not compile is refused there; rows with and without one share the batch)
and its own log-probability count.

Prefix caching (runtime/prefix_cache.py): the KV of full blocks of every
prefilled prompt is kept, keyed by a hash of the token ids up to each block and
the model's identity (the session's model_id, its backend and the backend's
options), within a budget of cache tokens with LRU eviction of blocks no
running row references. A request whose prompt starts with cached blocks gets
them copied into a cache of its own, prefills only the rest over them (at least
its last token, whose logits choose the first new token) and joins the batch;
greedy outputs are the same token for token. Models with capped sliding-window
layers (a cache that keeps the newest W positions) reuse a prefix only up to the
smallest such W: their prompts feed the blocks within the window first, so that
those are cached before later positions push them out (see prefix_cache.py).
Options:

- prefix_cache_tokens: the budget, in tokens of cached KV (default 4096; 0
  turns prefix caching off, and the batcher prefills every prompt in full);
- prefix_block: tokens per block (default 16): only whole blocks are cached
  and reused;
- prefix_cache: a PrefixCache to use instead of a new one (batchers may share
  one; keys keep models apart);
- prefill_chunk: the per-step token budget (default 256): the running rows'
  decode tokens count against it and prompts get the rest (at least one token a
  step); 0 prefills every admitted prompt whole in the step it is admitted;
- speculative, draft_tokens: the speculative decoding (runtime/drafting.py) of requests whose config does not
  ask for one (GenerationConfig.speculative None; "none" asks for none), and its k. A request that speculates
  is prefilled as any other, then decodes as a row of its own beside the batch: each scheduler step, after the
  batch's decode step, it drafts and checks its drafts in one forward over its own cache (several new tokens
  over a past is a batch-1 step for GroupQueryAttention), so rows with and without speculation run together.
  `Batcher.speculation` sums what they did (steps, drafted and accepted tokens);
- mixed_steps: a prompt chunk and the running rows' decode step are one forward
  call (Session.forward_mixed) where the backend can, instead of two calls that
  each read every weight (default False: on ONNX Runtime's CPU provider this
  loads a second graph of the bundle, which holds the weights a second time;
  benchmarks/batcher_prefill.py measures both).

BatchOptions holds these settings (all but prefix_cache) as one checked value,
which the server writes into a model's configuration and reads back.

`Batcher.prefix_stats` counts hit tokens, cached blocks and tokens, insertions
and evictions (None when off).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import queue
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Iterator

import numpy as np

from kvforge.checks import is_int
from kvforge.errors import KvforgeError

from .constrain import Constraint, masks
from .drafting import speculation_options
from .generate import (GenerationConfig, GenerationResult, TextStream, TokenEvent, check_prompts, end_of, left_padded,
                       row_constraints, step_logprobs)
from .prefix_cache import PrefixCache, PrefixStats
from .sampling import select
from .speculative import SpeculationStats, Speculator

if TYPE_CHECKING:  # pragma: no cover
    from .backend import KVCache
    from .session import Session

_END = object()  # the last item of a request's event queue


@dataclass(frozen=True)
class BatchOptions:
    """The continuous batcher's settings (the module's doc says what each does), checked when made."""

    max_batch: int = 8
    max_cache_tokens: int | None = None  # None: max_batch x the context
    prefix_cache_tokens: int = 4096  # 0: no prefix cache
    prefix_block: int = 16
    prefill_chunk: int = 256  # 0: whole prompts
    mixed_steps: bool = False  # a chunk and the decode step in one call: weights held twice on ONNX Runtime
    # the speculative decoding of requests that do not say (GenerationConfig.speculative None): "" (none),
    # "prompt-lookup", "quantized" or "draft:PATH"; draft_tokens: k (0: the method's default)
    speculative: str = ""
    draft_tokens: int = 0

    def __post_init__(self):
        for f in fields(self):
            value, least = getattr(self, f.name), 0 if f.name in ("prefix_cache_tokens", "prefill_chunk", "draft_tokens") else 1
            if value is None and f.name == "max_cache_tokens":
                continue
            if isinstance(f.default, str):  # a speculative method, checked as a request's would be
                if not isinstance(value, str):
                    raise KvforgeError(f"{f.name} must be a string, got {value!r}")
                self.speculation()
                continue
            if isinstance(f.default, bool):  # a switch
                if not isinstance(value, bool):
                    raise KvforgeError(f"{f.name} must be True or False, got {value!r}")
                continue
            if not is_int(value) or value < least:
                raise KvforgeError(f"{f.name} must be an int >= {least}, got {value!r}")

    def speculation(self) -> dict | None:
        """The default speculation as GenerationConfig.speculative takes it (None: none)."""
        return speculation_options(self.speculative, self.draft_tokens)

    def params(self) -> dict[str, str]:
        """As string parameters (a Triton model's config.pbtxt); unset ones are left out."""
        return {k: str(v) for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_params(cls, params: dict[str, str]) -> BatchOptions:
        """Read back what params() wrote (other keys are ignored; a missing one takes its default)."""
        values = {}
        for f in fields(cls):
            if isinstance(f.default, bool) and f.name in params:  # params() wrote str(True) or str(False)
                if params[f.name] not in ("True", "False"):
                    raise KvforgeError(f"{f.name} must be True or False, got {params[f.name]!r}")
                values[f.name] = params[f.name] == "True"
            elif isinstance(f.default, str) and f.name in params:
                values[f.name] = params[f.name]
            elif f.name in params and params[f.name] != "":
                try:
                    values[f.name] = int(params[f.name])
                except ValueError:
                    raise KvforgeError(f"{f.name} must be an integer, got {params[f.name]!r}") from None
        return cls(**values)


class Request:
    """A submitted generation: iterate it for TokenEvents, result() for the whole; cancel() from any thread."""

    def __init__(self, rid: int, prompt: list[int], config: GenerationConfig, stop: set[int], reserve: int,
                 text: TextStream, constraint: Constraint | None = None):
        self.id = rid
        self.prompt = prompt
        self.config = config
        self.stop = stop
        self.reserve = reserve  # cache tokens it may come to hold
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        logprobs = config.logprobs is not None
        self.logprobs: list[float] | None = [] if logprobs else None  # config.logprobs not None: per token
        self.top_logprobs: list[list[tuple[int, float]]] | None = [] if logprobs else None
        self._constraint = constraint  # the response format's matcher, dropped when the request ends
        # the request's own graph inputs beyond the KV-cache contract, per step from its input ids (a vision-language
        # prompt's image features: runtime/vision_session.py FeatureFeed); None: the session's step_inputs
        self._inputs = None
        self._drafter = None  # config.speculation: a fresh drafter (made at submit(), so a bad draft is refused there)
        self._speculator: Speculator | None = None  # config.speculation: the row, once its prompt is prefilled
        self._text = text
        self._events: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._cancelled = threading.Event()
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop generating: the request ends (finish_reason "cancelled") before the batch's next step."""
        self._cancelled.set()

    def __iter__(self) -> Iterator[TokenEvent]:
        return self.events()

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """The generated tokens as they come; raises the error that ended the request, if one did."""
        while True:
            try:
                item = self._events.get(timeout=timeout)
            except queue.Empty:
                raise KvforgeError(f"request {self.id}: no token within {timeout} s") from None
            if item is _END:
                self._events.put(_END)  # a second iteration ends at once too
                if self._error is not None:
                    raise self._error
                return
            yield item

    def result(self, timeout: float | None = None) -> GenerationResult:
        if not self._done.wait(timeout):
            raise KvforgeError(f"request {self.id} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        text = self._text.tokenizer.decode(self.tokens) if self._text.tokenizer is not None else ""
        return GenerationResult(list(self.tokens), self.finish_reason or "length", len(self.prompt), text,
                                None if self.logprobs is None else list(self.logprobs),
                                None if self.top_logprobs is None else list(self.top_logprobs),
                                None if self._speculator is None else self._speculator.stats.as_dict())

    # -- the scheduler's side ---------------------------------------------------------
    def _emit(self, token: int, finish: str | None, scored: tuple[float, list[tuple[int, float]]] | None = None) -> None:
        self.tokens.append(token)
        event = TokenEvent(token, len(self.tokens) - 1, finish is not None, finish)
        if scored is not None and self.logprobs is not None:
            self.logprobs.append(scored[0])
            self.top_logprobs.append(scored[1])
            event.logprob, event.top_logprobs = scored
        event.text = self._text.push(token, finish is not None)
        self._events.put(event)
        if finish is not None:
            self._end(finish)

    def _end(self, finish: str | None, error: BaseException | None = None) -> None:
        if self._done.is_set():
            return
        self._constraint = None  # frees the matcher
        self.finish_reason, self._error = finish, error
        self._events.put(_END)
        self._done.set()


@dataclass
class _Row:
    request: Request
    seen: list[int]  # prompt + generated ids (repetition penalty; a list: appending to an array copies it)
    rng: np.random.Generator
    logits: np.ndarray | None = None  # the next token's logits, (V,)


@dataclass
class _Batch:
    """The running rows and their one cache. A row that left is a hole (None) until a joining row fills it: its
    cache row holds nothing (Session.vacate_rows) and its mask row is zeros; it feeds a dummy token each step.
    There is at least one live row while there are rows at all."""

    rows: list[_Row | None] = field(default_factory=list)
    cache: KVCache | None = None
    mask: np.ndarray | None = None  # (rows, cache length + 1 for the pending token), right-aligned

    @property
    def live(self) -> list[_Row]:
        return [row for row in self.rows if row is not None]

    @property
    def live_at(self) -> list[int]:
        """The live rows' places."""
        return [i for i, row in enumerate(self.rows) if row is not None]

    @property
    def holes(self) -> list[int]:
        return [i for i, row in enumerate(self.rows) if row is None]


@dataclass
class _Prefill:
    """An admitted request whose prompt is being fed: its own cache so far, and how many prompt positions it holds."""

    request: Request
    cache: KVCache | None = None
    fed: int = 0
    started: bool = False  # its prefix lookup is done (when its prefill begins, so that it finds what went before)
    logits: np.ndarray | None = None  # the last fed chunk's, (1, 1, V)


class RequestQueue:
    """What every runner shares: requests waiting in arrival order, one worker thread started by the first of
    them, close() cancelling what waits. Subclasses run `_run` and say what close() does to running rows."""

    thread_name = "kvforge-runner"

    def __init__(self):
        self._waiting: collections.deque[Request] = collections.deque()
        self._wake = threading.Condition()
        self._ids = itertools.count()
        self._closing = False
        self._thread: threading.Thread | None = None

    def _enqueue(self, request: Request) -> Request:
        """Queue a checked request (one that asks for no token ends at once) and wake the worker."""
        if request.config.max_new_tokens == 0:
            request._end("length")
            return request
        with self._wake:
            if self._closing:
                raise KvforgeError(f"this {type(self).__name__.lower()} is closed")
            self._waiting.append(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
                self._thread.start()
            self._wake.notify()
        return request

    def _run(self) -> None:  # pragma: no cover - every runner has its own
        raise NotImplementedError

    def _closing_running(self) -> None:
        """Under the lock, as close() begins: what happens to the rows running now (the worker ends them)."""

    def generate(self, prompt, config: GenerationConfig | None = None, **kwargs) -> GenerationResult:
        """submit() and wait for the result."""
        return self.submit(prompt, config, **kwargs).result()

    def submit(self, prompt, config: GenerationConfig | None = None, **kwargs) -> Request:  # pragma: no cover
        raise NotImplementedError

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        """Cancel what is waiting and running, and stop the worker thread."""
        with self._wake:
            self._closing = True
            for r in self._waiting:
                r._end("cancelled")
            self._waiting.clear()
            self._closing_running()
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Batcher(RequestQueue):
    """A scheduler thread that runs many requests through one Session as one batch (see the module's doc)."""

    thread_name = "kvforge-batcher"

    def __init__(self, session: Session, max_batch: int = 8, max_cache_tokens: int | None = None,
                 prefix_cache_tokens: int = 4096, prefix_block: int = 16, prefix_cache: PrefixCache | None = None,
                 prefill_chunk: int = 256, mixed_steps: bool = False, speculative: str = "", draft_tokens: int = 0):
        options = BatchOptions(max_batch, max_cache_tokens, prefix_cache_tokens, prefix_block, prefill_chunk, mixed_steps,
                               speculative, draft_tokens)
        super().__init__()
        self.session = session
        self.options = options
        self.max_batch = options.max_batch
        self.max_cache_tokens = options.max_cache_tokens or options.max_batch * session.max_context
        self.prefill_chunk = options.prefill_chunk or None
        self._batch = _Batch()
        self._prefilling: collections.deque[_Prefill] = collections.deque()  # admitted, prompt not all fed yet
        self._chunk: tuple[_Prefill, int] | None = None  # a prompt chunk the next decode step feeds (mixed step)
        # rows that speculate: each its own cache, stepped after the batch's decode step (runtime/speculative.py)
        self._speculating: list[Request] = []
        self.speculation = SpeculationStats()  # what every speculative row did, summed
        self._default_speculation = options.speculation()
        self.chunk_steps = 0  # decode steps that also fed a prompt chunk
        self.steps = 0  # decode steps run (a test and a benchmark read these)
        self.peak_batch = 0
        # seconds spent in prefill and decode forward calls, and in copying caches (joins, leaves, restored prefixes)
        self.seconds = {"prefill": 0.0, "decode": 0.0, "copy": 0.0}
        if prefix_cache is None:
            prefix_cache = PrefixCache(prefix_block, prefix_cache_tokens)
            if prefix_cache.max_blocks == 0:
                prefix_cache = None
        elif not isinstance(prefix_cache, PrefixCache):
            raise KvforgeError(f"prefix_cache must be a PrefixCache, got {type(prefix_cache).__name__}")
        self.prefix_cache = prefix_cache
        backend = session.backend  # the runtime and its options: each computes its KV its own way (to rounding)
        runtime = ":".join(str(getattr(backend, a, "")) for a in ("name", "attention", "variant", "dtype", "device"))
        self._namespace = PrefixCache.namespace(session.model_id, runtime)
        windows = [w for w in session.io.windows if w is not None]
        self._window = min(windows) if windows else None  # capped layers: prefixes up to this many tokens only
        self._pins: dict[int, list[bytes]] = {}  # request id -> the cached blocks its row restored
        # a chunk rides in the decode step's forward_mixed call: one call where the backend has it ready (on ONNX
        # Runtime a second graph, loaded now, that holds the weights again), else two
        self.mixed = options.mixed_steps and session.prepare_mixed()

    # -- the client's side --------------------------------------------------------------
    def submit(self, prompt, config: GenerationConfig | None = None, inputs=None, **kwargs) -> Request:
        """Queue one prompt (text or token ids); returns at once. Refuses what could never run. inputs: the
        request's own graph inputs beyond the KV-cache contract, a callable (a step's input ids (1, T) -> {name:
        array}), as Session.step_inputs; its `key` (bytes), where it has one, keeps its prefix-cache blocks apart
        (the same tokens with other images are other keys and values)."""

        config = config or GenerationConfig.from_kwargs(**kwargs)
        if config.speculative is None and self._default_speculation is not None and config.format is None:
            config = dataclasses.replace(config, speculative=self._default_speculation)
        rows, single = self.session._prompts(prompt)
        if not single:
            raise KvforgeError("submit() takes one prompt; submit each of a batch on its own")
        ids = rows[0]
        check_prompts(self.session, [ids])
        reserve = min(len(ids) + config.max_new_tokens, self.session.max_context)
        if reserve > self.max_cache_tokens:
            raise KvforgeError(f"this request may hold {reserve} cache tokens (prompt {len(ids)} + max_new_tokens "
                               f"{config.max_new_tokens}) but the batcher's budget is {self.max_cache_tokens}; it can never run")
        stop = self.session._stop_ids(config)
        # the response format's matcher now: one that does not compile for this tokenizer is refused here
        row, = row_constraints(config.format, self.session.tokenizer, self.session.vocab_size, stop, 1)
        if config.adapter is not None:  # read (and checked against the bundle's slots) now, not in the loop
            self.session.load_adapter(config.adapter)
        request = Request(next(self._ids), ids, config, stop, reserve, TextStream(self.session.tokenizer), row)
        request._inputs = inputs
        if config.speculation is not None:  # the draft opened and its vocabulary checked now
            request._drafter = self.session._drafter(config)()
        return self._enqueue(request)

    def _space(self, request: Request) -> bytes:
        """The prefix cache's namespace of a request's blocks: the model's, and its adapter's (an adapter computes
        other keys and values for the same tokens)."""
        space = self._namespace
        key = getattr(request._inputs, "key", None)
        if key is not None:  # its own inputs (images): blocks of the same tokens with other inputs differ
            space = PrefixCache.namespace(space.hex(), f"inputs:{key.hex()}")
        if request.config.adapter is None:
            return space
        name = request.config.adapter  # and its version: blocks of an adapter replaced since are not reused
        return PrefixCache.namespace(space.hex(), f"lora:{name}:{self.session.adapter_version(name)}")

    def _inputs(self, rows: list[tuple[Request | None, np.ndarray]]) -> dict[str, np.ndarray] | None:
        """A step's graph inputs beyond the contract, for its rows ((request or None for a hole, its input ids)):
        each request's own (else the session's step_inputs), joined in row order (as the graph reads them: row by
        row, in reading order); None where the session's graph has none."""
        if self.session.step_inputs is None:
            return None
        return join_inputs([(r._inputs if r is not None and r._inputs is not None else self.session.step_inputs)(
            ids[None]) for r, ids in rows])

    @contextlib.contextmanager
    def _timed(self, what: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] += time.perf_counter() - start

    @classmethod
    def with_options(cls, session: Session, options: BatchOptions, prefix_cache: PrefixCache | None = None) -> Batcher:
        return cls(session, **asdict(options), prefix_cache=prefix_cache)

    @property
    def prefix_stats(self) -> PrefixStats | None:
        """Prefix-cache counters (hit tokens, cached blocks, ...), or None when prefix caching is off."""
        return None if self.prefix_cache is None else self.prefix_cache.stats

    @property
    def running(self) -> int:
        """Rows in the batch, and admitted requests whose prompts are still being prefilled."""
        return len(self._batch.live) + len(self._prefilling) + len(self._speculating)

    # -- the scheduler thread -----------------------------------------------------------
    def _run(self) -> None:
        batch = self._batch
        while True:
            with self._wake:
                while not (self._waiting or batch.rows or self._prefilling or self._speculating or self._closing):
                    self._wake.wait()
                if self._closing:
                    ending = self._in_flight()
                    for r in ending:
                        r._end("cancelled")
                    self._unpin(ending)
                    batch.rows, self._prefilling, self._chunk, self._speculating = [], collections.deque(), None, []
                    return
                self._prefilling.extend(_Prefill(r) for r in self._admit(batch))
            try:
                if self._prefilling:
                    self._prefill(batch, max(1, self.prefill_chunk - len(batch.live)) if self.prefill_chunk else None)
                if batch.rows:
                    self._step(batch)
                if self._speculating:
                    self._speculate()
            except BaseException as e:  # a failed step fails the requests in it, not the batcher
                error = e if isinstance(e, KvforgeError) else KvforgeError(f"generation failed: {type(e).__name__}: {e}")
                failed = self._in_flight()
                for r in failed:
                    r._end("error", error)
                self._unpin(failed)
                self._batch = batch = _Batch()
                self._prefilling = collections.deque()
                self._chunk = None
                self._speculating = []

    def _in_flight(self) -> list[Request]:
        """Every admitted request not finished: the batch's rows, prompts being prefilled, speculating rows."""
        return [row.request for row in self._batch.live] + [p.request for p in self._prefilling] + self._speculating

    def _speculate(self) -> None:
        """One speculative step of every speculating row (its first token, the first time), each over its own
        cache: its drafts checked in one forward at batch 1 (runtime/speculative.py). A row that fails ends alone."""
        for r in list(self._speculating):
            sp = r._speculator
            if r.cancelled:
                r._end("cancelled")
            elif not r.done:
                before = (sp.stats.steps, sp.stats.drafted, sp.stats.accepted)
                try:
                    with self._timed("decode"):
                        emitted = sp.step() if sp.tokens else sp.first()
                except KvforgeError as e:
                    r._end("error", e)
                    emitted = []
                for token, finish, scored in emitted:
                    r._emit(token, finish, scored)
                self.speculation.steps += sp.stats.steps - before[0]
                self.speculation.drafted += sp.stats.drafted - before[1]
                self.speculation.accepted += sp.stats.accepted - before[2]
                self.speculation.tokens += len(emitted)
            if r.done:
                self._speculating.remove(r)
                self._unpin([r])

    def _admit(self, batch: _Batch) -> list[Request]:
        """Waiting requests that fit now, in arrival order (the first that does not fit waits, and so do those after it)."""
        held = sum(r.reserve for r in self._in_flight())
        admitted: list[Request] = []
        while self._waiting and self.running + len(admitted) < self.max_batch:
            nxt = self._waiting[0]
            if nxt.cancelled:
                self._waiting.popleft()._end("cancelled")
                continue
            if held + nxt.reserve > self.max_cache_tokens:
                break
            admitted.append(self._waiting.popleft())
            held += nxt.reserve
        return admitted

    def _prefill(self, batch: _Batch, budget: int | None) -> None:
        """Feed admitted prompts, at most `budget` tokens of them (None: all), in admission order; the rows whose
        prompts are now complete join the batch (their first tokens are chosen by the next _step).

        Prompts not begun that fit what is left of the budget whole and start with no cached block are prefilled
        together as one left-padded batch; a prompt that starts with cached blocks gets them copied into a cache of
        its own and feeds only the rest; the first prompt that does not fit gets a chunk of the budget and waits
        for the next step with the prompts after it. Every completed prompt's new full blocks are cached."""
        left = budget
        plain: list[Request] = []
        parts: list[_Batch] = []
        complete: list[_Prefill] = []  # leave the queue only once their rows are made (a failure fails them too)
        for p in list(self._prefilling):
            if left is not None and left <= 0:
                break
            r = p.request
            if r.cancelled:
                self._prefilling.remove(p)
                r._end("cancelled")
                self._unpin([r])
                continue
            if not p.started:
                self._begin(p)
            rest = len(r.prompt) - p.fed
            if p.cache is None and not self._window_blocks(r.prompt) and (left is None or rest <= left) \
                    and r.config.speculation is None:  # (a speculating row keeps a cache of its own)
                plain.append(r)  # a whole prompt from scratch: batched with the others
                complete.append(p)
                fed = rest
            else:
                fed = rest if left is None else min(rest, left)
                if batch.rows and self._chunk is None and not self._window_blocks(r.prompt) \
                        and self.session.step_inputs is None:  # (forward_mixed takes no inputs beyond the contract)
                    self._chunk = (p, fed)  # fed by the decode step's own call (_step: a mixed step)
                else:
                    self._feed(p, fed)
                    if fed == rest:
                        complete.append(p)
                        parts.append(self._complete(p))
            if left is not None:
                left -= fed
        if plain:
            parts.insert(0, self._prefill_full(plain))
        if self.prefix_cache is not None:
            for part in parts:
                self._cache_blocks(part)
        parts = [part for part in parts if not self._speculates(part)]
        if parts:
            new = parts[0]
            for part in parts[1:]:  # the new rows aligned among themselves first: one regroup of the batch
                self._join(new, part)
            self._join(batch, new)
        for p in complete:
            self._prefilling.remove(p)

    def _begin(self, p: _Prefill) -> None:
        """A prompt's prefill begins: restore the cached blocks it starts with (pinned until its row leaves)."""
        p.started = True
        if self.prefix_cache is None:
            return
        r = p.request
        limit = len(r.prompt) - 1  # at least the last token is fed: its logits choose the first new one
        if self._window is not None:
            limit = min(limit, self._window)
        hit = self.prefix_cache.lookup(self._space(r), r.prompt, limit)
        if hit.blocks:
            self._pins[r.id] = hit.keys
            with self._timed("copy"):
                p.cache = self.session.cache_from_arrays(hit.arrays(), hit.tokens)
            p.fed = hit.tokens

    def _feed(self, p: _Prefill, n: int) -> None:
        """Feed the next n prompt tokens over the request's cache. With capped layers, the feed stops
        at the end of the blocks within the window once, to cache them before later positions push them out."""
        prompt, fed, goal = p.request.prompt, p.fed, p.fed + n
        end = self._window_blocks(prompt)
        while fed < goal:
            upto = end if fed < end < goal else goal
            ids, mask = _piece(prompt, fed, upto)
            with self._timed("prefill"):
                p.logits, p.cache = self.session.forward(ids, mask, cache=p.cache, last_logits_only=True,
                                                         adapters=p.request.config.adapters(1),
                                                         inputs=self._inputs([(p.request, ids[0])]))
            fed = p.fed = upto
            if fed == end and self.prefix_cache is not None:
                keys, first = self.prefix_cache.missing(self._space(p.request), prompt, end)
                if first < len(keys):
                    self.prefix_cache.insert(keys, prompt, first,
                                             _blocks(self.session.cache_arrays(p.cache), 0, end, self.prefix_cache.block_size))

    def _complete(self, p: _Prefill) -> _Batch:
        r = p.request
        row = _Row(r, list(r.prompt), np.random.default_rng(r.config.seed), p.logits[0, -1])
        return _Batch([row], p.cache, _pending(np.ones((1, len(r.prompt)), np.int64)))

    def _prefill_full(self, requests: list[Request]) -> _Batch:
        ids, mask = left_padded(self.session, [r.prompt for r in requests])
        with self._timed("prefill"):
            logits, cache = self.session.forward(ids, mask, cache=None, last_logits_only=True,
                                                 adapters=[r.config.adapter for r in requests],
                                                 inputs=self._inputs(list(zip(requests, ids))))
        rows = [_Row(r, list(r.prompt), np.random.default_rng(r.config.seed), logits[i, -1])
                for i, r in enumerate(requests)]
        return _Batch(rows, cache, _pending(mask))

    def _window_blocks(self, prompt: list[int]) -> int:
        """Capped layers: the tokens of the prompt's cacheable blocks (those within the window), fed apart from
        the rest so that they are cached before later positions push them out of the window; else 0."""
        if self._window is None or self.prefix_cache is None:
            return 0
        B = self.prefix_cache.block_size
        return min(self._window, len(prompt) - 1) // B * B

    def _cache_blocks(self, part: _Batch) -> None:
        """Cache the full prompt blocks of a freshly prefilled batch that are not cached yet."""
        pc, length = self.prefix_cache, part.cache.length
        held = min(self.session.io.cache_lengths(length))  # a capped layer keeps only the newest W positions
        todo = []
        for i, row in enumerate(part.rows):
            n = len(row.request.prompt)
            if n > held:  # some layer no longer holds the first positions: no block chain can start
                continue
            upto = n if self._window is None else min(n, self._window)
            keys, first = pc.missing(self._space(row.request), row.request.prompt, upto)
            if first < len(keys):
                todo.append((i, row, keys, first))
        if not todo:
            return
        arrays = self.session.cache_arrays(part.cache)
        for i, row, keys, first in todo:
            pc.insert(keys, row.request.prompt, first, _blocks(arrays, i, len(row.request.prompt), pc.block_size))

    def _unpin(self, requests: list[Request]) -> None:
        """Let go of the cached blocks these requests' rows restored."""
        if self.prefix_cache is None:
            return
        for r in requests:
            keys = self._pins.pop(r.id, None)
            if keys:
                self.prefix_cache.release(keys)

    def _join(self, batch: _Batch, new: _Batch) -> None:
        """New rows join: into holes where there are enough (only their own positions are copied), else appended
        to the live rows (a regroup, which also drops the holes)."""
        if not batch.rows:
            batch.rows, batch.cache, batch.mask = new.rows, new.cache, new.mask
            return
        holes = batch.holes
        length = max(batch.cache.length, new.cache.length)
        with self._timed("copy"):
            if len(holes) >= len(new.rows):
                into = holes[:len(new.rows)]
                batch.cache = self.session.place_rows(batch.cache, into, new.cache)
                batch.mask = _left_pad(batch.mask, length + 1)
                batch.mask[into] = _left_pad(new.mask, length + 1)
                for i, row in zip(into, new.rows):
                    batch.rows[i] = row
                return
            live = batch.live_at
            batch.cache = self.session.regroup_cache(
                [(batch.cache, live), (new.cache, list(range(len(new.rows))))], length)
        batch.mask = np.concatenate([_left_pad(batch.mask[live], length + 1), _left_pad(new.mask, length + 1)])
        batch.rows = [batch.rows[i] for i in live] + new.rows

    def _step(self, batch: _Batch) -> None:
        """Choose every row's next token, let finished rows go, and run one decode step for the rest."""
        context = self.session.max_context
        live = batch.live_at
        for i in live:
            if batch.rows[i].request.cancelled:
                batch.rows[i].request._end("cancelled")
        try:  # every constrained row's mask at once (each row alone if one of them fails)
            allowed = masks([batch.rows[i].request._constraint for i in live], self.session.vocab_size)
        except KvforgeError:
            allowed = None
        leaving = []
        for k, i in enumerate(live):
            row = batch.rows[i]
            r = row.request
            if r.done:
                leaving.append(i)
                continue
            try:
                mask = None
                if r._constraint is not None:
                    mask = allowed[k:k + 1] if allowed is not None else masks([r._constraint], self.session.vocab_size)
                chosen = select(row.logits[None], [row.seen], r.config.sampling, [row.rng], mask)
                token = int(chosen[0])
                scored = step_logprobs(r.config, row.logits[None], chosen)
                finish = end_of(token, len(r.tokens) + 1, len(r.prompt), r.config, r.stop, context, r._constraint)
            except KvforgeError as e:  # this request's grammar failed: it ends, the batch goes on
                r._end("error", e)
                leaving.append(i)
                continue
            row.seen.append(token)
            r._emit(token, finish, None if scored is None else scored[0])
            if finish is not None:
                leaving.append(i)
        self.peak_batch = max(self.peak_batch, len(live))
        if leaving:
            self._retire(batch, leaving)
        chunk, self._chunk = self._chunk, None
        if not batch.rows:
            if chunk is not None:  # no row decodes: the chunk alone
                self._feed(*chunk)
                self._chunk_fed(batch, chunk[0])
            return
        holes = batch.holes
        if holes:  # a hole feeds a dummy token that attends to itself alone (its mask row is zeros between steps)
            batch.mask[holes, -1] = 1
        nxt = np.array([[row.request.tokens[-1] if row is not None else 0] for row in batch.rows], np.int64)
        adapters = [row.request.config.adapter if row is not None else None for row in batch.rows]
        with self._timed("decode"):
            if chunk is None:
                logits, batch.cache = self.session.forward(
                    nxt, batch.mask, cache=batch.cache, last_logits_only=True, adapters=adapters,
                    inputs=self._inputs([(row.request if row is not None else None, ids) for row, ids in
                                         zip(batch.rows, nxt)]))
            else:  # the rows' decode step and a prompt's chunk as one step: the backend reads its weights once
                p, n = chunk
                (logits, batch.cache), (p.logits, p.cache) = self.session.forward_mixed(
                    (nxt, batch.mask, batch.cache), (*_piece(p.request.prompt, p.fed, p.fed + n), p.cache),
                    adapters=(adapters, p.request.config.adapters(1)))
                p.fed += n
                self.chunk_steps += 1
        for row, lg in zip(batch.rows, logits[:, -1]):
            if row is not None:
                row.logits = lg
        batch.mask = _pending(batch.mask)
        if holes:  # and holds nothing after it
            batch.mask[holes] = 0
            batch.cache = self.session.vacate_rows(batch.cache, holes)
        self.steps += 1
        if chunk is not None:
            self._chunk_fed(batch, chunk[0])

    def _chunk_fed(self, batch: _Batch, p: _Prefill) -> None:
        """After a chunk of p's prompt was fed by a step: a complete prompt's row joins the batch."""
        if p.fed < len(p.request.prompt):
            return
        part = self._complete(p)
        if self.prefix_cache is not None:
            self._cache_blocks(part)
        if not self._speculates(part):
            self._join(batch, part)
        self._prefilling.remove(p)

    def _speculates(self, part: _Batch) -> bool:
        """A prefilled row that speculates becomes a speculating row (with its own cache) instead of joining."""
        row = part.rows[0]
        r = row.request
        if r.config.speculation is None:
            return False
        r._speculator = Speculator(self.session, r.prompt, r.config, r.stop, r._drafter, part.cache, row.logits)
        self._speculating.append(r)
        return True

    def _retire(self, batch: _Batch, leaving: list[int]) -> None:
        """These rows leave. Their places become holes (nothing moves) unless holes would outnumber the live rows:
        then the live rows are regrouped without them. The leading positions that are now padding for every live
        row are dropped."""
        self._unpin([batch.rows[i].request for i in leaving])
        for i in leaving:
            batch.rows[i] = None
        live = batch.live_at
        if not live:
            batch.rows, batch.cache, batch.mask = [], None, None
            return
        first = int(batch.mask[live].argmax(axis=1).min())  # the earliest real position of any live row
        length = batch.cache.length - first
        if 2 * len(live) < len(batch.rows):
            with self._timed("copy"):
                batch.cache = self.session.regroup_cache([(batch.cache, live)], length)
            batch.rows, batch.mask = [batch.rows[i] for i in live], batch.mask[live, first:]
            return
        batch.mask[leaving] = 0
        batch.cache = self.session.vacate_rows(batch.cache, leaving)
        if first:
            with self._timed("copy"):  # a packed cache only forgets the columns; others copy what they keep
                try:
                    batch.cache = self.session.drop_oldest(batch.cache, first)
                except NotImplementedError:  # a backend that cannot drop positions (TensorRT): a regroup
                    batch.cache = self.session.regroup_cache([(batch.cache, list(range(len(batch.rows))))], length)
            batch.mask = batch.mask[:, first:]


def join_inputs(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Rows' graph inputs beyond the contract, joined in row order on their first axis (feature rows in reading
    order; per-row tensors batch first)."""
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def _blocks(arrays: list[np.ndarray], row: int, n: int, size: int):
    """k -> the k-th block of `size` positions of a row's first n tokens, from a cache's arrays (cache_arrays):
    position p of those n tokens sits at column (columns held) - n + p."""
    return lambda k: [a[row, :, a.shape[2] - n + k * size:a.shape[2] - n + (k + 1) * size] for a in arrays]


def _piece(prompt: list[int], start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """A prompt's tokens start..end as one row's step over its first `start` (ids, attention mask)."""
    return np.asarray([prompt[start:end]], np.int64), np.ones((1, end), np.int64)


def _pending(mask: np.ndarray) -> np.ndarray:
    """The mask with a column for the token each row feeds next."""
    return np.concatenate([mask, np.ones((mask.shape[0], 1), mask.dtype)], axis=1)


def _left_pad(mask: np.ndarray, width: int) -> np.ndarray:
    return np.concatenate([np.zeros((mask.shape[0], width - mask.shape[1]), mask.dtype), mask], axis=1)
