"""The tensorrt backend: pure checks and refusals on the CPU; FP32/FP16/INT8/FP8 engines of `tiny` on a GPU.

GPU tests are marked `gpu` and skip, with the reason, only where TensorRT is
not importable or no CUDA GPU is present (tests/conftest.py); everything else
fails loudly.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import re
import shutil
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvforge import metrics, runtime
from kvforge.bundle import Bundle, write_manifest
from kvforge.calibration import calibrate
from kvforge.cli import main
from kvforge.errors import KvforgeError, MissingDependencyError
from kvforge.export import export
from kvforge.export.engine import BuildOptions, build, engine_manifest, resolve_limits, synthesize_profiles
from kvforge.export.onnx_export import io_spec
from kvforge.model_defs import ModelConfig
from kvforge import tensorrt_env
from kvforge.runtime import trt_backend
from kvforge.runtime.trt_backend import BufferPool, check_compatibility, plan_step

from ..conftest import requires_tensorrt_gpu
from .trt_standin import RELEASES, HostCuda, describe, impl_of
from .trt_standin import tensorrt as standin_tensorrt

ENGINE = {"tensorrt_version": "10.13.0.35", "gpu": {"name": "NVIDIA H100", "compute_capability": "9.0"},
          "hardware_compatibility": "none", "version_compatible": False, "source": {"bundle": "runs/tiny-int8"}}


# -- compatibility ------------------------------------------------------------------------------
def test_engines_run_only_where_their_tensorrt_and_gpu_allow():
    check_compatibility(ENGINE, "10.13.0.35", "9.0")
    check_compatibility(ENGINE, "10.13.0", "9.0")  # the build number does not matter
    with pytest.raises(KvforgeError, match=r"built with TensorRT 10.13.0.35 and this machine has TensorRT 10.14.1 .*--version-compatible"
                                           r".*Rebuild it on this machine: kvforge build runs/tiny-int8 -o OUT"):
        check_compatibility(ENGINE, "10.14.1", "9.0")
    with pytest.raises(KvforgeError, match=r"built for compute capability 9.0 \(NVIDIA H100\) and NVIDIA A10 has compute capability 8.6"):
        check_compatibility(ENGINE, "10.13.0.35", "8.6", "NVIDIA A10")
    with pytest.raises(KvforgeError, match=r"TensorRT 10.13.0.35 and this machine has TensorRT 11.0.0 \(.*\); .*compute capability 8.9"):
        check_compatibility(ENGINE, "11.0.0", "8.9")  # both problems in one message

    portable = {**ENGINE, "version_compatible": True, "hardware_compatibility": "ampere_plus"}
    check_compatibility(portable, "10.14.1", "8.6")
    check_compatibility(portable, "11.1.0", "12.0")
    with pytest.raises(KvforgeError, match="version-compatible with TensorRT 10.13.0.35, which runs on 10.13.0.35 or later, and this machine has TensorRT 10.8.0"):
        check_compatibility(portable, "10.8.0", "9.0")
    with pytest.raises(KvforgeError, match="built for Ampere or newer .* compute capability 7.5"):
        check_compatibility(portable, "10.13.0.35", "7.5")
    same = {**ENGINE, "hardware_compatibility": "same_compute_capability"}
    check_compatibility(same, "10.13.0.35", "9.0")
    with pytest.raises(KvforgeError, match="compute capability 10.0"):
        check_compatibility(same, "10.13.0.35", "10.0")


# -- profile choice -------------------------------------------------------------------------------
@pytest.fixture
def micro_io():
    return io_spec(ModelConfig.from_name("mistral-micro"), torch.float32, 256)


def test_each_step_gets_the_profile_whose_box_holds_it(micro_io):
    profiles = synthesize_profiles(micro_io, resolve_limits(micro_io, max_batch=4, max_context=128))
    assert plan_step(profiles, micro_io, 2, 17, 0) == (0, False)  # prefill
    assert plan_step(profiles, micro_io, 2, 128, 0) == (0, False)
    assert plan_step(profiles, micro_io, 4, 1, 17) == (1, False)  # decode
    assert plan_step(profiles, micro_io, 1, 1, 0) == (1, False)  # a one-token prompt: decode's box holds it
    assert plan_step(profiles, micro_io, 1, 5, 10) == (1, True)  # a chunk over a past: token by token through decode
    with pytest.raises(KvforgeError, match=r"batch_size = 5 is outside 1..4 of the engine's 'prefill' profile \(rebuild with a larger --max-batch\)"):
        plan_step(profiles, micro_io, 5, 3, 0)
    with pytest.raises(KvforgeError, match=r"total_sequence_length = 129 is outside 1..128 of the engine's 'decode' profile \(rebuild with a larger --max-context\)"):
        plan_step(profiles, micro_io, 1, 1, 128)
    with pytest.raises(KvforgeError, match="does not fit this engine: sequence_length = 130 is outside 1..128"):
        plan_step(profiles, micro_io, 1, 130, 0)


# -- device buffers (with a fake allocator) ------------------------------------------------------------
class _FakeAlloc:
    def __init__(self):
        self.next, self.live, self.freed = 0x1000, {}, []

    def __call__(self, nbytes):
        alloc = self

        class Buf:
            def __init__(self):
                self.ptr, self.nbytes = alloc.next, nbytes
                alloc.next += nbytes + 0x100
                alloc.live[self.ptr] = nbytes

            def free(self):
                alloc.freed.append(self.ptr)
                del alloc.live[self.ptr]

        return Buf()


def test_cache_buffers_are_reused_only_once_no_cache_holds_them():
    fake = _FakeAlloc()
    pool = BufferPool(fake, keep_idle=1)
    a, lease_a = pool.acquire([1000, 1000])
    b, lease_b = pool.acquire([1000, 1000])
    assert {x.ptr for x in a}.isdisjoint(x.ptr for x in b)  # a live cache's buffers are never handed out again
    del lease_a
    gc.collect()
    c, lease_c = pool.acquire([900, 1200])  # the set of a dropped cache is reused, growing what is too small
    assert c[0] is a[0] and c[1].nbytes >= 2 * 1000 and c[1].ptr not in fake.live.keys() - {c[1].ptr}
    assert len(fake.freed) == 1  # only the grown buffer was reallocated
    d, lease_d = pool.acquire([10, 10])  # neither set is free: a third one
    assert len(pool.sets) == 3
    del lease_b, lease_c, lease_d
    gc.collect()
    _, lease = pool.acquire([10, 10])
    assert len(pool.sets) == 2 and sum(not s.free() for s in pool.sets) == 1  # idle sets beyond keep_idle are released
    assert len(fake.live) == 4
    pool.close()
    assert fake.live == {} and pool.closed


# -- bundles and sessions (no GPU touched) ---------------------------------------------------------
@pytest.fixture(scope="module")
def micro(micro_bundle):
    """mistral-micro's FP32 export, the run's shared one (tests only read it: engine bundles are written beside)."""
    return micro_bundle("mistral-micro")


def _engine_bundle(source: Bundle, out, engine_bytes: bytes = b"\x00plan" * 40, **facts) -> Bundle:
    """An engine bundle whose manifest is what `kvforge build` writes, around bytes that are not a real engine."""
    io = source.io
    limits = resolve_limits(io, 4, max_context=128, opt_batch=1, opt_context=64)
    out.mkdir(parents=True)
    (out / "model.engine").write_bytes(engine_bytes)
    shutil.copy2(source.path / "tokenizer.json", out / "tokenizer.json")
    write_manifest(out, engine_manifest(
        source.manifest, source_path=str(source.path),
        **{"tensorrt_version": "10.13.0.35", "gpu_name": "NVIDIA H100", "compute_capability": "9.0", **facts},
        profiles=synthesize_profiles(io, limits), limits=limits.__dict__,
        options={"builder_optimization_level": 3, "hardware_compatibility": "none", "version_compatible": False, "tf32": False},
        timing_cache=None, lint_result=source.manifest["lint"], seconds={"build": 1.0, "total": 1.0},
    ))
    return Bundle(out)


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)


def test_engine_bundles_load_on_the_tensorrt_backend(micro, tmp_path):
    engine = _engine_bundle(micro, tmp_path / "e")
    assert "tensorrt" in runtime.BACKENDS
    s = runtime.load(engine.path)  # backend="auto"; nothing is touched before activation
    assert s.backend_name == "tensorrt" and not s.backend.active and s.max_context == 128
    assert s.tokenizer is not None
    assert runtime.load(engine.path, backend="tensorrt").backend_name == "tensorrt"
    assert runtime.load(micro.path, backend="tensorrt").backend_name == "tensorrt"  # an ONNX bundle: engine built on activation
    assert runtime.load(micro.path).backend_name == "onnxruntime"
    assert runtime.load(engine.path, backend="torch").backend_name == "torch"  # the reference it was built from
    with pytest.raises(KvforgeError, match="holds a TensorRT engine \\(model.engine\\); it runs on the tensorrt backend"):
        runtime.load(engine.path, backend="onnxruntime")
    with pytest.raises(KvforgeError, match="not a bundle; export it first .* to run it on TensorRT"):
        runtime.load("tiny", backend="tensorrt")


def test_available_backends_lists_tensorrt_only_with_tensorrt_and_a_gpu():
    try:
        tensorrt_env.cuda_device()
        gpu = True
    except MissingDependencyError:
        gpu = False
    expected = importlib.util.find_spec("tensorrt") is not None and gpu
    assert ("tensorrt" in runtime.available_backends()) == expected


def test_activation_without_tensorrt_names_what_is_missing(micro, tmp_path, no_tensorrt, monkeypatch):
    engine = _engine_bundle(micro, tmp_path / "e")
    with pytest.raises(MissingDependencyError, match=r"TensorRT \(the `tensorrt` Python package\) is not available\..*bash scripts/install.sh --gpu"):
        runtime.load(engine.path).activate()

    def no_gpu():
        raise MissingDependencyError("an NVIDIA GPU (no CUDA driver, libcuda, was found)", tensorrt_env.INSTALL)

    monkeypatch.setattr(tensorrt_env, "cuda_device", no_gpu)
    with pytest.raises(MissingDependencyError, match="TensorRT .* is not available. Nor is an NVIDIA GPU .*install.sh --gpu"):
        runtime.load(engine.path).generate("def f(x):", max_new_tokens=2)


def test_damaged_engines_are_refused_before_tensorrt_reads_them(micro, tmp_path, no_tensorrt):
    engine = _engine_bundle(micro, tmp_path / "e")
    path = engine.path / "model.engine"
    data = path.read_bytes()
    path.write_bytes(data[:100])  # truncated
    with pytest.raises(KvforgeError, match="is damaged: model.engine has 100 bytes, the manifest says 200"):
        runtime.load(engine.path).activate()
    path.write_bytes(data[:-1] + b"!")  # same size, other bytes
    with pytest.raises(KvforgeError, match="is damaged: model.engine does not match its recorded sha256"):
        runtime.load(engine.path).activate()
    path.write_bytes(data)
    m = json.loads((engine.path / "kvforge.json").read_text())
    del m["files"]["model.engine"]
    (engine.path / "kvforge.json").write_text(json.dumps(m))
    with pytest.raises(KvforgeError, match="is damaged: 'graph' 'model.engine' is not one of the bundle's recorded files"):
        runtime.load(engine.path).activate()  # the manifest schema (kvforge/manifest.py) refuses it on opening


class _FakeTensorRT:
    """Only a version: any attempt to deserialize would fail with AttributeError, not a KvforgeError."""

    def __init__(self, version):
        self.__version__ = version


@pytest.mark.parametrize("recorded,running,message", [
    ({}, ("10.8.0", "9.0"), "built with TensorRT 10.13.0.35 and this machine has TensorRT 10.8.0"),
    ({"compute_capability": "8.6", "gpu_name": "NVIDIA A10"}, ("10.13.0.35", "9.0"),
     "built for compute capability 8.6 \\(NVIDIA A10\\) and Fake GPU has compute capability 9.0"),
])
def test_incompatible_engines_are_refused_before_deserialization(micro, tmp_path, monkeypatch, recorded, running, message):
    engine = _engine_bundle(micro, tmp_path / "e", **recorded)
    version, cc = running
    monkeypatch.setattr(trt_backend, "require_tensorrt_gpu",
                        lambda: (_FakeTensorRT(version), {"name": "Fake GPU", "compute_capability": cc, "count": 1}))
    with pytest.raises(KvforgeError, match=f"cannot run here: .*{message}"):
        runtime.load(engine.path).activate()


def test_fp8_builds_are_refused_below_compute_capability_8_9(micro, tmp_path, monkeypatch):
    from kvforge.export import engine as engine_mod

    fp8 = calibrate(micro.path, tmp_path / "fp8", precision="fp8", random_data=True, samples=2, seq_len=16)
    int8 = calibrate(micro.path, tmp_path / "int8", precision="int8", random_data=True, samples=2, seq_len=16, kv_cache="fp8")
    monkeypatch.setattr(engine_mod, "require_tensorrt_gpu",
                        lambda: (_FakeTensorRT("10.13.0.35"), {"name": "NVIDIA A100", "compute_capability": "8.0", "count": 1}))
    for bundle in (fp8, int8):  # FP8 weights/activations, or only an FP8 KV cache
        with pytest.raises(KvforgeError, match="FP8 needs a GPU of compute capability 8.9 or newer.*NVIDIA A100 has 8.0"):
            build(bundle.path, tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


def test_cli_takes_tensorrt_and_engine_bundles(micro, tmp_path, no_tensorrt):
    runner = CliRunner()
    engine = _engine_bundle(micro, tmp_path / "e")
    assert "tensorrt" in runner.invoke(main, ["generate", "--help"]).output
    for args in (["generate", str(engine.path), "--prompt", "def f(x):"], ["bench", str(engine.path)],
                 ["generate", str(micro.path), "--prompt", "x", "--backend", "tensorrt"]):
        result = runner.invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 1, result.output
        assert result.output.strip().splitlines()[-1].startswith("error: TensorRT (the `tensorrt` Python package) is not available")
        assert "Traceback" not in result.output


# -- TensorRT itself, release by release, without a GPU ----------------------------------------------
# The stand-in tensorrt module of each described release (tests/runtime/trt_standin.py): its surface is
# the release's own, from TensorRT's binding sources, and its engines run the graph with ONNX Runtime on
# the tensors at the addresses the backend binds. kvforge's build and backend run against every release.
@pytest.fixture
def standin(monkeypatch):
    """Factory: release -> (stand-in tensorrt module, host CUDA), installed where kvforge finds TensorRT and a GPU."""
    from kvforge.export import engine as engine_mod

    def install(release, compute_capability="9.0"):
        trt, cuda = standin_tensorrt(release), HostCuda()
        device = {"name": "Stand-in GPU", "compute_capability": compute_capability, "count": 1}
        monkeypatch.setattr(tensorrt_env.TrtLogger, "instance", None)  # one logger per process: this module's
        monkeypatch.setattr(trt_backend, "require_tensorrt_gpu", lambda: (trt, device))
        monkeypatch.setattr(engine_mod, "require_tensorrt_gpu", lambda: (trt, device))
        monkeypatch.setattr(trt_backend, "_polygraphy_cuda", lambda: cuda)
        return trt, cuda
    return install


def test_the_api_descriptions_say_where_they_come_from():
    assert RELEASES == ["10.16", "11.1"]  # the newest 10.x and the newest release (scripts/trt_api.py)
    for release in RELEASES:
        d = describe(release)
        assert d["tag"] == f"v{release}" and len(d["commit"]) == 40 and d["generated_by"] == "scripts/trt_api.py"
        assert not d["unparsed"] and any(s.endswith("pyCore.cpp") for s in d["sources"])
    old, new = describe("10.16"), describe("11.1")
    # what weak typing's removal took away, and what kvforge relies on staying
    assert "FP16" in old["enums"]["BuilderFlag"]["members"] and "FP16" not in new["enums"]["BuilderFlag"]["members"]
    assert "EXPLICIT_BATCH" in old["enums"]["NetworkDefinitionCreationFlag"]["members"]
    assert "EXPLICIT_BATCH" not in new["enums"]["NetworkDefinitionCreationFlag"]["members"]
    for d in (old, new):
        assert {"TF32", "VERSION_COMPATIBLE"} <= set(d["enums"]["BuilderFlag"]["members"])
        assert [a["name"] for a in d["classes"]["IBuilderConfig"]["methods"]["set_timing_cache"][0]["args"]] == ["cache", "ignore_mismatch"]


@pytest.mark.parametrize("release", RELEASES)
def test_the_stand_in_refuses_what_the_release_does_not_have(standin, release):
    """Deliberate misuse raises as TensorRT would: so kvforge code that did it would fail this suite."""
    trt, _ = standin(release)
    log = tensorrt_env.TrtLogger.get(trt)
    builder = trt.Builder(log)
    config = builder.create_builder_config()
    with pytest.raises(TypeError, match="set_timing_cache\\(\\): incompatible function arguments"):
        config.set_timing_cache(config.create_timing_cache(b""), ignore_mismatches=False)  # a misspelt keyword
    with pytest.raises(TypeError, match="incompatible function arguments"):
        builder.create_optimization_profile(0)  # an argument the method does not take
    with pytest.raises(AttributeError, match="'tensorrt.IBuilderConfig' object has no attribute 'max_workspace_size'"):
        config.max_workspace_size = 1 << 30  # removed in TensorRT 10
    with pytest.raises(AttributeError, match="property 'num_inputs' of 'tensorrt.INetworkDefinition' object has no setter"):
        builder.create_network(0).num_inputs = 3  # read-only
    with pytest.raises(AttributeError, match="has no attribute 'Builderr'"):
        trt.Builderr
    with pytest.raises(TypeError, match="No constructor defined"):
        trt.ICudaEngine()
    if release.startswith("11"):  # removed with weak typing
        with pytest.raises(AttributeError):
            trt.BuilderFlag.FP16
        with pytest.raises(AttributeError):
            trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH
    else:
        config.set_flag(trt.BuilderFlag.FP16)


def _misuse(monkeypatch, old: str, new: str) -> None:
    """Rewrite one call in kvforge's engine build, as a careless edit would."""
    import inspect
    import textwrap

    from kvforge.export import engine as engine_mod
    from kvforge.export import engine_plan

    source = textwrap.dedent(inspect.getsource(engine_plan.compile_engine))
    assert old in source
    namespace = dict(engine_plan.__dict__)
    exec(compile(source.replace(old, new), engine_plan.__file__, "exec"), namespace)
    monkeypatch.setattr(engine_mod, "compile_engine", namespace["compile_engine"])


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("old, new, fails_on", [
    ("ignore_mismatch=False", "ignore_mismatches=False", {"10.16", "11.1"}),  # an argument name misspelt
    ("trt.BuilderFlag.VERSION_COMPATIBLE", "trt.BuilderFlag.FP16", {"11.1"}),  # a flag TensorRT 11 removed
    ("builder.create_builder_config()", "builder.create_builder_config(network)", {"10.16", "11.1"}),
])
def test_a_misuse_in_the_build_code_fails_the_build(micro, standin, monkeypatch, tmp_path, release, old, new, fails_on):
    standin(release)
    _misuse(monkeypatch, old, new)
    options = BuildOptions(version_compatible=True)
    if release in fails_on:
        with pytest.raises((TypeError, AttributeError)):
            build(micro.path, tmp_path / "e", max_batch=2, max_context=32, options=options)
        assert not (tmp_path / "e").exists()
    else:
        assert Bundle.is_bundle(build(micro.path, tmp_path / "e", max_batch=2, max_context=32, options=options).path)


@pytest.mark.parametrize("release", RELEASES)
def test_build_settings_reach_tensorrt_as_each_release_takes_them(micro, standin, tmp_path, release):
    trt, _ = standin(release)
    cache = tmp_path / "timing.cache"
    options = BuildOptions(builder_optimization_level=2, hardware_compatibility="ampere_plus", version_compatible=True,
                           timing_cache=str(cache))
    engine = build(micro.path, tmp_path / "e", max_batch=2, max_context=64, options=options)
    plan = trt._state.plans[-1]
    assert plan["strongly_typed"]  # 10.x: the STRONGLY_TYPED flag was passed; 11: always
    assert "TF32" not in plan["flags"] and "VERSION_COMPATIBLE" in plan["flags"]  # TF32 off unless --tf32
    assert plan["builder_optimization_level"] == 2 and plan["hardware_compatibility_level"] == "AMPERE_PLUS"
    assert len(plan["profiles"]) == 2 and all(set(p) == {t.name for t in micro.io.inputs} for p in plan["profiles"])
    m = engine.manifest["engine"]
    assert m["tensorrt_version"] == trt.__version__ and m["version_compatible"]
    # the timing cache goes back to TensorRT on the next build; one from another release is refused
    saved = m["timing_cache"]["saved_sha256"]
    again = build(micro.path, tmp_path / "e2", max_batch=2, max_context=64, options=options)
    assert again.manifest["engine"]["timing_cache"]["loaded_sha256"] == saved
    other = standin_tensorrt(next(r for r in RELEASES if r != release))
    foreign = other.Builder(tensorrt_env.TrtLogger.get(trt)).create_builder_config().create_timing_cache(b"")
    cache.write_bytes(bytes(foreign.serialize()))
    with pytest.raises(KvforgeError, match="was written by another TensorRT version or GPU"):
        build(micro.path, tmp_path / "e3", max_batch=2, max_context=64, options=options)
    with runtime.load(engine.path) as s:  # a version-compatible plan: the runtime lets it bring its host code
        assert s.backend.runtime.engine_host_code_allowed


@pytest.mark.parametrize("release", RELEASES)
def test_build_then_run_on_a_stand_in_tensorrt_matches_onnxruntime(micro, standin, tmp_path, release):
    """Inputs, cache hand-over (capped caches: mistral-micro's window is 8), profile choice, last-row logits,
    chunked steps and buffer reuse, against ORT, through an engine kvforge built with this release's API."""
    trt, cuda = standin(release)
    engine = build(micro.path, tmp_path / "e", max_batch=4, max_context=128, opt_context=64)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 259, (2, 9), dtype=np.int64)
    with runtime.load(engine.path) as s, runtime.load(micro.path, variant=False) as ref:
        ctx = impl_of(s.backend.context)
        logits, cache = s.forward(ids)
        want, ref_cache = ref.forward(ids)
        np.testing.assert_array_equal(logits, want)
        for a, b in zip(s.backend.cache_arrays(cache), ref.backend.cache_arrays(ref_cache)):
            np.testing.assert_array_equal(a, b)
        assert ctx.profile == 0
        step, cache2 = s.forward(ids[:, :1], cache=cache, last_logits_only=True)
        want_step, _ = ref.forward(ids[:, :1], cache=ref_cache)
        np.testing.assert_array_equal(step, want_step)
        assert ctx.profile == 1 and cache2.length == 10
        assert [a.shape[2] for a in s.backend.cache_arrays(cache2)] == [8] * 4  # capped at the window
        last, _ = s.forward(ids, last_logits_only=True)  # only each row's last position comes back
        np.testing.assert_array_equal(last, want[:, -1:])
        chunked, c = s.forward(ids[:, 4:], cache=s.forward(ids[:, :4])[1])  # a chunk over a past: token by token
        np.testing.assert_allclose(chunked, want[:, 4:], atol=1e-5, rtol=0)
        assert c.length == 9
        prompts = [[5, 77, 123, 9], [250, 31], [7]]
        before = cuda.allocations
        got = s.generate(prompts, max_new_tokens=40, ignore_eos=True)
        assert [r.tokens for r in got] == [r.tokens for r in ref.generate(prompts, max_new_tokens=40, ignore_eos=True)]
        # 40 steps x 4 cache tensors, yet at most two sets of 4 cache buffers and a few scratch ones are allocated
        assert cuda.allocations - before <= 2 * 4 + 4, cuda.allocations - before
        with pytest.raises(KvforgeError, match="batch_size = 5 is outside 1..4"):
            s.forward(np.zeros((5, 3), np.int64))
    assert cuda.live == {} and ctx.switches >= 2
    with s:
        with pytest.raises(KvforgeError, match="made before the session was last deactivated"):
            s.forward(ids[:, :1], cache=cache)


def test_continuous_batching_on_a_stand_in_engine_matches_onnxruntime(micro, standin, tmp_path):
    """Rows joining and leaving a batch on TensorRT: caches regrouped through host copies into pool buffers."""
    standin(RELEASES[-1])
    engine = build(micro.path, tmp_path / "e", max_batch=4, max_context=128, opt_context=64)
    prompts = [[5, 77, 123, 9], [250, 31], [7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11]]
    options = [dict(max_new_tokens=10 + 5 * i, ignore_eos=True) for i in range(len(prompts))]
    with runtime.load(engine.path) as s, runtime.load(micro.path, variant=False) as ref:
        with runtime.Batcher(s, max_batch=3) as batcher:
            requests = [batcher.submit(p, **o) for p, o in zip(prompts, options)]
            got = [r.result(timeout=300).tokens for r in requests]
            assert batcher.peak_batch == 3
        assert got == [ref.generate(p, **o).tokens for p, o in zip(prompts, options)]


def test_speculative_decoding_on_a_stand_in_engine_matches_onnxruntime(micro, standin, tmp_path):
    """Verification steps of several tokens over a past and their rollback through host copies (the base
    Backend.rollback) on TensorRT: drafted by an ONNX Runtime session of the same model, the engine's greedy
    tokens are ONNX Runtime's plain ones."""
    standin(RELEASES[-1])
    engine = build(micro.path, tmp_path / "e", max_batch=4, max_context=128, opt_context=64)
    prompt = [5, 77, 123, 9, 5, 77, 123, 9, 5, 77]
    with runtime.load(engine.path) as s, runtime.load(micro.path, variant=False) as ref:
        for spec in ({"method": "draft", "draft": ref, "k": 3}, {"method": "prompt-lookup", "k": 5}):
            got = s.generate(prompt, max_new_tokens=30, ignore_eos=True, speculative=spec)
            assert got.tokens == ref.generate(prompt, max_new_tokens=30, ignore_eos=True).tokens
            assert got.speculation["drafted"] > 0


@pytest.mark.slow  # Mistral with adapter slots: a structure no default test traces (8 s); the default tier keeps
# adapters through ONNX Runtime (tests/runtime/test_lora_runtime.py) and the stand-in engine's other paths here
def test_lora_adapters_on_a_stand_in_engine_match_onnxruntime(standin, tmp_path):
    """A bundle with LoRA slots built into an engine (profiles over lora_width): rows with different adapters and
    none, prefill and decode, equal ONNX Runtime on the bundle; each set of adapters goes to the device once."""
    from kvforge.adapters import list_adapters, lora_spec, write_adapter

    _, cuda = standin(RELEASES[-1])
    bundle = export("mistral-micro", tmp_path / "slots", lora_max_rank=4)
    rng = np.random.default_rng(1)
    for name, rank in (("a", 2), ("b", 4)):
        slots = {slot: ((0.2 * rng.standard_normal((fan_in, rank))).astype(np.float32),
                        (0.2 * rng.standard_normal((rank, fan_out))).astype(np.float32))
                 for slot, (fan_in, fan_out) in lora_spec(bundle)["slots"].items()}
        write_adapter(bundle, name, slots, {"source": "random"})
    engine = build(bundle.path, tmp_path / "e", max_batch=4, max_context=64, opt_context=32)
    ids = rng.integers(0, 259, (3, 6), dtype=np.int64)
    rows = ["a", None, "b"]
    with runtime.load(engine.path) as s, runtime.load(bundle.path, variant=False) as ref:
        logits, cache = s.forward(ids, adapters=rows)
        want, ref_cache = ref.forward(ids, adapters=rows)
        np.testing.assert_allclose(logits, want, atol=1e-5, rtol=0)
        base, _ = ref.forward(ids)
        assert np.abs(want[0] - base[0]).max() > 1e-2 and np.abs(want[2] - base[2]).max() > 1e-2
        np.testing.assert_allclose(logits[1], base[1], atol=1e-5, rtol=0)  # the row without an adapter
        before = cuda.allocations
        for i in range(3):
            step, cache = s.forward(ids[:, i:i + 1], cache=cache, adapters=rows)
            want_step, ref_cache = ref.forward(ids[:, i:i + 1], cache=ref_cache, adapters=rows)
            np.testing.assert_allclose(step, want_step, atol=1e-5, rtol=0)
        assert cuda.allocations - before <= 2 * 4 + 4  # the cache's buffers: the adapters were not uploaded again
        got = s.generate([[5, 77, 123], [9, 9]], max_new_tokens=12, ignore_eos=True, adapter="b")
        assert [r.tokens for r in got] == [r.tokens for r in ref.generate([[5, 77, 123], [9, 9]], max_new_tokens=12,
                                                                          ignore_eos=True, adapter="b")]
    # the engine bundle holds the adapters it was built with, and takes more without a rebuild
    assert sorted(a.name for a in list_adapters(engine)) == ["a", "b"]
    write_adapter(engine, "c", slots, {"source": "random"})
    with runtime.load(engine.path) as s, runtime.load(bundle.path, variant=False) as ref:
        write_adapter(bundle, "c", slots, {"source": "random"})
        np.testing.assert_allclose(s.forward(ids, adapters=["c"] * 3)[0], ref.forward(ids, adapters=["c"] * 3)[0],
                                   atol=1e-5, rtol=0)


def test_an_engine_of_another_release_is_refused(micro, standin, tmp_path):
    standin("10.16")
    engine = build(micro.path, tmp_path / "e", max_batch=2, max_context=32)
    standin("11.1")
    with pytest.raises(KvforgeError, match="built with TensorRT 10.16.0.72 and this machine has TensorRT 11.1.0.106"):
        runtime.load(engine.path).activate()


@pytest.mark.parametrize("damage,message", [
    ("random-bytes", r"TensorRT 10\.16\.0\.72 cannot deserialize .*model\.engine: .*Serialization assertion magicTagRead"),
    ("other-gpu", r"cannot run here: .*built for compute capability 8\.0 \(Stand-in GPU\) and Stand-in GPU has compute capability 9\.0"),
])
def test_engines_tensorrt_cannot_run_are_refused_in_one_line_from_the_cli(micro, standin, tmp_path, damage, message):
    """The bad-input matrix's engine cases where TensorRT is present: bytes that are no plan (their hash
    recorded, so only TensorRT can tell) and an engine built on another GPU; one line, nothing changed."""
    standin("10.16", compute_capability="8.0" if damage == "other-gpu" else "9.0")
    engine = build(micro.path, tmp_path / "e", max_batch=2, max_context=32)
    if damage == "random-bytes":
        (engine.path / "model.engine").write_bytes(np.random.default_rng(0).bytes(4096))
        write_manifest(engine.path, {k: v for k, v in engine.manifest.items() if k not in ("format", "format_version", "files")})
    else:
        standin("10.16", compute_capability="9.0")
    before = {p.name: p.read_bytes() for p in engine.path.iterdir()}
    result = CliRunner().invoke(main, ["generate", str(engine.path), "--prompt", "x", "--max-new-tokens", "2"])
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert len(errors) == 1 and re.search(message, errors[0]), result.output
    assert {p.name: p.read_bytes() for p in engine.path.iterdir()} == before


# =========================== GPU: real engines of tiny ===========================================
PROMPT = "def fibonacci(n):\n    if n"
MAX_CONTEXT = 512
# Tolerances of the engine against ONNX Runtime running the same graph on the CPU (the same function: only
# kernels and fusions differ). Against the FP32 Torch reference the engine must be about as close as ONNX
# Runtime is (docs/design.md: the CPU measures what a precision costs, the GPU only adds kernel differences):
# rel L2 within ORT's + the ORT tolerance, top-1 within 1 - ort_top1 of ORT's, KL within 1.5x ORT's + 1e-4.
TOL = {
    "fp32": {"ort_rel_l2": 1e-4, "ort_top1": 0.998, "greedy_equal": True},
    "fp16": {"ort_rel_l2": 1e-2, "ort_top1": 0.98, "greedy_equal": False},
    "int8": {"ort_rel_l2": 5e-2, "ort_top1": 0.95, "greedy_equal": False},
    "fp8": {"ort_rel_l2": 5e-2, "ort_top1": 0.95, "greedy_equal": False},
}
DECODE_VS_PREFILL_REL_L2 = {"fp32": 1e-4, "fp16": 1e-2, "int8": 3e-2, "fp8": 3e-2}


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    """ONNX bundles of tiny: FP32 and FP16 exports, INT8 and FP8 calibrations of the FP32 one."""
    root = tmp_path_factory.mktemp("tiny-trt")
    fp32 = export("tiny", root / "fp32")
    return {
        "fp32": fp32,
        "fp16": export("tiny", root / "fp16", dtype="float16"),
        "int8": calibrate(fp32.path, root / "int8", recipe="fixed", precision="int8", method="mse", samples=32, seq_len=128),
        "fp8": calibrate(fp32.path, root / "fp8", precision="fp8", samples=32, seq_len=128),
    }


@pytest.fixture(scope="module")
def tiny_engines(tiny_onnx, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-engines")
    cache = root / "timing.cache"
    engines = {}
    for precision, bundle in tiny_onnx.items():
        if precision == "fp8" and _cc() < (8, 9):
            continue
        engines[precision] = build(bundle.path, root / precision, max_batch=8, max_context=MAX_CONTEXT, opt_context=64,
                                   options=_options(timing_cache=str(cache)))
    return engines


def _options(**kw):
    from kvforge.export.engine import BuildOptions

    return BuildOptions(**kw)


def _cc() -> tuple[int, int]:
    major, minor = tensorrt_env.cuda_device()["compute_capability"].split(".")
    return int(major), int(minor)


def _teacher_forced(session, ids: list[int], steps: list[int]) -> np.ndarray:
    """Prefill `ids`, then feed `steps` one by one through the decode path; logits (len(steps) + 1, V)."""
    logits, cache = session.forward(np.array([ids], np.int64), last_logits_only=True)
    out = [logits[0, -1]]
    for t in steps:
        step, cache = session.forward(np.array([[t]], np.int64), cache=cache)
        out.append(step[0, -1])
    return np.stack(out)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "fp8"])
@pytest.mark.gpu
@pytest.mark.slow
@requires_tensorrt_gpu
def test_engine_computes_what_onnxruntime_and_the_reference_compute(tiny_onnx, tiny_engines, precision):
    from kvforge.model_defs.evaluate import heldout_text
    from kvforge.runtime.evaluate import window_logits

    if precision == "fp8" and _cc() < (8, 9):
        pytest.skip(f"FP8 needs compute capability >= 8.9; this GPU has {_cc()}")
    tol = TOL[precision]
    engine = tiny_engines[precision]
    m = engine.manifest
    assert m["engine"]["gpu"]["compute_capability"] == tensorrt_env.cuda_device()["compute_capability"]
    assert [p["name"] for p in m["engine"]["profiles"]] == ["prefill", "decode"] and m["io"]["max_context"] == MAX_CONTEXT

    with runtime.load(engine.path) as trt, runtime.load(tiny_onnx[precision].path, device="cpu") as ort, runtime.load("tiny", backend="torch") as ref:
        assert trt.backend_name == "tensorrt" and ort.backend_name == "onnxruntime"
        chunks = metrics.windows(trt.encode(heldout_text())[:1 + 4 * 256], 256)
        for (t, _), (o, _), (r, _) in zip(window_logits(trt, chunks, 4), window_logits(ort, chunks, 4), window_logits(ref, chunks, 4)):
            vs_ort, vs_ref, ort_vs_ref = metrics.logits_metrics(t, o), metrics.logits_metrics(t, r), metrics.logits_metrics(o, r)
            assert vs_ort["rel_l2"] <= tol["ort_rel_l2"] and vs_ort["top1_agreement"] >= tol["ort_top1"], vs_ort
            assert vs_ref["rel_l2"] <= ort_vs_ref["rel_l2"] + tol["ort_rel_l2"], (vs_ref, ort_vs_ref)
            assert vs_ref["top1_agreement"] >= ort_vs_ref["top1_agreement"] - (1 - tol["ort_top1"]), (vs_ref, ort_vs_ref)
            assert vs_ref["kl_divergence_mean"] <= 1.5 * ort_vs_ref["kl_divergence_mean"] + 1e-4, (vs_ref, ort_vs_ref)

        # generation: the same features as every backend, through Session
        got, want = trt.generate(PROMPT, max_new_tokens=24, ignore_eos=True), ort.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
        assert len(got.tokens) == 24 and got.text == trt.tokenizer.decode(got.tokens)
        if tol["greedy_equal"]:
            assert got.tokens == want.tokens == ref.generate(PROMPT, max_new_tokens=24, ignore_eos=True).tokens
        # decode steps (cache on the device, decode profile) against one prefill over the same tokens (prefill profile)
        ids = trt.encode(PROMPT)
        stepped = _teacher_forced(trt, ids, want.tokens[:-1])
        whole, _ = trt.forward(np.array([ids + want.tokens[:-1]], np.int64))
        assert metrics.rel_l2(stepped, whole[0, len(ids) - 1:]) <= DECODE_VS_PREFILL_REL_L2[precision]
        forced = metrics.top1_agreement(stepped, _teacher_forced(ort, ids, want.tokens[:-1]))
        assert forced >= tol["ort_top1"], forced


@pytest.mark.gpu
@pytest.mark.slow
@requires_tensorrt_gpu
def test_cache_batches_chunks_and_limits_on_an_fp32_engine(tiny_onnx, tiny_engines):
    engine = tiny_engines["fp32"]
    prompts = ["def add(a, b):", "class Stack:\n    def push(self, x):", "import os"]
    with runtime.load(engine.path) as trt, runtime.load(tiny_onnx["fp32"].path, device="cpu") as ort:
        ids = np.array([trt.encode(PROMPT)], np.int64)
        logits, cache = trt.forward(ids)
        ref, ref_cache = ort.forward(ids)
        for a, b in zip(trt.backend.cache_arrays(cache), ort.backend.cache_arrays(ref_cache)):
            assert a.shape == b.shape == (1, 4, ids.shape[1], 32)
            assert metrics.max_abs(a, b) <= 1e-4
        # a chunk over a past runs token by token through the decode profile
        head, tail = ids[:, :5], ids[:, 5:]
        _, c = trt.forward(head)
        chunked, c = trt.forward(tail, cache=c)
        assert c.length == ids.shape[1] and metrics.rel_l2(chunked, logits[:, 5:]) <= 1e-4
        # left-padded batches give each row what it gets alone
        batched = trt.generate(prompts, max_new_tokens=12, ignore_eos=True)
        assert [r.tokens for r in batched] == [trt.generate(p, max_new_tokens=12, ignore_eos=True).tokens for p in prompts]
        assert [r.tokens for r in batched] == [r.tokens for r in ort.generate(prompts, max_new_tokens=12, ignore_eos=True)]
        with pytest.raises(KvforgeError, match="batch_size = 9 is outside 1..8 .* --max-batch"):
            trt.forward(np.zeros((9, 4), np.int64))
        with pytest.raises(KvforgeError, match=f"exceeds the bundle's maximum of {MAX_CONTEXT}"):
            trt.forward(np.zeros((1, MAX_CONTEXT + 1), np.int64))
    with pytest.raises(KvforgeError, match="not active"):
        trt.backend.forward(ids, np.ones_like(ids), np.arange(ids.shape[1])[None], cache)
    tc = engine.manifest["engine"]["timing_cache"]
    assert tc["saved_sha256"] and tiny_engines["fp16"].manifest["engine"]["timing_cache"]["loaded_sha256"]  # reused across builds


@pytest.mark.gpu
@pytest.mark.slow
@requires_tensorrt_gpu
def test_engine_errors_on_a_real_gpu_are_clear(tiny_engines, tmp_path):
    engine = tiny_engines["fp32"]
    # a corrupt engine whose manifest hash matches: TensorRT refuses it, kvforge says so
    bad = shutil.copytree(engine.path, tmp_path / "bad")
    data = (bad / "model.engine").read_bytes()
    (bad / "model.engine").write_bytes(data[: len(data) // 2])
    m = json.loads((bad / "kvforge.json").read_text())
    del m["files"]["model.engine"]
    write_manifest(bad, {k: v for k, v in m.items() if k not in ("format", "format_version", "files")})
    with pytest.raises(KvforgeError, match="cannot deserialize"):
        runtime.load(bad).activate()
    # an engine recorded for another TensorRT
    old = shutil.copytree(engine.path, tmp_path / "old")
    m = json.loads((old / "kvforge.json").read_text())
    m["engine"]["tensorrt_version"] = "8.6.1"
    (old / "kvforge.json").write_text(json.dumps(m))
    with pytest.raises(KvforgeError, match="built with TensorRT 8.6.1 and this machine has TensorRT"):
        runtime.load(old).activate()
    assert "tensorrt" in runtime.available_backends()
