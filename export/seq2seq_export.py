"""Encoder-decoders (T5, BART) -> two ONNX graphs sharing one weight file, and their validation.

`encoder_model.onnx` runs once per source:

    input_ids                      int64       [batch_size, encoder_sequence_length]
    attention_mask                 int64       [batch_size, encoder_sequence_length]  1 = real token (right-padded)
    last_hidden_state              float32     [batch_size, encoder_sequence_length, dim]
    present.{i}.encoder.key/.value model dtype [batch_size, decoder_heads, encoder_sequence_length, decoder_head_dim]

the cross-attention keys and values of every decoder layer, computed once.
`decoder_model.onnx` runs every step, the first one included (past length 0):

    input_ids                            int64       [batch_size, decoder_sequence_length]
    encoder_attention_mask               int64       [batch_size, encoder_sequence_length]
    past_key_values.{i}.decoder.key/.value model dtype [batch_size, decoder_heads, past_decoder_sequence_length, decoder_head_dim]
    past_key_values.{i}.encoder.key/.value model dtype [batch_size, decoder_heads, encoder_sequence_length, decoder_head_dim]
    logits                               float32     [batch_size, decoder_sequence_length, vocab]
    present.{i}.decoder.key/.value       model dtype [batch_size, decoder_heads, total_decoder_sequence_length, decoder_head_dim]

(Hugging Face Optimum's names for its encoder and decoder-with-past graphs.)
One decoder graph serves the first step and the later ones, with no If node
(TensorRT). Weights common to both graphs (the shared embeddings) are stored
once: both graphs keep their initializers in one external file,
`model.onnx.data`, and a tensor the two share is one range of it.

Validation, on ONNX Runtime against the FP32 Torch model: the encoder on
full, right-padded and fuzzed batches (last hidden state and cross K/V on real
positions); the decoder on a grid of (batch, source padding, past, new
tokens) and fuzzed draws (logits and presents); and a lockstep greedy decode
that runs the exported encoder once and feeds each side's presents back,
comparing every step and the free-running tokens. Tolerances: the decoders'
(export/validate.py).
"""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvforge import metrics
from kvforge.bundle import BATCH, IOSpec, TensorSpec
from kvforge.errors import KvforgeError

from .encoder_export import example_inputs, failures_of, output_metrics, validation_cases
from .onnx_export import save_program, trace
from .validate import OrtRunner

ENCODER_GRAPH, DECODER_GRAPH, SHARED_DATA = "encoder_model.onnx", "decoder_model.onnx", "model.onnx.data"
ENC_SEQ, DEC_SEQ = "encoder_sequence_length", "decoder_sequence_length"
DEC_PAST, DEC_TOTAL = "past_decoder_sequence_length", "total_decoder_sequence_length"
_NP = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
LOCKSTEP_STEPS = 16


# --- names ------------------------------------------------------------------------
def cross_names(n: int, prefix: str) -> list[list[str]]:
    return [[f"{prefix}.{i}.encoder.key", f"{prefix}.{i}.encoder.value"] for i in range(n)]


def self_names(n: int, prefix: str) -> list[list[str]]:
    return [[f"{prefix}.{i}.decoder.key", f"{prefix}.{i}.decoder.value"] for i in range(n)]


def encoder_output_names(cfg) -> list[str]:
    return ["last_hidden_state"] + [n for pair in cross_names(cfg.n_decoder_layers, "present") for n in pair]


def decoder_input_names(cfg) -> list[str]:
    per_layer = [self_names(cfg.n_decoder_layers, "past_key_values")[i] + cross_names(cfg.n_decoder_layers, "past_key_values")[i]
                 for i in range(cfg.n_decoder_layers)]
    return ["input_ids", "encoder_attention_mask"] + [n for names in per_layer for n in names]


def decoder_output_names(cfg) -> list[str]:
    return ["logits"] + [n for pair in self_names(cfg.n_decoder_layers, "present") for n in pair]


def io_spec(cfg, dtype: torch.dtype, max_len: int) -> IOSpec:
    """The decoder graph's IO spec (its self-attention cache is the KV cache the runtime manages); the encoder
    graph's IO and the cross-attention cache's names go in `extra` (the graphs' files: the manifest's `graphs`)."""
    kv = _NP[dtype]
    H, D, n = cfg.decoder_heads, cfg.decoder_head_dim, cfg.n_decoder_layers
    cross_in = cross_names(n, "past_key_values")
    inputs = [TensorSpec("input_ids", "int64", [BATCH, DEC_SEQ]), TensorSpec("encoder_attention_mask", "int64", [BATCH, ENC_SEQ])]
    for i in range(n):
        inputs += [TensorSpec(name, kv, [BATCH, H, DEC_PAST, D]) for name in self_names(n, "past_key_values")[i]]
        inputs += [TensorSpec(name, kv, [BATCH, H, ENC_SEQ, D]) for name in cross_in[i]]
    outputs = [TensorSpec("logits", "float32", [BATCH, DEC_SEQ, cfg.vocab_size])] + [
        TensorSpec(name, kv, [BATCH, H, DEC_TOTAL, D]) for pair in self_names(n, "present") for name in pair]
    encoder = {
        "inputs": [TensorSpec(name, "int64", [BATCH, ENC_SEQ]).to_dict() for name in ("input_ids", "attention_mask")],
        "outputs": [TensorSpec("last_hidden_state", "float32", [BATCH, ENC_SEQ, cfg.dim]).to_dict()] + [
            TensorSpec(name, kv, [BATCH, H, ENC_SEQ, D]).to_dict() for pair in cross_names(n, "present") for name in pair],
    }
    return IOSpec(inputs, outputs, self_names(n, "past_key_values"), self_names(n, "present"), max_context=max_len,
                  extra={"architecture": "encoder-decoder", "encoder": encoder,
                         "cross_cache": {"inputs": cross_in, "encoder_outputs": cross_names(n, "present")},
                         "max_source_length": max_len})


# --- Torch wrappers -------------------------------------------------------------------
class FlatEncoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        hidden, cross = self.model.encode(input_ids, attention_mask)
        return (hidden.float(), *[t for kv in cross for t in kv])


class FlatDecoder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.n = model.config.n_decoder_layers

    def forward(self, input_ids, encoder_attention_mask, *caches):
        past = tuple((caches[4 * i], caches[4 * i + 1]) for i in range(self.n))
        cross = tuple((caches[4 * i + 2], caches[4 * i + 3]) for i in range(self.n))
        logits, present = self.model.decode(input_ids, encoder_attention_mask, past, cross)
        return (logits, *[t for kv in present for t in kv])


def source_inputs(cfg, batch: int, length: int, lengths: list[int] | None = None, seed: int = 0):
    """Seeded source ids (never the pad id where real), right-padded to `lengths`."""

    return example_inputs(cfg, batch, length, lengths, seed)[:2]


def decoder_inputs(cfg, dtype, cross, mask, seq: int, past: int, seed: int = 0):
    """input_ids, encoder_attention_mask and per layer (past key, past value, cross key, cross value)."""
    gen = torch.Generator().manual_seed(seed)
    B = mask.shape[0]
    ids = torch.randint(0, cfg.vocab_size, (B, seq), generator=gen)
    caches = []
    for k, v in cross:
        pk = torch.randn(B, cfg.decoder_heads, past, cfg.decoder_head_dim, generator=gen).to(dtype)
        pv = torch.randn(B, cfg.decoder_heads, past, cfg.decoder_head_dim, generator=gen).to(dtype)
        caches += [pk, pv, k.to(dtype), v.to(dtype)]
    return (ids, mask, *caches)


# --- export -------------------------------------------------------------------------------
def _name_dims(graph, symbols: dict[tuple[str, int], str], known: set[str]) -> None:
    """Give the exporter's symbols the contract's names; a sum past + new becomes the total."""
    import onnx_ir as ir

    values = {v.name: v for v in list(graph.inputs) + list(graph.outputs)}
    table = {}
    for (name, axis), wanted in symbols.items():
        dim = values[name].shape[axis]
        if not isinstance(dim, int):
            table.setdefault(str(dim), wanted)

    def rename(text: str) -> str:
        named = re.sub(r"[A-Za-z_]\w*", lambda m: table.get(m.group(0), m.group(0)), text).replace(" ", "")
        return DEC_TOTAL if named in (f"{DEC_PAST}+{DEC_SEQ}", f"{DEC_SEQ}+{DEC_PAST}") else named

    for v in values.values():
        if v.shape is not None:
            v.shape = ir.Shape([d if isinstance(d, int) else rename(str(d)) for d in v.shape])
    unknown = {str(d) for v in values.values() for d in (v.shape or []) if not isinstance(d, int) and str(d) not in known}
    if unknown:
        raise KvforgeError(f"export produced dimensions outside the IO contract: {sorted(unknown)}")


def share_weights(paths: list[Path], data_name: str = SHARED_DATA, min_bytes: int = 1024) -> dict[str, int]:
    """Move the initializers of several graphs into one external data file beside them, each distinct tensor
    stored once: a tensor two graphs hold (the shared embeddings) becomes one range both point to."""
    import onnx
    from onnx.external_data_helper import set_external_data

    directory = paths[0].parent
    offsets: dict[str, tuple[int, int]] = {}
    stored = shared = 0
    models = [onnx.load(str(p)) for p in paths]
    with open(directory / data_name, "wb") as data:
        for model in models:
            for tensor in model.graph.initializer:
                raw = tensor.raw_data
                if len(raw) < min_bytes:
                    continue
                key = hashlib.sha256(bytes(str((tensor.data_type, list(tensor.dims))), "utf-8") + raw).hexdigest()
                if key in offsets:
                    shared += len(raw)
                else:
                    pad = (-data.tell()) % 64  # aligned, as onnx writes external data
                    data.write(b"\0" * pad)
                    offsets[key] = (data.tell(), len(raw))
                    data.write(raw)
                    stored += len(raw)
                offset, length = offsets[key]
                set_external_data(tensor, data_name, offset, length)
                tensor.ClearField("raw_data")
    for model, path in zip(models, paths):
        onnx.save(model, str(path))
    return {"stored_bytes": stored, "shared_bytes": shared}


def export_seq2seq_onnx(model, directory: Path, opset: int) -> dict[str, Any]:
    """Write encoder_model.onnx, decoder_model.onnx and their shared model.onnx.data into `directory`."""
    cfg = model.config
    dtype = model.dtype
    dyn = torch.export.Dim.DYNAMIC
    n = cfg.n_decoder_layers
    batch, length, seq, past = 2, 7, 3, 5  # distinct, none 0 or 1
    src = source_inputs(cfg, batch, length, [length, length - 3])
    enc = trace(FlatEncoder(model).eval(), src, {"input_ids": {0: dyn, 1: dyn}, "attention_mask": {0: dyn, 1: dyn}},
                 ["input_ids", "attention_mask"], encoder_output_names(cfg), opset)
    _name_dims(enc.model.graph, {("input_ids", 0): BATCH, ("input_ids", 1): ENC_SEQ}, {BATCH, ENC_SEQ})
    save_program(enc, directory / ENCODER_GRAPH, external_data=False)

    with torch.no_grad():
        _, cross = model.encode(*src)
    args = decoder_inputs(cfg, dtype, cross, src[1], seq, past)
    cache_dims = []
    for _ in range(n):
        cache_dims += [{0: dyn, 2: dyn}] * 4
    dec = trace(FlatDecoder(model).eval(), args,
                 {"input_ids": {0: dyn, 1: dyn}, "encoder_attention_mask": {0: dyn, 1: dyn}, "caches": tuple(cache_dims)},
                 decoder_input_names(cfg), decoder_output_names(cfg), opset)
    _name_dims(dec.model.graph, {("input_ids", 0): BATCH, ("input_ids", 1): DEC_SEQ,
                                 ("encoder_attention_mask", 1): ENC_SEQ, ("past_key_values.0.decoder.key", 2): DEC_PAST},
               {BATCH, ENC_SEQ, DEC_SEQ, DEC_PAST, DEC_TOTAL})
    save_program(dec, directory / DECODER_GRAPH, external_data=False)
    return share_weights([directory / ENCODER_GRAPH, directory / DECODER_GRAPH])


# --- validation -----------------------------------------------------------------------------
TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"max_abs": 1e-4, "max_abs_of_magnitude": 2e-6, "greedy_min": LOCKSTEP_STEPS},
    "float16": {"rel_l2": 1e-2},
    "bfloat16": {"rel_l2": 5e-2},
}


def _group(results: list[dict[str, dict]], key: str) -> list[dict[str, float]]:
    return [{k: v for k, v in r[key].items() if k != "finite"} for r in results if key in r]


@torch.no_grad()
def validate_seq2seq(directory: Path, reference, dtype: str, max_len: int, fuzz: int = 4, seed: int = 0,
                     progress=None) -> dict[str, Any]:
    cfg = reference.config
    tol = TOLERANCES[dtype]
    enc_run, dec_run = OrtRunner(directory / ENCODER_GRAPH, dtype), OrtRunner(directory / DECODER_GRAPH, dtype)
    if dec_run.names != decoder_input_names(cfg):
        raise KvforgeError(f"decoder graph inputs {dec_run.names[:4]}... do not follow the IO contract")
    flat_dec = FlatDecoder(reference).eval()
    failures: list[str] = []
    enc_results, dec_results = [], []
    enc_cases = validation_cases(max_len, fuzz, seed)
    total = len(enc_cases) + 8 + fuzz + LOCKSTEP_STEPS
    done = 0

    def tick():
        nonlocal done
        done += 1
        if progress:
            progress(done, total)

    # the encoder: hidden state and cross K/V on real source positions
    for i, (name, batch, length, lengths) in enumerate(enc_cases):
        src = source_inputs(cfg, batch, length, lengths, seed + i)
        hidden, cross = reference.encode(*src)
        out = enc_run.run(src)
        real = src[1].numpy().astype(bool)
        result = {"last_hidden_state": output_metrics("hidden", out[0][real], hidden.numpy()[real])}
        kv_c = [o.astype(np.float32).transpose(0, 2, 1, 3)[real] for o in out[1:]]
        kv_r = [t.float().numpy().transpose(0, 2, 1, 3)[real] for kv in cross for t in kv]
        result["cross_kv"] = metrics.worst([output_metrics("kv", c, r) for c, r in zip(kv_c, kv_r)])
        result["cross_kv"]["finite"] = all(np.isfinite(c).all() for c in kv_c)
        failures += failures_of(result, tol, f"encoder {name} (batch {batch}, length {length})")
        enc_results.append(result)
        tick()

    # the decoder: logits and presents on a grid of (batch, source padding, past, new tokens) and fuzzed draws
    long_past = max(1, min(max_len - 8, 96))
    grid = [("first step", 1, 6, None, 0, 1), ("first step b3 padded source", 3, 9, [9, 4, 1], 0, 1),
            ("several new tokens", 2, 5, None, 0, 4), ("decode after 5", 1, 7, None, 5, 1),
            ("decode b3 after 5, padded source", 3, 8, [8, 2, 5], 5, 1), ("chunk after 6", 2, 4, [4, 3], 6, 3),
            ("decode long past", 1, 5, None, long_past, 1), ("long source", 2, min(max_len, 64), [min(max_len, 64), 9], 2, 1)]
    rng = random.Random(seed)
    for i in range(fuzz):
        b, length = rng.randint(1, 4), rng.randint(1, min(max_len, 40))
        grid.append((f"fuzz {i}", b, length, [rng.randint(1, length) for _ in range(b)], rng.randint(0, min(max_len - 4, 40)),
                     rng.randint(1, 4)))
    for i, (name, batch, length, lengths, past, seq) in enumerate(grid):
        past, seq = min(past, max_len - 1), max(1, min(seq, max_len - min(past, max_len - 1)))
        src = source_inputs(cfg, batch, min(length, max_len), [min(x, max_len) for x in lengths] if lengths else None, seed + 50 + i)
        _, cross = reference.encode(*src)
        args = decoder_inputs(cfg, reference.dtype, cross, src[1], seq, past, seed + 50 + i)
        cand = dec_run.run(args)
        # the reference sees exactly what the candidate sees (the caches rounded to its dtype)
        ref = flat_dec(*(torch.from_numpy(dec_run.cast(t)).float() if t.is_floating_point() else t for t in args))
        result = {"logits": output_metrics("logits", cand[0], ref[0].numpy())}
        result["present"] = metrics.worst([output_metrics("present", c, r.float().numpy()) for c, r in zip(cand[1:], ref[1:])])
        result["present"]["finite"] = all(np.isfinite(np.asarray(c, np.float32)).all() for c in cand[1:])
        failures += failures_of(result, tol, f"decoder {name} (batch {batch}, past {past}, new {seq})")
        dec_results.append(result)
        tick()

    lock = _lockstep(enc_run, dec_run, reference, tol, seed, max_len, tick)
    failures += lock.pop("failures")
    return {
        "dtype": dtype, "reference": "torch float32", "tolerances": tol,
        "cases": len(enc_results) + len(dec_results),
        "encoder": {k: metrics.worst(_group(enc_results, k)) for k in ("last_hidden_state", "cross_kv")},
        "decoder": {k: metrics.worst(_group(dec_results, k)) for k in ("logits", "present")},
        "lockstep": lock, "passed": not failures, "failures": failures,
    }


def _lockstep(enc_run, dec_run, reference, tol, seed, max_len, tick) -> dict[str, Any]:
    """The exported encoder once, then LOCKSTEP_STEPS decoder steps on each side's own cache: teacher-forced
    (both fed the reference's greedy token; logits and presents compared every step) and free-running."""
    cfg = reference.config
    src = source_inputs(cfg, 2, min(12, max_len), [min(12, max_len), min(7, max_len)], seed + 99)
    steps = min(LOCKSTEP_STEPS, max_len - 1)
    _, ref_cross = reference.encode(*src)
    enc_out = enc_run.run(src)
    cand_cross = [(enc_out[1 + 2 * i], enc_out[2 + 2 * i]) for i in range(cfg.n_decoder_layers)]
    empty = np.zeros((2, cfg.decoder_heads, 0, cfg.decoder_head_dim), np.asarray(enc_out[1]).dtype)

    def cand_step(ids, past):
        feeds = [ids.numpy(), src[1].numpy()]
        for i, (k, v) in enumerate(cand_cross):
            feeds += [*(past[i] if past else (empty, empty)), k, v]
        out = dec_run.session.run(None, dict(zip(dec_run.names, feeds)))
        return out[0], [(out[1 + 2 * i], out[2 + 2 * i]) for i in range(cfg.n_decoder_layers)]

    def ref_step(ids, past):
        logits, present = reference.decode(ids, src[1], past, ref_cross)
        return logits, present

    start = torch.full((2, 1), cfg.decoder_start_token_id, dtype=torch.int64)
    worst_logits, worst_present, failures = [], [], []
    ids, cp, rp = start, None, None
    for step in range(steps):
        lc, cp = cand_step(ids, cp)
        lr, rp = ref_step(ids, rp)
        result = {"logits": output_metrics("logits", lc, lr.numpy()),
                  "present": metrics.worst([output_metrics("p", np.asarray(c, np.float32), r.float().numpy())
                                            for (ck, cv), (rk, rv) in zip(cp, rp) for c, r in ((ck, rk), (cv, rv))])}
        result["present"]["finite"] = True
        failures += failures_of(result, tol, f"lockstep step {step}")
        worst_logits.append({k: v for k, v in result["logits"].items() if k != "finite"})
        worst_present.append({k: v for k, v in result["present"].items() if k != "finite"})
        ids = lr[:, -1:].argmax(-1)
        tick()

    def greedy(step_fn):
        ids, past, tokens = start, None, []
        for _ in range(steps):
            logits, past = step_fn(ids, past)
            ids = torch.as_tensor(np.asarray(logits)[:, -1:].argmax(-1))
            tokens.append(ids[:, 0].tolist())
        return tokens

    ref_tokens, cand_tokens = greedy(ref_step), greedy(cand_step)
    matching = sum(a == b for a, b in zip(ref_tokens, cand_tokens))
    need = min(tol.get("greedy_min", 0), steps)
    if matching < need:
        failures.append(f"greedy tokens agree on {matching} of {steps} steps, need {need}")
    return {"steps": steps, "logits": metrics.worst(worst_logits), "present": metrics.worst(worst_present),
            "greedy_matching_steps": matching, "failures": failures}
