"""The continuous batcher's executor: runs the scheduler's plans (runtime/scheduler.py) on a Session.

It owns what the plans only name: the batch's one cache and attention mask (rows right-aligned, each row's mask
left-padded: the padding is hidden, position ids count each row's own tokens), each row's sampling state, the
caches of prompts being fed, the speculating rows' steps and the prefix cache's blocks (runtime/prefix_cache.py:
looked up, restored, inserted and pinned while a row holds them). The batch's row order is the scheduler's: a
plan's rows (a request per row, None for a hole) say which of its rows is whose.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional

import numpy as np

from kvforge.errors import KvforgeError

from .constrain import masks
from .generate import end_of, left_padded, step_logprobs
from .prefix_cache import PrefixCache
from .sampling import select
from .scheduler import DecodePlan, Feed, Placement, StepPlan
from .speculative import SpeculationStats, Speculator

if TYPE_CHECKING:  # pragma: no cover
    from .backend import KVCache
    from .batcher import Request
    from .session import Session


@dataclass
class _Row:
    request: Request
    seen: list[int]  # prompt + generated ids (repetition penalty; a list: appending to an array copies it)
    rng: np.random.Generator
    logits: np.ndarray | None = None  # the next token's logits, (V,)


@dataclass
class _Part:
    """Freshly prefilled rows with their one cache, before they join the batch."""

    rows: list[_Row]
    cache: KVCache
    mask: np.ndarray  # (rows, cache length + 1 for the pending token)


@dataclass
class _Prompt:
    """A prompt being fed over a cache of its own."""

    cache: KVCache | None = None
    logits: np.ndarray | None = None  # the last fed piece's, (1, 1, V)


class BatchExecutor:
    """Runs a Batcher's step plans on its session (see the module's doc)."""

    def __init__(self, session: Session, prefix_cache: PrefixCache | None):
        self.session = session
        self.prefix_cache = prefix_cache
        backend = session.backend  # the runtime and its options: each computes its KV its own way (to rounding)
        runtime = ":".join(str(getattr(backend, a, "")) for a in ("name", "attention", "variant", "dtype", "device"))
        self._namespace = PrefixCache.namespace(session.model_id, runtime)
        windows = [w for w in session.io.windows if w is not None]
        self._window = min(windows) if windows else None  # capped layers: prefixes up to this many tokens only
        self._pins: dict[int, list[bytes]] = {}  # request id -> the cached blocks its row restored
        self._hits: dict[Request, object] = {}  # looked up, not restored yet
        self._prompts: dict[Request, _Prompt] = {}
        self._rows: dict[Request, _Row] = {}  # the batch's live rows
        self.cache: KVCache | None = None  # the batch's
        self.mask: np.ndarray | None = None  # (rows, cache length + 1 for the pending token), right-aligned
        self.speculation = SpeculationStats()  # what every speculative row did, summed
        self.chunk_steps = 0  # decode steps that also fed a prompt chunk
        self.steps = 0  # decode steps run
        self.peak_batch = 0
        # seconds spent in prefill and decode forward calls, and in copying caches (joins, leaves, restored prefixes)
        self.seconds = {"prefill": 0.0, "decode": 0.0, "copy": 0.0}

    def reset(self, requests: list[Request]) -> None:
        """Forget the batch and every prompt's cache (a failed step, closing); these requests' blocks are let go."""
        self.release(requests)
        self._hits, self._prompts, self._rows, self.cache, self.mask = {}, {}, {}, None, None

    # -- the prefix cache -----------------------------------------------------------------
    def apart(self, prompt: list[int]) -> int:
        """Capped layers: the tokens of the prompt's cacheable blocks (those within the window), fed apart from
        the rest so that they are cached before later positions push them out of the window; else 0."""
        if self._window is None or self.prefix_cache is None:
            return 0
        B = self.prefix_cache.block_size
        return min(self._window, len(prompt) - 1) // B * B

    def lookup(self, r: Request) -> int:
        """The prompt tokens r's prefill restores from cached blocks (pinned until its row leaves): the scheduler's
        lookup. At least the last token is fed: its logits choose the first new one."""
        if self.prefix_cache is None:
            return 0
        limit = len(r.prompt) - 1
        if self._window is not None:
            limit = min(limit, self._window)
        hit = self.prefix_cache.lookup(self._space(r), r.prompt, limit)
        if not hit.blocks:
            return 0
        self._pins[r.id] = hit.keys
        self._hits[r] = hit
        return hit.tokens

    def release(self, requests: list[Request]) -> None:
        """Let go of the cached blocks these requests' rows restored."""
        if self.prefix_cache is None:
            return
        for r in requests:
            keys = self._pins.pop(r.id, None)
            if keys:
                self.prefix_cache.release(keys)

    def _space(self, request: Request) -> bytes:
        """The prefix cache's namespace of a request's blocks: the model's, and its adapter's (an adapter computes
        other keys and values for the same tokens)."""
        space = self._namespace
        key = getattr(request.inputs, "key", None)
        if key is not None:  # its own inputs (images): blocks of the same tokens with other inputs differ
            space = PrefixCache.namespace(space.hex(), f"inputs:{key.hex()}")
        if request.config.adapter is None:
            return space
        name = request.config.adapter  # and its version: blocks of an adapter replaced since are not reused
        return PrefixCache.namespace(space.hex(), f"lora:{name}:{self.session.adapter_version(name)}")

    def _cache_blocks(self, part: _Part) -> None:
        """Cache the full prompt blocks of freshly prefilled rows that are not cached yet."""
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

    # -- a plan's prompts --------------------------------------------------------------------
    def prefill(self, plan: StepPlan) -> None:
        """Restore the hits, run the feeds, prefill the whole prompts; the completed prompts' rows join."""
        for r in plan.hits:
            self._restore(r)
        for feed in plan.feeds:
            self._feed(feed)
        parts = [self._prefill_whole(plan.whole)] if plan.whole else []
        self._settle(parts + [self._complete(r) for r in plan.complete], plan.joins)

    def _restore(self, r: Request) -> None:
        """The cached blocks r's lookup found, copied into a cache of its own."""
        hit = self._hits.pop(r)
        with self._timed("copy"):
            self._prompts[r] = _Prompt(self.session.cache_from_arrays(hit.arrays(), hit.tokens))

    def _feed(self, feed: Feed) -> None:
        """Feed prompt tokens over the request's own cache (keep_blocks: then cache its blocks up to there)."""
        r = feed.job
        p = self._prompts.setdefault(r, _Prompt())
        ids, mask = _piece(r.prompt, feed.start, feed.end)
        with self._timed("prefill"):
            p.logits, p.cache = self.session.forward(ids, mask, cache=p.cache, last_logits_only=True,
                                                     adapters=r.config.adapters(1), inputs=self._inputs([(r, ids[0])]))
        if feed.keep_blocks:
            keys, first = self.prefix_cache.missing(self._space(r), r.prompt, feed.end)
            if first < len(keys):
                self.prefix_cache.insert(keys, r.prompt, first, _blocks(self.session.cache_arrays(p.cache), 0,
                                                                        feed.end, self.prefix_cache.block_size))

    def _prefill_whole(self, requests: list[Request]) -> _Part:
        ids, mask = left_padded(self.session, [r.prompt for r in requests])
        with self._timed("prefill"):
            logits, cache = self.session.forward(ids, mask, cache=None, last_logits_only=True,
                                                 adapters=[r.config.adapter for r in requests],
                                                 inputs=self._inputs(zip(requests, ids)))
        return _Part([_row(r, logits[i, -1]) for i, r in enumerate(requests)], cache, _pending(mask))

    def _complete(self, r: Request) -> _Part:
        """A prompt fed over its own cache is complete: its row."""
        p = self._prompts.pop(r)
        return _Part([_row(r, p.logits[0, -1])], p.cache, _pending(np.ones((1, len(r.prompt)), np.int64)))

    def _settle(self, parts: list[_Part], joins: Placement | None) -> None:
        """Freshly prefilled rows: their new full prompt blocks are cached, then they join the batch as `joins` says
        (those that speculate become rows of their own instead)."""
        if self.prefix_cache is not None:
            for part in parts:
                self._cache_blocks(part)
        joining = [part for part in parts if not self._speculates(part)]
        if joining:
            self._join(joining, joins)

    def _speculates(self, part: _Part) -> bool:
        """A prefilled row that speculates becomes a row of its own (a Speculator over its own cache)."""
        row = part.rows[0]
        r = row.request
        if not r.speculates:
            return False
        r.speculator = Speculator(self.session, r.prompt, r.config, r.stop, r.drafter, part.cache, row.logits)
        return True

    def _join(self, parts: list[_Part], joins: Placement) -> None:
        """New rows join the batch: aligned among themselves first (one regroup of the batch), then placed."""
        new = parts[0]
        for part in parts[1:]:
            new = _Part(new.rows + part.rows, *self._joined(new.cache, new.mask, _after(new), part))
        self._rows.update((row.request, row) for row in new.rows)
        if self.cache is None:
            self.cache, self.mask = new.cache, new.mask
        else:
            self.cache, self.mask = self._joined(self.cache, self.mask, joins, new)

    def _joined(self, cache: KVCache, mask: np.ndarray, placement: Placement, new: _Part) -> tuple[KVCache, np.ndarray]:
        """A cache and its mask with new's rows in its holes placement.fill (only their own positions are copied),
        or after its rows placement.keep (a regroup)."""
        length = max(cache.length, new.cache.length)
        with self._timed("copy"):
            if not placement.regroup:
                into = list(placement.fill)
                cache = self.session.place_rows(cache, into, new.cache)
                mask = _left_pad(mask, length + 1)
                mask[into] = _left_pad(new.mask, length + 1)
                return cache, mask
            keep = list(placement.keep)
            cache = self.session.regroup_cache([(cache, keep), (new.cache, list(range(len(new.rows))))], length)
        return cache, np.concatenate([_left_pad(mask[keep], length + 1), _left_pad(new.mask, length + 1)])

    # -- the decode step -----------------------------------------------------------------------
    def choose(self, rows: list[Request | None]) -> list[Request]:
        """Choose every live row's next token (its request's sampling, grammar and stop ids) and emit it; returns the
        requests whose rows leave: finished, cancelled, failed (a request whose grammar fails ends alone)."""
        live = [r for r in rows if r is not None]
        for r in live:
            if r.cancelled:
                r.end("cancelled")
        try:  # every constrained row's mask at once (each row alone if one of them fails)
            allowed = masks([r.constraint for r in live], self.session.vocab_size)
        except KvforgeError:
            allowed = None
        leaving = []
        for k, r in enumerate(live):
            if r.done:
                leaving.append(r)
                continue
            row = self._rows[r]
            try:
                mask = None
                if r.constraint is not None:
                    mask = allowed[k:k + 1] if allowed is not None else masks([r.constraint], self.session.vocab_size)
                chosen = select(row.logits[None], [row.seen], r.config.sampling, [row.rng], mask)
                token = int(chosen[0])
                scored = step_logprobs(r.config, row.logits[None], chosen)
                finish = end_of(token, len(r.tokens) + 1, len(r.prompt), r.config, r.stop, self.session.max_context,
                                r.constraint)
            except KvforgeError as e:
                r.end("error", e)
                leaving.append(r)
                continue
            row.seen.append(token)
            r.emit(token, finish, None if scored is None else scored[0])
            if finish is not None:
                leaving.append(r)
        self.peak_batch = max(self.peak_batch, len(live))
        return leaving

    def decode(self, step: DecodePlan) -> None:
        """The leaving rows go; one decode step of the rest (a hole feeds a dummy token that attends to itself alone:
        its mask row is zeros between steps), with the plan's chunk in the same call (Session.forward_mixed), or the
        chunk alone where no row decodes. A prompt the chunk completes joins after."""
        if step.leave is not None:
            self._leave(step.finished, step.leave)
        chunk = step.chunk
        if not step.rows:
            if chunk is not None:
                self._feed(chunk)
                self._chunk_fed(step)
            return
        holes = step.holes
        if holes:
            self.mask[holes, -1] = 1
        nxt = np.array([[r.tokens[-1] if r is not None else 0] for r in step.rows], np.int64)
        adapters = [r.config.adapter if r is not None else None for r in step.rows]
        with self._timed("decode"):
            if chunk is None:
                logits, self.cache = self.session.forward(nxt, self.mask, cache=self.cache, last_logits_only=True,
                                                          adapters=adapters, inputs=self._inputs(zip(step.rows, nxt)))
            else:  # the rows' decode step and a prompt's chunk as one step: the backend reads its weights once
                p = self._prompts.setdefault(chunk.job, _Prompt())
                (logits, self.cache), (p.logits, p.cache) = self.session.forward_mixed(
                    (nxt, self.mask, self.cache), (*_piece(chunk.job.prompt, chunk.start, chunk.end), p.cache),
                    adapters=(adapters, chunk.job.config.adapters(1)))
                self.chunk_steps += 1
        for r, lg in zip(step.rows, logits[:, -1]):
            if r is not None:
                self._rows[r].logits = lg
        self.mask = _pending(self.mask)
        if holes:  # and holds nothing after it
            self.mask[holes] = 0
            self.cache = self.session.vacate_rows(self.cache, holes)
        self.steps += 1
        if chunk is not None:
            self._chunk_fed(step)

    def _chunk_fed(self, step: DecodePlan) -> None:
        """The chunk completed its prompt (the scheduler placed its row, or it speculates): its row."""
        if step.chunk.end == len(step.chunk.job.prompt):
            self._settle([self._complete(step.chunk.job)], step.joins)

    def _leave(self, leaving: list[Request], placement: Placement) -> None:
        """The leaving rows go (their blocks let go) as placed: holes, or the live rows regrouped. The leading
        positions that are now padding for every live row are dropped."""
        self.release(leaving)
        for r in leaving:
            del self._rows[r]
        live = list(placement.keep)
        if not live:
            self.cache = self.mask = None
            return
        first = int(self.mask[live].argmax(axis=1).min())  # the earliest real position of any live row
        length = self.cache.length - first
        if placement.regroup:
            with self._timed("copy"):
                self.cache = self.session.regroup_cache([(self.cache, live)], length)
            self.mask = self.mask[live, first:]
            return
        vacate = list(placement.vacate)
        self.mask[vacate] = 0
        self.cache = self.session.vacate_rows(self.cache, vacate)
        if first:
            with self._timed("copy"):  # a packed cache only forgets the columns; others copy what they keep
                try:
                    self.cache = self.session.drop_oldest(self.cache, first)
                except NotImplementedError:  # a backend that cannot drop positions (TensorRT): a regroup
                    self.cache = self.session.regroup_cache([(self.cache, list(range(self.mask.shape[0])))], length)
            self.mask = self.mask[:, first:]

    # -- speculating rows ----------------------------------------------------------------------
    def speculate(self, requests: list[Request]) -> list[Request]:
        """One speculative step of every speculating row (its first token, the first time), each over its own
        cache: its drafts checked in one forward at batch 1 (runtime/speculative.py). A row that fails ends alone.
        Returns those that ended (their blocks let go)."""
        ended = []
        for r in requests:
            if r.cancelled:
                r.end("cancelled")
            elif not r.done:
                self._speculate(r)
            if r.done:
                ended.append(r)
        self.release(ended)
        return ended

    def _speculate(self, r: Request) -> None:
        sp = r.speculator
        before = (sp.stats.steps, sp.stats.drafted, sp.stats.accepted)
        try:
            with self._timed("decode"):
                emitted = sp.step() if sp.tokens else sp.first()
        except KvforgeError as e:
            r.end("error", e)
            emitted = []
        for token, finish, scored in emitted:
            r.emit(token, finish, scored)
        self.speculation.steps += sp.stats.steps - before[0]
        self.speculation.drafted += sp.stats.drafted - before[1]
        self.speculation.accepted += sp.stats.accepted - before[2]
        self.speculation.tokens += len(emitted)

    # -- helpers ---------------------------------------------------------------------------------
    def _inputs(self, rows: Iterable[tuple[Optional[Request], np.ndarray]]) -> dict[str, np.ndarray] | None:
        """A step's graph inputs beyond the contract, for its rows ((request or None for a hole, its input ids)):
        each request's own (else the session's step_inputs), joined in row order (as the graph reads them: row by
        row, in reading order); None where the session's graph has none."""
        if self.session.step_inputs is None:
            return None
        return join_inputs([(r.inputs if r is not None and r.inputs is not None else self.session.step_inputs)(
            ids[None]) for r, ids in rows])

    @contextlib.contextmanager
    def _timed(self, what: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] += time.perf_counter() - start


def join_inputs(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Rows' graph inputs beyond the contract, joined in row order on their first axis (feature rows in reading
    order; per-row tensors batch first)."""
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def _row(r: Request, logits: np.ndarray) -> _Row:
    return _Row(r, list(r.prompt), np.random.default_rng(r.config.seed), logits)


def _after(part: _Part) -> Placement:
    """Rows that join after all of part's."""
    return Placement(tuple(range(len(part.rows))), regroup=True)


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
