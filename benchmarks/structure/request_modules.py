"""The calibrate request's module count (issue 52): how many of the repository's modules and functions one
`kvforge calibrate BUNDLE -o OUT --precision int8` passes through, from the CLI to the written bundle.

For each measured checkout, a child process (1) exports the built-in `tiny` preset once (`kvforge export tiny`,
not counted), then (2) runs the CLI's main function in-process with argv `calibrate BUNDLE -o OUT --precision int8
--samples 1 --seq-len 16` (the smallest calibration data; the default automatic recipe) under sys.setprofile and
threading.setprofile. Every Python function entered whose code file lies in the measured repository (not tests/ or
benchmarks/) is recorded; module bodies run by imports during the request, and the code objects of comprehensions
and generator expressions, are not counted. A call's caller is the nearest repository frame up the stack (so a
model's forward, reached through torch's Module.__call__, counts as called by the module that called the model).

Reported: distinct modules (files) and functions, functions per module, cross-module call edges (distinct ordered
pairs caller module != callee module) and "back and forth" pairs (module pairs with calls both ways).

The package is imported from the measured checkout, never from the editable install: pyproject.toml maps
kvforge.export to export/ and so on, and the editable install's finder (on sys.meta_path) would otherwise answer for
those stage packages even with the other checkout first on PYTHONPATH. The child puts a finder built from the measured
checkout's own pyproject.toml first on sys.meta_path, and fails if any kvforge module's file lies elsewhere.

Run from the repository root:
    python3 -m benchmarks.structure.request_modules                        # this checkout
    python3 benchmarks/structure/request_modules.py --repo PATH           # another checkout
    python3 benchmarks/structure/request_modules.py --compare /tmp/kvforge-before   # this one ("after") and PATH ("before")
Writes benchmarks/results/request_modules.json: one key per measured revision (its short hash), each with its
label ("after" for --repo's checkout with --compare, "before" for --compare's, "measured" alone)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections import Counter, defaultdict
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # moved with benchmarks/
RESULT = ROOT / "benchmarks" / "results" / "request_modules.json"
CALIBRATE = ["--precision", "int8", "--samples", "1", "--seq-len", "16"]
NOT_FUNCTIONS = {"<module>", "<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"}


def package_dirs(repo: Path) -> dict[str, Path]:
    """kvforge's packages -> their folders in `repo`, from its pyproject.toml's package-dir table."""
    table = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {pkg: (repo / folder).resolve() for pkg, folder in table.items()}


class RepoFinder:
    """Answers for kvforge's mapped packages from one checkout, ahead of every other finder."""

    def __init__(self, dirs: dict[str, Path]):
        self.dirs = dirs

    def find_spec(self, fullname, path=None, target=None):
        folder = self.dirs.get(fullname)
        if folder is None:
            return None  # submodules: found on the parent package's __path__, which is this checkout's
        return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def check_origin(repo: Path) -> dict[str, str]:
    """Every loaded kvforge module must come from `repo`; {kvforge package: its __init__ file}."""
    wrong = [f"{n}: {m.__file__}" for n, m in list(sys.modules.items()) if n.split(".")[0] == "kvforge"
             and getattr(m, "__file__", None) and not Path(m.__file__).resolve().is_relative_to(repo)]
    if wrong:
        raise SystemExit(f"kvforge modules imported from outside {repo}:\n" + "\n".join(wrong[:20]))
    return {n: sys.modules[n].__file__ for n in sorted(sys.modules) if n in package_dirs(repo)}


def child(stage: str, repo: Path, bundle: Path, out_json: Path | None) -> None:
    dirs = package_dirs(repo)
    sys.meta_path.insert(0, RepoFinder(dirs))
    from kvforge.cli import main

    print(f"kvforge from {sys.modules['kvforge'].__file__}", flush=True)
    if stage == "export":
        main(["export", "tiny", "-o", str(bundle), "--quiet"], standalone_mode=False)
        check_origin(repo)
        return
    # the measured file -> its module name (None: not the repository's, or tests/benchmarks)
    names: dict[str, str | None] = {}

    def module_of(filename: str) -> str | None:
        p = Path(filename).resolve()
        if not p.is_relative_to(repo) or p.relative_to(repo).parts[0] in ("tests", "benchmarks"):
            return None
        pkg, folder = max(((k, d) for k, d in dirs.items() if p.is_relative_to(d)), key=lambda kd: len(kd[1].parts),
                          default=(None, repo))
        parts = [pkg] * (pkg is not None) + list(p.relative_to(folder).with_suffix("").parts)
        return ".".join(x for x in parts if x != "__init__")

    functions: dict[str, set] = defaultdict(set)
    edges: Counter = Counter()
    importing: Counter = Counter()  # thread -> depth of import-run module bodies
    calls = [0]

    def in_import(frame) -> bool:  # a module body run by an import
        caller = (frame.f_back or frame).f_code.co_filename
        return frame.f_code.co_name == "<module>" and caller.startswith("<frozen importlib")

    def hook(frame, event, arg):
        if event == "return":
            if in_import(frame):
                importing[threading.get_ident()] -= 1
            return
        if event != "call":
            return
        if in_import(frame):
            importing[threading.get_ident()] += 1
            return
        code = frame.f_code
        fn = code.co_filename
        mod = names[fn] if fn in names else names.setdefault(fn, module_of(fn))
        if mod is None or code.co_name in NOT_FUNCTIONS or importing[threading.get_ident()] > 0:
            return
        calls[0] += 1
        functions[mod].add((code.co_qualname, code.co_firstlineno))
        up = frame.f_back
        while up is not None:
            f = up.f_code.co_filename
            caller = names[f] if f in names else names.setdefault(f, module_of(f))
            if caller is not None:
                if caller != mod:
                    edges[(caller, mod)] += 1
                break
            up = up.f_back

    loaded = set(sys.modules)
    argv = ["calibrate", str(bundle), "-o", str(bundle.parent / "q"), *CALIBRATE]
    t = time.perf_counter()
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        main(argv, standalone_mode=False)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    seconds, origin = time.perf_counter() - t, check_origin(repo)
    pairs = sorted({tuple(sorted(e)) for e in edges if (e[1], e[0]) in edges})
    rev = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True, text=True)
    out_json.write_text(json.dumps({
        "repo": str(repo), "revision": rev.stdout.strip(), "package_files": origin,
        "argv": ["kvforge", "calibrate", "BUNDLE", "-o", "OUT", *CALIBRATE], "profiled_seconds": round(seconds, 1),
        "modules": len(functions), "functions": sum(len(f) for f in functions.values()), "calls": calls[0],
        "cross_module_edges": len(edges), "back_and_forth_pairs": len(pairs),
        "functions_per_module": dict(sorted(((m, len(f)) for m, f in functions.items()), key=lambda x: (-x[1], x[0]))),
        "function_names": {m: sorted(f"{q}:{n}" for q, n in f) for m, f in sorted(functions.items())},
        "edges": {f"{a} -> {b}": n for (a, b), n in sorted(edges.items())},
        "back_and_forth": [f"{a} <-> {b}" for a, b in pairs],
        "kvforge_modules_imported_during_request": sorted(n for n in set(sys.modules) - loaded
                                                          if n.startswith("kvforge")),
    }, indent=2))


def measure(repo: Path) -> dict:
    """Exports tiny and measures the calibrate request in child processes importing kvforge from `repo`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])])}
    with tempfile.TemporaryDirectory(prefix="request-modules-") as tmp:
        bundle, out = Path(tmp) / "tiny", Path(tmp) / "result.json"
        for stage in ("export", "calibrate"):
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", stage, "--repo", str(repo),
                            "--bundle", str(bundle), "--json", str(out)], env=env, cwd=tmp, check=True)
        return json.loads(out.read_text())


def report(label: str, r: dict) -> None:
    print(f"\n{label}: {r['repo']} @ {r['revision']} (kvforge from {r['package_files']['kvforge']})")
    print(f"  {r['modules']} modules, {r['functions']} functions ({r['calls']} calls), {r['cross_module_edges']} "
          f"cross-module edges, {r['back_and_forth_pairs']} back-and-forth pairs; {r['profiled_seconds']} s profiled")
    for m, n in r["functions_per_module"].items():
        print(f"    {n:4d}  {m}")
    for pair in r["back_and_forth"]:
        print(f"    <-> {pair}")


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", type=Path, default=ROOT, help="checkout to measure (default: this one)")
    p.add_argument("--compare", type=Path, help="a second checkout, measured as 'before'")
    p.add_argument("--child", choices=["export", "calibrate"], help=argparse.SUPPRESS)
    p.add_argument("--bundle", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.repo.resolve(), a.bundle, a.json)
    results = {"after" if a.compare else "measured": measure(a.repo.resolve())}
    results.update({"before": measure(a.compare.resolve())} if a.compare else {})
    for label, r in results.items():
        report(label, r)
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    by_rev = {r["revision"]: {"label": label, **r} for label, r in results.items()}
    RESULT.write_text(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), **by_rev}, indent=2) + "\n")
    print(f"\nwrote {RESULT}")


if __name__ == "__main__":
    cli()
