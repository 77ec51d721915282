"""docs/design.md's checkable claims, read from the page itself where they can be (issue 52).

"This page says how it is built; where code and this page differ, one of them is a bug." Each test parses the
claim out of docs/design.md (the paths it names, its registry table, its layer map) or quotes it, and checks it
against the code; a claim the code does not honour yet is pinned as a known exception, so that fixing the code
fails the test until the page and the exception are updated.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import json
import re
import shutil
from pathlib import Path

import pytest

from kvforge.kinds import KINDS

from . import test_layers

ROOT = Path(__file__).resolve().parents[1]
DESIGN = (ROOT / "docs" / "design.md").read_text()


def section(title: str) -> str:
    """The text of the `## title` section."""
    start = DESIGN.index(f"\n## {title}\n")
    end = DESIGN.find("\n## ", start + 1)
    return DESIGN[start:end if end > 0 else None]


def fenced_blocks(text: str) -> list[str]:
    return re.findall(r"```\n(.*?)```", text, re.S)


# -- the files and modules the page names -------------------------------------------------------------------
# backticked words with a slash or a file suffix that are not repository paths: a bundle's own files, URLs,
# environment settings, a config key's slash-separated choices
NOT_PATHS = {"kvforge.json", "model_fields.py", "/v1/*", "$KVFORGE_CACHE/traces", "BUNDLE/adapters/NAME/",
             "adapters/NAME/", "adapters/NAME/FILE", "KVFORGE_RECORD_COSTS=tests/file_costs.json",
             "experts.gate/up/down"}


def named_paths() -> set[str]:
    """Every repository path the page names: backticked ones, and bare ones such as runtime/ort/attention.py."""
    ticked = {t for t in re.findall(r"`([^`\s]+)`", DESIGN) if "/" in t or re.search(r"\.(py|md|json|toml)$", t)}
    bare = set(re.findall(r"(?<![\w/.$`=])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|json|toml))", DESIGN))
    return (ticked | bare) - NOT_PATHS


def test_every_path_the_page_names_exists():
    paths = named_paths()
    assert {"kvforge/kinds.py", "runtime/ort/attention.py", "tests/test_layers.py", "export/replicate.py"} <= paths
    missing = sorted(p for p in paths if not ((ROOT / p).exists() or (ROOT / "docs" / p).exists()))
    assert missing == [], "docs/design.md names files that do not exist"
    assert (ROOT / "kvforge" / "model_fields.py").is_file()  # `model_fields.py`, the core's generated module


def test_every_core_module_the_page_lists_exists():
    """"The core holds what every layer shares": each backticked name in that paragraph is a kvforge/ module."""
    start = DESIGN.index("The core holds what every layer shares")
    paragraph = DESIGN[start:DESIGN.index("\n\n", start)]
    named = {t for t in re.findall(r"`([a-z_]+)`", paragraph)} - {"read_json", "write_manifest", "write_derived",
                                                                  "derived_manifest", "layer_name", "router_choices"}
    assert {"errors", "kinds", "onnx_graph", "bundle", "derived", "resources"} <= named
    assert sorted(n for n in named if not (ROOT / "kvforge" / f"{n}.py").is_file()) == []


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names}
    return names


# backticked `a.b` words that are not module attributes: a manifest field, an ONNX Runtime session option, files
NOT_ATTRIBUTES = {"model.architecture", "session.disable_prepacking", "model_fields.py", "decoder.onnx",
                  "vision.onnx", "kvforge.json"}


def test_every_module_attribute_the_page_names_exists():
    """`module.name` references (`metrics.perplexity`, `onnx_graph.save_with_data`, `runtime.load`): the module,
    found by the last part of its name (the core's where a stage has one of the same name), defines the name
    (read from its source: no import)."""
    by_name: dict[str, list[tuple[str, Path]]] = {}
    for module, path in test_layers.modules().items():
        by_name.setdefault(module.rsplit(".", 1)[-1], []).append((module, path))
    checked, missing = [], []
    for module, name in sorted(set(re.findall(r"`([a-z_]+)\.([A-Za-z_]\w*)`", DESIGN))):
        found = by_name.get(module, [])
        core = [f for f in found if f[0] == f"kvforge.{module}"]
        if f"{module}.{name}" in NOT_ATTRIBUTES or not (core or len(found) == 1):
            continue  # not a module of kvforge (`lockstep.steps`, `torch.onnx`), or an ambiguous name
        checked.append(f"{module}.{name}")
        if name not in _top_level_names((core or found)[0][1]):
            missing.append(f"{module}.{name}")
    assert {"onnx_graph.save_with_data", "kinds.check_registry", "runtime.load", "replicate.layer_design"} <= set(
        checked)
    assert missing == []


def test_the_onnx_graph_helpers_the_runtime_and_calibration_share_live_in_the_core():
    """"`onnx_graph` (...) the module a node came from, `layer_name`, and a mixture's routing, `router_choices`,
    which calibration's experts and runtime/ort/moe.py both read": the runtime reads them from the core, not
    from calibration."""
    from kvforge import onnx_graph
    from kvforge.calibration import experts
    from kvforge.runtime.ort import moe

    assert moe.router_choices is onnx_graph.router_choices and moe.layer_name is onnx_graph.layer_name
    assert experts.router_choices is onnx_graph.router_choices and experts.layer_name is onnx_graph.layer_name
    edges = test_layers.imports(test_layers.modules())
    assert not {t for t in edges["kvforge.runtime.ort.moe"] if t.startswith("kvforge.calibration")}


# -- the kind registries -------------------------------------------------------------------------------------
def registry_table() -> list[tuple[str, str, str]]:
    """(file, registry name, what it holds) from the table under "Model kinds"."""
    block = next(b for b in fenced_blocks(section("Model kinds")) if "ARCHITECTURES" in b)
    rows = [re.match(r"\s*(\S+\.py)\s+([A-Z_]+)\s+(.*)", line) for line in block.splitlines() if line.strip()]
    assert all(rows), block
    return [r.groups() for r in rows]


def test_the_registry_table_names_one_registry_per_stage():
    rows = registry_table()
    assert [f.split("/")[0] for f, _, _ in rows] == ["model_defs", "export", "calibration", "runtime", "verify",
                                                     "serving"]


@pytest.mark.parametrize("file,registry", [(f, r) for f, r, _ in registry_table()])
def test_each_registry_the_page_names_exists_and_covers_every_kind(file, registry):
    """"Each registry checks at import that it covers every kind": the file holds the registry, keyed by every
    kind's name, and calls check_registry on it."""
    path = ROOT / file
    assert registry in _top_level_names(path)
    assert re.search(rf"check_registry\(\s*\"\w+\",\s*{registry}\s*\)", path.read_text())
    module = importlib.import_module("kvforge." + file.removesuffix(".py").replace("/", "."))
    assert set(getattr(module, registry)) == set(KINDS)


def test_the_kinds_the_page_counts():
    """"The vision-language kind (issue 37) is the fifth"; the others: decoders, encoders, the Perceiver,
    encoder-decoders."""
    assert list(KINDS) == ["decoder", "encoder", "perceiver", "encoder-decoder", "vision-language"]
    assert "`kvforge/kinds.py`" in DESIGN and "`kinds.check_registry`" in DESIGN


# -- the layers ----------------------------------------------------------------------------------------------
def layer_map() -> list[tuple[str, str]]:
    """(layer, its folder) from the Layers diagram, top to bottom."""
    block = fenced_blocks(section("Layers"))[0]
    rows = []
    for line in block.splitlines():
        m = re.match(r"\s*(\w+)\s+(\S+?)[:/ ]", line)
        if m:
            rows.append(m.groups())
    return rows


def test_the_layer_map_is_the_one_the_layer_test_holds_the_code_to():
    """"A module imports from its own layer and the layers below it, never above", with the layers as the page
    draws them (cli at the top, the core at the bottom): tests/test_layers.py's ORDER must be that diagram, and
    each stage's folder the package the diagram says (`runtime/ -> kvforge.runtime`)."""
    rows = layer_map()
    assert [name for name, _ in rows][::-1] == test_layers.ORDER
    block = fenced_blocks(section("Layers"))[0]
    for folder, package in test_layers.PACKAGES.items():
        if folder != "kvforge":
            assert f"{folder}/ -> {package}:" in block


def test_no_module_imports_a_layer_the_page_puts_above_it():
    order = [name for name, _ in layer_map()][::-1]
    edges = test_layers.imports(test_layers.modules())
    upward = sorted((a, b) for a, targets in edges.items() for b in targets
                    if order.index(test_layers.layer(b)) > order.index(test_layers.layer(a)))
    assert upward == []


# the modules outside model_defs, export and calibration that import torch inside a function (design.md, Layers:
# "lazily (inside functions), by the Torch backends ... and verify's vision comparison")
LAZY_TORCH = {"kvforge.runtime.graph_backends", "kvforge.runtime.loading", "kvforge.runtime.torch_backend",
              "kvforge.verify.compare_vision"}


def _torch_imports(path: Path) -> tuple[bool, bool]:
    """(imports torch at module level, imports it anywhere)."""
    tree = ast.parse(path.read_text(), str(path))

    def is_torch(node) -> bool:
        if isinstance(node, ast.Import):
            return any(a.name.split(".")[0] == "torch" for a in node.names)
        return isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch"

    top = any(is_torch(n) for n in tree.body) or any(
        is_torch(n) for s in tree.body if isinstance(s, (ast.If, ast.Try)) for n in ast.walk(s)
        if not (isinstance(s, ast.If) and isinstance(s.test, ast.Name) and s.test.id == "TYPE_CHECKING"))
    return top, any(is_torch(n) for n in ast.walk(tree))


def test_torch_is_imported_only_where_the_page_says():
    """"Torch is imported only by model_defs, export and calibration and, lazily, by the Torch backends ... and
    verify's vision comparison": elsewhere no module imports it at module level, and the lazy importers are
    the ones the page names."""
    top, lazy = [], set()
    for module, path in test_layers.modules().items():
        if test_layers.layer(module) in ("model_defs", "export", "calibration"):
            continue
        at_top, anywhere = _torch_imports(path)
        if at_top:
            top.append(module)
        elif anywhere:
            lazy.add(module)
    assert top == []
    assert lazy == LAZY_TORCH


# -- the manifest hashes every file --------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _assert_manifest_lists_every_file(bundle: Path) -> dict:
    manifest = json.loads((bundle / "kvforge.json").read_text())
    on_disk = {p.relative_to(bundle).as_posix(): p for p in bundle.rglob("*")
               if p.is_file() and p.name != "kvforge.json"}
    assert set(manifest["files"]) == set(on_disk)
    for name, path in on_disk.items():
        assert manifest["files"][name] == {"bytes": path.stat().st_size, "sha256": _sha256(path)}, name
    return manifest


def test_the_manifest_lists_and_hashes_every_file(tiny_fp32, tmp_path):
    """"`write_manifest` (kvforge/bundle.py) ... lists every file in the directory with its size and sha256":
    an export's bundle holds no file its manifest does not list and hash."""
    bundle = tmp_path / "tiny"
    shutil.copytree(tiny_fp32.path, bundle)
    manifest = _assert_manifest_lists_every_file(bundle)
    assert {"model.onnx", "tokenizer.json"} <= set(manifest["files"])


def test_recording_adapters_lists_and_hashes_their_files(tiny_fp32, tmp_path):
    """"The one edit of a bundle in place is its adapters (`kvforge lora add` / `remove`), after which
    `record_adapters` records the adapters' files in the manifest again (the other records kept, not
    re-hashed)". A real adapter needs a slotted export (tests/runtime/test_lora_runtime.py); what the manifest
    records does not depend on the files' contents, so two plain files stand in for one here."""
    from kvforge.adapters import record_adapters
    from kvforge.bundle import Bundle

    bundle = tmp_path / "tiny"
    shutil.copytree(tiny_fp32.path, bundle)
    before = json.loads((bundle / "kvforge.json").read_text())["files"]
    adapter = bundle / "adapters" / "probe"
    adapter.mkdir(parents=True)
    (adapter / "adapter.safetensors").write_bytes(b"\x00" * 64)
    (adapter / "adapter.json").write_text("{}\n")
    record_adapters(Bundle(bundle))
    manifest = _assert_manifest_lists_every_file(bundle)
    assert {"adapters/probe/adapter.safetensors", "adapters/probe/adapter.json"} <= set(manifest["files"])
    assert {k: v for k, v in manifest["files"].items() if not k.startswith("adapters/")} == before
    shutil.rmtree(adapter)
    record_adapters(Bundle(bundle))
    assert json.loads((bundle / "kvforge.json").read_text())["files"] == before


# -- every backend is a Runner -------------------------------------------------------------------------------
def test_every_backend_is_a_runner():
    """"Every backend is a `Runner` (runtime/backend.py) but one": the decoder backends `runtime.load` chooses
    by name (onnxruntime, tensorrt, torch) and the encoder and encoder-decoder ones (runtime/graph_backends.py)
    subclass it, take its options and lifecycle, and implement its activate_impl hook."""
    from kvforge.runtime.backend import Backend, Runner
    from kvforge.runtime.graph_backends import ENCODER_BACKENDS, SEQ2SEQ_BACKENDS
    from kvforge.runtime.ort_backend import OnnxRuntimeBackend
    from kvforge.runtime.session import BACKENDS
    from kvforge.runtime.torch_backend import TorchBackend
    from kvforge.runtime.trt_backend import TensorRTBackend

    assert BACKENDS == ("onnxruntime", "tensorrt", "torch")
    decoders = [OnnxRuntimeBackend, TensorRTBackend, TorchBackend]
    for cls in decoders:
        assert issubclass(cls, Backend) and cls.forward_impl is not Backend.forward_impl, cls
    graphs = {*ENCODER_BACKENDS.values(), *SEQ2SEQ_BACKENDS.values()}
    assert set(ENCODER_BACKENDS) == set(SEQ2SEQ_BACKENDS) == {"onnxruntime", "torch"}
    for cls in [*decoders, *graphs]:
        assert issubclass(cls, Runner), cls
        assert cls.activate_impl is not Runner.activate_impl, f"{cls.__name__} does not implement activate_impl"
        for method in ("activate", "deactivate", "check_active"):
            assert getattr(cls, method) is getattr(Runner, method), (cls, method)
        assert "options" in inspect.signature(cls.__init__).parameters or cls.__init__ is Runner.__init__, cls


def test_the_vision_graph_runs_on_a_bare_session_the_known_exception():
    """The exception the page states: "a vision-language session runs its vision graph on a bare ONNX Runtime
    session (runtime/vision_session.py, `ort_session.make_session`) beside a decoder `Session` on
    `OnnxRuntimeBackend`, and opens on onnxruntime only". When the vision graph gets a Runner, this test fails:
    update it and the page."""
    from kvforge.runtime.backend import Runner
    from kvforge.runtime.vision_session import VisionLanguageSession

    assert not issubclass(VisionLanguageSession, Runner)
    source = inspect.getsource(VisionLanguageSession.activate)
    assert "make_session(" in source and "self._vision = " in source
    init = inspect.getsource(VisionLanguageSession.__init__)
    assert "OnnxRuntimeBackend(" in init and 'backend not in ("auto", "onnxruntime")' in init


# -- the kind branches the page lists as exceptions ----------------------------------------------------------
def test_the_kind_branches_outside_the_registries_are_the_ones_the_page_lists():
    """"The vision-language kind added such branches, on a session's class or a served capability rather than a
    kind's name: `kvforge generate --image` (kvforge/cli.py ...) and the chat endpoint (serving/openai_api.py
    `chat_job`: `service.images` ...)". Pinned: a new branch of this sort, or one removed, fails here."""
    cli = (ROOT / "kvforge" / "cli.py").read_text()
    api = (ROOT / "serving" / "openai_api.py").read_text()
    assert re.findall(r"isinstance\(session, runtime\.(\w+)\)", cli) == ["VisionLanguageSession", "EncoderSession",
                                                                          "Session"]
    assert len(re.findall(r"\bservice\.images\b", api)) == 3
    assert "`_image_messages`" in DESIGN and "def _image_messages(" in api
    assert "isinstance(session, runtime.VisionLanguageSession)" in DESIGN.replace("\n", " ")
