"""Speculative decoding in Session.generate/stream: each step drafts up to k tokens (runtime/drafting.py), the target
checks them in one forward over its cache, keeps what it accepts and cuts its cache back to that
(Session.rollback).

One row at a time: a step feeds 1 + k tokens over the row's cache (GroupQueryAttention's packed cache takes
several new tokens over a past at batch 1 only), and rows accept different numbers of tokens. A list of prompts
runs its rows one after another, each with what it would get alone. Greedy output is token for token what plain
decoding gives (to the rounding of a k + 1-token step against a 1-token step); sampling follows the target's
distribution (drafting.verify).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import numpy as np

from .drafting import keep, verify
from .generate import GenerationConfig, GenerationResult, RowState, check_prompts, end_of, step_logprobs, token_events
from .sampling import select

if TYPE_CHECKING:  # pragma: no cover
    from .session import Session


@dataclass
class SpeculationStats:
    """What speculation did for one row: steps (target forwards after the prefill), tokens drafted and accepted."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens generated (the prefill's first one included)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted, "tokens": self.tokens,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
                "tokens_per_step": (self.tokens - 1) / self.steps if self.steps else None}


Emitted = tuple  # (token, finish reason or None, (log-probability, top alternatives) or None)


class Speculator:
    """One row's speculative decoding after its prompt's prefill: its cache (all of the context but its last
    token), drafter, generators and stats. first() chooses the first token from the prefill's logits; each step()
    drafts, verifies in one forward, cuts the cache back, and returns the tokens it emits (up to the one that
    ends the row). Session.generate/stream and the continuous batcher both run rows through it."""

    def __init__(self, session: Session, prompt: list[int], config: GenerationConfig, stop: set[int], drafter,
                 cache, logits: np.ndarray, stats: SpeculationStats | None = None):
        self.session, self.config, self.stop, self.drafter = session, config, stop, drafter
        self.prompt, self.tokens = list(prompt), []
        self.cache, self.logits = cache, logits  # logits (V,): the prefill's last position
        self.stats = stats or SpeculationStats()
        self.rng = np.random.default_rng(config.seed)
        self.draft_rng = np.random.default_rng(None if config.seed is None else [config.seed, 1])
        self.finish: str | None = None
        self.k = config.speculation.k  # tokens to draft next (adaptive: moves with what is accepted, up to k)

    def _emit(self, tokens: list[int], logits: np.ndarray) -> list[Emitted]:
        """The tokens in order until one ends the row (logits[i]: the raw logits token i was chosen from)."""
        out = []
        for i, token in enumerate(tokens):
            self.tokens.append(token)
            scored = step_logprobs(self.config, logits[i:i + 1], np.asarray([token]))
            self.finish = end_of(token, len(self.tokens), len(self.prompt), self.config, self.stop,
                                 self.session.max_context, None)
            out.append((token, self.finish, None if scored is None else scored[0]))
            if self.finish:
                self.drafter.close()
                break
        self.stats.tokens += len(out)
        return out

    def first(self) -> list[Emitted]:
        token = int(select(self.logits[None], [np.asarray(self.prompt, np.int64)], self.config.sampling, [self.rng])[0])
        return self._emit([token], self.logits[None])

    def step(self) -> list[Emitted]:
        s, config = self.session, self.config
        context = self.prompt + self.tokens  # the cache holds all but its last token
        k = min(self.k, config.max_new_tokens - len(self.tokens) - 1, s.max_context - len(context))
        drafts, q = self.drafter.propose(context, k, config.sampling, self.draft_rng) if k > 0 else ([], None)
        feed = [context[-1], *drafts]
        logits, after = s.forward(np.asarray([feed], np.int64), cache=self.cache, adapters=config.adapters(1))
        out = verify(logits[0], drafts, q, context, config.sampling, self.rng)
        self.stats.steps += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += len(out) - 1
        if config.speculation.adaptive and drafts:
            self.k = min(self.k + 2, config.speculation.k) if len(out) - 1 == len(drafts) else max(1, self.k - 1)
        emitted = self._emit(out, logits[0])
        if not self.finish:  # keep the context's last token and the accepted drafts
            self.cache = keep(s, self.cache, after, len(context) + len(out) - 1, feed, config.adapters(1))
        return emitted


def speculative_rows(session: Session, prompt: list[int], config: GenerationConfig, stop: set[int], drafter,
                     stats: SpeculationStats) -> Iterator[list[RowState]]:
    """One row's generation with speculation; yields [row] after every step (the last yield is final)."""
    check_prompts(session, [prompt])
    logprobs = config.logprobs is not None
    row = RowState(list(prompt), logprobs=[] if logprobs else None, top=[] if logprobs else None)
    if config.max_new_tokens == 0:
        yield [row]
        return
    logits, cache = session.forward(np.asarray([prompt], np.int64), last_logits_only=True, adapters=config.adapters(1))
    speculator = Speculator(session, prompt, config, stop, drafter, cache, logits[0, -1], stats)
    emitted = speculator.first()
    while True:
        for token, finish, scored in emitted:
            row.tokens.append(token)
            if scored is not None:
                row.logprobs.append(scored[0])
                row.top.append(scored[1])
            row.finish = finish
        yield [row]
        if row.finish:
            return
        emitted = speculator.step()


def generate_speculative(session: Session, prompts: list[list[int]], config: GenerationConfig, stop: set[int],
                         make_drafter, stream: bool = False):
    """Session.generate/stream with config.speculation: results (each with its speculation stats), or (stream)
    the one row's TokenEvents. make_drafter() makes a fresh drafter for each row."""
    if stream:
        return token_events(speculative_rows(session, prompts[0], config, stop, make_drafter(), SpeculationStats()))
    check_prompts(session, prompts)
    results = []
    for prompt in prompts:
        stats = SpeculationStats()
        rows = None
        for rows in speculative_rows(session, prompt, config, stop, make_drafter(), stats):
            pass
        r = rows[0]
        results.append(GenerationResult(r.tokens, r.finish or "length", len(r.prompt), "", r.logprobs, r.top,
                                        stats.as_dict()))
    return results
