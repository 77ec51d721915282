"""ONNX Runtime backend: CPU, or CUDA where onnxruntime-gpu is installed. Imports no Torch.

The cache stays in OrtValues: each step binds the previous step's `present`
outputs as this step's `past` inputs through IO binding, so no cache tensor
is copied through numpy between steps.
"""

from __future__ import annotations

import numpy as np

from kvforge.errors import KvforgeError, MissingDependencyError

from .backend import Backend, KVCache
from .ort_variant import KEEP_INPUT

_ONNX_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "bfloat16": "tensor(bfloat16)", "int64": "tensor(int64)"}


def _ort():
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
_QUANT_DISABLED_OPTIMIZERS = {"int8": ["CommonSubexpressionElimination"], "fp8": ["ReluQuantRewrite"]}
_QUANT_SESSION_CONFIG = {
    "fp8": {"session.disable_quant_qdq": "1"},
    "int4": {"session.qdq_matmulnbits_accuracy_level": "0"},
}


def make_session(model, quant_format: str | None = None, providers: list[str] | None = None, optimization: str = "all",
                 threads: int | None = None):
    """An InferenceSession over `model` (a path or serialized bytes) with the settings its Q/DQ format needs."""
    ort = _ort()
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
    for key, value in _QUANT_SESSION_CONFIG.get(quant_format, {}).items():
        opts.add_session_config_entry(key, value)
    try:
        return ort.InferenceSession(
            model if isinstance(model, bytes) else str(model), opts, providers=providers or ["CPUExecutionProvider"],
            disabled_optimizers=_QUANT_DISABLED_OPTIMIZERS.get(quant_format, []),
        )
    except Exception as e:  # ORT raises its own exception types for bad graphs
        where = "the graph" if isinstance(model, bytes) else model
        raise KvforgeError(f"ONNX Runtime cannot load {where}: {e}") from e


def prefill_feeds(batch: np.ndarray, config: dict, past_names: list[str], dtype: str) -> dict[str, np.ndarray]:
    """Feeds for a prefill of `batch` (B, T) from an empty cache: what calibration and attribution runs use."""
    b, t = batch.shape
    np_dtype = np.float16 if dtype == "float16" else np.float32
    return {
        "input_ids": batch,
        "attention_mask": np.ones((b, t), np.int64),
        "position_ids": np.broadcast_to(np.arange(t, dtype=np.int64), (b, t)).copy(),
        **{n: np.zeros((b, config["n_kv_heads"], 0, config["head_dim"]), np_dtype) for n in past_names},
    }


_OPTIMIZATION_LEVELS = ("all", "extended", "basic", "none")


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    option_names = ("device", "threads", "optimization", "variant")

    def __init__(self, config, io, bundle, device: str = "auto", threads: int | None = None, optimization: str = "all",
                 variant: bool = True, **options):
        super().__init__(config, io, **options)
        if device not in ("auto", "cpu", "cuda"):
            raise KvforgeError(f"onnxruntime device {device!r} is not one of 'auto', 'cpu', 'cuda'")
        if optimization not in _OPTIMIZATION_LEVELS:
            raise KvforgeError(f"optimization {optimization!r} is not one of {_OPTIMIZATION_LEVELS}")
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
            raise KvforgeError(f"threads must be a positive int (or None for ONNX Runtime's default), got {threads!r}")
        self.bundle = bundle
        self.graph_path = bundle.graph_file
        self.variant = variant  # run the ORT-specific variant of the graph (see ort_variant.py)
        self.device = device
        self.threads = threads
        self.optimization = optimization
        self.session = None
        self.kv_dtype = io.input(io.past[0][0]).dtype if io.past else "float32"
        self.past_names = [n for layer in io.past for n in layer]
        self.present_names = [n for layer in io.present for n in layer]
        self.output_names = [t.name for t in io.outputs]
        self.quant_format = (bundle.manifest["precision"].get("quantization") or {}).get("format")

    def _providers(self) -> list[str]:
        ort = _ort()
        available = ort.get_available_providers()
        if self.device == "cuda":
            if "CUDAExecutionProvider" not in available:
                raise MissingDependencyError(
                    "ONNX Runtime's CUDA provider", "Install onnxruntime-gpu (`bash scripts/install.sh --gpu`) on a machine with an NVIDIA GPU."
                )
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        if self.device == "auto" and "CUDAExecutionProvider" in available:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    def activate_impl(self) -> None:
        providers = self._providers()
        if self.kv_dtype == "bfloat16" and providers == ["CPUExecutionProvider"]:
            raise KvforgeError(
                "ONNX Runtime's CPU provider has no bfloat16 kernels; run this bundle on a GPU, "
                "with the torch backend, or export float16/float32 for the CPU"
            )
        if self.variant:
            from .ort_variant import variant_path

            self.graph_path = variant_path(self.bundle)
        else:
            self.bundle.load_graph(external_data=False)  # external weights outside the bundle are refused here
        self.session = make_session(self.graph_path, self.quant_format, providers, self.optimization, self.threads)
        self.device_name = "cuda" if providers[0] == "CUDAExecutionProvider" else "cpu"
        names = [i.name for i in self.session.get_inputs()]
        expected = [t.name for t in self.io.inputs] + ([KEEP_INPUT] if self.variant else [])
        if names != expected:
            raise KvforgeError(f"{self.graph_path} inputs {names} differ from the manifest's IO spec {expected}")

    def deactivate_impl(self) -> None:
        self.session = None

    def empty_cache_impl(self, batch: int):
        ort = _ort()
        cfg = self.config
        shape = [batch, cfg["n_kv_heads"], 0, cfg["head_dim"]]
        np_dtype = np.float16 if self.kv_dtype == "float16" else np.float32
        return [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np_dtype), self.device_name, 0) for _ in self.past_names]

    def forward_impl(self, input_ids, attention_mask, position_ids, cache: KVCache, last_only: bool):
        binding = self.session.io_binding()
        if self.variant:
            binding.bind_cpu_input(KEEP_INPUT, np.array([1 if last_only else input_ids.shape[1]], np.int64))
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("attention_mask", attention_mask)
        binding.bind_cpu_input("position_ids", position_ids)
        for name, value in zip(self.past_names, cache.values):
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, self.device_name)
        self.session.run_with_iobinding(binding)
        outputs = dict(zip(self.output_names, binding.get_outputs()))
        logits = outputs["logits"].numpy()
        if last_only and not self.variant:
            logits = logits[:, -1:]
        present = [outputs[n] for n in self.present_names]
        return logits, KVCache(self.name, cache.batch, cache.length + input_ids.shape[1], present)

    def drop_oldest_impl(self, values, drops):
        ort = _ort()
        return [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, n:]), self.device_name, 0) if n else v
                for v, n in zip(values, drops)]

    def from_numpy_impl(self, arrays):
        ort = _ort()
        return [ort.OrtValue.ortvalue_from_numpy(a, self.device_name, 0) for a in arrays]

    def to_numpy(self, value) -> np.ndarray:
        return value.numpy()
