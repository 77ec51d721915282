"""Engine build on the CPU: limits, profile synthesis and its checks, the dry-run plan, the manifest, every refusal.

The TensorRT build itself runs in tests/runtime/test_trt_backend.py (marked gpu).
"""

from __future__ import annotations

import copy
import json
import shutil
import sys

import onnx
import pytest
import torch
from click.testing import CliRunner

from kvforge.bundle import Bundle, IOSpec, write_manifest
from kvforge.calibration import calibrate
from kvforge.cli import main
from kvforge.errors import KvforgeError, MissingDependencyError
from kvforge.export import export
from kvforge.export.engine import (
    BuildOptions,
    build,
    build_plan,
    check_profiles,
    engine_manifest,
    infer_profile_shapes,
    plan_text,
    resolve_limits,
    synthesize_profiles,
)
from kvforge.export.onnx_export import io_spec
from kvforge.model_defs import ModelConfig

from ..derived_checks import add_raw_adapter, assert_altered_adapter_is_caught, assert_derived


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return export("llama3-micro", tmp_path_factory.mktemp("eng") / "fp32", max_context=256)  # 2 layers, 2 KV heads


@pytest.fixture(scope="module")
def int8(fp32, tmp_path_factory):
    return calibrate(fp32.path, tmp_path_factory.mktemp("eng") / "int8", precision="int8", random_data=True, samples=8, seq_len=32)


@pytest.fixture
def io() -> IOSpec:
    return io_spec(ModelConfig.from_name("llama3-micro"), torch.float32, 256)


@pytest.fixture
def cli():
    runner = CliRunner()
    return lambda *args: runner.invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def no_tensorrt(monkeypatch):
    """`import tensorrt` fails, whatever this machine has installed."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)


# -- limits -----------------------------------------------------------------------------------
def test_limits_default_to_the_bundle_and_refuse_what_no_engine_can_honour(io):
    lim = resolve_limits(io)
    assert (lim.max_batch, lim.max_context, lim.opt_batch, lim.opt_context) == (8, 256, 1, 256)
    lim = resolve_limits(io, max_batch=4, max_context=128, opt_batch=2)
    assert (lim.max_batch, lim.max_context, lim.opt_batch, lim.opt_context) == (4, 128, 2, 128)
    bad = [
        (dict(max_batch=2, opt_batch=4), "--opt-batch 4 exceeds --max-batch 2"),
        (dict(max_context=64, opt_context=65), "--opt-context 65 exceeds --max-context 64"),
        (dict(max_context=512), "--max-context 512 exceeds the bundle's max context 256"),
        (dict(max_context=1), "--max-context must be at least 2"),
        (dict(max_batch=0), "--max-batch must be at least 1"),
    ]
    for kwargs, message in bad:
        with pytest.raises(KvforgeError, match=message):
            resolve_limits(io, **kwargs)
    io.max_context = None
    with pytest.raises(KvforgeError, match="records no max context; pass --max-context"):
        resolve_limits(io)
    assert resolve_limits(io, max_context=100).max_context == 100


def test_builder_options_are_checked():
    with pytest.raises(KvforgeError, match="--builder-optimization-level must be 0..5, got 7"):
        BuildOptions(builder_optimization_level=7)
    with pytest.raises(KvforgeError, match="--hardware-compatibility 'turing_plus' is not one of"):
        BuildOptions(hardware_compatibility="turing_plus")


# -- profiles -----------------------------------------------------------------------------------
def test_prefill_and_decode_profiles_cover_every_input_with_consistent_corners(io):
    profiles = synthesize_profiles(io, resolve_limits(io, max_batch=4, max_context=200, opt_batch=2, opt_context=64))
    assert [(p["index"], p["name"]) for p in profiles] == [(0, "prefill"), (1, "decode")]
    for p in profiles:
        assert list(p["shapes"]) == [t.name for t in io.inputs]  # every input, in IO-spec order
    pre, dec = (p["shapes"] for p in profiles)
    assert pre["input_ids"] == {"min": [1, 1], "opt": [2, 64], "max": [4, 200]}
    assert pre["attention_mask"] == {"min": [1, 1], "opt": [2, 64], "max": [4, 200]}
    assert pre["past_key_values.1.value"] == {"min": [1, 2, 0, 16], "opt": [2, 2, 0, 16], "max": [4, 2, 0, 16]}
    assert dec["input_ids"] == {"min": [1, 1], "opt": [2, 1], "max": [4, 1]}
    assert dec["past_key_values.0.key"] == {"min": [1, 2, 0, 16], "opt": [2, 2, 63, 16], "max": [4, 2, 199, 16]}
    for p in profiles:  # total = past + seq at every corner, never beyond max context
        for point in ("min", "opt", "max"):
            s = p["shapes"]
            total, seq, past = s["attention_mask"][point][1], s["input_ids"][point][1], s["past_key_values.0.key"][point][2]
            assert total == past + seq <= 200, (p["name"], point)
    check_profiles(io, profiles, 200)


def test_capped_caches_get_window_sized_profiles(micro_bundle):
    """qwen2-micro: layer 0 full, layer 1 windowed (6). A capped cache's past is min(past, 6) at every corner,
    and ONNX shape inference brings every present out at min(total, 6)."""
    bundle = micro_bundle("qwen2-micro")
    io = bundle.io
    assert io.windows == [None, 6]
    profiles = synthesize_profiles(io, resolve_limits(io, max_batch=2, max_context=100, opt_context=40))
    pre, dec = (p["shapes"] for p in profiles)
    assert dec["past_key_values.0.key"] == {"min": [1, 1, 0, 16], "opt": [1, 1, 39, 16], "max": [2, 1, 99, 16]}
    assert dec["past_key_values.1.key"] == {"min": [1, 1, 0, 16], "opt": [1, 1, 6, 16], "max": [2, 1, 6, 16]}
    assert pre["past_key_values.1.value"]["max"] == [2, 1, 0, 16]
    assert profiles[1]["dims"]["max"]["total_sequence_length_w6"] == 6
    check_profiles(io, profiles, 100)
    assert infer_profile_shapes(onnx.load(str(bundle.graph_file)), io, profiles) == 6
    profiles[1]["shapes"]["past_key_values.1.key"]["max"][2] = 7
    profiles[1]["shapes"]["past_key_values.1.value"]["max"][2] = 7
    with pytest.raises(KvforgeError, match="past_sequence_length_w6 7 should be 6 \\(a cache capped at 6 positions over 100 tokens\\)"):
        check_profiles(io, profiles, 100)


@pytest.mark.parametrize("edit,message", [
    (lambda p: p[1]["shapes"]["attention_mask"]["max"].__setitem__(1, 257),
     "profile 'decode' max: attention_mask's total_sequence_length 257 != past_sequence_length 255 \\+ sequence_length 1"),
    (lambda p: p[0]["shapes"]["position_ids"]["opt"].__setitem__(0, 3),
     "profile 'prefill' opt: batch_size is 1 in input_ids but 3 in position_ids"),
    (lambda p: [p[0]["shapes"][n]["max"].__setitem__(1, 300) for n in ("input_ids", "attention_mask", "position_ids")],
     "profile 'prefill' max: 300 tokens exceed the max context 256"),
    (lambda p: p[1]["shapes"]["past_key_values.0.key"]["max"].__setitem__(3, 32),
     "past_key_values.0.key dimension 3 is 32, the graph's is fixed at 16"),
    (lambda p: p[0]["shapes"].pop("position_ids"), "profile 'prefill' gives no shapes for the inputs \\['position_ids'\\]"),
])
def test_inconsistent_profiles_are_refused(io, edit, message):
    profiles = synthesize_profiles(io, resolve_limits(io))
    edit(profiles)
    with pytest.raises(KvforgeError, match=message):
        check_profiles(io, profiles, 256)


def test_shape_inference_runs_at_every_corner_and_catches_what_the_graph_cannot_compute(fp32):
    model = onnx.load(str(fp32.graph_file))
    io = fp32.io
    profiles = synthesize_profiles(io, resolve_limits(io))
    assert infer_profile_shapes(model, io, profiles) == 6
    # a profile box whose max corner overlaps prefill and decode: past 255 + seq 256 against a mask of 256
    bad = copy.deepcopy(profiles[:1])
    for name in [t.name for t in io.inputs if t.name.startswith("past_key_values")]:
        bad[0]["shapes"][name]["max"][2] = 255
    bad[0]["dims"]["max"]["past_sequence_length"] = 255
    with pytest.raises(KvforgeError, match="profile 'prefill' at its max point .*past_sequence_length=255.*ONNX shape inference fails.*Incompatible dimensions"):
        infer_profile_shapes(model, io, bad)


def test_the_graph_must_match_the_io_spec(fp32, tmp_path):
    broken = shutil.copytree(fp32.path, tmp_path / "b")
    m = json.loads((broken / "kvforge.json").read_text())
    m["io"]["inputs"][3]["shape"][2] = "past_len"  # a symbol the graph does not use
    m["io"]["outputs"][0]["dtype"] = "float16"
    (broken / "kvforge.json").write_text(json.dumps(m))
    with pytest.raises(KvforgeError) as e:
        build_plan(broken)
    # the unknown symbol is met first, when the profiles are sized
    assert "symbolic dimension 'past_len'" in str(e.value)
    m["io"]["inputs"][3]["shape"][2] = "past_sequence_length"
    (broken / "kvforge.json").write_text(json.dumps(m))
    with pytest.raises(KvforgeError, match="does not match the manifest's IO spec: output logits is float32 in the graph, float16 in the IO spec"):
        build_plan(broken)


# -- the plan -----------------------------------------------------------------------------------
def test_dry_run_prints_the_plan_without_tensorrt(fp32, int8, cli, tmp_path, no_tensorrt):
    out = tmp_path / "never"
    result = cli("build", int8.path, "-o", out, "--dry-run", "--max-batch", 4, "--max-context", 128, "--opt-context", 32,
                 "--timing-cache", tmp_path / "tc.bin")
    assert result.exit_code == 0, result.output
    text = result.output
    assert "profile 0 'prefill' (used when sequence_length > 1):" in text and "profile 1 'decode' (used when sequence_length == 1):" in text
    assert "input_ids                min [1, 1]  opt [1, 32]  max [4, 128]" in text
    assert "past_key_values.1.value  min [1, 2, 0, 16]  opt [1, 2, 31, 16]  max [4, 2, 127, 16]" in text
    assert text.count("past_key_values.") == 8  # 4 cache inputs x 2 profiles
    assert "Q/DQ nodes: QuantizeLinear INT8 x14; DequantizeLinear INT8 x28" in text
    assert "quantization int8 (per-channel weights, per-tensor static activations" in text
    assert "lint: passed (0 errors, 0 warnings)" in text and "shape check: passed" in text
    assert f"timing cache {tmp_path / 'tc.bin'} (new)" in text
    assert "tensorrt: not installed here" in text and "scripts/install.sh --gpu" in text
    assert not out.exists() and not (tmp_path / "tc.bin").exists()

    plan = json.loads(cli("build", fp32.path, "--dry-run", "--json").output)
    assert plan["limits"] == {"max_batch": 8, "max_context": 256, "opt_batch": 1, "opt_context": 256}
    assert [p["name"] for p in plan["profiles"]] == ["prefill", "decode"]
    assert plan["profiles"][1]["shapes"]["attention_mask"]["max"] == [8, 256]
    assert plan["precision"]["quantization"] is None and plan["precision"]["qdq"] == {"QuantizeLinear": {}, "DequantizeLinear": {}}
    assert plan["lint"]["passed"] and plan["shape_check"]["points"] == 6 and plan["tensorrt"]["installed"] is False
    assert plan_text(plan).startswith(f"build plan for {fp32.path}")


@pytest.mark.parametrize("precision,options,expected", [
    ("fp8", dict(activations="static"), {"QuantizeLinear": {"FP8": 14}, "DequantizeLinear": {"FP8": 28}}),
    ("int4", dict(zero_points=False), {"QuantizeLinear": {}, "DequantizeLinear": {"INT4": 14}}),
    # the automatic recipe's blocks with a float minimum: signed codes too (the minimums are an offset table)
    ("int4", {}, {"QuantizeLinear": {}, "DequantizeLinear": {"INT4": 14}}),
])
def test_precision_summary_counts_qdq_by_dtype(fp32, tmp_path, precision, options, expected):
    q = calibrate(fp32.path, tmp_path / precision, precision=precision, random_data=True, samples=4, seq_len=16,
                  **options)
    summary = build_plan(q.path)["precision"]
    assert summary["qdq"] == expected
    assert summary["quantization"] == precision and summary["dtype"] == "float32" and summary["quantized_layers"] == 14


def test_an_engine_bundle_is_not_built_again(fp32, tmp_path):
    engine = _fake_engine_bundle(fp32, tmp_path / "e")
    with pytest.raises(KvforgeError, match="is already a TensorRT engine bundle"):
        build_plan(engine)


# -- refusals of the real build -----------------------------------------------------------------
def test_build_without_tensorrt_says_what_is_missing_and_writes_nothing(fp32, cli, tmp_path, no_tensorrt):
    out, tc = tmp_path / "sub" / "engine", tmp_path / "tc.bin"
    result = cli("build", fp32.path, "-o", out, "--timing-cache", tc, "--quiet")
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == [lines[-1]] and lines[-1].startswith("error: TensorRT (the `tensorrt` Python package) is not available.")
    assert "bash scripts/install.sh --gpu" in lines[-1] and "Traceback" not in result.output
    assert not out.exists() and not tc.exists() and not (tmp_path / "sub").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging directory left either
    with pytest.raises(MissingDependencyError, match="TensorRT"):
        build(fp32.path, out)
    assert not out.exists()


def test_bad_limits_fail_before_any_build(fp32, cli, tmp_path, no_tensorrt):
    out = tmp_path / "engine"
    for args, message in [
        (("--max-batch", 2, "--opt-batch", 3), "error: --opt-batch 3 exceeds --max-batch 2"),
        (("--max-context", 1024), "error: --max-context 1024 exceeds the bundle's max context 256"),
        (("--opt-context", 300), "error: --opt-context 300 exceeds --max-context 256"),
    ]:
        result = cli("build", fp32.path, "-o", out, "--quiet", *args)
        assert result.exit_code == 1 and message in result.output, result.output
        assert "TensorRT" not in result.output  # refused before the dependency check
        assert not out.exists()
    result = cli("build", fp32.path, "--quiet")
    assert result.exit_code == 2 and "missing option -o / --out" in result.output


# -- the manifest -------------------------------------------------------------------------------
FACTS = dict(tensorrt_version="10.13.0.35", gpu_name="NVIDIA H100 80GB HBM3", compute_capability="9.0")


def _engine_manifest(source: Bundle, **overrides):
    limits = {"max_batch": 4, "max_context": 128, "opt_batch": 1, "opt_context": 64}
    io = source.io
    kwargs = dict(
        source_path=str(source.path), **FACTS,
        profiles=synthesize_profiles(io, resolve_limits(io, 4, max_context=128, opt_batch=1, opt_context=64)), limits=limits,
        options={"builder_optimization_level": 3, "hardware_compatibility": "none", "version_compatible": False, "tf32": False},
        timing_cache={"path": "/tmp/tc.bin", "loaded_sha256": None, "saved_sha256": "ab" * 32},
        lint_result=source.manifest["lint"], seconds={"build": 12.5, "total": 14.0},
    )
    kwargs.update(overrides)
    return engine_manifest(source.manifest, **kwargs)


def _fake_engine_bundle(source: Bundle, out, engine_bytes: bytes = b"not a real plan" * 8, **overrides) -> Bundle:
    out.mkdir(parents=True)
    (out / "model.engine").write_bytes(engine_bytes)
    shutil.copy2(source.path / "tokenizer.json", out / "tokenizer.json")
    write_manifest(out, _engine_manifest(source, **overrides))
    return Bundle(out)


def test_engine_manifest_records_the_build(fp32, int8, tmp_path):
    m = _engine_manifest(int8)
    assert m["stage"] == "build" and m["graph"] == "model.engine" and m["external_data"] is None
    assert int8.manifest["graphs"] == {"model": "model.onnx"} and m["graphs"] == {"model": "model.engine"}
    e = m["engine"]
    assert e["tensorrt_version"] == "10.13.0.35"
    assert e["gpu"] == {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
    assert e["strongly_typed"] is True and e["tf32"] is False and e["version_compatible"] is False
    assert e["hardware_compatibility"] == "none" and e["builder_optimization_level"] == 3
    assert [p["name"] for p in e["profiles"]] == ["prefill", "decode"] and e["limits"]["max_context"] == 128
    assert e["source"]["onnx_sha256"] == int8.manifest["files"]["model.onnx"]["sha256"]
    assert e["source"]["bundle"] == str(int8.path) and e["source"]["stage"] == "calibrate"
    assert e["timing_cache"]["saved_sha256"] == "ab" * 32
    assert m["io"]["max_context"] == 128 and int8.manifest["io"]["max_context"] == 256  # the source is not edited
    assert m["precision"] == int8.manifest["precision"] and m["model"] == int8.manifest["model"]
    assert [x["stage"] for x in m["lineage"]] == ["export", "calibrate", "build"]
    assert m["lineage"][-1]["versions"] == {"tensorrt": "10.13.0.35"} and m["lineage"][-1]["options"]["max_batch"] == 4
    assert "validation" not in m and "files" not in m
    other = _engine_manifest(int8, tensorrt_version="11.1.0", compute_capability="8.6", gpu_name="NVIDIA A10",
                             options={"hardware_compatibility": "ampere_plus", "version_compatible": True})
    assert other["engine"]["tensorrt_version"] == "11.1.0" and other["engine"]["gpu"]["compute_capability"] == "8.6"
    assert other["engine"]["hardware_compatibility"] == "ampere_plus" and other["engine"]["version_compatible"] is True

    b = _fake_engine_bundle(fp32, tmp_path / "e")
    assert b.manifest["files"]["model.engine"]["bytes"] == 15 * 8 and b.io.max_context == 128
    b.verify_files()


def test_inspect_shows_the_engine(int8, tmp_path, cli):
    b = _fake_engine_bundle(int8, tmp_path / "eng")
    out = cli("inspect", b.path)
    assert out.exit_code == 0
    text = " ".join(out.output.split())
    assert "engine: TensorRT 10.13.0.35 for NVIDIA H100 80GB HBM3 (compute capability 9.0), max batch 4, max context 128" in text
    assert "profile 0 prefill" in text and "profile 1 decode" in text


# -- the written bundle: what it carries of its source (kvforge/derived.py), through a stand-in TensorRT ------------
@pytest.fixture
def standin_build(monkeypatch):
    """`build` runs against the stand-in TensorRT of the newest described release (tests/runtime/trt_standin.py:
    it parses the graph and serializes a record of the build), on a stand-in GPU."""
    from kvforge import tensorrt_env
    from kvforge.export import engine as engine_mod

    from ..runtime.trt_standin import RELEASES, tensorrt

    trt = tensorrt(RELEASES[-1])
    monkeypatch.setattr(tensorrt_env.TrtLogger, "instance", None)
    monkeypatch.setattr(engine_mod, "require_tensorrt_gpu",
                        lambda: (trt, {"name": "Stand-in GPU", "compute_capability": "9.0", "count": 1}))


def test_an_engine_bundle_carries_its_sources_files_and_adapters_and_hashes_every_file(fp32, standin_build, tmp_path):
    shutil.copytree(fp32.path, tmp_path / "source")
    source = add_raw_adapter(Bundle(tmp_path / "source"))
    assert "adapters/x/adapter.safetensors" in source.manifest["files"]
    engine = build(source.path, tmp_path / "engine", max_batch=2, max_context=64)
    assert engine.manifest["graph"] == "model.engine" and engine.manifest["engine"]["source"]["bundle"] == str(source.path)
    assert engine.manifest["graphs"] == engine.graphs == {"model": "model.engine"}
    assert "config.json" in engine.manifest["files"]  # `kvforge lora add` reads it from an engine bundle too
    assert_derived(source, engine, "build")
    assert_altered_adapter_is_caught(engine, "x")


def test_one_engine_per_graph_is_a_bundle_that_carries_and_hashes_as_well(micro_bundle, standin_build, tmp_path):
    """A vision-language bundle (two graphs: export/engine_graphs.py): the engine bundle opens (its `engine` record
    names the decoder's engine and profiles, as the schema asks), with the source's files and adapters."""
    shutil.copytree(micro_bundle("llava-micro").path, tmp_path / "source")
    source = add_raw_adapter(Bundle(tmp_path / "source"))
    engine = build(source.path, tmp_path / "engine", max_batch=2, max_context=48)
    assert engine.manifest["graphs"] == {"vision": "vision.engine", "decoder": "decoder.engine"}
    assert engine.manifest["engine"]["file"] == engine.manifest["graph"] == "decoder.engine"
    assert engine.manifest["engine"]["profiles"] == engine.manifest["engines"]["decoder"]["profiles"]
    assert_derived(source, engine, "build")
    assert_altered_adapter_is_caught(engine, "x")


@pytest.mark.parametrize("preset, graphs", [
    ("t5-micro", {"encoder": "encoder_model.engine", "decoder": "decoder_model.engine"}),
    ("bert-micro", {"model": "model.engine"}),
])
def test_an_engine_bundle_names_each_engine_by_its_graphs_role(preset, graphs, micro_bundle, standin_build, tmp_path):
    """`graphs` names the engines, one graph's too (the source's ONNX files are not in the engine bundle), and the
    engine bundle opens."""
    source = micro_bundle(preset)
    engine = build(source.path, tmp_path / "engine", max_batch=2, max_context=32)
    assert engine.manifest["graphs"] == Bundle(engine.path).graphs == graphs
    assert {role: g["source_graph"] for role, g in engine.manifest["engines"].items()} == source.graphs
    assert_derived(source, engine, "build")
