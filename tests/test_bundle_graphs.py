"""A bundle's graphs, role -> file (issue 52): the manifest's `graphs`, which export always writes, calibrate keeps
and a build rewrites; `Bundle.graphs` returns it, and derives the same map from a manifest written before the entry
(the only place that knows those layouts)."""

from __future__ import annotations

import json
import shutil

import pytest

from kvforge.bundle import MANIFEST, Bundle, write_manifest
from kvforge.calibration import calibrate
from kvforge.errors import KvforgeError

GRAPHS = {
    "tiny": {"model": "model.onnx"},
    "llava-micro": {"vision": "vision.onnx", "decoder": "decoder.onnx"},
    "t5-micro": {"encoder": "encoder_model.onnx", "decoder": "decoder_model.onnx"},
}


@pytest.fixture
def bundle_of(tiny_fp32, micro_bundle):
    return lambda name: tiny_fp32 if name == "tiny" else micro_bundle(name)


def _rewritten(source: Bundle, out, change) -> Bundle:
    """A copy of `source` whose manifest `change(manifest)` edited, written again with its file records."""
    shutil.copytree(source.path, out)
    manifest = json.loads((out / MANIFEST).read_text())
    change(manifest)
    write_manifest(out, manifest)
    return out


def _old_layout(manifest) -> None:
    """The manifest as kvforge wrote it before `graphs` was always written: none (an encoder-decoder's was dropped
    here too), and the vision or encoder graph named in io.extra beside its IO."""
    graphs = manifest.pop("graphs")
    extra = manifest["io"].get("extra", {})
    for side in ("vision", "encoder"):
        if side in graphs:
            extra[side]["graph"] = graphs[side]
            extra["decoder_graph"] = graphs["decoder"]


@pytest.mark.parametrize("name", list(GRAPHS))
def test_export_writes_every_graph_by_role(name, bundle_of):
    bundle = bundle_of(name)
    assert bundle.manifest["graphs"] == bundle.graphs == GRAPHS[name]
    assert bundle.manifest["graph"] in bundle.graphs.values()
    assert all(file in bundle.manifest["files"] for file in bundle.graphs.values())
    # one answer: io.extra holds the other graph's IO, not its file
    assert not any("graph" in v for v in bundle.io.extra.values() if isinstance(v, dict))
    assert "decoder_graph" not in bundle.io.extra


@pytest.mark.parametrize("name", list(GRAPHS))
def test_calibrate_keeps_the_graphs_rewritten_and_hashed(name, bundle_of, tmp_path):
    source = bundle_of(name)
    q = calibrate(source.path, tmp_path / "int4", precision="int4", recipe="fixed")
    assert q.manifest["graphs"] == q.graphs == source.graphs
    for file in q.graphs.values():
        assert (q.path / file).is_file()
        assert q.manifest["files"][file]["sha256"] != source.manifest["files"][file]["sha256"]  # quantized
    q.verify(full=True)  # every file against its recorded size and hash
    if len(q.graphs) > 1:
        assert set(q.manifest["lint"]["graphs"]) == set(q.graphs)


@pytest.mark.parametrize("name", list(GRAPHS))
def test_a_manifest_written_before_the_entry_gives_the_same_map(name, bundle_of, tmp_path):
    old = Bundle(_rewritten(bundle_of(name), tmp_path / "old", _old_layout))
    assert "graphs" not in old.manifest
    assert old.graphs == GRAPHS[name]


def test_readers_of_an_old_bundle_see_its_graphs_and_a_derived_bundle_records_them(micro_bundle, tmp_path):
    from kvforge.export.engine import build_plan

    source = micro_bundle("llava-micro")
    old = Bundle(_rewritten(source, tmp_path / "old", _old_layout))
    plan = build_plan(old.path, max_batch=2, max_context=48)
    assert {g["role"]: g["graph"] for g in plan["graphs"]} == GRAPHS["llava-micro"]
    q = calibrate(old.path, tmp_path / "int4", precision="int4")
    assert q.manifest["graphs"] == GRAPHS["llava-micro"]


@pytest.mark.parametrize("change, problem", [
    (lambda m: m["graphs"].update(vision="missing.onnx"),
     r"is damaged: 'graphs.vision' 'missing.onnx' is not one of the bundle's recorded files"),
    (lambda m: m.update(graphs={"model": "decoder.onnx"}),
     r"is damaged: 'graphs' has the roles \['model'\]; vision-language bundles have \['vision', 'decoder'\]"),
    (lambda m: m["graphs"].update(decoder="vision.onnx"),
     r"is damaged: 'graph' 'decoder.onnx' is not one of the files 'graphs' names \(vision.onnx, vision.onnx\)"),
    (lambda m: (_old_layout(m), m["io"]["extra"]["vision"].update(graph="gone.onnx")),
     r"is damaged: it has no 'graphs' entry, and its io.extra.vision.graph \('gone.onnx'\) is not one of the "
     r"bundle's recorded files"),
])
def test_a_manifest_whose_graphs_do_not_fit_is_refused(change, problem, micro_bundle, tmp_path):
    path = _rewritten(micro_bundle("llava-micro"), tmp_path / "bad", change)
    with pytest.raises(KvforgeError, match=problem):
        Bundle(path)


def test_a_recorded_graph_missing_from_the_directory_is_named(micro_bundle, tmp_path):
    shutil.copytree(micro_bundle("llava-micro").path, tmp_path / "b")
    (tmp_path / "b" / "vision.onnx").unlink()
    with pytest.raises(KvforgeError, match="is damaged: vision.onnx is missing"):
        Bundle(tmp_path / "b").verify()
