"""`compare` for encoder bundles (BERT, RoBERTa, the Perceiver): the metrics that fit an encoder.

The inputs are windows of held-out text (or seeded random tokens), each cut to
a seeded length between a quarter of the window and all of it, so every batch
is right-padded as a real one is. Candidate and reference (the FP32 Torch
model the bundle was made from) see the same ids; per output:

- last_hidden_state over real tokens: max abs, rel L2, and the cosine of each
  token's vector (`hidden_cosine_min`, the worst token);
- the pooled embedding of each input (mean over real tokens, or over a
  Perceiver's latents): `embedding_cosine_mean` and `embedding_cosine_min`;
- a masked-LM head's logits over real tokens, or a classification head's per
  input: `top1_agreement` (the prediction unchanged), `kl_divergence_mean`,
  `logits_rel_l2`, `logits_max_abs`;
- a base model's pooler_output: `pooler_cosine_min`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from kvforge import metrics, runtime
from kvforge.bundle import Bundle
from kvforge.calibration.data import eval_ids
from kvforge.metrics import ENCODER_METRICS, check_tolerances
from kvforge.runtime.encoder_session import EncoderSession

from .report import Report, precision_of, reference_source

# Default bounds per precision. Float exports are bounded on what export validation already holds them to;
# the quantized ones on what users feel (the embedding's direction and the prediction), measured on the
# micro encoders with margin (docs/verification.md).
ENCODER_TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"embedding_cosine_min": 0.99999, "hidden_rel_l2": 1e-4, "top1_agreement": 0.999},
    "float16": {"embedding_cosine_min": 0.9999, "hidden_rel_l2": 2e-2, "top1_agreement": 0.98},
    "bfloat16": {"embedding_cosine_min": 0.999, "hidden_rel_l2": 8e-2, "top1_agreement": 0.95},
    "int8": {"embedding_cosine_min": 0.99, "top1_agreement": 0.9},
    "fp8": {"embedding_cosine_min": 0.98, "top1_agreement": 0.85},
    "int4": {"embedding_cosine_min": 0.95, "top1_agreement": 0.8},
}


def _rows(ids: list[int], samples: int, seq_len: int, pad: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """`samples` windows of the token stream, each cut to a seeded length and right-padded."""
    windows = metrics.windows(ids, seq_len)[:, :-1]
    windows = windows[np.linspace(0, len(windows) - 1, min(samples, len(windows))).astype(int)]
    lengths = rng.integers(max(1, seq_len // 4), seq_len + 1, len(windows))
    mask = (np.arange(seq_len)[None] < lengths[:, None]).astype(np.int64)
    return np.where(mask == 1, windows, pad).astype(np.int64), mask


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of (n, d) arrays, in float64."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return np.where(den > 0, (a * b).sum(-1) / np.maximum(den, 1e-300), 1.0)


class _Sums:
    """Streaming per-output statistics over batches."""

    def __init__(self):
        self.values: dict[str, list] = {}

    def add(self, key: str, value) -> None:
        self.values.setdefault(key, []).append(np.asarray(value, np.float64).ravel())

    def all(self, key: str) -> np.ndarray:
        return np.concatenate(self.values[key]) if key in self.values else np.zeros(0)


def data_line(r: dict[str, Any]) -> str:
    """What an encoder's report measured on, for people."""
    return f"{r['data']}, {r['inputs']} right-padded inputs, {r['tokens']} real tokens"


def _add_batch(sums: _Sums, oc: dict[str, np.ndarray], orf: dict[str, np.ndarray], real: np.ndarray,
               per_token: set[str], head: str | None) -> None:
    """One batch's candidate (oc) and reference (orf) outputs into the sums; `real`: the tokens that are not padding."""
    hc, hr = oc["last_hidden_state"], orf["last_hidden_state"]
    if "last_hidden_state" in per_token:
        pooled_c = (hc * real[..., None]).sum(1) / real.sum(1, keepdims=True)
        pooled_r = (hr * real[..., None]).sum(1) / real.sum(1, keepdims=True)
        hc, hr = hc[real], hr[real]
    else:
        pooled_c, pooled_r = hc.mean(1), hr.mean(1)
        hc, hr = hc.reshape(-1, hc.shape[-1]), hr.reshape(-1, hr.shape[-1])
    sums.add("embedding_cosine", _cosines(pooled_c, pooled_r))
    sums.add("hidden_cosine", _cosines(hc, hr))
    sums.add("hidden_err2", ((hc.astype(np.float64) - hr) ** 2).sum())
    sums.add("hidden_ref2", (hr.astype(np.float64) ** 2).sum())
    sums.add("hidden_max_abs", np.abs(hc.astype(np.float64) - hr).max())
    if head in ("mlm", "classification"):
        lc, lr = oc["logits"], orf["logits"]
        if "logits" in per_token:
            lc, lr = lc[real], lr[real]
        sums.add("top1", lc.argmax(-1) == lr.argmax(-1))
        sums.add("kl", metrics.kl_divergence(lc, lr))
        sums.add("logits_err2", ((lc.astype(np.float64) - lr) ** 2).sum())
        sums.add("logits_ref2", (lr.astype(np.float64) ** 2).sum())
        sums.add("logits_max_abs", np.abs(lc.astype(np.float64) - lr).max())
    if head == "pooler":
        sums.add("pooler_cosine", _cosines(oc["pooler_output"], orf["pooler_output"]))


def _metrics(sums: _Sums) -> dict[str, Any]:
    """The comparison's metrics from the sums over every batch (a head's metrics None where there is no head)."""

    def rel(err: str, ref_key: str) -> float:
        den = sums.all(ref_key).sum()
        return float(np.sqrt(sums.all(err).sum() / den)) if den > 0 else 0.0

    emb = sums.all("embedding_cosine")
    return {
        "embedding_cosine_mean": float(emb.mean()), "embedding_cosine_min": float(emb.min()),
        "hidden_cosine_min": float(sums.all("hidden_cosine").min()),
        "hidden_max_abs": float(sums.all("hidden_max_abs").max()),
        "hidden_rel_l2": rel("hidden_err2", "hidden_ref2"),
        "top1_agreement": float(sums.all("top1").mean()) if "top1" in sums.values else None,
        "kl_divergence_mean": float(sums.all("kl").mean()) if "kl" in sums.values else None,
        "logits_max_abs": float(sums.all("logits_max_abs").max()) if "top1" in sums.values else None,
        "logits_rel_l2": rel("logits_err2", "logits_ref2") if "top1" in sums.values else None,
        "pooler_cosine_min": float(sums.all("pooler_cosine").min()) if "pooler_cosine" in sums.values else None,
    }


def compare_encoder(
    candidate: str | Path,
    reference: str | Path | None = None,
    data: str | Path | None = None,
    backend: str = "auto",
    samples: int = 64,
    max_tokens: int = 16384,
    seq_len: int = 128,
    batch_size: int = 8,
    tolerances: dict[str, float] | None = None,
    random_data: bool = False,
    seed: int = 0,
    progress=None,
    **backend_options,
):
    """Compare an encoder bundle on `backend` with the Torch reference; returns a compare.Report."""
    progress = progress or (lambda phase, done, total: None)
    started = time.time()
    bundle = Bundle(candidate)
    precision = precision_of(bundle)
    bounds = {**ENCODER_TOLERANCES.get(precision, {}), **(tolerances or {})}
    cand = runtime.load(candidate, backend=backend, **backend_options)
    ref_source = reference_source(bundle, reference, "encoder")
    ref = EncoderSession(bundle, "torch", source=ref_source, float_reference=True)
    cfg = bundle.model_config
    seq_len = min(seq_len, cand.max_length)
    rng = np.random.default_rng(seed)
    if random_data:
        ids, data_name = rng.integers(0, cfg["vocab_size"], max_tokens + 1).tolist(), f"random tokens (seed {seed})"
    else:
        ids, data_name = eval_ids(cand.tokenizer, data, max_tokens, cfg["vocab_size"])
    pad = cfg.get("pad_token_id") or 0
    input_ids, mask = _rows(ids, samples, seq_len, pad, rng)
    per_token = set(bundle.io.extra.get("per_token_outputs", []))
    head = cfg.get("head")
    sums = _Sums()
    n_batches = -(-len(input_ids) // batch_size)
    with cand, ref:
        for i in range(0, len(input_ids), batch_size):
            rows = [r[m == 1].tolist() for r, m in zip(input_ids[i:i + batch_size], mask[i:i + batch_size])]
            feeds = cand.feeds(rows)
            oc, orf = cand.run(feeds), ref.run(feeds)
            _add_batch(sums, oc, orf, feeds["attention_mask"].astype(bool), per_token, head)
            progress("encode", i // batch_size + 1, n_batches)

    result: dict[str, Any] = {
        "kind": "encoder", "metric_keys": list(ENCODER_METRICS),
        "candidate": str(candidate), "candidate_backend": cand.backend_name, "precision": precision,
        "reference": ref_source, "reference_backend": "torch", "architecture": cfg.get("architecture"), "head": head,
        "data": data_name, "inputs": int(len(input_ids)), "tokens": int(mask.sum()), "seq_len": seq_len,
        **_metrics(sums),
    }
    if result["top1_agreement"] is None:  # no prediction head: its bound does not apply
        bounds.pop("top1_agreement", None)
    failures = check_tolerances(result, bounds)
    result.update({"tolerances": bounds, "failures": failures, "passed": not failures,
                   "seconds": round(time.time() - started, 2)})
    return Report(result)
