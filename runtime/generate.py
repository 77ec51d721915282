"""The generation loop: a left-padded prefill, then one cached decode step per token."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import numpy as np

from kvforge.adapters import check_name
from kvforge.checks import is_int
from kvforge.errors import KvforgeError

from .constrain import Constraint, ResponseFormat, constraint, masks, parse_response_format
from .drafting import parse_speculative
from .sampling import SamplingConfig, select, token_logprobs

if TYPE_CHECKING:  # pragma: no cover
    from kvforge.tokenizer import Tokenizer

    from .session import Session

MAX_TOP_LOGPROBS = 20


@dataclass
class GenerationConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop_token_ids: Sequence[int] = ()  # in addition to the model's EOS tokens
    ignore_eos: bool = False  # keep going past EOS (benchmarks, comparisons with a fixed length)
    seed: int | None = None  # seeds sampling; same seed, same tokens
    # Constrained decoding (runtime/constrain.py): OpenAI's {"type": "text" | "json_object"} or
    # {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, and kvforge's {"type": "regex",
    # "regex": ...}, {"type": "grammar", "grammar": <Lark (llguidance's dialect) or GBNF>} and {"type": "structural",
    # "begin": ..., "schema": {...}, "end": ...}. Each token is chosen among those the format allows; the row ends
    # ("stop") when the format is complete. Checked (and compiled) here: a bad one raises KvforgeError.
    response_format: dict | None = None
    # None: no log-probabilities; k (0..20): each generated token's log-probability and the k most likely tokens'
    # (id, log-probability). They are the log-softmax of the model's raw logits at that step: before the repetition
    # penalty, temperature, top-k/top-p and the response format's mask (what vLLM returns by default).
    logprobs: int | None = None
    # Speculative decoding (runtime/drafting.py): "prompt-lookup", "quantized" (the bundle's own calibrated
    # sibling drafts), "draft:PATH" (a bundle with the same tokenizer), or a dict {"method", "k", "ngram",
    # "draft"} (draft: a path or an open Session). The output is the target's: greedy token for token, sampling
    # in distribution.
    speculative: Any = None
    # A LoRA adapter of the bundle (kvforge lora add; the bundle exported with --lora-max-rank) by name: every row
    # of the call runs with it. None: the base model.
    adapter: str | None = None

    def __post_init__(self):
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise KvforgeError(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        if self.seed is not None and (not is_int(self.seed) or self.seed < 0):
            raise KvforgeError(f"seed must be an int >= 0 or None, got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(self.stop_token_ids, Iterable):
            raise KvforgeError(f"stop_token_ids takes a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        bad = [t for t in self.stop_token_ids if not is_int(t) or t < 0]
        if bad:
            raise KvforgeError(f"stop_token_ids must be token ids (ints >= 0), got {bad[:8]}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise KvforgeError(f"logprobs must be None or an int in 0..{MAX_TOP_LOGPROBS} (how many alternatives to "
                               f"report per token), got {self.logprobs!r}")
        if self.adapter is not None:
            check_name(self.adapter)
        self.sampling = SamplingConfig(self.temperature, self.top_k, self.top_p, self.repetition_penalty)
        self.format = parse_response_format(self.response_format)
        self.speculation = parse_speculative(self.speculative)
        if self.speculation is not None and self.format is not None:
            raise KvforgeError("speculative decoding does not combine with a response_format yet: the grammar "
                               "would have to follow drafted tokens back; ask for one or the other")

    def adapters(self, rows: int) -> list[str | None] | None:
        """Session.forward's adapters for `rows` rows of this call."""
        return None if self.adapter is None else [self.adapter] * rows

    @classmethod
    def from_kwargs(cls, **kwargs) -> GenerationConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise KvforgeError(f"unknown generation option(s) {unknown}; options: {sorted(known)}")
        return cls(**kwargs)


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids, prompt excluded (a stop token that ended it included)
    # "stop" (a stop token, or the response format complete), "length" (max_new_tokens) or "context" (the
    # bundle's max context)
    finish_reason: str
    prompt_tokens: int
    text: str = ""
    logprobs: list[float] | None = None  # each token's log-probability (config.logprobs not None)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # each token's k most likely (id, log-probability)
    speculation: dict | None = None  # with config.speculative: SpeculationStats.as_dict() (runtime/speculative.py)


@dataclass
class TokenEvent:
    token: int
    index: int  # 0 for the first generated token
    last: bool  # no token follows
    finish_reason: str | None = None
    text: str = ""
    logprob: float | None = None  # config.logprobs not None: this token's log-probability
    top_logprobs: list[tuple[int, float]] | None = None  # and the k most likely tokens' (id, log-probability)


@dataclass
class RowState:
    """One row of a generation loop: its prompt, what it generated so far, and why it ended."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None
    constraint: Constraint | None = None


def row_constraints(fmt: ResponseFormat | None, tokenizer, vocab_size: int, stop: set[int], n: int) -> list[Constraint | None]:
    """One fresh matcher per row for a response format (the format compiled once), or None per row."""
    if fmt is None:
        return [None] * n
    return [constraint(fmt, tokenizer, vocab_size, stop) for _ in range(n)]


def step_logprobs(config: GenerationConfig, logits: np.ndarray, chosen: np.ndarray):
    """Per row (log-probability, top alternatives) of the chosen tokens, or None when not asked for."""
    if config.logprobs is None:
        return None
    return token_logprobs(logits, chosen, config.logprobs)


def end_of(token: int, generated: int, prompt: int, config: GenerationConfig, stop: set[int], context: int,
           row: Constraint | None) -> str | None:
    """finish_reason, and "stop" when the token completes the row's response format (the matcher takes it)."""
    if row is not None and token not in stop and row.advance(token):
        return "stop"
    return finish_reason(token, generated, prompt, config, stop, context)


def generate_tokens(
    session: Session, prompts: list[list[int]], config: GenerationConfig, stop: set[int], stream: bool = False
):
    """Run the loop; returns results, or (stream=True) an iterator of TokenEvents for one row."""
    it = _loop(session, prompts, config, stop)
    if stream:
        return token_events(it)
    rows = None
    for rows in it:
        pass
    return [GenerationResult(r.tokens, r.finish or "length", len(r.prompt), "", r.logprobs, r.top) for r in rows]


def token_events(it) -> Iterator[TokenEvent]:
    """One TokenEvent per token of the first row, whatever number of tokens each step added (a speculative step
    adds several); each is held back until the next is known, so that the last one says it is."""
    pending = None
    for rows in it:
        row = rows[0]
        for index in range(pending.index + 1 if pending is not None else 0, len(row.tokens)):
            if pending is not None:
                yield pending
            pending = TokenEvent(row.tokens[index], index, False)
            if row.logprobs is not None:
                pending.logprob, pending.top_logprobs = row.logprobs[index], row.top[index]
        if row.finish and pending is not None:  # (a finish without a new token: the same token, now the last)
            pending.last, pending.finish_reason = True, row.finish
    if pending is not None:
        if not pending.last:
            pending.last, pending.finish_reason = True, "length"
        yield pending


def check_prompts(session: Session, prompts: list[list[int]]) -> None:
    """Each prompt has a token, only ids inside the vocabulary, and fits the context."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise KvforgeError("every prompt needs at least one token")
    vocab = session.vocab_size
    for p in prompts:
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise KvforgeError(f"prompt token ids {bad[:8]} are outside the vocabulary (0..{vocab - 1})")
    longest = max(len(p) for p in prompts)
    if longest > session.max_context:
        raise KvforgeError(f"a prompt of {longest} tokens exceeds the bundle's maximum context of {session.max_context}")


def left_padded(session: Session, prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """A prefill batch: ids left-padded to the longest prompt, and the mask of real tokens (positions count those)."""
    longest = max(len(p) for p in prompts)
    ids = np.full((len(prompts), longest), session.config.get("pad_token_id") or 0, np.int64)
    mask = np.zeros((len(prompts), longest), np.int64)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = p
        mask[i, longest - len(p):] = 1
    return ids, mask


def right_padded(rows: list[list[int]], pad: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Encoder inputs: ids right-padded (with `pad`, or 0) to the longest row, and the mask of real tokens."""
    longest = max(len(r) for r in rows)
    ids = np.full((len(rows), longest), pad or 0, np.int64)
    mask = np.zeros((len(rows), longest), np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    return ids, mask


def finish_reason(token: int, generated: int, prompt: int, config: GenerationConfig, stop: set[int], context: int) -> str | None:
    """Why a row ends with `token`, its `generated`-th new token after a `prompt`-token prompt (None: it goes on)."""
    if token in stop:
        return "stop"
    if generated >= config.max_new_tokens:
        return "length"
    if prompt + generated >= context:  # this row's own sequence fills the context
        return "context"
    return None


def _loop(session: Session, prompts: list[list[int]], config: GenerationConfig, stop: set[int]):
    """Yield the rows after every step (the last yield is final)."""
    check_prompts(session, prompts)
    constraints = row_constraints(config.format, session.tokenizer, session.vocab_size, stop, len(prompts))
    logprobs = config.logprobs is not None
    rows = [RowState(list(p), logprobs=[] if logprobs else None, top=[] if logprobs else None, constraint=c)
            for p, c in zip(prompts, constraints)]
    if config.max_new_tokens == 0:
        yield rows
        return
    B = len(rows)
    rngs = [np.random.default_rng(config.seed) for _ in rows]  # one per row: a row samples what it would alone
    ids, mask = left_padded(session, prompts)
    adapters = config.adapters(B)
    logits, cache = session.forward(ids, mask, last_logits_only=True, adapters=adapters)
    seen = [np.asarray(r.prompt, np.int64) for r in rows]
    last = logits[:, -1]

    for step in range(config.max_new_tokens):
        allowed = masks([None if r.finish else r.constraint for r in rows], session.vocab_size)
        chosen = select(last, seen, config.sampling, rngs, allowed)
        scored = step_logprobs(config, last, chosen)
        for i, r in enumerate(rows):
            if r.finish:
                continue
            token = int(chosen[i])
            r.tokens.append(token)
            if scored is not None:
                r.logprobs.append(scored[i][0])
                r.top.append(scored[i][1])
            seen[i] = np.append(seen[i], token)
            r.finish = end_of(token, len(r.tokens), len(r.prompt), config, stop, session.max_context, r.constraint)
            if r.finish:
                r.constraint = None  # its matcher is done with
        yield rows
        if all(r.finish for r in rows):
            return
        if mask.shape[1] + 1 > session.max_context:
            # The batch is as wide as the context, but the rows still going are shorter than the longest
            # prompt: their leading columns are padding. Drop as many as the next step needs, so that each
            # row gets the length it would get alone (positions and windows are unaffected).
            excess = mask.shape[1] + 1 - session.max_context
            try:
                cache = session.backend.drop_oldest(cache, excess)
            except NotImplementedError:
                for r in rows:
                    r.finish = r.finish or "context"
                yield rows
                return
            mask = mask[:, excess:]
        # Finished rows keep a slot in the batch; what they are fed is ignored.
        nxt = np.array([[r.tokens[-1]] for r in rows], np.int64)
        mask = np.concatenate([mask, np.ones((B, 1), np.int64)], axis=1)
        logits, cache = session.forward(nxt, mask, cache=cache, last_logits_only=True, adapters=adapters)
        last = logits[:, -1]


def token_rows(prompt, encode, what: str = "prompt") -> tuple[list[list[int]], bool]:
    """Normalize str | ids | a list of either to a list of id lists (an empty row stays empty, for the caller's
    check to name); report whether one was given. encode(text) -> ids."""
    if isinstance(prompt, (bytes, bytearray)):  # a Sequence of ints to Python: never token ids here
        try:
            prompt = bytes(prompt).decode("utf-8")
        except UnicodeDecodeError as e:
            raise KvforgeError(f"the {what} is bytes that are not UTF-8 text (byte {e.start}: "
                               f"{bytes(prompt)[e.start:e.start + 4]!r}); pass a str, or token ids as a list of ints") from e
    if isinstance(prompt, str):
        return [encode(prompt)], True
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, Sequence) and prompt and all(isinstance(t, (int, np.integer)) for t in prompt):
        return [[int(t) for t in prompt]], True
    if isinstance(prompt, Sequence) and prompt:
        return [[] if isinstance(p, (list, tuple, np.ndarray)) and len(p) == 0 else token_rows(p, encode, what)[0][0]
                for p in prompt], False
    raise KvforgeError(f"a {what} is a str, a list of token ids, or a list of those; got {prompt!r}")


def stop_ids(config: GenerationConfig, eos, vocab_size: int, tokenizer=None) -> set[int]:
    """The tokens that end a row: config.stop_token_ids, and unless ignore_eos the model's eos ids (as
    transformers' generate: config.json's or generation_config.json's; the tokenizer's eos only for a model
    that names none)."""
    extra = {int(t) for t in config.stop_token_ids}
    outside = sorted(t for t in extra if t >= vocab_size)
    if outside:
        raise KvforgeError(f"stop_token_ids {outside[:8]} are outside the vocabulary (0..{vocab_size - 1})")
    if config.ignore_eos:
        return extra
    stop = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not stop and tokenizer is not None and tokenizer.eos_token_id is not None:
        stop.add(tokenizer.eos_token_id)
    return stop | extra


class TextStream:
    """Incremental detokenization: text is released only once it decodes to complete UTF-8.

    Byte-level tokenizers split a multi-byte character over several tokens;
    decoding after each token would show U+FFFD until the rest arrives. The
    held-back text is released with the token that completes it (or at the end).
    """

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.emitted = 0

    def push(self, token: int, last: bool = False) -> str:
        self.tokens.append(token)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd") and not last:
            return ""
        delta, self.emitted = text[self.emitted:], len(text)
        return delta
