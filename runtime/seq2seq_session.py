"""Sessions over encoder-decoder bundles (T5, BART): the encoder once per source, then the decoder loop.

    from kvforge import runtime
    with runtime.load("runs/t5") as session:                    # a Seq2SeqSession
        print(session.generate("translate: hello", max_new_tokens=32).text)
        for event in session.stream("summarize: ..."):
            print(event.text, end="")

`generate` takes a source (text, token ids, or a list of either: a batch,
right-padded) and the options of `GenerationConfig` (greedy or sampled,
stop tokens, seeds). Each step feeds every row's last token with its own
self-attention cache and the cross-attention K/V the encoder computed once;
a row that has finished keeps its slot, and what it is fed is ignored. The
first target token is the model's decoder_start_token_id; forced_bos /
forced_eos tokens are forced where transformers' generate forces them (the
first token, the last one max_new_tokens allows).

A response format (`response_format`, runtime/constrain.py) constrains each
row's target as it does a decoder's; the forced tokens are outside it (they are
chosen as transformers forces them and not shown to the grammar). `logprobs`
reports each token's log-probability under the raw logits, as for decoders.

Backends: onnxruntime (the bundle's two graphs) and torch (the reference
rebuilt from the bundle's source). Calls are serialized by a lock.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError

from .constrain import masks
from .generate import (GenerationConfig, GenerationResult, TextStream, TokenEvent, end_of, finish_reason, right_padded,
                       row_constraints, step_logprobs, stop_ids, token_rows)
from .graph_backends import SEQ2SEQ_BACKENDS
from .graph_session import GraphSession
from .sampling import select


class Seq2SeqSession(GraphSession):
    backends = SEQ2SEQ_BACKENDS

    def __init__(self, bundle: Bundle, backend: str = "auto", **options):
        """backend: onnxruntime (the bundle's two graphs) or torch (its source model; float_reference=True: the
        float model a quantized bundle was made from, what compare measures against)."""
        super().__init__(bundle, backend, **options)
        self.max_context = self.io.max_context or self.config["max_seq_len"]
        self.vocab_size = self.config["vocab_size"]

    # -- inputs ------------------------------------------------------------------------------
    # what a runner of requests (runtime/serial.py) asks of the session
    def prompt_rows(self, source) -> tuple[list[list[int]], bool]:
        """A source (str | ids | a list of either) as lists of token ids, and whether one source was given."""
        return token_rows(source, self._encode_text, "source")

    def _encode_text(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise KvforgeError(f"{self.source} has no tokenizer; pass token ids instead of text")
        return self.tokenizer.encode(text)

    def check_sources(self, rows: list[list[int]]) -> None:
        """Refuse an empty source, token ids outside the vocabulary, or one longer than the bundle's context."""
        for i, r in enumerate(rows):
            if not r:
                raise KvforgeError(f"source {i} has no tokens")
            bad = [t for t in r if not 0 <= t < self.vocab_size]
            if bad:
                raise KvforgeError(f"source token ids {bad[:8]} are outside the vocabulary (0..{self.vocab_size - 1})")
            if len(r) > self.max_context:
                raise KvforgeError(f"a source of {len(r)} tokens exceeds this bundle's maximum of {self.max_context}")

    def stop_tokens(self, config: GenerationConfig) -> set[int]:
        """The token ids that end a generation under config (its stop ids, and the model's EOS unless ignored)."""
        return stop_ids(config, self.config.get("eos_token_id"), self.vocab_size, self.tokenizer)

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self, rows: list[list[int]], config: GenerationConfig, stop: set[int]):
        """Yield every row's tokens after each step, with each row's finish reason (None: going on) and, when
        config.logprobs is set, each row's (log-probability, top alternatives) per token (else None)."""
        self.check_sources(rows)
        cfg = self.config
        B = len(rows)
        pad = cfg.get("pad_token_id") or 0
        ids, mask = right_padded(rows, pad)
        tokens: list[list[int]] = [[] for _ in rows]
        finish: list[str | None] = [None] * B
        scores = [[] for _ in rows] if config.logprobs is not None else None
        constraints = row_constraints(config.format, self.tokenizer, self.vocab_size, stop, B)
        if config.max_new_tokens == 0:
            yield tokens, finish, scores
            return
        self.activate()
        model = self.backend
        with self._lock:
            cross = model.encode(ids, mask)
        heads, dim = cfg["decoder_heads"], cfg["decoder_head_dim"]
        past = [(model.empty(B, heads, dim), model.empty(B, heads, dim)) for _ in cross]
        nxt = np.full((B, 1), cfg["decoder_start_token_id"], np.int64)
        seen = [np.zeros(0, np.int64) for _ in rows]
        rngs = [np.random.default_rng(config.seed) for _ in rows]
        limit = min(config.max_new_tokens, self.max_context)  # the start token takes position 0
        for step in range(limit):
            with self._lock:
                logits, past = model.decode(nxt, mask, past, cross)
            forced = self._forced(step, config.max_new_tokens)
            allowed = None if forced is not None else masks([None if f else c for f, c in zip(finish, constraints)],
                                                            self.vocab_size)
            chosen = select(logits[:, -1], seen, config.sampling, rngs, allowed)
            if forced is not None:
                chosen = np.full(B, forced)
            scored = step_logprobs(config, logits[:, -1], chosen)
            for i in range(B):
                if finish[i]:
                    continue
                token = int(chosen[i])
                tokens[i].append(token)
                if scored is not None:
                    scores[i].append(scored[i])
                seen[i] = np.append(seen[i], token)
                if forced is not None:  # outside the grammar
                    finish[i] = finish_reason(token, len(tokens[i]), 1, config, stop, self.max_context)
                else:
                    finish[i] = end_of(token, len(tokens[i]), 1, config, stop, self.max_context, constraints[i])
                if finish[i]:
                    constraints[i] = None
            yield tokens, finish, scores
            if all(finish):
                return
            nxt = np.array([[t[-1] if t else pad] for t in tokens], np.int64)
        for i in range(B):  # the context ran out first
            finish[i] = finish[i] or "context"
        yield tokens, finish, scores

    def _forced(self, step: int, max_new_tokens: int) -> int | None:
        """transformers' forced tokens: forced_bos_token_id first, forced_eos_token_id as the last allowed token."""
        cfg = self.config
        if step == 0 and cfg.get("forced_bos_token_id") is not None:
            return cfg["forced_bos_token_id"]
        if step == max_new_tokens - 1 and cfg.get("forced_eos_token_id") is not None:
            return cfg["forced_eos_token_id"]
        return None

    # -- public -------------------------------------------------------------------------------
    def forward(self, source_ids: np.ndarray, source_mask: np.ndarray, target_ids: np.ndarray) -> np.ndarray:
        """Teacher-forced float32 logits (B, T, vocab) of target_ids (decoder inputs, the start token first)
        given right-padded sources: the encoder, then one decoder call over all T tokens."""
        for name, a in (("source_ids", source_ids), ("source_mask", source_mask), ("target_ids", target_ids)):
            if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 2 or 0 in a.shape:
                raise KvforgeError(f"{name} must be a non-empty int64 array [batch, length]")
        if source_ids.shape != source_mask.shape or target_ids.shape[0] != source_ids.shape[0]:
            raise KvforgeError(f"shapes disagree: source {source_ids.shape}, mask {source_mask.shape}, target {target_ids.shape}")
        self.check_sources([r[m == 1].tolist() for r, m in zip(source_ids, source_mask)])
        if target_ids.shape[1] > self.max_context or target_ids.min() < 0 or target_ids.max() >= self.vocab_size:
            raise KvforgeError(f"target ids must lie in 0..{self.vocab_size - 1}, at most {self.max_context} per row")
        self.activate()
        model = self.backend
        cfg = self.config
        with self._lock:
            cross = model.encode(source_ids, source_mask)
            B = source_ids.shape[0]
            past = [(model.empty(B, cfg["decoder_heads"], cfg["decoder_head_dim"]),) * 2 for _ in cross]
            logits, _ = model.decode(target_ids, source_mask, past, cross)
        return np.asarray(logits, np.float32)

    def generate(self, source, config: GenerationConfig | None = None, **kwargs) -> GenerationResult | list[GenerationResult]:
        """The target for one source (-> GenerationResult) or each of a list (-> list; a right-padded batch)."""
        config = config or GenerationConfig.from_kwargs(**kwargs)
        rows, single = self.prompt_rows(source)
        tokens, finish, scores = [], [], None
        for tokens, finish, scores in self._loop(rows, config, self.stop_tokens(config)):
            pass
        results = [GenerationResult(list(t), f or "length", len(r)) for t, f, r in zip(tokens, finish, rows)]
        if scores is not None:
            for r, s in zip(results, scores):
                r.logprobs, r.top_logprobs = [lp for lp, _ in s], [top for _, top in s]
        for r in results:
            r.text = self.tokenizer.decode(r.tokens) if self.tokenizer is not None else ""
        return results[0] if single else results

    def stream(self, source, config: GenerationConfig | None = None, **kwargs) -> Iterator[TokenEvent]:
        """Yield each target token of one source with the text it completes."""
        config = config or GenerationConfig.from_kwargs(**kwargs)
        rows, single = self.prompt_rows(source)
        if not single:
            raise KvforgeError("stream() takes one source; use generate() for a batch")
        text = TextStream(self.tokenizer)
        for tokens, finish, scores in self._loop(rows, config, self.stop_tokens(config)):
            if not tokens[0]:
                continue
            last = finish[0] is not None
            if len(text.tokens) == len(tokens[0]):  # the final yield repeats the last token
                continue
            token = tokens[0][-1]
            event = TokenEvent(token, len(tokens[0]) - 1, last, finish[0], text.push(token, last))
            if scores is not None:
                event.logprob, event.top_logprobs = scores[0][-1]
            yield event

    def embed(self, *args, **kwargs):
        raise KvforgeError(f"{self.source} is an encoder-decoder; `generate` runs it (embed runs encoder bundles)")
