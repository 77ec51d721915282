"""Validate an exported graph against the Torch reference; failures fail the export.

Checks, on ONNX Runtime (CPU):
- a grid of shapes: batch 1 and 3; past 0, 1 and a long one (longer than any
  sliding window); seq 1 and several; a left-padded batch;
- a 32-step lockstep decode that feeds `present` back as `past`, comparing
  logits and presents at every step, plus free-running greedy token agreement;
- shape fuzzing: random (batch, seq, past) draws, so a dimension specialized
  to the example shape cannot pass.

The reference is always the FP32 Torch model. Tolerances per export dtype:
- float32: 1e-4 max abs on logits and presents (~1e-6 seen), or 2e-6 of the
  largest reference magnitude when that is above 50: FP32 rounding grows with
  magnitude (an ulp at 256 is 3e-5), and real checkpoints such as GPT-2 have
  logits near -100, where ~10 ulps of differently ordered sums exceed 1e-4.
- float16: rel L2 on logits <= 1e-2, presents <= 1e-2. FP16 carries 11
  significant bits (unit roundoff 4.9e-4); a few rounded matmuls, residual
  adds and the FP16 cache compound that to ~1e-3 (seen 5e-4 .. 3e-3), so
  1e-2 is the bound with headroom that still catches a real defect (a wrong
  cast or a missing FP32 softmax/norm gives > 5e-2).
- bfloat16: rel L2 <= 5e-2: BF16 has 8 significant bits (unit roundoff
  3.9e-3, 8x FP16's), so the same reasoning gives ~1e-2 typical.
Greedy agreement over 32 free-running steps: all 32 for float32. For FP16 and
BF16 it is reported, not gated: on a model whose next-token distribution is
flat (random weights) rounding flips near-ties and the free-running sequences
part ways without any defect; the rel-L2 bounds above are what catch defects.
(On the trained `tiny` model the tests require >= 30 of 32 for both.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvforge import metrics
from kvforge.errors import KvforgeError

from .bf16 import emulate_bfloat16
from .onnx_export import FlatKVModel, example_inputs, input_names, output_names

TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"logits_max_abs": 1e-4, "present_max_abs": 1e-4, "max_abs_of_magnitude": 2e-6, "greedy_min": 32},
    "float16": {"logits_rel_l2": 1e-2, "present_rel_l2": 1e-2},
    "bfloat16": {"logits_rel_l2": 5e-2, "present_rel_l2": 5e-2},
}
LOCKSTEP_STEPS = 32


@dataclass
class Case:
    name: str
    batch: int
    seq: int
    past: int
    pad: tuple[int, ...] | None = None  # left padding per row (counted in the cache + new tokens)


def _feeds(args: tuple[torch.Tensor, ...], names: list[str], cast) -> dict[str, np.ndarray]:
    return {n: cast(a) for n, a in zip(names, args)}


class OrtRunner:
    """Runs the exported graph; BF16 graphs run through an exact-rounding FP32 emulation."""

    def __init__(self, path: Path, dtype: str):
        import onnxruntime as ort

        self.dtype = dtype
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if dtype == "bfloat16":
            model = emulate_bfloat16(path)
            self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        else:
            self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]

    def cast(self, t: torch.Tensor) -> np.ndarray:
        if not t.is_floating_point():
            return t.numpy()
        if self.dtype == "float16":
            return t.to(torch.float16).numpy()
        # float32, and bfloat16 emulated in float32 on values rounded to bfloat16
        return t.to(getattr(torch, self.dtype)).float().numpy()

    def run(self, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        return self.session.run(None, _feeds(args, self.names, self.cast))

    def step(self, base: tuple[torch.Tensor, ...], past: list[np.ndarray]) -> list[np.ndarray]:
        """input_ids, attention_mask, position_ids from Torch plus a cache already in the graph's dtype."""
        return self.session.run(None, {**_feeds(base, self.names[:3], lambda t: t.numpy()), **dict(zip(self.names[3:], past))})


def _fit(case: Case, max_context: int) -> Case:
    """The case cut to the bundle's context (a bundle may declare as few as 2 positions)."""
    past = min(case.past, max_context - 1)
    seq = max(1, min(case.seq, max_context - past))
    pad = tuple(min(p, past + seq - 1) for p in case.pad) if case.pad else None  # every row keeps a real token
    return Case(case.name, case.batch, seq, past, pad)


def _grid(cfg, max_context: int) -> list[Case]:
    window = max((cfg.layer_window(i) or 0) for i in range(cfg.n_layers))
    long_past = max(0, min(max_context - 8, max(96, 2 * window + 8)))
    return [_fit(c, max_context) for c in [
        Case("prefill b1", 1, 7, 0),
        Case("prefill b3", 3, 5, 0),
        Case("decode after 1", 1, 1, 1),
        Case("decode b3 after 1", 3, 1, 1),
        Case("chunk after 1", 3, 4, 1),
        Case("decode long past", 1, 1, long_past),
        Case("chunk b3 long past", 3, 6, long_past),
        Case("left-padded prefill", 3, 9, 0, pad=(0, 3, 6)),
        Case("left-padded decode", 3, 1, 9, pad=(0, 3, 6)),
    ]]


def _fuzz_cases(max_context: int, n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        b, t = rng.randint(1, 4), min(rng.randint(1, 9), max_context)
        p = rng.randint(0, max(0, min(max_context - t, 64)))
        cases.append(Case(f"fuzz {i}", b, t, p))
    return cases


def _case_inputs(cfg, case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    args = list(example_inputs(cfg, torch.float32, case.batch, case.seq, case.past, seed))
    if case.pad:
        total = case.past + case.seq
        mask = torch.ones(case.batch, total, dtype=torch.int64)
        for row, n in enumerate(case.pad):
            mask[row, :n] = 0
        args[1] = mask
        args[2] = (mask.cumsum(-1) - 1).clamp(min=0)[:, -case.seq:]
    return tuple(args)


def _compare(outputs: list[np.ndarray], reference: tuple[torch.Tensor, ...], names: list[str], valid: np.ndarray | None):
    """Metrics for logits (real positions only) and all presents (worst layer)."""
    ref_logits = reference[0].numpy()
    cand_logits = outputs[0].astype(np.float32)
    if valid is not None:
        ref_logits, cand_logits = ref_logits[valid], cand_logits[valid]
    logits = metrics.logits_metrics(cand_logits, ref_logits)
    logits["reference_magnitude"] = float(np.abs(ref_logits).max()) if ref_logits.size else 0.0
    present = metrics.worst([
        {**metrics.tensor_metrics(o.astype(np.float32), r.float().numpy()), "reference_magnitude": float(r.abs().max()) if r.numel() else 0.0}
        for o, r in zip(outputs[1:], reference[1:])
    ])
    finite = all(np.isfinite(o.astype(np.float32)).all() for o in outputs)
    return {"logits": logits, "present": present, "finite": finite}


def _check(result: dict[str, Any], tol: dict[str, float]) -> list[str]:
    failures = []
    if not result["finite"]:
        failures.append("non-finite values in the outputs")
    for part in ("logits", "present"):
        for metric in ("max_abs", "rel_l2"):
            key = f"{part}_{metric}"
            if key not in tol:
                continue
            limit = tol[key]
            if metric == "max_abs":
                limit = max(limit, tol.get("max_abs_of_magnitude", 0.0) * result[part]["reference_magnitude"])
            if result[part][metric] > limit:
                failures.append(f"{key} {result[part][metric]:.3g} > {limit:.3g}")
    return failures


@torch.no_grad()
def validate(
    path: Path, reference, dtype: str, max_context: int, fuzz: int = 6, seed: int = 0, progress=None
) -> dict[str, Any]:
    """Run every check; return the metrics and a list of failures (empty = passed).

    reference: the FP32 Torch model (eval mode).
    """
    cfg = reference.config
    tol = TOLERANCES[dtype]
    runner = OrtRunner(path, dtype)
    if runner.names != input_names(cfg):
        raise KvforgeError(f"graph inputs {runner.names} do not follow the IO contract {input_names(cfg)}")
    flat = FlatKVModel(reference).eval()
    names = output_names(cfg)
    cases, failures = [], []
    all_cases = _grid(cfg, max_context) + _fuzz_cases(max_context, fuzz, seed)
    for i, case in enumerate(all_cases):
        args = _case_inputs(cfg, case, seed + i)
        # the reference sees exactly what the candidate sees (the cache rounded to its dtype)
        ref_args = tuple(torch.from_numpy(runner.cast(a)).float() if a.is_floating_point() else a for a in args)
        outputs = runner.run(args)
        valid = args[1][:, -case.seq:].numpy().astype(bool) if case.pad else None
        result = _compare(outputs, flat(*ref_args), names, valid)
        result.update(case=case.name, shape=[case.batch, case.seq, case.past])
        cases.append(result)
        failures += [f"{case.name} (batch {case.batch}, seq {case.seq}, past {case.past}): {f}" for f in _check(result, tol)]
        if progress:
            progress(i + 1, len(all_cases) + LOCKSTEP_STEPS)

    lock = _lockstep(runner, flat, cfg, tol, seed, progress, len(all_cases), max_context)
    failures += lock.pop("failures")
    summary = {
        "dtype": dtype,
        "reference": "torch float32",
        "tolerances": tol,
        "cases": len(cases),
        "logits": metrics.worst([c["logits"] for c in cases]),
        "present": metrics.worst([c["present"] for c in cases]),
        "lockstep": lock,
        "passed": not failures,
        "failures": failures,
    }
    return summary


def _lockstep(runner: OrtRunner, flat, cfg, tol, seed, progress, done, max_context: int) -> dict[str, Any]:
    """Prefill 8 tokens, then 32 steps feeding each side's present back as its past.

    Teacher-forced: both sides get the reference's greedy token, so logits and
    presents are compared at every step. Free-running: each side follows its
    own argmax; the count of agreeing tokens is reported.
    """
    gen = torch.Generator().manual_seed(seed + 99)
    prompt = torch.randint(0, cfg.vocab_size, (1, min(8, max_context - 1)), generator=gen)
    empty = tuple(t for layer in flat.model.empty_cache(1) for t in layer)

    def step_inputs(ids, past_len):
        total = past_len + ids.shape[1]
        mask = torch.ones(1, total, dtype=torch.int64)
        pos = torch.arange(past_len, total, dtype=torch.int64)[None]
        return ids, mask, pos

    steps = min(LOCKSTEP_STEPS, max_context - prompt.shape[1])
    worst_logits, worst_present, failures = [], [], []
    # teacher-forced
    cand_empty = [runner.cast(t) for t in empty]
    ref_past, cand_past = empty, cand_empty
    ids, past_len = prompt, 0
    for step in range(steps + 1):
        base = step_inputs(ids, past_len)
        ref_out = flat(*base, *ref_past)
        cand_out = runner.step(base, cand_past)
        m = _compare(cand_out, ref_out, [], None)
        worst_logits.append(m["logits"])
        worst_present.append(m["present"])
        failures += [f"lockstep step {step}: {f}" for f in _check(m, tol)]
        ref_past, cand_past = ref_out[1:], cand_out[1:]
        past_len += ids.shape[1]
        ids = ref_out[0][:, -1:].argmax(-1)
        if progress:
            progress(done + min(step + 1, LOCKSTEP_STEPS), done + LOCKSTEP_STEPS)

    # free-running greedy, each side on its own tokens
    def greedy(run):
        past, ids, past_len, tokens = None, prompt, 0, []
        for _ in range(steps):
            logits, past = run(step_inputs(ids, past_len), past)
            past_len += ids.shape[1]
            ids = torch.as_tensor(np.asarray(logits)[:, -1:].argmax(-1))
            tokens.append(int(ids))
        return tokens

    def run_ref(base, past):
        out = flat(*base, *(past if past is not None else empty))
        return out[0], out[1:]

    def run_cand(base, past):
        out = runner.step(base, past if past is not None else cand_empty)
        return out[0], out[1:]

    ref_tokens, cand_tokens = greedy(run_ref), greedy(run_cand)
    agree = next((i for i, (a, b) in enumerate(zip(ref_tokens, cand_tokens)) if a != b), steps)
    matching = sum(a == b for a, b in zip(ref_tokens, cand_tokens))
    need = min(tol.get("greedy_min", 0), steps)
    if matching < need:
        failures.append(f"greedy tokens agree on {matching} of {steps} steps, need {need}")
    return {
        "steps": steps,
        "logits": metrics.worst(worst_logits),
        "present": metrics.worst(worst_present),
        "greedy_matching_steps": matching,
        "greedy_first_divergence": agree if agree < steps else None,
        "failures": failures,
    }
