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

Backends: onnxruntime (the bundle's two graphs) and torch (the reference
rebuilt from the bundle's source). Calls are serialized by a lock.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import numpy as np

from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError
from kvforge.tokenizer import Tokenizer

from .generate import GenerationConfig, GenerationResult, TextStream, TokenEvent, finish_reason, right_padded, stop_ids, token_rows
from .sampling import select

Pairs = list[tuple[np.ndarray, np.ndarray]]


class _OrtModel:
    def __init__(self, bundle: Bundle, threads: int | None = None, optimization: str = "all", device: str = "cpu", **unknown):
        if unknown:
            raise KvforgeError(f"unknown onnxruntime options for an encoder-decoder: {sorted(unknown)}")
        if device not in ("cpu", "auto"):
            raise KvforgeError(f"encoder-decoder sessions run on device 'cpu' here, not {device!r}")
        from .ort_backend import make_session

        bundle.load_graph(external_data=False)  # refuses external data outside the bundle
        quant = bundle.quantization_format
        graphs = bundle.manifest["graphs"]
        self.encoder = make_session(bundle.path / graphs["encoder"], quant, optimization=optimization, threads=threads)
        self.decoder = make_session(bundle.path / graphs["decoder"], quant, optimization=optimization, threads=threads)
        self.dec_names = [i.name for i in self.decoder.get_inputs()]
        self.dtype = np.float16 if bundle.dtype == "float16" else np.float32
        if bundle.dtype == "bfloat16":
            raise KvforgeError("ONNX Runtime's CPU provider has no bfloat16 kernels; run a float32 or float16 bundle")

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> Pairs:
        out = self.encoder.run(None, {"input_ids": ids, "attention_mask": mask})
        return [(out[1 + 2 * i], out[2 + 2 * i]) for i in range((len(out) - 1) // 2)]

    def decode(self, ids: np.ndarray, mask: np.ndarray, past: Pairs, cross: Pairs) -> tuple[np.ndarray, Pairs]:
        feeds = [ids, mask]
        for (pk, pv), (ck, cv) in zip(past, cross):
            feeds += [pk, pv, ck, cv]
        out = self.decoder.run(None, dict(zip(self.dec_names, feeds)))
        return out[0], [(out[1 + 2 * i], out[2 + 2 * i]) for i in range(len(past))]


class _TorchModel:
    def __init__(self, bundle: Bundle, source: str | None = None, device: str = "cpu", float_reference: bool = False,
                 **unknown):
        """float_reference: run the float model a quantized bundle was made from (what compare measures against)."""
        if unknown:
            raise KvforgeError(f"unknown torch options for an encoder-decoder: {sorted(unknown)}")
        import torch

        from kvforge.model_defs import load


        if bundle.quantization_format and not float_reference:
            raise KvforgeError(f"{bundle.path} is quantized; the torch backend would run the float model it was made "
                               "from. Run it on onnxruntime; `kvforge compare` measures it against that reference")
        source = source or bundle.recorded_source
        if source is None:
            raise KvforgeError(f"{bundle.path} records no source model; pass source=... for the torch backend")
        model, _ = load(source, dtype="float32" if float_reference else bundle.dtype)
        if model.config.to_dict() != bundle.model_config:
            raise KvforgeError(f"the source {source!r} builds a model whose config differs from the bundle's")
        self.torch, self.model, self.device = torch, model.to(device), device
        self.dtype = np.float32

    def _t(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def encode(self, ids, mask) -> Pairs:
        with self.torch.no_grad():
            _, cross = self.model.encode(self._t(ids), self._t(mask))
        return [(k, v) for k, v in cross]  # kept as tensors between steps

    def decode(self, ids, mask, past, cross):
        with self.torch.no_grad():
            past = None if past[0][0].shape[2] == 0 else past
            logits, present = self.model.decode(self._t(ids), self._t(mask), past, cross)
        return logits.float().cpu().numpy(), list(present)

    def empty(self, batch, heads, dim):
        z = self.torch.zeros(batch, heads, 0, dim, dtype=self.model.dtype, device=self.device)
        return z


class Seq2SeqSession:
    architecture = "encoder-decoder"

    def __init__(self, bundle: Bundle, backend: str = "auto", **options):
        if backend not in ("auto", "onnxruntime", "torch"):
            raise KvforgeError(f"encoder-decoder bundles run on the onnxruntime or torch backend, not {backend!r}")
        self.bundle = bundle
        self.source = str(bundle.path)
        self.config: dict[str, Any] = bundle.model_config
        self.io = bundle.io
        self.tokenizer = Tokenizer.from_file(bundle.tokenizer_file) if bundle.tokenizer_file else None
        self.max_context = self.io.max_context or self.config["max_seq_len"]
        self.vocab_size = self.config["vocab_size"]
        self.backend_name = "onnxruntime" if backend == "auto" else backend
        self._options = options
        self._model = None
        self._lock = threading.RLock()

    # -- lifecycle ---------------------------------------------------------------------
    def activate(self) -> Seq2SeqSession:
        with self._lock:
            if self._model is None:
                make = _OrtModel if self.backend_name == "onnxruntime" else _TorchModel
                self._model = make(self.bundle, **self._options)
        return self

    def deactivate(self) -> None:
        with self._lock:
            self._model = None

    def __enter__(self) -> Seq2SeqSession:
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def __repr__(self) -> str:
        return f"Seq2SeqSession({self.source!r}, backend={self.backend_name!r})"

    # -- inputs ------------------------------------------------------------------------------
    def _sources(self, source) -> tuple[list[list[int]], bool]:
        return token_rows(source, self._encode_text, "source")

    def _encode_text(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise KvforgeError(f"{self.source} has no tokenizer; pass token ids instead of text")
        return self.tokenizer.encode(text)

    def _check(self, rows: list[list[int]]) -> None:
        for i, r in enumerate(rows):
            if not r:
                raise KvforgeError(f"source {i} has no tokens")
            bad = [t for t in r if not 0 <= t < self.vocab_size]
            if bad:
                raise KvforgeError(f"source token ids {bad[:8]} are outside the vocabulary (0..{self.vocab_size - 1})")
            if len(r) > self.max_context:
                raise KvforgeError(f"a source of {len(r)} tokens exceeds this bundle's maximum of {self.max_context}")

    def _stop_ids(self, config: GenerationConfig) -> set[int]:
        return stop_ids(config, self.config.get("eos_token_id"), self.vocab_size, self.tokenizer)

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self, rows: list[list[int]], config: GenerationConfig, stop: set[int]) -> Iterator[list[list[int]]]:
        """Yield every row's tokens after each step, with each row's finish reason (None: going on)."""
        self._check(rows)
        cfg = self.config
        B = len(rows)
        pad = cfg.get("pad_token_id") or 0
        ids, mask = right_padded(rows, pad)
        tokens: list[list[int]] = [[] for _ in rows]
        finish: list[str | None] = [None] * B
        if config.max_new_tokens == 0:
            yield tokens, finish
            return
        self.activate()
        model = self._model
        with self._lock:
            cross = model.encode(ids, mask)
        heads, dim = cfg["decoder_heads"], cfg["decoder_head_dim"]
        past = [(self._empty(model, B, heads, dim), self._empty(model, B, heads, dim)) for _ in cross]
        nxt = np.full((B, 1), cfg["decoder_start_token_id"], np.int64)
        seen = [np.zeros(0, np.int64) for _ in rows]
        rngs = [np.random.default_rng(config.seed) for _ in rows]
        limit = min(config.max_new_tokens, self.max_context)  # the start token takes position 0
        for step in range(limit):
            with self._lock:
                logits, past = model.decode(nxt, mask, past, cross)
            chosen = select(logits[:, -1], seen, config.sampling, rngs)
            forced = self._forced(step, config.max_new_tokens)
            for i in range(B):
                if finish[i]:
                    continue
                token = forced if forced is not None else int(chosen[i])
                tokens[i].append(token)
                seen[i] = np.append(seen[i], token)
                finish[i] = finish_reason(token, len(tokens[i]), 1, config, stop, self.max_context)
            yield tokens, finish
            if all(finish):
                return
            nxt = np.array([[t[-1] if t else pad] for t in tokens], np.int64)
        for i in range(B):  # the context ran out first
            finish[i] = finish[i] or "context"
        yield tokens, finish

    def _forced(self, step: int, max_new_tokens: int) -> int | None:
        """transformers' forced tokens: forced_bos_token_id first, forced_eos_token_id as the last allowed token."""
        cfg = self.config
        if step == 0 and cfg.get("forced_bos_token_id") is not None:
            return cfg["forced_bos_token_id"]
        if step == max_new_tokens - 1 and cfg.get("forced_eos_token_id") is not None:
            return cfg["forced_eos_token_id"]
        return None

    @staticmethod
    def _empty(model, batch, heads, dim):
        if isinstance(model, _TorchModel):
            return model.empty(batch, heads, dim)
        return np.zeros((batch, heads, 0, dim), model.dtype)

    # -- public -------------------------------------------------------------------------------
    def forward(self, source_ids: np.ndarray, source_mask: np.ndarray, target_ids: np.ndarray) -> np.ndarray:
        """Teacher-forced float32 logits (B, T, vocab) of target_ids (decoder inputs, the start token first)
        given right-padded sources: the encoder, then one decoder call over all T tokens."""
        for name, a in (("source_ids", source_ids), ("source_mask", source_mask), ("target_ids", target_ids)):
            if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 2 or 0 in a.shape:
                raise KvforgeError(f"{name} must be a non-empty int64 array [batch, length]")
        if source_ids.shape != source_mask.shape or target_ids.shape[0] != source_ids.shape[0]:
            raise KvforgeError(f"shapes disagree: source {source_ids.shape}, mask {source_mask.shape}, target {target_ids.shape}")
        self._check([r[m == 1].tolist() for r, m in zip(source_ids, source_mask)])
        if target_ids.shape[1] > self.max_context or target_ids.min() < 0 or target_ids.max() >= self.vocab_size:
            raise KvforgeError(f"target ids must lie in 0..{self.vocab_size - 1}, at most {self.max_context} per row")
        self.activate()
        model = self._model
        cfg = self.config
        with self._lock:
            cross = model.encode(source_ids, source_mask)
            B = source_ids.shape[0]
            past = [(self._empty(model, B, cfg["decoder_heads"], cfg["decoder_head_dim"]),) * 2 for _ in cross]
            logits, _ = model.decode(target_ids, source_mask, past, cross)
        return np.asarray(logits, np.float32)

    def generate(self, source, config: GenerationConfig | None = None, **kwargs) -> GenerationResult | list[GenerationResult]:
        """The target for one source (-> GenerationResult) or each of a list (-> list; a right-padded batch)."""
        config = config or GenerationConfig.from_kwargs(**kwargs)
        rows, single = self._sources(source)
        tokens, finish = [], []
        for tokens, finish in self._loop(rows, config, self._stop_ids(config)):
            pass
        results = [GenerationResult(list(t), f or "length", len(r)) for t, f, r in zip(tokens, finish, rows)]
        for r in results:
            r.text = self.tokenizer.decode(r.tokens) if self.tokenizer is not None else ""
        return results[0] if single else results

    def stream(self, source, config: GenerationConfig | None = None, **kwargs) -> Iterator[TokenEvent]:
        """Yield each target token of one source with the text it completes."""
        config = config or GenerationConfig.from_kwargs(**kwargs)
        rows, single = self._sources(source)
        if not single:
            raise KvforgeError("stream() takes one source; use generate() for a batch")
        text = TextStream(self.tokenizer)
        for tokens, finish in self._loop(rows, config, self._stop_ids(config)):
            if not tokens[0]:
                continue
            last = finish[0] is not None
            if len(text.tokens) == len(tokens[0]):  # the final yield repeats the last token
                continue
            token = tokens[0][-1]
            yield TokenEvent(token, len(tokens[0]) - 1, last, finish[0], text.push(token, last))

    def embed(self, *args, **kwargs):
        raise KvforgeError(f"{self.source} is an encoder-decoder; `generate` runs it (embed runs encoder bundles)")
