"""`calibrate --accuracy-budget`: keep the most sensitive decoder blocks in float until the budget holds.

1. The fully quantized graph is compared with the float graph it came from
   (both on ONNX Runtime) over held-out windows: perplexity change, top-1
   agreement, KL (kvforge.verify.compare's metrics and bounds).
2. If a bound fails, the blocks are ranked by their contribution to the
   error of the residual stream (kvforge.attribution, the same ranking as
   `kvforge compare --per-layer`), and kept in float one at a time, most
   sensitive first, re-measuring after each, until every bound holds.
   The calibration statistics are reused; only the Q/DQ rewrite is redone.
3. What it kept costs speed: decode tokens/s of the float graph, the fully
   quantized graph and the result are measured on ONNX Runtime, same
   machine, same run.
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any, Callable

import numpy as np

from kvforge.attribution import compare_blocks, graph_block_outputs
from kvforge.errors import KvforgeError
from kvforge.metrics import WindowStats, check_tolerances, parse_tolerances, split_tolerance
from kvforge.metrics import windows
from kvforge.ort_session import make_session, prefill_feeds
from kvforge.tokenizer import Tokenizer

from .data import eval_ids

BUDGET_METRICS = ("perplexity_delta_pct", "top1_agreement", "kl_divergence_mean", "logits_rel_l2")
BUDGET_SEQ_LEN = 256  # tokens per held-out window (fewer where the model's context is shorter)


def parse_budget(items) -> dict[str, float]:
    keys = list(items) if isinstance(items, dict) else [split_tolerance(s)[0] for s in items or []]
    bad = [k for k in keys if k not in BUDGET_METRICS]
    if bad:
        raise KvforgeError(f"--accuracy-budget measures {list(BUDGET_METRICS)} on held-out windows; {bad} is not among them")
    return parse_tolerances(items)


def budget_window(bundle, seq_len: int = BUDGET_SEQ_LEN) -> int:
    return min(seq_len, bundle.io.max_context or bundle.model_config["max_seq_len"])


def budget_ids(bundle, data, tokens: int, seq_len: int = BUDGET_SEQ_LEN) -> tuple[list[int], str]:
    """The budget's held-out token stream, checked before any calibration work: enough for one window, in vocabulary."""

    if bundle.tokenizer_file is None:
        raise KvforgeError(f"--accuracy-budget measures on text, and {bundle.path} has no tokenizer")
    window = budget_window(bundle, seq_len)
    if tokens < window:
        raise KvforgeError(f"--budget-tokens must be at least the budget's window of {window} tokens, got {tokens}")
    ids, name = eval_ids(Tokenizer.from_file(bundle.tokenizer_file), data, tokens, bundle.model_config["vocab_size"])
    if len(ids) <= window:
        raise KvforgeError(f"--accuracy-budget needs more than {window} tokens of held-out text; {name} gives {len(ids)}")
    return ids, name


class HeldOutEvaluator:
    """Candidate graphs against the float graph on the same held-out windows (ONNX Runtime, CPU)."""

    BATCH_LOGITS_BYTES = 256 << 20  # a batch of windows makes at most these logits (else fewer windows per batch)

    def __init__(self, bundle, float_model, held_out: tuple[list[int], str], seq_len: int = BUDGET_SEQ_LEN,
                 batch_size: int = 4):
        """held_out: budget_ids()'s token stream and its name. The graphs measured may be loaded without their
        external data: it is read from the bundle's folder."""
        self.bundle = bundle
        self.dtype = bundle.dtype
        ids, self.data = held_out
        self.chunks = windows(ids, budget_window(bundle, seq_len))
        window_logits = (self.chunks.shape[1] - 1) * bundle.model_config["vocab_size"] * 4
        self.batch_size = max(1, min(batch_size, self.BATCH_LOGITS_BYTES // window_logits))
        self.float_model = float_model
        self._reference = None  # the float graph's logits on every batch, in a scratch file (_reference_logits)
        self._reference_at: dict[int, tuple] = {}  # batch start -> (shape, dtype, offset) in it

    def session(self, model, quant: str | None):
        return make_session(model.SerializeToString(), quant, external_dir=self.bundle.path,
                            half_weights=self.dtype == "float16")

    def feeds(self, batch):
        return prefill_feeds(np.ascontiguousarray(batch), self.bundle.model_config, self.bundle.io, self.dtype)

    def metrics(self, model, quant: str) -> dict[str, float]:
        if self._reference is None:  # before the candidate's session: the two never run side by side
            self._reference = self._write_reference()
        cand = self.session(model, quant)
        stats = WindowStats()
        for i in range(0, len(self.chunks), self.batch_size):
            lc = cand.run(["logits"], self.feeds(self.chunks[i : i + self.batch_size, :-1]))[0]
            stats.add(lc, self._reference_logits(i), self.chunks[i : i + self.batch_size, 1:])
        return stats.result()

    def _reference_logits(self, i: int) -> np.ndarray:
        """The float graph's logits on the batch at window i: the same for every candidate measured, so made once
        for every batch (_write_reference) and kept in an unlinked scratch file under TMPDIR, read back a batch
        at a time; the float graph's session is dropped once they are written, so that a candidate's session
        never runs beside it (Gemma 3's vocabulary projection alone is 0.7 GB per session)."""
        shape, dtype, offset = self._reference_at[i]
        self._reference.seek(offset)
        return np.frombuffer(self._reference.read(int(np.prod(shape)) * dtype.itemsize), dtype).reshape(shape)

    def _write_reference(self):
        import tempfile

        session = self.session(self.float_model, None)
        scratch = tempfile.TemporaryFile()
        try:
            for i in range(0, len(self.chunks), self.batch_size):
                logits = session.run(["logits"], self.feeds(self.chunks[i : i + self.batch_size, :-1]))[0]
                self._reference_at[i] = (logits.shape, logits.dtype, scratch.tell())
                scratch.write(np.ascontiguousarray(logits).tobytes())
            scratch.flush()
        except OSError as e:
            scratch.close()
            raise KvforgeError(f"cannot keep the float graph's held-out logits under TMPDIR "
                               f"({tempfile.gettempdir()}): {e}") from e
        return scratch

    def ranking(self, model, quant: str) -> list[dict[str, Any]]:
        sample = np.ascontiguousarray(self.chunks[:2, :-1])
        cfg, io = self.bundle.model_config, self.bundle.io
        where = self.bundle.path
        return compare_blocks(lambda inject: graph_block_outputs(model, cfg, io, self.dtype, quant, sample, inject,
                                                                 where),
                              graph_block_outputs(self.float_model, cfg, io, self.dtype, None, sample,
                                                  external_dir=where))

    def decode_tokens_per_s(self, model, quant: str | None, past: int = 128, runs: int = 15) -> float:
        """Median single-token decode steps per second over a past of `past` tokens (batch 1)."""
        sess = self.session(model, quant)
        io = self.bundle.io
        rng = np.random.default_rng(0)
        np_dtype = np.float16 if self.dtype == "float16" else np.float32
        feeds = {
            "input_ids": np.array([[1]], np.int64),
            "attention_mask": np.ones((1, past + 1), np.int64),
            "position_ids": np.array([[past]], np.int64),
            **{n: rng.standard_normal(io.empty_shape(n, 1)[:2] + [length] + io.empty_shape(n, 1)[3:]).astype(np_dtype)
               for names, length in zip(io.past, io.cache_lengths(past)) for n in names},
        }
        times = []
        for i in range(runs + 3):
            t0 = time.perf_counter()
            sess.run(["logits"], feeds)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return 1.0 / statistics.median(times)


def fit_budget(bundle, float_model, quantize: Callable, session_format: str, budget: dict[str, float],
               held_out: tuple[list[int], str], progress) -> tuple[Any, dict[str, Any]]:
    """quantize(extra_exclude) -> (model, targets, excluded, record). Returns the last quantize() result and the record.

    held_out: budget_ids()'s token stream and its name, read (and checked) before the calibration.
    """
    ev = HeldOutEvaluator(bundle, float_model, held_out)
    result = quantize([])
    full = result[0]
    measured = ev.metrics(full, session_format)
    iterations = [{"kept_in_float": [], **{k: measured[k] for k in BUDGET_METRICS}}]
    progress("budget", 1, 1)
    rows = None
    kept: list[str] = []
    if check_tolerances(measured, budget):
        rows = ev.ranking(full, session_format)
        order = [r["layer"] for r in sorted(rows, key=lambda r: r["rank"])]
        progress("budget", 1, len(order) + 1)
        for n, layer in enumerate(order, 1):
            kept.append(layer)
            try:
                result = quantize([rf"^{re.escape(k)}\." for k in kept])
            except KvforgeError:  # every linear layer is now in float
                kept.pop()
                break
            measured = ev.metrics(result[0], session_format)
            iterations.append({"kept_in_float": list(kept), **{k: measured[k] for k in BUDGET_METRICS}})
            progress("budget", n + 1, len(order) + 1)
            if not check_tolerances(measured, budget):
                break
    failures = check_tolerances(measured, budget)
    if failures:
        raise KvforgeError(
            f"the accuracy budget cannot be met: with {kept or 'nothing'} kept in float, {'; '.join(failures)}. "
            "Loosen the budget, try another --method or --smoothquant, or a wider format"
        )
    speed = {"float_decode_tokens_per_s": ev.decode_tokens_per_s(float_model, None),
             "quantized_decode_tokens_per_s": ev.decode_tokens_per_s(full, session_format)}
    speed["result_decode_tokens_per_s"] = (ev.decode_tokens_per_s(result[0], session_format) if kept
                                           else speed["quantized_decode_tokens_per_s"])
    # what keeping blocks in float did to decode speed (negative: slower than fully quantized)
    speed["change_pct"] = 100.0 * (speed["result_decode_tokens_per_s"] / speed["quantized_decode_tokens_per_s"] - 1)
    report = {
        "budget": budget, "data": ev.data, "tokens": int(ev.chunks[:, :-1].size), "reference": "the float input graph on ONNX Runtime",
        "kept_in_float": kept, "ranking": rows, "iterations": iterations, "met": True,
        "speed": {**speed, "measured": "batch 1, one-token decode steps over a past of 128, median of 15, ONNX Runtime CPU"},
    }
    return result, report
