"""The model kinds (kvforge/kinds.py): every stage's registry covers every kind, the capabilities describe the
models they claim to, and no module outside the registries branches on a kind's name."""

from __future__ import annotations

import ast
import importlib

import pytest

from kvforge.errors import KvforgeError
from kvforge.kinds import KINDS, check_registry, get_kind, kind_name, kind_of
from kvforge.model_defs.architectures import ARCHITECTURES, all_presets, build, preset_config

from .test_layers import modules

REGISTRIES = {
    "model_defs": ("kvforge.model_defs.architectures", "ARCHITECTURES"),
    "export": ("kvforge.export.kinds", "EXPORTS"),
    "calibration": ("kvforge.calibration.kinds", "QUANTIZERS"),
    "runtime": ("kvforge.runtime.kinds", "SESSIONS"),
    "verify": ("kvforge.verify.kinds", "COMPARERS"),
    "serving": ("kvforge.serving.kinds", "SERVED"),
}


@pytest.mark.parametrize("stage", sorted(REGISTRIES))
def test_every_registry_covers_every_kind(stage):
    module, name = REGISTRIES[stage]
    registry = getattr(importlib.import_module(module), name)
    assert set(registry) == set(KINDS)


def test_a_registry_out_of_step_is_named():
    with pytest.raises(RuntimeError, match=r"calibration's kind registry .* missing \['perceiver'\]"):
        check_registry("calibration", {k: None for k in KINDS if k != "perceiver"})
    with pytest.raises(RuntimeError, match=r"unknown \['vision'\]"):
        check_registry("export", {**{k: None for k in KINDS}, "vision": None})


def test_kind_lookup_and_names():
    assert kind_of({}).name == "decoder"  # decoder manifests predate the field
    assert kind_of({"architecture": "encoder-decoder"}).multi_graph
    assert kind_name("perceiver") == "a Perceiver encoder" and kind_name("nope") == "a 'nope' model"
    with pytest.raises(KvforgeError, match="unknown model architecture 'vision'"):
        get_kind("vision")


@pytest.mark.parametrize("preset", sorted(p for p in all_presets() if p.endswith("-micro")))
def test_capabilities_describe_the_models(preset):
    """What a Kind claims is what its models are: the length bound is a config field, a KV-cache kind's model
    takes a cache, a multi-graph kind's model encodes and decodes, a tied head is a parameter of the model."""
    cfg = preset_config(preset)
    kind = kind_of(cfg)
    assert isinstance(cfg, ARCHITECTURES[kind.name].config)
    assert isinstance(getattr(cfg, kind.length_field), int)
    model = build(cfg)
    assert hasattr(model, "encode") == kind.multi_graph  # an encoder-decoder encodes once, then decodes
    assert hasattr(cfg, "cache_entries") == kind.kv_cache  # what a layer caches: the KV-cache IO is built from it
    if kind.tied_head:
        assert kind.tied_head in dict(model.named_parameters(remove_duplicate=False))
    if kind.cls_pooling:  # a [CLS] token at position 0 to pool: the encoder presets carry BERT-style heads
        assert getattr(cfg, "head", None) in ("mlm", "classification")


# -- no branch on a kind's name outside the registries ------------------------------------------------------
ALLOWED = {"kvforge.kinds"}  # the one place kinds are described


def kind_branches(source: str, filename: str = "<src>") -> list[str]:
    """Comparisons of an expression about the model kind (its text names `architecture` or `kind`) with a kind's
    name: `bundle.architecture == "decoder"`, `r.get("kind") in ("encoder", ...)`. A stack's side or a graph's role
    (`which == "decoder"`) is not a kind and is not flagged."""
    tree = ast.parse(source, filename)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        parts = [node.left, *node.comparators]
        names = [p for p in parts if _kind_constant(p)]
        others = [p for p in parts if not _kind_constant(p)]
        if names and any(("architecture" in ast.unparse(o) or "kind" in ast.unparse(o)) for o in others):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def _kind_constant(node) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in KINDS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and e.value in KINDS for e in node.elts)
    return False


def test_the_branch_finder_can_fail():
    assert kind_branches('if bundle.architecture != "decoder":\n    pass\n')
    assert kind_branches('x = cfg.get("architecture", "decoder") in ("encoder", "encoder-decoder")\n')
    assert kind_branches('if r.get("kind") == "encoder":\n    pass\n')
    assert not kind_branches('if which == "decoder":\n    pass\n')
    assert not kind_branches('if bundle.kind.kv_cache:\n    pass\n')


def test_no_module_branches_on_a_kind_name():
    offenders = [hit for module, path in modules().items() if module not in ALLOWED
                 for hit in kind_branches(path.read_text(), str(path))]
    assert offenders == [], "ask the Kind (kvforge/kinds.py) or a stage registry instead:\n" + "\n".join(offenders)
