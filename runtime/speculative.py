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
from .generate import GenerationConfig, GenerationResult, _events, _Row, check_prompts, end_of, step_logprobs
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


def _take(row: _Row, tokens: list[int], logits: np.ndarray, config: GenerationConfig, stop: set[int],
          context: int) -> int:
    """Append tokens to the row one by one (logits[i]: the raw logits token i was chosen from) until one ends it;
    how many it took."""
    for i, token in enumerate(tokens):
        row.tokens.append(token)
        scored = step_logprobs(config, logits[i:i + 1], np.asarray([token]))
        if scored is not None:
            row.logprobs.append(scored[0][0])
            row.top.append(scored[0][1])
        row.finish = end_of(token, len(row.tokens), len(row.prompt), config, stop, context, None)
        if row.finish:
            return i + 1
    return len(tokens)


def speculative_rows(session: Session, prompt: list[int], config: GenerationConfig, stop: set[int], drafter,
                     stats: SpeculationStats) -> Iterator[list[_Row]]:
    """One row's generation with speculation; yields [row] after every step (the last yield is final)."""
    check_prompts(session, [prompt])
    spec = config.speculation
    logprobs = config.logprobs is not None
    row = _Row(list(prompt), logprobs=[] if logprobs else None, top=[] if logprobs else None)
    if config.max_new_tokens == 0:
        yield [row]
        return
    rng = np.random.default_rng(config.seed)
    draft_rng = np.random.default_rng(None if config.seed is None else [config.seed, 1])
    logits, cache = session.forward(np.asarray([prompt], np.int64), last_logits_only=True)
    first = int(select(logits[:, -1], [np.asarray(prompt, np.int64)], config.sampling, [rng])[0])
    stats.tokens += _take(row, [first], logits[:, -1], config, stop, session.max_context)
    yield [row]
    while not row.finish:
        context = row.prompt + row.tokens  # the cache holds all but its last token
        k = min(spec.k, config.max_new_tokens - len(row.tokens) - 1, session.max_context - len(context))
        drafts, q = drafter.propose(context, k, config.sampling, draft_rng) if k > 0 else ([], None)
        feed = [context[-1], *drafts]
        logits, after = session.forward(np.asarray([feed], np.int64), cache=cache)
        out = verify(logits[0], drafts, q, context, config.sampling, rng)
        taken = _take(row, out, logits[0], config, stop, session.max_context)
        stats.steps += 1
        stats.drafted += len(drafts)
        stats.accepted += len(out) - 1
        stats.tokens += taken
        yield [row]
        if not row.finish:  # keep the context's last token and the accepted drafts
            cache = keep(session, cache, after, len(context) + len(out) - 1, feed)
    drafter.close()


def generate_speculative(session: Session, prompts: list[list[int]], config: GenerationConfig, stop: set[int],
                         make_drafter, stream: bool = False):
    """Session.generate/stream with config.speculation: results (each with its speculation stats), or (stream)
    the one row's TokenEvents. make_drafter() makes a fresh drafter for each row."""
    if stream:
        return _events(speculative_rows(session, prompts[0], config, stop, make_drafter(), SpeculationStats()))
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
