"""ONNX Runtime sessions as every stage opens them: calibration, attribution and the runtime's backend.

make_session sets what each Q/DQ format needs for ONNX Runtime's CPU provider to compute what the graph
says; prefill_feeds builds a prefill from an empty cache as the IO spec shapes it. Imports no Torch.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from kvforge.errors import KvforgeError, MissingDependencyError
from kvforge.kinds import kind_of
from kvforge.onnx_graph import MS_DOMAIN, dequantizes_with_run_time_scales


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError as e:
        raise MissingDependencyError("onnxruntime", "Install it with `pip install onnxruntime` (or onnxruntime-gpu).") from e
    return onnxruntime


# How ONNX Runtime's CPU provider must run each Q/DQ format to compute what the
# graph says (measured on ORT 1.31):
# - int8: the default fusions turn W8A8 into integer kernels (exact, 5-7x faster);
# - fp8: the integer fusions reject float8 inputs, so Q/DQ fusion is turned off
#   (the dequantized weights are constant-folded; activations keep their Q/DQ);
# - int4: block-wise DQ -> MatMul fuses into MatMulNBits, which by default also
#   quantizes activations to int8; accuracy level 0 keeps them in float.
# - int8 also needs common-subexpression elimination off: it merges the per-MatMul
#   QuantizeLinear nodes of a shared activation back into one, and ORT's QDQ
#   selector fuses only a Q -> DQ pair that feeds a single MatMul.
# - fp8 also needs ReluQuantRewrite off: it deletes a Relu that feeds a QuantizeLinear whose zero
#   point is the format's minimum, and takes FP8's zero point 0 for that (a ReLU FFN then sees
#   negative values: top-1 fell to ~0.2 on classic-micro).
# - int8's integer kernels are exact only where the CPU multiplies 8-bit pairs into 32 bits (VNNI, AMX, ARM's
#   dot products). On x86 CPUs with AVX2 alone, ORT's kernels sum pairs of products in 16 bits
#   (VPMADDUBSW), which saturates: on such a CPU (an AMD EPYC with AVX2 here) bert-micro's INT8 top-1
#   fell from 0.93 to 0.84 and tiny's perplexity delta doubled. `int8_kernels_exact()` probes this once;
#   where it fails, int8 runs like fp8 (Q/DQ kept, weights dequantized): the graph's function, slower.
QUANT_DISABLED_OPTIMIZERS = {"int8": ["CommonSubexpressionElimination"], "fp8": ["ReluQuantRewrite"]}
# - checkpoint (a pre-quantized checkpoint's own codes: export/checkpoint_codes.py): computed as written, so each
#   weight is the checkpoint's dequantization bit for bit (the DequantizeLinear / offset Add / Gather chains are
#   constant-folded to float weights at load).
EXACT_QDQ = {"session.disable_quant_qdq": "1"}  # Q/DQ computed as written, no integer kernels
# - int8-weights (weight-only INT8, block-wise: calibrate --weights-only): Q/DQ fusion off, so each weight's
#   DequantizeLinear is constant-folded into a float weight at load: exact, at the float graph's speed. Left on,
#   block-wise int8 DQ -> MatMul becomes an 8-bit MatMulNBits that quantizes the activations to int8 at its
#   default accuracy level, and at level 0 (exact) it is 22x slower than the W8A8 integer kernel over the same
#   weights (benchmarks/kernels/int8_matmul_kernels.py).
QUANT_SESSION_CONFIG = {
    "fp8": EXACT_QDQ,
    "int8-weights": EXACT_QDQ,
    "int4": {"session.qdq_matmulnbits_accuracy_level": "0"},
    "checkpoint": EXACT_QDQ,
}
# MatMulNBits' accuracy level, the ONNX Runtime backend's opt-in speed setting (its `accuracy_level` option):
# 0 keeps the activations in float (exact: the bundle's function), 4 quantizes them to int8 per weight block along
# K (scale max|x| / 127 per block, as llama.cpp's Q8 activations) and sums integer products: an INT4 bundle's
# fused MatMulNBits (this session config) and the ORT variant's (runtime/ort/variant.py) then run integer dot
# products, measured 1.8-2x (4-bit) and 15-25x (8-bit) faster than level 0 at batch 1 here, with errors of 5e-3
# to 2e-2 of the output's scale (benchmarks/kernels/int*_matmul_kernels.py, docs/ort-variant.md).
ACCURACY_LEVELS = {0: "MatMulNBits keeps the activations in float: exact, the bundle's function",
                   4: "MatMulNBits quantizes the activations to int8 per weight block (llama.cpp's dot products): "
                      "faster, not exact"}


def check_accuracy_level(level, option: str = "accuracy_level") -> int:
    """`level` if it is one of ACCURACY_LEVELS, else a KvforgeError naming `option`, the levels and what each means."""
    if isinstance(level, bool) or level not in ACCURACY_LEVELS:
        allowed = "; ".join(f"{k} ({v})" for k, v in ACCURACY_LEVELS.items())
        raise KvforgeError(f"{option} must be one of {allowed}; got {level!r}")
    return int(level)


@functools.lru_cache(maxsize=None)
def int8_kernels_exact() -> bool:
    """Whether ONNX Runtime's CPU integer kernels compute a W8A8 MatMul exactly here: a one-row Q/DQ MatMul whose
    activations and weights sit at the int8 extremes (where a 16-bit pairwise sum saturates), run fused and as
    written. Probed once per process (a few milliseconds)."""
    from onnx import TensorProto, helper, numpy_helper

    k, n = 64, 8
    w = np.full((k, n), 127, np.int8)
    w[:, 1::2] = -127
    x = np.full((1, k), 127.0, np.float32)
    x[0, ::3] = -128.0
    inits = [numpy_helper.from_array(w, "w_q"), numpy_helper.from_array(np.ones(n, np.float32), "w_s"),
             numpy_helper.from_array(np.zeros(n, np.int8), "w_z"), numpy_helper.from_array(np.array(1.0, np.float32), "x_s"),
             numpy_helper.from_array(np.array(0, np.int8), "x_z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["x_q"]),
             helper.make_node("DequantizeLinear", ["x_q", "x_s", "x_z"], ["x_dq"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w_dq"], axis=1),
             helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"])]
    exact = x.astype(np.float64) @ w.astype(np.float64)
    return bool(np.array_equal(_probe(nodes, inits, x, TensorProto.FLOAT, n), exact))


@functools.lru_cache(maxsize=None)
def u8_kernels_exact() -> bool:
    """Whether ONNX Runtime's CPU MatMulIntegerToFloat computes uint8 x uint8 exactly here, at the extremes (every
    product 255 x 255 with zero point 128 on the weights, where a 16-bit pairwise sum would saturate): the kernel
    per-token INT8 runs on (runtime/ort/per_token.py). Probed once per process."""
    return _integer_kernel_exact(255, 0, np.uint8, 128)


@functools.lru_cache(maxsize=None)
def s8_kernels_exact() -> bool:
    """Whether ONNX Runtime's CPU MatMulIntegerToFloat computes uint8 x int8 exactly here, at the extremes (255 x 127
    and 255 x -128: a pair of them overflows the 16-bit sums AVX2 without VNNI makes). Where it does (VNNI), the
    per-token kernel's codes stay signed: at 128 rows it ran 5x the uint8 x uint8 kernel's speed here. Probed once
    per process."""
    return _integer_kernel_exact(127, -128, np.int8, 0)


def _integer_kernel_exact(even: int, odd: int, dtype, zero_point: int) -> bool:
    """MatMulIntegerToFloat over uint8 rows of 255 (254 every third) and weights `dtype` whose even columns hold
    `even` and odd ones `odd` (zero point `zero_point`), against the exact product; False where the kernel is
    missing (a build without the contrib op: per-token graphs then run as written)."""
    from onnx import TensorProto, helper, numpy_helper

    k, n = 64, 8
    w = np.full((k, n), even, dtype)
    w[:, 1::2] = odd
    a = np.full((1, k), 255, np.uint8)
    a[0, ::3] = 254
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.ones(n, np.float32), "w_s"),
             numpy_helper.from_array(np.array(zero_point, dtype), "w_z"),
             numpy_helper.from_array(np.array(1.0, np.float32), "a_s"), numpy_helper.from_array(np.array(0, np.uint8), "a_z")]
    nodes = [helper.make_node("MatMulIntegerToFloat", ["x", "w", "a_s", "w_s", "a_z", "w_z"], ["y"], domain=MS_DOMAIN)]
    try:
        y = _probe(nodes, inits, a, TensorProto.UINT8, n)
    except Exception:  # noqa: BLE001 - a build without the contrib kernel
        return False
    return bool(np.array_equal(y.astype(np.float64), a.astype(np.float64) @ (w.astype(np.float64) - zero_point)))


def _probe(nodes, inits, x: np.ndarray, x_type: int, n: int) -> np.ndarray:
    """A one-input graph of these nodes (input "x", output "y" [1, n]) run once on the CPU provider, optimized."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "probe", [helper.make_tensor_value_info("x", x_type, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 8
    ort = import_onnxruntime()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def session_config(quant_format: str | None, providers: list[str] | None = None,
                   accuracy_level: int = 0) -> dict[str, str]:
    """The session config entries a Q/DQ format needs on these providers (the CPU's, by default). accuracy_level:
    the MatMulNBits that ORT fuses from block-wise DequantizeLinear -> MatMul (INT4's) at that level
    (ACCURACY_LEVELS; 0: exact)."""
    level = check_accuracy_level(accuracy_level)
    config = dict(QUANT_SESSION_CONFIG.get(quant_format, {}))
    if "session.qdq_matmulnbits_accuracy_level" in config:
        config["session.qdq_matmulnbits_accuracy_level"] = str(level)
    on_cpu = not providers or list(providers) == ["CPUExecutionProvider"]
    if quant_format == "int8" and on_cpu and not int8_kernels_exact():
        config.update(EXACT_QDQ)
    return config


def _graph_proto(model):
    """A graph given as a ModelProto (itself), serialized bytes or a path (read without its external data)."""
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, bytes):
        proto = onnx.ModelProto()
        proto.ParseFromString(model)
        return proto
    return onnx.load(str(model), load_external_data=False)


def _run_time_scales(model) -> bool:
    """Whether an INT8 graph (a path or serialized bytes) still holds Q/DQ pairs scaled as it runs (per-token
    activations that runtime/ort/per_token.py has not moved onto the integer kernels: calibration's candidates,
    the bundle's own graph). ONNX Runtime's Q/DQ fusion (1.24 to 1.32, where int8_kernels_exact) turns such a pair
    and its MatMul into a MatMulIntegerToFloat that refuses a zero point per row when it runs ("Per-Channel is not
    supported yet"), so such a graph runs with the fusion off: as written, the graph's function."""
    try:
        proto = _graph_proto(model)
    except Exception:  # noqa: BLE001 - not a graph: ONNX Runtime names the problem when it opens it
        return False
    return dequantizes_with_run_time_scales(proto)


SPINNING_ENV = "KVFORGE_ORT_SPINNING"
# KVFORGE_ORT_PROFILE=PREFIX: every session kvforge opens runs ONNX Runtime's profiler, which writes
# PREFIX_<date>.json (each node's time, as chrome://tracing reads it) when the session closes
PROFILE_ENV = "KVFORGE_ORT_PROFILE"


def spinning_allowed() -> bool:
    """Whether ONNX Runtime's thread pools may spin (ORT's default) or block when idle: KVFORGE_ORT_SPINNING=0 for
    a process whose cores are shared (several processes on a small machine, as OMP_WAIT_POLICY=PASSIVE for
    OpenMP). ORT's threads spin-wait for work after each parallel section; on two cores beside another busy process
    or the Python threads of a server, the spinning takes the cores they need: measured on this project's 2-core
    machine with another process busy, the tiny model's decode 4.4 -> 1.8 ms a token and a Triton soak of mixed
    requests 31.8 -> 19.8 ms a request with spinning off; on an idle machine spinning is 5-20% faster."""
    value = os.environ.get(SPINNING_ENV, "1")
    if value not in ("0", "1"):
        raise KvforgeError(f"{SPINNING_ENV} must be 0 (ONNX Runtime's threads block when idle) or 1 (they spin, "
                           f"ONNX Runtime's default), got {value!r}")
    return value == "1"


def block_when_idle(opts) -> None:
    """ORT SessionOptions `opts` with its thread pools blocking when idle, where spinning is not allowed."""
    if not spinning_allowed():
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.add_session_config_entry("session.inter_op.allow_spinning", "0")


def compute_weights_when_used(opts) -> None:
    """ORT SessionOptions `opts` for a graph whose weights are computed from its initializers (a float16
    weight's cast to float32, which the CPU's kernels compute in; a checkpoint's codes behind a
    DequantizeLinear): each is computed where it is used instead of held whole. At ORT_ENABLE_ALL such weights
    are folded into a float32 copy of each when the session loads (its initializer fusion), below that they run
    with the graph, and in priority order each runs just before the node that reads it (in the default order
    every one is ready at the start and runs first, so all the copies are live at once). Measured (40 float16
    weights of 4096 x 4096, 1.25 GiB mapped): 2.56 GiB resident after loading at ORT_ENABLE_ALL, a 3.9 GiB peak
    at ORT_DISABLE_ALL in the default order, 1.38 GiB at ORT_ENABLE_EXTENDED in priority order. The CPU arena is
    off: it would keep the memory of the largest weights live together (a tied head's float32 table beside a
    layer's) after the run. The graph is given as weights_when_used_graph makes it. Each run computes the
    weights again: for a session that runs a few times (validation, calibration), not for serving."""
    ort = import_onnxruntime()
    if opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
    opts.enable_cpu_mem_arena = False


def weights_when_used_graph(model, external_dir: str | Path | None = None) -> tuple[bytes, str | Path | None]:
    """A graph (a path; or serialized bytes, or a ModelProto read without its external data, whose external data
    lies in external_dir: the proto is rewritten in place) as serialized bytes for a
    session that computes its weights where they are used (compute_weights_when_used), and the folder its
    external data is read from. The graph is read without its external data; each weight read through a
    Transpose is read in place (onnx_graph.matmul_transposed_weights), so no copy of it is transposed again; a
    weight computed from initializers (a checkpoint's codes dequantized) is computed just before each node that
    reads it (onnx_graph.compute_weights_where_read), so one is live at a time; and a
    float16 weight or a dequantized one whose float32 copy exceeds 64 MiB (a head) is read a block of rows at a
    time (onnx_graph.read_half_weights_in_blocks, read_dequantized_weights_in_blocks), so its float32 copy is
    made a block at a time, and a lookup in a dequantized table dequantizes the rows it gathers
    (onnx_graph.gather_dequantized_rows)."""
    import onnx

    from kvforge.onnx_graph import (compute_weights_where_read, gather_dequantized_rows, matmul_transposed_weights,
                                    read_dequantized_weights_in_blocks, read_half_weights_in_blocks)

    proto = _graph_proto(model)
    if not isinstance(model, (onnx.ModelProto, bytes)):
        external_dir = Path(model).parent
    changed = compute_weights_where_read(proto)
    changed += matmul_transposed_weights(proto)
    changed += read_half_weights_in_blocks(proto)
    changed += read_dequantized_weights_in_blocks(proto)
    changed += gather_dequantized_rows(proto)
    if not changed and isinstance(model, bytes):
        return model, external_dir
    return proto.SerializeToString(), external_dir


def make_session(model, quant_format: str | None = None, providers: list[str] | None = None, optimization: str = "all",
                 threads: int | None = None, spinning: bool = True, external_dir: str | Path | None = None,
                 half_weights: bool = False, accuracy_level: int = 0, initializers: dict | None = None):
    """An InferenceSession over `model` (a path or serialized bytes) with the settings its Q/DQ format needs.
    spinning=False: its threads stop spinning when a run ends (ORT's session.force_spinning_stop), so that they do
    not take the cores from another session that runs in turn with it (a speculative draft and its target).
    external_dir: where the external data of a graph given as bytes lies (a bundle's folder): ONNX Runtime maps
    that file as it does for a graph loaded from its path, so the weights are not copied through the bytes.
    half_weights: a float16 graph run a few times (calibration's): each weight is cast to float32 where it is used
    (compute_weights_when_used), not copied whole when the session loads.
    accuracy_level: the fused MatMulNBits' (session_config; a graph's own MatMulNBits keep their attribute).
    initializers: OrtValues, by name, that stand for the graph's own initializers of those names: a weight that
    sessions over two graphs hold alike, held once (the caller keeps them alive while the session lives)."""
    ort = import_onnxruntime()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = {
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    }[optimization]
    if threads:
        opts.intra_op_num_threads = threads
    config = session_config(quant_format, providers, accuracy_level)
    if quant_format == "int8" and config.get("session.disable_quant_qdq") != "1" and _run_time_scales(model):
        config.update(EXACT_QDQ)
    for key, value in config.items():
        opts.add_session_config_entry(key, value)
    for name, value in (initializers or {}).items():
        opts.add_initializer(name, value)
    if not spinning:
        opts.add_session_config_entry("session.force_spinning_stop", "1")
    block_when_idle(opts)
    if os.environ.get(PROFILE_ENV):  # ONNX Runtime's own profiler: a JSON file per session, written when it closes
        opts.enable_profiling = True
        opts.profile_file_prefix = os.environ[PROFILE_ENV]
    if half_weights:
        compute_weights_when_used(opts)
        model, external_dir = weights_when_used_graph(model, external_dir)
    if external_dir is not None and isinstance(model, bytes):
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(external_dir))
    try:
        return ort.InferenceSession(
            model if isinstance(model, bytes) else str(model), opts, providers=providers or ["CPUExecutionProvider"],
            disabled_optimizers=QUANT_DISABLED_OPTIMIZERS.get(quant_format, []),
        )
    except Exception as e:  # ORT raises its own exception types for bad graphs
        where = "the graph" if isinstance(model, bytes) else model
        raise KvforgeError(f"ONNX Runtime cannot load {where}: {e}") from e


def prefill_feeds(batch: np.ndarray, config: dict, io, dtype: str) -> dict[str, np.ndarray]:
    """Feeds for a prefill of `batch` (B, T) from an empty cache (shaped as the IOSpec `io` says): what calibration
    and attribution runs use. An encoder's are its whole input: every token real, one segment."""
    b, t = batch.shape
    if not kind_of(config).kv_cache:
        feeds = {"input_ids": batch, "attention_mask": np.ones((b, t), np.int64)}
        if config.get("type_vocab_size", 0) > 1:
            feeds["token_type_ids"] = np.zeros((b, t), np.int64)
        return feeds
    np_dtype = np.float16 if dtype == "float16" else np.float32
    feeds = {
        "input_ids": batch,
        "attention_mask": np.ones((b, t), np.int64),
        "position_ids": np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy(),
        **{n: np.zeros(shape, np_dtype) for n, shape in io.cache_shapes(b).items()},
    }
    lora = io.extra.get("lora")
    if lora:  # LoRA slots: no adapter (the base model's own statistics)
        from .adapters import no_adapter_inputs

        feeds.update(no_adapter_inputs(lora, b, np_dtype))
    return feeds
