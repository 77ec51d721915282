"""Chat templates: a checkpoint's Jinja template turns a conversation into the prompt the model was tuned on.

Rendered as transformers renders them (`apply_chat_template`): a sandboxed Jinja environment (a template can
read the messages, not Python's internals), `trim_blocks` and `lstrip_blocks`, the loop-controls extension,
`raise_exception(message)` and `strftime_now(format)` as globals, a `tojson` filter that keeps non-ASCII text,
and the tokenizer's special tokens (`bos_token`, `eos_token`, `pad_token`) as variables. The rendered text is
tokenized without the tokenizer's own special tokens: the template writes them where the model expects them.

Templates come with the checkpoint: tokenizer_config.json's `chat_template` (a string, or a list of named
templates of which "default" is used), a `chat_template.jinja` file beside it, or a GGUF file's
`tokenizer.chat_template`; kvforge keeps the template in the bundle's tokenizer_config.json.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Sequence

from .errors import KvforgeError

ROLES_HINT = "a list of {'role': ..., 'content': ...} messages"


class TemplateError(KvforgeError):
    """The chat template refused the conversation (its raise_exception) or could not be rendered."""


@functools.lru_cache(maxsize=None)
def _environment():
    try:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # a dependency of kvforge; a broken environment gets a plain answer
        raise KvforgeError("chat templates need jinja2 (`pip install jinja2`)") from e

    def raise_exception(message):
        raise TemplateError(f"the chat template refused this conversation: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """A template compiled once (a chat renders the same template every turn)."""
    return _environment().from_string(template)


@functools.lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from its caller (beside what it sets itself): a template that takes tool
    definitions reads `tools`, one that does not never looks at them."""
    from jinja2 import TemplateSyntaxError, meta

    try:
        return frozenset(meta.find_undeclared_variables(_environment().parse(template)))
    except TemplateSyntaxError as e:
        raise TemplateError(f"the chat template does not render: {e}") from e


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation as a list of message dicts, or a KvforgeError naming what is wrong with it."""
    if isinstance(messages, dict) or isinstance(messages, str) or not isinstance(messages, Sequence) or not messages:
        raise KvforgeError(f"messages must be {ROLES_HINT}, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise KvforgeError(f"message {i} must be a dict with a 'role' string and a 'content', got {m!r:.80}")
    return [dict(m) for m in messages]


def render(template: str, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True,
           special_tokens: dict[str, str | None] | None = None, **variables: Any) -> str:
    """The template's text for this conversation; add_generation_prompt ends it where the assistant's reply begins.
    variables: what else the template reads (tools, documents, a date string, ...)."""
    from jinja2 import TemplateError as JinjaError
    from jinja2.exceptions import SecurityError

    messages = check_messages(messages)
    specials = {f"{role}_token": token for role, token in (special_tokens or {}).items() if token is not None}
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **specials, **variables)
    except TemplateError:
        raise
    except SecurityError as e:
        raise TemplateError(f"the chat template tried something the sandbox forbids: {e}") from e
    except JinjaError as e:
        raise TemplateError(f"the chat template does not render: {e}") from e


def template_from_config(config: dict[str, Any], where: str = "tokenizer_config.json") -> str | None:
    """The chat template a tokenizer_config.json names: its string, or the "default" of a list of named ones."""
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise KvforgeError(f"{where}: chat_template lists templates {sorted(map(str, named))} but none named 'default'")
    raise KvforgeError(f"{where}: chat_template is {type(value).__name__}, not a template string or a list of them")


IMAGE_SOURCE_KEYS = ("image", "url", "path")  # where transformers' processors read an image part's image


def split_images(messages: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """A conversation with image parts -> (the messages as a vision-language chat template takes them: each image
    part made {"type": "image"}, the template's placeholder; the images in reading order).

    Image parts are OpenAI's ({"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}) or
    transformers' ({"type": "image", "image" | "url" | "path": ...}); an image part without its image takes the
    next of the images given beside the messages (None in the list). String contents and text parts pass as
    they are: the template decides how to write them."""
    messages = check_messages(messages)
    out, images = [], []
    for i, m in enumerate(messages):
        content = m["content"]
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}]'s content part {j}"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise KvforgeError(f"{where} has no 'text' string")
                parts.append(part)
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise KvforgeError(f"{where} needs image_url.url (a data URL: data:image/png;base64,...)")
                parts.append({"type": "image"})
                images.append(url)
            elif kind == "image":
                parts.append({"type": "image"})
                images.append(next((part[k] for k in IMAGE_SOURCE_KEYS if part.get(k) is not None), None))
            else:
                what = f"has type {kind!r:.40}" if kind is not None else f"is {part!r:.60}"
                raise KvforgeError(f"{where} {what}: the parts are text, image_url and image")
        out.append({**m, "content": parts})
    return out, images
