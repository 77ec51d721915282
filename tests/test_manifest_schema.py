"""The manifest schema's own pieces: the model-field table stays equal to the configs, and the checker's verdicts."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from kvforge.errors import KvforgeError
from kvforge.manifest import validate_manifest
from kvforge.schema import DictOf, Enum, ListOf, Num, Opt, Rec, RelPath, SchemaError, Union, annotation_spec, check, read_json

ROOT = Path(__file__).resolve().parents[1]


def test_the_model_field_table_is_what_the_configs_declare():
    spec = importlib.util.spec_from_file_location("model_fields_script", ROOT / "scripts" / "model_fields.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert (ROOT / "kvforge" / "model_fields.py").read_text() == script.render(), (
        "a model config changed: run `python3 scripts/model_fields.py > kvforge/model_fields.py`")
    for annotations in script.table().values():  # every annotation has a schema form
        for annotation in annotations.values():
            annotation_spec(annotation)


@pytest.mark.parametrize("value, spec, problem", [
    (True, int, "is the boolean true, expected an integer"),
    (2.5, int, "is the number 2.5, expected an integer"),
    (float("nan"), float, "is the number nan, expected a finite number"),
    (-1, Num(low=0, integer=True), "is -1, expected an integer >= 0"),
    ("fp16", Enum("float32", "float16"), "is the string 'fp16', expected one of 'float32', 'float16'"),
    ("/etc/passwd", RelPath(), "'/etc/passwd' is an absolute path"),
    ("a/../../b", RelPath(directories=True), "climbs out of the bundle"),
    ("1/model.py", RelPath(), "names a file in a subdirectory"),
    ([1, "x"], ListOf(int), r"\[1\] is the string 'x'"),
    ({"a": {"b": None}}, DictOf(Rec({"b": int})), "a.b is null, expected an integer"),
    ({}, Rec({"b": int}, required=("b",)), "x.b is missing"),
    ("x", Union(int, ListOf(int)), "is the string 'x', expected an integer or a list"),
])
def test_check_names_the_field_and_what_was_expected(value, spec, problem):
    with pytest.raises(SchemaError) as e:
        check(value, spec, "x")
    assert __import__("re").search(problem, str(e.value)), str(e.value)


@pytest.mark.parametrize("value, spec", [
    (3, float), (None, Opt(int)), ([1, [2, 3]], ListOf(Union(int, ListOf(int)))), ("1/model.py", RelPath(directories=True)),
    ({"k": [1]}, annotation_spec("dict[str, Any]")), ([4, 5], annotation_spec("int | list[int] | None")),
    (float("inf"), Num(finite=False)), ({"b": 1, "unknown": "kept"}, Rec({"b": int}, required=("b",))),
])
def test_check_accepts_what_fits(value, spec):
    check(value, spec, "x")  # raises on a wrong verdict
    assert annotation_spec("int | None") == Opt(int) and annotation_spec("list[str] | None") == Opt(ListOf(str))


def test_a_valid_manifest_passes_and_a_model_field_is_typed_by_its_architecture(micro_bundle):
    manifest = json.loads((micro_bundle("bert-micro").path / "kvforge.json").read_text())
    validate_manifest(manifest, "bert")
    manifest["model"]["num_labels"] = "2"  # an encoder's field
    with pytest.raises(KvforgeError, match="bert is damaged: 'model.num_labels' is the string '2', expected an integer"):
        validate_manifest(manifest, "bert")


def test_read_json_names_the_file_and_the_problem(tmp_path):
    (tmp_path / "a.json").write_bytes(b"\xff\xfe{}")
    (tmp_path / "b.json").write_text("[1]")
    (tmp_path / "c.json").write_text("{nope")
    with pytest.raises(KvforgeError, match=r"config .*a.json is not UTF-8 text \(byte 0\)"):
        read_json(tmp_path / "a.json", "config")
    with pytest.raises(KvforgeError, match=r"b.json holds a list, expected a JSON object"):
        read_json(tmp_path / "b.json")
    with pytest.raises(KvforgeError, match=r"c.json is not valid JSON"):
        read_json(tmp_path / "c.json")
    with pytest.raises(KvforgeError, match=r"cannot read .*missing.json"):
        read_json(tmp_path / "missing.json")
    assert read_json(tmp_path / "b.json", kind=list) == [1]


def test_the_files_lie_at_the_top_level_but_for_the_adapters(micro_bundle):
    """A bundle's one subdirectory is adapters/NAME/ (kvforge/adapters.py); any other path in `files` is refused."""
    manifest = json.loads((micro_bundle("bert-micro").path / "kvforge.json").read_text())
    record = next(iter(manifest["files"].values()))
    manifest["files"]["adapters/a2/adapter.safetensors"] = record
    validate_manifest(manifest, "bert")
    for name, problem in [("sub/x.json", "names a file in a subdirectory"),
                          ("adapters/a2/more/x", "is not adapters/NAME/FILE"),
                          ("adapters/x", "is not adapters/NAME/FILE"),
                          ("adapters/../x", "climbs out of the bundle")]:
        bad = {**manifest, "files": {**manifest["files"], name: record}}
        with pytest.raises(KvforgeError, match=f"bert is damaged: .files\\[{re.escape(repr(name))}\\].* {problem}"):
            validate_manifest(bad, "bert")
