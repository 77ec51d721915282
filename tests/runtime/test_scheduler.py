"""The continuous batcher's scheduler on its own: plain jobs (prompt lengths, reservations), a chunk size, free rows
and a fake prefix-cache lookup in, exact step plans out. No session, no model."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvforge.runtime.scheduler import DecodePlan, Feed, Placement, Scheduler

BIG = 10 ** 6


@dataclass(eq=False)  # a job is itself: two with the same numbers are two requests
class Job:
    id: int
    tokens: int  # prompt length
    reserve: int = 0
    speculates: bool = False
    apart: int = 0
    cancelled: bool = False

    @property
    def prompt(self) -> range:
        return range(self.tokens)

    def __repr__(self) -> str:
        return f"Job{self.id}"


def _running(s: Scheduler, *jobs: Job) -> None:
    """jobs admitted and prefilled whole (prefill_chunk 0 for the occasion): rows of the batch, in order."""
    chunk, s.prefill_chunk = s.prefill_chunk, None
    s.admit(deque(jobs))
    s.plan()
    s.prefill_chunk = chunk
    assert s.rows == list(jobs)


def test_arrivals_are_admitted_in_order_within_the_rows_and_the_cache_token_budget():
    a, b, c = (Job(i, 10, reserve=100) for i in range(3))
    d = Job(3, 4, reserve=10)
    s = Scheduler(max_batch=3, max_cache_tokens=250, prefill_chunk=0)
    waiting = deque([a, b, c, d])
    s.admit(waiting)
    assert list(waiting) == [c, d]  # a and b hold 200 of 250: c waits, and d (which would fit) behind it
    plan = s.plan()
    assert plan.admitted == [a, b] and plan.whole == [a, b] and plan.feeds == [] and plan.chunk is None
    assert plan.joins == Placement((), regroup=True) and s.rows == [a, b]  # the first rows: the batch is theirs
    assert s.decode([]) == DecodePlan(None, [a, b], None)
    step = s.decode([a])  # a finished: its place becomes a hole, and its reservation is free
    assert step.leave == Placement((1,), vacate=(0,)) and step.rows == [None, b] and step.holes == [0]
    s.admit(waiting)
    assert list(waiting) == []  # c fits now, and d after it
    plan = s.plan()
    assert plan.admitted == [c, d] and plan.whole == [c, d]
    assert plan.joins == Placement((1,), regroup=True) and s.rows == [b, c, d]  # one hole, two rows: a regroup


def test_free_rows_bound_admission():
    jobs = [Job(i, 4, reserve=8) for i in range(3)]
    s = Scheduler(max_batch=2, max_cache_tokens=BIG, prefill_chunk=0)
    waiting = deque(jobs)
    s.admit(waiting)
    assert s.plan().admitted == jobs[:2] and list(waiting) == [jobs[2]] and s.running == 2
    s.decode([jobs[0]])
    s.admit(waiting)
    assert s.plan().admitted == [jobs[2]] and s.rows == [jobs[2], jobs[1]]


def test_a_cancelled_arrival_or_prompt_is_dropped_and_takes_no_row_or_budget():
    a, b, c = Job(1, 40), Job(2, 6), Job(3, 6)
    b.cancelled = True
    s = Scheduler(max_batch=2, max_cache_tokens=BIG, prefill_chunk=16)
    s.admit(deque([a, b, c]))
    plan = s.plan()
    assert plan.admitted == [a, c] and plan.dropped == [b]  # b took no row: c got the second
    assert plan.feeds == [Feed(a, 0, 16)] and plan.whole == [] and s.prefilling == [a, c]  # the budget went to a
    a.cancelled = True  # mid-prefill
    plan = s.plan()
    assert plan.dropped == [a] and plan.admitted == []
    assert plan.whole == [c] and plan.feeds == []  # a's tokens no longer count against the budget
    assert s.prefilling == [] and s.rows == [c] and s.in_flight() == [c]


def test_whole_prompts_batch_and_the_first_that_does_not_fit_is_chunked():
    a, b, long, d = Job(1, 5), Job(2, 7), Job(3, 30), Job(4, 3)
    s = Scheduler(max_batch=4, max_cache_tokens=BIG, prefill_chunk=16)
    s.admit(deque([a, b, long, d]))
    plan = s.plan()
    # no rows decode yet: the chunk is fed on its own, over the prompt's own cache; d waits behind it
    assert plan.whole == [a, b] and plan.feeds == [Feed(long, 0, 4)] and plan.complete == [] and plan.chunk is None
    assert s.rows == [a, b] and s.prefilling == [long, d]
    s.decode([])
    plan = s.plan()  # the budget less the two decoding rows: 14, a chunk that rides the decode step
    assert plan.chunk == Feed(long, 4, 18) and plan.feeds == [] and plan.whole == [] and plan.joins is None
    step = s.decode([])
    assert step.chunk == Feed(long, 4, 18) and step.rows == [a, b] and step.joins is None
    plan = s.plan()  # long takes 12 of 14; d does not fit whole in the 2 left, and a chunk rides already
    assert plan.chunk == Feed(long, 18, 30) and plan.whole == [] and plan.feeds == [Feed(d, 0, 2)]
    step = s.decode([b])  # b finishes in the step that completes long: long's row takes b's place after it
    assert step.leave == Placement((0,), vacate=(1,)) and step.rows == [a, None]
    assert step.chunk == Feed(long, 18, 30) and step.joins == Placement((0,), fill=(1,))
    assert s.rows == [a, long] and s.prefilling == [d]
    assert s.plan().chunk == Feed(d, 2, 3)  # begun: never batched from scratch
    step = s.decode([])
    assert step.rows == [a, long] and step.joins == Placement((0, 1), regroup=True) and s.rows == [a, long, d]


def test_the_step_budget_counts_the_decoding_rows_and_zero_prefills_whole():
    rows = [Job(i, 5) for i in range(3)]
    long = Job(9, 100)
    s = Scheduler(max_batch=4, max_cache_tokens=BIG, prefill_chunk=32)
    _running(s, *rows)
    s.admit(deque([long]))
    chunks = []
    while long in s.prefilling:
        chunks.append(s.plan().chunk)
        s.decode([])
    assert [(c.start, c.end) for c in chunks] == [(0, 29), (29, 58), (58, 87), (87, 100)]  # 32 - 3 rows a step
    assert s.rows == rows + [long]
    s = Scheduler(max_batch=4, max_cache_tokens=BIG, prefill_chunk=0)
    _running(s, *rows)
    s.admit(deque([long]))
    plan = s.plan()
    assert plan.whole == [long] and plan.chunk is None and s.rows == rows + [long]


def test_a_chunk_is_fed_alone_when_every_row_leaves():
    a, long = Job(1, 4), Job(2, 50)
    s = Scheduler(max_batch=4, max_cache_tokens=BIG, prefill_chunk=11)
    _running(s, a)
    s.admit(deque([long]))
    assert s.plan().chunk == Feed(long, 0, 10)
    step = s.decode([a])
    assert step.leave == Placement((), regroup=True) and step.rows == [] and step.chunk == Feed(long, 0, 10)
    assert s.rows == [] and s.busy and s.prefilling == [long]
    plan = s.plan()  # no rows: its next piece is a feed of its own, the whole budget
    assert plan.chunk is None and plan.feeds == [Feed(long, 10, 21)]


def test_chunks_do_not_ride_where_the_session_takes_its_own_inputs():
    a, long = Job(1, 4), Job(2, 50)
    s = Scheduler(max_batch=4, max_cache_tokens=BIG, prefill_chunk=11, chunks_ride=False)
    _running(s, a)
    s.admit(deque([long]))
    plan = s.plan()
    assert plan.chunk is None and plan.feeds == [Feed(long, 0, 10)]


def test_prefix_hits_are_looked_up_as_prefills_begin_and_only_the_rest_is_fed():
    hits = {2: 32, 3: 16}
    looked: list[int] = []

    def lookup(job):
        looked.append(job.id)
        return hits.get(job.id, 0)

    a, b, c, d = Job(1, 20), Job(2, 40), Job(3, 20), Job(4, 70)
    s = Scheduler(max_batch=4, max_cache_tokens=BIG, prefill_chunk=64, lookup=lookup)
    s.admit(deque([a, b, c, d]))
    plan = s.plan()
    assert plan.hits == {b: 32, c: 16}
    assert plan.whole == [a]  # a prompt with cached blocks is never batched from scratch
    assert plan.feeds == [Feed(b, 32, 40), Feed(c, 16, 20), Feed(d, 0, 32)]  # 20 + 8 + 4 + 32 = 64
    assert plan.complete == [b, c] and s.prefilling == [d]
    assert plan.joins == Placement((), regroup=True) and s.rows == [a, b, c]
    s.decode([])
    plan = s.plan()
    assert plan.hits == {} and plan.chunk == Feed(d, 32, 70) and looked == [1, 2, 3, 4]  # once each
    s = Scheduler(max_batch=4, max_cache_tokens=BIG, prefill_chunk=8, lookup=lookup)
    looked.clear()
    s.admit(deque([Job(5, 20), Job(6, 20)]))
    s.plan()
    assert looked == [5]  # the budget ran out before the second prompt's prefill began


def test_capped_window_blocks_are_fed_apart_and_never_batched_or_ridden():
    w, x = Job(1, 20, apart=8), Job(2, 5, apart=4)
    s = Scheduler(max_batch=4, max_cache_tokens=BIG, prefill_chunk=0)
    s.admit(deque([w, x]))
    plan = s.plan()
    assert plan.whole == []
    assert plan.feeds == [Feed(w, 0, 8, keep_blocks=True), Feed(w, 8, 20),
                          Feed(x, 0, 4, keep_blocks=True), Feed(x, 4, 5)]
    assert plan.complete == [w, x] and s.rows == [w, x]
    a, y = Job(3, 4), Job(4, 20, apart=16)
    s = Scheduler(max_batch=4, max_cache_tokens=BIG, prefill_chunk=13)
    _running(s, a)
    s.admit(deque([y]))
    plan = s.plan()  # 12 tokens: short of the blocks' end, and not in the decode step
    assert plan.chunk is None and plan.feeds == [Feed(y, 0, 12)]
    s.decode([])
    assert s.plan().feeds == [Feed(y, 12, 16, keep_blocks=True), Feed(y, 16, 20)]


def test_leaving_rows_become_holes_until_they_outnumber_the_live_ones():
    a, b, c, d, e, f = (Job(i, 3) for i in range(6))
    s = Scheduler(max_batch=8, max_cache_tokens=BIG, prefill_chunk=0)
    _running(s, a, b, c, d)
    step = s.decode([b])
    assert step.leave == Placement((0, 2, 3), vacate=(1,)) and step.rows == [a, None, c, d] and step.holes == [1]
    s.admit(deque([e, f]))  # two joiners, one hole: the batch is regrouped, holes dropped
    assert s.plan().joins == Placement((0, 2, 3), regroup=True) and s.rows == [a, c, d, e, f]
    assert s.decode([a, d]).leave == Placement((1, 3, 4), vacate=(0, 2))  # 3 live of 5
    step = s.decode([c, f])  # 1 live of 5: regrouped
    assert step.leave == Placement((3,), regroup=True) and step.rows == [e] and s.rows == [e]


def test_a_speculating_prompt_gets_a_row_of_its_own():
    sp, a = Job(1, 6, speculates=True, reserve=10), Job(2, 6, reserve=10)
    s = Scheduler(max_batch=4, max_cache_tokens=BIG, prefill_chunk=0)
    s.admit(deque([sp, a]))
    plan = s.plan()
    assert plan.whole == [a] and plan.feeds == [Feed(sp, 0, 6)] and plan.complete == [sp]
    assert plan.joins == Placement((), regroup=True)
    assert s.rows == [a] and s.speculating == [sp] and s.running == 2 and s.in_flight() == [a, sp]
    s.leave_speculating([sp])
    assert s.speculating == [] and s.running == 1


def test_a_speculating_prompt_completed_by_a_chunk_does_not_join():
    a, sp = Job(1, 3), Job(2, 20, speculates=True)
    s = Scheduler(max_batch=4, max_cache_tokens=BIG, prefill_chunk=0)
    _running(s, a)
    s.prefill_chunk = 30
    s.admit(deque([sp]))
    assert s.plan().chunk == Feed(sp, 0, 20)
    step = s.decode([])
    assert step.joins is None and s.rows == [a] and s.speculating == [sp] and s.prefilling == []


def test_reservations_of_rows_prompts_and_speculating_rows_hold_the_budget():
    a, sp, b = Job(1, 4, reserve=40), Job(2, 4, reserve=40, speculates=True), Job(3, 4, reserve=30)
    s = Scheduler(max_batch=8, max_cache_tokens=100, prefill_chunk=0)
    waiting = deque([a, sp, b])
    s.admit(waiting)
    s.plan()
    assert list(waiting) == [b]  # 40 + 40 + 30 > 100
    s.decode([a])
    s.admit(waiting)
    assert list(waiting) == [] and s.plan().admitted == [b]


def test_clear_forgets_everything_in_flight():
    a, long, w = Job(1, 3), Job(2, 40), Job(3, 3)
    s = Scheduler(max_batch=4, max_cache_tokens=BIG, prefill_chunk=10)
    _running(s, a)
    s.admit(deque([long, w]))
    s.plan()
    assert set(s.clear()) == {a, long, w}
    assert s.rows == [] and s.prefilling == [] and not s.busy and s.running == 0
    assert s.decode([]).chunk is None  # the chunk planned before is gone too
