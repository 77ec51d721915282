"""OpenAI tool calling through a checkpoint's own chat template (kvforge/serving/tools.py), without a model or server.

Oracles: transformers' apply_chat_template over the same tokenizer and template (templates written here in the
style of Qwen2.5's, Llama 3.1's and Mistral 7B v0.3's; SmolLM2's own, read from its GGUF file), Qwen2.5's template
for what a template without tools support must be shown, and jsonschema for arguments and constraint schemas.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.errors import KvforgeError
from kvforge.model_defs.checkpoint import TINY_DIR, packaged_file
from kvforge.model_defs.gguf import gguf_tokenizer, read_gguf_tokenizer
from kvforge.serving import tools as T
from kvforge.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA31 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

MISTRAL03 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# Gemma's shape: no system role (a template that takes no tools and refuses the system message they would go in)
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city, in °C or °F",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
BOOK = {"type": "function", "function": {  # a pydantic-style schema: its parts in $defs, reached through $ref
    "name": "book",
    "parameters": {"type": "object", "$defs": {"Slot": {
        "type": "object", "properties": {"day": {"enum": ["mon", "tue"]}, "hour": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 23}},
        "required": ["day", "hour"]}}, "properties": {"slot": {"$ref": "#/$defs/Slot"}}, "required": ["slot"]}}}
TOOLS = [WEATHER, ADD]
QUESTION = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"},
                                         {"type": "text", "text": "And 2+3?"}]}]
QUESTION_PLAIN = [QUESTION[0], {"role": "user", "content": "Weather in Paris?\nAnd 2+3?"}]


def model_reply(fmt: str, calls: list[tuple[str, dict]], before: str = "") -> str:
    """Text a model of each family writes for these calls."""
    if fmt == "hermes":
        return before + "".join(f'\n<tool_call>\n{{"name": "{n}", "arguments": {json.dumps(a)}}}\n</tool_call>'
                                for n, a in calls)
    if fmt == "llama3_json":
        return before + "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return before + "[TOOL_CALLS][" + ", ".join(json.dumps({"name": n, "arguments": a}) for n, a in calls) + "]"


def arguments_valid(call: dict, tools: list[dict]) -> bool:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call["function"]["name"])
    return jsonschema.Draft202012Validator(schema).is_valid(json.loads(call["function"]["arguments"]))


def follow_up(calls: list[dict], results: list[str]) -> tuple[list[dict], list[dict]]:
    """The conversation after the model's calls and the tools' results: as an OpenAI client sends it, and as
    transformers' documentation writes it (arguments as dicts, the same ids)."""
    openai = QUESTION + [{"role": "assistant", "content": None, "tool_calls": calls}] + [
        {"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, results)]
    hf = QUESTION_PLAIN + [{"role": "assistant", "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                         "arguments": json.loads(c["function"]["arguments"])}}
        for c in calls]}] + [{"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in zip(calls, results)]
    return openai, hf


@pytest.fixture(scope="module")
def tiny():
    return Tokenizer.from_file(TINY_DIR / "tokenizer.json")


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's tokenizer and its own (ChatML, no tools) template, from the GGUF file."""
    record = read_gguf_tokenizer(packaged_file("smollm2"))
    return gguf_tokenizer(record), record["chat_template"]


def with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tokenizer.backend, *tokenizer.special_tokens.values(), chat_template=template)


def oracle(tokenizer: Tokenizer, messages, tools=None) -> tuple[str, list[int]]:
    """transformers' apply_chat_template over the same tokenizer.json and template: text and ids."""
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend, chat_template=tokenizer.chat_template,
        **{f"{role}_token": tok for role, tok in tokenizer.special_tokens.items() if tok is not None})
    text = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
    return text, list(ids)


@pytest.fixture(scope="module")
def templated(tiny, smollm2):
    """format name -> a tokenizer whose template is in that family's style."""
    return {"hermes": with_template(smollm2[0], QWEN25), "llama3_json": with_template(tiny, LLAMA31),
            "mistral": with_template(tiny, MISTRAL03)}


def test_the_format_comes_from_the_templates_markers_or_the_caller(templated, smollm2):
    assert {name: T.tool_format(tok).name for name, tok in templated.items()} == {
        "hermes": "hermes", "llama3_json": "llama3_json", "mistral": "mistral"}
    assert T.tool_format(smollm2[1]).name == "hermes" and not T.takes_tools(smollm2[1])  # no tools: the default
    assert all(T.takes_tools(tok) for tok in templated.values())
    assert T.tool_format(templated["hermes"], "llama3_json").name == "llama3_json"  # vLLM's --tool-call-parser
    assert T.tool_format(MISTRAL03).begin == "[TOOL_CALLS] ["  # as Mistral 7B v0.3's template writes its calls
    assert T.tool_format(None, "mistral").begin == "[TOOL_CALLS]["
    with pytest.raises(KvforgeError, match="unknown tool-call format 'pythonic'.*hermes, llama3_json, mistral"):
        T.tool_format(templated["hermes"], "pythonic")

    @T.register_format
    class Bracketed(T.Hermes):  # a format is a registered component: a new one is detected by its markers
        name = "bracketed_test"
        markers = ("<|my_call|>",)

    try:
        assert T.tool_format("{{ '<|my_call|>' }}{{ tools }}").name == "bracketed_test"
        assert T.tool_format(QWEN25).name == "hermes"
    finally:
        del T.FORMATS["bracketed_test"]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_a_template_that_takes_tools_renders_as_transformers_renders_it(templated, fmt):
    """The first turn with two tools, and the follow-up with the assistant's calls and the tools' results: kvforge's
    ids are transformers' for the same template, with OpenAI's shapes on kvforge's side (content parts, arguments
    as JSON strings, null content) and transformers' documented ones on its side."""
    tok = templated[fmt]
    text, ids = oracle(tok, QUESTION_PLAIN, TOOLS)
    assert T.render_chat(tok, QUESTION, tools=TOOLS) == ids
    assert "get_weather" in text and "Weather in Paris?" in text

    reply = model_reply(fmt, [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})])
    content, calls = T.parse_tool_calls(reply, T.tool_format(tok), TOOLS)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert all(arguments_valid(c, TOOLS) for c in calls)
    if fmt == "llama3_json":  # Llama 3.1's template takes one call per assistant message
        with pytest.raises(KvforgeError, match="only supports single tool-calls"):
            T.render_chat(tok, follow_up(calls, ["18", "5"])[0], tools=TOOLS)
        calls = calls[:1]
    openai, hf = follow_up(calls, ['{"temperature": 18, "sky": "sunny"}', "5"][:len(calls)])
    text, ids = oracle(tok, hf, TOOLS)
    assert T.render_chat(tok, openai, tools=TOOLS) == ids
    assert "sunny" in text and '"city": "Paris"' in text  # (Llama's template writes the result as a JSON string)
    if fmt == "hermes":  # the template shows the calls as the model wrote them
        assert reply.strip() in text


def test_tool_choice_none_offers_no_tools(templated):
    tok = templated["hermes"]
    without = T.render_chat(tok, QUESTION, tools=TOOLS, tool_choice="none")
    assert without == oracle(tok, QUESTION_PLAIN)[1] != T.render_chat(tok, QUESTION, tools=TOOLS)
    assert T.tool_constraint(TOOLS, "none", "hermes") is None and T.tool_constraint(TOOLS, "auto", "hermes") is None


def test_a_template_without_tools_is_shown_what_qwen25s_template_shows(smollm2):
    """SmolLM2's ChatML template reads no `tools`: the tools go in the system message, the calls and results in
    turns it can show, and the prompt is then token for token what Qwen2.5's template (the Hermes style, ChatML
    too) renders for the same conversation with transformers."""
    plain = with_template(smollm2[0], smollm2[1])
    qwen = with_template(smollm2[0], QWEN25)
    assert T.render_chat(plain, QUESTION, tools=TOOLS) == oracle(qwen, QUESTION_PLAIN, TOOLS)[1]
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]
    openai, hf = follow_up(calls, ["18 °C, sunny", "5"])
    text, ids = oracle(qwen, hf, TOOLS)
    assert T.render_chat(plain, openai, tools=TOOLS) == ids
    assert "<tool_response>\n18 °C, sunny\n</tool_response>" in text
    said = openai[:3] + [{"role": "assistant", "content": "Let me look.", "tool_calls": calls[:1]}, openai[3]]
    hf_said = hf[:3] + [{**hf[2], "content": "Let me look.", "tool_calls": hf[2]["tool_calls"][:1]}, hf[3]]
    del said[2], hf_said[2]
    assert T.render_chat(plain, said, tools=TOOLS) == oracle(qwen, hf_said, TOOLS)[1]
    # no system message: one is added, holding the tools; tool_choice none: the template's own prompt
    text = plain.decode(T.render_chat(plain, QUESTION[1:], tools=TOOLS), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert text.endswith("And 2+3?<|im_end|>\n<|im_start|>assistant\n")
    assert T.render_chat(plain, QUESTION[1:], tools=TOOLS, tool_choice="none") == oracle(plain, QUESTION_PLAIN[1:])[1]


def test_a_template_without_a_system_role_gets_the_tools_in_the_first_user_turn(tiny):
    tok = with_template(tiny, GEMMA)
    text = tok.decode(T.render_chat(tok, QUESTION[1:], tools=TOOLS), skip_special_tokens=False)
    assert text.startswith("<s><start_of_turn>user\n# Tools\n") and "<tools>" in text and "Weather in Paris?" in text


def test_mistral_ids_are_nine_alphanumerics_in_the_template(templated):
    """A client's own ids (OpenAI's call_...) reach Mistral's template as 9 alphanumerics, the same on the call
    and on the result that answers it; the ids kvforge gives are already such."""
    tok = templated["mistral"]
    calls = [{"id": "call_Zx81kPqm2L0aB9cD3eF4gH5i", "type": "function",
              "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]
    text = tok.decode(T.render_chat(tok, follow_up(calls, ["5"])[0], tools=TOOLS), skip_special_tokens=False)
    (call_id,) = re.findall(r'"id": "(\w+)"', text)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call_id) and f'"call_id": "{call_id}"' in text and "call_Zx" not in text
    _, parsed = T.parse_tool_calls(model_reply("mistral", [("add", {"a": 1, "b": 1})]), "mistral", TOOLS)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", parsed[0]["id"])


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_two_calls_parse_into_openais_tool_calls(fmt):
    calls = [("get_weather", {"city": "Zürich", "unit": "celsius"}), ("add", {"a": -4, "b": 30})]
    content, parsed = T.parse_tool_calls(model_reply(fmt, calls, "Checking both.\n"), fmt, TOOLS)
    assert content == "Checking both."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == calls
    assert all(c["type"] == "function" and isinstance(c["function"]["arguments"], str) for c in parsed)
    assert all(arguments_valid(c, TOOLS) for c in parsed) and len({c["id"] for c in parsed}) == 2
    id_shape = r"[A-Za-z0-9]{9}" if fmt == "mistral" else r"call_[A-Za-z0-9]{24}"
    assert all(re.fullmatch(id_shape, c["id"]) for c in parsed)


MALFORMED = {
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
               '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
               '<tool_call>\n{"name": "add", "arguments": [2, 3]}\n</tool_call>',
               '<tool_call>\n"add"\n</tool_call>', "Paris is sunny today."],
    "llama3_json": ['{"name": "get_weather", "parameters": {"city": "Paris"', '{"name": "rm_rf", "parameters": {}}',
                    'A JSON object: {"x": 1}.', "<|python_tag|>get_weather.call(city='Paris')"],
    "mistral": ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}',
                '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]', '[1, 2, 3]', "[TOOL_CALLS] nothing"],
}


@pytest.mark.parametrize("fmt, text", [(f, t) for f, texts in MALFORMED.items() for t in texts])
def test_a_malformed_call_stays_content(fmt, text):
    assert T.parse_tool_calls(text, fmt, TOOLS) == (text, [])


def test_a_bad_call_beside_a_good_one_stays_content_and_empty_text_is_none():
    bad = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    good = model_reply("hermes", [("add", {"a": 1, "b": 2})])
    content, calls = T.parse_tool_calls(good + "\n" + bad, "hermes", TOOLS)
    assert content == bad and [c["function"]["name"] for c in calls] == ["add"]
    assert T.parse_tool_calls("", "hermes", TOOLS) == (None, [])
    assert T.parse_tool_calls("hello", "hermes", None) == ("hello", [])
    # a reply that stopped before the closing tag, and a mistral reply whose special marker was decoded away
    assert T.parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "hermes", TOOLS)[1]
    assert T.parse_tool_calls('[{"name": "add", "arguments": {"a": 1, "b": 2}}]', "mistral", TOOLS)[1]


def instances(key: str) -> list[tuple[dict, bool]]:
    """(a call object, whether it is a valid call of one of TOOLS + [BOOK]) with arguments under `key`."""
    return [({"name": "get_weather", key: {"city": "Paris"}}, True),
            ({"name": "get_weather", key: {"city": "Oslo", "unit": "celsius"}}, True),
            ({"name": "add", key: {"a": 1, "b": -2}}, True),
            ({"name": "book", key: {"slot": {"day": "mon", "hour": 9}}}, True),
            ({"name": "get_weather"}, False),
            ({"name": "get_weather", key: {}}, False),
            ({"name": "get_weather", key: {"city": "Paris", "unit": "kelvin"}}, False),
            ({"name": "get_weather", key: {"city": "Paris", "when": "now"}}, False),
            ({"name": "add", key: {"a": 1}}, False),
            ({"name": "add", key: {"a": "1", "b": 2}}, False),
            ({"name": "add", key: {"city": "Paris"}}, False),
            ({"name": "nope", key: {}}, False),
            ({"name": "add", key: {"a": 1, "b": 2}, "why": "because"}, False),
            ({"name": "add", "arguments" if key == "parameters" else "parameters": {"a": 1, "b": 2}}, False),
            ({"name": "book", key: {"slot": {"day": "sun", "hour": 9}}}, False),
            ({"name": "book", key: {"slot": {"day": "mon", "hour": 24}}}, False),
            ({"name": "book", key: {"slot": "monday"}}, False),
            ([{"name": "add", key: {"a": 1, "b": 2}}], False)]


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_a_forced_calls_schema_accepts_exactly_the_valid_calls(fmt):
    tools = TOOLS + [BOOK]
    forced = T.tool_constraint(tools, "required", fmt)
    f = T.as_format(fmt)
    assert (forced["type"], forced["begin"], forced["end"]) == ("structural", f.begin, f.end)
    jsonschema.Draft202012Validator.check_schema(forced["schema"])
    validator = jsonschema.Draft202012Validator(forced["schema"])
    cases = instances(f.arguments_key)
    assert [validator.is_valid(x) for x, _ in cases] == [ok for _, ok in cases]
    named = jsonschema.Draft202012Validator(
        T.tool_constraint(tools, {"type": "function", "function": {"name": "book"}}, fmt)["schema"])
    assert [named.is_valid(x) for x, _ in cases] == [ok and x["name"] == "book" for x, ok in cases]
    # what the constraint lets a model write parses back into exactly that call
    for call, ok in cases:
        if ok:
            _, parsed = T.parse_tool_calls(forced["begin"] + json.dumps(call) + forced["end"], f, tools)
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == [
                (call["name"], call[f.arguments_key])]


def test_the_hermes_constraint_is_the_documented_shape():
    forced = T.tool_constraint([ADD], "required", "hermes")
    assert forced == {"type": "structural", "begin": "<tool_call>\n", "end": "\n</tool_call>", "schema": {
        "type": "object", "properties": {"name": {"const": "add"}, "arguments": ADD["function"]["parameters"]},
        "required": ["name", "arguments"], "additionalProperties": False}}
    assert set(T.tool_constraint(TOOLS, "required", "hermes")["schema"]) == {"anyOf"}


def test_a_strict_tools_forced_call_takes_no_argument_it_does_not_declare():
    """OpenAI's strict function calling: with "strict": true no argument (nor nested field) beyond those declared
    is allowed, however the parameters schema is written; without it, JSON Schema's reading (extra allowed).
    The oracle is jsonschema on what OpenAI's strict mode requires the schema to say, written out here."""
    loose = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "object", "properties": {"k": {"type": "string"}}}}}, "required": ["name"]}
    tight = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "object", "properties": {"k": {"type": "string"}}, "additionalProperties": False}}},
        "required": ["name"], "additionalProperties": False}
    calls = [{"name": "x"}, {"name": "x", "tags": [{"k": "a"}]}, {"name": "x", "score": 1},
             {"name": "x", "tags": [{"k": "a", "v": 2}]}, {"tags": []}]
    for strict in (True, False, None):
        fn = {"name": "tag", "parameters": loose, **({} if strict is None else {"strict": strict})}
        schema = T.tool_constraint([{"type": "function", "function": fn}], "required", "hermes")["schema"]
        got = [jsonschema.Draft202012Validator(schema).is_valid({"name": "tag", "arguments": c}) for c in calls]
        want = [jsonschema.Draft202012Validator(tight if strict else loose).is_valid(c) for c in calls]
        assert got == want and got.count(True) == (2 if strict else 4)


MARKERS = st.sampled_from(["</tool_call>", "<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "}", "]", ";", '"', "\n"])


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(["hermes", "llama3_json", "mistral"]),
       city=st.lists(st.text(max_size=6) | MARKERS, max_size=5).map("".join),
       unit=st.sampled_from([None, "celsius", "fahrenheit"]), ascii_only=st.booleans())
def test_whatever_a_forced_call_says_it_parses(fmt, city, unit, ascii_only):
    """Argument strings holding the formats' own markers: a constrained reply still parses into its one call."""
    args = {"city": city} if unit is None else {"city": city, "unit": unit}
    forced = T.tool_constraint(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, fmt)
    key = T.as_format(fmt).arguments_key
    call = {"name": "get_weather", key: args}
    assert jsonschema.Draft202012Validator(forced["schema"]).is_valid(call)
    content, parsed = T.parse_tool_calls(forced["begin"] + json.dumps(call, ensure_ascii=ascii_only) + forced["end"],
                                         fmt, TOOLS)
    assert content is None and len(parsed) == 1 and json.loads(parsed[0]["function"]["arguments"]) == args


TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}


@pytest.mark.parametrize("request_, problem", [
    (dict(messages=[]), "messages must be a non-empty list"),
    (dict(messages={"role": "user", "content": "hi"}), "messages must be a non-empty list"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), r"messages\[0\] has role 'robot'"),
    (dict(messages=[{"role": "user", "content": None}]), r"messages\[0\]'s content must be a string"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     r"content part 0 has type 'image_url': only text parts"),
    (dict(messages=[{"role": "assistant", "content": None}]), "needs content or tool_calls"),
    (dict(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                    {"role": "tool", "content": "3"}]), r"messages\[2\]: a tool message needs a 'tool_call_id'"),
    (dict(messages=[{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_1", "content": "3"}]),
     "must follow an assistant message with tool_calls"),
    (dict(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
                    {"role": "tool", "tool_call_id": "call_9", "content": "3"}]), "'call_9' names none of"),
    (dict(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {**TOOL_CALL, "function": {"name": "add", "arguments": "{a: 1}"}}]}]), "arguments are not JSON"),
    (dict(tools={"type": "function", "function": {"name": "add"}}), "tools must be a list"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "add"}}]), r"tools\[0\] has type 'retrieval'"),
    (dict(tools=[{"type": "function", "function": {"name": "add two"}}]), "function name must be"),
    (dict(tools=[ADD, ADD]), "two tools are named 'add'"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
     r"tools\[0\] \(f\): parameters is not a JSON schema"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": 3}}}}]),
     r"parameters is not a JSON schema.*at properties/a"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "must describe an object"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]), r"\(f\): strict must be true or false"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "rm_rf"}}),
     "names the function 'rm_rf', which is not among the tools"),
    (dict(tools=TOOLS, tool_choice="always"), "tool_choice must be one of none, auto, required"),
    (dict(tool_choice="required"), "'required' needs tools"),
])
def test_a_bad_request_is_refused_by_name(templated, request_, problem):
    request_ = {"messages": QUESTION, **request_}
    with pytest.raises(KvforgeError, match=problem):
        T.render_chat(templated["hermes"], **request_)


def test_good_shapes_are_accepted(templated):
    """developer is a system message; assistant content may be parts; a tool without parameters is a call with no
    arguments (its forced schema an empty object)."""
    tok = templated["hermes"]
    messages = [{"role": "developer", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"},
                                             {"type": "text", "text": "And 2+3?"}]}]
    assert T.render_chat(tok, messages, tools=TOOLS) == T.render_chat(tok, QUESTION, tools=TOOLS)
    clock = {"type": "function", "function": {"name": "now"}}
    forced = T.tool_constraint([clock], "required", "hermes")
    assert jsonschema.Draft202012Validator(forced["schema"]).is_valid({"name": "now", "arguments": {}})
    content, calls = T.parse_tool_calls('<tool_call>\n{"name": "now"}\n</tool_call>', "hermes", [clock])
    assert content is None and calls[0]["function"] == {"name": "now", "arguments": "{}"}
