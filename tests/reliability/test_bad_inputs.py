"""The bad-input matrix: each case gives the CLI or the Python API something wrong and requires a clear refusal.

Every CLI case: exit status 1 (`error: ...`, one line naming the problem) or 2 (click's usage error), no Python
traceback, and nothing that was on disk before changed. Every API case: the documented KvforgeError with a
message naming the problem. Cases build what they break from shared, read-only fixtures (copied first).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from kvforge import runtime
from kvforge.bundle import MANIFEST, write_manifest

from .refusal import assert_refused, snapshot


# -- helpers that break things ---------------------------------------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_manifest(bundle: Path, edit: Callable[[dict], None] = lambda m: None) -> None:
    """Edit a bundle's manifest, then record its files again (so only the edit is wrong)."""
    m = json.loads((bundle / MANIFEST).read_text())
    edit(m)
    write_manifest(bundle, {k: v for k, v in m.items() if k not in ("format", "format_version", "files")})


def _hf(ctx, name: str) -> Path:
    return _copy(ctx.hf_llama, ctx.work / name)


def _edit_tensors(directory: Path, edit: Callable[[dict], None]) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def _edit_config(directory: Path, edit: Callable[[dict], None]) -> Path:
    cfg = json.loads((directory / "config.json").read_text())
    edit(cfg)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def _bundle(ctx, name: str) -> Path:
    return _copy(ctx.micro, ctx.work / name)


def _external_data_bundle(ctx, location: str, create: bool) -> Path:
    """A bundle whose weights are external data at `location` (relative to the graph), manifest consistent."""
    import onnx

    b = _bundle(ctx, "external")
    model = onnx.load(str(b / "model.onnx"))
    onnx.save(model, str(b / "model.onnx"), save_as_external_data=True, location="weights.bin", size_threshold=0)
    model = onnx.load(str(b / "model.onnx"), load_external_data=False)  # onnx itself will not write a '..' location
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(model, str(b / "model.onnx"))
    target = b / location
    target.parent.mkdir(parents=True, exist_ok=True)
    (b / "weights.bin").replace(target)
    if not create:
        target.unlink()
    _rewrite_manifest(b, lambda m: m.update(external_data=None))
    return b


@dataclass
class Case:
    id: str
    make: Callable  # ctx -> argv (a CLI case) or a zero-argument callable (an API case)
    message: str  # a regex the error line must match
    status: int = 1  # CLI exit status (1: kvforge's error, 2: click's usage error)


def _api(fn):
    return lambda ctx: (lambda: fn(ctx))


def _session(ctx):
    return runtime.load(ctx.micro)


# -- the matrix ----------------------------------------------------------------------------------------------
CASES = [
    # model sources and Hugging Face checkpoints
    Case("unknown-preset", lambda c: ["export", "gpt5", "-o", str(c.work / "out")], r"unknown model source 'gpt5'"),
    Case("pickle-only-checkpoint", lambda c: ["export", str(c.pickle_only), "-o", str(c.work / "out")],
         r"pytorch_model\.bin cannot be read as tensors alone: torch\.load\(weights_only=True\) refuses it .*runs no code"),
    Case("unsupported-architecture", lambda c: ["export", str(_edit_config(_hf(c, "mamba"), lambda h: h.update(model_type="mamba"))),
                                                "-o", str(c.work / "out")], r"unsupported architecture: model_type='mamba'"),
    Case("missing-tensor", lambda c: ["export", str(_edit_tensors(_hf(c, "m"), lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))),
                                      "-o", str(c.work / "out")], r"missing tensors \(1\): \['model.layers.1.mlp.up_proj.weight'\]"),
    Case("extra-tensor", lambda c: ["export", str(_edit_tensors(_hf(c, "x"), lambda t: t.update({"model.extra.weight": t["model.norm.weight"].clone()}))),
                                    "-o", str(c.work / "out")], r"unexpected tensors \(1\): \['model.extra.weight'\]"),
    Case("misshapen-tensor", lambda c: ["export", str(_edit_tensors(_hf(c, "s"), lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:10]}))),
                                        "-o", str(c.work / "out")], r"shape mismatches: model.norm.weight: checkpoint \(10,\)"),
    Case("nan-tensor", lambda c: ["export", str(_edit_tensors(_hf(c, "nan"), lambda t: t["model.layers.0.self_attn.q_proj.weight"].view(-1)[:3].fill_(float("nan")))),
                                  "-o", str(c.work / "out")], r"model.layers.0.self_attn.q_proj.weight holds 3 NaN or infinite values"),
    Case("config-not-json", lambda c: ["export", str(_write(_hf(c, "cj") / "config.json", "{not json")), "-o", str(c.work / "out")],
         r"config.json is not valid JSON"),
    Case("config-lacks-key", lambda c: ["export", str(_edit_config(_hf(c, "ck"), lambda h: h.pop("hidden_size"))), "-o", str(c.work / "out")],
         r"llama config.json lacks the key 'hidden_size'"),
    Case("corrupt-safetensors", lambda c: ["export", str(_write(_hf(c, "cs") / "model.safetensors", b"\x00garbage" * 10)),
                                           "-o", str(c.work / "out")], r"cannot read .*model.safetensors"),
    Case("corrupt-checkpoint-tokenizer", lambda c: ["export", str(_write(_hf(c, "tk") / "tokenizer.json", "{")), "-o", str(c.work / "out")],
         r"tokenizer.json"),
    # bundles
    Case("truncated-graph", lambda c: ["generate", str(_truncate(_bundle(c, "t") / "model.onnx")), "--prompt", "x"],
         r"is damaged: model.onnx has \d+ bytes, the manifest says \d+"),
    Case("graph-garbage-consistent-manifest", lambda c: ["lint", str(_write(_bundle(c, "g") / "model.onnx", b"\x08\x07garbage"))],
         r"is not a readable ONNX model"),
    Case("manifest-not-json", lambda c: ["inspect", str(_write(_bundle(c, "mj") / MANIFEST, "{nope"))], r"kvforge.json is not valid JSON"),
    Case("manifest-lacks-io", lambda c: ["inspect", str(_patch_json(_bundle(c, "mi") / MANIFEST, lambda m: m.pop("io")))],
         r"is damaged: 'io' is missing"),
    Case("manifest-mistyped-model", lambda c: ["inspect", str(_patch_json(_bundle(c, "mm") / MANIFEST, lambda m: m.update(model=[1])))],
         r"is damaged: 'model' is a list, expected a dict"),
    Case("manifest-bad-io", lambda c: ["generate", str(_patch_json(_bundle(c, "mb") / MANIFEST, lambda m: m["io"].update(inputs=5))), "--prompt", "x"],
         r"is damaged: 'io.inputs' is the number 5, expected a list"),
    Case("external-data-outside-bundle", lambda c: ["generate", str(_external_data_bundle(c, "../outside/weights.bin", True)), "--prompt", "x"],
         r"external data .*'../outside/weights.bin'.* outside the bundle"),
    Case("external-data-missing", lambda c: ["generate", str(_external_data_bundle(c, "weights.bin", False)), "--prompt", "x"],
         r"external data file weights.bin .* is missing"),
    Case("bundle-tokenizer-corrupt", lambda c: ["generate", str(_resign(_write(_bundle(c, "bt") / "tokenizer.json", "{\"x\": 1}"))), "--prompt", "x"],
         r"tokenizer.json is not a valid tokenizer.json"),
    Case("bundle-tokenizer-missing", lambda c: ["generate", str(_unlink(_bundle(c, "tm") / "tokenizer.json")), "--prompt", "x"],
         r"is damaged: tokenizer.json is missing"),
    Case("not-a-bundle", lambda c: ["compare", str(c.work)], r"is not a bundle"),
    # generation
    Case("prompt-beyond-context", lambda c: ["generate", str(c.micro), "--prompt", "x" * 300], r"prompt of 3\d\d tokens exceeds the bundle's maximum context of 256"),
    Case("invalid-utf8-prompt", lambda c: ["generate", str(c.micro), "--prompt", "ok \udcff"], r"the prompt is not valid UTF-8 text"),
    Case("negative-temperature", lambda c: ["generate", str(c.micro), "--prompt", "x", "--temperature", "-1"], r"Invalid value for '--temperature'", 2),
    Case("top-p-above-one", lambda c: ["generate", str(c.micro), "--prompt", "x", "--top-p", "2"], r"Invalid value for '--top-p'", 2),
    Case("negative-top-k", lambda c: ["generate", str(c.micro), "--prompt", "x", "--top-k", "-1"], r"Invalid value for '--top-k'", 2),
    Case("zero-repetition-penalty", lambda c: ["generate", str(c.micro), "--prompt", "x", "--repetition-penalty", "0"], r"Invalid value for '--repetition-penalty'", 2),
    Case("negative-max-new-tokens", lambda c: ["generate", str(c.micro), "--prompt", "x", "--max-new-tokens", "-3"], r"max-new-tokens|max_new_tokens", 2),
    Case("unknown-backend", lambda c: ["generate", str(c.micro), "--prompt", "x", "--backend", "tensorflow"], r"tensorflow", 2),
    Case("api-token-out-of-range", _api(lambda c: _session(c).generate([5, 99999])), r"outside the vocabulary \(0..258\)"),
    Case("api-negative-token", _api(lambda c: _session(c).generate([5, -1])), r"prompt token ids \[-1\] are outside the vocabulary"),
    Case("api-float-ids", _api(lambda c: _session(c).forward(np.zeros((1, 3), np.float32))), r"input_ids must be int64"),
    Case("api-mask-shape", _api(lambda c: _session(c).forward(np.zeros((1, 3), np.int64), np.ones((1, 5), np.int64))),
         r"attention_mask must have shape \(1, 3\)"),
    Case("api-ids-3d", _api(lambda c: _session(c).forward(np.zeros((1, 3, 1), np.int64))), r"input_ids must have 2 dimensions"),
    Case("api-mask-values", _api(lambda c: _session(c).forward(np.zeros((1, 3), np.int64), np.full((1, 3), 2, np.int64))),
         r"attention_mask may only hold 0 and 1"),
    Case("api-bad-prompt-type", _api(lambda c: _session(c).generate({"text": "x"})), r"a prompt is a str, a list of token ids"),
    # calibration data
    Case("empty-data", lambda c: ["calibrate", str(c.micro), "-o", str(c.work / "q"), "--precision", "int8", "--data", str(_write(c.work / "e.txt", ""))],
         r"calibration data .*e.txt holds no text"),
    Case("whitespace-data", lambda c: ["calibrate", str(c.micro), "-o", str(c.work / "q"), "--precision", "int8",
                                       "--data", str(_write(c.work / "w.txt", " \n\t\n "))], r"no text|empty|whitespace"),
    Case("binary-data", lambda c: ["calibrate", str(c.micro), "-o", str(c.work / "q"), "--precision", "int8",
                                   "--data", str(_write(c.work / "b.txt", bytes(range(256)) * 4))], r"not UTF-8"),
    Case("bad-jsonl-line", lambda c: ["calibrate", str(c.micro), "-o", str(c.work / "q"), "--precision", "int8",
                                      "--data", str(_write(c.work / "d.jsonl", '{"text": "fine"}\n{broken\n'))], r"d.jsonl:2 is not valid JSON"),
    Case("non-finite-weights", lambda c: ["calibrate", str(_nonfinite_graph(_bundle(c, "nf"))), "-o", str(c.work / "q"), "--precision", "int8", "--random-data"],
         r"holds \d+ NaN or infinite values"),
    Case("unknown-precision", lambda c: ["calibrate", str(c.micro), "-o", str(c.work / "q"), "--precision", "int3"], r"int3", 2),
    # outputs
    Case("output-exists", lambda c: ["export", "gpt2-micro", "-o", str(c.existing)], r"already exists; pass --force"),
    Case("output-is-input", lambda c: ["calibrate", str(c.micro), "-o", str(c.micro), "--precision", "int8", "--random-data", "--force"],
         r"is, or holds, the input"),
    Case("output-under-a-file", lambda c: ["export", "gpt2-micro", "-o", str(_write(c.work / "afile", "x") / "sub" / "out")], r"cannot create"),
    Case("output-not-a-bundle", lambda c: ["export", "gpt2-micro", "-o", str(c.not_bundle), "--force"], r"is a directory but not a kvforge bundle"),
    # engines
    Case("engine-random-bytes", lambda c: ["generate", str(_engine(c, b"\x13random" * 50, record=False)), "--prompt", "x"],
         r"model.engine does not match its recorded sha256"),
    Case("engine-no-tensorrt", lambda c: ["generate", str(_engine(c, b"\x13random" * 50, record=True)), "--prompt", "x"],
         r"TensorRT \(the `tensorrt` Python package\) is not available"),
    # other commands and options
    Case("check-without-baseline", lambda c: ["check", str(_write(c.work / "c.toml", 'source = "gpt2-micro"\n[[artifacts]]\nname = "fp32"\ndtype = "float32"\n'))],
         r"no baseline at"),
    Case("build-max-batch-zero", lambda c: ["build", str(c.micro), "--dry-run", "--max-batch", "0"], r"max-batch|max_batch", 2),
    Case("bench-zero-runs", lambda c: ["bench", str(c.micro), "--runs", "0"], r"runs", 2),
    Case("eval-missing-data", lambda c: ["eval", "gpt2-micro", "--data", str(c.work / "nope.txt")], r"no such file: .*nope.txt"),
    Case("unknown-option", lambda c: ["export", "gpt2-micro", "--frobnicate"], r"No such option", 2),
    # serving
    Case("triton-not-a-bundle", lambda c: ["triton", str(c.work), "-o", str(c.work / "repo")], r"is not a kvforge bundle"),
    Case("triton-damaged-bundle", lambda c: ["triton", str(_truncate(_bundle(c, "tr") / "model.onnx")), "-o", str(c.work / "repo")],
         r"is damaged: model.onnx has \d+ bytes"),
    Case("triton-bad-model-name", lambda c: ["triton", str(c.micro), "-o", str(c.work / "repo"), "--model-name", "a/b"], r"model name 'a/b'"),
    Case("triton-output-not-a-repository", lambda c: ["triton", str(c.micro), "-o", str(c.not_bundle), "--force"],
         r"is a directory but not a kvforge output"),
    Case("triton-zero-instances", lambda c: ["triton", str(c.micro), "-o", str(c.work / "repo"), "--instances", "0"], r"instances", 2),
    Case("api-batcher-never-fits", _api(lambda c: runtime.Batcher(_session(c), max_cache_tokens=10).submit([5] * 8, max_new_tokens=8)),
         r"may hold 16 cache tokens .* budget is 10; it can never run"),
]


def _write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path.parent if path.name in (MANIFEST, "model.onnx", "config.json", "model.safetensors", "tokenizer.json") else path


def _truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:1000])
    return path.parent


def _unlink(path: Path) -> Path:
    path.unlink()
    return path.parent


def _patch_json(path: Path, edit) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path.parent


def _resign(bundle: Path) -> Path:
    _rewrite_manifest(bundle)
    return bundle


def _nonfinite_graph(bundle: Path) -> Path:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(bundle / "model.onnx"))
    init = next(i for i in model.graph.initializer if i.name.endswith("ffn.up_proj.weight"))
    w = numpy_helper.to_array(init).copy()
    w[0, :2] = np.inf
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    onnx.save(model, str(bundle / "model.onnx"))
    return _resign(bundle)


def _engine(ctx, data: bytes, record: bool) -> Path:
    """An engine bundle (manifest as `kvforge build` writes it) around bytes that are no engine."""
    from kvforge.bundle import Bundle
    from kvforge.export.engine import engine_manifest, resolve_limits, synthesize_profiles

    source = Bundle(ctx.micro)
    out = ctx.work / "engine"
    out.mkdir()
    (out / "model.engine").write_bytes(b"\x00" * len(data))
    limits = resolve_limits(source.io, 2, max_context=64, opt_batch=1, opt_context=32)
    write_manifest(out, engine_manifest(
        source.manifest, source_path=str(source.path), tensorrt_version="10.16.0.72", gpu_name="GPU", compute_capability="9.0",
        profiles=synthesize_profiles(source.io, limits), limits=limits.__dict__, timing_cache=None, lint_result=source.manifest["lint"],
        options={"builder_optimization_level": 3, "hardware_compatibility": "none", "version_compatible": False, "tf32": False},
        seconds={"build": 0.0, "total": 0.0}))
    (out / "model.engine").write_bytes(data)  # after the manifest: its hash no longer matches
    if record:
        _rewrite_manifest(out)
    return out


# -- running a case ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared(tmp_path_factory, micro_bundle, hf_checkpoint):
    root = tmp_path_factory.mktemp("bad-inputs")
    pickle_only = root / "pickle-only"
    pickle_only.mkdir()
    shutil.copy(hf_checkpoint("llama") / "config.json", pickle_only)
    (pickle_only / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    return {"micro": micro_bundle("gpt2-micro").path, "hf_llama": hf_checkpoint("llama"), "pickle_only": pickle_only}


@dataclass
class Ctx:
    work: Path
    micro: Path
    hf_llama: Path
    pickle_only: Path
    existing: Path
    not_bundle: Path


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_clearly_and_changes_nothing(case, shared, tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "tensorrt", None)  # the engine cases: no TensorRT here, whatever is installed
    work = tmp_path / "work"
    work.mkdir()
    existing = _write(work / "existing" / "keep.txt", "keep") and work / "existing"
    not_bundle = work / "notbundle"
    _write(not_bundle / "precious.txt", "mine")
    ctx = Ctx(work, shared["micro"], shared["hf_llama"], shared["pickle_only"], existing, not_bundle)
    made = case.make(ctx)
    before = snapshot(work, shared["micro"], shared["hf_llama"])
    assert_refused(made, case.message, case.status)
    assert snapshot(work, shared["micro"], shared["hf_llama"]) == before  # nothing already on disk changed


def test_the_matrix_covers_at_least_forty_cases():
    assert len(CASES) >= 40 and len({c.id for c in CASES}) == len(CASES)
