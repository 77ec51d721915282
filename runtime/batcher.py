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

That thread plans and runs apart: runtime/scheduler.py (Scheduler) decides each
step from the queue and the running rows alone (admissions, prefix hits, which
prompt tokens are fed and how, where rows join and leave, which rows decode:
a StepPlan and a DecodePlan; it holds no session), and
runtime/batch_executor.py (BatchExecutor) runs the plans on the session (the
batch's cache and mask, sampling, the prefix cache's blocks, speculating rows).
This module holds the requests, the options and the thread that drives both.

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
  benchmarks/features/batcher_prefill.py measures both).

BatchOptions holds these settings (all but prefix_cache) as one checked value,
which the server writes into a model's configuration and reads back:
Batcher(session, options) takes one, Batcher(session, max_batch=8, ...) makes
one of its fields (once; not both).

`Batcher.prefix_stats` counts hit tokens, cached blocks and tokens, insertions
and evictions (None when off).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Iterator

from kvforge.checks import is_int
from kvforge.errors import KvforgeError

from .batch_executor import BatchExecutor
from .constrain import Constraint
from .drafting import speculation_options
from .generate import GenerationConfig, GenerationResult, TextStream, TokenEvent, check_prompts, row_constraints
from .prefix_cache import PrefixCache, PrefixStats
from .scheduler import Scheduler
from .speculative import SpeculationStats, Speculator

if TYPE_CHECKING:  # pragma: no cover
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

    @classmethod
    def of(cls, options: BatchOptions | None, settings: dict) -> BatchOptions:
        """The one options value of a runner: `options`, or made from its fields given as keywords (not both)."""
        if options is None:
            return cls(**settings)
        if not isinstance(options, cls):
            raise KvforgeError(f"options must be a kvforge.runtime.BatchOptions, got {type(options).__name__}")
        if settings:
            raise KvforgeError(f"give a BatchOptions or its fields, not both ({', '.join(sorted(settings))} beside it)")
        return options

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
    """A submitted generation: iterate it for TokenEvents, result() for the whole; cancel() from any thread.
    emit() and end(), and constraint, inputs, drafter and speculator, are its runner's (its worker thread's)."""

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
        self.constraint = constraint  # the response format's matcher, dropped when the request ends
        # the request's own graph inputs beyond the KV-cache contract, per step from its input ids (a vision-language
        # prompt's image features: runtime/vision_session.py FeatureFeed); None: the session's step_inputs
        self.inputs = None
        self.drafter = None  # config.speculation: a fresh drafter (made at submit(), so a bad draft is refused there)
        self.speculator: Speculator | None = None  # config.speculation: the row, once its prompt is prefilled
        self.apart = 0  # leading prompt tokens fed apart, their blocks cached first (runtime/scheduler.py)
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

    @property
    def speculates(self) -> bool:
        """It decodes as a row of its own beside the batch (config.speculation)."""
        return self.config.speculation is not None

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
                                None if self.speculator is None else self.speculator.stats.as_dict())

    # -- the runner's side (its worker thread: RequestQueue, runtime/batch_executor.py, runtime/serial.py) ----------
    def emit(self, token: int, finish: str | None, scored: tuple[float, list[tuple[int, float]]] | None = None) -> None:
        """A generated token (with its log-probabilities, where asked) to the request's events; finish: it was the
        last, and why (the request ends)."""
        self.tokens.append(token)
        event = TokenEvent(token, len(self.tokens) - 1, finish is not None, finish)
        if scored is not None and self.logprobs is not None:
            self.logprobs.append(scored[0])
            self.top_logprobs.append(scored[1])
            event.logprob, event.top_logprobs = scored
        event.text = self._text.push(token, finish is not None)
        self._events.put(event)
        if finish is not None:
            self.end(finish)

    def end(self, finish: str | None, error: BaseException | None = None) -> None:
        """The request ends (finish_reason `finish`; error: what result() and iteration raise); a no-op once it has."""
        if self._done.is_set():
            return
        self.constraint = None  # frees the matcher
        self.finish_reason, self._error = finish, error
        self._events.put(_END)
        self._done.set()



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
            request.end("length")
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
                r.end("cancelled")
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
    """A scheduler thread that runs many requests through one Session as one batch (see the module's doc):
    Batcher(session, options) with a BatchOptions, or Batcher(session, max_batch=..., ...) with its fields."""

    thread_name = "kvforge-batcher"

    def __init__(self, session: Session, options: BatchOptions | None = None, *,
                 prefix_cache: PrefixCache | None = None, **settings):
        super().__init__()
        self.session = session
        self.options = options = BatchOptions.of(options, settings)
        if prefix_cache is None:
            prefix_cache = PrefixCache(options.prefix_block, options.prefix_cache_tokens)
            if prefix_cache.max_blocks == 0:
                prefix_cache = None
        elif not isinstance(prefix_cache, PrefixCache):
            raise KvforgeError(f"prefix_cache must be a PrefixCache, got {type(prefix_cache).__name__}")
        self.prefix_cache = prefix_cache
        self.max_cache_tokens = options.max_cache_tokens or options.max_batch * session.max_context
        self._executor = BatchExecutor(session, prefix_cache)
        self._scheduler = Scheduler(options.max_batch, self.max_cache_tokens, options.prefill_chunk,
                                    self._executor.lookup, chunks_ride=session.step_inputs is None)
        self._default_speculation = options.speculation()
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
        rows, single = self.session.prompt_rows(prompt)
        if not single:
            raise KvforgeError("submit() takes one prompt; submit each of a batch on its own")
        ids = rows[0]
        check_prompts(self.session, [ids])
        reserve = min(len(ids) + config.max_new_tokens, self.session.max_context)
        if reserve > self.max_cache_tokens:
            raise KvforgeError(f"this request may hold {reserve} cache tokens (prompt {len(ids)} + max_new_tokens "
                               f"{config.max_new_tokens}) but the batcher's budget is {self.max_cache_tokens}; it can never run")
        stop = self.session.stop_tokens(config)
        # the response format's matcher now: one that does not compile for this tokenizer is refused here
        row, = row_constraints(config.format, self.session.tokenizer, self.session.vocab_size, stop, 1)
        if config.adapter is not None:  # read (and checked against the bundle's slots) now, not in the loop
            self.session.load_adapter(config.adapter)
        request = Request(next(self._ids), ids, config, stop, reserve, TextStream(self.session.tokenizer), row)
        request.inputs = inputs
        request.apart = self._executor.apart(ids)
        if config.speculation is not None:  # the draft opened and its vocabulary checked now
            request.drafter = self.session.new_drafter(config)
        return self._enqueue(request)

    @classmethod
    def with_options(cls, session: Session, options: BatchOptions, prefix_cache: PrefixCache | None = None) -> Batcher:
        return cls(session, options, prefix_cache=prefix_cache)

    @property
    def prefix_stats(self) -> PrefixStats | None:
        """Prefix-cache counters (hit tokens, cached blocks, ...), or None when prefix caching is off."""
        return None if self.prefix_cache is None else self.prefix_cache.stats

    @property
    def running(self) -> int:
        """Rows in the batch, and admitted requests whose prompts are still being prefilled."""
        return self._scheduler.running

    # what the executor counted (a test and a benchmark read these)
    @property
    def steps(self) -> int:
        """Decode steps run."""
        return self._executor.steps

    @property
    def chunk_steps(self) -> int:
        """Decode steps that also fed a prompt chunk."""
        return self._executor.chunk_steps

    @property
    def peak_batch(self) -> int:
        return self._executor.peak_batch

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds spent in prefill and decode forward calls, and in copying caches (joins, leaves, restored
        prefixes)."""
        return self._executor.seconds

    @property
    def speculation(self) -> SpeculationStats:
        """What every speculative row did, summed."""
        return self._executor.speculation

    # -- the scheduler thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._waiting or self._scheduler.busy or self._closing):
                    self._wake.wait()
                if self._closing:
                    self._end_in_flight("cancelled")
                    return
                self._scheduler.admit(self._waiting)
            try:
                self._step()
            except BaseException as e:  # a failed step fails the requests in it, not the batcher
                self._end_in_flight("error", e if isinstance(e, KvforgeError) else
                                    KvforgeError(f"generation failed: {type(e).__name__}: {e}"))

    def _step(self) -> None:
        """One step: the scheduler plans, the executor runs: prompts fed (their complete rows join), every row's
        next token chosen, finished rows leave, one decode step (with a prompt chunk), the speculating rows' step."""
        scheduler, executor = self._scheduler, self._executor
        plan = scheduler.plan()
        for r in plan.dropped:
            r.end("cancelled")
        executor.release(plan.dropped)
        executor.prefill(plan)
        if scheduler.rows:
            executor.decode(scheduler.decode(executor.choose(scheduler.rows)))
        if scheduler.speculating:
            scheduler.leave_speculating(executor.speculate(scheduler.speculating))

    def _end_in_flight(self, finish: str, error: BaseException | None = None) -> None:
        """End every admitted request not finished (a failed step, closing) and forget the batch."""
        requests = self._scheduler.clear()
        for r in requests:
            r.end(finish, error)
        self._executor.reset(requests)
