"""Backends for the kinds without a decoder's KV-cache step: encoders (BERT, RoBERTa, the Perceiver) and
encoder-decoders (T5, BART). They are `Runner`s like the decoder's `Backend` (runtime/backend.py): one name, the
options they take checked when the session opens, activate/deactivate around `*_impl` hooks, and the torch
reference found by `torch_source`.

- `OrtGraphs` runs a bundle's graphs by role on ONNX Runtime's CPU provider: `run(role, feeds)` -> outputs in
  the graph's order; `OrtSeq2Seq` adds the encoder-decoder's `encode` and `decode` over its two graphs.
- `TorchEncoder` and `TorchSeq2Seq` run the reference rebuilt from the bundle's source; with float_reference a
  quantized bundle's float origin (what `kvforge compare` measures against).

`ENCODER_BACKENDS` and `SEQ2SEQ_BACKENDS` map a backend name to its class for runtime/graph_session.py.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kvforge.bundle import Bundle, IOSpec
from kvforge.errors import KvforgeError
from kvforge.ort_session import make_session

from .backend import Runner, torch_source
from .ort.attention import use_multi_head_attention
from .ort.per_token import integer_per_token_matmuls
from .ort.variant import fuse_sibling_quantized_matmuls

PROTOBUF_LIMIT = 2**31 - 1  # a serialized graph's bound

Pairs = list[tuple[Any, Any]]  # per decoder layer: (key, value)


class OrtGraphs(Runner):
    name = "onnxruntime"
    option_names = ("device", "threads", "optimization")

    def __init__(self, bundle: Bundle, device: str = "cpu", threads: int | None = None, optimization: str = "all",
                 **options):
        super().__init__(**options)
        if device not in ("cpu", "auto"):
            raise KvforgeError(f"{bundle.kind.name} sessions run on device 'cpu' here, not {device!r}")
        if bundle.dtype == "bfloat16":
            raise KvforgeError("ONNX Runtime's CPU provider has no bfloat16 kernels; run a float32 or float16 bundle")
        self.bundle, self.threads, self.optimization = bundle, threads, optimization
        self.graphs = bundle.graphs  # role -> file
        self.sessions: dict[str, Any] = {}
        self.dtype = np.float16 if bundle.dtype == "float16" else np.float32

    def activate_impl(self) -> None:
        self.bundle.load_graph(external_data=False)  # refuses external data outside the bundle
        quant = self.bundle.session_format
        self.sessions = {role: make_session(self._graph(file), quant, optimization=self.optimization,
                                            threads=self.threads, external_dir=self.bundle.path)
                         for role, file in self.graphs.items()}

    def _graph(self, file: str):
        """What ONNX Runtime loads for one of the bundle's graphs: its file, or its faster form for ONNX Runtime, as
        bytes whose external data stays in the bundle's file: each bidirectional attention layer as one
        MultiHeadAttention (runtime/ort/attention.py), and per-token INT8 MatMuls on the integer kernels
        (runtime/ort/per_token.py). The bundle's graph is unchanged."""
        path = self.bundle.path / file
        if self.optimization == "none":  # as written
            return path
        import onnx

        cfg = self.bundle.model_config
        model = onnx.load(str(path), load_external_data=False)
        changed = use_multi_head_attention(model, cfg.get("n_heads", 0), cfg.get("n_kv_heads", cfg.get("n_heads", 0)),
                                           cfg.get("head_dim", 0))
        if (self.bundle.quantization or {}).get("activations") == "per-token dynamic":
            fuse_sibling_quantized_matmuls(model, str(self.bundle.path))  # q/k/v: one integer kernel over the row codes
            # none where this CPU's kernel is not exact: the MatMuls run in float
            changed += integer_per_token_matmuls(model, str(self.bundle.path))
        return model.SerializeToString() if changed and model.ByteSize() < PROTOBUF_LIMIT else path

    def deactivate_impl(self) -> None:
        self.sessions = {}

    def run(self, role: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.check_active()
        return self.sessions[role].run(None, feeds)


class OrtSeq2Seq(OrtGraphs):
    def activate_impl(self) -> None:
        super().activate_impl()
        self.decoder_inputs = [i.name for i in self.sessions["decoder"].get_inputs()]

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> Pairs:
        out = self.run("encoder", {"input_ids": ids, "attention_mask": mask})
        return [(out[1 + 2 * i], out[2 + 2 * i]) for i in range((len(out) - 1) // 2)]

    def decode(self, ids: np.ndarray, mask: np.ndarray, past: Pairs, cross: Pairs) -> tuple[np.ndarray, Pairs]:
        feeds = [ids, mask]
        for (pk, pv), (ck, cv) in zip(past, cross):
            feeds += [pk, pv, ck, cv]
        out = self.run("decoder", dict(zip(self.decoder_inputs, feeds)))
        return out[0], [(out[1 + 2 * i], out[2 + 2 * i]) for i in range(len(past))]

    def empty(self, batch: int, heads: int, dim: int) -> np.ndarray:
        return np.zeros((batch, heads, 0, dim), self.dtype)


def torch_runner(source, config: dict[str, Any], io: IOSpec, dtype: str = "float32", device: str = "cpu"
                 ) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    """run(feeds) -> outputs in IO order, on the Torch reference built from `source` (a preset, checkpoint or
    Hugging Face directory), which must build the model `config` describes."""
    import torch

    model = _reference(source, config, dtype).to(device)
    names = [t.name for t in io.outputs]

    @torch.no_grad()
    def run(feeds):
        out = model(*(torch.from_numpy(feeds[t.name]).to(device) for t in io.inputs))
        return [out[n].float().cpu().numpy() for n in names]
    return run


def _reference(source, config: dict[str, Any], dtype: str):
    from kvforge.model_defs import load  # torch: only for the torch backend, on activation

    model, _ = load(source, dtype=dtype)
    if model.config.to_dict() != config:
        raise KvforgeError(f"the source {source!r} builds a model whose config differs from the bundle's")
    return model


class _TorchRunner(Runner):
    name = "torch"
    option_names = ("source", "device")

    def __init__(self, bundle: Bundle, source: str | None = None, device: str = "cpu", float_reference: bool = False,
                 **options):
        """float_reference: run the float model a quantized bundle was made from (what compare measures against)."""
        super().__init__(**options)
        self.bundle, self.device = bundle, device
        self.source = torch_source(bundle, source, float_reference)
        self.dtype_name = "float32" if float_reference else bundle.dtype


class TorchEncoder(_TorchRunner):
    def activate_impl(self) -> None:
        self._run = torch_runner(self.source, self.bundle.model_config, self.bundle.io, self.dtype_name, self.device)

    def deactivate_impl(self) -> None:
        self._run = None

    def run(self, role: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.check_active()
        return self._run(feeds)


class TorchSeq2Seq(_TorchRunner):
    def activate_impl(self) -> None:
        import torch

        self.torch = torch
        self.model = _reference(self.source, self.bundle.model_config, self.dtype_name).to(self.device)

    def deactivate_impl(self) -> None:
        self.model = None

    def _t(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def encode(self, ids, mask) -> Pairs:
        self.check_active()
        with self.torch.no_grad():
            _, cross = self.model.encode(self._t(ids), self._t(mask))
        return [(k, v) for k, v in cross]  # kept as tensors between steps

    def decode(self, ids, mask, past, cross):
        self.check_active()
        with self.torch.no_grad():
            past = None if past[0][0].shape[2] == 0 else past
            logits, present = self.model.decode(self._t(ids), self._t(mask), past, cross)
        return logits.float().cpu().numpy(), list(present)

    def empty(self, batch: int, heads: int, dim: int):
        return self.torch.zeros(batch, heads, 0, dim, dtype=self.model.dtype, device=self.device)


ENCODER_BACKENDS: dict[str, type[Runner]] = {"onnxruntime": OrtGraphs, "torch": TorchEncoder}
SEQ2SEQ_BACKENDS: dict[str, type[Runner]] = {"onnxruntime": OrtSeq2Seq, "torch": TorchSeq2Seq}
