"""Tokenizers: any tokenizer.json through `tokenizers`, and a built-in byte-level one.

Torch-free, so that the embedded runtime can use it. The built-in byte-level
tokenizer is itself a `tokenizers` pipeline (byte-level pre-tokenizer, a BPE
model over the 256 byte symbols with no merges), so it saves to a standard
tokenizer.json that Hugging Face and ONNX Runtime GenAI tooling can read.
Token ids 0..255 are the byte values; 256, 257, 258 are <s>, </s>, <pad>.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from kvforge.chat import render, template_from_config
from kvforge.errors import KvforgeError, MissingDependencyError

TOKENIZER_FILE = "tokenizer.json"
SPECIALS_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
_SPECIAL_ROLES = ("bos", "eos", "pad")


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise MissingDependencyError("the `tokenizers` library", "Install it with `pip install tokenizers`.") from e
    return tokenizers


def _check_utf8(text: str) -> None:
    """Text with lone surrogates (bytes that were not UTF-8, as Python decodes command lines and file names
    with surrogateescape) has no UTF-8 form to tokenize."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise KvforgeError(f"the prompt is not valid UTF-8 text: {text[max(0, e.start - 10):e.end + 10]!r} holds "
                           f"{text[e.start:e.end]!r}, not a character") from e


def _file_setting(key: str, setting: dict | None) -> dict | None:
    """tokenizer.json's "padding" or "truncation" entry for a setting as the tokenizers library reports it."""
    if setting is None:
        return None
    tk = _import_tokenizers()
    probe = tk.Tokenizer(tk.models.WordLevel({"[PAD]": 0}, unk_token="[PAD]"))
    if key == "padding":
        probe.enable_padding(**setting)
    else:
        probe.enable_truncation(**setting)
    return json.loads(probe.to_str())[key]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the ids of its special tokens.

    `encode(text)` applies the tokenizer's post-processor (for example the
    `<s> $A` template that prepends BOS), as Hugging Face does with
    `add_special_tokens=True`.
    """

    def __init__(self, backend, bos_token: str | None = None, eos_token: str | None = None, pad_token: str | None = None,
                 chat_template: str | None = None):
        self.backend = backend
        # tokenizer.json's own padding and truncation, kept for save() but not applied: transformers' fast
        # tokenizers pad and truncate only when a call asks (a sentence-transformers file's "Fixed 128" padding
        # would otherwise make every text 128 ids, the padding attended and pooled); its pad token is the default
        self.file_padding, self.file_truncation = backend.padding, backend.truncation
        backend.no_padding()
        backend.no_truncation()
        self._truncating_copies: dict[int, Any] = {}  # max_length -> a backend copy that truncates (_truncating)
        if pad_token is None and self.file_padding and backend.token_to_id(self.file_padding["pad_token"]) is not None:
            pad_token = self.file_padding["pad_token"]
        self.special_tokens = {"bos": bos_token, "eos": eos_token, "pad": pad_token}
        self.chat_template = chat_template  # the checkpoint's Jinja chat template (kvforge/chat.py), if it has one
        for role, token in self.special_tokens.items():
            if token is not None and backend.token_to_id(token) is None:
                raise KvforgeError(f"{role} token {token!r} is not in the tokenizer's vocabulary")

    # -- construction --------------------------------------------------------
    @classmethod
    def byte_level(cls) -> Tokenizer:
        tk = _import_tokenizers()
        vocab = {ch: b for b, ch in bytes_to_unicode().items()}
        specials = ["<s>", "</s>", "<pad>"]
        vocab.update({tok: 256 + i for i, tok in enumerate(specials)})
        backend = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=[]))
        backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = tk.decoders.ByteLevel()
        backend.add_special_tokens(specials)
        backend.post_processor = tk.processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 256)]
        )
        return cls(backend, "<s>", "</s>", "<pad>")

    @classmethod
    def from_json(cls, data: dict, bos_token: str | None = None, eos_token: str | None = None,
                  pad_token: str | None = None, chat_template: str | None = None) -> Tokenizer:
        """A tokenizer from tokenizer.json's content (built in memory, as from a GGUF file's vocabulary)."""
        tk = _import_tokenizers()
        try:
            backend = tk.Tokenizer.from_str(json.dumps(data))
        except Exception as e:  # tokenizers raises plain Exception subclasses on a bad description
            raise KvforgeError(f"the tokenizer description does not load: {e}") from e
        return cls(backend, bos_token, eos_token, pad_token, chat_template)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json; special tokens from tokenizer_config.json beside it, if any."""
        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise KvforgeError(f"no tokenizer file at {path}")
        tk = _import_tokenizers()
        try:
            backend = tk.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exception subclasses on bad JSON
            raise KvforgeError(f"{path} is not a valid tokenizer.json: {e}") from e
        specials: dict[str, str | None] = {}
        template = None
        cfg_path = path.parent / SPECIALS_FILE
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except UnicodeDecodeError as e:
                raise KvforgeError(f"{cfg_path} is not UTF-8 text (byte {e.start}); a tokenizer_config.json is JSON "
                                   "in UTF-8") from e
            except json.JSONDecodeError as e:
                raise KvforgeError(f"{cfg_path} is not valid JSON: {e}") from e
            if not isinstance(cfg, dict):
                raise KvforgeError(f"{cfg_path} holds {type(cfg).__name__} JSON, not an object of special tokens")
            for role in _SPECIAL_ROLES:
                value = cfg.get(f"{role}_token")
                if isinstance(value, dict):  # {"content": "<s>", ...} in older files
                    value = value.get("content")
                specials[role] = value if isinstance(value, str) else None
            template = template_from_config(cfg, str(cfg_path))
        jinja_path = path.parent / CHAT_TEMPLATE_FILE
        if template is None and jinja_path.is_file():  # transformers' newer layout: the template in its own file
            template = jinja_path.read_text(encoding="utf-8")
        return cls(backend, specials.get("bos"), specials.get("eos"), specials.get("pad"), template)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        data = json.loads(self.backend.to_str())
        for key, setting in (("padding", self.file_padding), ("truncation", self.file_truncation)):
            data[key] = _file_setting(key, setting)  # as the checkpoint shipped them (readers apply them on request)
        (directory / TOKENIZER_FILE).write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
        cfg: dict[str, Any] = {f"{role}_token": tok for role, tok in self.special_tokens.items() if tok is not None}
        # How encode() adds special tokens, said the way every reader of these files understands it: transformers
        # (a fast tokenizer over tokenizer.json) and ONNX Runtime GenAI (onnxruntime-extensions reads the class and
        # add_*_token; a Llama class would make it split text differently).
        cfg.update(tokenizer_class="PreTrainedTokenizerFast", **self.adds_special_tokens())
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (directory / SPECIALS_FILE).write_text(json.dumps(cfg, indent=2) + "\n")

    def adds_special_tokens(self) -> dict[str, bool]:
        """{"add_bos_token", "add_eos_token"}: whether encode() puts the BOS first and the EOS last (what the
        tokenizer.json post-processor does), found by encoding a probe text with and without special tokens."""
        plain = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        bos, eos = self.bos_token_id, self.eos_token_id
        return {"add_bos_token": bos is not None and full[:1] == [bos] and plain[:1] != [bos],
                "add_eos_token": eos is not None and full[-1:] == [eos] and plain[-1:] != [eos]}

    # -- chat ------------------------------------------------------------------
    def render_chat(self, messages, add_generation_prompt: bool = True, **variables) -> str:
        """The conversation as the checkpoint's chat template writes it (kvforge/chat.py)."""
        if self.chat_template is None:
            raise KvforgeError("this tokenizer has no chat template (tokenizer_config.json's chat_template, "
                               "chat_template.jinja or a GGUF file's tokenizer.chat_template); use generate with a prompt")
        return render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                      special_tokens=self.special_tokens, **variables)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **variables) -> list[int]:
        """The token ids of the rendered conversation: the template writes the special tokens, so the tokenizer
        adds none of its own (as transformers' apply_chat_template)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **variables), add_special_tokens=False)

    # -- special tokens --------------------------------------------------------
    def _special_id(self, role: str) -> int | None:
        token = self.special_tokens[role]
        return None if token is None else self.backend.token_to_id(token)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (an added special token: `<image>`), or None."""
        return self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad")

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # -- encode / decode -------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise KvforgeError(f"encode takes a str, got {type(text).__name__}")
        _check_utf8(text)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True,
                     max_length: int | None = None) -> list[list[int]]:
        """Token ids of each text; max_length: at most that many, the text cut before its special tokens are added
        (so a [CLS] ... [SEP] row keeps both), as transformers' truncation=True, max_length=N cuts."""
        for text in texts:
            _check_utf8(text)
        backend = self.backend if max_length is None else self._truncating(max_length, pair=False)
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def encode_pairs(self, pairs: Sequence[tuple[str, str]], max_length: int | None = None
                     ) -> tuple[list[list[int]], list[list[int]]]:
        """(token ids, token type ids) of each (text, text pair) as the post-processor joins them ([CLS] a [SEP] b
        [SEP], the second text's types 1), as transformers' tokenizer(text, text_pair) gives them; max_length: cut
        the longer text first until the pair fits (transformers' truncation=True, "longest_first")."""
        for a, b in pairs:
            _check_utf8(a)
            _check_utf8(b)
        backend = self.backend if max_length is None else self._truncating(max_length, pair=True)
        encodings = backend.encode_batch([(a, b) for a, b in pairs])
        return [e.ids for e in encodings], [e.type_ids for e in encodings]

    def _truncating(self, max_length: int, pair: bool):
        """A copy of the backend that truncates to max_length (longest first, special tokens counted), as
        transformers' fast tokenizers truncate; one per length, made once (the shared backend never truncates)."""
        if max_length <= self.backend.num_special_tokens_to_add(pair):
            raise KvforgeError(f"max_length {max_length} leaves no room for text beside the special tokens")
        if max_length not in self._truncating_copies:
            backend = type(self.backend).from_str(self.backend.to_str())
            backend.enable_truncation(max_length, strategy="longest_first")
            self._truncating_copies[max_length] = backend
        return self._truncating_copies[max_length]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids past the tokenizer's vocabulary have no text and are skipped, as in transformers:
        a model's embedding is often padded beyond its tokenizer (Qwen2), and it may generate those ids."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if i < 0]
        if bad:
            raise KvforgeError(f"token ids {bad[:8]} are negative; token ids start at 0")
        size = self.vocab_size  # once: the backend counts it on each call
        return self.backend.decode([i for i in ids if i < size], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, specials={self.special_tokens})"
