#!/usr/bin/env python3
"""Extract TensorRT's Python API from its public pybind11 binding sources.

This generator is run BY HAND, once, whenever a TensorRT release is added to
the set the project supports.  It reads the public NVIDIA/TensorRT git
repository (a bare mirror is fine: files are read with ``git show TAG:path``),
parses the pybind11 binding sources of every requested release tag, and writes
one JSON description of the ``tensorrt`` Python module per tag to
``tests/runtime/trt_api/tensorrt-<version>.json`` (``<version>`` is the tag
without its leading ``v``).  The JSON files are committed; tests and tools use
them to check that the project only calls TensorRT Python APIs (classes,
methods, argument names, properties, enum members) that exist in the
releases it supports, without needing TensorRT or a GPU.

Usage (from the repository root; stdlib only, needs ``git`` on PATH)::

    python scripts/trt_api.py                      # default mirror, tags v10.16 and v11.1
    python scripts/trt_api.py --tag v11.2 --tag v11.1 --summary
    python scripts/trt_api.py --repo ~/src/TensorRT --tag v10.16 --out /tmp/trt_api

``--summary`` prints per-tag counts and the API differences between
consecutive tags (in the order given), which is the quickest way to review a
new release.  After regenerating, inspect the "unparsed" list of every
output file: it names bindings that the parser could not interpret (for
example names produced by macros); nothing there is guessed.

What is read:
  * every ``python/src/**/*.cpp`` (binding sources: ``py::class_``,
    ``py::enum_``, ``py::bind_vector``, ``m.def``, ``m.attr(...) = ...`` ...);
    ``#if`` blocks are evaluated for the full ``tensorrt`` module
    (``tensorrt_EXPORTS``/``EXPORT_ALL_BINDINGS`` = 1, other undefined macros
    = 0, as the C preprocessor does); skipped blocks that contain bindings are
    listed under ``preprocessor.inactive``;
  * ``include/**/*.h``, ``python/include/*.h`` and the binding sources again,
    only to count the parameters of C++ functions bound without argument
    names (``"named": false`` entries);
  * ``python/packaging/bindings_wheel/tensorrt/__init__.py``: module-level
    helpers the wheel adds in Python (``volume``, ``nptype``, ``Logger``
    severity aliases, ...), marked ``"source": "python"``.

Output schema (keys sorted)::

  {"tensorrt_version": "11.1", "tag": "v11.1", "commit": "<sha>",
   "header_version": "11.1.0.106", "generated_by": "scripts/trt_api.py",
   "sources": [...files that define bindings...],
   "classes": {"Builder": {"bases": [], "init": [OVERLOAD...],
                           "methods": {"name": [OVERLOAD...]},
                           "static_methods": {...}, "properties": {"p": "ro"|"rw"|"wo"},
                           # optional: "static_properties", "deprecated_properties",
                           # "attributes" (python-added / export_values names),
                           # "container": "vector"|"map" for py::bind_vector/bind_map
                          }},
   "enums": {"ILogger.Severity": {"members": [...], "arithmetic": true,
                                  "export_values": true,
                                  # optional: "methods", "properties", "attributes",
                                  # "alias_of" + "source" for python aliases
                                 }},
   "functions": {"name": [OVERLOAD...]},
   "constants": ["float32", "__version__", ...],
   "python": {...what the Python package adds, with conditions...},
   "preprocessor": {"defines": {...}, "assumed_undefined": [...], "inactive": [...]},
   "unparsed": [{"where": "file:line", "text": "..."}]}

  OVERLOAD = {"args": [{"name": "flags", "default": "0U"}], "named": true, "nargs": 1}
    "named": false means pybind11 got no argument names: the arguments are
    positional-only and "nargs" is their count inferred from the C++
    signature (null when it could not be inferred).  Optional keys:
    "deprecated": true (wrapped in utils::deprecate*), "source": "python".

Nested scopes use dotted names as seen from the module ("ILogger.Severity").
"bases" lists Python-visible base classes (``py::class_<Derived, Base>``).
"""

from __future__ import annotations

import argparse
import ast
import bisect
import json
import re
import subprocess
import sys
from pathlib import Path

DEFAULT_REPO = "/work/.mirror/NVIDIA+TensorRT/repo"
DEFAULT_TAGS = ["v10.16", "v11.1"]
GENERATED_BY = "scripts/trt_api.py"
PY_INIT = "python/packaging/bindings_wheel/tensorrt/__init__.py"

# Macros as the full `tensorrt` Python module is built (python/CMakeLists.txt
# defines tensorrt_EXPORTS=1; ForwardDeclarations.h derives EXPORT_ALL_BINDINGS).
# Anything else that is not #define'd in the file itself is 0, like in cpp.
DEFAULT_DEFINES = {
    "tensorrt_EXPORTS": 1,
    "EXPORT_ALL_BINDINGS": 1,
    "PYBIND11_VERSION_MAJOR": 2,
    "PYBIND11_VERSION_MINOR": 13,
    "PYBIND11_VERSION_PATCH": 6,
    "__linux__": 1,
    "__GNUC__": 11,
    "__cplusplus": 201703,
}

# Function-like macros that appear in binding bodies and bind nothing.
HARMLESS_MACROS = re.compile(
    r"^(PY_ASSERT_\w+|PYBIND11_OVERLOAD\w*|PYBIND11_OVERRIDE\w*|CUDA_CALL\w*|PLUGIN_API_CATCH\w*|"
    r"PYBIND11_MODULE|TRT_\w+|ASSERT\w*|CHECK\w*)$"
)

CPP_KEYWORDS = {
    "if", "else", "for", "while", "do", "switch", "case", "return", "sizeof", "decltype", "noexcept",
    "alignas", "alignof", "static_assert", "catch", "throw", "new", "delete", "typeid", "try",
    "static_cast", "dynamic_cast", "const_cast", "reinterpret_cast", "operator", "template",
    "typename", "using", "namespace", "class", "struct", "union", "enum", "public", "private",
    "protected", "virtual", "const", "constexpr", "static", "inline", "explicit", "default",
    "goto", "break", "continue", "co_return", "co_await", "requires", "defined",
}

TEMPLATE_KEYWORDS = {"static_cast", "reinterpret_cast", "const_cast", "dynamic_cast", "operator", "template"}
NOT_A_CLASS_DECL = ("enum", "<", ",", "(", "friend")
DEPRECATING_WRAPPERS = {"deprecate", "deprecateMember"}
TRANSPARENT_WRAPPERS = {"deprecateInTrtRtxOnly", "deprecateMemberInTrtRtxOnly", "cpp_function"}


# --------------------------------------------------------------------------------------------
# git access
# --------------------------------------------------------------------------------------------
class Git:
    def __init__(self, repo: str):
        self.repo = repo

    def _run(self, *args: str) -> str:
        res = subprocess.run(
            ["git", "-C", self.repo, *args], check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        return res.stdout.decode("utf-8", errors="replace")

    def commit(self, tag: str) -> str:
        return self._run("rev-parse", f"{tag}^{{commit}}").strip()

    def files(self, tag: str, *prefixes: str) -> list[str]:
        out = self._run("ls-tree", "-r", "--name-only", tag, "--", *prefixes)
        return [line for line in out.splitlines() if line]

    def show(self, tag: str, path: str) -> str:
        return self._run("show", f"{tag}:{path}")


# --------------------------------------------------------------------------------------------
# C++ lexing: comments, preprocessor, tokens
# --------------------------------------------------------------------------------------------
def _blank(s: str) -> str:
    return "".join("\n" if c == "\n" else " " for c in s)


_RAW_START = re.compile(r'(?:u8|u|U|L)?R"([^()\\\s]{0,16})\(')


def strip_comments(text: str) -> tuple[str, list[tuple[int, int]]]:
    """Blank out comments (positions and newlines kept). Returns text and multi-line literal spans."""
    out = []
    spans = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "/" and i + 1 < n and text[i + 1] == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            # a backslash-newline continues a // comment
            while j < n and j > 0 and text[j - 1] == "\\":
                k = text.find("\n", j + 1)
                j = n if k < 0 else k
            out.append(_blank(text[i:j]))
            i = j
        elif c == "/" and i + 1 < n and text[i + 1] == "*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blanked = _blank(text[i:j])
            out.append(" " + blanked[1:] if blanked else blanked)
            i = j
        elif c == "R" or (c in "uUL" and _RAW_START.match(text, i)):
            m = _RAW_START.match(text, i)
            if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
                end = text.find(")" + m.group(1) + '"', m.end())
                end = n if end < 0 else end + len(m.group(1)) + 2
                spans.append((i, end))
                out.append(text[i:end])
                i = end
            else:
                out.append(c)
                i += 1
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"' and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif c == "'":
            # digit separator (1'000) or a character literal
            k = i
            while k > 0 and (text[k - 1].isalnum() or text[k - 1] == "_"):
                k -= 1
            if k < i and text[k].isdigit():
                out.append(c)
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != "'" and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        else:
            j = i
            while j < n and text[j] not in "/\"'RuUL":
                j += 1
            if j == i:
                j = i + 1
            out.append(text[i:j])
            i = j
    return "".join(out), spans


_PP_TOKEN = re.compile(r"\s*(defined|[A-Za-z_]\w*|0[xX][0-9a-fA-F]+|\d+|&&|\|\||==|!=|<=|>=|[()!<>+\-*/%?:])")


class Preprocessor:
    """Evaluates #if/#ifdef/#elif/#else/#endif; blanks directives and inactive code."""

    def __init__(self, defines: dict[str, int]):
        self.base_defines = dict(defines)

    def run(self, path: str, text: str, spans: list[tuple[int, int]]):
        defines = dict(self.base_defines)
        func_macros: dict[str, int] = {}
        unknown: set[str] = set()
        inactive: list[dict] = []
        lines = text.split("\n")
        offsets = []
        pos = 0
        for line in lines:
            offsets.append(pos)
            pos += len(line) + 1
        span_starts = [s for s, _ in spans]

        def in_literal(off: int) -> bool:
            k = bisect.bisect_right(span_starts, off) - 1
            return k >= 0 and spans[k][0] < off < spans[k][1]

        def evaluate(expr: str, lineno: int) -> bool:
            out = []
            toks = _PP_TOKEN.findall(expr)
            k = 0
            while k < len(toks):
                t = toks[k]
                if t == "defined":
                    if k + 1 < len(toks) and toks[k + 1] == "(":
                        name = toks[k + 2]
                        k += 4
                    else:
                        name = toks[k + 1]
                        k += 2
                    if name not in defines:
                        unknown.add(name)
                    out.append("1" if name in defines else "0")
                    continue
                if re.match(r"[A-Za-z_]", t):
                    if t in defines:
                        out.append(str(defines[t]))
                    else:
                        unknown.add(t)
                        out.append("0")
                elif t == "&&":
                    out.append(" and ")
                elif t == "||":
                    out.append(" or ")
                elif t == "!":
                    out.append(" not ")
                elif t == "/":
                    out.append("//")
                elif re.match(r"0[xX]", t):
                    out.append(str(int(t, 16)))
                else:
                    out.append(t)
                k += 1
            try:
                return bool(eval(" ".join(out), {"__builtins__": {}}, {}))  # noqa: S307 - arithmetic only
            except Exception:
                unknown.add(f"<cannot evaluate '{expr.strip()}' at {path}:{lineno}>")
                return True

        # stack entries: [parent_active, branch_active, taken, start_line, condition]
        stack: list[list] = []
        active = True
        out_lines = list(lines)
        i = 0
        while i < len(lines):
            line = lines[i]
            stripped = line.lstrip()
            if stripped.startswith("#") and not in_literal(offsets[i] + len(line) - len(stripped)):
                first = i
                directive = stripped
                while directive.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    directive = directive[:-1] + " " + lines[i].strip()
                for k in range(first, i + 1):
                    out_lines[k] = " " * len(lines[k])
                m = re.match(r"#\s*(\w+)\s*(.*)", directive)
                word, rest = (m.group(1), m.group(2).strip()) if m else ("", "")
                lineno = first + 1
                if word in ("if", "ifdef", "ifndef"):
                    if word == "ifdef":
                        cond = rest.split()[0] in defines if rest else False
                        if rest and rest.split()[0] not in defines:
                            unknown.add(rest.split()[0])
                    elif word == "ifndef":
                        cond = rest.split()[0] not in defines if rest else True
                    else:
                        cond = evaluate(rest, lineno) if active else False
                    stack.append([active, active and cond, cond, lineno, f"#{word} {rest}"])
                    active = active and cond
                elif word == "elif" and stack:
                    top = stack[-1]
                    cond = (not top[2]) and top[0] and evaluate(rest, lineno)
                    top[1] = top[0] and cond
                    top[2] = top[2] or cond
                    top[3], top[4] = lineno, f"#elif {rest}"
                    active = top[1]
                elif word == "else" and stack:
                    top = stack[-1]
                    top[1] = top[0] and not top[2]
                    top[2] = True
                    top[3], top[4] = lineno, f"#else of {top[4]}"
                    active = top[1]
                elif word == "endif" and stack:
                    active = stack.pop()[0]
                elif word == "define" and active:
                    md = re.match(r"(\w+)(\()?\s*(.*)", rest)
                    if md:
                        name, is_func, value = md.group(1), md.group(2), md.group(3)
                        if is_func:
                            func_macros[name] = lineno
                        else:
                            try:
                                defines[name] = int(value, 0) if value else 1
                            except ValueError:
                                if value in defines:
                                    defines[name] = defines[value]
                                else:
                                    defines[name] = 1
                elif word == "undef" and active:
                    defines.pop(rest.split()[0] if rest else "", None)
            elif not active:
                out_lines[i] = " " * len(line)
                if stack:
                    top = stack[-1]
                    names = re.findall(
                        r'(?:\.(?:def\w*|value)\s*\(\s*|py::(?:class_|enum_)<[^>]*>\s*\(\s*\w+\s*,\s*)"(\w+)"', line
                    )
                    if names:
                        if inactive and inactive[-1]["_id"] == id(top) and inactive[-1]["_cond"] == top[4]:
                            inactive[-1]["names"].extend(names)
                        else:
                            inactive.append(
                                {
                                    "_id": id(top),
                                    "_cond": top[4],
                                    "where": f"{path}:{top[3]}",
                                    "condition": top[4],
                                    "names": list(names),
                                }
                            )
            i += 1
        for item in inactive:
            item.pop("_id")
            item.pop("_cond")
        return "\n".join(out_lines), func_macros, unknown, inactive


class Tok:
    __slots__ = ("kind", "val", "pos", "end", "line", "suffix")

    def __init__(self, kind, val, pos, end, line, suffix=""):
        self.kind, self.val, self.pos, self.end, self.line, self.suffix = kind, val, pos, end, line, suffix

    def __repr__(self):
        return f"Tok({self.kind},{self.val!r},L{self.line})"


_TOKEN_RE = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<raw>(?:u8|u|U|L)?R"(?P<delim>[^()\\\s]{0,16})\(.*?\)(?P=delim)")
  | (?P<str>(?:u8|u|U|L)?"(?:\\.|[^"\\\n])*")(?P<sfx>[A-Za-z_]\w*)?
  | (?P<chr>(?:u8|u|U|L)?'(?:\\.|[^'\\\n])*')
  | (?P<num>\.?\d(?:[eEpP][+-]|[\w.']|)*)
  | (?P<id>[A-Za-z_]\w*)
  | (?P<op>\.\.\.|->\*|::|->|\+\+|--|<<=|<<|<=|>=|==|!=|&&|\|\||\+=|-=|\*=|/=|%=|&=|\|=|\^=|\.\*|\#\#|[^\s\w])
    """,
    re.VERBOSE | re.DOTALL,
)


def tokenize(text: str) -> list[Tok]:
    line_starts = [0] + [m.end() for m in re.finditer("\n", text)]
    toks = []
    for m in _TOKEN_RE.finditer(text):
        kind = m.lastgroup
        if kind == "ws":
            continue
        if kind in ("sfx", "delim"):
            kind = "str" if m.group("str") is not None else "raw"
        line = bisect.bisect_right(line_starts, m.start())
        if m.group("str") is not None:
            toks.append(Tok("str", m.group("str"), m.start(), m.end(), line, m.group("sfx") or ""))
        elif m.group("raw") is not None:
            toks.append(Tok("str", m.group("raw"), m.start(), m.end(), line))
        else:
            toks.append(Tok(kind, m.group(kind), m.start(), m.end(), line))
    return toks


def str_value(tok: Tok) -> str | None:
    """Python value of a plain C++ string literal token (no prefix/suffix handling beyond ascii)."""
    if tok.kind != "str":
        return None
    v = tok.val
    m = re.match(r'(?:u8|u|U|L)?R"([^()\\\s]{0,16})\((.*)\)\1"$', v, re.DOTALL)
    if m:
        return m.group(2)
    m = re.match(r'(?:u8|u|U|L)?"(.*)"$', v, re.DOTALL)
    if not m:
        return None
    try:
        return ast.literal_eval('"' + m.group(1) + '"')
    except Exception:
        return m.group(1)


class Source:
    """One lexed C++ file with bracket matching and splitting helpers."""

    def __init__(self, path: str, text: str, pp: Preprocessor):
        self.path = path
        cleaned, spans = strip_comments(text)
        self.text, self.func_macros, self.unknown_macros, self.inactive = pp.run(path, cleaned, spans)
        self.toks = tokenize(self.text)
        self.match = self._match_brackets()

    def _match_brackets(self) -> dict[int, int]:
        pairs = {")": "(", "]": "[", "}": "{"}
        stack: list[int] = []
        match: dict[int, int] = {}
        for i, t in enumerate(self.toks):
            if t.kind != "op":
                continue
            if t.val in "([{" and len(t.val) == 1:
                stack.append(i)
            elif t.val in pairs and len(t.val) == 1:
                # tolerate mismatches by unwinding to the matching opener
                while stack and self.toks[stack[-1]].val != pairs[t.val]:
                    stack.pop()
                if stack:
                    j = stack.pop()
                    match[i] = j
                    match[j] = i
        return match

    def v(self, i: int) -> str:
        return self.toks[i].val if 0 <= i < len(self.toks) else ""

    def close(self, i: int) -> int:
        """Index of the bracket matching the opener at i (or len(toks) if unbalanced)."""
        return self.match.get(i, len(self.toks))

    def angle_close(self, i: int, hi: int | None = None) -> int | None:
        """Index of the '>' closing the '<' at i, or None when '<' is a less-than."""
        hi = len(self.toks) if hi is None else hi
        depth = 0
        j = i
        while j < hi:
            v = self.toks[j].val
            kind = self.toks[j].kind
            if kind == "op":
                if v in ("(", "["):
                    j = self.close(j) + 1
                    continue
                if v == "<":
                    depth += 1
                elif v == ">":
                    depth -= 1
                    if depth == 0:
                        return j
                elif v in (")", "]", "}", "{", ";", "&&", "||", "="):
                    return None
            j += 1
        return None

    def is_template_open(self, i: int, hi: int | None = None) -> int | None:
        if self.v(i) != "<" or i == 0:
            return None
        prev = self.toks[i - 1]
        if prev.kind == "id" and (prev.val not in CPP_KEYWORDS or prev.val in TEMPLATE_KEYWORDS):
            return self.angle_close(i, hi)
        return None

    def split(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Split tokens [lo, hi) at top-level commas (brackets and template args respected)."""
        if lo >= hi:
            return []
        parts = []
        start = lo
        j = lo
        while j < hi:
            v = self.toks[j].val
            if self.toks[j].kind == "op":
                if v in ("(", "[", "{"):
                    j = self.close(j) + 1
                    continue
                if v == "<":
                    k = self.is_template_open(j, hi)
                    if k is not None:
                        j = k + 1
                        continue
                if v == ",":
                    parts.append((start, j))
                    start = j + 1
            j += 1
        parts.append((start, hi))
        return [p for p in parts if p[0] < p[1]]

    def text_of(self, lo: int, hi: int) -> str:
        if lo >= hi:
            return ""
        return re.sub(r"\s+", " ", self.text[self.toks[lo].pos : self.toks[hi - 1].end]).strip()

    def where(self, i: int) -> str:
        return f"{self.path}:{self.toks[i].line if i < len(self.toks) else '?'}"

    def qualified_name(self, i: int, hi: int) -> tuple[list[str], int, tuple[int, int] | None]:
        """Parse ID(::ID)*[<...>] starting at i (optional leading ::). Returns parts, end, targs."""
        parts: list[str] = []
        targs = None
        j = i
        if self.v(j) == "::":
            j += 1
        while j < hi and self.toks[j].kind == "id":
            parts.append(self.toks[j].val)
            j += 1
            if j < hi and self.v(j) == "<":
                k = self.angle_close(j, hi)
                if k is not None:
                    targs = (j + 1, k)
                    j = k + 1
            if j < hi and self.v(j) == "::" and j + 1 < hi and self.toks[j + 1].kind == "id":
                j += 1
                continue
            break
        return parts, j, targs


def cpp_key(text: str) -> str:
    """Normalise a C++ type spelling to a lookup key: drop cv, namespaces starting lowercase."""
    t = re.sub(r"\b(const|typename|struct|class|volatile)\b", " ", text)
    t = re.sub(r"\s+", "", t).lstrip(":")
    parts = t.split("::")
    while len(parts) > 1 and parts[0][:1].islower():
        parts = parts[1:]
    return "::".join(parts)


def count_params(src: Source, lo: int, hi: int) -> int | None:
    """Number of parameters in a parameter list [lo, hi) (None for variadics)."""
    parts = src.split(lo, hi)
    if not parts:
        return 0
    if len(parts) == 1 and src.text_of(*parts[0]) == "void":
        return 0
    for a, b in parts:
        txt = src.text_of(a, b)
        if "..." in txt or re.search(r"\bpy(?:bind11)?::(?:args|kwargs)\b", txt):
            return None
    return len(parts)


# --------------------------------------------------------------------------------------------
# C++ declaration index (used only to count parameters of functions bound without names)
# --------------------------------------------------------------------------------------------
class CppIndex:
    def __init__(self):
        self.classes: dict[str, list[dict]] = {}  # key -> [{"bases": [...], "methods": {name: set}}]
        self.aliases: dict[str, str] = {}
        self.free_by_file: dict[str, dict[str, set]] = {}
        self.global_free: dict[str, set] = {}

    def add_source(self, src: Source, header: bool):
        toks = src.toks
        class_ranges: list[tuple[int, int]] = []
        free: dict[str, set] = {}
        n = len(toks)
        for i, t in enumerate(toks):
            if t.kind == "id" and t.val in ("class", "struct") and src.v(i - 1) not in NOT_A_CLASS_DECL:
                names = []
                j = i + 1
                while j < n and (toks[j].kind == "id" or toks[j].val == "::"):
                    if toks[j].kind == "id":
                        names.append(toks[j].val)
                    j += 1
                if not names or src.v(j) not in ("{", ":"):
                    continue
                name = names[-1] if names[-1] != "final" else (names[-2] if len(names) > 1 else None)
                if not name:
                    continue
                bases = []
                if src.v(j) == ":":
                    k = j + 1
                    while k < n and src.v(k) not in ("{", ";"):
                        if src.v(k) == "<":
                            kk = src.angle_close(k)
                            k = (kk if kk is not None else k) + 1
                            continue
                        k += 1
                    if src.v(k) != "{":
                        continue
                    for a, b in src.split(j + 1, k):
                        txt = re.sub(r"\b(public|protected|private|virtual)\b", " ", src.text_of(a, b))
                        bases.append(cpp_key(txt))
                    j = k
                body_end = src.close(j)
                class_ranges.append((j, body_end))
                methods: dict[str, set] = {}
                k = j + 1
                while k < body_end:
                    v = toks[k].val
                    if v in ("{", "(", "[") and toks[k].kind == "op":
                        if v == "(" and toks[k - 1].kind == "id" and toks[k - 1].val not in CPP_KEYWORDS:
                            prev = src.v(k - 2)
                            if prev not in (".", "->", "=", "::", ",", "(", "return") and not toks[k - 1].val.isupper():
                                cnt = count_params(src, k + 1, src.close(k))
                                methods.setdefault(toks[k - 1].val, set()).add(cnt)
                        k = src.close(k) + 1
                        continue
                    k += 1
                self.classes.setdefault(name, []).append({"bases": bases, "methods": methods})
            elif t.kind == "id" and t.val == "using" and toks[i + 1].kind == "id" and src.v(i + 2) == "=":
                k = i + 3
                while k < n and src.v(k) != ";":
                    k += 1
                target = cpp_key(src.text_of(i + 3, k))
                if target and target != toks[i + 1].val and re.match(r"^[\w:]+$", target):
                    self.aliases.setdefault(toks[i + 1].val, target.split("::")[-1])
        inside_class = bytearray(n)
        for a, b in class_ranges:
            inside_class[a + 1 : b] = b"\x01" * max(0, b - a - 1)

        for i, t in enumerate(toks):
            # auto NAME = [captures](params) ...
            if t.kind == "id" and src.v(i + 1) == "=" and src.v(i + 2) == "[" and src.v(i - 1) in ("auto", "const"):
                k = src.close(i + 2) + 1
                if src.v(k) == "<":
                    kk = src.angle_close(k)
                    k = (kk if kk is not None else k) + 1
                if src.v(k) == "(":
                    free.setdefault(t.val, set()).add(count_params(src, k + 1, src.close(k)))
                continue
            # RET NAME(params) quals { ... }   (or ';' in headers)
            if t.kind == "id" and src.v(i + 1) == "(" and t.val not in CPP_KEYWORDS and not t.val.isupper():
                prev = toks[i - 1] if i > 0 else None
                if prev is None or not (prev.kind == "id" and prev.val not in ("return", "else", "case", "new", "throw")
                                        or prev.val in ("*", "&", ">")):
                    continue
                if prev.val == "::" or src.v(i - 1) in (".", "->"):
                    continue
                close = src.close(i + 1)
                k = close + 1
                while k < n and (toks[k].val in ("const", "noexcept", "override", "final") or
                                 (toks[k].kind == "id" and toks[k].val.isupper())):
                    k += 1
                    if src.v(k) == "(" and src.v(k - 1) == "noexcept":
                        k = src.close(k) + 1
                if src.v(k) == "->":
                    while k < n and src.v(k) not in ("{", ";"):
                        k += 1
                end = src.v(k)
                if end == "{" or (header and end == ";"):
                    if inside_class[i]:
                        continue
                    free.setdefault(t.val, set()).add(count_params(src, i + 2, close))
        if header:
            for name, counts in free.items():
                self.global_free.setdefault(name, set()).update(counts)
        self.free_by_file[src.path] = free

    def _norm(self, key: str) -> str:
        """Classes are indexed by their simple name (nested or namespaced ones too)."""
        key = key.split("<")[0].split("::")[-1]
        return self.aliases.get(key, key)

    def is_class(self, key: str) -> bool:
        return self._norm(key) in self.classes

    def member_count(self, cls: str, meth: str) -> int | None:
        seen = set()
        queue = [cls]
        while queue:
            c = self._norm(queue.pop(0))
            if c in seen:
                continue
            seen.add(c)
            counts: set = set()
            for info in self.classes.get(c, []):
                counts |= info["methods"].get(meth, set())
            if counts:
                return next(iter(counts)) if len(counts) == 1 else None
            for info in self.classes.get(c, []):
                queue.extend(info["bases"])
        return None

    def free_count(self, path: str, name: str) -> int | None:
        for table in (self.free_by_file.get(path, {}), self.global_free):
            if name in table:
                counts = table[name]
                return next(iter(counts)) if len(counts) == 1 else None
        return None


# --------------------------------------------------------------------------------------------
# pybind11 binding extraction
# --------------------------------------------------------------------------------------------
class Api:
    def __init__(self):
        self.classes: dict[str, dict] = {}
        self.enums: dict[str, dict] = {}
        self.functions: dict[str, list] = {}
        self.constants: list[str] = []
        self.unparsed: list[dict] = []
        self.warnings: list[str] = []
        self.type_map: dict[str, str] = {}  # cpp key -> python dotted name
        self.pending_bases: list[tuple[str, list[str], str]] = []
        self.sources: set[str] = set()

    def cls(self, name: str) -> dict:
        return self.classes.setdefault(
            name, {"bases": [], "init": [], "methods": {}, "static_methods": {}, "properties": {}}
        )

    def enum(self, name: str) -> dict:
        return self.enums.setdefault(name, {"members": [], "arithmetic": False})

    def add_unparsed(self, where: str, text: str):
        text = re.sub(r"\s+", " ", text).strip()
        if len(text) > 240:
            text = text[:237] + "..."
        self.unparsed.append({"where": where, "text": text})


class Binder:
    """Walks the bodies of binding functions of one source file."""

    def __init__(self, src: Source, api: Api, index: CppIndex):
        self.src = src
        self.api = api
        self.index = index
        self.binding_funcs: list[str] = []
        self.called: set[str] = set()

    # ---- discovery -------------------------------------------------------------------------
    def run(self):
        src = self.src
        toks = src.toks
        for i, t in enumerate(toks):
            if t.val == "PYBIND11_MODULE" and src.v(i + 1) == "(":
                close = src.close(i + 1)
                parts = src.split(i + 2, close)
                if len(parts) >= 2 and src.v(close + 1) == "{":
                    var = src.text_of(*parts[1])
                    self.binding_funcs.append("PYBIND11_MODULE")
                    self.walk(close + 2, src.close(close + 1), {var: ("module", "")})
                continue
            if t.val == "(" and t.kind == "op" and i > 0 and (toks[i - 1].kind == "id" or src.v(i - 1) == "]"):
                close = src.close(i)
                k = close + 1
                while src.v(k) in ("const", "noexcept", "override"):
                    k += 1
                if src.v(k) != "{":
                    continue
                var = None
                for a, b in src.split(i + 1, close):
                    txt = src.text_of(a, b)
                    m = re.match(r"^(?:pybind11|py)::module_?\s*&\s*(\w+)$", txt)
                    if m:
                        var = m.group(1)
                if var:
                    self.binding_funcs.append(toks[i - 1].val)
                    self.walk(k + 1, src.close(k), {var: ("module", "")})

    def walk(self, lo: int, hi: int, scopes: dict[str, tuple[str, str]]):
        src = self.src
        toks = src.toks
        i = lo
        stmt_start = True
        while i < hi:
            t = toks[i]
            v = t.val
            if t.kind == "id" and v in ("py", "pybind11") and src.v(i + 1) == "::":
                what = src.v(i + 2)
                if what in ("class_", "enum_") and src.v(i + 3) == "<":
                    i = self.registration(i, hi, scopes)
                    stmt_start = True
                    continue
                if what in ("bind_vector", "bind_map") and src.v(i + 3) == "<":
                    i = self.bind_container(i, hi, scopes, "vector" if what == "bind_vector" else "map")
                    stmt_start = True
                    continue
            if t.kind == "id" and v in scopes and src.v(i + 1) == "." and src.v(i - 1) not in (".", "->", "::"):
                i = self.var_chain(i, hi, scopes)
                stmt_start = True
                continue
            if stmt_start and t.kind == "id" and src.v(i + 1) == "(":
                close = src.close(i + 1)
                if re.match(r"^[A-Z][A-Z0-9_]+$", v) and not HARMLESS_MACROS.match(v):
                    self.api.add_unparsed(src.where(i), src.text_of(i, close + 1))
                    i = close + 1
                    continue
                self.called.add(v)
            if t.kind == "op" and v == "{":
                prev = src.v(i - 1)
                descend = prev in (";", "{", "}", "else", "do", "try") or i == lo
                if prev == ")":
                    opener = src.match.get(i - 1)
                    descend = opener is not None and src.v(opener - 1) in ("if", "for", "while", "switch", "catch")
                if not descend:
                    i = src.close(i) + 1
                    stmt_start = src.v(i - 1) == "}" and src.v(i) != ";"
                    continue
            if t.kind == "op" and v in ("(", "["):
                i = src.close(i) + 1
                stmt_start = False
                continue
            stmt_start = v in (";", "{", "}")
            i += 1

    # ---- registrations -----------------------------------------------------------------------
    def resolve_scope(self, lo: int, hi: int, scopes) -> str | None:
        src = self.src
        txt = src.text_of(lo, hi)
        if txt in scopes:
            return scopes[txt][1]
        m = re.match(r"^(\w+)\.attr\(\s*\"(\w+)\"\s*\)$", txt)
        if m and m.group(1) in scopes:
            base = scopes[m.group(1)][1]
            return f"{base}.{m.group(2)}" if base else m.group(2)
        return None

    def registration(self, i: int, hi: int, scopes) -> int:
        src = self.src
        kind = src.v(i + 2)
        lt = i + 3
        gt = src.angle_close(lt, hi)
        if gt is None:
            self.api.add_unparsed(src.where(i), src.text_of(i, min(i + 12, hi)))
            return i + 3
        targs = [src.text_of(a, b) for a, b in src.split(lt + 1, gt)]
        k = gt + 1
        var = None
        if src.toks[k].kind == "id" and src.v(k + 1) in ("(", "{"):
            var = src.v(k)
            k += 1
        elif src.v(i - 1) == "=" and src.toks[i - 2].kind == "id":
            var = src.v(i - 2)
        if src.v(k) not in ("(", "{"):
            self.api.add_unparsed(src.where(i), src.text_of(i, min(k + 1, hi)))
            return k
        close = src.close(k)
        args = src.split(k + 1, close)
        if len(args) < 2:
            self.api.add_unparsed(src.where(i), src.text_of(i, close + 1))
            return close + 1
        scope = self.resolve_scope(*args[0], scopes)
        name = str_value(src.toks[args[1][0]]) if args[1][1] - args[1][0] == 1 else None
        if scope is None or name is None or src.toks[args[1][0]].suffix:
            self.api.add_unparsed(src.where(i), src.text_of(i, close + 1))
            return self.skip_statement(close + 1, hi)
        path = f"{scope}.{name}" if scope else name
        extras = [src.text_of(a, b) for a, b in args[2:]]
        self.api.sources.add(src.path)
        self.api.type_map.setdefault(cpp_key(targs[0]), path)
        if kind == "class_":
            entry = self.api.cls(path)
            self.api.pending_bases.append((path, [cpp_key(t) for t in targs[1:]], src.path))
            if any(re.match(r"^py::buffer_protocol", e) for e in extras):
                entry["buffer_protocol"] = True
            target = ("class", path)
        else:
            entry = self.api.enum(path)
            if any(re.match(r"^py::arithmetic\s*[({]", e) for e in extras):
                entry["arithmetic"] = True
            target = ("enum", path)
        if var:
            scopes[var] = target
        return self.chain(close + 1, hi, target)

    def bind_container(self, i: int, hi: int, scopes, container: str) -> int:
        src = self.src
        lt = i + 3
        gt = src.angle_close(lt, hi)
        if gt is None or src.v(gt + 1) != "(":
            self.api.add_unparsed(src.where(i), src.text_of(i, min(i + 12, hi)))
            return i + 3
        close = src.close(gt + 1)
        args = src.split(gt + 2, close)
        scope = self.resolve_scope(*args[0], scopes) if args else None
        name = str_value(src.toks[args[1][0]]) if len(args) > 1 and args[1][1] - args[1][0] == 1 else None
        if scope is None or name is None:
            self.api.add_unparsed(src.where(i), src.text_of(i, close + 1))
            return close + 1
        path = f"{scope}.{name}" if scope else name
        self.api.sources.add(src.path)
        entry = self.api.cls(path)
        entry["container"] = container
        self.api.type_map.setdefault(cpp_key(src.text_of(lt + 1, gt)), path)
        return self.chain(close + 1, hi, ("class", path))

    def var_chain(self, i: int, hi: int, scopes) -> int:
        target = scopes[self.src.v(i)]
        return self.chain(i + 1, hi, target)

    def skip_statement(self, k: int, hi: int) -> int:
        src = self.src
        while k < hi and src.v(k) != ";":
            if src.v(k) in ("(", "[", "{"):
                k = src.close(k) + 1
                continue
            k += 1
        return k + 1

    def chain(self, k: int, hi: int, target: tuple[str, str]) -> int:
        src = self.src
        while k < hi and src.v(k) == "." and src.toks[k + 1].kind == "id" and src.v(k + 2) == "(":
            name = src.v(k + 1)
            open_ = k + 2
            close = src.close(open_)
            args = src.split(open_ + 1, close)
            if name == "attr" and src.v(close + 1) == "=":
                end = self.skip_statement(close + 2, hi)
                self.attr_assign(k, args, target, src.text_of(close + 2, end - 1))
                return end
            self.chain_call(k, name, args, target)
            k = close + 1
        if k < hi and src.v(k) != ";":
            self.api.add_unparsed(src.where(k), "unexpected after binding chain: " + src.text_of(k, min(k + 8, hi)))
            return self.skip_statement(k, hi)
        return k + 1

    def attr_assign(self, k: int, args, target, value: str):
        src = self.src
        name = str_value(src.toks[args[0][0]]) if args and args[0][1] - args[0][0] == 1 else None
        if name is None:
            self.api.add_unparsed(src.where(k), "attr(" + src.text_of(*args[0]) + ") = " + value if args else value)
            return
        self.api.sources.add(src.path)
        kind, path = target
        if kind == "module" and not path:
            if name not in self.api.constants:
                self.api.constants.append(name)
        else:
            owner = self.api.cls(path) if kind == "class" else self.api.enum(path)
            owner.setdefault("attributes", {})[name] = {"source": "cpp", "kind": "attr"}

    # ---- individual .def/.value/... calls ----------------------------------------------------
    def chain_call(self, k: int, name: str, args, target):
        src = self.src
        api = self.api
        kind, path = target
        where = src.where(k)
        first = src.toks[args[0][0]] if args else None
        pyname = str_value(first) if first is not None and args[0][1] - args[0][0] == 1 and not first.suffix else None
        api.sources.add(src.path)

        if kind == "module":
            if name == "def" and pyname:
                api.functions.setdefault(pyname, []).append(self.overload(args, method=False))
            elif name == "add_object" and pyname:
                if pyname not in api.constants:
                    api.constants.append(pyname)
            else:
                api.add_unparsed(where, f"{name}(" + src.text_of(args[0][0], args[-1][1]) + ")" if args else name)
            return

        owner = api.cls(path) if kind == "class" else api.enum(path)
        if name == "value" and kind == "enum":
            if pyname is None:
                api.add_unparsed(where, "value(" + src.text_of(*args[0]) + ")")
            elif pyname not in owner["members"]:
                owner["members"].append(pyname)
            return
        if name == "export_values" and kind == "enum":
            owner["export_values"] = True
            return
        if name in ("def", "def_static"):
            if pyname is not None:
                bucket = "static_methods" if name == "def_static" else "methods"
                owner.setdefault(bucket, {}).setdefault(pyname, []).append(
                    self.overload(args, method=(name == "def"))
                )
                return
            if name == "def" and args and src.text_of(*args[0]).startswith(("py::init", "pybind11::init")):
                owner.setdefault("init", []).append(self.overload(args, method=False, init=True))
                return
            api.add_unparsed(where, f"{name}(" + src.text_of(args[0][0], args[-1][1]) + ")" if args else name)
            return
        m = re.match(r"^def_(property_readonly|property|readwrite|readonly)(_static)?$", name)
        if m and pyname is not None:
            what, static = m.group(1), bool(m.group(2))
            if what in ("property_readonly", "readonly"):
                mode = "ro"
            elif what == "readwrite":
                mode = "rw"
            else:
                getter = src.text_of(*args[1]) if len(args) > 1 else "nullptr"
                setter = src.text_of(*args[2]) if len(args) > 2 else "nullptr"
                if setter == "nullptr":
                    mode = "ro" if getter != "nullptr" else "none"
                else:
                    mode = "rw" if getter != "nullptr" else "wo"
            bucket = "static_properties" if static else "properties"
            props = owner.setdefault(bucket, {})
            old = props.get(pyname)
            if old and old != mode:
                mode = "rw" if {old, mode} >= {"ro", "wo"} or "rw" in (old, mode) else mode
            props[pyname] = mode
            accessor_args = args[1:3] if what == "property" else args[1:2]
            if any(self.callable_info(a, b)["deprecated"] for a, b in accessor_args):
                dep = owner.setdefault("deprecated_properties", [])
                if pyname not in dep:
                    dep.append(pyname)
            return
        if name == "def_buffer":
            owner["buffer_protocol"] = True
            return
        api.add_unparsed(where, f".{name}(" + (src.text_of(args[0][0], args[-1][1]) if args else "") + ")")

    def named_arg(self, a: int, b: int):
        """Parse a pybind11 argument annotation; returns dict, 'kw_only'/'pos_only' or None."""
        src = self.src
        t = src.toks[a]
        default = None
        if t.kind == "str" and t.suffix == "_a":
            name = str_value(t)
            j = a + 1
        elif src.text_of(a, min(a + 3, b)) in ("py::arg", "pybind11::arg") and src.v(a + 3) == "(":
            close = src.close(a + 3)
            inner = src.split(a + 4, close)
            name = str_value(src.toks[inner[0][0]]) if inner else None
            j = close + 1
            while j < b and src.v(j) == "." and src.v(j + 2) == "(":
                j = src.close(j + 2) + 1
        elif src.text_of(a, min(a + 3, b)) in ("py::arg_v", "pybind11::arg_v") and src.v(a + 3) == "(":
            close = src.close(a + 3)
            inner = src.split(a + 4, close)
            name = str_value(src.toks[inner[0][0]]) if inner else None
            return {"name": name, "default": src.text_of(*inner[1]) if len(inner) > 1 else None}
        else:
            txt = src.text_of(a, b)
            if re.match(r"^(py|pybind11)::kw_only\s*[({]", txt):
                return "kw_only"
            if re.match(r"^(py|pybind11)::pos_only\s*[({]", txt):
                return "pos_only"
            return None
        if j < b and src.v(j) == "=":
            default = src.text_of(j + 1, b)
        return {"name": name, "default": default}

    def overload(self, args, method: bool, init: bool = False) -> dict:
        src = self.src
        callable_span = args[0] if init else (args[1] if len(args) > 1 else None)
        named = []
        markers = {}
        for a, b in args[1:]:
            res = self.named_arg(a, b)
            if res == "kw_only":
                markers["kw_only_from"] = len(named)
            elif res == "pos_only":
                markers["pos_only_until"] = len(named)
            elif isinstance(res, dict):
                named.append(res)
        info = self.callable_info(*callable_span) if callable_span else {"params": None, "member": False,
                                                                         "deprecated": False}
        params = info["params"]
        if params is not None and method and not info["member"]:
            params = params - 1 if params >= 1 else None
        ov: dict = {"args": named, "named": bool(named)}
        ov["nargs"] = len(named) if named else params
        if named and params is not None and params != len(named):
            self.api.warnings.append(
                f"{src.where(callable_span[0])}: {len(named)} argument names but C++ callable has {params} "
                f"parameters: {src.text_of(*callable_span)[:80]}"
            )
        if info["deprecated"]:
            ov["deprecated"] = True
        ov.update(markers)
        return ov

    def callable_info(self, lo: int, hi: int) -> dict:
        """Parameter count of a bound C++ callable expression (member pointer, lambda, ...)."""
        src = self.src
        res = {"params": None, "member": False, "deprecated": False}
        if lo >= hi:
            return res
        txt = src.text_of(lo, hi)
        if txt == "nullptr":
            return res
        # py::init<...>() / py::init(factory)
        if src.v(lo) in ("py", "pybind11") and src.v(lo + 1) == "::" and src.v(lo + 2) in ("init", "init_alias"):
            j = lo + 3
            if src.v(j) == "<":
                gt = src.angle_close(j, hi)
                if gt is not None:
                    res["params"] = len(src.split(j + 1, gt))
                return res
            if src.v(j) == "(":
                inner = src.split(j + 1, src.close(j))
                if inner:
                    sub = self.callable_info(*inner[0])
                    res["params"] = sub["params"]
                    res["deprecated"] = sub["deprecated"]
                return res
            return res
        # lambda
        if src.v(lo) == "[":
            k = src.close(lo) + 1
            if src.v(k) == "<":
                gt = src.angle_close(k, hi)
                k = (gt if gt is not None else k) + 1
            if src.v(k) == "(":
                res["params"] = count_params(src, k + 1, src.close(k))
            else:
                res["params"] = 0
            return res
        amp = src.v(lo) == "&"
        start = lo + 1 if amp else lo
        parts, end, targs = src.qualified_name(start, hi)
        if not parts:
            return res
        last = parts[-1]
        # wrappers: utils::deprecate*(f, msg), py::cpp_function(f, extras...)
        if src.v(end) == "(" and not amp:
            close = src.close(end)
            inner = src.split(end + 1, close)
            if last in DEPRECATING_WRAPPERS | TRANSPARENT_WRAPPERS and inner:
                sub = self.callable_info(*inner[0])
                sub["deprecated"] = sub["deprecated"] or last in DEPRECATING_WRAPPERS
                return sub
            if last == "overload_cast" and targs is not None and inner:
                sub = self.callable_info(*inner[0])
                sub["params"] = count_params(src, targs[0], targs[1])
                return sub
            if last in ("static_cast", "reinterpret_cast") and targs is not None and inner:
                sub = self.callable_info(*inner[0])
                sub["params"] = self.fnptr_params(targs[0], targs[1])
                return sub
            return res
        if end != hi:
            return res
        qual = "::".join(parts[:-1])
        if amp and qual and self.index.is_class(cpp_key(qual)):
            res["member"] = True
            res["params"] = self.index.member_count(cpp_key(qual), last)
        else:
            res["params"] = self.index.free_count(src.path, last)
        return res

    def fnptr_params(self, lo: int, hi: int) -> int | None:
        """Parameter count of a function pointer type such as R (C::*)(A, B) const noexcept."""
        src = self.src
        j = lo
        while j < hi:
            if src.v(j) == "(":
                close = src.close(j)
                inner = src.text_of(j + 1, close)
                if inner.endswith("*") and src.v(close + 1) == "(":
                    return count_params(src, close + 2, src.close(close + 1))
                j = close + 1
                continue
            j += 1
        return None


# --------------------------------------------------------------------------------------------
# Python package additions (tensorrt/__init__.py)
# --------------------------------------------------------------------------------------------
def python_additions(text: str, api: Api, version: str, header_version: str, path: str) -> dict:
    values = {
        "TENSORRT_MODULE": "tensorrt",
        "TENSORRT_NVINFER_NAME": "nvinfer",
        "TENSORRT_ONNXPARSER_NAME": "nvonnxparser",
        "TENSORRT_MAJOR": version.split(".")[0],
        "TENSORRT_MINOR": (version.split(".") + ["0"])[1],
        "TENSORRT_PYTHON_VERSION": header_version or version,
        "TENSORRT_PLUGIN_DISABLED": "False",
    }
    unknown_placeholders = set()

    def subst(m):
        key = m.group(1)
        if key not in values:
            unknown_placeholders.add(key)
            return f"__TEMPLATE_{key}__"
        return values[key]

    code = re.sub(r"##(\w+)##", subst, text)
    result: dict = {"file": path, "functions": [], "constants": [], "attributes": [], "conditional": []}
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        api.add_unparsed(f"{path}:{e.lineno}", f"python syntax error after template substitution: {e.msg}")
        return result

    def cond_value(test):
        try:
            return bool(eval(compile(ast.Expression(test), path, "eval"), {"__builtins__": {}}, {}))  # noqa: S307
        except Exception:
            return None

    funcs: dict[str, ast.AST] = {}

    def conditional(name: str, kind: str, conds: list[str]):
        result["conditional"].append({"name": name, "kind": kind, "condition": " and ".join(conds)})

    def sig_of(fn, drop_self: bool) -> dict:
        a = fn.args
        pos = list(a.posonlyargs) + list(a.args)
        defaults = [None] * (len(pos) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
        args = [{"name": p.arg, "default": d} for p, d in zip(pos, defaults)]
        args += [
            {"name": p.arg, "default": (ast.unparse(d) if d is not None else None)}
            for p, d in zip(a.kwonlyargs, a.kw_defaults)
        ]
        if drop_self and args:
            args = args[1:]
        ov = {"args": args, "named": True, "nargs": len(args), "source": "python"}
        if a.vararg or a.kwarg:
            ov["nargs"] = None
        return ov

    def owner_of(name: str):
        if name in api.classes:
            return api.classes[name], "class"
        if name in api.enums:
            return api.enums[name], "enum"
        return None, None

    def visit(body, conds: list[str]):
        for node in body:
            if isinstance(node, ast.If):
                val = cond_value(node.test)
                text_c = ast.unparse(node.test)
                if val is True:
                    visit(node.body, conds)
                elif val is False:
                    visit(node.orelse, conds)
                else:
                    visit(node.body, conds + [text_c])
                    visit(node.orelse, conds + [f"not ({text_c})"])
                continue
            if isinstance(node, ast.Try):
                for part in (node.body, node.orelse, node.finalbody):
                    visit(part, conds)
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs[node.name] = node
                if node.name.startswith("_"):
                    continue
                if conds:
                    conditional(node.name, "function", conds)
                    continue
                result["functions"].append(node.name)
                api.functions.setdefault(node.name, []).append(sig_of(node, False))
                continue
            if isinstance(node, ast.ClassDef):
                if not node.name.startswith("_"):
                    if conds:
                        conditional(node.name, "class", conds)
                    else:
                        api.cls(node.name)["source"] = "python"
                continue
            if isinstance(node, ast.Assign):
                for tgt in node.targets:
                    if isinstance(tgt, ast.Name):
                        n = tgt.id
                        if n.startswith("_") and not (n.startswith("__") and n.endswith("__")):
                            continue
                        if conds:
                            conditional(n, "constant", conds)
                            continue
                        result["constants"].append(n)
                        if n not in api.constants:
                            api.constants.append(n)
                    elif isinstance(tgt, ast.Attribute) and isinstance(tgt.value, ast.Name):
                        add_attr(tgt.value.id, tgt.attr, node.value, conds, node.lineno)
                continue
            if isinstance(node, ast.For):
                if conds:
                    continue  # e.g. the Windows-only DLL loading loop
                # for attr, value in E.__members__.items(): setattr(C, attr, value)
                it = node.iter
                ok = False
                if (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items"
                        and isinstance(it.func.value, ast.Attribute) and it.func.value.attr == "__members__"):
                    enum_name = ast.unparse(it.func.value.value)
                    for stmt in node.body:
                        if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                                and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "setattr"):
                            cls_name = ast.unparse(stmt.value.args[0])
                            owner, _ = owner_of(cls_name)
                            members = api.enums.get(enum_name, {}).get("members")
                            if owner is not None and members is not None and not conds:
                                for mem in members:
                                    owner.setdefault("attributes", {})[mem] = {
                                        "source": "python", "kind": "enum_value", "of": enum_name}
                                    result["attributes"].append(f"{cls_name}.{mem}")
                                ok = True
                if not ok:
                    api.add_unparsed(f"{path}:{node.lineno}", "python loop: " + ast.unparse(node).splitlines()[0])
                continue
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # docstring
            if isinstance(node, (ast.Import, ast.ImportFrom, ast.Delete, ast.Pass, ast.Expr)):
                continue
            api.add_unparsed(f"{path}:{node.lineno}", "python statement: " + ast.unparse(node).splitlines()[0])

    def add_attr(owner_name, attr, value, conds, lineno):
        owner, kind = owner_of(owner_name)
        if owner is None:
            api.add_unparsed(f"{path}:{lineno}", f"python attribute on unknown object: {owner_name}.{attr}")
            return
        if conds:
            conditional(f"{owner_name}.{attr}", "attribute", conds)
            return
        result["attributes"].append(f"{owner_name}.{attr}")
        vtext = ast.unparse(value)
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "property":
            owner.setdefault("properties", {})[attr] = "rw" if len(value.args) > 1 else "ro"
            owner.setdefault("attributes", {})[attr] = {"source": "python", "kind": "property"}
            return
        fn = None
        if isinstance(value, ast.Name) and value.id in funcs:
            fn = funcs[value.id]
        elif isinstance(value, ast.Lambda):
            fn = value
        if fn is not None:
            owner.setdefault("methods", {})[attr] = [sig_of(fn, True)]
            owner.setdefault("attributes", {})[attr] = {"source": "python", "kind": "method"}
            return
        if isinstance(value, ast.Attribute) and vtext in api.enums:
            alias = f"{owner_name}.{attr}"
            src_enum = api.enums[vtext]
            api.enums[alias] = {
                "alias_of": vtext,
                "members": list(src_enum["members"]),
                "arithmetic": src_enum.get("arithmetic", False),
                "source": "python",
            }
            owner.setdefault("attributes", {})[attr] = {"source": "python", "kind": "alias", "of": vtext}
            return
        owner.setdefault("attributes", {})[attr] = {"source": "python", "kind": "value"}

    visit(tree.body, [])
    if unknown_placeholders:
        result["unknown_placeholders"] = sorted(unknown_placeholders)
    return result


# --------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------
def header_version_of(git: Git, tag: str) -> str:
    try:
        text = git.show(tag, "include/NvInferVersion.h")
    except subprocess.CalledProcessError:
        return ""
    vals = {}
    for key in ("MAJOR", "MINOR", "PATCH", "BUILD"):
        m = re.search(rf"#define\s+TRT_{key}_ENTERPRISE\s+(\d+)", text) or re.search(
            rf"#define\s+NV_TENSORRT_{key}\s+(\d+)", text
        )
        vals[key] = m.group(1) if m else None
    if not all(vals.values()):
        return ""
    return ".".join(vals[k] for k in ("MAJOR", "MINOR", "PATCH", "BUILD"))


def extract(git: Git, tag: str) -> tuple[dict, list[str]]:
    version = tag[1:] if tag.startswith("v") else tag
    commit = git.commit(tag)
    pp = Preprocessor(DEFAULT_DEFINES)
    all_files = git.files(tag, "python", "include")
    binding_files = sorted(f for f in all_files if f.startswith("python/src/") and f.endswith(".cpp"))
    header_files = sorted(
        f for f in all_files
        if f.endswith((".h", ".hpp")) and (f.startswith("include/") or f.startswith("python/include/"))
    )
    index = CppIndex()
    sources: dict[str, Source] = {}
    unknown: set[str] = set()
    inactive: list[dict] = []
    for f in header_files:
        src = Source(f, git.show(tag, f), pp)
        index.add_source(src, header=True)
    for f in binding_files:
        src = Source(f, git.show(tag, f), pp)
        sources[f] = src
        index.add_source(src, header=False)
        unknown |= src.unknown_macros
        inactive.extend(src.inactive)

    api = Api()
    binders = []
    for f, src in sources.items():
        b = Binder(src, api, index)
        b.run()
        binders.append(b)

    # Binding functions that are never called from PYBIND11_MODULE (or another binder).
    defined = {fn for b in binders for fn in b.binding_funcs if fn != "PYBIND11_MODULE"}
    called = {c for b in binders for c in b.called}
    notes = []
    for fn in sorted(defined - called):
        notes.append(f"binding function {fn}() is defined but not called from the module")

    # Resolve Python-visible bases now that every registration is known.
    for path, extra, _file in api.pending_bases:
        bases = []
        for key in extra:
            base = api.type_map.get(key) or api.type_map.get(key.split("::")[-1])
            if base and base != path and base in api.classes and base not in bases:
                bases.append(base)
        api.classes[path]["bases"] = bases

    # export_values(): members become attributes of the enclosing scope.
    for name, e in api.enums.items():
        if e.get("export_values"):
            scope = name.rpartition(".")[0]
            for mem in e["members"]:
                if scope:
                    owner = api.classes.get(scope) or api.enums.get(scope)
                    if owner is not None:
                        owner.setdefault("attributes", {})[mem] = {"source": "export_values", "kind": "enum_value",
                                                                   "of": name}
                elif mem not in api.constants:
                    api.constants.append(mem)

    header_version = header_version_of(git, tag)
    python_info: dict = {}
    if PY_INIT in all_files:
        python_info = python_additions(git.show(tag, PY_INIT), api, version, header_version, PY_INIT)
    else:
        notes.append(f"{PY_INIT} not found; no Python-level additions recorded")

    for c in api.classes.values():
        for key in ("deprecated_properties",):
            if key in c:
                c[key] = sorted(c[key])
    out = {
        "tensorrt_version": version,
        "tag": tag,
        "commit": commit,
        "header_version": header_version,
        "generated_by": GENERATED_BY,
        "sources": sorted(api.sources) + ([PY_INIT] if python_info else []),
        "classes": api.classes,
        "enums": api.enums,
        "functions": api.functions,
        "constants": sorted(api.constants),
        "python": python_info,
        "preprocessor": {
            "defines": {k: v for k, v in DEFAULT_DEFINES.items()},
            "assumed_undefined": sorted(unknown),
            "inactive": inactive,
        },
        "unparsed": api.unparsed,
    }
    if notes:
        out["notes"] = notes
    return out, api.warnings


def dumps(obj, depth: int = 0, expand_to: int = 4) -> str:
    """JSON with sorted keys: dicts are expanded down to `expand_to` levels, deeper values inline."""
    if isinstance(obj, dict) and depth < expand_to and obj:
        pad = " " * (depth + 1)
        items = [f"{pad}{json.dumps(k)}: {dumps(obj[k], depth + 1, expand_to)}" for k in sorted(obj)]
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    if isinstance(obj, list) and depth < expand_to and obj and all(isinstance(x, dict) for x in obj) and depth <= 1:
        pad = " " * (depth + 1)
        return "[\n" + ",\n".join(pad + dumps(x, expand_to, expand_to) for x in obj) + "\n" + " " * depth + "]"
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


# --------------------------------------------------------------------------------------------
# summary / diff
# --------------------------------------------------------------------------------------------
def counts(api: dict) -> dict:
    classes = api["classes"]
    return {
        "classes": len(classes),
        "methods": sum(len(c.get("methods", {})) for c in classes.values()),
        "static_methods": sum(len(c.get("static_methods", {})) for c in classes.values()),
        "overloads": sum(len(o) for c in classes.values() for o in c.get("methods", {}).values()),
        "properties": sum(len(c.get("properties", {})) for c in classes.values()),
        "enums": len(api["enums"]),
        "enum_members": sum(len(e["members"]) for e in api["enums"].values()),
        "functions": len(api["functions"]),
        "constants": len(api["constants"]),
        "unparsed": len(api["unparsed"]),
    }


def sig(ovs: list) -> list[str]:
    out = []
    for o in ovs:
        if o["named"]:
            args = (a["name"] + ("=" + a["default"] if a["default"] else "") for a in o["args"])
            out.append("(" + ", ".join(args) + ")")
        else:
            out.append(f"(<{o['nargs'] if o['nargs'] is not None else '?'} positional>)")
    return out


def _diff_names(lines: list[str], a, b, removed, added, changed=None) -> None:
    """Append a line per name only in `a` (removed(name)), only in `b` (added(name)), and, with `changed`,
    per name in both whose entries differ (changed(name) gives the line, or None when they are alike)."""
    lines += [removed(n) for n in sorted(set(a) - set(b), key=str)]
    lines += [added(n) for n in sorted(set(b) - set(a), key=str)]
    if changed is not None:
        lines += [x for x in (changed(n) for n in sorted(set(a) & set(b), key=str)) if x]


def diff(old: dict, new: dict) -> list[str]:
    lines: list[str] = []
    a, b = old["classes"], new["classes"]
    _diff_names(lines, a, b, lambda n: f"- class {n}", lambda n: f"+ class {n}")
    for n in sorted(set(a) & set(b)):
        ca, cb = a[n], b[n]
        if ca.get("bases") != cb.get("bases"):
            lines.append(f"~ {n} bases {ca.get('bases')} -> {cb.get('bases')}")
        if sig(ca.get("init", [])) != sig(cb.get("init", [])):
            lines.append(f"~ {n}.__init__ {sig(ca.get('init', []))} -> {sig(cb.get('init', []))}")
        for bucket in ("methods", "static_methods"):
            ma, mb = ca.get(bucket, {}), cb.get(bucket, {})
            static = "" if bucket == "methods" else " (static)"
            _diff_names(lines, ma, mb, lambda m: f"- {n}.{m}{static}", lambda m: f"+ {n}.{m}{static} {sig(mb[m])}",
                        lambda m: f"~ {n}.{m} {sig(ma[m])} -> {sig(mb[m])}" if sig(ma[m]) != sig(mb[m]) else None)
        for bucket in ("properties", "static_properties"):
            pa, pb = ca.get(bucket, {}), cb.get(bucket, {})
            _diff_names(lines, pa, pb, lambda p: f"- {n}.{p} (property {pa[p]})", lambda p: f"+ {n}.{p} (property {pb[p]})",
                        lambda p: f"~ {n}.{p} property {pa[p]} -> {pb[p]}" if pa[p] != pb[p] else None)
    ea, eb = old["enums"], new["enums"]
    _diff_names(lines, ea, eb, lambda n: f"- enum {n}", lambda n: f"+ enum {n} {eb[n]['members']}")
    for n in sorted(set(ea) & set(eb)):
        ma, mb = ea[n]["members"], eb[n]["members"]
        lines += [f"- {n}.{m}" for m in ma if m not in mb] + [f"+ {n}.{m}" for m in mb if m not in ma]
    fa, fb = old["functions"], new["functions"]
    _diff_names(lines, fa, fb, lambda n: f"- function {n}", lambda n: f"+ function {n} {sig(fb[n])}",
                lambda n: f"~ function {n} {sig(fa[n])} -> {sig(fb[n])}" if sig(fa[n]) != sig(fb[n]) else None)
    _diff_names(lines, old["constants"], new["constants"], lambda n: f"- constant {n}", lambda n: f"+ constant {n}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=DEFAULT_REPO, help="NVIDIA/TensorRT git repository (bare is fine)")
    ap.add_argument("--tag", action="append", help=f"release tag, repeatable (default: {' '.join(DEFAULT_TAGS)})")
    ap.add_argument(
        "--out", default=str(Path(__file__).resolve().parent.parent / "tests" / "runtime" / "trt_api"),
        help="output directory (default: tests/runtime/trt_api next to this script's repo)",
    )
    ap.add_argument("--summary", action="store_true", help="print counts and the diff between consecutive tags")
    args = ap.parse_args(argv)
    tags = args.tag or DEFAULT_TAGS
    git = Git(args.repo)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for tag in tags:
        api, warnings = extract(git, tag)
        path = out_dir / f"tensorrt-{api['tensorrt_version']}.json"
        path.write_text(dumps(api) + "\n", encoding="utf-8")
        results.append(api)
        print(f"wrote {path} ({api['commit'][:12]})", file=sys.stderr)
        for w in warnings:
            print(f"  warning: {w}", file=sys.stderr)
        for u in api["unparsed"]:
            print(f"  unparsed: {u['where']}: {u['text']}", file=sys.stderr)
    if args.summary:
        for api in results:
            c = counts(api)
            print(f"{api['tag']} ({api['header_version']}): " + ", ".join(f"{k}={v}" for k, v in c.items()))
        for old, new in zip(results, results[1:]):
            print(f"\n=== {old['tag']} -> {new['tag']}")
            for line in diff(old, new):
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
