"""The continuous batcher's scheduler: what each step runs, decided from the queue and the running rows alone.

It holds no session and calls no model (runtime/batch_executor.py runs its plans; runtime/batcher.py drives
both). Its state is bookkeeping: the admitted prompts and how many of their tokens are fed, the batch's rows (a
job per row, None for a hole) and the rows that speculate beside the batch. A step is planned in two halves,
since the rows that finish are known only once the executor has chosen their tokens:

- plan(): the prompts' part: cancelled prompts dropped, prefixes looked up as prefills begin, prompts fed within
  the step's token budget (whole together, or over their own caches, or one chunk riding the decode step), and
  where the completed prompts' rows join the batch (the holes they fill, or a regroup);
- decode(finished): the finished rows leave (holes, or a regroup when holes would outnumber the live rows), the
  rows that decode, and where the riding chunk's row joins once its prompt is complete.

A job is the scheduler's view of a request (runtime/batcher.py Request): `prompt` (only its length is read, and
what `lookup` reads), `reserve` (cache tokens it may come to hold), `cancelled`, `speculates` (it decodes as a
row of its own with a cache of its own, so it is never prefilled with others) and `apart` (its leading prompt
tokens that are fed apart, so that their blocks are cached before later positions push them out of a capped
window; 0: none). `lookup(job)` says how many of its prompt tokens its prefill restores from the prefix cache.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

Job = Any  # a Request, or anything with the attributes the module's doc lists


@dataclass(frozen=True)
class Feed:
    """Prompt tokens start..end of a job, fed over its own cache. keep_blocks: after it, the prompt's blocks up to
    `end` (those within a capped window) are cached."""

    job: Job
    start: int
    end: int
    keep_blocks: bool = False


@dataclass(frozen=True)
class Placement:
    """A change of the batch's rows. keep: the places of the rows that stay, in order. regroup: the cache is rebuilt
    from them (holes dropped; joining rows follow them), else it changes in place: joining rows fill the holes
    `fill`, leaving rows' places become the holes `vacate`."""

    keep: tuple[int, ...]
    regroup: bool = False
    fill: tuple[int, ...] = ()
    vacate: tuple[int, ...] = ()


@dataclass
class StepPlan:
    """The prompts' part of a step (Scheduler.plan), run in this order: restore the hits, run the feeds, prefill
    `whole`, then the completed prompts' rows join (those that speculate become rows of their own instead)."""

    admitted: list[Job] = field(default_factory=list)  # left the queue since the last plan, in arrival order
    dropped: list[Job] = field(default_factory=list)  # cancelled while waiting or prefilling: they end
    hits: dict[Job, int] = field(default_factory=dict)  # prefills that begin with cached blocks: prompt tokens
    feeds: list[Feed] = field(default_factory=list)  # over the prompts' own caches, in order
    whole: list[Job] = field(default_factory=list)  # prompts from scratch, prefilled together as one batch
    complete: list[Job] = field(default_factory=list)  # prompts the feeds complete, in order
    chunk: Optional[Feed] = None  # fed with the decode step (Scheduler.decode)
    joins: Optional[Placement] = None  # where the rows of `whole`, then of `complete`, join (less those that speculate)


@dataclass
class DecodePlan:
    """The decode part of a step (Scheduler.decode)."""

    leave: Optional[Placement]  # how the finished rows leave (None: none finished)
    rows: list[Optional[Job]]  # the rows that decode, in place order, None for a hole ([]: none: the chunk alone)
    chunk: Optional[Feed]  # the plan's chunk: in the decode call, or alone when no row decodes
    joins: Optional[Placement] = None  # the chunk completes its prompt: where its row joins, after the decode
    finished: list[Job] = field(default_factory=list)  # the rows that leave

    @property
    def holes(self) -> list[int]:
        return [i for i, job in enumerate(self.rows) if job is None]


@dataclass
class _Prefilling:
    job: Job
    fed: int = 0  # prompt tokens fed or restored
    started: bool = False  # its prefix is looked up (when its prefill begins, so that it finds what went before)


class Scheduler:
    """Plans the batcher's steps (see the module's doc). prefill_chunk: the step's token budget (the decoding rows'
    tokens count against it; None or 0: whole prompts); chunks_ride: a prompt's chunk may be fed in the decode
    step's call (not where the session takes inputs beyond the KV-cache contract)."""

    def __init__(self, max_batch: int, max_cache_tokens: int, prefill_chunk: int | None,
                 lookup: Callable[[Job], int] = lambda job: 0, chunks_ride: bool = True):
        self.max_batch = max_batch
        self.max_cache_tokens = max_cache_tokens
        self.prefill_chunk = prefill_chunk or None
        self.lookup = lookup
        self.chunks_ride = chunks_ride
        self.rows: list[Optional[Job]] = []  # the batch's rows: holes are None; a live row while there are rows
        self.speculating: list[Job] = []
        self._prefilling: collections.deque[_Prefilling] = collections.deque()  # admitted, prompt not all fed
        self._chunk: Feed | None = None  # planned to ride the next decode step
        self._admitted: list[Job] = []
        self._dropped: list[Job] = []

    # -- what is in flight ------------------------------------------------------------------
    @property
    def live(self) -> list[Job]:
        return [job for job in self.rows if job is not None]

    @property
    def prefilling(self) -> list[Job]:
        return [p.job for p in self._prefilling]

    def in_flight(self) -> list[Job]:
        """Every admitted job not finished: the batch's rows, prompts being prefilled, speculating rows."""
        return self.live + self.prefilling + self.speculating

    @property
    def running(self) -> int:
        return len(self.live) + len(self._prefilling) + len(self.speculating)

    @property
    def busy(self) -> bool:
        return bool(self.rows or self._prefilling or self.speculating)

    def clear(self) -> list[Job]:
        """Forget everything in flight (a failed step, closing); returns what was."""
        jobs = self.in_flight()
        self.rows, self.speculating, self._prefilling, self._chunk = [], [], collections.deque(), None
        return jobs

    # -- the step's halves --------------------------------------------------------------------
    def admit(self, queue: collections.deque) -> None:
        """Take the waiting jobs that fit now from the queue's head, in arrival order, while the batch has a free row
        and the cache-token budget holds their reservations (the first that does not fit waits, and those after
        it); cancelled ones are dropped. The next plan lists both."""
        held = sum(job.reserve for job in self.in_flight())
        while queue and self.running < self.max_batch:
            job = queue[0]
            if job.cancelled:
                self._dropped.append(queue.popleft())
                continue
            if held + job.reserve > self.max_cache_tokens:
                break
            self._prefilling.append(_Prefilling(queue.popleft()))
            self._admitted.append(job)
            held += job.reserve

    def plan(self) -> StepPlan:
        """Feed admitted prompts, at most the step's budget of tokens (budget None: all), in admission order. Prompts
        not begun that fit what is left of the budget whole and start with no cached block are prefilled together;
        a prompt that starts with cached blocks restores them and feeds only the rest; the first prompt that does
        not fit gets a chunk of the budget (riding the decode step where there are rows and it may) and waits for
        the next step with the prompts after it."""
        plan = StepPlan(self._admitted, self._dropped)
        self._admitted, self._dropped = [], []
        left = self._budget()
        done: list[_Prefilling] = []
        for p in list(self._prefilling):
            if left is not None and left <= 0:
                break
            job = p.job
            if job.cancelled:
                self._prefilling.remove(p)
                plan.dropped.append(job)
                continue
            if not p.started:
                p.started, p.fed = True, self.lookup(job)
                if p.fed:
                    plan.hits[job] = p.fed
            rest = len(job.prompt) - p.fed
            fed = rest if left is None else min(rest, left)
            if not p.fed and not job.apart and not job.speculates and fed == rest:
                plan.whole.append(job)  # a whole prompt from scratch: batched with the others
                done.append(p)
            elif self.rows and plan.chunk is None and not job.apart and self.chunks_ride:
                plan.chunk = self._chunk = Feed(job, p.fed, p.fed + fed)
            else:
                plan.feeds += _pieces(job, p.fed, p.fed + fed)
                if fed == rest:
                    plan.complete.append(job)
                    done.append(p)
            p.fed += fed
            if left is not None:
                left -= fed
        for p in done:
            self._prefilling.remove(p)
        plan.joins = self._join(plan.whole + plan.complete)
        return plan

    def decode(self, finished: list[Job]) -> DecodePlan:
        """The finished rows leave; the rest decode, with the plan's chunk (whose row then joins if its prompt is
        complete)."""
        leave = self._leave(finished) if finished else None
        chunk, self._chunk = self._chunk, None
        step = DecodePlan(leave, list(self.rows), chunk, finished=list(finished))
        if chunk is not None and chunk.end == len(chunk.job.prompt):
            self._prefilling.remove(next(p for p in self._prefilling if p.job is chunk.job))
            step.joins = self._join([chunk.job])
        return step

    def leave_speculating(self, jobs: list[Job]) -> None:
        """Speculating rows that finished."""
        self.speculating = [job for job in self.speculating if job not in jobs]

    # -- the rows -----------------------------------------------------------------------------
    def _budget(self) -> int | None:
        """The prompts' tokens this step: what the decoding rows leave of prefill_chunk, at least 1."""
        return max(1, self.prefill_chunk - len(self.live)) if self.prefill_chunk else None

    def _join(self, jobs: list[Job]) -> Placement | None:
        """Completed prompts' rows join (those that speculate become rows of their own): into holes where there are
        enough (only their own positions are copied), else after the live rows (a regroup, which drops the holes)."""
        self.speculating += [job for job in jobs if job.speculates]
        jobs = [job for job in jobs if not job.speculates]
        if not jobs:
            return None
        holes = [i for i, job in enumerate(self.rows) if job is None]
        live = tuple(i for i, job in enumerate(self.rows) if job is not None)
        if len(holes) >= len(jobs):
            into = tuple(holes[:len(jobs)])
            for i, job in zip(into, jobs):
                self.rows[i] = job
            return Placement(live, fill=into)
        self.rows = [self.rows[i] for i in live] + jobs
        return Placement(live, regroup=True)

    def _leave(self, jobs: list[Job]) -> Placement:
        """These rows leave. Their places become holes (nothing moves) unless holes would outnumber the live rows:
        then the live rows are regrouped without them."""
        places = tuple(i for i, job in enumerate(self.rows) if job is not None and job in jobs)
        for i in places:
            self.rows[i] = None
        live = tuple(i for i, job in enumerate(self.rows) if job is not None)
        if 2 * len(live) < len(self.rows):  # (no live row at all: an empty batch)
            self.rows = [self.rows[i] for i in live]
            return Placement(live, regroup=True)
        return Placement(live, vacate=places)


def _pieces(job: Job, start: int, end: int) -> list[Feed]:
    """A job's feed of start..end, cut where its blocks apart end (the feed that reaches them caches them)."""
    cut = job.apart
    if start < cut < end:
        return [Feed(job, start, cut, True), Feed(job, cut, end)]
    return [Feed(job, start, end, end == cut)]
