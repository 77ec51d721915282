"""`kvforge.runtime.load(source, backend="auto")`: a bundle opens as its kind's session (runtime/kinds.py); a model
source opens as a Session over the Torch reference."""

from __future__ import annotations

import os
from typing import Any

from kvforge.bundle import Bundle, IOSpec
from kvforge.errors import KvforgeError
from kvforge.kinds import kind_of

from .encoder_session import EncoderSession
from .kinds import session_of
from .seq2seq_session import Seq2SeqSession
from .session import BACKENDS, Session
from .torch_backend import TorchBackend


def load(source: str | os.PathLike, /, backend: str = "auto", **options) -> Session | EncoderSession | Seq2SeqSession:
    """Open a bundle (or, with the torch backend, any model source) as a Session.

    backend: "auto" (tensorrt for engine bundles, onnxruntime for ONNX bundles;
    torch for model sources), "onnxruntime", "tensorrt" or "torch". options go
    to the backend: onnxruntime takes device ("auto", "cpu", "cuda"), threads,
    optimization ("all", "extended", "basic", "none"), variant (True: the
    faster ORT-specific variant of the graph, see runtime/ort/variant.py;
    False: the bundle's graph exactly), accuracy_level (0: MatMulNBits exact;
    4, opt-in: 8-bit activations as llama.cpp's dot products, faster and not
    exact; kvforge/ort_session.ACCURACY_LEVELS), prefill_accuracy_level (the
    level of steps of more than one token a row, where it differs: a second
    session holding the weights again; 0 beside accuracy_level 4 prefills on
    level 0's faster many-row kernels); tensorrt runs engine bundles (`kvforge
    build`), and an ONNX bundle through an engine built once with the default
    limits and cached (runtime/trt_backend.py); torch takes device and source
    (the model to rebuild the reference from; default: the one recorded in the
    bundle's lineage). An encoder bundle (BERT, RoBERTa, Perceiver) opens as an
    EncoderSession (embed, classify), an encoder-decoder bundle (T5, BART) as a
    Seq2SeqSession (generate, stream), on onnxruntime or torch.
    """
    if backend not in ("auto", *BACKENDS):
        raise KvforgeError(f"unknown backend {backend!r}; choose from {('auto', *BACKENDS)}")
    if Bundle.is_bundle(source):
        bundle = Bundle(source)
        bundle.verify()  # before any cache derived from its files is consulted (docs/bundle.md: integrity)
        opener = session_of(bundle.kind)
        if bundle.is_engine and not opener.runs_engines:
            raise KvforgeError(f"{bundle.path} holds TensorRT engines of {bundle.kind.article} "
                               f"({', '.join(sorted(bundle.manifest.get('engines', {})))}); kvforge's runtime runs "
                               "encoder and encoder-decoder bundles on onnxruntime or torch: load the ONNX bundle they "
                               "were built from")
        return opener.open(bundle, backend, **options)
    if backend == "onnxruntime":
        raise KvforgeError(f"{source} is not a bundle; export it first (`kvforge export {source} -o OUT`) to run it on ONNX Runtime")
    if backend == "tensorrt":
        raise KvforgeError(f"{source} is not a bundle; export it first (`kvforge export {source} -o OUT`, then optionally "
                           "`kvforge build OUT -o ENGINE`) to run it on TensorRT")
    return _torch_session(source, **options)


def _torch_session(source, dtype: str = "float32", **options) -> Session:
    """A Session over the Torch reference built from a model source (no bundle needed)."""
    from kvforge.model_defs import load as load_model  # torch: only for a Session over a model source

    model, tokenizer = load_model(source, dtype=dtype)
    cfg = model.config.to_dict()
    kind = kind_of(cfg)
    if not kind.kv_cache:  # Session generates over a KV cache; other kinds' sessions read their bundle's graphs
        raise KvforgeError(f"{source} is {kind.article}; its sessions open from a bundle: export it first "
                           f"(`kvforge export {source} -o OUT`), then load OUT (backend='torch' runs the reference)")
    io = _io_from_config(cfg, dtype)
    impl = TorchBackend(cfg, io, source, dtype=dtype, **options)
    return Session(impl, tokenizer, cfg, io, str(source), f"{source}:{dtype}")


def _io_from_config(cfg: dict[str, Any], dtype: str) -> IOSpec:
    from kvforge.export.onnx_export import io_spec  # export and model_defs import torch (see above)
    from kvforge.model_defs import ModelConfig

    import torch

    return io_spec(ModelConfig.from_dict(cfg), getattr(torch, dtype), cfg["max_seq_len"])
