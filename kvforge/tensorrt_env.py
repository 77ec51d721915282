"""TensorRT's environment, as the engine build (export) and the TensorRT backend (runtime) both need it.

What is installed and which GPU is here (asked of the driver, no toolkit needed), the logger TensorRT keeps
one of per process, and the pure checks on an engine's record: the TensorRT version and compute capability
it runs on, the precisions a GPU builds, the concrete shape of an IO tensor. Nothing here imports TensorRT
before a function is called that needs it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import itertools
import sys
from typing import Any

from kvforge.errors import KvforgeError, MissingDependencyError

ENGINE_FILE = "model.engine"
INSTALL = "Install it with `bash scripts/install.sh --gpu` (the `gpu` extra: tensorrt, onnxruntime-gpu) on a machine with an NVIDIA GPU."
HARDWARE_COMPATIBILITY = ("none", "ampere_plus", "same_compute_capability")
PREFILL, DECODE = "prefill", "decode"


def is_engine_bundle(manifest: dict[str, Any]) -> bool:
    """True for a bundle written by `kvforge build` (its graph is a serialized TensorRT engine)."""
    return str(manifest.get("graph", "")).endswith(".engine") or manifest.get("stage") == "build"


# -- what this machine has ------------------------------------------------------------
def import_tensorrt():
    try:
        import tensorrt
    except ImportError as e:
        raise MissingDependencyError("TensorRT (the `tensorrt` Python package)", INSTALL) from e
    return tensorrt


def tensorrt_version() -> str | None:
    """The installed TensorRT's version, without importing it (None when absent)."""
    if importlib.util.find_spec("tensorrt") is None:
        return None
    from importlib import metadata

    for dist in ("tensorrt", "tensorrt-cu12", "tensorrt-cu13", "tensorrt-cu11", "tensorrt_cu12"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def cuda_device(index: int = 0) -> dict[str, Any]:
    """Name and compute capability of CUDA device `index`, asked of the driver (libcuda): no toolkit needed."""
    candidates = ["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.so", "libcuda.dylib"]
    lib = None
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        raise MissingDependencyError("an NVIDIA GPU (no CUDA driver, libcuda, was found)", INSTALL)
    rc = lib.cuInit(0)
    count = ctypes.c_int(0)
    if rc != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value <= index:
        raise MissingDependencyError(
            f"an NVIDIA GPU (the CUDA driver finds no usable device{'' if rc == 0 else f': cuInit error {rc}'})", INSTALL
        )
    dev = ctypes.c_int(0)
    lib.cuDeviceGet(ctypes.byref(dev), index)
    name = ctypes.create_string_buffer(256)
    lib.cuDeviceGetName(name, 256, dev)
    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    lib.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)  # ..._MINOR
    return {"name": name.value.decode(errors="replace"), "compute_capability": f"{major.value}.{minor.value}", "count": count.value}


def tensorrt_gpu_missing() -> str | None:
    """Why the tensorrt backend cannot run here, naming everything absent; None when the `tensorrt`
    package is installed and a CUDA GPU is present. Imports nothing heavy (a skip or a listing)."""
    reasons = []
    if importlib.util.find_spec("tensorrt") is None:
        reasons.append("TensorRT (the `tensorrt` package) is not installed")
    try:
        cuda_device()
    except MissingDependencyError as e:
        reasons.append(f"{e.what} is absent")
    return "; ".join(reasons) or None


def require_tensorrt_gpu():
    """(tensorrt module, cuda_device()), or one MissingDependencyError naming everything that is missing."""
    try:
        trt = import_tensorrt()
    except MissingDependencyError as e:
        try:
            cuda_device()
        except MissingDependencyError as gpu:
            raise MissingDependencyError(e.what, f"Nor is {gpu.what}. {INSTALL}") from e
        raise
    return trt, cuda_device()


class TrtLogger:
    """A TensorRT logger that keeps the errors, to be quoted in the KvforgeError that follows a failure.

    TensorRT keeps one logger per process (a later one is ignored with a
    warning), so there is one instance, made on first use.
    """

    instance = None

    @classmethod
    def get(cls, trt):
        if cls.instance is None:

            class Logger(trt.ILogger):
                def __init__(self):
                    trt.ILogger.__init__(self)
                    self.errors: list[str] = []

                def log(self, severity, msg):
                    if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                        self.errors.append(msg)
                    elif severity == trt.ILogger.Severity.WARNING:
                        print(f"[TensorRT] warning: {msg}", file=sys.stderr)

                def take(self) -> str:
                    text = " | ".join(self.errors[-5:]) or "no error was logged"
                    self.errors.clear()
                    return text

            cls.instance = Logger()
        return cls.instance


# -- pure checks ------------------------------------------------------------------------
def _version(v: str) -> tuple[int, int, int]:
    parts = [int("".join(itertools.takewhile(str.isdigit, p)) or 0) for p in str(v).split(".")[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


def _cc(v: str) -> tuple[int, int]:
    major, _, minor = str(v).partition(".")
    return int(major), int(minor or 0)


def check_precision_supported(quantization: dict[str, Any] | None, compute_capability: str, gpu_name: str) -> None:
    """What TensorRT cannot build from this quantization, or on this GPU: a checkpoint's unsigned codes, per-token
    activations, block-wise INT8 weights; FP8 Q/DQ (weights, activations or the KV cache) below compute capability 8.9."""
    q = quantization or {}
    kept = ((q.get("checkpoint") or {}).get("kept") or {}).values()
    unsigned = sorted({r["type"] for r in kept if r["codes"] in ("uint4", "uint8")})
    if unsigned:  # the lint names each node too (dtype rule); say it before a build starts
        raise KvforgeError(f"this bundle keeps its checkpoint's unsigned codes ({', '.join(unsigned)}: a block minimum "
                           "added after the scale), which TensorRT's DequantizeLinear does not take (INT8, FP8, FP4, "
                           "INT4 only); export the checkpoint with --dequantize and calibrate it for TensorRT")
    if q.get("activations") == "per-token dynamic":
        raise KvforgeError(f"this bundle's {q.get('format', '').upper()} activations are scaled per token at run time "
                           "(--activations per-token, an encoder's default, or the automatic recipe's measured "
                           "choice), which ONNX Runtime runs and TensorRT does not (its scales are constants); "
                           "calibrate the float bundle with --activations static for TensorRT")
    if q.get("zero_points"):
        raise KvforgeError("this bundle's INT4 blocks are asymmetric (a minimum or zero point per block: the "
                           "automatic recipe's default, which kvforge runs on ONNX Runtime, not on TensorRT); "
                           "calibrate the float bundle with --no-zero-points for TensorRT")
    if q.get("int8_layers"):
        raise KvforgeError(f"this bundle keeps {len(q['int8_layers'])} layers as block-wise INT8 weights beside its INT4 "
                           "ones (the automatic recipe's choice), which TensorRT's block-wise Q/DQ (INT4's) does not "
                           "take; calibrate the float bundle with --no-zero-points for TensorRT")
    if q.get("format") == "int8" and q.get("weight_only"):
        raise KvforgeError("this bundle's INT8 weights are block-wise with float activations (--weights-only), which "
                           "ONNX Runtime runs and TensorRT does not (its block-wise Q/DQ is INT4's); calibrate the "
                           "float bundle with --precision int4, or W8A8 int8, for TensorRT")
    fp8_codes = any(r["codes"] == "fp8" for r in kept)
    if (q.get("format") == "fp8" or q.get("kv_cache") == "fp8" or fp8_codes) and _cc(compute_capability) < (8, 9):
        raise KvforgeError(f"FP8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); {gpu_name} has "
                           f"{compute_capability}: build an int8, int4 or float bundle for it instead")


def tensorrt_refusal(quantization: dict[str, Any] | None) -> str | None:
    """Why TensorRT cannot build this quantization on any GPU (a form kvforge runs on ONNX Runtime only:
    check_precision_supported's reasons short of a GPU's), or None."""
    try:
        check_precision_supported(quantization, "9.0", "a GPU of compute capability 9.0")
    except KvforgeError as e:
        return str(e)
    return None


def check_compatibility(engine: dict[str, Any], tensorrt_version: str, compute_capability: str,
                        gpu_name: str = "this GPU", where: str = "the bundle") -> None:
    """Refuse an engine that this TensorRT or GPU cannot run, with what was recorded and what is here.

    Engines run only on the TensorRT version (major.minor.patch) that built
    them, unless built version-compatible (then on that version or later);
    and only on GPUs of the compute capability they were built for, unless
    built hardware-compatible (ampere_plus: any compute capability >= 8.0).
    """
    built_v = engine["tensorrt_version"]
    built_cc, built_gpu = engine["gpu"]["compute_capability"], engine["gpu"].get("name", "?")
    problems = []
    if engine.get("version_compatible"):
        if _version(tensorrt_version) < _version(built_v):
            problems.append(f"it was built version-compatible with TensorRT {built_v}, which runs on {built_v} or later, "
                            f"and this machine has TensorRT {tensorrt_version}")
    elif _version(tensorrt_version) != _version(built_v):
        problems.append(f"it was built with TensorRT {built_v} and this machine has TensorRT {tensorrt_version} "
                        "(an engine runs only on the TensorRT version that built it unless built with --version-compatible)")
    level = engine.get("hardware_compatibility", "none")
    if level == "ampere_plus":
        if _cc(compute_capability) < (8, 0):
            problems.append(f"it was built for Ampere or newer (compute capability >= 8.0) and {gpu_name} has compute capability {compute_capability}")
    elif _cc(compute_capability) != _cc(built_cc):
        problems.append(f"it was built for compute capability {built_cc} ({built_gpu}) and {gpu_name} has compute capability "
                        f"{compute_capability} (build with --hardware-compatibility ampere_plus to run on any GPU from Ampere on)")
    if problems:
        source = engine.get("source", {}).get("bundle", "the ONNX bundle")
        raise KvforgeError(f"the TensorRT engine in {where} cannot run here: " + "; ".join(problems)
                           + f". Rebuild it on this machine: kvforge build {source} -o OUT")


def concrete_shape(shape: list, values: dict[str, int], name: str = "?") -> tuple[int, ...]:
    """An IO-spec shape with its symbolic dimensions replaced by `values`."""
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
        elif d in values:
            out.append(values[d])
        else:
            raise KvforgeError(f"tensor {name!r} has a symbolic dimension {d!r} that kvforge cannot size "
                               f"(known: {', '.join(sorted(values))})")
    return tuple(out)
