"""Constrained decoding: a response format (JSON mode, a JSON Schema, a regular expression, a grammar, a
structural tag) as a token mask per generated row.

    session.generate(prompt, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {...}}})

The formats (`GenerationConfig.response_format`) are OpenAI's, with vLLM-like extensions:

    {"type": "text"}                                   no constraint (as None)
    {"type": "json_object"}                            any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
    {"type": "regex", "regex": "..."}                  the whole output matches (Rust `regex` syntax)
    {"type": "grammar", "grammar": "..."}              llguidance's Lark dialect (`start: ...`); a llama.cpp GBNF
                                                       grammar (`root ::= ...`) is converted to it
    {"type": "structural", "begin": "<tool_call>\\n", "schema": {...}, "end": "\\n</tool_call>"}
                                                       literal text, JSON matching the schema, literal text

JSON is written compactly, one way: separators ", " and ": ", no other whitespace (free whitespace lets a model
pad without end). Properties come in the schema's order. A schema is checked with jsonschema's `check_schema`
(its declared draft, else 2020-12) and then compiled; what the engine does not implement (an unknown `format`,
say) is refused, never silently ignored. Every problem is a KvforgeError raised before any forward pass.

`"strict": true` (OpenAI's structured outputs) means no property beyond those declared: the schema is tightened
as xgrammar's strict mode tightens it (`strict_schema`: additionalProperties false on every object that says
nothing of other properties, no array item beyond prefixItems). OpenAI refuses such a schema in strict mode
unless it says `additionalProperties: false` itself and requires every property; kvforge tightens it instead,
so every schema OpenAI takes means the same here and one it refuses still gets output its schema admits (with
JSON Schema's own reading, an undeclared property is allowed: a model writes one at will). Without `strict`
the schema means what JSON Schema says.

Each row has its own matcher. At each step the row's mask allows the tokens the grammar allows, never a
special token, and the model's stop tokens exactly when the grammar accepts; the row ends ("stop") when the
grammar is complete and nothing but a stop token may follow. Vocabulary rows beyond the tokenizer's
(a model's padded embedding) are always masked.

The engine: llguidance (Microsoft's; vLLM's and SGLang's `guidance` backend), chosen over xgrammar 0.2.8 by
benchmarks/kernels/grammar_engines.py on SmolLM2's 49,152-token vocabulary and the 20 schemas of the tests (both compile
all 20): llguidance compiles a schema in 0.5 ms (median; max 0.8) where xgrammar takes 16 ms (max 119: it
precomputes masks per grammar), and computes a mask in 14 us median, 91 us mean, 2.2 ms p99, where xgrammar's
median is 2 us but its mean 0.5 ms and p99 11 ms; a SmolLM2 decode step takes about 30 ms here, so either is cheap
per token and llguidance's tail and compile times are the better ones. And xgrammar imports Torch (and
transformers) when imported, which the Torch-free runtime cannot take; llguidance needs nothing (not even NumPy).
llguidance builds its vocabulary from the bundle's tokenizer.json itself (byte-level BPE, SentencePiece with byte
fallback, added and special tokens), so every family kvforge reads works.

Compiled grammars are cached: one per (tokenizer, vocabulary size, format), least recently used first out.
A batch's masks are computed in one call (llguidance's executor, the GIL released) after the tokens' choice and
before the next forward pass; they take 0.6% of a decode step at batch 1 and 2% at batch 8
(benchmarks/features/constrained_decoding.py), so they are not overlapped with it.

Limits: JSON Schema cannot bound the digits of a fraction, so a weak model may write them until max_new_tokens
("length"), as it may a string without maxLength or an array without maxItems. To the grammar, a SentencePiece token's leading ▁ is a space, so JSON
starts with a token without one.
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from kvforge.errors import KvforgeError, MissingDependencyError

if TYPE_CHECKING:  # pragma: no cover
    from kvforge.tokenizer import Tokenizer

FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "grammar", "structural")
# JSON as one canonical compact layout (see the module's doc)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_GRAMMARS_KEPT = 256  # parsed formats (grammar text), by the format's JSON
_COMPILED_KEPT = 64  # compiled matchers, by tokenizer, vocabulary size and format
_VOCABULARIES_KEPT = 4  # the engine's view of a tokenizer (building one for 50k tokens takes about 0.5 s)


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise MissingDependencyError("llguidance (the grammar engine of response_format)",
                                     "Install it with `pip install llguidance`.") from e
    return llguidance


class _LRU:
    """A small thread-safe least-recently-used map."""

    def __init__(self, size: int):
        self.size = size
        self.items: collections.OrderedDict = collections.OrderedDict()
        self.lock = threading.Lock()

    def get(self, key, make):
        with self.lock:
            if key in self.items:
                self.items.move_to_end(key)
                return self.items[key]
        value = make()  # outside the lock: compiling may take a while, and llguidance releases the GIL
        with self.lock:
            self.items[key] = value
            self.items.move_to_end(key)
            while len(self.items) > self.size:
                self.items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self.items)


_grammars = _LRU(_GRAMMARS_KEPT)
_compiled = _LRU(_COMPILED_KEPT)
_vocabularies = _LRU(_VOCABULARIES_KEPT)
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# -- formats ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponseFormat:
    """A checked response format: its type, its llguidance grammar, and the key it is cached under."""

    type: str
    grammar: str
    key: str


def parse_response_format(fmt: Any) -> ResponseFormat | None:
    """Check a response_format (see the module's doc) and compile its grammar without a vocabulary; None for no
    constraint. Raises KvforgeError naming the problem."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise KvforgeError(f"response_format must be a dict such as {{'type': 'json_object'}}, got {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind not in FORMAT_TYPES:
        raise KvforgeError(f"response_format type {kind!r} is unknown; types: {', '.join(FORMAT_TYPES)}")
    if kind == "text":
        return None
    try:
        key = json.dumps(fmt, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise KvforgeError(f"response_format must be plain JSON data: {e}") from e
    grammar = _grammars.get(key, lambda: _grammar_of(kind, fmt))
    return ResponseFormat(kind, grammar, key)


def _field(fmt: dict, name: str, types: type, what: str):
    value = fmt.get(name)
    if not isinstance(value, types):
        raise KvforgeError(f"response_format {fmt.get('type')!r} needs {name!r}: {what}; got {value!r:.200}")
    return value


def check_schema(schema: Any, where: str) -> None:
    """A JSON Schema by jsonschema's meta-schema (the draft its $schema names, else 2020-12)."""
    if not isinstance(schema, dict):
        raise KvforgeError(f"{where} must be a JSON Schema (an object), got {type(schema).__name__}")
    try:
        import jsonschema
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise MissingDependencyError("jsonschema (checks response_format schemas)", "Install it with `pip install jsonschema`.") from e
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.absolute_path) or "(the root)"
        raise KvforgeError(f"{where} is not a valid JSON Schema: at {path}: {e.message}") from e


def _grammar_of(kind: str, fmt: dict) -> str:
    llg = _llguidance()
    if kind == "json_object":
        grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    elif kind == "json_schema":
        spec = _field(fmt, "json_schema", dict, "an object {'name': ..., 'schema': {...}}")
        if "schema" not in spec:
            raise KvforgeError("response_format json_schema needs json_schema['schema'], the JSON Schema to follow")
        schema = spec["schema"]
        check_schema(schema, "response_format json_schema['schema']")
        strict = spec.get("strict", False)
        if not isinstance(strict, bool):
            raise KvforgeError(f"response_format json_schema['strict'] must be true or false, got {strict!r:.80}")
        grammar = _json_grammar(llg, strict_schema(schema) if strict else schema)
    elif kind == "regex":
        grammar = llg.LLMatcher.grammar_from_regex(_field(fmt, "regex", str, "a regular expression"))
    elif kind == "grammar":
        text = _field(fmt, "grammar", str, "a Lark grammar (llguidance's dialect) or a GBNF grammar")
        try:
            grammar = llg.grammar_from("grammar", text)
        except ValueError as e:
            raise KvforgeError(f"response_format grammar does not parse: {e}") from e
    else:  # structural
        begin = _field(fmt, "begin", str, "the literal text before the JSON")
        end = _field(fmt, "end", str, "the literal text after the JSON")
        schema = fmt.get("schema")
        check_schema(schema, "response_format structural['schema']")
        body = json.dumps({**schema, "x-guidance": {**schema.get("x-guidance", {}), **JSON_OPTIONS}}, ensure_ascii=False)
        lark = "start: " + " ".join(p for p in (_lark_literal(begin), f"%json {body}", _lark_literal(end)) if p)
        grammar = llg.LLMatcher.grammar_from_lark(lark)
    problem = llg.LLMatcher.validate_grammar(grammar)
    if problem:
        raise KvforgeError(f"response_format {kind} does not compile: {problem.strip()}")
    return grammar


# where a schema holds subschemas: keyword -> how (one schema, a list of them, or a map of them)
_SUBSCHEMAS = {"properties": "map", "patternProperties": "map", "$defs": "map", "definitions": "map",
               "additionalProperties": "one", "items": "one", "contains": "one", "prefixItems": "list",
               "anyOf": "list", "oneOf": "list"}


def strict_schema(schema: Any) -> Any:
    """A JSON Schema read as OpenAI's strict mode reads it, tightened as xgrammar's strict mode tightens it: an
    object admits no property beyond those it declares (additionalProperties false where the schema says nothing
    of other properties) and an array with prefixItems no item beyond them. Every document the result admits
    the schema admits too. Subschemas of allOf are left as written: each sees only its own properties, so a
    tightened branch would refuse the others' (OpenAI's strict mode does not take allOf)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, how in _SUBSCHEMAS.items():
        value = out.get(key)
        if how == "one" and isinstance(value, dict):
            out[key] = strict_schema(value)
        elif how == "list" and isinstance(value, list):
            out[key] = [strict_schema(v) for v in value]
        elif how == "map" and isinstance(value, dict):
            out[key] = {k: strict_schema(v) for k, v in value.items()}
    types = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if ("object" in types or "properties" in out) and not {"additionalProperties", "unevaluatedProperties",
                                                           "patternProperties"} & set(out):
        out["additionalProperties"] = False
    if "prefixItems" in out and not {"items", "unevaluatedItems"} & set(out):
        out["items"] = False
    return out


def _json_grammar(llg, schema) -> str:
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as e:
        raise KvforgeError(f"response_format json_schema does not compile: {e}") from e


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else ""


# -- the engine's vocabulary ---------------------------------------------------------------------------
def _fingerprint(tokenizer: Tokenizer) -> tuple[str, str]:
    """(sha256 of the tokenizer's JSON, the JSON): the cache key of its engine vocabulary."""
    known = _fingerprints.get(tokenizer)
    if known is None:
        text = tokenizer.backend.to_str()
        known = (hashlib.sha256(text.encode("utf-8")).hexdigest(), text)
        _fingerprints[tokenizer] = known
    return known


def vocabulary(tokenizer: Tokenizer, vocab_size: int):
    """llguidance's LLTokenizer for `tokenizer` over a model vocabulary of `vocab_size` rows (cached)."""
    if tokenizer.vocab_size > vocab_size:
        raise KvforgeError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {vocab_size} logits; "
                           "constrained decoding needs a logit for every token")
    sha, text = _fingerprint(tokenizer)
    eos = tokenizer.eos_token_id

    def make():
        llg = _llguidance()
        try:
            return llg.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        except Exception as e:  # the Rust side raises ValueError/RuntimeError on a tokenizer it cannot read
            raise KvforgeError(f"the grammar engine cannot read this tokenizer: {e}") from e

    return _vocabularies.get((sha, vocab_size, eos), make)


# -- matchers ---------------------------------------------------------------------------------------
class Constraint:
    """One row's grammar state: the tokens it allows next, and the tokens chosen so far."""

    def __init__(self, matcher, vocab_size: int, stop: set[int], engine_eos: Sequence[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stop = np.array(sorted(t for t in stop if t < vocab_size), np.int64)
        self.engine_eos = np.array([t for t in engine_eos if t < vocab_size], np.int64)
        self.done = matcher.is_stopped()

    def check(self) -> None:
        if self.matcher.is_error():
            raise KvforgeError(f"the grammar engine failed: {self.matcher.get_error()}")

    def finish_mask(self, allowed: np.ndarray) -> None:
        """Adjust a row's engine mask (bool, V) in place: the engine's EOS off, the stop tokens on exactly when the
        grammar accepts. Raises when nothing at all may follow (an engine failure)."""
        allowed[self.engine_eos] = False
        allowed[self.stop] = self.matcher.is_accepting()
        if not allowed.any():
            self.check()
            raise KvforgeError("the grammar allows no next token and no stop token (is the row's stop list empty "
                               "with ignore_eos, and the grammar complete?)")

    def advance(self, token: int) -> bool:
        """Take the chosen token; True when the grammar is then complete and nothing but a stop token may follow."""
        if not self.matcher.consume_token(int(token)):
            self.check()
            raise KvforgeError(f"the grammar engine refused token {token}, which its own mask allowed")
        self.done = self.matcher.is_stopped()
        return self.done


def constraint(fmt: ResponseFormat, tokenizer: Tokenizer | None, vocab_size: int, stop: set[int]) -> Constraint:
    """A fresh matcher for one row (the format compiled once per tokenizer and vocabulary size, then copied)."""
    if tokenizer is None:
        raise KvforgeError("response_format needs the bundle's tokenizer (tokenizer.json); this bundle has none")
    llg = _llguidance()
    llt = vocabulary(tokenizer, vocab_size)
    sha, _ = _fingerprint(tokenizer)

    def compile_():
        m = llg.LLMatcher(llt, fmt.grammar, log_level=0)
        if m.is_error():
            raise KvforgeError(f"response_format {fmt.type} does not compile for this tokenizer: {m.get_error().strip()}")
        return m

    template = _compiled.get((sha, vocab_size, tokenizer.eos_token_id, fmt.key), compile_)
    row = Constraint(template.deep_copy(), vocab_size, stop, llt.eos_tokens)
    if row.done and not row.stop.size:
        raise KvforgeError(f"response_format {fmt.type} allows only empty output and no stop token may end it")
    return row


def masks(rows: Sequence[Constraint | None], vocab_size: int) -> np.ndarray | None:
    """The allowed tokens (B, V) bool of every row (all True for a row without a constraint, or one that is
    done); None when no row has one."""
    live = [(i, c) for i, c in enumerate(rows) if c is not None]
    if not live:
        return None
    words = (vocab_size + 31) // 32
    bits = np.zeros((len(rows), words), np.int32)
    if len(live) == 1:
        i, c = live[0]
        c.matcher.unsafe_compute_mask_ptr(bits[i].ctypes.data, bits[i].nbytes)  # releases the GIL
    else:
        _executor().unsafe_compute_mask_ptr([(c.matcher, i) for i, c in live], bits.ctypes.data, words * 4, len(rows))
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].view(bool)
    for i, c in enumerate(rows):
        if c is None:
            allowed[i] = True
        else:
            c.finish_mask(allowed[i])
    return allowed


_executor_lock = threading.Lock()
_executor_instance = None


def _executor():
    global _executor_instance
    with _executor_lock:
        if _executor_instance is None:
            _executor_instance = _llguidance().LLExecutor()
        return _executor_instance


def cache_sizes() -> dict[str, int]:
    """How many parsed formats, compiled matchers and engine vocabularies are cached (tests read it)."""
    return {"formats": len(_grammars), "compiled": len(_compiled), "vocabularies": len(_vocabularies)}
