"""Validate an exported graph against the Torch reference; failures fail the export.

Checks, on ONNX Runtime (CPU):
- a grid of shapes: batch 1 and 3; past 0, 1 and a long one (longer than any
  sliding window); seq 1 and several; a left-padded batch;
- a 32-step lockstep decode that feeds `present` back as `past`, comparing
  logits and presents at every step, plus free-running greedy token agreement;
- shape fuzzing: random (batch, seq, past) draws, so a dimension specialized
  to the example shape cannot pass.

Inputs come from the model's own distribution (validate_inputs.py): token ids
are real text where the caller passes a tokenizer's encoding (`tokens=`), else
sampled from the reference; every past cache is the reference's own `present`
from a prefill of such ids. Random ids and uniform random caches are out of
distribution for real weights (their activations have outlier channels) and
inflate rounding errors: on SmolLM2-135M they put a correct FP32 graph 7e-3
away from the FP32 reference; on real inputs it is 7e-5 from FP64, as close
as the FP32 reference is (9e-5).

float32: bounded by the reference's own rounding noise. Every case runs on
the FP32 Torch reference and on a float64 copy of it (computing in float64
throughout, its norms and softmax included); the candidate is measured
against FP64, and per output (the logits, each layer's present key/value)
its max abs and rel L2 errors are divided by the FP32 reference's on the same
inputs (|ref32 - ref64|, at least one FP32 ulp: eps32 * max|ref64| for max
abs, eps32 for rel L2, so a case with no noise cannot fail on one ulp). The
graph passes when that ratio is <= 32 for every output. Measured ratios of
correct exports (max over every output of every case and lockstep step,
max abs / rel L2): tiny 4.8 / 3.5 (5.7 on three text-token cases); the 16
micro presets 2.0-3.2 / 1.7-2.8 (medians ~1.1); SmolLM2-135M 3.2 / 3.8.
ONNX Runtime rounds about as much as Torch does, so ~1-6 is what a correct
graph shows. Deliberately broken graphs (tests/export/test_validate_defects.py),
smallest per-case ratio over a prefill, a decode and a left-padded decode
(tiny / SmolLM2): Softmax with FP16 input and output 379 / 618; norm epsilon
x10 4.3e4 / 8.7e3; RoPE base / 10 3.8e5 / 1.3e5; causal mask off by one
~1e6; two KV heads swapped ~3e6. 32 sits 5.6x above the worst correct ratio
and 12x below the subtlest defect. No fixed absolute bound does both: the
FP32 reference itself is up to 1e-4 from FP64 on SmolLM2's logits and 7e-6
on tiny's, so one number is at the noise of the first or 15x loose on the
second. The report gives, per failing case, its worst output and ratio and
the first layer whose cache departs (everything before it computed what the
reference computed).

float16 / bfloat16: bounded the same way by the dtype's own rounding noise. The truth is the FP32 reference
(its own error, ~1e-5, is far below a half dtype's); the noise is that of the reference computed in the dtype
as half kernels compute (HalfReference: weights, cache and every value between two operations in the dtype,
each operation computed in float32 and its result rounded, as GPU FP16 kernels accumulate in float32 and store
half; what the model computes in float32 itself, its norms, softmax and RoPE angles, in float32). ONNX
Runtime's CPU provider rounds less than that on a real model: SmolLM2-135M's FP16 graph is 12x closer to FP32
than that reference on its logits (rel L2 9.6e-4 against 1.2e-2; worst ratio 0.90, in the lockstep). Per
output, the graph's rel L2 error is divided by the half reference's (at least one ulp of the dtype, 2^-10 /
2^-7) and passes at <= 8. Rel L2 only: a half dtype's max abs error is that of a few rounded outliers.
Measured ratios of correct exports: FP16 0.6-1.4 over 12 micro presets and tiny (noise 5e-4 .. 3e-3), the real
Gemma 3 270M 0.79 (logits rel L2 3.2e-3 against a noise of 7.4e-3), the real SmolLM2-135M 0.90; BF16 1.0-2.3.
Injected defects in tiny's FP16 export (tests/export/test_validate_defects.py; per case over a prefill, a
decode and a left-padded decode): norm epsilon x10 19 / 15 / 6.2, RoPE base / 10 47-144, causal mask off by
one 236-673, two KV heads swapped 395-1053. The fixed rel L2 bounds this replaced (1e-2 FP16, 5e-2 BF16) sat
3-20x above the noise of small models and at the noise of large ones (a Llama-3.2-3B shape's logits: 1.1e-2 /
1.3e-2). A mixture model's half reference may route a token at a near tie to another expert than the FP32
reference does; its noise is then larger on that case, which the bound allows (and a graph that routes a token
differently from both fails: mixtral-micro and deepseek-micro in BF16 are refused, the latter on 5 cases
at the fixed bound before, on one lockstep step now).
Greedy agreement over 32 free-running steps: all 32 for float32, or a first
divergence at a near tie (the reference's logits of the two tokens closer than
twice the largest logits error the bound allowed). For FP16 and BF16 it is
reported, not gated: on a model whose next-token distribution is flat (random
weights) rounding flips near-ties and the free-running sequences part ways
without any defect; the rel-L2 bounds above are what catch defects. (On the
trained `tiny` model the tests require >= 30 of 32 for both.)
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from kvforge import metrics
from kvforge.errors import KvforgeError
from kvforge.onnx_graph import dequantizes_weights
from kvforge.ort_session import EXACT_QDQ, block_when_idle, compute_weights_when_used, weights_when_used_graph
from kvforge.adapters import MASK, slot_input_names
from kvforge.model_defs.lora import LoraFeed, feeding, validation_feed
from kvforge.model_defs.weights import streamed_source

from .bf16 import emulate_bfloat16
from .onnx_export import FlatKVModel, input_names, output_names
from .validate_inputs import Float64Reference, HalfReference, RoutingMargins, case_inputs, token_pool
from .validate_report import case_failures, compare_case, first_failure, public, worst_record

HALF_MULTIPLE = 8.0  # see the module's docstring
TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"noise_multiple": 32.0, "floor_ulps": 1.0, "judge_max_abs": 1.0, "greedy_min": 32},
    "float16": {"noise_multiple": HALF_MULTIPLE, "floor_ulps": 1.0, "judge_max_abs": 0.0},
    "bfloat16": {"noise_multiple": HALF_MULTIPLE, "floor_ulps": 1.0, "judge_max_abs": 0.0},
}
EPS = {dtype: float(torch.finfo(getattr(torch, dtype)).eps) for dtype in TOLERANCES}  # one ulp at 1.0
LOCKSTEP_STEPS = 32
# a reference streamed from its checkpoint (too large to keep: model_defs/weights.py) reads every weight on each
# step of each side, so its lockstep is bounded: 8 steps of each side feeding its own cache back; and so are its
# random shapes besides the grid, which repeat what the grid's cases cover (batch, new tokens, a past), on other
# sizes: 2 of them (each costs a read of every weight on both references, and for the FP64 one a cast of each to
# float64: Gemma 3 270M's 262k-row head alone is 1.3 GB of float64 per forward)
STREAMED_LOCKSTEP_STEPS = 8
STREAMED_FUZZ = 2
POOL_ROWS = 4  # distinct token sequences; the largest batch of any case
PROMPT = 8  # the lockstep's prefill
VALIDATION_RANK = 4  # the random adapter a graph with LoRA slots is validated with


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
        # The weights stay as the data file holds them, mapped: no packed copy of each (faster at the batch sizes
        # serving sees, not at validation's), and no constant folded from a weight (a tied head's transposed
        # table: the head becomes a FusedMatMul reading the embedding). A weight the graph computes (a float16
        # weight cast to float32 for the CPU's kernels, a checkpoint's codes dequantized) is computed where it is
        # used, one at a time, not held whole (ort_session.compute_weights_when_used), and Q/DQ runs as written
        # (no integer kernel: the codes' dequantization bit for bit). No CPU arena: what a run frees goes back, not
        # held beside the references' next forward (a float16 Qwen2.5-1.5B's export peaked at 7.4 GiB with it,
        # 4.9 without)
        opts.enable_cpu_mem_arena = False
        opts.add_session_config_entry("session.disable_prepacking", "1")
        block_when_idle(opts)
        options = {"providers": ["CPUExecutionProvider"], "disabled_optimizers": ["ConstantFolding"]}
        if dtype == "bfloat16":
            model = emulate_bfloat16(path)
            self.session = ort.InferenceSession(model.SerializeToString(), opts, **options)
        else:
            import onnx

            compute_weights_when_used(opts)
            proto = onnx.load(str(path), load_external_data=False)
            if dequantizes_weights(proto):
                # a checkpoint's codes: the graph as written. ONNX Runtime's fusions add nodes that its priority
                # order runs after every original node ready before them, so each DequantizeLinear moved to its
                # reader ran early again and stayed live (Gemma 3 270M's codes graph: +0.35 GB a run); without
                # codes, its fusions stay (a micro model's export took 18% longer as written)
                opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            for key, value in EXACT_QDQ.items():
                opts.add_session_config_entry(key, value)
            graph, folder = weights_when_used_graph(proto, Path(path).parent)
            opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
            self.session = ort.InferenceSession(graph, opts, **options)
        self.names = [i.name for i in self.session.get_inputs()]

    def cast(self, t: torch.Tensor) -> np.ndarray:
        if not t.is_floating_point():
            return t.numpy()
        if self.dtype == "float16":
            return t.to(torch.float16).numpy()
        # float32, and bfloat16 emulated in float32 on values rounded to bfloat16
        return t.to(getattr(torch, self.dtype)).float().numpy()

    # a graph with LoRA slots: its adapters' feeds for a batch (validate sets it)
    lora: LoraFeed | None = None

    def _lora_feeds(self, batch: int) -> dict[str, np.ndarray]:
        if self.lora is None:
            return {}
        rank = next(iter(self.lora.weights.values()))[0].shape[1]
        feeds = {MASK: self.cast(torch.ones(batch, rank))}
        for slot, (a, b) in self.lora.weights.items():
            names = slot_input_names(slot)
            feeds[names[0]], feeds[names[1]] = self.cast(a), self.cast(b)
        return feeds

    def run(self, args: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
        return self.session.run(None, {**_feeds(args, self.names, self.cast), **self._lora_feeds(args[0].shape[0])})

    def step(self, base: tuple[torch.Tensor, ...], past: list[np.ndarray]) -> list[np.ndarray]:
        """input_ids, attention_mask, position_ids from Torch plus a cache already in the graph's dtype."""
        return self.session.run(None, {**_feeds(base, self.names[:3], lambda t: t.numpy()), **dict(zip(self.names[3:], past)),
                                       **self._lora_feeds(base[0].shape[0])})


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


GRID_CASES = ("prefill b1", "prefill b3", "decode after 1", "decode b3 after 1", "chunk after 1", "decode long past",
              "chunk b3 long past", "left-padded prefill", "left-padded decode")


def _fuzz_cases(max_context: int, n: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        b, t = rng.randint(1, 4), min(rng.randint(1, 9), max_context)
        p = rng.randint(0, max(0, min(max_context - t, 64)))
        cases.append(Case(f"fuzz {i}", b, t, p))
    return cases


def _label(case: Case) -> str:
    return f"{case.name} (batch {case.batch}, seq {case.seq}, past {case.past})"


@torch.no_grad()
def validate(
    path: Path, reference, dtype: str, max_context: int, fuzz: int = 6, seed: int = 0, progress=None, *,
    tokens: Sequence[int] | None = None, cases: Sequence[str] | None = None, lockstep: bool = True,
    reference64: Float64Reference | None = None, text: str | None = None,
) -> dict[str, Any]:
    """Run every check; return the metrics, a report and a list of failures (empty = passed).

    reference: the FP32 Torch model (eval mode). tokens: real token ids (a tokenizer's encoding of text) the
    inputs are cut from (text: its name, for the report); None samples them from the reference. cases: the
    names of the shape-grid cases to run (GRID_CASES; None = all), fuzz: how many random shapes besides (at most
    STREAMED_FUZZ for a reference streamed from its checkpoint),
    lockstep: whether to run the 32-step decode. A case whose mixture routing sits at a tie (RoutingMargins)
    is recorded with its margin and not judged.
    reference64: Float64Reference(reference) made earlier, for validating several graphs of one model.
    """
    cfg = reference.config
    tol = TOLERANCES[dtype]
    runner = OrtRunner(path, dtype)
    flat = FlatKVModel(reference).eval()
    if runner.names != input_names(cfg, flat.slots):
        raise KvforgeError(f"graph inputs {runner.names} do not follow the IO contract {input_names(cfg, flat.slots)}")
    if dtype == "float32":
        floor = reference64 if reference64 is not None else Float64Reference(reference)
    else:
        floor = HalfReference(reference, getattr(torch, dtype))
    with contextlib.ExitStack() as lora:
        if flat.slots:  # the slots run with a random adapter on every row, in the graph and the references alike
            runner.lora = validation_feed(reference, VALIDATION_RANK)
            for model in [reference, floor.flat.model]:
                lora.enter_context(feeding(model, runner.lora))
        return _validate(runner, flat, floor, cfg, tol, dtype, max_context, fuzz, seed, progress, tokens, cases,
                         lockstep, text, reference)


def _judged(names, cand, out32, other, valid, floor, dtype: str) -> dict[str, Any]:
    """compare_case with the truth and the noisy reference in their places (see Float64Reference, HalfReference)."""
    truth, noisy = (other, out32) if floor.is_truth else (out32, other)
    return compare_case(names, cand, truth, noisy, valid, TOLERANCES[dtype], EPS[dtype])


def _validate(runner, flat, floor, cfg, tol, dtype, max_context, fuzz, seed, progress, tokens, cases, lockstep, text,
              reference) -> dict[str, Any]:
    grid = _grid(cfg, max_context)
    unknown = set(cases or ()) - {c.name for c in grid}
    if unknown:
        raise KvforgeError(f"unknown validation cases {sorted(unknown)}; the grid has {list(GRID_CASES)}")
    source = streamed_source(reference)
    streams = source is not None and not source.keep
    steps = STREAMED_LOCKSTEP_STEPS if streams else LOCKSTEP_STEPS
    fuzz = min(fuzz, STREAMED_FUZZ) if streams else fuzz
    all_cases = [c for c in grid if cases is None or c.name in cases] + _fuzz_cases(max_context, fuzz, seed)
    length = max([c.past + c.seq for c in all_cases] + [min(PROMPT, max_context - 1)])
    pool = token_pool(flat, tokens, POOL_ROWS, length, seed, max([c.past for c in all_cases if not c.pad], default=0))
    total = len(all_cases) + (steps if lockstep else 0)
    names, records, failures = output_names(cfg), [], []
    margins = RoutingMargins(reference)
    for i, case in enumerate(all_cases):
        args = case_inputs(flat, pool, case.batch, case.seq, case.past, case.pad, i)
        # the references see exactly what the candidate sees (the cache rounded to its dtype)
        ref_args = tuple(torch.from_numpy(runner.cast(a)).float() if a.is_floating_point() else a for a in args)
        outputs = runner.run(args)
        valid = args[1][:, -case.seq:].numpy().astype(bool) if case.pad else None
        other = floor(*ref_args)
        with margins:
            expected = flat(*ref_args)
        record = _judged(names, outputs, expected, other, valid, floor, dtype)
        record.update(case=case.name, shape=[case.batch, case.seq, case.past])
        if margins.tied:  # a mixture's routing at a tie: either choice is right, and the outputs may differ
            record["routing_margin"] = margins.smallest
        records.append(record)
        failures += [] if margins.tied else case_failures(_label(case), record, floor.noise)
        if progress:
            progress(i + 1, total)
    lock = None
    if lockstep:
        prompt = pool.ids[:1, :min(PROMPT, max_context - 1)]
        tick = lambda d: progress and progress(len(all_cases) + d, total)  # noqa: E731
        lock = _lockstep(runner, flat, floor, cfg, dtype, prompt, max_context, tick, steps)
        failures += lock.pop("failures")
    given = tokens is not None and len(tokens) > 0
    return _summary(dtype, tol, records, lock, failures, (text or "text given by the caller") if given else None)


def _summary(dtype: str, tol, records: list[dict], lock: dict | None, failures: list[str],
             text: str | None) -> dict[str, Any]:
    steps = lock.pop("records") if lock else []
    judged = [r for r in records if "routing_margin" not in r]  # cases routed at a tie are shown, not judged
    summary = {
        "dtype": dtype,
        "reference": ("torch float64 (bounded by torch float32's own rounding)" if dtype == "float32" else
                      f"torch float32 (bounded by torch {dtype}'s own rounding: each operation's result rounded)"),
        "tolerances": tol,
        "inputs": f"token ids of {text}" if text else "token ids sampled from the reference",
        "cases": len(records),
        "logits": metrics.worst([r["logits"] for r in judged]),
        "present": metrics.worst([r["present"] for r in judged if r["present"]]),
    }
    summary["noise"] = {part: metrics.worst([r["noise"][part] for r in judged + steps])
                        for part in ("logits", "present")}
    summary["worst"] = worst_record(judged + steps)
    summary["first_failure"] = first_failure(judged + steps)
    keys = ("case", "shape", "worst_output", "ratio", "excess", "first_layer", "routing_margin")
    summary["case_results"] = [{k: public(r)[k] for k in keys if k in r} for r in records]
    if lock is not None:
        summary["lockstep"] = lock
    summary.update(passed=not failures, failures=failures)
    return summary


def _step_inputs(ids: torch.Tensor, past_len: int) -> tuple[torch.Tensor, ...]:
    total = past_len + ids.shape[1]
    return ids, torch.ones(1, total, dtype=torch.int64), torch.arange(past_len, total, dtype=torch.int64)[None]


def _lockstep(runner: OrtRunner, flat, floor, cfg, dtype: str, prompt: torch.Tensor, max_context: int, tick,
              steps: int = LOCKSTEP_STEPS) -> dict[str, Any]:
    """Prefill the prompt, then `steps` steps (32), each side feeding its own present back as its past.

    Every side gets the FP32 reference's greedy token (the other reference too: FP64, or the half one), so logits
    and presents are compared at every step, the noisy reference's own drift from the truth giving the floor. The
    FP32 reference is thereby decoding greedily on its own; so is the candidate until its argmax first differs, from
    where it goes on alone (_free_run) to count the free-running greedy agreement.
    """
    steps = min(steps, max_context - prompt.shape[1])
    names = output_names(cfg)
    empty = tuple(t for layer in flat.model.empty_cache(1) for t in layer)
    past32, past_o, past_c = empty, empty, [runner.cast(t) for t in empty]
    ids, past_len, records, failures, tokens, diverged = prompt, 0, [], [], [], None
    for step in range(steps + 1):
        base = _step_inputs(ids, past_len)
        out32, out_c = flat(*base, *past32), runner.step(base, past_c)
        out_o = floor(*base, *past_o)
        record = _judged(names, out_c, out32, out_o, None, floor, dtype)
        record.update(case=f"lockstep step {step}", shape=[1, ids.shape[1], past_len])
        records.append(record)
        failures += case_failures(f"lockstep step {step}", record, floor.noise)
        past32, past_c, past_o = out32[1:], out_c[1:], out_o[1:]
        past_len += ids.shape[1]
        ref_logits = out32[0][0, -1].double().numpy()
        ids = torch.tensor([[int(ref_logits.argmax())]])
        if step < steps:
            own = int(np.asarray(out_c[0])[0, -1].argmax())
            tokens.append((int(ids), own))
            if diverged is None and own != int(ids):
                margin = float(ref_logits[int(ids)] - ref_logits[own])
                diverged = (step, margin, own, past_c, past_len)
        tick(min(step + 1, steps))
    # the largest logits error the bound allowed at any step: a free-running divergence within it is a near tie
    allowed = [j.get("allowed_max_abs", 0.0) for r in records for j in r["_judged"] if j["output"] == "logits"]
    slack = 2 * max(allowed, default=0.0)
    greedy = _greedy(runner, tokens, diverged, steps, TOLERANCES[dtype], slack)
    return {
        "steps": steps,
        "logits": metrics.worst([r["logits"] for r in records]),
        "present": metrics.worst([r["present"] for r in records if r["present"]]),
        **{k: v for k, v in greedy.items() if k != "failures"},
        "failures": failures + greedy["failures"],
        "records": records,
    }


def _greedy(runner: OrtRunner, tokens: list[tuple[int, int]], diverged, steps: int, tol,
            slack: float) -> dict[str, Any]:
    """Free-running greedy agreement: all steps must agree, or part ways at a near tie of the reference's (its
    logits of the two tokens closer than `slack`, twice the largest logits error the bound allowed)."""
    first = margin = None
    cand = [own for _, own in tokens]
    if diverged is not None:
        first, margin, own, past, past_len = diverged
        cand = cand[:first + 1] + _free_run(runner, own, past, past_len, steps - first - 1)
    matching = sum(ref == c for (ref, _), c in zip(tokens, cand))
    need = min(tol.get("greedy_min", 0), steps)
    failures = []
    if matching < need and not (margin is not None and margin <= slack):
        failures.append(f"greedy tokens agree on {matching} of {steps} steps, need {need} (first divergence at step "
                        f"{first}: the reference's margin {margin:.3g} is no near tie, > {slack:.3g})")
    return {"greedy_matching_steps": matching, "greedy_first_divergence": first, "greedy_divergence_margin": margin,
            "greedy_near_tie_slack": slack, "failures": failures}


def _free_run(runner: OrtRunner, token: int, past: list[np.ndarray], past_len: int, count: int) -> list[int]:
    """The candidate's own greedy continuation: `count` tokens after `token`, from its cache `past`."""
    tokens = []
    for _ in range(count):
        out = runner.step(_step_inputs(torch.tensor([[token]]), past_len), past)
        past, past_len = out[1:], past_len + 1
        token = int(np.asarray(out[0])[0, -1].argmax())
        tokens.append(token)
    return tokens
