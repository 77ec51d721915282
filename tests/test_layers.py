"""The layer contract of docs/design.md, over the AST of every module (function-local imports included).

Layers, bottom to top: core (kvforge/*.py) -> model_defs -> export -> calibration -> runtime -> serving ->
verify -> cli. A module may import its own layer and those below, and no import cycle exists between
modules (imports under `if TYPE_CHECKING:` are annotations, not imports). KNOWN_UPWARD and KNOWN_CYCLES are
empty; should one ever have to be tolerated for a while, it is listed there, and the test fails again once
it is gone (so the lists only shrink).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kvforge": "kvforge", "model_defs": "kvforge.model_defs", "export": "kvforge.export",
            "calibration": "kvforge.calibration", "runtime": "kvforge.runtime", "serving": "kvforge.serving",
            "verify": "kvforge.verify"}
ORDER = ["core", "model_defs", "export", "calibration", "runtime", "serving", "verify", "cli"]

KNOWN_UPWARD: set[tuple[str, str]] = set()
KNOWN_CYCLES: set[frozenset] = set()


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ORDER:
        return parts[1]
    return "cli" if module in ("kvforge.cli", "kvforge.__main__") else "core"


def _runtime_nodes(tree):
    """Every node, less the bodies of `if TYPE_CHECKING:` (annotations only: nothing is imported at run time)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the kvforge modules it imports anywhere in its source."""
    edges = defaultdict(set)
    for module, path in mods.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                while target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in mods and target != module and target.startswith("kvforge"):
                    edges[module].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> set[frozenset]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.add(frozenset(group))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_new_upward_import_and_the_known_ones_are_still_listed():
    mods = modules()
    assert len(mods) > 60 and "kvforge.runtime.session" in mods and "kvforge.bundle" in mods
    edges = imports(mods)
    upward = {(a, b) for a, targets in edges.items() for b in targets if ORDER.index(layer(b)) > ORDER.index(layer(a))}
    assert upward - KNOWN_UPWARD == set(), "imports from a higher layer (docs/design.md, Layers)"
    assert KNOWN_UPWARD - upward == set(), "fixed: remove them from KNOWN_UPWARD"


def test_no_new_import_cycle():
    found = cycles(imports(modules()))
    assert found - KNOWN_CYCLES == set(), "a new import cycle"
    assert KNOWN_CYCLES - found == set(), "a cycle is gone or changed: update KNOWN_CYCLES"


def test_the_core_imports_nothing_above_it():
    """The core modules stay free of every stage (what calibration and verify share lives here)."""
    edges = imports(modules())
    for module in ("kvforge.schema", "kvforge.manifest", "kvforge.cache", "kvforge.bundle", "kvforge.errors",
                   "kvforge.checks", "kvforge.ort_session", "kvforge.metrics", "kvforge.attribution"):
        assert {layer(t) for t in edges.get(module, ())} <= {"core"}, module


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The contract can fail: a core module importing the runtime is caught, function-local or not."""
    fake = {"kvforge.fake": tmp_path / "fake.py", "kvforge.runtime.session": ROOT / "runtime" / "session.py"}
    fake["kvforge.fake"].write_text("def f():\n    from kvforge.runtime.session import Session\n    return Session\n")
    edges = imports(fake)
    assert edges["kvforge.fake"] == {"kvforge.runtime.session"} and layer("kvforge.fake") == "core"
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == {frozenset({"a", "b"})}
    hidden = tmp_path / "hidden.py"
    hidden.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvforge.runtime.session import Session\n")
    assert imports({"kvforge.hidden": hidden, "kvforge.runtime.session": ROOT / "runtime" / "session.py"}) == {}



def private_imports(path: Path) -> list[str]:
    """`from <a kvforge module> import _name`: a private name taken from another module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("kvforge")):
            found += [f"{path}:{node.lineno}: {node.module or '.'} {a.name}"
                      for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_a_private_name():
    """What two modules share is public in the one that owns it (or moved down to where both can import it);
    the tests use public names too."""
    paths = list(modules().values()) + sorted((ROOT / "tests").rglob("*.py"))
    offenders = [hit for path in paths for hit in private_imports(path)]
    assert offenders == []


def test_the_private_import_check_can_fail(tmp_path):
    probe = tmp_path / "m.py"
    probe.write_text("from kvforge.export.lint import _helper, public\nfrom .sibling import _x, __version__\nfrom os import _exit\n")
    assert [h.rsplit(" ", 1)[-1] for h in private_imports(probe)] == ["_helper", "_x"]
