"""Data safety: what --force may remove, what a damaged or tampered bundle may do, what reaches a traceback.

The matrix, like test_bad_inputs: each case builds a situation from copies of shared, read-only bundles and
runs one CLI command (or API call). A refusal is exit status 1 with one `error: ...` line matching the case
(2 and click's usage message for an option click checks), no traceback, and every file that was on disk
before byte-identical afterwards. The replacement cases show what --force does replace.

Then a property test over manifests: random type and structure corruption of any field of a valid manifest
is refused as damage (never a traceback, never a graph run).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvforge import runtime
from kvforge.bundle import MANIFEST, Bundle, write_manifest
from kvforge.cli import main
from kvforge.errors import KvforgeError

from .refusal import assert_refused, snapshot


# -- helpers ------------------------------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


def _manifest(bundle: Path) -> dict:
    return json.loads((bundle / MANIFEST).read_text())


def _patch(bundle: Path, edit: Callable[[dict], None], resign: bool = False) -> Path:
    """Edit the manifest as it stands (resign: record the files again, so only the edit is wrong)."""
    m = _manifest(bundle)
    edit(m)
    if resign:
        write_manifest(bundle, {k: v for k, v in m.items() if k not in ("format", "format_version", "files")})
    else:
        (bundle / MANIFEST).write_text(json.dumps(m))
    return bundle


def _resign(bundle: Path) -> Path:
    return _patch(bundle, lambda m: None, resign=True)


def _user_dir(root: Path, marker: str = MANIFEST, marker_text: str = "{}") -> Path:
    """A user's directory that happens to hold a file with kvforge's marker name."""
    _write(root / marker, marker_text)
    _write(root / "thesis.txt", "four years of work\n")
    _write(root / "src" / "main.py", "print('mine')\n")
    return root


def _nan_in(bundle: Path, suffix: str) -> Path:
    """A NaN in one float initializer (name ending in suffix); the manifest re-signed: hash-consistent."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(bundle / "model.onnx"))
    init = next(i for i in model.graph.initializer if i.name.endswith(suffix))
    w = numpy_helper.to_array(init).copy()
    w.reshape(-1)[:2] = np.nan
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    onnx.save(model, str(bundle / "model.onnx"))
    return _resign(bundle)


@dataclass
class Ctx:
    work: Path
    dec: Path  # gpt2-micro FP32
    s2s: Path  # t5-micro FP32
    other: Path  # another model's graph, outside the bundles


@dataclass
class Case:
    id: str
    make: Callable  # ctx -> argv, or a zero-argument callable for an API case
    message: str
    status: int = 1


ENGINE = {"file": "model.engine", "tensorrt_version": "10.16", "gpu": {"name": "GPU", "compute_capability": "9.0"},
          "limits": {"max_batch": 1, "max_context": 64}, "hardware_compatibility": "none", "version_compatible": False,
          "profiles": [{"index": 0, "name": "prefill", "shapes": {}}]}


def _api(fn):
    return lambda ctx: (lambda: fn(ctx))


def _b(ctx, name: str) -> Path:
    return _copy(ctx.dec, ctx.work / name)


CASES = [
    # --force removes only what kvforge can prove it wrote
    Case("force-calibrate-user-dir-with-empty-manifest",
         lambda c: ["calibrate", str(c.dec), "-o", str(_user_dir(c.work / "u")), "--precision", "int8", "--random-data", "--force"],
         r"holds a kvforge.json that is not a valid bundle manifest"),
    Case("force-export-user-dir-with-empty-manifest",
         lambda c: ["export", "gpt2-micro", "-o", str(_user_dir(c.work / "u")), "--force"],
         r"holds a kvforge.json that is not a valid bundle manifest"),
    Case("force-export-user-dir-with-copied-manifest",  # a real manifest, copied beside the user's files
         lambda c: ["export", "gpt2-micro", "-o", str(_user_dir(c.work / "u", marker_text=(c.dec / MANIFEST).read_text())), "--force"],
         r"holds files its kvforge.json does not list \(src, src/main.py, thesis.txt\)|not a valid bundle manifest"),
    Case("force-bundle-with-a-stray-file",
         lambda c: ["calibrate", str(c.dec), "-o", str(_write(_b(c, "q") / "notes.txt", "mine").parent), "--precision", "int8",
                    "--random-data", "--force"], r"holds files its kvforge.json does not list \(notes.txt\)"),
    Case("force-bundle-with-a-stray-folder",
         lambda c: ["export", "gpt2-micro", "-o", str(_write(_b(c, "q") / "extra" / "a.txt", "mine").parent.parent), "--force"],
         r"does not list \(extra, extra/a.txt\)"),
    Case("force-triton-user-dir-with-empty-record",
         lambda c: ["triton", str(c.dec), "-o", str(_user_dir(c.work / "u", marker="kvforge-triton.json")), "--force"],
         r"holds a kvforge-triton.json that does not list the files kvforge wrote"),
    Case("force-pipeline-user-dir",
         lambda c: ["pipeline", "gpt2-micro", "-o", str(_user_dir(c.work / "u")), "--random-data", "--precision", "fp16", "--force"],
         r"is not a directory `kvforge pipeline` wrote"),
    Case("force-pipeline-record-and-stray-file",
         lambda c: ["pipeline", "gpt2-micro", "-o", str(_user_dir(c.work / "u", marker="kvforge-pipeline.json",
                                                                marker_text='{"entries": ["fp16"]}')),
                    "--random-data", "--precision", "fp16", "--force"], r"holds entries no pipeline wrote \(src, thesis.txt\)"),
    Case("force-build-user-dir",
         lambda c: ["build", str(c.dec), "-o", str(_user_dir(c.work / "u")), "--force"],
         r"not a valid bundle manifest|TensorRT"),
    Case("force-output-is-the-current-directory", lambda c: ["export", "gpt2-micro", "-o", ".", "--force"],
         r"the output \. is the current directory"),
    Case("output-on-a-filesystem-that-takes-no-files", lambda c: ["export", "gpt2-micro", "-o", "/proc/kvforge-out"],
         r"cannot write to /proc"),
    Case("output-under-sys", lambda c: ["calibrate", str(c.dec), "-o", "/sys/kvforge-q", "--precision", "int8", "--random-data"],
         r"cannot write to /sys"),
    # a damaged graph, a manifest that points outside its bundle
    Case("graph-random-bytes-same-size-warm-cache",
         lambda c: ["generate", str(_warm_then_scramble(c)), "--prompt", "x", "--max-new-tokens", "2"],
         r"model.onnx does not match its recorded sha256"),
    Case("graph-entry-absolute-path",
         lambda c: ["generate", str(_patch(_b(c, "a"), lambda m: m.update(graph=str(c.other)))), "--prompt", "x"],
         r"'graph' .* is an absolute path"),
    Case("graph-entry-absolute-path-inspect",
         lambda c: ["inspect", str(_patch(_b(c, "a"), lambda m: m.update(graph=str(c.other))))], r"'graph' .* is an absolute path"),
    Case("graph-entry-climbs-out",
         lambda c: ["inspect", str(_patch(_b(c, "a"), lambda m: m.update(graph="../../../../etc/passwd")))], r"'graph' .* climbs out"),
    Case("graph-entry-not-a-recorded-file",
         lambda c: ["generate", str(_patch(_b(c, "a"), lambda m: m.update(graph="tokenizer.json"))), "--prompt", "x"],
         r"'graph' is not one of|'graph' 'tokenizer.json'|not a readable ONNX model"),
    Case("file-entry-climbs-out",
         lambda c: ["lint", str(_patch(_b(c, "a"), lambda m: m["files"].update({"../../x": m["files"]["model.onnx"]})))],
         r"climbs out of the bundle"),
    Case("external-data-entry-absolute",
         lambda c: ["generate", str(_patch(_copy(c.s2s, c.work / "s"), lambda m: m.update(external_data="/etc/hosts"))), "--prompt", "x"],
         r"'external_data' .* is an absolute path"),
    Case("seq2seq-graphs-entry-absolute",
         lambda c: ["generate", str(_patch(_copy(c.s2s, c.work / "s"), lambda m: m["graphs"].update(encoder=str(c.other)))), "--prompt", "x"],
         r"'graphs.encoder' .* is an absolute path"),
    Case("engine-file-entry-climbs-out",
         lambda c: ["inspect", str(_patch(_b(c, "a"), lambda m: m.update(engine={**ENGINE, "file": "../model.engine"})))], r"climbs out"),
    Case("graph-is-a-link-to-another-model",
         lambda c: ["generate", str(_link_graph(c)), "--prompt", "x"], r"model.onnx is a link, not the bundle's own file"),
    # NaN weights in a hash-consistent graph
    Case("nan-norm-weight-generate", lambda c: ["generate", str(_nan_in(_b(c, "n"), "model.norm.weight")), "--prompt", "x"],
         r"holds 2 NaN or infinite values"),
    Case("nan-norm-weight-calibrate-int4",
         lambda c: ["calibrate", str(_nan_in(_b(c, "n"), "model.norm.weight")), "-o", str(c.work / "q"), "--precision", "int4", "--random-data"],
         r"holds 2 NaN or infinite values"),
    Case("nan-weight-triton", lambda c: ["triton", str(_nan_in(_b(c, "n"), "up_proj.weight")), "-o", str(c.work / "r")],
         r"holds 2 NaN or infinite values"),
    Case("nan-weight-api", lambda c: (lambda b: lambda: runtime.load(b))(_nan_in(_b(c, "n"), "up_proj.weight")),
         r"holds 2 NaN or infinite values"),
    # manifest fields of the wrong type or shape: one clear line, not a traceback
    Case("max-context-a-string", lambda c: ["generate", str(_patch(_b(c, "m"), lambda m: m["io"].update(max_context="256"))), "--prompt", "x"],
         r"is damaged: 'io.max_context' is the string '256', expected an integer >= 1"),
    Case("file-entry-lacks-bytes", lambda c: ["generate", str(_patch(_b(c, "m"), lambda m: m["files"]["model.onnx"].pop("bytes"))), "--prompt", "x"],
         r"is damaged: 'files.model.onnx.bytes' is missing"),
    Case("quantization-a-string", lambda c: ["compare", str(_patch(_b(c, "m"), lambda m: m["precision"].update(quantization="int8")))],
         r"is damaged: 'precision.quantization' is the string 'int8', expected a dict"),
    Case("unknown-dtype", lambda c: ["inspect", str(_patch(_b(c, "m"), lambda m: m["precision"].update(dtype="float12")))],
         r"'precision.dtype' is the string 'float12', expected one of"),
    Case("unknown-stage", lambda c: ["inspect", str(_patch(_b(c, "m"), lambda m: m.update(stage="bake")))], r"'stage' is the string 'bake'"),
    Case("lineage-empty-torch-backend",
         lambda c: ["generate", str(_patch(_b(c, "m"), lambda m: m.update(lineage=[]))), "--prompt", "x", "--backend", "torch"],
         r"records no source model; pass source="),
    Case("model-field-mistyped", lambda c: ["generate", str(_patch(_b(c, "m"), lambda m: m["model"].update(rope_theta="1e4"))), "--prompt", "x"],
         r"'model.rope_theta' is the string '1e4', expected a finite number"),
    Case("tokenizer-config-not-utf8",
         lambda c: ["generate", str(_resign(_write(_b(c, "t") / "tokenizer_config.json", b'{"bos_token": "\xff\xfe"}').parent)), "--prompt", "x"],
         r"tokenizer_config.json is not UTF-8 text"),
    Case("engine-section-partial", lambda c: ["inspect", str(_patch(_b(c, "e"), lambda m: m.update(engine={"file": "model.onnx"})))],
         r"'engine.tensorrt_version' is missing"),
    Case("seed-negative-cli", lambda c: ["generate", str(c.dec), "--prompt", "x", "--seed", "-1"], r"Invalid value for '--seed'", 2),
    Case("seed-negative-api", _api(lambda c: runtime.load(c.dec).generate("x", max_new_tokens=2, temperature=0.5, seed=-1)),
         r"seed must be an int >= 0"),
    Case("prompt-bytes-not-utf8-api", _api(lambda c: runtime.load(c.dec).generate(b"ok \xff\xfe", max_new_tokens=2)),
         r"the prompt is bytes that are not UTF-8 text"),
    Case("batcher-prompt-bytes-not-utf8", _api(lambda c: runtime.Batcher(runtime.load(c.dec)).submit(b"\xc3\x28", max_new_tokens=2)),
         r"bytes that are not UTF-8"),
    Case("cache-is-a-file", lambda c: ["generate", str(c.dec), "--prompt", "x", "--max-new-tokens", "1"], r"KVFORGE_CACHE .* is not a directory"),
    Case("compare-report-unwritable", lambda c: ["compare", str(c.dec), "--json", "/proc/kvforge/r.json"],
         r"Invalid value for '--json': cannot write /proc/kvforge/r.json", 2),
    Case("check-report-unwritable", lambda c: ["check", str(_spec_with_baseline(c, b"{}")), "--report", "/proc/kvforge/r.json"],
         r"Invalid value for '--report': cannot write", 2),
    Case("check-workdir-unwritable", lambda c: ["check", str(_spec_with_baseline(c, b"{}")), "--workdir", "/proc/kvforge/w"],
         r"cannot create the work directory /proc/kvforge/w"),
    Case("build-timing-cache-unwritable", lambda c: ["build", str(c.dec), "--dry-run", "--timing-cache", "/proc/kvforge/t.cache"],
         r"Invalid value for '--timing-cache': cannot write", 2),
    Case("baseline-not-utf8",
         lambda c: ["check", str(_spec_with_baseline(c, b"\xff\xfe{}"))], r"baseline .* is not UTF-8 text"),
]


def _warm_then_scramble(ctx) -> Path:
    """Run the bundle once (its ORT variant is built and cached), then overwrite its graph with random bytes of
    the same size: the cache must not answer for it."""
    b = _b(ctx, "w")
    with runtime.load(b) as session:
        session.generate("x", max_new_tokens=1)
    size = (b / "model.onnx").stat().st_size
    (b / "model.onnx").write_bytes(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    return b


def _link_graph(ctx) -> Path:
    b = _b(ctx, "l")
    (b / "model.onnx").unlink()
    (b / "model.onnx").symlink_to(ctx.other)
    return b


def _spec_with_baseline(ctx, content: bytes) -> Path:
    spec = _write(ctx.work / "c.toml", 'source = "gpt2-micro"\nbaseline = "b.json"\n[[artifacts]]\nname = "fp32"\ndtype = "float32"\n')
    _write(ctx.work / "b.json", content)
    return spec


@pytest.fixture(scope="module")
def shared(micro_bundle):
    return {"dec": micro_bundle("gpt2-micro").path, "s2s": micro_bundle("t5-micro").path,
            "other": micro_bundle("llama3-micro").path / "model.onnx"}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_refused_clearly_and_nothing_on_disk_changes(case, shared, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    ctx = Ctx(work, shared["dec"], shared["s2s"], shared["other"])
    made = case.make(ctx)
    if case.id == "cache-is-a-file":
        monkeypatch.setenv("KVFORGE_CACHE", str(_write(work / "cachefile", "not a directory")))
    before = snapshot(work, shared["dec"], shared["s2s"], shared["other"].parent)
    assert_refused(made, case.message, case.status)
    assert snapshot(work, shared["dec"], shared["s2s"], shared["other"].parent) == before


# -- what --force does replace -------------------------------------------------------------------------------
def test_force_replaces_a_bundle_kvforge_wrote(shared, tmp_path):
    out = _copy(shared["dec"], tmp_path / "q")
    result = CliRunner().invoke(main, ["calibrate", str(shared["dec"]), "-o", str(out), "--precision", "int8",
                                       "--random-data", "--force", "--quiet"])
    assert result.exit_code == 0, result.output
    assert Bundle(out).quantization_format == "int8" and Bundle(out).manifest["stage"] == "calibrate"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".q.")]  # no staging leftovers beside it


def test_force_replaces_a_served_triton_repository_bytecode_and_all(shared, tmp_path):
    repo = tmp_path / "repo"
    assert CliRunner().invoke(main, ["triton", str(shared["dec"]), "-o", str(repo), "--model-name", "m"]).exit_code == 0
    _write(repo / "m" / "1" / "__pycache__" / "model.cpython-311.pyc", b"\x00bytecode")  # what serving it leaves
    result = CliRunner().invoke(main, ["triton", str(shared["dec"]), "-o", str(repo), "--model-name", "m", "--instances", "2", "--force"])
    assert result.exit_code == 0, result.output
    assert "count: 2" in (repo / "m" / "config.pbtxt").read_text()
    _write(repo / "m" / "notes.txt", "mine")  # but not a file of the user's
    result = CliRunner().invoke(main, ["triton", str(shared["dec"]), "-o", str(repo), "--model-name", "m", "--force"])
    assert result.exit_code == 1 and "m/notes.txt" in result.output and (repo / "m" / "notes.txt").is_file()


def test_the_api_refuses_what_the_cli_refuses(shared, tmp_path):
    from kvforge.calibration import calibrate
    from kvforge.export import export

    user = _user_dir(tmp_path / "u")
    before = snapshot(user)
    with pytest.raises(KvforgeError, match="not a valid bundle manifest"):
        export("gpt2-micro", user, force=True)
    with pytest.raises(KvforgeError, match="not a valid bundle manifest"):
        calibrate(shared["dec"], user, precision="int8", random_data=True, force=True)
    assert snapshot(user) == before


def test_valid_utf8_bytes_prompt_is_the_same_as_the_str(shared):
    with runtime.load(shared["dec"]) as session:
        assert session.generate("héllo".encode(), max_new_tokens=4).tokens == session.generate("héllo", max_new_tokens=4).tokens


def test_a_graph_rewritten_in_place_is_hashed_again_before_the_cache_is_used(shared, tmp_path):
    """Same size, mtime put back: the stat record still differs (ctime), so the full hash runs and refuses."""
    b = _copy(shared["dec"], tmp_path / "b")
    with runtime.load(b) as session:
        session.generate("x", max_new_tokens=1)
    graph = b / "model.onnx"
    st = graph.stat()
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0xFF
    graph.write_bytes(bytes(data))
    os.utime(graph, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(KvforgeError, match="model.onnx does not match its recorded sha256"):
        runtime.load(b)


# -- the property test over manifests -------------------------------------------------------------------------
FREE_FORM = ("lineage[*].options", "lineage[*].versions", "lineage[*].seconds", "calibration.scales",
             "calibration.accuracy_budget", "calibration.experts", "model.extra", "io.extra", "ecosystem", "lint.targets",
             "validation.tolerances")
"""Records kvforge writes for people and never reads back to decide anything (a source's own options, per-layer
scales, free-form notes): their contents are informational, so any JSON is valid there."""


def _leaves(value, path=(), out=None) -> list[tuple]:
    """Every field's path (a tuple of keys and indexes; lists: their first two items)."""
    out = [] if out is None else out
    if path:
        out.append(path)
    if isinstance(value, dict):
        for k, v in value.items():
            _leaves(v, (*path, k), out)
    elif isinstance(value, list):
        for i, v in enumerate(value[:2]):
            _leaves(v, (*path, i), out)
    return out


def _dotted(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))


def _free_form(path: tuple) -> bool:
    generic = re.sub(r"\[\d+\]", "[*]", _dotted(path))
    return any(generic == f or generic.startswith(f + ".") or generic.startswith(f + "[") for f in FREE_FORM)


def _get(m, path: tuple):
    parent = None
    node = m
    for key in path:
        parent, node = node, node[key]
    return parent, path[-1], node


def _other_kinds(value, path: tuple):
    """Values of a JSON kind other than value's (and never null: null is a valid value of many optional fields)."""
    if len(path) > 1 and path[-2] == "shape":  # a dimension is a name or a size: either is no corruption there
        return [2.5, True, [value], {"a": value}]
    if isinstance(value, bool):
        return ["yes", 7, [1], {"a": 1}]
    if isinstance(value, (int, float)):  # (not [7]: a token id may be one id or a list of them)
        return ["7", True, {"a": 7}]
    if isinstance(value, str):
        return [7, 2.5, False, [value], {"a": value}]
    if isinstance(value, list):
        return ["x", 7, True, {"a": 1}]
    if isinstance(value, dict):
        return ["x", 7, True, [1]]
    return [True]  # null: no optional field of a manifest is a boolean one, so true is never valid where null was


@pytest.fixture(scope="module")
def manifests(micro_bundle, tmp_path_factory):
    """Valid bundles of each kind, with the paths of their manifests' fields (free-form records left out)."""
    from kvforge.calibration import calibrate

    root = tmp_path_factory.mktemp("manifests")
    dec = micro_bundle("gpt2-micro").path
    bundles = {"decoder": dec, "encoder": micro_bundle("bert-micro").path, "encoder-decoder": micro_bundle("t5-micro").path,
               "int4": calibrate(dec, root / "int4", precision="int4", random_data=True, samples=4, seq_len=32).path}
    return _Manifests({kind: (path, [p for p in _leaves(_manifest(path)) if not _free_form(p)]) for kind, path in bundles.items()})


class _Manifests(dict):
    def __repr__(self) -> str:  # hypothesis prints the fixture with a failing example: the kinds are enough
        return f"<valid manifests: {', '.join(self)}>"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_type_or_structure_corruption_is_refused_as_damage(manifests, tmp_path_factory, monkeypatch, data):
    import onnxruntime

    kind = data.draw(st.sampled_from(sorted(manifests)), label="bundle")
    source, paths = manifests[kind]
    path = data.draw(st.sampled_from(paths).map(tuple), label="field")
    m = _manifest(source)
    parent, key, value = _get(m, path)
    corrupted = copy.deepcopy(m)
    cparent, ckey, _ = _get(corrupted, path)
    action = data.draw(st.sampled_from(["retype", "delete"] if isinstance(cparent, dict) else ["retype"]), label="action")
    if action == "retype":
        cparent[ckey] = data.draw(st.sampled_from(_other_kinds(value, path)), label="value")
    else:
        del cparent[ckey]
    b = _copy(source, tmp_path_factory.mktemp("corrupt") / "b")
    (b / MANIFEST).write_text(json.dumps(corrupted))

    ran = []
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: ran.append(a) or pytest.fail("a graph ran"))
    result = CliRunner().invoke(main, ["inspect", str(b)])
    assert "Traceback" not in result.output and (result.exception is None or isinstance(result.exception, SystemExit)), (
        _dotted(path), action, result.output, repr(result.exception))
    try:
        refused = None
        Bundle(b)
    except KvforgeError as e:
        refused = str(e)
    if action == "retype":
        assert refused and re.search(r"is damaged|is not 'kvforge-bundle'", refused), (_dotted(path), cparent[ckey], refused)
        assert result.exit_code == 1 and result.output.count("error: ") == 1, result.output
    if refused is None:  # a field that may be absent: the bundle still reads, and runs
        return
    with pytest.raises(KvforgeError, match=r"is damaged|is not 'kvforge-bundle'"):
        runtime.load(b)
    assert not ran
