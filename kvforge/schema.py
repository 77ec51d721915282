"""A small structural schema for JSON-like data: what kvforge's manifests and configs must look like.

    check(value, Rec({"graph": RelPath(), "opset": Opt(int)}, required=("graph",)), "manifest")

A spec is a Python type (str, int, float, bool: bool is never an int here, and an int is
a float), None, or one of the classes below. `check` raises SchemaError naming the
first field that does not fit, by its dotted path, what it holds and what was expected;
callers turn that into their own sentence ("bundle ... is damaged: ..."). Records
accept keys they do not list (a newer kvforge may add some); they refuse listed keys
of the wrong shape, and missing required ones.

`annotation_spec` turns a dataclass field's annotation ("int | None", "list[int] |
None", "dict[str, Any]") into a spec, so a manifest's model entry is checked against
the model configs' own fields (kvforge/model_fields.py).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from kvforge.errors import KvforgeError


class SchemaError(ValueError):
    def __init__(self, path: str, problem: str):
        super().__init__(f"{path} {problem}")
        self.path = path
        self.problem = problem


def describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return f"a {'list' if isinstance(value, list) else 'dict' if isinstance(value, dict) else type(value).__name__}"


@dataclass(frozen=True)
class Opt:
    spec: Any


class Union(tuple):
    """One of several specs: Union(str, int)."""

    def __new__(cls, *specs):
        return super().__new__(cls, specs)

    @property
    def specs(self) -> tuple:
        return tuple(self)


class Enum(tuple):
    """One of these values: Enum("a", "b")."""

    def __new__(cls, *values):
        return super().__new__(cls, values)

    @property
    def values(self) -> tuple:
        return tuple(self)


@dataclass(frozen=True)
class ListOf:
    spec: Any
    min_len: int = 0


@dataclass(frozen=True)
class DictOf:
    spec: Any


@dataclass(frozen=True)
class Rec:
    fields: dict
    required: tuple = ()


@dataclass(frozen=True)
class Num:
    """A finite number (int or float, not bool) within [low, high]."""

    low: float = -math.inf
    high: float = math.inf
    integer: bool = False
    finite: bool = True  # False: NaN and infinities too (a measured metric may be one)


@dataclass(frozen=True)
class Pattern:
    regex: str
    what: str


@dataclass(frozen=True)
class RelPath:
    """A file name inside a directory: relative, no '..', no empty or '.' parts, no backslash or NUL."""

    directories: bool = False  # may it name a file in a subdirectory ("1/model.py")?


class AnyJSON:
    """Any JSON value (for free-form records: a source's own options)."""


def path_problem(name: str, directories: bool = False) -> str | None:
    """Why `name` is not a safe relative path inside a directory, or None."""
    if not name or "\x00" in name or "\\" in name:
        return "is not a usable file name"
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return "is an absolute path; a bundle names only its own files"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "climbs out of the bundle or has an empty part ('..', '.', '//')"
    if len(parts) > 1 and not directories:
        return "names a file in a subdirectory; a bundle's files lie at its top level"
    return None


def check(value: Any, spec: Any, path: str) -> None:
    """Raise SchemaError for the first part of `value` that does not fit `spec`."""
    if spec is None:
        if value is not None:
            raise SchemaError(path, f"is {describe(value)}, expected null")
    elif isinstance(spec, Opt):
        if value is not None:
            check(value, spec.spec, path)
    elif isinstance(spec, Union):
        _check_union(value, spec, path)
    elif isinstance(spec, (ListOf, DictOf, Rec)):
        _check_container(value, spec, path)
    elif spec is not AnyJSON:
        _check_scalar(value, spec, path)


def _check_union(value: Any, spec: Union, path: str) -> None:
    problems = []
    for option in spec.specs:
        try:
            check(value, option, path)
            return
        except SchemaError as e:
            problems.append(e)
    deepest = max(problems, key=lambda e: len(e.path))  # the option that fitted furthest names the real problem
    if deepest.path != path:
        raise deepest
    raise SchemaError(path, f"is {describe(value)}, expected {' or '.join(expected(s) for s in spec.specs)}")


def _check_scalar(value: Any, spec: Any, path: str) -> None:
    if spec in (int, float):
        spec = Num(integer=spec is int)
    if isinstance(spec, Num):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (not spec.integer or isinstance(value, int))
        if not ok or (spec.finite and isinstance(value, float) and not math.isfinite(value)):
            raise SchemaError(path, f"is {describe(value)}, expected {expected(spec)}")
        if math.isfinite(value) and not spec.low <= value <= spec.high:
            raise SchemaError(path, f"is {value!r}, expected {expected(spec)}")
    elif spec in (bool, str):
        if not isinstance(value, spec):
            raise SchemaError(path, f"is {describe(value)}, expected {expected(spec)}")
    elif isinstance(spec, Enum):
        if isinstance(value, bool) or value not in spec.values:
            raise SchemaError(path, f"is {describe(value)}, expected one of {', '.join(map(repr, spec.values))}")
    elif isinstance(spec, Pattern):
        if not isinstance(value, str) or not re.fullmatch(spec.regex, value):
            raise SchemaError(path, f"is {describe(value)}, expected {spec.what}")
    elif isinstance(spec, RelPath):
        if not isinstance(value, str):
            raise SchemaError(path, f"is {describe(value)}, expected a file name")
        problem = path_problem(value, spec.directories)
        if problem:
            raise SchemaError(path, f"{value[:80]!r} {problem}")
    else:
        raise TypeError(f"not a schema spec: {spec!r}")  # a programming error, not the data's


def _check_container(value: Any, spec: ListOf | DictOf | Rec, path: str) -> None:
    if isinstance(spec, ListOf):
        if not isinstance(value, list):
            raise SchemaError(path, f"is {describe(value)}, expected a list")
        if len(value) < spec.min_len:
            raise SchemaError(path, f"has {len(value)} entries, expected at least {spec.min_len}")
        for i, item in enumerate(value):
            check(item, spec.spec, f"{path}[{i}]")
        return
    if not isinstance(value, dict):
        raise SchemaError(path, f"is {describe(value)}, expected a dict")
    if isinstance(spec, DictOf):
        for key, item in value.items():
            check(item, spec.spec, f"{path}.{key}")
        return
    missing = [k for k in spec.required if k not in value]
    if missing:
        raise SchemaError(f"{path}.{missing[0]}", "is missing")
    for key, item_spec in spec.fields.items():
        if key in value:
            check(value[key], item_spec, f"{path}.{key}")


def expected(spec: Any) -> str:
    if spec is None:
        return "null"
    if spec in (str, bool):
        return {str: "a string", bool: "true or false"}[spec]
    if spec is int or (isinstance(spec, Num) and spec.integer):
        low = getattr(spec, "low", -math.inf)
        return "an integer" + (f" >= {low:g}" if low > -math.inf else "")
    if spec is float or isinstance(spec, Num):
        low, high = getattr(spec, "low", -math.inf), getattr(spec, "high", math.inf)
        bounds = (f" >= {low:g}" if low > -math.inf else "") + (f" <= {high:g}" if high < math.inf else "")
        return "a finite number" + bounds
    if isinstance(spec, Opt):
        return f"{expected(spec.spec)} or null"
    if isinstance(spec, Enum):
        return "one of " + ", ".join(map(repr, spec.values))
    if isinstance(spec, (ListOf,)):
        return "a list"
    if isinstance(spec, (DictOf, Rec)):
        return "a dict"
    if isinstance(spec, Pattern):
        return spec.what
    if isinstance(spec, RelPath):
        return "a file name"
    if isinstance(spec, Union):
        return " or ".join(expected(s) for s in spec.specs)
    return "a JSON value"


_SIMPLE = {"int": int, "float": float, "bool": bool, "str": str, "None": None, "Any": AnyJSON}


def annotation_spec(annotation: str) -> Any:
    """The spec of a dataclass field annotation written as a string (PEP 604 unions, list[...] and dict[...])."""
    parts = _split_union(annotation.strip())
    if len(parts) > 1:
        specs = [annotation_spec(p) for p in parts if p != "None"]
        inner = specs[0] if len(specs) == 1 else Union(*specs)
        return Opt(inner) if "None" in parts else inner
    text = parts[0]
    if text in _SIMPLE:
        return _SIMPLE[text]
    generic = re.fullmatch(r"(list|tuple|dict)\[(.*)\]", text)
    if generic:
        kind, args = generic.groups()
        if kind == "dict":
            return DictOf(annotation_spec(_split_args(args)[1]))
        items = _split_args(args)
        return ListOf(annotation_spec(items[0]))
    raise ValueError(f"annotation {annotation!r} has no schema form")


def _split_union(text: str) -> list[str]:
    return [p.strip() for p in _split_top(text, "|")]


def _split_args(text: str) -> list[str]:
    return [p.strip() for p in _split_top(text, ",") if p.strip() != "..."]


def _split_top(text: str, sep: str) -> list[str]:
    depth, start, out = 0, 0, []
    for i, ch in enumerate(text):
        depth += ch == "["
        depth -= ch == "]"
        if ch == sep and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return out


def read_json(path, what: str = "", kind: type | None = dict) -> Any:
    """A JSON file's value, or one KvforgeError naming the file and what is wrong (unreadable, not UTF-8, not
    JSON, or not of `kind`: an object by default)."""
    from pathlib import Path

    path = Path(path)
    label = f"{what} {path}".strip()
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise KvforgeError(f"cannot read {label}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise KvforgeError(f"{label} is not UTF-8 text (byte {e.start}); JSON files are UTF-8") from e
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise KvforgeError(f"{label} is not valid JSON: {e}") from e
    if kind is not None and not isinstance(value, kind):
        raise KvforgeError(f"{label} holds {describe(value)}, expected a JSON {'object' if kind is dict else kind.__name__}")
    return value
