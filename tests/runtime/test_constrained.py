"""Constrained decoding (response_format) and log-probabilities in the runtime.

The oracles are not kvforge: jsonschema validates every JSON output, re.fullmatch the regular expression's, Python's
own parser (ast) the grammar's; log-probabilities are numpy's log-softmax of Session.forward's logits.
The random-weight model is mistral-micro (byte-level tokenizer, the session fixture test_session and test_batcher
use too): its free output is not JSON at all, so every valid document below is the grammar's doing.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from kvforge import runtime
from kvforge.errors import KvforgeError
from kvforge.runtime.constrain import cache_sizes, constraint, masks, parse_response_format
from kvforge.tokenizer import Tokenizer

CASES = json.loads((Path(__file__).parent / "json_schemas.json").read_text())
PROMPT = "The answer, as JSON:"
REGEX = r"[A-Z][a-z]{2,6} [0-9]{1,3}(\.[0-9]{2})?"
# arithmetic with a parenthesized sum first; nesting through atom
LARK = r'''
start: "(" sum ") * " atom
sum: product (ADD product){0,2}
product: atom (" * " atom){0,2}
atom: NUMBER | "(" sum ")"
ADD: " + " | " - "
NUMBER: /[1-9][0-9]{0,2}/
'''
GBNF = r'''
root ::= "(" sum ") * " atom
sum ::= product (add product)? (add product)?
product ::= atom (" * " atom)? (" * " atom)?
atom ::= number | "(" sum ")"
add ::= " + " | " - "
number ::= [1-9] [0-9]? [0-9]?
'''


def schema_format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def validate(text: str, schema: dict):
    value = json.loads(text)
    jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator)
    return value


@pytest.fixture(scope="module")
def micro(micro_bundle):
    with runtime.load(micro_bundle("mistral-micro").path) as session:
        yield session


def test_the_schemas_are_valid_and_their_examples_follow_them():
    assert len(CASES) == 20 and len({c["name"] for c in CASES}) == 20
    for case in CASES:
        jsonschema.Draft202012Validator.check_schema(case["schema"])
        jsonschema.validate(case["example"], case["schema"], cls=jsonschema.Draft202012Validator)


def test_the_random_models_free_output_is_not_json(micro):
    free = micro.generate(PROMPT, max_new_tokens=60)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_every_schema_validates_on_a_random_model(micro, case):
    result = micro.generate(PROMPT, max_new_tokens=400, response_format=schema_format(case["schema"], case["name"]))
    assert result.finish_reason == "stop"
    validate(result.text, case["schema"])
    assert micro.tokenizer.eos_token_id not in result.tokens  # it ended with the grammar, not a stop token


def test_a_batch_of_constrained_rows_equals_each_row_alone(micro):
    schema = next(c["schema"] for c in CASES if c["name"] == "optional_fields")
    prompts = ["a", "The list: ", "zz top", "List of items in stock, as JSON please:"]
    batch = micro.generate(prompts, max_new_tokens=300, response_format=schema_format(schema))
    alone = [micro.generate(p, max_new_tokens=300, response_format=schema_format(schema)) for p in prompts]
    assert [b.tokens for b in batch] == [a.tokens for a in alone]
    assert len({len(b.tokens) for b in batch}) > 1  # the rows differ (and end at different steps): own matchers
    for b in batch:
        validate(b.text, schema)


def test_the_batcher_mixes_constrained_and_free_rows(micro):
    """Greedy rows with and without formats in one continuous batch each equal their runs alone; the free ones
    equal generation without any format in the batch."""
    by_name = {c["name"]: c["schema"] for c in CASES}
    jobs = [("one", dict(response_format=schema_format(by_name["nested"]))),
            ("two", dict(max_new_tokens=30, ignore_eos=True)),
            ("three", dict(response_format={"type": "regex", "regex": REGEX})),
            ("four", dict(max_new_tokens=12, ignore_eos=True)),
            ("five", dict(response_format=schema_format(by_name["tool_call_any_of"]))),
            ("six", dict(response_format={"type": "grammar", "grammar": LARK}, logprobs=2))]
    jobs = [(p, {"max_new_tokens": 300, **o}) for p, o in jobs]
    alone = [micro.generate(p, **o) for p, o in jobs]
    with runtime.Batcher(micro, max_batch=4) as batcher:  # fewer slots than jobs: some join as others leave
        requests = [batcher.submit(p, **o) for p, o in jobs]
        results = [r.result(timeout=120) for r in requests]
        events = list(requests[5])
    assert batcher.peak_batch > 1
    for got, want in zip(results, alone):
        assert got.tokens == want.tokens and got.finish_reason == want.finish_reason and got.text == want.text
    validate(results[0].text, by_name["nested"])
    validate(results[4].text, by_name["tool_call_any_of"])
    assert re.fullmatch(REGEX, results[2].text)
    free = [micro.generate(p, **o) for p, o in (jobs[1], jobs[3])]
    assert [results[1].tokens, results[3].tokens] == [f.tokens for f in free]
    # the batcher's log-probabilities and events
    np.testing.assert_allclose(results[5].logprobs, alone[5].logprobs, atol=1e-5)
    assert [e.token for e in events] == results[5].tokens
    assert [e.logprob for e in events] == results[5].logprobs
    assert [e.top_logprobs for e in events] == results[5].top_logprobs
    assert results[0].logprobs is None and results[0].top_logprobs is None


def test_a_cancelled_constrained_request_ends_and_the_rest_go_on(micro):
    schema = next(c["schema"] for c in CASES if c["name"] == "array_of_objects")
    with runtime.Batcher(micro, max_batch=2) as batcher:
        doomed = batcher.submit("a", max_new_tokens=300, response_format=schema_format(schema))
        doomed.cancel()
        kept = batcher.submit("a", max_new_tokens=300, response_format=schema_format(schema))
        assert doomed.result(timeout=60).finish_reason == "cancelled"
        validate(kept.result(timeout=60).text, schema)


def test_a_regular_expression_is_matched_whole(micro):
    for prompt in ("hello", "x = ", "Price:"):
        result = micro.generate(prompt, max_new_tokens=100, response_format={"type": "regex", "regex": REGEX})
        assert result.finish_reason == "stop" and re.fullmatch(REGEX, result.text), result.text


def _arithmetic(text: str) -> ast.AST:
    """Python's parser as the grammar's oracle: an expression of integers, +, - and * only."""
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    assert all(isinstance(n, allowed) for n in ast.walk(tree)), ast.dump(tree)
    assert all(isinstance(n.value, int) for n in ast.walk(tree) if isinstance(n, ast.Constant))
    return tree


def test_a_lark_grammar_and_the_same_grammar_in_gbnf(micro):
    nested = 0
    for prompt in ("((", "hello", "zzzz"):
        lark = micro.generate(prompt, max_new_tokens=200, response_format={"type": "grammar", "grammar": LARK})
        gbnf = micro.generate(prompt, max_new_tokens=200, response_format={"type": "grammar", "grammar": GBNF})
        assert lark.finish_reason == "stop" and lark.text.startswith("(")
        assert re.fullmatch(r"[0-9()+\-* ]+", lark.text)
        tree = _arithmetic(lark.text)
        assert isinstance(tree.body, ast.BinOp) and isinstance(tree.body.op, ast.Mult)
        nested += lark.text.startswith("((") or " (" in lark.text
        assert gbnf.tokens == lark.tokens  # the same language, so the same greedy choice at every step
    assert nested  # the grammar's recursion was taken at least once


def test_structural_text_then_json_then_text(micro):
    tool = next(c["schema"] for c in CASES if c["name"] == "tool_call_any_of")
    fmt = {"type": "structural", "begin": "<tool_call>\n", "schema": tool, "end": "\n</tool_call>"}
    result = micro.generate(PROMPT, max_new_tokens=300, response_format=fmt)
    assert result.finish_reason == "stop"
    m = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", result.text, re.S)
    assert m, result.text
    validate(m.group(1), tool)


def test_stream_follows_the_format_as_generate_does(micro):
    schema = next(c["schema"] for c in CASES if c["name"] == "deep_nesting")
    whole = micro.generate(PROMPT, max_new_tokens=200, response_format=schema_format(schema), logprobs=1)
    events = list(micro.stream(PROMPT, max_new_tokens=200, response_format=schema_format(schema), logprobs=1))
    assert [e.token for e in events] == whole.tokens
    assert "".join(e.text for e in events) == whole.text
    assert events[-1].last and events[-1].finish_reason == "stop"
    assert [e.logprob for e in events] == whole.logprobs and [e.top_logprobs for e in events] == whole.top_logprobs


def test_sampling_with_a_format_stays_inside_it(micro):
    schema = next(c["schema"] for c in CASES if c["name"] == "enums")
    seen = set()
    for seed in range(6):
        result = micro.generate(PROMPT, max_new_tokens=100, response_format=schema_format(schema), temperature=1.5,
                                top_k=40, top_p=0.95, repetition_penalty=1.3, seed=seed)
        value = validate(result.text, schema)
        seen.add((value["color"], value["size"]))
    assert len(seen) > 1  # sampled, not greedy


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def _forward_logprobs(session, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """numpy log-softmax of Session.forward's logits before each generated token."""
    logits, cache = session.forward(np.array([prompt], np.int64))
    out = [_log_softmax(logits[0, -1])]
    for t in tokens[:-1]:
        logits, cache = session.forward(np.array([[t]], np.int64), cache=cache)
        out.append(_log_softmax(logits[0, -1]))
    return out


@pytest.mark.parametrize("fmt", [None, "schema"])
def test_logprobs_are_the_raw_log_softmax_of_the_models_logits(micro, fmt):
    """Before the mask: a constrained token's log-probability is the model's, not renormalized over the allowed."""
    schema = next(c["schema"] for c in CASES if c["name"] == "flat")
    options = {"response_format": schema_format(schema)} if fmt else {"ignore_eos": True}
    prompt = micro.encode(PROMPT)
    result = micro.generate(prompt, max_new_tokens=40, logprobs=5, **options)
    expected = _forward_logprobs(micro, prompt, result.tokens)
    assert len(result.logprobs) == len(result.top_logprobs) == len(result.tokens)
    for token, lp, top, ref in zip(result.tokens, result.logprobs, result.top_logprobs, expected):
        assert abs(lp - ref[token]) < 1e-4
        order = np.argsort(-ref, kind="stable")[:5]
        assert [i for i, _ in top] == order.tolist()
        np.testing.assert_allclose([v for _, v in top], ref[order], atol=1e-4)
    if fmt:  # the grammar forced tokens the model did not favour: their raw log-probability is far below 0
        assert min(result.logprobs) < -1.0
    else:  # greedy without a mask takes the most likely token
        assert all(top[0][0] == t for t, top in zip(result.tokens, result.top_logprobs))
    zero = micro.generate(prompt, max_new_tokens=3, logprobs=0, ignore_eos=True)
    assert zero.top_logprobs == [[], [], []] and len(zero.logprobs) == 3
    assert micro.generate(prompt, max_new_tokens=3).logprobs is None


@pytest.mark.parametrize("fmt, message", [
    ({"type": "yaml"}, "type 'yaml' is unknown"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}, "not a valid JSON Schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": -1}}},
     "not a valid JSON Schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, r"json_schema\['schema'\]"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "strict": "yes"}},
     r"json_schema\['strict'\] must be true or false"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "format": "bogus"}}}, "Unknown format: bogus"),
    ({"type": "regex", "regex": "(ab"}, "(?s)regex does not compile.*unclosed group"),
    ({"type": "regex"}, "needs 'regex'"),
    ({"type": "grammar", "grammar": "start: missing"}, "(?s)grammar does not compile.*unknown name"),
    ({"type": "structural", "begin": "<a>", "schema": {"type": "nope"}, "end": "</a>"}, "not a valid JSON Schema"),
    ("json", "must be a dict"),
])
def test_a_bad_format_is_refused_before_any_forward_pass(micro, fmt, message):
    calls = []
    forward = micro.forward
    micro.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    try:
        with pytest.raises(KvforgeError, match=message):
            micro.generate(PROMPT, max_new_tokens=4, response_format=fmt)
        with pytest.raises(KvforgeError, match=message):
            runtime.GenerationConfig(response_format=fmt)
        with runtime.Batcher(micro) as batcher, pytest.raises(KvforgeError, match=message):
            batcher.submit(PROMPT, max_new_tokens=4, response_format=fmt)
    finally:
        del micro.forward
    assert calls == []


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "5"])
def test_logprobs_takes_0_to_20(bad):
    with pytest.raises(KvforgeError, match="logprobs must be None or an int in 0..20"):
        runtime.GenerationConfig(logprobs=bad)


def test_text_format_is_no_constraint(micro):
    free = micro.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
    text = micro.generate(PROMPT, max_new_tokens=20, ignore_eos=True, response_format={"type": "text"})
    assert text.tokens == free.tokens


def test_masks_never_allow_specials_or_padding_rows_and_eos_only_when_complete():
    """The byte-level tokenizer (<s> 256, </s> 257, <pad> 258) under a model vocabulary padded to 300 rows."""
    tok = Tokenizer.byte_level()
    row = constraint(parse_response_format({"type": "regex", "regex": "[ab]{1,3}"}), tok, 300, {257})
    for step, byte in enumerate(b"aba"):
        allowed = masks([row, None], 300)
        assert allowed.shape == (2, 300) and allowed[1].all()  # a row without a format allows everything
        want = {ord("a"), ord("b")} | ({257} if step > 0 else set())  # EOS once "a" (a match) is there
        assert set(np.flatnonzero(allowed[0]).tolist()) == want
        assert row.advance(byte) == (step == 2)  # "aba" is complete: nothing may follow
    assert row.done
    assert masks([None, None], 300) is None


def _admits(fmt: dict, text: str) -> bool:
    """Whether the format's grammar lets a row write `text` and stop (byte-level tokenizer: one token a byte)."""
    row = constraint(parse_response_format(fmt), Tokenizer.byte_level(), 300, {257})
    for byte in text.encode():
        if not masks([row], 300)[0][byte]:
            return False
        row.advance(byte)
    return row.done or bool(masks([row], 300)[0][257])


STRICT_CASES = [  # (schema, the same schema as OpenAI's strict mode requires it written, documents)
    ({"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                                       "score": {"type": "number"}}},
     {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                                       "score": {"type": "number"}}, "additionalProperties": False},
     [{"name": "a", "tags": ["x"], "score": 1}, {"name": "a", "tags": [], "score": 2, "scorevector": [1]},
      {"name": "a"}, {"name": "a", "x": None}]),
    ({"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}, "q": {"type": "array", "prefixItems": [
        {"type": "integer"}]}}, "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
     {"type": "object", "properties": {"p": {"$ref": "#/$defs/point"}, "q": {"type": "array", "prefixItems": [
         {"type": "integer"}], "items": False}}, "$defs": {"point": {"type": "object", "properties": {
             "x": {"type": "integer"}}, "additionalProperties": False}}, "additionalProperties": False},
     [{"p": {"x": 1}}, {"p": {"x": 1, "y": 2}}, {"q": [1]}, {"q": [1, 2]}, {"p": {"x": 1}, "r": 0}]),
    ({"type": "object", "properties": {"k": {"type": "string"}}, "additionalProperties": {"type": "integer"}},
     {"type": "object", "properties": {"k": {"type": "string"}}, "additionalProperties": {"type": "integer"}},
     [{"k": "a"}, {"k": "a", "n": 1}, {"k": "a", "n": "b"}]),
]


@pytest.mark.parametrize("schema, openai_strict, documents", STRICT_CASES)
def test_strict_schemas_admit_no_property_they_do_not_declare(schema, openai_strict, documents):
    """"strict": true reads a schema as OpenAI's strict mode does (no property or prefixItems item beyond those
    declared; a schema's own additionalProperties kept); without it, as JSON Schema does. The oracle is jsonschema
    on the schema as OpenAI requires a strict one written, and on the schema as given."""
    for strict in (True, False):
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": strict}}
        oracle = jsonschema.Draft202012Validator(openai_strict if strict else schema)
        assert [_admits(fmt, json.dumps(d)) for d in documents] == [oracle.is_valid(d) for d in documents]
    strict = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    loose = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    assert [_admits(loose, json.dumps(d)) for d in documents] == [
        jsonschema.Draft202012Validator(schema).is_valid(d) for d in documents]
    assert sum(_admits(strict, json.dumps(d)) for d in documents) < len(documents)


def test_the_engine_reads_a_sentencepiece_tokenizer(tmp_path):
    """SentencePiece with byte fallback (Llama 2's family, from a GGUF file): what the masks allow agrees with the
    pieces' own text (▁ a space, <0xXX> a byte), read here from the vocabulary: following a valid document by the
    longest allowed piece that it continues with reaches its end, and the control tokens are never allowed."""
    from kvforge.model_defs.gguf import gguf_tokenizer, read_gguf_tokenizer

    from ..model_defs.test_gguf_tokenizers import sentencepiece_vocab, write_tokenizer_gguf

    tokens, types, scores = sentencepiece_vocab()
    tok = gguf_tokenizer(read_gguf_tokenizer(write_tokenizer_gguf(tmp_path / "spm.gguf", "llama", "llama", tokens, types,
                                                                  scores=scores)))
    text = {i: bytes([int(t[3:5], 16)]) if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else t.replace("\u2581", " ").encode()
            for i, t in enumerate(tokens) if t not in ("<unk>", "<s>", "</s>", "<|end|>")}
    case = next(c for c in CASES if c["name"] == "nested")
    row = constraint(parse_response_format(schema_format(case["schema"])), tok, tok.vocab_size, {2})
    doc = {"person": {**case["example"]["person"], "name": "Zoë 日本"}}  # characters outside the vocabulary: bytes
    validate(json.dumps(doc), case["schema"])
    rest = json.dumps(doc, separators=(", ", ": "), ensure_ascii=False).encode()
    steps = 0
    while rest:
        allowed = masks([row], tok.vocab_size)[0]
        assert not allowed[[0, 1, 2, tokens.index("<|end|>")]].any()
        fits = [i for i in np.flatnonzero(allowed) if i in text and rest.startswith(text[i])]
        assert fits, rest
        best = max(fits, key=lambda i: len(text[i]))
        rest = rest[len(text[best]):]
        done = row.advance(best)
        steps += 1
    assert done and steps > 10


def test_compiled_formats_are_cached_and_bounded(micro):
    fmt = {"type": "regex", "regex": "[0-9]{4}"}
    micro.generate(PROMPT, max_new_tokens=5, response_format=fmt)
    before = cache_sizes()
    micro.generate(PROMPT, max_new_tokens=5, response_format=dict(fmt))
    assert cache_sizes() == before  # same tokenizer, same format: compiled once
    for i in range(80):
        parse = parse_response_format({"type": "regex", "regex": f"x{{{i + 1}}}"})
        constraint(parse, micro.tokenizer, micro.vocab_size, {257})
    sizes = cache_sizes()
    assert sizes["compiled"] <= 64 and sizes["formats"] <= 256


@pytest.mark.slow
def test_seq2seq_follows_a_schema(micro_bundle):
    """An encoder-decoder through the same selection: schemas without free-running numbers (a random model may
    write digits after a decimal point forever)."""
    by_name = {c["name"]: c["schema"] for c in CASES}
    with runtime.load(micro_bundle("t5-micro").path) as session:
        for name in ("enums", "boolean_null", "string_pattern"):
            result = session.generate("translate: hello", max_new_tokens=300, response_format=schema_format(by_name[name]),
                                      logprobs=1)
            assert result.finish_reason == "stop"
            validate(result.text, by_name[name])
            assert len(result.logprobs) == len(result.tokens)
        events = list(session.stream("translate: hello", max_new_tokens=100, response_format={"type": "regex", "regex": REGEX}))
        assert re.fullmatch(REGEX, "".join(e.text for e in events)) and events[-1].finish_reason == "stop"


SMOLLM2_CASES = ["nested", "enums", "optional_fields", "tool_call_any_of", "defs_ref"]


@pytest.mark.slow
def test_smollm2_follows_schemas_and_json_mode(smollm2_fp32_bundle):
    by_name = {c["name"]: c["schema"] for c in CASES}
    with runtime.load(smollm2_fp32_bundle.path) as session:
        for name in SMOLLM2_CASES:
            ids = session.chat_ids([{"role": "user", "content": f"Give me an example {name.replace('_', ' ')} record as JSON."}])
            result = session.generate(ids, max_new_tokens=120, response_format=schema_format(by_name[name], name))
            assert result.finish_reason == "stop", result.text
            validate(result.text, by_name[name])
        ids = session.chat_ids([{"role": "user", "content": "Describe a cat as a JSON object."}])
        result = session.generate(ids, max_new_tokens=120, response_format={"type": "json_object"})
        assert result.finish_reason == "stop" and isinstance(json.loads(result.text), dict)
