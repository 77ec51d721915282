"""Memory and disk plans: what an export or a calibration will need, checked before any work starts.

A stage that runs out of memory midway is killed by the kernel (nothing half-written, but minutes lost and no
word of why); one that runs out of disk fails while writing. Each stage estimates, from the model's parameter count
alone, the peak resident memory and the disk it will need, compares them with what this process may use, and
refuses with both figures when they do not fit. The coefficients are today's peaks measured on this design's
exports and calibrations (`/usr/bin/time -v`, 2-core machine, issue 48): export of SmolLM2-135M 4.55 GB, of
Gemma 3 270M 10.1 GB, of a 0.5B model 12.2 GB, i.e. at most ~8x the float32 weights over a ~1.5 GB runtime;
calibration of SmolLM2 to INT8 10.4 GB, FP8 11.1 GB, of Gemma 3 270M over 24 GB, i.e. ~22x the float bundle. They
are what the stages cost, not what they should: a stage made leaner lowers its coefficient here.

    memory free = the least of: the system's MemAvailable, the cgroup's memory.max minus its memory.current, and
                  the address-space limit (RLIMIT_AS, as `ulimit -v` or `prlimit --as` set it) minus what the
                  process has mapped
    disk free   = shutil.disk_usage of the output's directory

KVFORGE_SKIP_RESOURCE_CHECK=1 starts the stage anyway (the plan is an estimate, and an operator may know better).
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvforge.errors import KvforgeError

GIB = 1 << 30
SKIP = "KVFORGE_SKIP_RESOURCE_CHECK"


@dataclass(frozen=True)
class Plan:
    """What a stage will need: peak resident memory and disk, in bytes, for a model of `parameters`."""

    stage: str
    parameters: int
    memory: int
    disk: int
    scratch: int = 0  # bytes of scratch files under TMPDIR (a GGUF file's decoded tensors, held-out logits)

    def to_dict(self) -> dict:
        return {"stage": self.stage, "parameters": self.parameters, "memory_bytes": self.memory, "disk_bytes": self.disk,
                "scratch_bytes": self.scratch}


RUNTIME = 3 * GIB // 2  # torch, ONNX Runtime and the interpreter before any weight
EXPORT_PER_FP32_BYTE = 8  # peak resident bytes per byte of the float32 reference
# peak resident bytes per byte of the bundle's weights, weights streamed: Qwen2.5-1.5B's shape 7.94 GiB for a
# 5.75 GiB float32 bundle, 4.79 GiB for its 2.88 GiB float16 bundle (each half weight cast to float32 where it is
# used: kvforge/ort_session.py compute_weights_when_used; benchmarks/features/export_scale.py)
STREAMED_EXPORT_PER_BUNDLE_BYTE = 1.25
# calibration keeps the weights in the bundle's data file (calibration/one_graph.py): one ONNX Runtime session maps
# them at a time (a half weight cast to float32 where it is used), beside one run's activations
# (calibration/passes.py RUN_BYTES)
CALIBRATE_PER_BUNDLE_BYTE = 1.25
CALIBRATE_ACTIVATIONS = 1 * GIB


def dtype_bytes(dtype: str) -> int:
    """Bytes per weight of a bundle's float dtype (float32, float16, bfloat16)."""
    return {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


def export_plan(parameters: int, dtype_bytes: int, streamed: bool = False, scratch: int = 0) -> Plan:
    """An export of a model of `parameters` to a bundle of `dtype_bytes` per weight: the float32 reference is
    loaded whole whatever the bundle's dtype, or (streamed: weights read where they are used,
    model_defs/weights.py) the validating session maps the bundle's weights (a half weight cast to float32 where
    it is used) and the reference reads one block at a time."""
    bundle = parameters * dtype_bytes
    if streamed:
        memory = RUNTIME + STREAMED_EXPORT_PER_BUNDLE_BYTE * bundle
    else:
        memory = RUNTIME + EXPORT_PER_FP32_BYTE * 4 * parameters
    return Plan("export", parameters, int(memory), bundle * 5 // 4 + (64 << 20), scratch)


def calibrate_plan(parameters: int, bundle_bytes: int, scratch: int = 0) -> Plan:
    """A calibration of a float bundle whose graph and weights take `bundle_bytes` on disk: the session that
    observes (or measures a candidate) maps the weights (a half weight cast to float32 where it is used:
    ort_session.compute_weights_when_used) and one run's activations; the quantized graph is written beside
    the input. scratch: the float logits on the held-out windows that candidates are measured against
    (calibration/budget.py), kept under TMPDIR."""
    memory = RUNTIME + CALIBRATE_PER_BUNDLE_BYTE * bundle_bytes + CALIBRATE_ACTIVATIONS
    return Plan("calibration", parameters, int(memory), bundle_bytes, scratch)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cgroup_free() -> int | None:
    base = Path("/sys/fs/cgroup")
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((base / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None


def _address_space_free() -> int | None:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return soft - int(line.split()[1]) * 1024
    except OSError:
        return None
    return soft


def free_memory() -> tuple[int | None, str]:
    """(bytes this process may still use, where the bound comes from); None where nothing bounds it."""
    bounds = [(b, why) for b, why in ((_meminfo_available(), "available memory (MemAvailable)"),
                                      (_cgroup_free(), "the cgroup's memory.max"),
                                      (_address_space_free(), "the address-space limit (RLIMIT_AS)")) if b is not None]
    if not bounds:
        return None, "no bound found"
    return min(bounds)


def check(plan: Plan, out: str | Path) -> None:
    """Refuse `plan` when this process's memory or the output's disk cannot hold it (nothing is written yet)."""
    if os.environ.get(SKIP) == "1":
        return
    free, why = free_memory()
    problems = []
    if free is not None and plan.memory > free:
        problems.append(f"about {plan.memory / GIB:.1f} GiB of memory at its peak, and {max(free, 0) / GIB:.1f} GiB "
                        f"is free ({why})")
    target = Path(out).resolve()
    directory = next((p for p in [target, *target.parents] if p.exists()), None)
    scratch = Path(tempfile.gettempdir()) if plan.scratch else None
    shared = directory is not None and scratch is not None and scratch.exists() \
        and os.stat(scratch).st_dev == os.stat(directory).st_dev
    if directory is not None:
        disk = shutil.disk_usage(directory).free
        wanted = plan.disk + (plan.scratch if shared else 0)
        if wanted > disk:
            what = "the bundle and its scratch file (TMPDIR is on the same disk)" if shared else "the bundle"
            problems.append(f"about {wanted / GIB:.1f} GiB of disk for {what}, and {disk / GIB:.1f} GiB is "
                            f"free on {directory}")
    if scratch is not None and not shared:
        room = shutil.disk_usage(scratch).free if scratch.exists() else 0
        if plan.scratch > room:
            problems.append(f"about {plan.scratch / GIB:.1f} GiB of scratch disk under TMPDIR ({scratch}), and "
                            f"{room / GIB:.1f} GiB is free there (point TMPDIR at a disk with room)")
    if problems:
        raise KvforgeError(f"{plan.stage} of this model ({plan.parameters / 1e9:.2f}B parameters) needs "
                           + "; and ".join(problems) + f". Nothing was started or written. Free memory or disk, use "
                           f"a machine with more, or set {SKIP}=1 to start anyway")


def release_freed_memory() -> None:
    """Give the memory the process has freed back to the system (glibc's malloc_trim; nothing elsewhere). Called
    after each block of a streamed model's forward (model_defs/weights.py: streamed): reading and casting a
    block's weights frees buffers of many sizes, and glibc kept ~1 GiB of them in its heaps (a Llama-3.2-3B
    shape's FP16 validation: 1.45 GiB anonymous memory after a case, 0.37 GiB once trimmed); and by export once
    its graph is written, before validation runs it (tracing frees as much: Gemma 3 270M's export held 0.25 GiB
    of it)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    """The C library's malloc_trim, or None where there is none (not glibc)."""
    import ctypes
    import ctypes.util

    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
    except OSError:
        return None
