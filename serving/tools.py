"""OpenAI tool calling through the checkpoint's own chat template: pure functions, no HTTP (openai_api.py calls them).

    ids = render_chat(tokenizer, messages, tools=tools, tool_choice="auto")     # the prompt, as token ids
    fmt = tool_format(tokenizer)                                                # how this model writes its calls
    forced = tool_constraint(tools, "required", fmt)                            # a response_format, or None
    content, tool_calls = parse_tool_calls(reply_text, fmt, tools)              # OpenAI's message fields

A tool-call format (ToolFormat) says how a model family writes its calls, how its template's markers look, what
a forced call's literal frame is, and how its calls, tool definitions and results read as plain text. Formats
are registered by name (register_format); a template's text picks one (each format declares the markers that
say "this template is mine", e.g. "<tool_call>" -> hermes), and a caller may name one instead, as vLLM's
--tool-call-parser. Registered: hermes (Qwen2/2.5/3, Hermes, SmolLM3, most ChatML templates that take tools;
the default), llama3_json (Llama 3.1/3.2), mistral ([TOOL_CALLS], ids of 9 alphanumerics).

A template that reads `tools` gets OpenAI's tool list as `tools` (as transformers passes it) and the conversation
as OpenAI gives it, with each call's `function.arguments` decoded to the dict that templates write with `tojson`
(as vLLM hands them over). A template that never reads `tools` (SmolLM2's plain ChatML) gets the tools described
in a system message in the format's own words, the assistant's calls as the text the model would write, and
tool results as a user message of <tool_response> blocks: the conversation Qwen2.5's template would show.
With tool_choice "none" the tools are not offered at all (as vLLM); with "required" or a named function the
reply is constrained to one call of an allowed tool (tool_constraint), so that it always parses.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import secrets
import string
from typing import Any, ClassVar, Iterator

from kvforge.chat import TemplateError, template_variables
from kvforge.errors import KvforgeError, MissingDependencyError
from kvforge.runtime.constrain import strict_schema

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CHOICES = ("none", "auto", "required")
DEFAULT_FORMAT = "hermes"
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
ALPHANUMERIC = string.ascii_letters + string.digits
TOOL_SHAPE = "{'type': 'function', 'function': {'name': ..., 'description': ..., 'parameters': {JSON schema}}}"
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: no parameters is an empty parameter list

FORMATS: dict[str, type[ToolFormat]] = {}  # name -> format, in registration order (the order detection tries them)


def register_format(cls: type[ToolFormat]) -> type[ToolFormat]:
    """Register a tool-call format under cls.name (a class decorator); a later registration replaces an earlier one."""
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        raise KvforgeError(f"{cls.__name__} has no format name")
    FORMATS[cls.name] = cls
    return cls


def random_id(length: int, alphabet: str = ALPHANUMERIC) -> str:
    return "".join(secrets.choice(alphabet) for _ in range(length))


def skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def decode_json(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON value that starts at `at` and where it ends, or None where no JSON value starts there."""
    try:
        return json.JSONDecoder().raw_decode(text, at)
    except ValueError:
        return None


def dumps(value: Any) -> str:
    """JSON as templates' tojson writes it (non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


class ToolFormat:
    """How one model family writes tool calls. Subclasses set name, markers, begin/end and find_blocks."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()  # text in a chat template that says the template is this format's
    arguments_key: ClassVar[str] = "arguments"  # the key that holds a call's arguments in the model's JSON
    begin: str = ""  # the literal text before a forced call's JSON
    end: str = ""  # and after it

    @classmethod
    def detects(cls, template: str) -> bool:
        return any(marker in template for marker in cls.markers)

    @classmethod
    def for_template(cls, template: str | None) -> ToolFormat:
        """The format as this template writes it (a variant may depend on the template's text)."""
        return cls()

    def __repr__(self) -> str:
        return f"<tool format {self.name}>"

    # -- reading a reply -------------------------------------------------------
    def find_blocks(self, text: str) -> Iterator[tuple[int, int, list[Any]]]:
        """(start, end, decoded JSON values) of each stretch of the text that looks like calls."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return "call_" + random_id(24)

    def parse(self, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
        names = {t["function"]["name"] for t in tools}
        kept, calls, at = [], [], 0
        for start, end, values in self.find_blocks(text):
            found = [self.openai_call(v, names) for v in values]
            if not found or any(c is None for c in found):
                continue  # malformed or naming no offered tool: the text stays content
            kept.append(text[at:start])
            calls += found
            at = end
        if not calls:
            return (text or None), []
        kept.append(text[at:])
        return "".join(kept).strip() or None, calls

    def openai_call(self, value: Any, names: set[str]) -> dict | None:
        """One decoded call as OpenAI's tool_calls entry, or None where it is not a call of an offered tool."""
        if not isinstance(value, dict) or value.get("name") not in names:
            return None
        args = next((value[k] for k in (self.arguments_key, "arguments", "parameters") if k in value), {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            decoded = decode_json(args, 0)
            args = decoded[0] if decoded and decoded[1] == len(args) else None
        if not isinstance(args, dict):
            return None
        return {"id": self.new_call_id(), "type": "function",
                "function": {"name": value["name"], "arguments": dumps(args)}}

    # -- writing ---------------------------------------------------------------
    def call_json(self, name: str, arguments: dict) -> str:
        return dumps({"name": name, self.arguments_key: arguments})

    def calls_text(self, calls: list[tuple[str, dict]]) -> str:
        """What the model writes for these calls (an assistant's calls, shown to a template that takes no tools)."""
        return "\n".join(self.begin + self.call_json(n, a) + self.end for n, a in calls)

    def tools_prompt(self, tools: list[dict]) -> str:
        """The tools described in words, for a template that does not read `tools`."""
        raise NotImplementedError

    def results_text(self, results: list[str]) -> str:
        """Consecutive tool results, as one user message (Qwen2.5's form)."""
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)

    def template_messages(self, messages: list[dict]) -> list[dict]:
        """What the format's templates need beyond OpenAI's shapes (Mistral's ids); as given by default."""
        return messages

    # -- a forced call -----------------------------------------------------------
    def call_schema(self, tool: dict, at: str) -> tuple[dict, dict]:
        """The JSON schema of one call of `tool`, to sit at JSON pointer `at` of the whole schema, and the
        definitions ($defs) it moved to the root."""
        fn = tool["function"]
        params = copy.deepcopy(fn.get("parameters") or EMPTY_PARAMETERS)
        params.setdefault("type", "object")
        if fn.get("strict") is True:  # OpenAI's strict function calling: no argument beyond those declared
            params = strict_schema(params)
        defs = {}
        for key in ("$defs", "definitions"):
            defs.update({f"{fn['name']}.{k}": v for k, v in (params.pop(key, None) or {}).items()})
        where = f"{at}/properties/{self.arguments_key}"
        params = rebase_refs(params, fn["name"], where)
        defs = {k: rebase_refs(v, fn["name"], where) for k, v in defs.items()}
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, self.arguments_key: params},
                "required": ["name", self.arguments_key], "additionalProperties": False}, defs


def pointer_escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def pointer_unescape(key: str) -> str:
    return key.replace("~1", "/").replace("~0", "~")


def rebase_refs(schema: Any, tool: str, where: str) -> Any:
    """A tool's parameter schema moved into a larger one: its local $refs made to point where things now are
    (#/$defs/X -> the root's #/$defs/<tool>.X; any other #... -> below `where`, the parameters' new place)."""
    if isinstance(schema, list):
        return [rebase_refs(s, tool, where) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            parts = value[1:].split("/", 3)  # "", "$defs", name, rest
            if len(parts) >= 3 and parts[0] == "" and parts[1] in ("$defs", "definitions"):
                moved = pointer_escape(f"{tool}.{pointer_unescape(parts[2])}")
                value = f"#/$defs/{moved}" + (f"/{parts[3]}" if len(parts) == 4 else "")
            else:
                value = where + value[1:]
            out[key] = value
        else:
            out[key] = rebase_refs(value, tool, where)
    return out


@register_format
class Hermes(ToolFormat):
    """<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call (Hermes 2 Pro, Qwen2/2.5/3,
    SmolLM3 and most ChatML templates that take tools)."""

    name = "hermes"
    markers = ("<tool_call>",)
    begin = "<tool_call>\n"
    end = "\n</tool_call>"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def find_blocks(self, text):
        at = 0
        while (start := text.find(self.OPEN, at)) >= 0:
            decoded = decode_json(text, skip_space(text, start + len(self.OPEN)))
            if decoded is not None:  # the JSON first: a string argument may itself hold "</tool_call>"
                value, after = decoded
                after = skip_space(text, after)
                if text.startswith(self.CLOSE, after):
                    yield start, after + len(self.CLOSE), [value]
                    at = after + len(self.CLOSE)
                    continue
                if after == len(text):  # the reply stopped before the closing tag
                    yield start, after, [value]
                    return
            close = text.find(self.CLOSE, start)
            at = close + len(self.CLOSE) if close >= 0 else start + len(self.OPEN)

    def tools_prompt(self, tools):
        listed = "".join("\n" + dumps(t) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>{listed}\n</tools>"
                "\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


@register_format
class Llama3Json(ToolFormat):
    """Llama 3.1/3.2: the reply is {"name": ..., "parameters": {...}} (after <|python_tag|> or not); several calls
    are separated by ';'."""

    name = "llama3_json"
    markers = ("<|python_tag|>", '"parameters": ')
    arguments_key = "parameters"
    TAG = "<|python_tag|>"

    def find_blocks(self, text):
        at = 0
        while True:
            starts = [i for i in (text.find(self.TAG, at), text.find("{", at)) if i >= 0]
            if not starts:
                return
            start = min(starts)
            cursor = start + len(self.TAG) if text.startswith(self.TAG, start) else start
            values, end = [], start
            while (decoded := decode_json(text, skip_space(text, cursor))) is not None:
                value, end = decoded
                if not isinstance(value, dict):
                    break
                values.append(value)
                cursor = skip_space(text, end)
                if not text.startswith(";", cursor):
                    break
                cursor += 1
            if values and all("name" in v for v in values):
                yield start, end, values
                at = end
            else:  # not calls: look past this brace (or tag)
                at = max(end, start + 1)

    def calls_text(self, calls):
        return "; ".join(self.call_json(n, a) for n, a in calls)

    def tools_prompt(self, tools):
        listed = "".join(json.dumps(t, ensure_ascii=False, indent=4) + "\n\n" for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\n"
                'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
                f'value}}.Do not use variables.\n\n{listed}').rstrip()


@register_format
class Mistral(ToolFormat):
    """[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]; Mistral's templates take call ids of 9 alphanumerics
    (so do the ids given here), and longer ids in a conversation are mapped to such ones, the same way on the
    assistant's call and on the tool result that answers it."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    TAG = "[TOOL_CALLS]"
    end = "]"
    ID = re.compile(r"[A-Za-z0-9]{9}")

    def __init__(self, spaced: bool = False):
        self.begin = self.TAG + (" [" if spaced else "[")  # Mistral 7B v0.3's template writes "[TOOL_CALLS] ["

    @classmethod
    def for_template(cls, template):
        return cls(spaced=bool(template) and '"[TOOL_CALLS] ["' in template)

    def new_call_id(self):
        return random_id(9)

    def template_id(self, call_id: str) -> str:
        if self.ID.fullmatch(call_id):
            return call_id
        digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest(), "big")
        return "".join(ALPHANUMERIC[(digest >> (6 * i)) % len(ALPHANUMERIC)] for i in range(9))

    def template_messages(self, messages):
        out = []
        for m in messages:
            m = dict(m)
            if "tool_calls" in m:
                m["tool_calls"] = [{**c, "id": self.template_id(c["id"])} for c in m["tool_calls"]]
            if "tool_call_id" in m:
                m["tool_call_id"] = self.template_id(m["tool_call_id"])
            out.append(m)
        return out

    def find_blocks(self, text):
        starts = [m.start() for m in re.finditer(re.escape(self.TAG), text)]
        if not starts and text.lstrip().startswith("["):  # the marker is a special token: decoding may drop it
            starts = [len(text) - len(text.lstrip())]
        for start in starts:
            cursor = start + len(self.TAG) if text.startswith(self.TAG, start) else start
            decoded = decode_json(text, skip_space(text, cursor))
            if decoded is not None:
                value, end = decoded
                yield start, end, value if isinstance(value, list) else [value]

    def calls_text(self, calls):
        return self.begin + ", ".join(self.call_json(n, a) for n, a in calls) + self.end

    def tools_prompt(self, tools):
        return (f"[AVAILABLE_TOOLS] {dumps(tools)}[/AVAILABLE_TOOLS]\nTo call functions, reply with {self.TAG} "
                'and a JSON list of {"name": <function-name>, "arguments": <args-json-object>} objects.')


# -- the checks ----------------------------------------------------------------------------------------------------
def jsonschema_module():
    try:
        import jsonschema
    except ImportError as e:
        raise MissingDependencyError("the `jsonschema` library (tool parameters are JSON schemas)",
                                     "Install it with `pip install jsonschema`.") from e
    return jsonschema


def check_tools(tools: Any) -> list[dict] | None:
    """OpenAI's `tools`, checked: a list of function tools with distinct names and JSON-schema parameters.
    None (or an empty list) for no tools; a KvforgeError naming the problem otherwise."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise KvforgeError(f"tools must be a list of {TOOL_SHAPE}, got {type(tools).__name__}")
    jsonschema = jsonschema_module()
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or not isinstance(tool.get("function"), dict):
            raise KvforgeError(f"{where} must be {TOOL_SHAPE}, got {tool!r:.120}")
        if tool.get("type") != "function":
            raise KvforgeError(f"{where} has type {tool.get('type')!r}; the only tool type is 'function'")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise KvforgeError(f"{where}'s function name must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}")
        if name in seen:
            raise KvforgeError(f"{where}: two tools are named {name!r}")
        seen.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise KvforgeError(f"{where} ({name}): description must be a string, "
                               f"got {type(fn['description']).__name__}")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise KvforgeError(f"{where} ({name}): strict must be true or false, got {fn['strict']!r:.80}")
        params = fn.get("parameters")
        if params is None:
            continue
        if not isinstance(params, dict):
            raise KvforgeError(f"{where} ({name}): parameters must be a JSON schema object, got {params!r:.80}")
        try:
            jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator).check_schema(params)
        except jsonschema.SchemaError as e:
            at = "/".join(map(str, e.path))
            raise KvforgeError(f"{where} ({name}): parameters is not a JSON schema: {e.message}"
                               + (f" (at {at})" if at else "")) from None
        if isinstance(params.get("type"), str) and params["type"] != "object":
            raise KvforgeError(f"{where} ({name}): parameters must describe an object (the call's named arguments), "
                               f"not type {params['type']!r}")
    return tools or None


def check_tool_choice(tool_choice: Any, tools: list[dict] | None) -> str | dict:
    """tool_choice checked against the (checked) tools: "none", "auto", "required", or
    {"type": "function", "function": {"name": NAME}} naming one of them. None means OpenAI's default."""
    if tool_choice is None:
        return "auto" if tools else "none"
    names = [t["function"]["name"] for t in tools or []]
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise KvforgeError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                               f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r:.80}")
        if tool_choice == "required" and not tools:
            raise KvforgeError("tool_choice 'required' needs tools to call")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise KvforgeError("tool_choice must be one of none, auto, required or {'type': 'function', 'function': "
                           f"{{'name': ...}}}}, got {tool_choice!r:.120}")
    if fn["name"] not in names:
        raise KvforgeError(f"tool_choice names the function {fn['name']!r}, which is not among the tools "
                           f"({', '.join(names) or 'none given'})")
    return {"type": "function", "function": {"name": fn["name"]}}


def forced_tools(tool_choice: Any, tools: list[dict] | None) -> list[dict]:
    """The tools one of which the reply must call: all for "required", the named one, none otherwise."""
    choice = check_tool_choice(tool_choice, tools)
    if choice == "required":
        return list(tools)
    if isinstance(choice, dict):
        return [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    return []


def content_text(content: Any, where: str, nullable: bool = False) -> str | None:
    """A message's content as one string: a string, or the text of a list of text parts (joined by newlines)."""
    if content is None and nullable:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                what = f"has type {kind!r}" if kind is not None else f"is {part!r:.60}"
                raise KvforgeError(f"{where}'s content part {j} {what}: only text parts "
                                   "({'type': 'text', 'text': ...}) are supported")
            if not isinstance(part.get("text"), str):
                raise KvforgeError(f"{where}'s content part {j} has no 'text' string")
            texts.append(part["text"])
        return "\n".join(texts)
    raise KvforgeError(f"{where}'s content must be a string or a list of text parts, got {type(content).__name__}")


def check_calls(calls: Any, where: str) -> list[dict]:
    """An assistant's tool_calls as templates take them: arguments decoded from OpenAI's JSON string to a dict."""
    if not isinstance(calls, list):
        raise KvforgeError(f"{where}'s tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}'s tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise KvforgeError(f"{at} must be {{'id': ..., 'type': 'function', 'function': {{'name': ..., "
                               f"'arguments': '<JSON>'}}}}, got {call!r:.120}")
        if call.get("type", "function") != "function":
            raise KvforgeError(f"{at} has type {call['type']!r}; the only tool call type is 'function'")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise KvforgeError(f"{at} has no 'id' (the tool result names it in tool_call_id)")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise KvforgeError(f"{at}'s arguments are not JSON ({e}): {args!r:.80}") from None
        if not isinstance(args, dict):
            raise KvforgeError(f"{at}'s arguments must be a JSON object, got {args!r:.80}")
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def check_chat_messages(messages: Any) -> list[dict]:
    """OpenAI's messages checked and made plain: content one string (None only beside an assistant's calls),
    developer as system, calls' arguments as dicts, each tool result answering a call of the assistant before it."""
    if not isinstance(messages, list) or not messages:
        raise KvforgeError("messages must be a non-empty list of {'role': ..., 'content': ...} objects, got "
                           + (f"{type(messages).__name__}" if not isinstance(messages, list) else "an empty list"))
    out, answerable = [], None  # the ids of the calls a tool message may answer now
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise KvforgeError(f"{where} must be an object with a role and content, got {m!r:.80}")
        role = m.get("role")
        if role not in ROLES:
            raise KvforgeError(f"{where} has role {role!r:.40}; the roles are {', '.join(ROLES)}")
        msg = {"role": "system" if role == "developer" else role,
               "content": content_text(m.get("content"), where, nullable=role == "assistant")}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = check_calls(m["tool_calls"], where)
            answerable = {c["id"] for c in msg["tool_calls"]}
        elif role == "assistant" and msg["content"] is None:
            raise KvforgeError(f"{where}: an assistant message needs content or tool_calls")
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise KvforgeError(f"{where}: a tool message needs a 'tool_call_id' naming the call it answers")
            if answerable is None:
                raise KvforgeError(f"{where}: a tool message must follow an assistant message with tool_calls")
            if call_id not in answerable:
                raise KvforgeError(f"{where}: tool_call_id {call_id!r:.60} names none of the preceding assistant's "
                                   f"tool calls ({', '.join(sorted(answerable))})")
            msg["tool_call_id"] = call_id
        else:
            answerable = None
        out.append(msg)
    return out


# -- rendering -----------------------------------------------------------------------------------------------------
def template_of(source: Any) -> str | None:
    return source if isinstance(source, str) or source is None else getattr(source, "chat_template", None)


def takes_tools(source: Any) -> bool:
    """Whether a chat template (or a tokenizer's) reads `tools`: if not, tools are described in a system message."""
    template = template_of(source)
    return bool(template) and "tools" in template_variables(template)


def tool_format(source: Any = None, tool_parser: str | None = None) -> ToolFormat:
    """The tool-call format of a chat template (or a tokenizer's): the one named by tool_parser, else the first
    registered format whose markers the template holds, else hermes."""
    template = template_of(source)
    if tool_parser is not None:
        if tool_parser not in FORMATS:
            raise KvforgeError(f"unknown tool-call format {tool_parser!r:.60}; the formats are {', '.join(FORMATS)}")
        return FORMATS[tool_parser].for_template(template)
    for cls in FORMATS.values():
        if template and cls.detects(template):
            return cls.for_template(template)
    return FORMATS[DEFAULT_FORMAT].for_template(template)


def as_format(fmt: Any) -> ToolFormat:
    if isinstance(fmt, ToolFormat):
        return fmt
    if isinstance(fmt, str):
        return tool_format(None, fmt)
    raise KvforgeError(f"a tool-call format is a ToolFormat or one of {', '.join(FORMATS)}, got {fmt!r:.60}")


def plain_conversation(messages: list[dict], fmt: ToolFormat) -> list[dict]:
    """Calls and tool results as text a template without tool support shows: an assistant's calls as the text the
    model writes, consecutive tool results as one user message of <tool_response> blocks."""
    out: list[dict] = []
    results: list[str] = []
    for m in messages + [None]:
        if m is not None and m["role"] == "tool":
            results.append(m["content"])
            continue
        if results:
            out.append({"role": "user", "content": fmt.results_text(results)})
            results = []
        if m is None:
            break
        if "tool_calls" in m:
            calls = fmt.calls_text([(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]])
            m = {"role": "assistant", "content": f"{m['content']}\n{calls}" if m["content"] else calls}
        out.append(m)
    return out


def with_tools_prompt(messages: list[dict], prompt: str, where: str) -> list[dict]:
    """The tools' description ahead of the first system message (where="system"; one is added if there is none)
    or of the first user message (where="user")."""
    messages = [dict(m) for m in messages]
    if where == "system":
        if messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{prompt}"
            return messages
        return [{"role": "system", "content": prompt}] + messages
    for m in messages:
        if m["role"] == "user":
            m["content"] = f"{prompt}\n\n{m['content']}"
            return messages
    return [{"role": "user", "content": prompt}] + messages


def chat_prompt(tokenizer, messages: Any, tools: Any = None, tool_choice: Any = "auto",
                tool_parser: str | None = None) -> str:
    """The prompt text of an OpenAI chat request, through the tokenizer's chat template."""
    tools = check_tools(tools)
    choice = check_tool_choice(tool_choice, tools)
    messages = check_chat_messages(messages)
    offered = tools if choice != "none" else None
    fmt = tool_format(tokenizer, tool_parser)
    if takes_tools(tokenizer):
        return tokenizer.render_chat(fmt.template_messages(messages), True, tools=offered)
    plain = plain_conversation(messages, fmt)
    if not offered:
        return tokenizer.render_chat(plain, True, tools=None)
    try:
        return tokenizer.render_chat(with_tools_prompt(plain, fmt.tools_prompt(offered), "system"), True, tools=None)
    except TemplateError:  # a template without a system role (Gemma's): the description opens the first user turn
        return tokenizer.render_chat(with_tools_prompt(plain, fmt.tools_prompt(offered), "user"), True, tools=None)


def render_chat(tokenizer, messages: Any, tools: Any = None, tool_choice: Any = "auto",
                tool_parser: str | None = None) -> list[int]:
    """The prompt ids of an OpenAI chat request (messages, tools, tool_choice) through the tokenizer's own chat
    template, as transformers' apply_chat_template gives them; a KvforgeError naming what is wrong otherwise."""
    return tokenizer.encode(chat_prompt(tokenizer, messages, tools, tool_choice, tool_parser), add_special_tokens=False)


# -- a forced call, and the reply's calls --------------------------------------------------------------------------
def tool_constraint(tools: Any, tool_choice: Any, fmt: Any) -> dict | None:
    """For tool_choice "required" or a named function: the response_format that makes the reply one call of an
    allowed tool, {"type": "structural", "begin": <literal text>, "schema": <the call's JSON schema>, "end":
    <literal text>}; None for "auto" and "none"."""
    tools = check_tools(tools)
    allowed = forced_tools(tool_choice, tools)
    if not allowed:
        return None
    fmt = as_format(fmt)
    schemas, defs = [], {}
    for i, tool in enumerate(allowed):
        schema, moved = fmt.call_schema(tool, "#" if len(allowed) == 1 else f"#/anyOf/{i}")
        schemas.append(schema)
        defs.update(moved)
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    if defs:
        schema = {**schema, "$defs": defs}
    return {"type": "structural", "begin": fmt.begin, "schema": schema, "end": fmt.end}


def parse_tool_calls(text: str, fmt: Any, tools: Any) -> tuple[str | None, list[dict]]:
    """A reply's calls in OpenAI's shape ({"id": ..., "type": "function", "function": {"name": ...,
    "arguments": "<JSON>"}}) and the text outside them (None when empty). A call that does not parse or names no
    offered tool stays in the content; this never raises on the reply's text."""
    tools = check_tools(tools)
    if not tools:
        return (text or None), []
    return as_format(fmt).parse(text, tools)
