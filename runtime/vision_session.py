"""Sessions over vision-language bundles (LLaVA, Idefics2/3, Qwen2-VL): images through the vision graph once, then
a decoder Session over the decoder graph that takes their features (issue 37).

    from kvforge import runtime
    with runtime.load("runs/llava") as session:                       # a VisionLanguageSession
        print(session.generate("<image>\\nWhat is in the picture?", images=["cat.png"]).text)

A prompt's text holds the config's image placeholder (`<image>`) once per image; each stands for the image's
`image_tokens` image tokens, the rows the decoder's graph replaces with that image's features (the placeholder is
a special token of the model's tokenizer, where it has one: its text is then encoded whole, as transformers'
processor does; else the text around the placeholders is encoded piece by piece). Token-id prompts hold the image
tokens themselves. Images are Pillow images, paths, bytes or data URLs, preprocessed as the model's Hugging Face
image processor does (kvforge/images.py).

Families whose processor writes more than image tokens (Idefics2's <fake_token_around_image>, Idefics3's tiles
with their <row_r_col_c> and the whole image after <global-img>) get that text per placeholder, from each image's
tiles (kvforge/images.py prompt_with_images); Qwen2-VL's placeholder is repeated once per token of the image's
grid, and its decoder's multimodal RoPE takes each prompt's offsets (kvforge.images.rope_offsets), fed per row by
a FeatureFeed with the row's features. chat() and stream_chat() take messages with image parts (OpenAI's
image_url, transformers' image) through the model's chat template.

Generation is the decoder Session's (runtime/generate.py: greedy or sampled, stop tokens, response formats,
logprobs): its prefill takes the images' features, each later step none (an image token the model generates keeps
its own embedding, as in transformers). batcher() is the continuous batcher over the decoder whose requests carry
their own images (VisionBatcher). Backend: onnxruntime; the decoder runs its ORT variant over a packed cache (the image
features bound per call, runtime/step_inputs.py) unless loaded with variant=False. A session's calls are
serialized.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from typing import Any, Iterator

import numpy as np

from kvforge.bundle import FEATURES, OFFSETS, PIXELS, Bundle
from kvforge.errors import KvforgeError
from kvforge.images import ImageProcessing, load_image, prompt_with_images, rope_offsets, same_size_batches
from kvforge.ort_session import make_session
from kvforge.tokenizer import Tokenizer

from .batch_executor import join_inputs
from .batcher import BatchOptions, Batcher, Request
from .generate import GenerationConfig, GenerationResult, TokenEvent, token_rows
from .ort_backend import OnnxRuntimeBackend
from .session import Session



class VisionLanguageSession:
    architecture = "vision-language"

    def __init__(self, bundle: Bundle, backend: str = "auto", **options):
        if backend not in ("auto", "onnxruntime"):
            raise KvforgeError(f"vision-language bundles run on the onnxruntime backend for now, not {backend!r}")
        if bundle.is_engine:
            raise KvforgeError(f"{bundle.path} holds TensorRT engines; running a vision-language model's engines is not "
                               "built yet: run its ONNX bundle (the one it was built from)")
        self.bundle = bundle
        self.source = str(bundle.path)
        self.config: dict[str, Any] = bundle.model_config
        self.io = bundle.io
        spec = self.io.extra["vision"]
        self.image_token_id = int(spec["image_token_id"])
        self.image_tokens = int(spec["image_tokens"])
        self.placeholder = self.config.get("image_placeholder", "<image>")
        self.image_prompt = self.config.get("image_prompt", "tokens")
        self.processing = ImageProcessing(**self.config["image_processing"])
        decoder_config = self.config["decoder"]
        self.tokenizer = Tokenizer.from_file(bundle.tokenizer_file) if bundle.tokenizer_file else None
        impl = OnnxRuntimeBackend(decoder_config, self.io, bundle, **options)
        self.decoder = Session(impl, self.tokenizer, decoder_config, self.io, self.source, bundle.graph_sha256)
        self.decoder.step_inputs = self._step_features
        self.mrope = any(t.name == OFFSETS for t in self.io.inputs)  # the decoder turns multimodal RoPE (Qwen2-VL)
        self.feature_dim = next(t for t in self.io.inputs if t.name == FEATURES).shape[-1]
        self.feature_dtype = np.float16 if next(t for t in self.io.inputs if t.name == FEATURES).dtype == "float16" \
            else np.float32
        self._vision_graph = bundle.path / bundle.graphs["vision"]
        self._vision = None
        self._threads = options.get("threads")
        self._local = threading.local()  # each thread's generation feeds (a batcher's thread has its own)
        self._lock = threading.RLock()

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        return self.decoder.backend_name

    @property
    def backend(self):
        return self.decoder.backend

    @property
    def max_context(self) -> int:
        return self.decoder.max_context

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    def activate(self):
        with self._lock:
            self.decoder.activate()
            if self._vision is None:
                # the tower's quantized kernels as the decoder's: exact Q/DQ where the CPU's fused INT8 ones saturate;
                # its patches are many rows, at the level of the decoder's prompts
                self._vision = make_session(str(self._vision_graph), self.bundle.session_format,
                                            threads=self._threads, accuracy_level=self.backend.prefill_level)
        return self

    def deactivate(self) -> None:
        with self._lock:
            self.decoder.deactivate()
            self._vision = None

    def __enter__(self):
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def __repr__(self) -> str:
        return f"VisionLanguageSession({self.source!r}, backend={self.backend_name!r})"

    # -- images ------------------------------------------------------------------------------
    def feature_sets(self, images: list[Any]) -> list[np.ndarray]:
        """Each image's features (P, C), or each of its tiles' and then the whole image's where the processing
        splits images (Pillow images, paths, bytes or data URLs). P is image_tokens, or (Qwen2-VL) its own grid's."""
        return self.tile_features(self.processing.process_tiles(list(images))[0]) if images else []

    def image_features(self, images: list[Any]) -> np.ndarray:
        """(N, image_tokens, C): feature_sets() as one array, where every set has the same size."""
        sets = self.feature_sets(images)
        if not sets:
            return np.zeros((0, self.image_tokens, self.feature_dim), self.feature_dtype)
        if len({f.shape for f in sets}) > 1:
            raise KvforgeError("these images give different numbers of features (each its own patch grid): use "
                               "feature_sets()")
        return np.stack(sets)

    def tile_features(self, tiles: list[np.ndarray]) -> list[np.ndarray]:
        """The vision graph over preprocessed tiles (ImageProcessing.process_tiles), one call per run of equal sizes;
        each tile's features."""
        self.activate()
        return [f for batch in same_size_batches(tiles) for f in self._vision.run(None, {PIXELS: batch})[0]]

    def _step_features(self, input_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The decoder step's inputs beyond the contract: each row's from its FeatureFeed (this thread's, set for
        a generation), else none (no feature rows; plain positions)."""
        feeds = getattr(self._local, "feeds", None)
        if feeds is not None and len(feeds) == input_ids.shape[0]:
            return join_inputs([feed(input_ids[i:i + 1]) for i, feed in enumerate(feeds)])
        return self._no_inputs(input_ids.shape)

    def _no_inputs(self, shape: tuple[int, int]) -> dict[str, np.ndarray]:
        out = {FEATURES: np.zeros((0, self.feature_dim), self.feature_dtype)}
        if self.mrope:
            out[OFFSETS] = np.zeros((shape[0], 3, shape[1]), np.int64)
        return out

    def _take(self, pending: deque, input_ids: np.ndarray) -> np.ndarray:
        """The step's feature rows: the pending rows its image tokens take, in order. A prompt's image tokens
        and images were checked to agree (_image_rows); an image token beyond them (one that generation
        produced) takes no row and keeps its own embedding, as in transformers."""
        n = min(int((input_ids == self.image_token_id).sum()), len(pending))
        rows = [pending.popleft() for _ in range(n)]
        out = np.stack(rows) if rows else np.zeros((0, self.feature_dim), self.feature_dtype)
        return out.astype(self.feature_dtype, copy=False)

    def feed(self, images: list[Any], prompt: list[int] | None = None) -> "FeatureFeed":
        """One prompt's images as its own step inputs (the batcher's `inputs`): read and preprocessed now (a bad
        image is refused here), their features computed by the vision graph at the prompt's first step. prompt:
        its token ids, where the decoder's multimodal RoPE places the images' tokens by their grids."""
        tiles = self.processing.process_tiles(list(images))[0] if images else []
        grids = [self.processing.prompt_grid(im) for im in images] if self.mrope and images else []
        return FeatureFeed(self, tiles, prompt, grids)

    def forward(self, input_ids: np.ndarray, image_features: np.ndarray | None = None,
                attention_mask: np.ndarray | None = None, *, cache=None, last_logits_only: bool = False,
                rope_offsets: np.ndarray | None = None):
        """One decoder step (Session.forward) whose image tokens take `image_features`: (images, P, C) or their
        rows (R, C), in the order the step's image tokens come. Returns (float32 logits, the new cache). Without
        features, an image token keeps its own embedding (a generated one). rope_offsets (B, 3, T): multimodal
        RoPE's positions less the plain ones (kvforge.images.rope_offsets), where the decoder turns it (else 0)."""
        ids = np.asarray(input_ids)
        inputs = self._no_inputs(ids.shape)
        if image_features is not None:
            rows = np.asarray(image_features).reshape(-1, self.feature_dim)
            n = int((ids == self.image_token_id).sum())
            if n != len(rows):
                raise KvforgeError(f"the step holds {n} image tokens but {len(rows)} feature rows were given "
                                   f"({self.image_tokens} per image)")
            inputs[FEATURES] = rows.astype(self.feature_dtype, copy=False)
        if rope_offsets is not None:
            if not self.mrope:
                raise KvforgeError(f"{self.source}'s decoder turns plain RoPE: it takes no rope_offsets")
            inputs[OFFSETS] = np.asarray(rope_offsets, np.int64).reshape(ids.shape[0], 3, ids.shape[1])
        return self.decoder.forward(ids, attention_mask, cache=cache, last_logits_only=last_logits_only,
                                    inputs=inputs)

    # -- prompts -----------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, grids: list[tuple[int, int]] | None = None
               ) -> list[int]:
        """Text with image placeholders -> ids with each image's tokens where its placeholder is, written as the
        model's processor writes them (the config's image_prompt: kvforge/images.py prompt_with_images). grids: each
        image's (rows, cols) of tiles where the processing splits images (ImageProcessing.grid; None: unsplit)."""
        tok = self.tokenizer
        if tok is None:
            raise KvforgeError(f"{self.source} has no tokenizer; pass token ids instead of text")
        special = tok.token_to_id(self.placeholder) == self.image_token_id
        if self.image_prompt != "tokens":  # the processor's text around each image, then the text encoded whole
            count = text.count(self.placeholder)
            grids = [(0, 0)] * count if grids is None else grids
            if len(grids) != count or not special:
                raise KvforgeError(f"the text holds {count} {self.placeholder!r} placeholder(s) but {len(grids)} "
                                   "image(s) were given" if special else
                                   f"{self.placeholder!r} is not one token of this model's tokenizer")
            text = prompt_with_images(self.image_prompt, text, self.placeholder, self.image_tokens, grids)
            return tok.encode(text, add_special_tokens=add_special_tokens)
        if special:  # one special token: encode the text whole
            ids = tok.encode(text, add_special_tokens=add_special_tokens)
        else:
            pieces = text.split(self.placeholder)
            ids = tok.encode(pieces[0], add_special_tokens=add_special_tokens)
            for piece in pieces[1:]:
                ids += [self.image_token_id] + (tok.encode(piece, add_special_tokens=False) if piece else [])
        out = []
        for t in ids:
            out += [t] * self.image_tokens if t == self.image_token_id else [t]
        return out

    def _grids(self, images) -> list[tuple[int, int]] | None:
        """What each image's text in a prompt depends on (its tiles, or Qwen2-VL's token grid), else None."""
        p = self.processing
        return [p.prompt_grid(im) for im in images] if p.do_image_splitting or p.patch_layout else None

    def _prompts(self, prompt, images=None) -> tuple[list[list[int]], bool]:
        """Token rows of a prompt (text, token ids, or a batch of either) and whether it was one prompt; a text's
        images (a batch's: a list per prompt) decide how it writes them where they are split into tiles."""
        if isinstance(prompt, str):
            return [self.encode(prompt, grids=self._grids(images or []))], True
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            per = images if isinstance(images, (list, tuple)) and len(images) == len(prompt) else [[]] * len(prompt)
            return [self.encode(p, grids=self._grids(ims if isinstance(ims, (list, tuple)) else []))
                    for p, ims in zip(prompt, per)], False
        return token_rows(prompt, self.encode)

    @staticmethod
    def _loaded(images):
        """The images (one prompt's list, or a list per prompt) as Pillow images, each read once: the prompt's text,
        its check and its pixels all look at them."""
        if images is None:
            return None
        return [[load_image(x) for x in e] if isinstance(e, (list, tuple)) else load_image(e) for e in images]

    def _image_rows(self, rows: list[list[int]], images, single: bool) -> list[list[Any]]:
        """Each row's images, checked against its image tokens."""
        if images is None:
            images = [[] for _ in rows]
        elif single:
            images = [list(images)]
        elif len(images) != len(rows) or not all(isinstance(x, (list, tuple)) for x in images):
            raise KvforgeError(f"a batch of {len(rows)} prompts takes a list of images per prompt")
        for i, (row, ims) in enumerate(zip(rows, images)):
            tokens = sum(1 for t in row if t == self.image_token_id)
            need = sum(self.processing.image_tokens(im, self.image_tokens) for im in ims)
            if tokens != need:
                where = "the prompt" if single else f"prompt {i}"
                raise KvforgeError(f"{where} holds {tokens} image tokens but its {len(ims)} image(s) take {need} "
                                   f"(an image {self.image_tokens} per tile): put one {self.placeholder!r} in the text "
                                   "per image")
        return [list(x) for x in images]

    def _feed(self, rows: list[list[int]], images: list[list[Any]]) -> None:
        """This thread's generation feeds each row its images (and multimodal RoPE's offsets)."""
        self._local.feeds = [self.feed(ims, row) for row, ims in zip(rows, images)]

    def batcher(self, options: BatchOptions | None = None, **settings) -> "VisionBatcher":
        """A continuous batcher over this session's decoder whose requests carry their own images
        (submit(prompt, images=[...])): runtime.Batcher's options (a BatchOptions, or its fields)."""
        return VisionBatcher(self, options, **settings)

    def chat_ids(self, messages, images=None, add_generation_prompt: bool = True) -> tuple[list[int], list[Any]]:
        """(prompt ids, images) of a conversation whose contents may hold image parts (kvforge.chat.split_images:
        OpenAI's image_url parts, transformers' image parts; a part without its image takes the next of
        `images`), written by the model's chat template with its image placeholder per image."""
        ids, chosen, _ = self._chat(messages, images, add_generation_prompt)
        return ids, chosen

    def _chat(self, messages, images, add_generation_prompt: bool = True) -> tuple[list[int], list[Any], list[Any]]:
        """chat_ids(), and the images read."""
        from kvforge.chat import split_images

        if self.tokenizer is None:
            raise KvforgeError(f"{self.source} has no tokenizer to write a chat with")
        template_messages, found = split_images(messages)
        given = list(images or [])
        missing = sum(1 for x in found if x is None)
        if missing != len(given):
            raise KvforgeError(f"the messages hold {missing} image part(s) without their image but {len(given)} "
                               "image(s) were given beside them")
        supply = iter(given)
        chosen = [x if x is not None else next(supply) for x in found]
        loaded = self._loaded(chosen)
        text = self.tokenizer.render_chat(template_messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False, grids=self._grids(loaded)), chosen, loaded

    def chat(self, messages, config: GenerationConfig | None = None, images=None, **kwargs) -> GenerationResult:
        """The assistant's next reply to a conversation with images (chat_ids); kwargs are generation options."""
        ids, _, loaded = self._chat(messages, images)
        return self.generate(ids, config, images=loaded, **kwargs)

    def stream_chat(self, messages, config: GenerationConfig | None = None, images=None, **kwargs
                    ) -> Iterator[TokenEvent]:
        """The assistant's next reply, token by token with its text (as stream())."""
        ids, _, loaded = self._chat(messages, images)
        return self.stream(ids, config, images=loaded, **kwargs)

    # -- generation --------------------------------------------------------------------------
    def stop_tokens(self, config: GenerationConfig) -> set[int]:
        """The token ids that end a generation under config (the decoder's)."""
        return self.decoder.stop_tokens(config)

    def generate(self, prompt, config: GenerationConfig | None = None, images=None, **kwargs
                 ) -> GenerationResult | list[GenerationResult]:
        """Generate for one prompt (its images: a list) or a batch (a list of images per prompt)."""
        config = config or GenerationConfig.from_kwargs(**kwargs)
        self._refuse(config)
        images = self._loaded(images)
        rows, single = self._prompts(prompt, images)
        per_row = self._image_rows(rows, images, single)
        with self._lock:
            self._feed(rows, per_row)
            try:
                results = self.decoder.generate(rows, config)
            finally:
                self._local.feeds = None
        return results[0] if single else results

    def stream(self, prompt, config: GenerationConfig | None = None, images=None, **kwargs) -> Iterator[TokenEvent]:
        """Yield each generated token with its text (one prompt and its images)."""
        config = config or GenerationConfig.from_kwargs(**kwargs)
        self._refuse(config)
        images = self._loaded(images)
        rows, single = self._prompts(prompt, images)
        if not single:
            raise KvforgeError("stream() takes one prompt; use generate() for a batch")
        per_row = self._image_rows(rows, images, True)
        with self._lock:  # the whole stream: the pending features belong to its prefill
            self._feed(rows, per_row)
            try:
                yield from self.decoder.stream(rows[0], config)
            finally:
                self._local.feeds = None

    def _refuse(self, config: GenerationConfig) -> None:
        if config.speculation is not None:
            raise KvforgeError("speculative decoding with images is not built yet; leave speculative out")
        if config.adapter is not None:
            raise KvforgeError("this vision-language bundle has no LoRA slots")


class FeatureFeed:
    """A prompt's own step inputs (a callable: a step's input ids (1, T) -> inputs): its images' feature rows,
    taken by its image tokens in order, and where the decoder turns multimodal RoPE, each fed position's offset
    (kvforge.images.rope_offsets: the prompt's, then the one after it; a row's left padding takes 0). The
    features are computed at the first step (on the batcher's thread: a server's request handler does not wait for
    the vision graph); `key` (the preprocessed pixels' sha256) keeps the prompt's prefix-cache blocks apart from
    those of other images."""

    def __init__(self, session: VisionLanguageSession, tiles: list[np.ndarray], prompt: list[int] | None = None,
                 grids: list[tuple[int, int]] | None = None):
        self.session = session
        self.tiles = tiles
        self.pending: deque[np.ndarray] | None = None if tiles else deque()
        digest = hashlib.sha256()
        for t in tiles:
            digest.update(repr(t.shape).encode())
            digest.update(np.ascontiguousarray(t).tobytes())
        self.key = digest.digest() if tiles else None
        self.prompt, self.grids, self.fed = prompt, grids or [], 0
        self._offsets: tuple[np.ndarray, int] | None = None

    def __call__(self, input_ids: np.ndarray) -> dict[str, np.ndarray]:
        if self.pending is None:
            self.pending = deque(row for f in self.session.tile_features(self.tiles) for row in f)
            self.tiles = []
        out = {FEATURES: self.session._take(self.pending, input_ids)}
        if self.session.mrope:
            out[OFFSETS] = self._rope(input_ids.shape[1])[None]
        return out

    def _rope(self, steps: int) -> np.ndarray:
        """(3, steps) offsets of the next `steps` positions fed (a first step longer than the prompt: left pads)."""
        if self._offsets is None:
            prompt = self.prompt or []
            self._offsets = rope_offsets(prompt, self.session.image_token_id, self.grids) if self.grids else \
                (np.zeros((3, len(prompt)), np.int64), 0)
        table, after = self._offsets
        pads = steps - table.shape[1] if self.fed == 0 and steps > table.shape[1] else 0
        out = np.zeros((3, steps), np.int64)
        for k in range(pads, steps):
            p = self.fed + k - pads
            out[:, k] = table[:, p] if p < table.shape[1] else after
        self.fed += steps - pads
        return out


class VisionBatcher(Batcher):
    """runtime.Batcher over a VisionLanguageSession's decoder: submit() takes a prompt with image placeholders
    (or image tokens) and its images, read and preprocessed at submit() (a bad image is refused there); the vision
    graph runs at the request's first prefill step and its features feed that request's image tokens. Prompts with images and without share the batch; mixed steps are off (a prompt's
    chunk rides apart)."""

    def __init__(self, session: VisionLanguageSession, options: BatchOptions | None = None, **settings):
        options = BatchOptions.of(options, settings)
        if options.speculative:
            raise KvforgeError("speculative decoding with images is not built yet; leave speculative out")
        super().__init__(session.decoder, options)
        self.vision = session

    def submit(self, prompt, config: GenerationConfig | None = None, images=None, **kwargs) -> Request:
        config = config or GenerationConfig.from_kwargs(**kwargs)
        self.vision._refuse(config)
        images = self.vision._loaded(images)
        rows, single = self.vision._prompts(prompt, images)
        if not single:
            raise KvforgeError("submit() takes one prompt; submit each of a batch on its own")
        per_row = self.vision._image_rows(rows, images, True)
        return super().submit(rows[0], config, inputs=self.vision.feed(per_row[0], rows[0]))
