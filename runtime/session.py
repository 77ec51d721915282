"""A decoder LM's Session (what `kvforge.runtime.load` opens for one, runtime/loading.py): one interface over the
backends.

A Session validates every input against the bundle's IO spec, owns a
backend, and generates text. It is a context manager (activate on enter,
release on exit) and also activates itself on first use.

Threads: a Session may be shared between threads; its calls are serialized
by a lock (each generation owns its own cache, so concurrent callers get the
same results they would get alone, one after another). A stream takes the
lock for each token's step only, never between tokens.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from kvforge.adapters import slot_input_names
from kvforge.bundle import Bundle, IOSpec
from kvforge.errors import KvforgeError
from kvforge.kinds import kind_name
from kvforge.tensorrt_env import tensorrt_gpu_missing
from kvforge.tokenizer import Tokenizer

from .backend import Backend, KVCache, SessionLifecycle, torch_source
from .drafting import DRAFTERS, check_vocabularies
from .generate import GenerationConfig, GenerationResult, TextStream, TokenEvent, generate_tokens, stop_ids, token_rows
from .lora import AdapterSet, no_slots
from .step_inputs import StepInputs
from .ort_backend import OnnxRuntimeBackend
from .speculative import generate_speculative
from .torch_backend import TorchBackend
from .trt_backend import TensorRTBackend

BACKENDS = ("onnxruntime", "tensorrt", "torch")


def available_backends() -> list[str]:
    """The backends whose libraries import here (tensorrt: also a CUDA device)."""
    import importlib.util

    found = []
    if importlib.util.find_spec("onnxruntime"):
        found.append("onnxruntime")

    if tensorrt_gpu_missing() is None:
        found.append("tensorrt")
    if importlib.util.find_spec("torch"):
        found.append("torch")
    return found


def _lora_dtype(io: IOSpec, lora: dict[str, Any]) -> str:
    """The dtype the graph takes its LoRA stacks in (the model's)."""
    first = next(iter(lora["slots"]))
    return io.input(slot_input_names(first)[0]).dtype


def open_decoder(bundle: Bundle, backend: str, **options) -> "Session":
    """A decoder LM bundle's Session on its backend ("auto": tensorrt for engines, else onnxruntime)."""
    io, config = bundle.io, bundle.model_config
    tokenizer = Tokenizer.from_file(bundle.tokenizer_file) if bundle.tokenizer_file else None
    dtype = bundle.dtype
    engine = bundle.is_engine
    if backend == "auto":
        backend = "tensorrt" if engine else "onnxruntime"
    if backend == "onnxruntime" and engine:
        raise KvforgeError(f"{bundle.path} holds a TensorRT engine ({bundle.manifest['graph']}); it runs on the tensorrt "
                           "backend (or torch, for the reference), not onnxruntime")
    if backend == "onnxruntime":
        impl: Backend = OnnxRuntimeBackend(config, io, bundle, **options)
    elif backend == "tensorrt":
        impl = TensorRTBackend(config, io, bundle, **options)
    else:
        src = torch_source(bundle, options.pop("source", None))
        impl = TorchBackend(config, io, src, dtype=dtype, **options)
    model_id = bundle.graph_sha256 or str(bundle.path.resolve())  # caches pass between sessions of one model only
    return Session(impl, tokenizer, config, io, str(bundle.path), model_id)


class Session(SessionLifecycle):
    architecture = "decoder"  # what kvforge.kinds.kind_name names in messages

    def __init__(self, backend: Backend, tokenizer: Tokenizer | None, config: dict[str, Any], io: IOSpec, source: str,
                 model_id: str | None = None):
        self.backend = backend
        self.model_id = model_id or source  # which model's caches this session accepts
        self.tokenizer = tokenizer
        self.config = config
        self.io = io
        self.source = source
        self.vocab_size = config["vocab_size"]
        self.max_context = io.max_context or config["max_seq_len"]
        self._lock = threading.RLock()
        self._drafts: dict[str, Session] = {}  # draft sessions opened for speculative decoding, by path
        lora = io.extra.get("lora")
        self.adapters = AdapterSet(lora, source, _lora_dtype(io, lora)) if lora else None  # None: no LoRA slots
        # inputs the graph takes beyond the contract's, per step from its input ids (a vision-language decoder's
        # image features: runtime/vision_session.py); None: none
        self.step_inputs: Callable[[np.ndarray], dict[str, np.ndarray]] | None = None

    # -- lifecycle -------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        return self.backend.name

    def __repr__(self) -> str:
        return f"Session({self.source!r}, backend={self.backend.name!r}, active={self.backend.active})"

    # -- one step --------------------------------------------------------------
    def empty_cache(self, batch: int) -> KVCache:
        with self._lock:
            self.backend.activate()
            cache = self.backend.empty_cache(batch)
            cache.owner = self.model_id
            return cache

    def forward(
        self,
        input_ids: np.ndarray,
        attention_mask: np.ndarray | None = None,
        *,
        position_ids: np.ndarray | None = None,
        cache: KVCache | None = None,
        last_logits_only: bool = False,
        adapters: list[str | None] | None = None,
        inputs: dict[str, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, KVCache]:
        """One graph step, validated against the IO spec: float32 logits (B, T, V) and the new cache.

        last_logits_only: return (B, 1, V), the last position's logits only (what
        generation needs); on ONNX Runtime the other positions are not computed.
        adapters: each row's LoRA adapter (a name in the bundle's adapters/, None: none; the bundle needs slots).
        inputs: the step's graph inputs beyond the KV-cache contract (a vision-language decoder's image_features),
        given instead of what step_inputs makes (the batcher gives each request's own).
        """
        with self._lock:
            step = self._checked_step(input_ids, attention_mask, position_ids, cache)
            extra = self._lora(adapters, step[0].shape[0])
            if inputs is not None:
                extra = {**(extra or {}), **inputs}
            elif self.step_inputs is not None:
                extra = {**(extra or {}), **self.step_inputs(step[0])}
            logits, present = self.backend.forward(*step, last_logits_only, StepInputs.of(extra, self.io.feature_token))
            present.owner = self.model_id
            return logits, present

    def forward_mixed(self, rows: tuple, prompt: tuple, adapters: tuple = (None, None)
                      ) -> tuple[tuple[np.ndarray, KVCache], tuple[np.ndarray, KVCache]]:
        """A decode step of some rows and a chunk of another row's prompt as one step: one call where the backend
        can and prepare_mixed() made it ready (the ONNX Runtime backend's packed cache), each weight read once for
        both; else the two forward calls. rows and prompt are each
        (input_ids, attention_mask, cache), as forward() takes them: rows one token per row, prompt one row.
        Returns ((logits, cache), (logits, cache)), the last position's logits of each, equal to what the two
        forward(..., last_logits_only=True) calls return (to rounding). adapters: the rows' and the prompt's, as
        forward takes them."""
        (r_ids, r_mask, r_cache), (p_ids, p_mask, p_cache) = rows, prompt
        if self.step_inputs is not None:
            raise KvforgeError("a decode step mixed with a prompt's chunk is not made for graphs with inputs beyond "
                               "the KV-cache contract (a vision-language decoder's image features)")
        with self._lock:
            decode = self._checked_step(r_ids, r_mask, None, r_cache)
            chunk = self._checked_step(p_ids, p_mask, None, p_cache)
            if decode[0].shape[1] != 1 or chunk[0].shape[0] != 1:
                raise KvforgeError(f"forward_mixed takes one new token per decode row and one prompt row, got "
                                   f"input_ids {decode[0].shape} and {chunk[0].shape}")
            if decode[3] is chunk[3]:
                raise KvforgeError("forward_mixed takes two different caches")
            lora = (self._lora(adapters[0], decode[0].shape[0]), self._lora(adapters[1], 1))
            parts = self.backend.forward_mixed(decode, chunk, True, tuple(StepInputs.of(f) for f in lora))
            for _, cache in parts:
                cache.owner = self.model_id
            return parts

    def prepare_mixed(self) -> bool:
        """Make forward_mixed's one-call form ready (ONNX Runtime: build and load the mixed step's graph, a second
        session beside the plain one); whether the backend has it (else forward_mixed makes two calls)."""
        if self.step_inputs is not None:  # forward_mixed takes no inputs beyond the contract
            return False
        with self._lock:
            self.backend.activate()
            return self.backend.prepare_mixed()

    def load_adapter(self, name: str) -> None:
        """Read the bundle's adapter `name` into this session now (else its first step that names it does)."""
        with self._lock:
            if self.adapters is None:
                no_slots([name], self.source)
            self.adapters.load(name)

    def adapter_version(self, name: str) -> str | None:
        """The sha256 of the weights this session serves as adapter `name` (None: not loaded)."""
        return None if self.adapters is None else self.adapters.versions.get(name)

    def _lora(self, adapters: list[str | None] | None, batch: int) -> dict[str, np.ndarray] | None:
        """The LoRA inputs of a step (None for a bundle without slots, which takes no adapter)."""
        if self.adapters is None:
            no_slots(adapters, self.source)
            return None
        return self.adapters.feeds(adapters, batch)

    def _checked_step(self, input_ids, attention_mask, position_ids, cache) -> tuple:
        """forward()'s inputs checked against the IO spec and the cache (under the lock): ids, mask, positions, cache."""
        ids = self._check_int64("input_ids", input_ids, ndim=2)
        B, T = ids.shape
        if T == 0 or B == 0:
            raise KvforgeError(f"input_ids must have at least one row and one token, got shape {ids.shape}")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise KvforgeError(f"token ids {sorted(set(bad.tolist()))[:8]} are outside the vocabulary (0..{self.vocab_size - 1})")
        self.backend.activate()
        if cache is None:
            cache = self.backend.empty_cache(B)
        if not isinstance(cache, KVCache):
            raise KvforgeError(f"cache must be a KVCache from this session, got {type(cache).__name__}")
        if cache.owner is not None and cache.owner != self.model_id:
            raise KvforgeError(f"this cache was made by a session of another model ({cache.owner[:16]}), "
                               f"not {self.source}; a cache continues only the model that made it")
        n_cache = sum(len(layer) for layer in self.io.past)
        if len(cache.values) != n_cache or not 0 <= cache.length <= self.max_context:
            raise KvforgeError(f"this cache holds {len(cache.values)} tensors over {cache.length} positions; "
                               f"{self.source} takes {n_cache} tensors over 0..{self.max_context}")
        if cache.batch != B:
            raise KvforgeError(f"the cache holds {cache.batch} rows but input_ids has {B}")
        total = cache.length + T
        if total > self.max_context:
            raise KvforgeError(f"context of {total} tokens (past {cache.length} + new {T}) exceeds the bundle's maximum of {self.max_context}")
        if attention_mask is None:
            attention_mask = np.ones((B, total), np.int64)
        mask = self._check_int64("attention_mask", attention_mask, shape=(B, total))
        if not ((mask == 0) | (mask == 1)).all():
            raise KvforgeError("attention_mask may only hold 0 and 1")
        if position_ids is None:
            position_ids = np.maximum(mask.cumsum(-1) - 1, 0)[:, -T:]
        pos = self._check_int64("position_ids", position_ids, shape=(B, T))
        if (pos < 0).any() or (pos >= self.max_context).any():
            raise KvforgeError(f"position_ids must lie in 0..{self.max_context - 1}")
        return ids, mask, np.ascontiguousarray(pos), cache

    def regroup_cache(self, parts: list[tuple[KVCache, list[int]]], length: int) -> KVCache:
        """Rows of several caches as one, aligned right at `length` positions (see Backend.regroup)."""
        if not parts or any(c.owner not in (None, self.model_id) for c, _ in parts):
            raise KvforgeError("regroup_cache takes one or more caches made by this session")
        if not 0 <= length <= self.max_context:
            raise KvforgeError(f"a cache of {length} positions exceeds the bundle's maximum of {self.max_context}")
        with self._lock:
            cache = self.backend.regroup(parts, length)
            cache.owner = self.model_id
            return cache

    def drop_oldest(self, cache: KVCache, n: int) -> KVCache:
        """The cache without its first n positions, which must be padding for every row (Backend.drop_oldest)."""
        if cache.owner not in (None, self.model_id) or not 0 <= n <= cache.length:
            raise KvforgeError(f"drop_oldest takes a cache of this session and 0..{cache.length} positions, got {n}")
        with self._lock:
            dropped = self.backend.drop_oldest(cache, n)
            dropped.owner = self.model_id
            return dropped

    def rollback(self, before: KVCache, after: KVCache, length: int) -> KVCache:
        """`after` (one step's continuation of `before`) cut back to its first `length` positions, for every row
        alike (Backend.rollback: the packed cache moves its lengths, a graph cache slices). Raises
        NotImplementedError where a capped layer's window has let go positions the cut cache needs (feed the kept
        tokens over `before` instead)."""
        if any(c.owner not in (None, self.model_id) for c in (before, after)) or before.batch != after.batch:
            raise KvforgeError("rollback takes two caches of this session with the same rows")
        if not before.length <= length <= after.length:
            raise KvforgeError(f"rollback keeps {before.length}..{after.length} positions, got {length}")
        with self._lock:
            cut = self.backend.rollback(before, after, length)
            cut.owner = self.model_id
            return cut

    def vacate_rows(self, cache: KVCache, rows: list[int]) -> KVCache:
        """The cache with these rows emptied and kept in place (Backend.vacate: moves nothing); their attention-mask
        rows must be all zeros from now on. Continue the cache returned, not the one given."""
        if cache.owner not in (None, self.model_id) or any(not 0 <= r < cache.batch for r in rows):
            raise KvforgeError(f"vacate_rows takes a cache of this session and rows within its {cache.batch}")
        with self._lock:
            return self.backend.vacate(cache, rows)

    def place_rows(self, cache: KVCache, rows: list[int], part: KVCache) -> KVCache:
        """The cache with the rows of `part` (another cache of this session) in its empty rows `rows`, in order,
        each aligned right (Backend.place: a packed cache copies only part's positions). Continue the cache
        returned, not the one given."""
        if cache.owner not in (None, self.model_id) or part.owner not in (None, self.model_id):
            raise KvforgeError("place_rows takes two caches made by this session")
        if len(rows) != part.batch or len(set(rows)) != len(rows) or any(not 0 <= r < cache.batch for r in rows):
            raise KvforgeError(f"place_rows needs {part.batch} distinct rows within the cache's {cache.batch}, got {rows}")
        if max(cache.length, part.length) > self.max_context:
            raise KvforgeError(f"a cache of {max(cache.length, part.length)} positions exceeds the bundle's maximum of {self.max_context}")
        with self._lock:
            placed = self.backend.place(cache, rows, part)
            placed.owner = self.model_id
            return placed

    def cache_arrays(self, cache: KVCache) -> list[np.ndarray]:
        """The cache's tensors as numpy arrays in the contract's layout (copies; see Backend.cache_arrays)."""
        with self._lock:
            return self.backend.cache_arrays(cache)

    def cache_from_arrays(self, arrays: list[np.ndarray], length: int) -> KVCache:
        """A cache of this session's from numpy arrays, every row `length` real positions (Backend.from_arrays)."""
        n_cache = sum(len(layer) for layer in self.io.past)
        if len(arrays) != n_cache or not 0 < length <= self.max_context:
            raise KvforgeError(f"a cache of {len(arrays)} tensors over {length} positions: {self.source} takes "
                               f"{n_cache} tensors over 1..{self.max_context}")
        with self._lock:
            self.backend.activate()
            cache = self.backend.from_arrays(arrays, length)
            cache.owner = self.model_id
            return cache

    @staticmethod
    def _check_int64(name: str, value, ndim: int | None = None, shape: tuple[int, ...] | None = None) -> np.ndarray:
        if not isinstance(value, np.ndarray):
            raise KvforgeError(f"{name} must be a numpy array of int64, got {type(value).__name__}")
        if value.dtype != np.int64:
            raise KvforgeError(f"{name} must be int64 (the IO spec's dtype), got {value.dtype}")
        if ndim is not None and value.ndim != ndim:
            raise KvforgeError(f"{name} must have {ndim} dimensions [batch, seq], got shape {value.shape}")
        if shape is not None and value.shape != shape:
            raise KvforgeError(f"{name} must have shape {shape}, got {value.shape}")
        return np.ascontiguousarray(value)

    # -- text ------------------------------------------------------------------
    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise KvforgeError(f"{self.source} has no tokenizer; pass token ids instead of text")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return self._require_tokenizer().encode(text)

    def _prompts(self, prompt) -> tuple[list[list[int]], bool]:
        """Normalize str | ids | list of either to a list of id lists; report whether one was given."""
        return token_rows(prompt, self.encode)

    # what a runner of requests (runtime/batcher.py) asks of the session
    def prompt_rows(self, prompt) -> tuple[list[list[int]], bool]:
        """A prompt (str | ids | a list of either) as lists of token ids, and whether one prompt was given."""
        return self._prompts(prompt)

    def stop_tokens(self, config: GenerationConfig) -> set[int]:
        """The token ids that end a generation under config (its stop ids, and the model's EOS unless ignored)."""
        return stop_ids(config, self.config.get("eos_token_id"), self.vocab_size, self.tokenizer)

    def new_drafter(self, config: GenerationConfig):
        """A fresh drafter for config.speculation (runtime/drafting.py): its draft session opened once per path and
        kept, its vocabulary checked."""
        return self._drafter(config)()

    def generate(self, prompt, config: GenerationConfig | None = None, **kwargs) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (-> GenerationResult) or a list (-> list, left-padded batch)."""
        config = config or GenerationConfig.from_kwargs(**kwargs)
        rows, single = self._prompts(prompt)
        with self._lock:
            results = self._generation(rows, config)
        for r in results:
            r.text = self.tokenizer.decode(r.tokens) if self.tokenizer is not None else ""
        return results[0] if single else results

    def stream(self, prompt, config: GenerationConfig | None = None, **kwargs) -> Iterator[TokenEvent]:
        """Yield each generated token with the text it completes (one prompt)."""
        config = config or GenerationConfig.from_kwargs(**kwargs)
        rows, single = self._prompts(prompt)
        if not single:
            raise KvforgeError("stream() takes one prompt; use generate() for a batch")
        # No lock between tokens: each step takes it for its forward pass (the stream owns its cache), so the
        # thread that holds an open stream, or any other, may use the session meanwhile, and a stream left
        # unfinished holds nothing.
        yield from _stream_text(self, rows[0], config)

    def _generation(self, rows: list[list[int]], config: GenerationConfig, stream: bool = False):
        """The generation loop for config: speculative (runtime/speculative.py) or plain (runtime/generate.py);
        results, or (stream) the one row's TokenEvents."""
        stop = self.stop_tokens(config)
        if config.adapter is not None:  # read and checked before any step
            self.load_adapter(config.adapter)
        if config.speculation is not None:
            return generate_speculative(self, rows, config, stop, self._drafter(config), stream)
        return generate_tokens(self, rows, config, stop, stream)

    # -- speculative decoding --------------------------------------------------
    def _drafter(self, config: GenerationConfig):
        """A factory of fresh drafters for config.speculation (runtime/drafting.py), its draft session opened (once
        per path, kept with this session) and its vocabulary checked first."""
        spec = config.speculation
        kind = DRAFTERS[spec.method]
        with self._lock:  # (a batcher's submit() may call this from any thread: one draft session per path)
            where = kind.draft(spec, Path(self.source))
            draft = None if where is None else self._draft_session(where)
        return lambda: kind.make(spec, self, draft)

    def _draft_session(self, where) -> "Session":
        """The draft session at `where`: an open Session (checked), or a bundle path (opened once, kept)."""
        if not isinstance(where, (str, Path)):
            draft = where
        else:
            path = Path(where)
            key = str(path.resolve())
            draft = self._drafts.get(key)
            if draft is None:
                bundle = Bundle(path)
                if not bundle.kind.kv_cache:
                    raise KvforgeError(f"the draft {path} is {kind_name(bundle.kind.name)}; a draft is a decoder LM "
                                       "bundle with the target's tokenizer")
                # on ONNX Runtime its threads stop spinning after each step: they would take the cores from the
                # target's verification step that follows (benchmarks/features/speculative_smollm2.py)
                draft = open_decoder(bundle, "auto", **({} if bundle.is_engine else {"spinning": False})).activate()
                check_vocabularies(self, draft)
                self._drafts[key] = draft
                return draft
        if not isinstance(draft, Session):
            raise KvforgeError(f"a draft session is a decoder Session, got {type(draft).__name__}")
        check_vocabularies(self, draft)
        return draft

    # -- chat ------------------------------------------------------------------
    def chat_ids(self, messages, add_generation_prompt: bool = True, **variables) -> list[int]:
        """The conversation's prompt ids, as the model's chat template writes them (kvforge/chat.py)."""
        return self._require_tokenizer().apply_chat_template(messages, add_generation_prompt, **variables)

    def chat(self, messages, config: GenerationConfig | None = None, **kwargs) -> GenerationResult:
        """The assistant's next reply to a conversation ([{"role": "user", "content": ...}, ...]); kwargs are
        generation options (GenerationConfig)."""
        return self.generate(self.chat_ids(messages), config, **kwargs)

    def stream_chat(self, messages, config: GenerationConfig | None = None, **kwargs) -> Iterator[TokenEvent]:
        """The assistant's next reply, token by token with its text (as stream())."""
        return self.stream(self.chat_ids(messages), config, **kwargs)


def _stream_text(session: Session, prompt: list[int], config: GenerationConfig) -> Iterator[TokenEvent]:
    text = TextStream(session.tokenizer)
    for event in session._generation([prompt], config, stream=True):
        event.text = text.push(event.token, event.last)
        yield event
