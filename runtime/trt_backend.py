"""TensorRT backend: one strongly typed engine with a prefill and a decode profile; the KV cache stays on the GPU.

Each step copies the (small) int64 inputs to the device, binds the previous
step's `present` buffers as this step's `past` inputs (no host round trip),
runs `execute_async_v3` on the backend's CUDA stream and copies back only the
logits that were asked for. Profile 0 serves prefill (sequence_length > 1,
past 0), profile 1 decode (sequence_length 1); the engine's manifest records
both, and the backend picks one per step. A step with sequence_length > 1
over a non-empty cache fits neither profile box, so it runs token by token
through the decode profile (same arithmetic: attention is causal).

The graph writes the whole cache, past + new, into each `present` output, so
a step needs output buffers other than its inputs. Caches own their device
buffers through a lease: a buffer set is reused once no cache refers to it
any more, so a generation loop that drops each cache as it goes ping-pongs
between two sets, each grown geometrically as the context grows.

Nothing here imports TensorRT or touches the GPU before `activate()`; the
checks that need neither (engine file hash and size, TensorRT version and
compute capability against the manifest, profile choice, buffer reuse) are
pure functions, tested on the CPU. CUDA memory and streams come from
Polygraphy's CUDA helpers (`polygraphy.cuda`); no Torch on this path.
"""

from __future__ import annotations

import hashlib
import json
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvforge.adapters import LORA_WIDTH
from kvforge.bundle import BATCH, Bundle
from kvforge.cache import cache_dir
from kvforge.errors import KvforgeError, MissingDependencyError
from kvforge.tensorrt_env import (
    DECODE, PREFILL, TrtLogger, check_compatibility, concrete_shape, is_engine_bundle, require_tensorrt_gpu,
)

from .backend import Backend, KVCache

_ALIGN = 256  # TensorRT wants 256-byte aligned tensor addresses; cudaMalloc gives that
LORA_SETS = 2  # sets of adapters whose device copies are kept (each set is up to max_batch adapters)
CACHE_GRANULE = 128  # cache buffers are sized in steps of this many tokens (then doubled as needed)


def _polygraphy_cuda():
    """polygraphy.cuda with the CUDA runtime library loaded."""
    try:
        from polygraphy import cuda
        from polygraphy.exception import PolygraphyException
    except ImportError as e:
        raise MissingDependencyError("polygraphy (TensorRT's CUDA helpers)", "Install it with `bash scripts/install.sh --gpu`.") from e
    try:
        cuda.wrapper()
    except (OSError, PolygraphyException) as e:
        raise MissingDependencyError(
            f"the CUDA runtime library, libcudart ({e})",
            "TensorRT's wheels normally bring it; otherwise `pip install nvidia-cuda-runtime-cu12` or add the CUDA toolkit's lib64 to LD_LIBRARY_PATH.",
        ) from e
    return cuda


def step_shapes(io, batch: int, seq: int, past: int, extra: dict[str, int] | None = None) -> dict[str, tuple[int, ...]]:
    """The step's input shapes; `extra` sizes dimensions the step's inputs have beyond batch and lengths (a LoRA
    step's lora_width)."""
    values = {**io.dim_values(batch, seq, past), **(extra or {})}
    return {t.name: concrete_shape(t.shape, values, t.name) for t in io.inputs}


def _violation(profile: dict, shapes: dict[str, tuple[int, ...]], io) -> str | None:
    """None when every input shape lies in the profile's [min, max] box, else what lies outside."""
    for name, box in profile["shapes"].items():
        actual = shapes.get(name)
        if actual is None:
            continue
        for axis, (v, lo, hi) in enumerate(zip(actual, box["min"], box["max"])):
            if not lo <= v <= hi:
                dim = io.input(name).shape[axis]
                what = f"{dim} = {v}" if isinstance(dim, str) else f"dimension {axis} of {name} = {v}"
                flag = "--max-batch" if dim in (BATCH, LORA_WIDTH) else "--max-context"
                return f"{what} is outside {lo}..{hi} of the engine's {profile['name']!r} profile (rebuild with a larger {flag})"
    return None


def plan_step(profiles: list[dict], io, batch: int, seq: int, past: int,
              extra: dict[str, int] | None = None) -> tuple[int, bool]:
    """(profile index, stepwise) for a step of `seq` tokens over a past of `past`.

    Decode (seq == 1) prefers the decode profile, anything longer the prefill
    profile; a step no profile box holds (seq > 1 over a non-empty past) runs
    token by token through the decode profile when its first and last tokens fit.
    """
    by_name = {p["name"]: i for i, p in enumerate(profiles)}
    order = [DECODE, PREFILL] if seq == 1 else [PREFILL, DECODE]
    order = [by_name[n] for n in order if n in by_name] + [i for i in range(len(profiles)) if profiles[i]["name"] not in order]
    shapes = step_shapes(io, batch, seq, past, extra)
    for i in order:
        if _violation(profiles[i], shapes, io) is None:
            return i, False
    if seq > 1 and DECODE in by_name:
        i = by_name[DECODE]
        first, last = step_shapes(io, batch, 1, past, extra), step_shapes(io, batch, 1, past + seq - 1, extra)
        if _violation(profiles[i], first, io) is None and _violation(profiles[i], last, io) is None:
            return i, True
    raise KvforgeError(f"a step of batch {batch}, {seq} new tokens over a past of {past} does not fit this engine: "
                       + _violation(profiles[order[0]], shapes, io))


def verify_engine_file(bundle: Bundle) -> None:
    """Size and sha256 of every file against the manifest, before TensorRT sees a byte of the engine."""
    graph = bundle.manifest.get("graph")
    if graph not in bundle.manifest.get("files", {}):
        raise KvforgeError(f"bundle {bundle.path} is damaged: the manifest records no size or hash for its engine {graph!r}")
    bundle.verify_files()


# -- device buffers ----------------------------------------------------------------------
class _Lease:
    """Held by every tensor of one cache; once the last goes, the buffer set it used is free again."""

    __slots__ = ("pool", "__weakref__")

    def __init__(self, pool):
        self.pool = pool


@dataclass(eq=False)
class DeviceTensor:
    """A contiguous tensor at the start of a device buffer (ptr 0: empty, no memory)."""

    ptr: int
    shape: tuple[int, ...]
    dtype: np.dtype
    lease: _Lease | None = None

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


class _BufferSet:
    def __init__(self):
        self.buffers: list = []
        self.lease: weakref.ref | None = None

    def free(self) -> bool:
        return self.lease is None or self.lease() is None


class BufferPool:
    """Buffer sets for cache outputs, reused once no live cache holds them.

    alloc(nbytes) returns an object with `ptr`, `nbytes` and `free()`.
    """

    def __init__(self, alloc: Callable[[int], Any], keep_idle: int = 2):
        self.alloc = alloc
        self.keep_idle = keep_idle
        self.sets: list[_BufferSet] = []
        self.closed = False

    def acquire(self, sizes: list[int]) -> tuple[list, _Lease]:
        """Buffers of at least `sizes` bytes that no live cache uses, and the lease the new cache must hold."""
        chosen = next((s for s in self.sets if s.free()), None)
        if chosen is None:
            chosen = _BufferSet()
            self.sets.append(chosen)
        for i, need in enumerate(sizes):
            need = max(need, _ALIGN)
            if i < len(chosen.buffers) and chosen.buffers[i].nbytes >= need:
                continue
            old = chosen.buffers[i].nbytes if i < len(chosen.buffers) else 0
            if i < len(chosen.buffers):
                chosen.buffers[i].free()
            buf = self.alloc(max(need, 2 * old))  # geometric growth: few reallocations as the context grows
            if i < len(chosen.buffers):
                chosen.buffers[i] = buf
            else:
                chosen.buffers.append(buf)
        lease = _Lease(self)
        chosen.lease = weakref.ref(lease)
        idle = [s for s in self.sets if s.free()]
        for s in idle[self.keep_idle:]:
            for b in s.buffers:
                b.free()
            self.sets.remove(s)
        return chosen.buffers[: len(sizes)], lease

    def close(self) -> None:
        for s in self.sets:
            for b in s.buffers:
                b.free()
        self.sets = []
        self.closed = True


class _DeviceBuffer:
    """A raw cudaMalloc'd region (through polygraphy.cuda.DeviceArray)."""

    def __init__(self, cuda, nbytes: int):
        self.array = cuda.DeviceArray.raw((int(nbytes),))
        self.ptr = self.array.ptr
        self.nbytes = int(nbytes)

    def free(self) -> None:
        if self.array is not None:
            self.array.free()
            self.array, self.ptr, self.nbytes = None, 0, 0


def _numpy_dtype(trt_dtype) -> np.dtype:
    import ml_dtypes

    table = {
        "FLOAT": np.float32, "HALF": np.float16, "BF16": ml_dtypes.bfloat16, "FP8": ml_dtypes.float8_e4m3fn,
        "INT8": np.int8, "UINT8": np.uint8, "INT32": np.int32, "INT64": np.int64, "BOOL": np.bool_,
    }
    name = getattr(trt_dtype, "name", str(trt_dtype)).split(".")[-1]
    if name not in table:
        raise KvforgeError(f"the engine has an IO tensor of type {name}, which the tensorrt backend does not bind")
    return np.dtype(table[name])


# -- the backend ---------------------------------------------------------------------------
class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, config, io, bundle: Bundle, **options):
        super().__init__(config, io, **options)
        self.bundle = bundle
        self.past_names = [n for layer in io.past for n in layer]
        self.present_names = [n for layer in io.present for n in layer]
        self.engine = None

    # lifecycle
    def activate_impl(self) -> None:
        bundle = self.bundle if is_engine_bundle(self.bundle.manifest) else engine_for(self.bundle)
        verify_engine_file(bundle)
        meta = bundle.manifest.get("engine")
        if not meta:
            raise KvforgeError(f"{bundle.path} is not an engine bundle: its manifest has no `engine` section")
        trt, device = require_tensorrt_gpu()
        check_compatibility(meta, trt.__version__, device["compute_capability"], device["name"], str(bundle.path))
        cuda = _polygraphy_cuda()
        log = TrtLogger.get(trt)
        log.errors.clear()
        self._trt, self._cuda, self._log = trt, cuda, log
        self.runtime = trt.Runtime(log)
        if meta.get("version_compatible"):
            # a version-compatible plan carries the lean runtime's host code; the hash above vouches for the file
            self.runtime.engine_host_code_allowed = True
        engine_path = bundle.path / bundle.manifest["graph"]
        try:
            self.engine = self.runtime.deserialize_cuda_engine(engine_path.read_bytes())
        except (RuntimeError, TypeError, ValueError) as e:  # TensorRT mostly returns None, and logs why
            raise KvforgeError(f"TensorRT {trt.__version__} cannot deserialize {engine_path}: {e}; {log.take()}") from e
        if self.engine is None:
            raise KvforgeError(f"TensorRT {trt.__version__} cannot deserialize {engine_path}: {log.take()}")
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.engine_inputs = {n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT}
        outputs = {n for n in names if n not in self.engine_inputs}
        spec_inputs = {t.name for t in self.io.inputs}
        missing = [n for n in ["logits", *self.present_names] if n not in outputs] + [n for n in self.past_names if n not in self.engine_inputs]
        unknown = sorted(self.engine_inputs - spec_inputs)
        if missing or unknown:
            raise KvforgeError(f"{engine_path} does not match the manifest's IO spec: missing {missing}, unexpected inputs {unknown}")
        self.dtypes = {n: _numpy_dtype(self.engine.get_tensor_dtype(n)) for n in names}
        self.profiles = meta["profiles"]
        self.max_context = int(meta["limits"]["max_context"])
        self.present_specs = [next(t for t in self.io.outputs if t.name == n) for n in self.present_names]
        if self.engine.num_optimization_profiles != len(self.profiles):
            raise KvforgeError(f"{engine_path} has {self.engine.num_optimization_profiles} optimization profiles, the manifest records {len(self.profiles)}")
        self.context = self.engine.create_execution_context()
        if self.context is None:
            raise KvforgeError(f"TensorRT cannot create an execution context for {engine_path} (out of GPU memory?): {log.take()}")
        self.stream = cuda.Stream()
        alloc = lambda n: _DeviceBuffer(cuda, n)  # noqa: E731
        self.pool = BufferPool(alloc)
        self.scratch = BufferPool(alloc, keep_idle=1)  # inputs and logits: one set, reused every step
        self.dummy = _DeviceBuffer(cuda, _ALIGN)  # the address of empty (zero-volume) tensors
        self._lora_sets: dict[tuple, tuple[dict, dict]] = {}  # adapters' device copies, by the arrays' identity
        self.context.set_optimization_profile_async(0, self.stream.ptr)
        self.active_profile = 0

    def deactivate_impl(self) -> None:
        if self.engine is None:
            return
        self.stream.synchronize()
        self.context = None
        self.engine = None
        self.runtime = None
        self.pool.close()
        self.scratch.close()
        for _, buffers in self._lora_sets.values():
            for buf in buffers.values():
                buf.free()
        self._lora_sets = {}
        self.dummy.free()
        self.stream.free()

    # steps
    def empty_cache_impl(self, batch: int):
        values = self.io.dim_values(batch, 0, 0)
        return [DeviceTensor(0, concrete_shape(self.io.input(n).shape, values, n), self.dtypes[n]) for n in self.past_names]

    def forward_impl(self, input_ids, attention_mask, position_ids, cache: KVCache, last_only: bool, inputs=None):
        self._check_alive(cache.values)
        B, T = input_ids.shape
        rows = inputs.adapter_rows if inputs is not None else None
        extra = {LORA_WIDTH: rows.shape[1]} if rows is not None else None
        index, stepwise = plan_step(self.profiles, self.io, B, T, cache.length, extra)
        if not stepwise:
            return self._run(index, input_ids, attention_mask, position_ids, cache, last_only, inputs)
        kept = []
        for i in range(T):
            total = cache.length + 1
            part = inputs.for_columns(input_ids, np.full((B, 1), i)) if inputs is not None else None
            logits, cache = self._run(index, input_ids[:, i:i + 1], attention_mask[:, :total], position_ids[:, i:i + 1], cache,
                                      True, part)
            kept.append(logits)
        return (kept[-1] if last_only else np.concatenate(kept, axis=1)), cache

    def _lora_weights(self, lora: dict[str, np.ndarray]) -> dict[str, _DeviceBuffer]:
        """A step's adapters' A and B on the device: uploaded once per set of adapters (the session passes the same
        joined arrays step after step, runtime/lora.py), the last LORA_SETS sets kept."""
        arrays = {n: a for n, a in lora.items() if n in self.engine_inputs}
        key = tuple((n, id(a)) for n, a in sorted(arrays.items()))
        held = self._lora_sets.pop(key, None)
        if held is None:
            copy, kind = self._cuda.wrapper().memcpy, self._cuda.MemcpyKind
            buffers = {}
            for name, a in arrays.items():
                arr = np.ascontiguousarray(a, dtype=self.dtypes[name])
                buffers[name] = _DeviceBuffer(self._cuda, max(arr.nbytes, _ALIGN))
                copy(buffers[name].ptr, arr.ctypes.data, arr.nbytes, kind.HostToDevice, self.stream.ptr)
            self.stream.synchronize()
            held = (arrays, buffers)  # the arrays kept alive: their ids stay theirs while the key is held
            while len(self._lora_sets) >= LORA_SETS:
                for buf in self._lora_sets.pop(next(iter(self._lora_sets)))[1].values():
                    buf.free()
        self._lora_sets[key] = held
        return held[1]

    def _run(self, index: int, ids, mask, pos, cache: KVCache, last_only: bool, inputs=None):
        cuda, ctx, stream = self._cuda, self.context, self.stream
        copy, kind = cuda.wrapper().memcpy, cuda.MemcpyKind
        B, T = ids.shape
        if index != self.active_profile:
            ctx.set_optimization_profile_async(index, stream.ptr)
            self.active_profile = index
        # inputs the engine kept (TensorRT drops inputs that no output depends on), in the engine's dtypes
        host = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
        if inputs is not None:
            host.update(inputs.step_feeds())  # small, copied each step; the adapters' weights stay on the device
            for name, buf in self._lora_weights(inputs.adapter_weights).items():
                self._set_shape(name, inputs.adapter_weights[name].shape)
                ctx.set_tensor_address(name, buf.ptr)
        host = {n: np.ascontiguousarray(a, dtype=self.dtypes[n]) for n, a in host.items() if n in self.engine_inputs}
        for name, arr in host.items():
            self._set_shape(name, arr.shape)
        for name, t in zip(self.past_names, cache.values):
            self._set_shape(name, t.shape)
        shapes = {n: tuple(ctx.get_tensor_shape(n)) for n in ["logits", *self.present_names]}
        if any(d < 0 for s in shapes.values() for d in s):
            raise KvforgeError(f"TensorRT cannot infer the output shapes {shapes} for batch {B}, {T} tokens over a past of "
                               f"{cache.length}: {self._log.take()}")
        # device memory: inputs and logits from a scratch set reused every step; presents from the cache pool
        scratch, _scratch_lease = self.scratch.acquire([a.nbytes for a in host.values()] + [self._nbytes("logits", shapes["logits"])])
        for (name, arr), buf in zip(host.items(), scratch):
            copy(buf.ptr, arr.ctypes.data, arr.nbytes, kind.HostToDevice, stream.ptr)
            ctx.set_tensor_address(name, buf.ptr)
        for name, t in zip(self.past_names, cache.values):
            ctx.set_tensor_address(name, t.ptr or self.dummy.ptr)  # the previous step's present: no copy
        logits_buf = scratch[-1]
        ctx.set_tensor_address("logits", logits_buf.ptr)
        buffers, lease = self.pool.acquire(self._reserve(B, T, cache.length + T))
        for name, buf in zip(self.present_names, buffers):
            ctx.set_tensor_address(name, buf.ptr)
        if not ctx.execute_async_v3(stream.ptr):
            raise KvforgeError(f"TensorRT failed to run a step (batch {B}, {T} tokens, past {cache.length}): {self._log.take()}")
        dtype = self.dtypes["logits"]
        V, row = shapes["logits"][-1], shapes["logits"][-1] * dtype.itemsize
        if last_only and T > 1:  # copy back each row's last position only
            logits = np.empty((B, 1, V), dtype)
            for b in range(B):
                copy(logits.ctypes.data + b * row, logits_buf.ptr + (b * T + T - 1) * row, row, kind.DeviceToHost, stream.ptr)
        else:
            logits = np.empty(shapes["logits"], dtype)
            copy(logits.ctypes.data, logits_buf.ptr, logits.nbytes, kind.DeviceToHost, stream.ptr)
        stream.synchronize()  # the step is done; `host` lived until its copies were
        values = [DeviceTensor(buf.ptr, shapes[n], self.dtypes[n], lease) for n, buf in zip(self.present_names, buffers)]
        return logits.astype(np.float32, copy=False), KVCache(self.name, B, cache.length + T, values)

    def _check_alive(self, tensors) -> None:
        pool = getattr(self, "pool", None)
        for t in tensors:
            if t.lease is not None and (t.lease.pool is not pool or pool.closed):
                raise KvforgeError("this cache was made before the session was last deactivated; its GPU memory is gone")

    def _reserve(self, batch: int, seq: int, total: int) -> list[int]:
        """Bytes to hold each present tensor with room to grow: its size at `total` rounded up to CACHE_GRANULE tokens."""
        room = min(max(self.max_context, total), -(-total // CACHE_GRANULE) * CACHE_GRANULE)
        values = self.io.dim_values(batch, seq, room - seq)  # a capped cache needs no more than its window
        return [self._nbytes(t.name, concrete_shape(t.shape, values, t.name)) for t in self.present_specs]

    def _nbytes(self, name: str, shape) -> int:
        return int(np.prod(shape, dtype=np.int64)) * self.dtypes[name].itemsize

    def _set_shape(self, name: str, shape) -> None:
        if not self.context.set_input_shape(name, tuple(int(d) for d in shape)):
            profile = self.profiles[self.active_profile]
            raise KvforgeError(f"TensorRT refuses shape {tuple(shape)} for {name} in the {profile['name']!r} profile "
                               f"({profile['shapes'].get(name)}): {self._log.take()}")

    def from_numpy_impl(self, arrays):
        buffers, lease = self.pool.acquire([a.nbytes for a in arrays])
        copy, kind = self._cuda.wrapper().memcpy, self._cuda.MemcpyKind
        for a, buf in zip(arrays, buffers):
            if a.nbytes:
                copy(buf.ptr, a.ctypes.data, a.nbytes, kind.HostToDevice)
        return [DeviceTensor(buf.ptr if a.nbytes else 0, a.shape, a.dtype, lease) for a, buf in zip(arrays, buffers)]

    def to_numpy(self, value: DeviceTensor) -> np.ndarray:
        out = np.zeros(value.shape, value.dtype)
        if value.ptr and out.nbytes:
            self._check_alive([value])
            self._cuda.wrapper().memcpy(out.ctypes.data, value.ptr, out.nbytes, self._cuda.MemcpyKind.DeviceToHost)
        return out


# -- engines for ONNX bundles ------------------------------------------------------------------
ENGINE_CACHE_VERSION = 1


def engine_cache_key(bundle: Bundle, tensorrt_version: str, compute_capability: str) -> str:
    files = bundle.manifest.get("files", {})
    parts = {
        "graph": files.get(bundle.manifest["graph"], {}).get("sha256"),
        "external_data": files.get(bundle.manifest.get("external_data") or "", {}).get("sha256"),
        "tensorrt": tensorrt_version,
        "compute_capability": compute_capability,
        "version": ENGINE_CACHE_VERSION,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def engine_for(bundle: Bundle) -> Bundle:
    """The engine for an ONNX bundle, built once with the default limits and cached under $KVFORGE_CACHE.

    This is what `runtime.load(onnx_bundle, backend="tensorrt")` runs; `kvforge
    build` makes an engine bundle with chosen limits instead.
    """
    trt, device = require_tensorrt_gpu()
    target = cache_dir("trt-engines") / engine_cache_key(bundle, trt.__version__, device["compute_capability"])
    if Bundle.is_bundle(target):
        return Bundle(target)
    from kvforge.export.engine import build  # torch and onnx: only when an engine must be built

    print(f"kvforge: building a TensorRT engine for {bundle.path} (cached in {target}) ...", file=sys.stderr)
    try:
        return build(bundle.path, target)
    except KvforgeError:
        if Bundle.is_bundle(target):  # another process built it first
            return Bundle(target)
        raise
