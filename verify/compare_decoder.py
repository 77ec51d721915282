"""A decoder bundle against the Torch reference: docs/design.md's verification metrics (verify/compare.py dispatches).

Three measurements, all seeded and on real text (or random tokens when asked):
- windows: perplexity of candidate and reference over non-overlapping
  windows of a held-out corpus, and the logits metrics over every position
  (max abs, rel L2, cosine, top-1 agreement, KL of candidate from reference);
- lockstep decode: from several prompts, both models decode `steps` tokens
  through their KV caches, fed the reference's greedy tokens (teacher
  forcing); per step: logits rel L2, KL, argmax agreement (the drift curve),
  and at the end the present tensors;
- free running: the candidate's own greedy continuation against the
  reference's, as the fraction of steps before they first differ.

The report's keys are stable (docs/verification.md). A tolerance names a
metric and a bound: a floor for agreements and cosines, a ceiling for
errors; `perplexity_delta_pct` is bounded in absolute value.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from kvforge import metrics, runtime
from kvforge.attribution import compare_blocks, onnx_block_outputs, torch_block_outputs
from kvforge.bundle import Bundle
from kvforge.calibration.data import eval_ids
from kvforge.errors import KvforgeError
from kvforge.metrics import WindowStats, check_tolerances

from .report import DEFAULT_TOLERANCES, Report, precision_of, reference_source


class ReferenceRuns:
    """The reference's outputs, kept for the next comparison against the same reference on the same inputs.

    A pipeline or a check compares every artifact of a model with one Torch reference on the same windows and
    prompts, and the reference computes the same outputs each time: they are computed once. Keys hold the
    reference's name and the exact inputs; what would pass MAX_BYTES in all is computed again each time instead
    (a large vocabulary's window logits)."""

    MAX_BYTES = 256 << 20

    def __init__(self):
        self._kept: dict[Any, Any] = {}
        self._bytes = 0

    def get(self, key, compute):
        if key in self._kept:
            return self._kept[key]
        value = compute()
        size = sum(a.nbytes for a in _arrays(value))
        if self._bytes + size <= self.MAX_BYTES:
            self._kept[key] = value
            self._bytes += size
        return value


def _arrays(value):
    if isinstance(value, np.ndarray):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _arrays(v)


def _reference_decode(reference, prompt: list[int], steps: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The reference decoding greedily from the prompt: its last-position logits at each of `steps` steps (step 0
    is the prefill's) and its final present tensors."""
    lr, cache_r = reference.forward(np.asarray([prompt], np.int64), last_logits_only=True)
    rows = []
    for step in range(steps):
        rows.append(np.array(lr[0, -1]))
        if step + 1 < steps:
            lr, cache_r = reference.forward(np.asarray([[int(rows[-1].argmax())]], np.int64), cache=cache_r,
                                            last_logits_only=True)
    return rows, [np.array(a) for a in reference.backend.cache_arrays(cache_r)]


def lockstep(candidate, reference, prompt: list[int], steps: int,
             runs: ReferenceRuns | None = None) -> tuple[list[int], list[dict[str, float]], dict]:
    """Decode `steps` tokens in both sessions, both fed the reference's greedy token.

    Returns the reference's tokens, per-step logits metrics (step 0 is the
    prefill's last position) and the metrics of the final present tensors.
    runs: where the reference's decode from this prompt is kept (or found).
    """
    compute = lambda: _reference_decode(reference, prompt, steps)  # noqa: E731
    rows, pr = runs.get(("decode", str(reference.source), tuple(prompt), steps), compute) if runs else compute()
    lc, cache_c = candidate.forward(np.asarray([prompt], np.int64), last_logits_only=True)
    tokens, per_step = [], []
    for step in range(steps):
        c, r = lc[0, -1], rows[step]
        token = int(r.argmax())
        per_step.append({
            "logits_rel_l2": metrics.rel_l2(c, r),
            "kl_divergence": float(metrics.kl_divergence(c, r)),
            "top1_agreement": float(int(c.argmax()) == token),
        })
        tokens.append(token)
        if step + 1 < steps:
            lc, cache_c = candidate.forward(np.asarray([[token]], np.int64), cache=cache_c, last_logits_only=True)
    pc = candidate.backend.cache_arrays(cache_c)
    present = metrics.worst([metrics.tensor_metrics(c, r) for c, r in zip(pc, pr)])
    return tokens, per_step, present


def _reference_session(candidate: Bundle, reference):
    reference = reference_source(candidate, reference)
    return runtime.load(reference, backend="torch"), str(reference)


class _Adapted:
    """A session whose every step runs with one LoRA adapter."""

    def __init__(self, session, adapter: str):
        self._session, self.adapter = session, adapter
        session.load_adapter(adapter)  # refused now, by name, if the bundle lacks slots or the adapter

    def __getattr__(self, name):
        return getattr(self._session, name)

    def __enter__(self):
        self._session.__enter__()
        return self

    def __exit__(self, *exc):
        return self._session.__exit__(*exc)

    def forward(self, input_ids, *args, **kwargs):
        return self._session.forward(input_ids, *args, adapters=[self.adapter] * len(input_ids), **kwargs)


def _with_adapter(cand, ref, cand_bundle: Bundle, adapter: str):
    """The candidate stepping with `adapter`, and the reference with it merged into its weights (W += (A B)^T per
    slot): an oracle that computes the adapter another way than the slots do."""
    from kvforge.adapters import read_adapter

    _, slots = read_adapter(cand_bundle, adapter)
    ref.activate()
    ref.backend.merge_lora(slots)
    return _Adapted(cand, adapter), ref


def data_line(r: dict[str, Any]) -> str:
    """What a decoder's report measured on, for people."""
    return f"{r['data']}, {r['tokens']} tokens; decode: {r['prompts']} prompts x {r['steps']} steps"


def _check_same_model(cand, ref) -> None:
    if cand.vocab_size != ref.vocab_size:
        raise KvforgeError(f"candidate vocabulary {cand.vocab_size} differs from the reference's {ref.vocab_size}")
    shape = lambda s: {k: s.config.get(k) for k in ("n_layers", "n_kv_heads", "head_dim", "kv_lora_rank",  # noqa: E731
                                                      "qk_rope_head_dim")}
    if shape(cand) != shape(ref):
        raise KvforgeError(f"the candidate's KV cache {shape(cand)} differs from the reference's {shape(ref)}: "
                           "they are not the same model")


def _windows(cand, ref, chunks: np.ndarray, batch_size: int, progress,
             runs: ReferenceRuns | None = None) -> dict[str, float]:
    """Perplexity and the logits metrics over every position of the held-out windows."""
    stats = WindowStats()
    n_batches = -(-len(chunks) // batch_size)
    for i in range(0, len(chunks), batch_size):
        batch = np.ascontiguousarray(chunks[i : i + batch_size, :-1])
        lc, _ = cand.forward(batch)
        compute = lambda: np.asarray(ref.forward(batch)[0])  # noqa: E731
        lr = runs.get(("window", str(ref.source), batch.shape, batch.tobytes()), compute) if runs else compute()
        stats.add(lc, lr, chunks[i : i + batch_size, 1:])
        progress("windows", i // batch_size + 1, n_batches)
    return stats.result()


def _decode(cand, ref, ids: list[int], prompts: int, prompt_len: int, steps: int, progress,
            runs: ReferenceRuns | None = None) -> dict[str, Any]:
    """Lockstep decode (the drift curve) and free running, from prompts spread over the corpus."""
    starts = np.linspace(0, len(ids) - prompt_len - 1, prompts).astype(int)
    drift = np.zeros((steps, 3))
    agree = prefix = 0.0
    presents = []
    for n, s in enumerate(starts):
        prompt = [int(t) for t in ids[s : s + prompt_len]]
        tokens, per_step, present = lockstep(cand, ref, prompt, steps, runs)
        drift += [[p["logits_rel_l2"], p["kl_divergence"], p["top1_agreement"]] for p in per_step]
        agree += sum(p["top1_agreement"] for p in per_step) / steps
        free = cand.generate(prompt, max_new_tokens=steps, ignore_eos=True).tokens
        matched = next((k for k, (a, b) in enumerate(zip(free, tokens)) if a != b), min(len(free), len(tokens)))
        prefix += matched / steps
        presents.append(present)
        progress("decode", n + 1, prompts)
    drift /= prompts
    present = metrics.worst(presents)
    return {
        "greedy_agreement": agree / prompts,
        "greedy_prefix_match": prefix / prompts,
        "present_max_abs": present["max_abs"], "present_rel_l2": present["rel_l2"], "present_cosine": present["cosine"],
        "steps": steps, "prompts": prompts, "prompt_len": prompt_len,
        "drift": [{"step": k, "logits_rel_l2": d[0], "kl_divergence": d[1], "top1_agreement": d[2]} for k, d in enumerate(drift)],
    }


def compare_decoder(
    candidate: str | Path,
    reference: str | Path | None = None,
    data: str | Path | None = None,
    backend: str = "auto",
    *,
    steps: int = 32,
    prompts: int = 4,
    prompt_len: int = 32,
    max_tokens: int = 4096,
    seq_len: int = 256,
    batch_size: int = 4,
    tolerances: dict[str, float] | None = None,
    per_layer: bool = False,
    random_data: bool = False,
    seed: int = 0,
    progress=None,
    reference_runs: ReferenceRuns | None = None,
    adapter: str | None = None,
    **backend_options,
) -> Report:
    """A decoder bundle on `backend` against the Torch reference: windows, lockstep decode, free running.
    reference_runs: the reference's outputs kept across the comparisons of several artifacts (pipeline, check).
    adapter: the candidate's LoRA adapter to run with, merged into the reference's weights."""
    progress = progress or (lambda phase, done, total: None)
    started = time.time()
    cand_bundle = Bundle(candidate)
    precision = precision_of(cand_bundle)
    bounds = {**DEFAULT_TOLERANCES.get(precision, {}), **(tolerances or {})}
    cand = runtime.load(candidate, backend=backend, **backend_options)
    ref, ref_name = _reference_session(cand_bundle, reference)
    if adapter is not None:
        if per_layer:
            raise KvforgeError("--per-layer reads the graph's blocks without LoRA inputs; leave it out with --adapter")
        cand, ref = _with_adapter(cand, ref, cand_bundle, adapter)
        ref_name, reference_runs = f"{ref_name} with adapter {adapter} merged", None  # not the plain reference's runs
    with cand, ref:
        _check_same_model(cand, ref)
        max_context = min(cand.max_context, ref.max_context)
        seq_len = min(seq_len, max_context)
        if random_data:
            rng = np.random.default_rng(seed)
            ids, data_name = rng.integers(0, cand.vocab_size, max_tokens + 1).tolist(), f"random tokens (seed {seed})"
        else:
            ids, data_name = eval_ids(cand.tokenizer or ref.tokenizer, data, max_tokens, cand.vocab_size)
        chunks = metrics.windows(ids, seq_len)
        result: dict[str, Any] = {
            "candidate": str(candidate), "candidate_backend": cand.backend_name, "precision": precision,
            "reference": ref_name, "reference_backend": ref.backend_name,
            "data": data_name, "tokens": int(chunks[:, :-1].size), "seq_len": seq_len,
            **_windows(cand, ref, chunks, batch_size, progress, reference_runs),
        }
        prompt_len = min(prompt_len, len(ids) - 1, max_context - 1)
        result.update(_decode(cand, ref, ids, prompts, prompt_len, min(steps, max_context - prompt_len), progress,
                              reference_runs))
        result["per_layer"] = None
        if per_layer:
            if cand.backend_name != "onnxruntime":
                raise KvforgeError(f"--per-layer reads intermediate tensors from the ONNX graph; run the candidate on onnxruntime, not {cand.backend_name}")
            sample = np.ascontiguousarray(chunks[: min(2, len(chunks)), :-1])
            result["per_layer"] = compare_blocks(lambda inject: onnx_block_outputs(cand_bundle, sample, inject),
                                                 torch_block_outputs(ref, sample))
            progress("per-layer", 1, 1)

    failures = check_tolerances(result, bounds)
    result.update({"tolerances": bounds, "failures": failures, "passed": not failures,
                   "seconds": round(time.time() - started, 2)})
    return Report(result)
