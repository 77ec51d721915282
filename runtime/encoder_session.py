"""Sessions over encoder bundles (BERT, RoBERTa, the Perceiver): embed and classify, no generation.

    from kvforge import runtime
    with runtime.load("runs/bert") as session:                     # an EncoderSession
        vectors = session.embed(["a query", "a passage"], pooling="mean")
        labels = session.classify(["great film"])                 # a model with a classification head

`run(feeds)` is the graph's own contract (input_ids, attention_mask [,
token_type_ids] -> last_hidden_state [, logits | pooler_output]); `encode`
tokenizes and right-pads texts the way Hugging Face pipelines do and runs
them in batches. Backends: onnxruntime (the bundle's graph) and torch (the
reference rebuilt from the bundle's source). Like `Session`, an
EncoderSession is a context manager, activates on first use, and serializes
calls from several threads with a lock.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError

from .generate import right_padded
from .graph_backends import ENCODER_BACKENDS
from .graph_session import GraphSession

# pooling -> the vector of one text's token states h (tokens, dim); the modes of sentence-transformers' Pooling
POOLINGS = {
    "mean": lambda h: h.mean(axis=0),
    "cls": lambda h: h[0],
    "max": lambda h: h.max(axis=0),
    "mean_sqrt_len": lambda h: h.sum(axis=0) / np.sqrt(h.shape[0]),
    "last": lambda h: h[-1],
}
TOKEN_POOLINGS = ("cls", "last")  # poolings that pick one token's state: a Perceiver's latents have no such token


class EncoderSession(GraphSession):
    backends = ENCODER_BACKENDS

    def __init__(self, bundle: Bundle, backend: str = "auto", **options):
        """backend: onnxruntime (the bundle's graph) or torch (its source model; float_reference=True: the float
        model a quantized bundle was made from, what compare measures against)."""
        super().__init__(bundle, backend, **options)
        self.max_length = self.io.max_context or self.config["max_seq_len"]
        # where texts are cut on request (truncate=True): a sentence-transformers model's own max_seq_length (what
        # SentenceTransformer.encode cuts at), else the bundle's longest input
        recorded = (self.config.get("embedding") or {}).get("max_seq_length")
        self.truncate_length = min(recorded, self.max_length) if recorded else self.max_length
        self.input_names = [t.name for t in self.io.inputs]
        self.output_names = [t.name for t in self.io.outputs]

    def __repr__(self) -> str:
        return f"EncoderSession({self.source!r}, backend={self.backend_name!r}, outputs={self.output_names})"

    # -- the graph's contract --------------------------------------------------------
    def check_feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The feeds as the graph takes them, or a KvforgeError that names what is wrong."""
        if not isinstance(feeds, dict):
            raise KvforgeError(f"feeds must be a dict of numpy arrays named {self.input_names}")
        missing = [n for n in self.input_names if n not in feeds]
        extra = sorted(set(feeds) - set(self.input_names))
        if missing or extra:
            raise KvforgeError(f"this encoder takes {self.input_names}; missing {missing}, unexpected {extra}")
        out, shape = {}, None
        for name in self.input_names:
            value = feeds[name]
            if not isinstance(value, np.ndarray) or value.dtype != np.int64 or value.ndim != 2:
                what = f"{value.dtype} {value.shape}" if isinstance(value, np.ndarray) else type(value).__name__
                raise KvforgeError(f"{name} must be an int64 array [batch, sequence], got {what}")
            if shape is not None and value.shape != shape:
                raise KvforgeError(f"{name} has shape {value.shape}, input_ids {shape}: they must match")
            shape = value.shape
            out[name] = np.ascontiguousarray(value)
        batch, length = shape
        if batch < 1 or length < 1:
            raise KvforgeError(f"empty input: shape {shape}")
        if length > self.max_length:
            raise KvforgeError(f"inputs of {length} tokens exceed this bundle's {self.max_length}; pass truncate=True "
                               "or shorter texts")
        ids = out["input_ids"]
        vocab = self.config["vocab_size"]
        if ids.min() < 0 or ids.max() >= vocab:
            bad = int(ids[(ids < 0) | (ids >= vocab)][0])
            raise KvforgeError(f"token id {bad} is out of range for a vocabulary of {vocab}")
        mask = out["attention_mask"]
        if not np.isin(mask, (0, 1)).all():
            raise KvforgeError("attention_mask must hold only 0 and 1")
        if not mask.any(axis=1).all():
            raise KvforgeError(f"rows {np.flatnonzero(~mask.any(axis=1)).tolist()} of attention_mask have no real token")
        if "token_type_ids" in out:
            types = out["token_type_ids"]
            if types.min() < 0 or types.max() >= self.config["type_vocab_size"]:
                raise KvforgeError(f"token_type_ids must lie in 0..{self.config['type_vocab_size'] - 1}")
        return out

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One call of the graph: its outputs by name."""
        feeds = self.check_feeds(feeds)
        self.activate()
        with self._lock:
            outputs = self.backend.run("model", feeds)
        return dict(zip(self.output_names, (np.asarray(o, np.float32) for o in outputs)))

    # -- text --------------------------------------------------------------------------
    def tokenize(self, texts: str | Sequence[str], truncate: bool = False) -> list[list[int]]:
        """Token id rows for texts (a list of token id lists passes through, checked for length; a list of
        (text, text pair) tuples joins each pair as the tokenizer's post-processor does: tokenize_pairs gives
        their token types too)."""
        return self._rows(texts, truncate)[0]

    def tokenize_pairs(self, pairs: Sequence[tuple[str, str]], truncate: bool = False
                       ) -> tuple[list[list[int]], list[list[int]]]:
        """(token ids, token type ids) of each (text, text pair), as transformers' tokenizer(text, text_pair)
        gives them: what a cross-encoder scores."""
        if not pairs or not all(isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(t, str) for t in p)
                                for p in pairs):
            raise KvforgeError("pairs must be a non-empty list of (text, text pair) tuples of two strings")
        if self.tokenizer is None:
            raise KvforgeError(f"{self.source} has no tokenizer; call run() with token ids")
        if "token_type_ids" not in self.input_names:
            raise KvforgeError(f"{self.source} takes no token_type_ids: it does not tell a pair's two texts apart")
        rows, types = self.tokenizer.encode_pairs(pairs, self.truncate_length if truncate else None)
        for i, row in enumerate(rows):
            self._fit(i, row, False)
        return rows, types

    def _rows(self, texts, truncate: bool) -> tuple[list[list[int]], list[list[int]] | None]:
        """(token id rows, their token type ids or None) for texts, token id lists or text pairs."""
        if isinstance(texts, str):
            texts = [texts]
        if isinstance(texts, Sequence) and texts and all(
                isinstance(t, (tuple, list)) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in texts):
            return self.tokenize_pairs([tuple(t) for t in texts], truncate)
        if isinstance(texts, Sequence) and texts and all(
                isinstance(r, (list, tuple)) and r and all(isinstance(t, (int, np.integer)) for t in r) for r in texts):
            rows = [[int(t) for t in r] for r in texts]
            return [self._fit(i, r, truncate) for i, r in enumerate(rows)], None
        if not texts or not all(isinstance(t, str) for t in texts):
            raise KvforgeError("texts must be a string, a non-empty list of strings, a list of token id lists, or a "
                               "list of (text, text pair) tuples")
        if self.tokenizer is None:
            raise KvforgeError(f"{self.source} has no tokenizer; call run() with token ids")
        # cut where asked as transformers cuts (the text, then its special tokens), never otherwise
        rows = self.tokenizer.encode_batch(list(texts), max_length=self.truncate_length if truncate else None)
        for i, row in enumerate(rows):
            if not row:
                raise KvforgeError(f"text {i} encodes to no tokens")
        return [self._fit(i, r, False) for i, r in enumerate(rows)], None

    def _fit(self, i: int, row: list[int], truncate: bool) -> list[int]:
        if len(row) > self.max_length:
            if not truncate:
                raise KvforgeError(f"text {i} is {len(row)} tokens, more than this bundle's {self.max_length}; "
                                   "pass truncate=True to cut it")
            return row[:self.max_length]  # token ids given: cut as given
        return row

    def feeds(self, rows: list[list[int]], types: list[list[int]] | None = None) -> dict[str, np.ndarray]:
        """Right-padded input_ids and attention_mask (and token_type_ids: `types`, else zeros) for token id rows."""
        ids, mask = right_padded(rows, self.config.get("pad_token_id"))
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self.input_names:
            feeds["token_type_ids"] = right_padded(types, 0)[0] if types is not None else np.zeros_like(ids)
        return feeds

    def encode(self, texts: str | Sequence[str], batch_size: int = 32, truncate: bool = False
               ) -> list[dict[str, np.ndarray]]:
        """Every output for each text (or (text, text pair) tuple), its padding removed from per-token outputs."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise KvforgeError(f"batch_size must be a positive integer, got {batch_size!r}")
        rows, types = self._rows(texts, truncate)
        per_token = set(self.io.extra.get("per_token_outputs", []))
        results = []
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            out = self.run(self.feeds(chunk, None if types is None else types[start:start + batch_size]))
            for i, r in enumerate(chunk):
                results.append({n: (v[i, :len(r)] if n in per_token else v[i]) for n, v in out.items()})
        return results

    def embedding_defaults(self) -> dict[str, Any]:
        """The pooling and normalization embed() applies when not told: the checkpoint's own (a sentence-transformers
        directory's modules.json, recorded at export), else the mean of the tokens' states, not normalized."""
        recorded = self.config.get("embedding") or {}
        return {"pooling": recorded.get("pooling", "mean"), "normalize": bool(recorded.get("normalize", False)),
                "source": recorded.get("source", "kvforge's default")}

    def embed(self, texts: str | Sequence[str], pooling: str | None = None, *, normalize: bool | None = None,
              batch_size: int = 32, truncate: bool = False) -> np.ndarray:
        """One vector per text, (n, dim), pooled from its tokens' last hidden states (a Perceiver: its latents) by
        `pooling` (POOLINGS: mean, cls, max, mean_sqrt_len, last) and L2-normalized when `normalize`; either left
        None takes embedding_defaults() (a sentence-transformers checkpoint's own pooling and normalization)."""
        defaults = self.embedding_defaults()
        pooling = defaults["pooling"] if pooling is None else pooling
        normalize = defaults["normalize"] if normalize is None else normalize
        if pooling not in POOLINGS:
            raise KvforgeError(f"pooling {pooling!r} is not one of {list(POOLINGS)}")
        if pooling in TOKEN_POOLINGS and not self.bundle.kind.cls_pooling:
            raise KvforgeError(f"{self.bundle.kind.article}'s outputs are latents, not tokens: there is no token to "
                               f"pool by {pooling!r}; use pooling='mean'")
        hidden = [r["last_hidden_state"] for r in self.encode(texts, batch_size, truncate)]
        vectors = np.stack([POOLINGS[pooling](h.astype(np.float32)) for h in hidden]).astype(np.float32)
        if normalize:
            vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return vectors

    def classify(self, texts: str | Sequence[str], batch_size: int = 32, truncate: bool = False) -> list[dict[str, Any]]:
        """Per text, or per (text, text pair) tuple (a cross-encoder): the top class (`label`, `index`, `score`)
        and every class's probability (`scores`): the softmax of the logits, or with one label (a cross-encoder's
        relevance, a regression) its sigmoid, as transformers' text-classification pipeline and
        sentence-transformers' CrossEncoder score them."""
        if self.config.get("head") != "classification":
            raise KvforgeError(f"{self.source} has no classification head (head={self.config.get('head')!r})")
        labels = self.config.get("labels") or [f"LABEL_{i}" for i in range(self.config["num_labels"])]
        out = []
        for r in self.encode(texts, batch_size, truncate):
            logits = r["logits"].astype(np.float64)
            if logits.size == 1:
                p = 1.0 / (1.0 + np.exp(-logits))
            else:
                p = np.exp(logits - logits.max())
                p /= p.sum()
            i = int(p.argmax())
            out.append({"label": labels[i], "index": i, "score": float(p[i]), "scores": p.astype(np.float32).tolist()})
        return out

    def generate(self, *args, **kwargs):
        raise KvforgeError(f"{self.source} is {self.bundle.kind.article}: it does not generate text; use embed() or classify() "
                           "(`kvforge embed` on the command line)")

    stream = generate
