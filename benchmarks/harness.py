"""Helpers the benchmarks share: interleaved timing of contenders (balanced orders, decode rates), the machine's
memory bandwidth, the fields every result records (the machine, the load average, the time) and its JSON writer,
the bytes of weights an ONNX decode step reads, and the benchmark-only llama.cpp venv (built from source), its
runner and GGUF re-typing.

benchmarks/ is a package: scripts run from the repository root as `python3 -m benchmarks.GROUP.NAME` and import
this module as `from benchmarks.harness import X`, fixtures of other benchmarks as `from benchmarks.peers.NAME
import X` (no script touches the import path)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]  # the repository
RESULTS = ROOT / "benchmarks" / "results"
PAUSE_S = 1.0  # idle time before each contender's run (interleaved_runs)
# runs a GGUF under the bench venv's llama-cpp-python, by path (self-contained: it imports nothing of kvforge's
# or of this package)
RUNNER = ROOT / "benchmarks" / "peers" / "llamacpp_run.py"
THREADS = 2  # llama.cpp threads (this machine's cores)


# ---------------------------------------------------------------- timing


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of n contenders in which each follows each other one equally often (a Williams design)."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    return rows + [r[::-1] for r in rows] if n % 2 else rows


def decode_rate(result: dict) -> float:
    """Decode tokens/s of one timed generation (timed_greedy's, or a peer's with the same keys)."""
    return result["decode_steps"] / result["decode_s"]


def interleaved_runs(contenders: dict[str, Callable[[], dict]], rounds: int, rate: Callable[[dict], float],
                     after_round: Callable[[int], None] | None = None) -> dict[str, list[dict]]:
    """Each contender's results over `rounds` rounds: every contender warmed up once, then each round runs every
    one once, a pause before each run, in balanced orders (each follows each other equally often) for up to
    four contenders and in rotations beyond. Prints each round's decode rates (rate(result), tokens/s);
    after_round(i) runs after the warm-up (i = -1) and after each round i (a bandwidth sample, say)."""
    names = list(contenders)
    for run in contenders.values():  # warm-up
        run()
    if after_round is not None:
        after_round(-1)
    n = len(names)
    orders = balanced_orders(n) if n <= 4 else [list(range(n))[i:] + list(range(n))[:i] for i in range(n)]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for i in range(rounds):
        for name in (names[k] for k in orders[i % len(orders)]):
            time.sleep(PAUSE_S)
            runs[name].append(contenders[name]())
        print(f"run {i}: " + ", ".join(f"{name} {rate(r[-1]):.1f} tok/s" for name, r in runs.items()), flush=True)
        if after_round is not None:
            after_round(i)
    return runs


def bandwidth_gbs(reps: int = 9) -> float:
    import torch

    torch.set_num_threads(os.cpu_count() or 2)
    a = torch.ones(256 * 2**20, dtype=torch.float32)  # 1 GiB, beyond any cache
    a.sum()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t)
    return a.numel() * 4 / statistics.median(times) / 1e9


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where the OS has none): a busy machine explains slow runs."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return []


def machine() -> dict:
    """What a result records of the machine it ran on: its CPU count, Python and platform."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def utc_time() -> str:
    """Now, UTC, as a result's `time` (or `date`) field: 2026-11-23T15:56:07Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_result(name: str, result: dict, path: Path | str | None = None, indent: int = 2) -> Path:
    """`result` as indented JSON at `path` (default benchmarks/results/<name>.json), directories made; the path."""
    path = Path(path) if path is not None else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")
    return path


# ---------------------------------------------------------------- ONNX


def onnx_weight_bytes(graph_file) -> int:
    """Bytes of the initializers a decode step of an ONNX model reads, as stored: all but those only the
    embedding Gather reads."""
    import onnx

    g = onnx.load(str(graph_file), load_external_data=False).graph
    readers: dict[str, list] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)

    def stored(t) -> int:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            return int({e.key: e.value for e in t.external_data}["length"])
        return len(t.raw_data) or onnx.numpy_helper.to_array(t).nbytes

    def gathered_only(name: str) -> bool:
        users = readers.get(name, [])
        return bool(users) and all(u.op_type == "Gather" and u.input[0] == name and "input_ids" in u.input for u in users)

    return sum(stored(t) for t in g.initializer if not gathered_only(t.name))


# ---------------------------------------------------------------- llama.cpp: build, files


LLAMA_CPP_VERSION = "0.3.36"
# ggml's x86 options and the /proc/cpuinfo flags each needs (all of them)
GGML_X86 = {"GGML_SSE42": ("sse4_2",), "GGML_AVX": ("avx",), "GGML_AVX2": ("avx2",), "GGML_FMA": ("fma",),
            "GGML_F16C": ("f16c",), "GGML_BMI2": ("bmi2",), "GGML_AVX_VNNI": ("avx_vnni",),
            "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
            "GGML_AVX512_VBMI": ("avx512vbmi",), "GGML_AVX512_VNNI": ("avx512_vnni",), "GGML_AVX512_BF16": ("avx512_bf16",)}


def cmake_args() -> str:
    """A CPU build for this machine: OpenMP threads, no BLAS, no GPU, no downloads (curl), none of the tools,
    examples or tests; each SIMD extension the CPU reports switched on by name, AMX off. Not GGML_NATIVE:
    -march=native also compiles in ggml's AMX kernels wherever CPUID reports AMX, and a VM whose kernel has not
    enabled the AMX tile state (this one: a Firecracker guest on a Sapphire Rapids host) then dies of SIGILL on
    the first `tileloadd`."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    simd = " ".join(f"-D{opt}={'ON' if all(f in flags for f in need) else 'OFF'}" for opt, need in GGML_X86.items())
    return ("-DGGML_NATIVE=OFF " + simd + " -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "
            "-DGGML_OPENMP=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
            "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF")


def bench_venv(venv: Path) -> tuple[Path, str]:
    """(the python of the benchmark-only venv with llama-cpp-python built from source, its CMAKE_ARGS); built on
    first use, and again when the build it holds was made with other CMAKE_ARGS."""
    python, stamp, args = venv / "bin" / "python", venv / "kvforge-llamacpp-build.json", cmake_args()
    wanted = {"llama_cpp_python": LLAMA_CPP_VERSION, "cmake_args": args}
    if (python.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == wanted
            and subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True).returncode == 0):
        return python, args
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    log = venv / "build.log"
    env = {**os.environ, "CMAKE_ARGS": args, "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2)}
    print(f"building llama-cpp-python {LLAMA_CPP_VERSION} from source in {venv} (minutes; log: {log})", flush=True)
    with open(log, "w") as f:
        done = subprocess.run([str(python), "-m", "pip", "install", "-v", "--force-reinstall", "--no-cache-dir",
                               "--no-binary", "llama-cpp-python", f"llama-cpp-python=={LLAMA_CPP_VERSION}"],
                              env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        lines = log.read_text(errors="replace").splitlines()
        errors = [ln for ln in lines if "error" in ln.lower() and "Werror" not in ln]
        raise SystemExit(f"llama-cpp-python did not build (CMAKE_ARGS={args}):\n" +
                         "\n".join(errors[:20] or lines[-40:]) + f"\nfull log: {log}")
    stamp.write_text(json.dumps(wanted))
    return python, args


def write_gguf(src: Path, dst: Path, target: str) -> Path:
    """`src` with every 2-D weight stored as `target` (F32 or Q8_0): dequantized from its own type, requantized for
    Q8_0; tensors already of that type and 1-D ones (norms) copied as stored; every metadata field copied, but
    general.file_type, which says the new type. Written once (reused when `dst` exists)."""
    import gguf

    if dst.is_file():
        return dst
    qt, vt = gguf.GGMLQuantizationType, gguf.GGUFValueType
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[target]
    reader = gguf.GGUFReader(src)
    tmp = dst.with_name(dst.name + ".part")
    writer = gguf.GGUFWriter(tmp, reader.fields["general.architecture"].contents())  # writes general.architecture
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the header's, written by the writer
            continue
        value = int(file_type) if key == "general.file_type" else field.contents()
        writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if field.types[0] == vt.ARRAY else None)
    for t in reader.tensors:
        if len(t.shape) == 2 and t.tensor_type != qt[target]:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            if target == "F32":
                writer.add_tensor(t.name, w)
            else:
                writer.add_tensor(t.name, gguf.quants.quantize(w, qt[target]), raw_dtype=qt[target])
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=None if t.tensor_type == qt.F32 else t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst
