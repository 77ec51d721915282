"""The OpenAI API (serving/openai_app.py) driven by the official `openai` client, on 127.0.0.1.

The server runs in this process over a Service (the same one the Triton model builds); what it answers is compared
with the runtime's own generate/chat/embed (the Torch-checked runtime is the oracle for the text; the `openai`
client checks the wire format by parsing it; jsonschema checks structured output). tests/serving/test_triton.py
drives the same front through `kvforge serve`.
"""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from kvforge import runtime
from kvforge.bundle import Bundle

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")

from kvforge.serving.kinds import Service  # noqa: E402
from kvforge.serving.openai_app import OpenAIServer  # noqa: E402

MODEL = "tiny"
# SmolLM2's shape of template (ChatML); tiny's tokenizer has none of its own
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "def add(a, b):"}]


def _serve(session, kind, name=MODEL, api_key=None, max_batch=8):
    service = Service(session, kind, runtime.BatchOptions(max_batch=max_batch))
    server = OpenAIServer(lambda: service, name, api_key=api_key).start()
    return service, server


@pytest.fixture(scope="module")
def tiny(tiny_fp32):
    with runtime.load(tiny_fp32.path) as session:
        session.tokenizer.chat_template = CHATML
        yield session


@pytest.fixture(scope="module")
def served(tiny, tiny_fp32):
    service, server = _serve(tiny, Bundle(tiny_fp32.path).kind)
    yield server
    server.stop()
    service.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=120)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_and_chat_equal_the_runtime_greedy_and_count_usage(client, tiny):
    prompt = "def fibonacci(n):"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    ref = tiny.generate(prompt, max_new_tokens=12)
    assert out.choices[0].text == ref.text
    assert out.usage.prompt_tokens == len(tiny.encode(prompt)) and out.usage.completion_tokens == len(ref.tokens)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    ref = tiny.chat(MESSAGES, max_new_tokens=10)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == ref.text
    assert chat.usage.prompt_tokens == len(tiny.chat_ids(MESSAGES)) and chat.usage.completion_tokens == len(ref.tokens)
    assert chat.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")


def test_streamed_deltas_concatenate_to_the_whole_and_usage_comes_last(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=14, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=14, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    plain = client.completions.create(model=MODEL, prompt="class Stack", max_tokens=9, temperature=0)
    streamed = client.completions.create(model=MODEL, prompt="class Stack", max_tokens=9, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text


def test_n_choices_with_a_seed_are_reproducible_and_differ(client):
    def run():
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=1.0, n=3, seed=7)
        return [c.message.content for c in sorted(out.choices, key=lambda c: c.index)]

    first = run()
    assert len(first) == 3 and run() == first
    assert len(set(first)) > 1  # each choice samples with its own seed


def test_logprobs_equal_the_runtimes_log_softmax(client, tiny):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                         top_logprobs=3)
    entries = out.choices[0].logprobs.content
    ids = tiny.chat_ids(MESSAGES)
    tokens = tiny.generate(ids, max_new_tokens=6).tokens
    assert len(entries) == len(tokens)
    for step, token in enumerate(tokens):
        logits, _ = tiny.forward(np.array([ids + tokens[:step]], np.int64))
        lp = _log_softmax(logits[0, -1])
        assert entries[step].logprob == pytest.approx(lp[token], abs=1e-4)
        top = np.argsort(-lp)[:3]
        assert [e.logprob for e in entries[step].top_logprobs] == pytest.approx(lp[top].tolist(), abs=1e-4)
        assert entries[step].top_logprobs[0].token == tiny.tokenizer.decode([int(top[0])], skip_special_tokens=False)

    done = client.completions.create(model=MODEL, prompt="x = 1", max_tokens=4, temperature=0, logprobs=2)
    assert len(done.choices[0].logprobs.token_logprobs) == 4
    assert all(len(t) <= 2 for t in done.choices[0].logprobs.top_logprobs)


# the 20 schemas of varied shape that tests/runtime/test_constrained.py runs in the runtime
SCHEMAS = json.loads((Path(__file__).parents[1] / "runtime" / "json_schemas.json").read_text())


def _structured(client, model, messages, schemas, max_tokens):
    """Each schema's reply, asked concurrently (the batcher runs them as one batch)."""
    replies: dict[int, object] = {}

    def ask(i):
        replies[i] = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": schemas[i]["name"],
                                                                    "schema": schemas[i]["schema"]}})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(schemas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return [replies[i] for i in range(len(schemas))]


def test_response_format_json_schema_always_validates_on_a_random_model(client):
    for case, out in zip(SCHEMAS, _structured(client, MODEL, MESSAGES, SCHEMAS, 200)):
        assert out.choices[0].finish_reason == "stop", (case["name"], out.choices[0].message.content)
        jsonschema.validate(json.loads(out.choices[0].message.content), case["schema"])
    free = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0)
    with pytest.raises((ValueError, jsonschema.ValidationError)):  # what the model writes unconstrained is not that
        jsonschema.validate(json.loads(free.choices[0].message.content), SCHEMAS[0]["schema"])


@pytest.mark.slow
def test_smollm2_answers_every_schema_json_mode_and_a_tool_call(smollm2_fp32_bundle):
    """The real model through the API: the 20 schemas validate, json_object parses, a required call validates."""
    with runtime.load(smollm2_fp32_bundle.path) as session:
        service, server = _serve(session, smollm2_fp32_bundle.kind, "smollm2")
        try:
            client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=600)
            ask = [{"role": "user", "content": "Reply with a JSON value for this request: a small example record."}]
            for case, out in zip(SCHEMAS, _structured(client, "smollm2", ask, SCHEMAS, 256)):
                assert out.choices[0].finish_reason == "stop", (case["name"], out.choices[0].message.content)
                jsonschema.validate(json.loads(out.choices[0].message.content), case["schema"])
            cat = [{"role": "user", "content": "Describe a cat as a JSON object with two keys."}]
            obj = client.chat.completions.create(model="smollm2", messages=cat, max_tokens=200, temperature=0,
                                                 response_format={"type": "json_object"})
            assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].message.content), dict)
            call = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
                tool_choice="required", max_tokens=128, temperature=0).choices[0].message.tool_calls[0]
            schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)
        finally:
            server.stop()
            service.close()


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer", "minimum": -100, "maximum": 100},
                                          "b": {"type": "integer", "minimum": -100, "maximum": 100}},
                                          "required": ["a", "b"], "additionalProperties": False}}},
]


def test_a_required_tool_call_parses_validates_and_its_result_renders_into_an_answer(client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = client.chat.completions.create(model=MODEL, messages=question, tools=TOOLS, tool_choice="required",
                                         max_tokens=120, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) >= 1
    call = choice.message.tool_calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)

    named = client.chat.completions.create(model=MODEL, messages=question, tools=TOOLS, max_tokens=120, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    call2 = named.choices[0].message.tool_calls[0]
    assert call2.function.name == "add"
    jsonschema.validate(json.loads(call2.function.arguments), TOOLS[1]["function"]["parameters"])

    follow = question + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    answer = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=8, temperature=0)
    assert answer.usage.prompt_tokens > out.usage.prompt_tokens and answer.usage.completion_tokens >= 1


BAD = [
    (dict(model="nope", messages=MESSAGES), 404, "model"),
    (dict(model=MODEL, messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    (dict(model=MODEL, messages=[]), 400, "messages"),
    (dict(model=MODEL, messages=MESSAGES, response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                                 "schema": {"type": 12}}}),
     400, "schema"),
    (dict(model=MODEL, messages=MESSAGES, max_tokens=10 ** 6), 400, "max_tokens"),
    (dict(model=MODEL, messages=MESSAGES, n=5), 400, "'n'"),
    (dict(model=MODEL, messages=MESSAGES, temperature="hot"), 400, "temperature"),
    (dict(model=MODEL, messages="hello"), 400, "messages"),
    (dict(model=MODEL, messages=MESSAGES, logit_bias={"1": 5}), 400, "logit_bias"),
]


@pytest.mark.parametrize("body,status,named", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_the_openai_error_shape_and_the_server_goes_on(client, body, status, named):
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**body)
    e = caught.value
    assert e.status_code == status and named in e.message, (e.status_code, e.message)
    assert isinstance(e.body, dict) and {"message", "type", "param", "code"} <= set(e.body)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_a_prompt_beyond_the_context_is_a_400_context_length_exceeded(client, tiny):
    prompt = list(range(5, 5 + tiny.max_context))
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert caught.value.code == "context_length_exceeded"


def test_sixteen_concurrent_streams_all_complete(client, tiny):
    prompts = [f"def f{i}(x):" for i in range(16)]
    texts: dict[int, str] = {}

    def one(i):
        stream = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=10, temperature=0, stream=True)
        texts[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(texts) == list(range(16))
    assert all(texts[i] == tiny.generate(prompts[i], max_new_tokens=10).text for i in (0, 7, 15))


def test_an_api_key_is_required_when_set_and_503_while_loading(tiny, tiny_fp32):
    service, server = _serve(tiny, Bundle(tiny_fp32.path).kind, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
        assert [m.id for m in openai.OpenAI(base_url=server.url, api_key="s3cret").models.list().data] == [MODEL]
    finally:
        server.stop()
        service.close()
    loading = OpenAIServer(lambda: None, MODEL).start()
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            openai.OpenAI(base_url=loading.url, api_key="x", max_retries=0).completions.create(model=MODEL, prompt="x")
        assert caught.value.status_code == 503
    finally:
        loading.stop()


def test_an_encoder_serves_embeddings_and_an_encoder_decoder_completions(micro_bundle):
    encoder = micro_bundle("bert-micro")
    with runtime.load(encoder.path) as session:
        service, server = _serve(session, encoder.kind, "bert")
        try:
            client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
            texts = ["the cat sat", "on the mat today"]
            out = client.embeddings.create(model="bert", input=texts)
            ref = session.embed(texts, normalize=True)
            got = np.array([d.embedding for d in sorted(out.data, key=lambda d: d.index)])
            np.testing.assert_allclose(got, ref, atol=1e-6)
            assert out.usage.prompt_tokens == sum(len(r) for r in session.tokenize(texts))
            raw = client.embeddings.with_raw_response.create(model="bert", input="the cat sat", encoding_format="base64")
            vector = np.frombuffer(base64.b64decode(json.loads(raw.text)["data"][0]["embedding"]), "<f4")
            np.testing.assert_allclose(vector, ref[0], atol=1e-6)
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model="bert", prompt="x")
        finally:
            server.stop()
            service.close()

    seq2seq = micro_bundle("t5-micro")
    with runtime.load(seq2seq.path) as session:
        service, server = _serve(session, seq2seq.kind, "t5")
        try:
            client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)
            ids = [5, 9, 13, 17, 21]
            out = client.completions.create(model="t5", prompt=ids, max_tokens=8, temperature=0)
            ref = session.generate(ids, max_new_tokens=8)
            assert out.choices[0].text == ref.text and out.usage.completion_tokens == len(ref.tokens)
            with pytest.raises(openai.BadRequestError):
                client.embeddings.create(model="t5", input="x")
        finally:
            server.stop()
            service.close()


# a LLaVA-style template: content parts, an image part written as the model's placeholder
VL_TEMPLATE = ("{% for message in messages %}{{ message['role'].upper() + ': ' }}{% if message['content'] is string %}"
               "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
               "{{ '<image>\n' }}{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def _data_url(seed: int, size=(37, 52)) -> str:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_a_vision_language_model_answers_image_url_parts_as_its_session(micro_bundle):
    """Chat requests with OpenAI image_url parts (data URLs) through the official client: each reply is what the
    session's own chat gives for the same messages and images, concurrent requests with their own images
    included; prompt_tokens count the image tokens. Images the server cannot or must not read are a 400."""
    bundle = micro_bundle("llava-micro")
    with runtime.load(bundle.path) as session:
        session.tokenizer.chat_template = VL_TEMPLATE
        service, server = _serve(session, bundle.kind, "llava")
        try:
            client = openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=120)

            def messages(url, question="What is in it?"):
                return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": question}]}]

            urls = [_data_url(1), _data_url(2, (64, 20))]
            expected = [session.chat(messages(u), max_new_tokens=6, ignore_eos=True) for u in urls]
            assert expected[0].text != expected[1].text or \
                session.chat(messages(urls[0]), max_new_tokens=1, logprobs=0).logprobs != \
                session.chat(messages(urls[1]), max_new_tokens=1, logprobs=0).logprobs
            ids, images = session.chat_ids(messages(urls[0]))
            assert ids.count(session.image_token_id) == session.image_tokens and images == [urls[0]]

            results = [None, None]

            def ask(i):
                results[i] = client.chat.completions.create(model="llava", messages=messages(urls[i]), max_tokens=6,
                                                            temperature=0, extra_body={"ignore_eos": True})
            threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            for got, want in zip(results, expected):
                assert got.choices[0].message.content == want.text
                assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want.tokens)
            text_only = client.chat.completions.create(model="llava", max_tokens=4, temperature=0,
                                                       messages=[{"role": "user", "content": "hello"}])
            assert text_only.choices[0].message.content == \
                session.chat([{"role": "user", "content": "hello"}], max_new_tokens=4).text

            for bad, named in ((messages("https://example.com/cat.png"), "not a data URL"),
                               (messages("data:image/png;base64,bm90IGFuIGltYWdl"), "not an image Pillow can read"),
                               ([{"role": "user", "content": [{"type": "image", "path": "/etc/hostname"}]}],
                                "send images as image_url parts"),
                               ([{"role": "user", "content": [{"type": "audio", "x": 1}]}], "the parts are text")):
                with pytest.raises(openai.BadRequestError, match=named):
                    client.chat.completions.create(model="llava", messages=bad, max_tokens=2)
            with pytest.raises(openai.BadRequestError, match="holds 9 image tokens"):
                client.completions.create(model="llava", prompt="<image> what?", max_tokens=2)
        finally:
            server.stop()
            service.close()
