"""Encoders (BERT, RoBERTa, the Perceiver) -> one ONNX graph, and its validation against the Torch reference.

The IO contract (Hugging Face Optimum's names for feature-extraction, fill-mask and text-classification):

    input_ids          int64   [batch_size, sequence_length]
    attention_mask     int64   [batch_size, sequence_length]   1 = real token (right-padded batches)
    token_type_ids     int64   [batch_size, sequence_length]   only when the model has segment types (BERT)
    last_hidden_state  float32 [batch_size, sequence_length, dim]   (a Perceiver: [batch_size, n_latents, dim])
    logits             float32 [batch_size, sequence_length, vocab] (masked LM) or [batch_size, num_labels]
    pooler_output      float32 [batch_size, dim]                    (a base BERT / RoBERTa with its pooler)

There is no cache: the IO spec's kv_cache lists no layers.

Validation runs the graph on ONNX Runtime against the FP32 Torch model: full
and right-padded batches, the longest input, and fuzzed (batch, length,
padding) draws, comparing every output on the positions that hold real tokens
(padded positions are computed but meaningless, as in transformers). The
tolerances are the decoders' (export/validate.py): FP32 1e-4 max abs (or
2e-6 of the largest reference magnitude above 50), FP16 rel L2 1e-2, BF16 5e-2.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvforge import metrics
from kvforge.bundle import BATCH, SEQ, IOSpec, TensorSpec
from kvforge.errors import KvforgeError
from kvforge.model_defs.encoder import head_output

from .onnx_export import save_program, trace
from .replicate import hidden_names, hidden_states, prefix, traced_program
from .validate import OrtRunner

TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"max_abs": 1e-4, "max_abs_of_magnitude": 2e-6},
    "float16": {"rel_l2": 1e-2},
    "bfloat16": {"rel_l2": 5e-2},
}


def input_names(cfg) -> list[str]:
    names = ["input_ids", "attention_mask"]
    return names + ["token_type_ids"] if cfg.type_vocab_size > 1 else names


def output_names(cfg) -> list[str]:
    head = head_output(cfg)
    return ["last_hidden_state"] + ([head] if head else [])


def _latents(cfg) -> int | None:
    """A Perceiver's hidden states are its latents (a fixed count); an encoder's are one row per token."""
    return getattr(cfg, "n_latents", None)


def _per_token(cfg, name: str) -> bool:
    """Whether the output has one row per input token (and padded rows to ignore)."""
    if name == "last_hidden_state":
        return not _latents(cfg)
    return name == "logits" and cfg.head == "mlm"


def io_spec(cfg, max_len: int) -> IOSpec:
    hidden_len = _latents(cfg) or SEQ
    shapes = {
        "last_hidden_state": [BATCH, hidden_len, cfg.dim],
        "logits": [BATCH, SEQ, cfg.vocab_size] if cfg.head == "mlm" else [BATCH, cfg.num_labels],
        "pooler_output": [BATCH, cfg.dim],
    }
    return IOSpec(
        inputs=[TensorSpec(n, "int64", [BATCH, SEQ]) for n in input_names(cfg)],
        outputs=[TensorSpec(n, "float32", shapes[n]) for n in output_names(cfg)],
        past=[], present=[], max_context=max_len,
        extra={"architecture": cfg.architecture, "per_token_outputs": [n for n in output_names(cfg) if _per_token(cfg, n)]},
    )


class FlatEncoder(torch.nn.Module):
    """The encoder with positional tensor inputs and a tuple of outputs, in IO-contract order; n_layers: its first
    n layers only, with their hidden states after the outputs (a traced prefix: export/replicate.py)."""

    def __init__(self, model, n_layers: int | None = None):
        super().__init__()
        self.model = model if n_layers is None else prefix(model, n_layers)
        self.names = output_names(model.config)
        self.n_layers = n_layers

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        capture = hidden_states(self.model.layers) if self.n_layers is not None else contextlib.nullcontext([])
        with capture as hidden:
            out = self.model(input_ids, attention_mask, token_type_ids)
        return (*(out[n] for n in self.names), *hidden)


def example_inputs(cfg, batch: int, seq: int, lengths: list[int] | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Seeded inputs: random ids (never the pad id in real positions), right padding to `lengths`, random segments."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    pad = cfg.pad_token_id
    if pad is not None:
        ids = torch.where(ids == pad, (ids + 1) % cfg.vocab_size, ids)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row, n in enumerate(lengths or []):
        mask[row, n:] = 0
        if pad is not None:
            ids[row, n:] = pad
    args = [ids, mask]
    if getattr(cfg, "type_vocab_size", 0) > 1:
        types = torch.randint(0, cfg.type_vocab_size, (batch, seq), generator=gen)
        args.append(types * mask)
    return tuple(args)


def _rename_dims(graph) -> None:
    """The exporter's symbols for the batch and sequence dimensions get the contract's names."""
    import onnx_ir as ir

    values = list(graph.inputs) + list(graph.outputs)
    ids = graph.inputs[0]
    symbol = {str(ids.shape[0]): BATCH, str(ids.shape[1]): SEQ}
    for v in values:
        if v.shape is not None:
            v.shape = ir.Shape([d if isinstance(d, int) else symbol.get(str(d), str(d)) for d in v.shape])
    unknown = {str(d) for v in values for d in (v.shape or []) if not isinstance(d, int) and str(d) not in (BATCH, SEQ)}
    if unknown:
        raise KvforgeError(f"encoder export produced dimensions outside the IO contract: {sorted(unknown)}")


def export_encoder_onnx(model, path: Path, opset: int, external_data: bool | None = None,
                        every_layer: bool = False) -> Path:
    """Export an encoder (in its target dtype, eval mode) to `path`: each layer design traced once and copied
    (export/replicate.py) unless every_layer."""

    cfg = model.config
    # distinct example sizes that are neither 0 nor 1 (nor a Perceiver's latent count), so none is specialized
    batch = next(b for b in (2, 3, 4) if b != getattr(cfg, "n_latents", None))
    seq = next(s for s in (5, 6, 7) if s not in (batch, getattr(cfg, "n_latents", None)))
    args = example_inputs(cfg, batch, seq, [seq, seq - 2][:batch] + [seq] * (batch - 2))
    dyn = torch.export.Dim.DYNAMIC
    names = input_names(cfg)
    dynamic_shapes = {n: {0: dyn, 1: dyn} for n in ("input_ids", "attention_mask", "token_type_ids")[:len(names)]}

    def traced(n_layers: int | None):
        flat = FlatEncoder(model, n_layers).eval()
        outputs = output_names(cfg) + (hidden_names(n_layers) if n_layers is not None else [])
        return trace(flat, args, dynamic_shapes, names, outputs, opset, optimize=n_layers is None)

    program = traced_program(model, traced, lambda: traced(None), names, output_names(cfg), every_layer)
    _rename_dims(program.model.graph)
    return save_program(program, path, external_data)


def validation_cases(max_len: int, fuzz: int, seed: int) -> list[tuple[str, int, int, list[int] | None]]:
    """(name, batch, length, right-padded row lengths or None)."""
    cases = [
        ("b1", 1, 7, None),
        ("b3", 3, 5, None),
        ("right-padded b3", 3, 9, [9, 5, 2]),
        ("one token", 2, 1, None),
        ("longest input", 1, max_len, None),
        ("padded long b2", 2, min(max_len, 64), [min(max_len, 64), min(max_len, 17)]),
    ]
    rng = random.Random(seed)
    for i in range(fuzz):
        b, t = rng.randint(1, 4), rng.randint(1, min(max_len, 48))
        cases.append((f"fuzz {i}", b, t, [rng.randint(1, t) for _ in range(b)]))
    return [(n, b, min(t, max_len), [min(x, max_len) for x in lens] if lens else None) for n, b, t, lens in cases]


def compare_outputs(cfg, outputs: list[np.ndarray], reference: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, dict]:
    """Per output: max abs, rel L2 and cosine on real positions (top-1 agreement for logits), plus the reference's magnitude."""
    result = {}
    valid = mask.astype(bool)
    for name, cand in zip(output_names(cfg), outputs):
        ref = np.asarray(reference[name], np.float32)
        cand = np.asarray(cand, np.float32)
        if _per_token(cfg, name):
            ref, cand = ref[valid], cand[valid]
        m = metrics.logits_metrics(cand, ref) if name == "logits" else metrics.tensor_metrics(cand, ref)
        m["reference_magnitude"] = float(np.abs(ref).max()) if ref.size else 0.0
        m["finite"] = bool(np.isfinite(cand).all())
        result[name] = m
    return result


def output_metrics(name: str, cand, ref) -> dict[str, float]:
    """One output's metrics against the reference (logits' for "logits", a tensor's otherwise), with the reference's
    magnitude and whether the candidate is finite: what failures_of reads."""
    cand, ref = np.asarray(cand, np.float32), np.asarray(ref, np.float32)
    m = metrics.logits_metrics(cand, ref) if name == "logits" else metrics.tensor_metrics(cand, ref)
    m["reference_magnitude"] = float(np.abs(ref).max()) if ref.size else 0.0
    m["finite"] = bool(np.isfinite(cand).all())
    return m


def failures_of(result: dict[str, dict], tol: dict[str, float], where: str = "") -> list[str]:
    """The bounds each output's metrics break (max abs: the larger of the bound and its share of the reference's
    magnitude; rel L2), one sentence each, prefixed by `where`."""
    out = []
    prefix = f"{where}: " if where else ""
    for name, m in result.items():
        if not m["finite"]:
            out.append(f"{prefix}{name} holds non-finite values")
        if "max_abs" in tol:
            limit = max(tol["max_abs"], tol.get("max_abs_of_magnitude", 0.0) * m["reference_magnitude"])
            if m["max_abs"] > limit:
                out.append(f"{prefix}{name} max_abs {m['max_abs']:.3g} > {limit:.3g}")
        if "rel_l2" in tol and m["rel_l2"] > tol["rel_l2"]:
            out.append(f"{prefix}{name} rel_l2 {m['rel_l2']:.3g} > {tol['rel_l2']:.3g}")
    return out


@torch.no_grad()
def validate_encoder(path: Path, reference, dtype: str, max_len: int, fuzz: int = 6, seed: int = 0,
                     progress=None) -> dict[str, Any]:
    """Every check; the metrics per output (worst case) and a list of failures (empty = passed)."""

    cfg = reference.config
    tol = TOLERANCES[dtype]
    runner = OrtRunner(path, dtype)
    if runner.names != input_names(cfg):
        raise KvforgeError(f"graph inputs {runner.names} do not follow the encoder IO contract {input_names(cfg)}")
    cases = validation_cases(max_len, fuzz, seed)
    per_output: dict[str, list] = {n: [] for n in output_names(cfg)}
    failures = []
    for i, (name, batch, seq, lengths) in enumerate(cases):
        args = example_inputs(cfg, batch, seq, lengths, seed + i)
        ref = {k: v.numpy() for k, v in reference(*args).items()}
        result = compare_outputs(cfg, runner.run(args), ref, args[1].numpy())
        for out, m in result.items():
            per_output[out].append(m)
        failures += failures_of(result, tol, f"{name} (batch {batch}, length {seq})")
        if progress:
            progress(i + 1, len(cases))
    return {
        "dtype": dtype,
        "reference": "torch float32",
        "tolerances": tol,
        "cases": len(cases),
        "outputs": {n: metrics.worst([{k: v for k, v in m.items() if k != "finite"} for m in ms])
                    for n, ms in per_output.items()},
        "passed": not failures,
        "failures": failures,
    }
