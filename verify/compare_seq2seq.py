"""`compare` for encoder-decoder bundles (T5, BART): target perplexity given the source, agreement, greedy decoding.

The data is a .jsonl of {"source", "target"} pairs, or plain text whose
windows of 2 x seq_len tokens are split into a source (the first half) and
its target (the continuation). Candidate and reference (the FP32 Torch model
the bundle was made from) see the same right-padded sources:

- teacher-forced over the targets: perplexity of each side and its change,
  top-1 agreement, KL of the candidate's next-token distribution from the
  reference's, logits max abs / rel L2;
- greedy: the reference decodes `steps` tokens greedily; `greedy_agreement`
  is how often the candidate's argmax, fed the reference's tokens, picks the
  reference's token; `greedy_prefix_match` how far the candidate's own greedy
  decode follows the reference's before they first differ.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from kvforge import metrics
from kvforge.bundle import Bundle
from kvforge.calibration.data import eval_ids
from kvforge.calibration.seq2seq import read_pairs
from kvforge.errors import KvforgeError
from kvforge.metrics import check_tolerances
from kvforge.runtime.generate import right_padded
from kvforge.runtime.seq2seq_session import Seq2SeqSession

from .report import DEFAULT_TOLERANCES, Report, precision_of, reference_source

SEQ2SEQ_METRICS = (
    "perplexity_reference", "perplexity_candidate", "perplexity_delta_pct", "top1_agreement", "kl_divergence_mean",
    "logits_max_abs", "logits_rel_l2", "greedy_agreement", "greedy_prefix_match",
)


def _pairs(cand, data, max_tokens: int, seq_len: int, samples: int, random_data: bool, seed: int):

    vocab = cand.vocab_size
    pairs = read_pairs(data) if data is not None and not random_data else None
    if pairs is not None:
        tok = cand.tokenizer
        rows = [(tok.encode(s)[:seq_len], tok.encode(t, add_special_tokens=False)[:seq_len]) for s, t in pairs[:samples]]
        return [(s, t) for s, t in rows if s and t], str(data)
    if random_data:
        rng = np.random.default_rng(seed)
        ids, name = rng.integers(0, vocab, max_tokens + 1).tolist(), f"random tokens (seed {seed})"
    else:
        ids, name = eval_ids(cand.tokenizer, data, max_tokens, vocab)
    windows = metrics.windows(ids, 2 * seq_len)[:, :-1]
    windows = windows[np.linspace(0, len(windows) - 1, min(samples, len(windows))).astype(int)]
    return [(w[:seq_len].tolist(), w[seq_len:].tolist()) for w in windows], name


def data_line(r: dict[str, Any]) -> str:
    """What an encoder-decoder's report measured on, for people."""
    return (f"{r['data']}, {r['pairs']} source/target pairs, {r['tokens']} target tokens; "
            f"greedy: {r['prompts']} sources x {r['steps']} steps")


def compare_seq2seq(candidate: str | Path, reference: str | Path | None = None, data: str | Path | None = None,
                    backend: str = "auto", steps: int = 16, prompts: int = 4, max_tokens: int = 8192, seq_len: int = 64,
                    samples: int = 32, batch_size: int = 4, tolerances: dict[str, float] | None = None,
                    random_data: bool = False, seed: int = 0, progress=None, **backend_options):
    """Compare an encoder-decoder bundle on `backend` with the Torch reference: target perplexity given the
    source, top-1, KL and greedy agreement; returns a compare.Report."""
    progress = progress or (lambda phase, done, total: None)
    started = time.time()
    bundle = Bundle(candidate)
    precision = precision_of(bundle)
    defaults = {k: v for k, v in DEFAULT_TOLERANCES.get(precision, {}).items() if k in SEQ2SEQ_METRICS}
    bounds = {**defaults, **(tolerances or {})}
    ref_source = reference_source(bundle, reference, "encoder-decoder")
    cand = Seq2SeqSession(bundle, backend, **backend_options)
    ref = Seq2SeqSession(bundle, "torch", source=ref_source, float_reference=True)
    seq_len = min(seq_len, cand.max_context - 1)
    pairs, data_name = _pairs(cand, data, max_tokens, seq_len, samples, random_data, seed)
    if not pairs:
        raise KvforgeError(f"{data_name} gives no source/target pair to compare on")
    pad = cand.config.get("pad_token_id") or 0
    start = cand.config["decoder_start_token_id"]
    stats = metrics.WindowStats()  # over the real target positions
    with cand, ref:
        n_batches = -(-len(pairs) // batch_size)
        for b in range(0, len(pairs), batch_size):
            chunk = pairs[b:b + batch_size]
            src, mask = right_padded([s for s, _ in chunk], pad)
            tgt = [t for _, t in chunk]
            T = max(len(t) for t in tgt)
            inputs = np.full((len(chunk), T), pad, np.int64)
            labels = np.full((len(chunk), T), -1, np.int64)
            for i, t in enumerate(tgt):
                inputs[i, :len(t)] = [start] + t[:-1]
                labels[i, :len(t)] = t
            lc, lr = cand.forward(src, mask, inputs), ref.forward(src, mask, inputs)
            real = labels >= 0
            stats.add(lc[real], lr[real], labels[real])
            progress("teacher-forced", b // batch_size + 1, n_batches)

        # greedy: the reference's tokens, the candidate fed them, and the candidate on its own
        steps = min(steps, cand.max_context - 1)
        chosen = [pairs[i][0] for i in np.linspace(0, len(pairs) - 1, min(prompts, len(pairs))).astype(int)]
        # one step more than compared: a forced end token (BART's, at the last allowed step) falls outside, and a
        # forced first token is no prediction of the model's: neither is counted
        ref_tokens = [r.tokens[:steps] for r in ref.generate(chosen, max_new_tokens=steps + 1, ignore_eos=True)]
        src, mask = right_padded(chosen, pad)
        fed = np.asarray([[start] + t[:-1] for t in ref_tokens], np.int64)
        hits = cand.forward(src, mask, fed).argmax(-1) == np.asarray(ref_tokens)
        first = 1 if cand.config.get("forced_bos_token_id") is not None else 0
        agree = float(hits[:, first:].mean())
        own = [r.tokens[:steps] for r in cand.generate(chosen, max_new_tokens=steps + 1, ignore_eos=True)]
        prefix = float(np.mean([next((k for k, (a, b) in enumerate(zip(o, r)) if a != b), steps) / steps
                                for o, r in zip(own, ref_tokens)]))
        progress("greedy", 1, 1)

    teacher = stats.result()
    result: dict[str, Any] = {
        "kind": "encoder-decoder", "metric_keys": list(SEQ2SEQ_METRICS),
        "candidate": str(candidate), "candidate_backend": cand.backend_name, "precision": precision,
        "reference": ref_source, "reference_backend": "torch", "data": data_name, "pairs": len(pairs),
        "tokens": stats.count, "seq_len": seq_len,
        **{k: teacher[k] for k in ("perplexity_reference", "perplexity_candidate", "perplexity_delta_pct", "top1_agreement",
                                   "kl_divergence_mean", "logits_max_abs", "logits_rel_l2")},
        "greedy_agreement": agree, "greedy_prefix_match": prefix, "steps": steps, "prompts": len(chosen),
    }
    failures = check_tolerances(result, bounds)
    result.update({"tolerances": bounds, "failures": failures, "passed": not failures,
                   "seconds": round(time.time() - started, 2)})
    return Report(result)
