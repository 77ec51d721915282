"""Speculative decoding's parts that know nothing of the loop: what a request asks for (`Speculation`), the drafters
that propose tokens, and the acceptance rule that keeps the target model's output exact.

A drafter proposes up to k tokens that may follow a context; the target then checks all of them in one forward
(runtime/speculative.py). Drafters are registered in DRAFTERS by method name, each a `DrafterKind`: how to make
one, where its draft bundle is (none, the request's, or one found beside the target), its default k, and whether
the request names a draft:

- "prompt-lookup": the tokens that followed the latest earlier occurrence of the context's last n-gram (n from
  `ngram` down to 1), in the prompt or the output so far. Costs no model call; pays off where the output copies
  the input (rewrites, summaries, code edits).
- "draft": another decoder bundle with the same tokenizer (checked: `check_vocabularies`) runs ahead greedily, or
  sampling with the request's settings; its cache follows the accepted tokens (Session.rollback).
- "quantized": "draft" with the target's own calibrated sibling (`quantized_sibling`: a bundle beside the
  target whose lineage says it was calibrated from the target's graph; INT4 first, as it reads the fewest bytes).

The acceptance rule (`verify`): greedy keeps a drafted token while it equals the target's argmax, then adds the
target's own token; sampling uses speculative sampling (Leviathan et al., Chen et al.): accept drafted token d
with probability min(1, p(d) / q(d)), else draw from max(0, p - q) normalized, and after all k accepted draw a
bonus token from the target. p is the target's distribution after the request's repetition penalty,
temperature, top-k and top-p (sampling.probabilities); q is the drafter's (one-hot for prompt lookup). The
tokens out are then distributed as the target's own draws.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvforge.bundle import Bundle
from kvforge.checks import is_int
from kvforge.errors import KvforgeError

from .sampling import SamplingConfig, draw, probabilities, select

if TYPE_CHECKING:  # pragma: no cover
    from .backend import KVCache
    from .session import Session

MAX_K = 32


@dataclass(frozen=True)
class Speculation:
    """What a request asks of speculative decoding: the method, how many tokens a step drafts (k), the longest
    n-gram prompt lookup matches, and the draft bundle (a path, or an open Session) for "draft"."""

    method: str
    k: int
    ngram: int = 3
    draft: Any = None
    # adapt the tokens drafted per step to what is accepted (Hugging Face's assisted generation "heuristic"
    # schedule): one fewer after a step that rejected any, two more (up to k) after one that accepted all
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in DRAFTERS:
            raise KvforgeError(f"speculative method {self.method!r} is not one of {list(DRAFTERS)}")
        if not is_int(self.k) or not 1 <= self.k <= MAX_K:
            raise KvforgeError(f"speculative k (tokens drafted per step) must be an int in 1..{MAX_K}, got {self.k!r}")
        if not is_int(self.ngram) or not 1 <= self.ngram <= 16:
            raise KvforgeError(f"speculative ngram must be an int in 1..16, got {self.ngram!r}")
        if DRAFTERS[self.method].named_draft != (self.draft is not None):
            raise KvforgeError(f"speculative method {self.method!r} takes a draft bundle (draft=PATH)"
                               if self.draft is None else f"speculative method {self.method!r} takes no draft bundle")
        if not isinstance(self.adaptive, bool):
            raise KvforgeError(f"speculative adaptive must be true or false, got {self.adaptive!r}")
        if self.draft is not None and not isinstance(self.draft, (str, Path)) and not hasattr(self.draft, "forward"):
            raise KvforgeError(f"a draft is a bundle path or an open decoder Session, got {type(self.draft).__name__}")


def parse_speculative(value) -> Speculation | None:
    """None, a Speculation, "prompt-lookup", "quantized", "draft:PATH", or a dict {"method", "k", "ngram",
    "draft", "adaptive"} (k defaults per method: DrafterKind.default_k)."""
    if value is None or isinstance(value, Speculation):
        return value
    if isinstance(value, str):
        if value in ("", "none"):
            return None
        if value.startswith("draft:"):
            value = {"method": "draft", "draft": value[len("draft:"):]}
        else:
            value = {"method": value}
    if not isinstance(value, dict):
        raise KvforgeError(f"speculative takes 'prompt-lookup', 'quantized', 'draft:PATH' or a dict, got {value!r}")
    unknown = sorted(set(value) - {"method", "k", "ngram", "draft", "adaptive"})
    if unknown:
        raise KvforgeError(f"unknown speculative option(s) {unknown}; it takes method, k, ngram, draft, adaptive")
    method = value.get("method")
    if method not in DRAFTERS:
        raise KvforgeError(f"speculative method {method!r} is not one of {list(DRAFTERS)} (or draft:PATH)")
    return Speculation(method, value.get("k") or DRAFTERS[method].default_k, value.get("ngram", 3), value.get("draft"),
                       value.get("adaptive", True))


def speculation_options(value, k: int = 0, ngram: int | None = None) -> dict | None:
    """parse_speculative(value) as the dict GenerationConfig.speculative takes (None: none), with k (0: the
    method's default) and ngram (None: the value's) set: what the CLI's options and BatchOptions make."""
    spec = parse_speculative(value)
    if spec is None:
        return None
    return {"method": spec.method, "k": k or spec.k, "ngram": spec.ngram if ngram is None else ngram, "draft": spec.draft}


# -- drafters ------------------------------------------------------------------------------------------------
class PromptLookup:
    """Drafts the tokens that followed the latest earlier occurrence of the context's last n tokens (the longest n
    up to `ngram` that occurs). A match of one token drafts one token: the token after the last is a weak guess (on
    SmolLM2's rewrites, summaries and code edits its first drafted token was right 22% of the time, against 49% for
    two-token matches and 81% for three), and a step verifying k guesses costs more than one verifying one."""

    def __init__(self, ngram: int = 3):
        self.ngram = ngram

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, rng) -> tuple[list[int], None]:
        ids = np.asarray(context, np.int64)
        for n in range(min(self.ngram, len(ids) - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every n-gram that has a follower
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start:start + (k if n > 1 else 1)].tolist(), None
        return [], None

    def close(self) -> None:
        pass


class DraftModel:
    """Drafts with another decoder Session, greedily or sampling; its cache follows the accepted context."""

    def __init__(self, session: Session, vocab_size: int):
        self.session = session
        self.vocab = min(vocab_size, session.vocab_size)  # tokens both models have
        self.target_vocab = vocab_size
        self.cache: KVCache | None = None  # holds self.held
        self.anchor: KVCache | None = None  # holds the context of the last proposal (what rollback cuts back to)
        self.held: list[int] = []

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, rng) -> tuple[list[int], np.ndarray | None]:
        s = self.session
        k = min(k, s.max_context - len(context))
        if k < 1:
            return [], None
        same = 0
        for a, b in zip(self.held, context[:-1]):  # at least the last token is fed anew (its logits are needed)
            if a != b:
                break
            same += 1
        cache = None
        if self.cache is not None and self.anchor is not None and same >= self.anchor.length:
            cache = keep(s, self.anchor, self.cache, same, self.held[self.anchor.length:])
        elif same:  # the context left the anchor behind (not in one generation's loop): start over
            same = 0
        logits, cache = s.forward(np.asarray([context[same:]], np.int64), cache=cache, last_logits_only=True)
        self.anchor, held = cache, list(context)
        drafts, qs = [], []
        for i in range(k):
            last = logits[:, -1, :self.vocab]
            history = np.asarray(held + drafts, np.int64)
            seen = [history[history < self.vocab]]  # (ids only the target has cannot be penalized here)
            if sampling.temperature == 0.0:
                token = int(select(last, seen, sampling, [rng])[0])
            else:
                q = probabilities(last, seen, sampling)
                token = int(draw(q, [rng])[0])
                qs.append(np.pad(q[0], (0, self.target_vocab - self.vocab)))
            drafts.append(token)
            if i < k - 1:
                logits, cache = s.forward(np.asarray([[token]], np.int64), cache=cache, last_logits_only=True)
                held.append(token)
        self.cache, self.held = cache, held
        return drafts, np.stack(qs) if qs else None

    def close(self) -> None:
        self.cache = self.anchor = None


def keep(session: Session, before: KVCache, after: KVCache, length: int, tokens: list[int],
         adapters: list[str | None] | None = None) -> KVCache:
    """`after` (before continued by `tokens`) cut back to `length` positions: Session.rollback, or where a capped
    window let go of positions it needs, the kept tokens fed over `before` again (with the row's `adapters`)."""
    if length == after.length:
        return after
    try:
        return session.rollback(before, after, length)
    except NotImplementedError:
        if length == before.length:
            return before
        _, cache = session.forward(np.asarray([tokens[:length - before.length]], np.int64), cache=before,
                                   last_logits_only=True, adapters=adapters)
        return cache


@dataclass(frozen=True)
class DrafterKind:
    """A drafting method: `make(spec, target session, draft session or None)` makes a fresh drafter;
    `draft(spec, target bundle path)` says where its draft bundle is (a path, an open Session, or None: it needs
    none); `default_k` is its tokens per step; `named_draft`: the request names the draft (spec.draft)."""

    make: Callable[[Speculation, Any, Any], Any]
    draft: Callable[[Speculation, Path], Any]
    default_k: int
    named_draft: bool = False


def _draft_model(spec: Speculation, target, draft) -> DraftModel:
    return DraftModel(draft, target.vocab_size)


DRAFTERS = {
    "prompt-lookup": DrafterKind(lambda spec, target, draft: PromptLookup(spec.ngram), lambda spec, target: None, 8),
    "draft": DrafterKind(_draft_model, lambda spec, target: spec.draft, 4, named_draft=True),
    "quantized": DrafterKind(_draft_model, lambda spec, target: quantized_sibling(target), 4),
}


# -- the acceptance rule -------------------------------------------------------------------------------------
def verify(logits: np.ndarray, drafts: list[int], q: np.ndarray | None, seen: list[int], sampling: SamplingConfig,
           rng) -> list[int]:
    """The tokens one verification step emits: the accepted drafts, then the target's correction (at the first
    rejection) or bonus token (all accepted). logits (len(drafts) + 1, V): the target's raw logits after the
    context's last token and after each draft; q (len(drafts), V): the drafter's distributions (None: each
    draft was certain, as prompt lookup's)."""
    out: list[int] = []
    for i in range(len(drafts) + 1):
        history = [np.asarray(seen + out, np.int64)]
        row = logits[i:i + 1]
        if sampling.temperature == 0.0:
            token = int(select(row, history, sampling, [rng])[0])
            out.append(token)
            if i == len(drafts) or token != drafts[i]:
                return out
            continue
        p = probabilities(row, history, sampling)[0]
        if i == len(drafts):  # every draft accepted: the bonus token
            out.append(int(draw(p[None], [rng])[0]))
            return out
        d = drafts[i]
        qd = 1.0 if q is None else float(q[i, d])
        if rng.random() * qd < p[d]:  # accept with probability min(1, p(d) / q(d))
            out.append(d)
            continue
        if q is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q[i], 0.0)
        total = residual.sum()
        out.append(int(draw((residual / total if total > 0 else p)[None], [rng])[0]))
        return out
    return out


# -- drafts from bundles -------------------------------------------------------------------------------------
def check_vocabularies(target: Session, draft: Session) -> None:
    """A draft must read and write the target's token ids: both tokenizers' vocabularies (added tokens included)
    are the same map."""
    if target.tokenizer is None or draft.tokenizer is None:
        raise KvforgeError(f"speculative decoding checks that the draft's vocabulary is the target's; "
                           f"{draft.source if draft.tokenizer is None else target.source} has no tokenizer to check")
    a = target.tokenizer.backend.get_vocab(with_added_tokens=True)
    b = draft.tokenizer.backend.get_vocab(with_added_tokens=True)
    if a != b:
        only = sorted(set(a.items()) ^ set(b.items()))[:4]
        raise KvforgeError(f"the draft {draft.source} has another vocabulary than {target.source} ({len(b)} vs "
                           f"{len(a)} tokens; differing entries such as {only}): a draft must share the target's "
                           "tokenizer")


_PRECISION_ORDER = {"int4": 0, "int8": 1, "fp8": 2}


def quantized_sibling(target: Path) -> Path:
    """The bundle beside the bundle `target` (in its parent directory) calibrated from target's graph: INT4 first,
    then INT8, then FP8, then the smallest graph."""
    if not Bundle.is_bundle(target):
        raise KvforgeError(f"speculative 'quantized' looks for a calibrated bundle beside the bundle it drafts for; "
                           f"{target} is not a bundle (pass draft:PATH)")
    graph_sha256 = Bundle(target).graph_sha256
    found = []
    for manifest in sorted(target.resolve().parent.glob("*/kvforge.json")):
        try:
            m = json.loads(manifest.read_text())
            last = (m.get("lineage") or [{}])[-1]
            if last.get("stage") != "calibrate" or (last.get("input") or {}).get("sha256") != graph_sha256:
                continue
            precision = str((last.get("options") or {}).get("precision"))
            size = sum(int(r.get("size", 0)) for r in (m.get("files") or {}).values())
        except (OSError, ValueError, AttributeError, TypeError):
            continue  # not a readable bundle: not a candidate
        found.append((_PRECISION_ORDER.get(precision, 3), size, manifest.parent))
    if not found:
        raise KvforgeError(f"speculative 'quantized' found no bundle beside {target} calibrated from it (looked for "
                           f"*/kvforge.json in {target.resolve().parent} whose last lineage step calibrates "
                           f"{graph_sha256[:12]}); calibrate one there (`kvforge calibrate {target} OUT --precision "
                           "int4`) or pass draft:PATH")
    return min(found)[2]
