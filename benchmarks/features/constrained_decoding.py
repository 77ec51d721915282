"""What constrained decoding costs per token on SmolLM2-135M-Instruct (FP32, ONNX Runtime; issue 33).

Decode tokens/s with a JSON schema (response_format json_schema, through llguidance: runtime/constrain.py) against
the same generation unconstrained, greedy, each row with its own chat prompt (a request for a packing list). The
schema asks for exactly 30 {name, quantity} objects, more than the new tokens allow, so that every constrained row
runs to max_new_tokens as the unconstrained one does (ignore_eos): both decode the same number of tokens.

- batch 1: Session.stream;
- batch 8, Session.generate: 8 prompts as one left-padded batch;
- batch 8, Batcher: 8 requests submitted at once (each streamed by a thread of its own).

Decode tokens/s is rows / the median decode step (the interval between two forward calls' returns: the tokens'
choice, the grammar's masks included, and one forward pass): a median over the ~100 steps of a run shrugs off the
bursts of a shared machine that a whole run's mean takes in (the whole runs' rates are recorded too). Target:
constrained >= 0.9x unconstrained. Variants run interleaved (constrained and unconstrained alternate, the order
flipping every round) and the ratio is taken per round; medians over --runs rounds. Also measured: the grammar's
own time per step (mask computation, the matchers' advance) inside the constrained runs, by timing those calls.

    python3 -m benchmarks.features.constrained_decoding [--runs 5] [--bundle DIR] [--new-tokens 96]
DIR: an FP32 SmolLM2 bundle (`kvforge export smollm2 --dequantize -o DIR`); made in a temporary directory if not given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result

ITEMS = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                          "quantity": {"type": "integer", "minimum": 1, "maximum": 100}},
         "required": ["name", "quantity"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 30, "maxItems": 30, "items": ITEMS}},
          "required": ["items"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "packing_list", "schema": SCHEMA}}
TRIPS = ["a camping trip", "a week at the beach", "a ski holiday", "a business trip", "a hiking tour", "a sailing trip",
         "a city break", "a family visit"]


def bundle_path(given: Path | None, work: Path) -> Path:
    if given is not None:
        return given
    from kvforge.export import export

    path = work / "smollm2-fp32"
    if not (path / "kvforge.json").is_file():
        export("smollm2", path, force=True, dequantize=True)
    return path


class GrammarClock:
    """Times the grammar's calls (masks, advance) while installed: seconds and calls."""

    def __init__(self):
        from kvforge.runtime import batcher, constrain, generate

        self.modules = (generate, batcher, constrain)
        self.seconds = 0.0
        self.steps = 0
        self.saved = (generate.masks, batcher.masks, constrain.Constraint.advance)

    def _timed(self, fn, count: bool):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.steps += count
        return wrapper

    def __enter__(self):
        generate, batcher, constrain = self.modules
        generate.masks = self._timed(self.saved[0], True)
        batcher.masks = self._timed(self.saved[1], True)
        constrain.Constraint.advance = self._timed(self.saved[2], False)
        return self

    def __exit__(self, *exc):
        generate, batcher, constrain = self.modules
        generate.masks, batcher.masks, constrain.Constraint.advance = self.saved


class StepClock:
    """Records when each of the session's forward calls returns (an instance attribute over Session.forward, which
    the generation loop and the batcher call): the intervals between two are decode steps (the token's choice, the
    grammar's mask included, and the forward pass)."""

    def __init__(self, session):
        self.session, self.marks = session, []

    def __enter__(self):
        forward = self.session.forward

        def timed(*args, **kwargs):
            out = forward(*args, **kwargs)
            self.marks.append(time.perf_counter())
            return out

        self.session.forward = timed
        return self

    def __exit__(self, *exc):
        del self.session.forward

    def steps(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def run_stream(session, prompt, constrained: bool, new_tokens: int) -> dict:
    kw = {"response_format": FORMAT} if constrained else {"ignore_eos": True}
    tokens = []
    with StepClock(session) as clock:
        for event in session.stream(prompt, max_new_tokens=new_tokens, **kw):
            tokens.append(event.token)
        end = time.perf_counter()
    return {"rows": 1, "tokens": len(tokens), "decode_s": end - clock.marks[0], "decoded": len(tokens) - 1,
            "steps": clock.steps(), "text": session.tokenizer.decode(tokens)}


def run_generate(session, prompts, constrained: bool, new_tokens: int) -> dict:
    kw = {"response_format": FORMAT} if constrained else {"ignore_eos": True}
    with StepClock(session) as clock:
        results = session.generate(prompts, max_new_tokens=new_tokens, **kw)
        end = time.perf_counter()
    return {"rows": len(prompts), "tokens": sum(len(r.tokens) for r in results), "decode_s": end - clock.marks[0],
            "decoded": sum(len(r.tokens) - 1 for r in results), "steps": clock.steps(), "text": results[0].text}


def run_batcher(session, prompts, constrained: bool, new_tokens: int) -> dict:
    from kvforge import runtime

    kw = {"response_format": FORMAT} if constrained else {"ignore_eos": True}
    stamps: list[list[float]] = [[] for _ in prompts]
    with StepClock(session) as clock, runtime.Batcher(session, max_batch=len(prompts)) as batcher:
        requests = [batcher.submit(p, max_new_tokens=new_tokens, **kw) for p in prompts]

        def consume(i):
            for _ in requests[i]:
                stamps[i].append(time.perf_counter())

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [r.result() for r in requests]
    first, last = min(s[0] for s in stamps), max(s[-1] for s in stamps)
    return {"rows": len(prompts), "tokens": sum(len(r.tokens) for r in results), "decode_s": last - first,
            "decoded": sum(len(r.tokens) - 1 for r in results), "steps": clock.steps(), "text": results[0].text}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bundle", type=Path, default=None, help="an FP32 SmolLM2 bundle to reuse")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=RESULTS / "constrained_decoding.json")
    args = ap.parse_args()
    load_before = load_average()
    from kvforge import runtime

    with tempfile.TemporaryDirectory() as tmp:
        path = bundle_path(args.bundle, Path(tmp))
        session = runtime.load(path).activate()
        prompts = [session.chat_ids([{"role": "user", "content": f"List thirty things to pack for {trip}, each with a "
                                      "quantity, as JSON."}]) for trip in TRIPS]
        setups = {"batch1_stream": lambda c: run_stream(session, prompts[0], c, args.new_tokens),
                  "batch8_generate": lambda c: run_generate(session, prompts, c, args.new_tokens),
                  "batch8_batcher": lambda c: run_batcher(session, prompts, c, args.new_tokens)}
        out = {}
        for name, run in setups.items():
            run(True), run(False)  # warm-up (and the grammar's compilation, cached from here on)
            rounds = []
            for i in range(args.runs):
                order = (True, False) if i % 2 == 0 else (False, True)
                got = {}
                for constrained in order:
                    time.sleep(0.5)
                    if constrained:
                        with GrammarClock() as clock:
                            got[constrained] = run(True)
                        got[constrained]["grammar_s"], got[constrained]["grammar_steps"] = clock.seconds, clock.steps
                    else:
                        got[constrained] = run(False)
                c, f = got[True], got[False]
                rate_c, rate_f = c["decoded"] / c["decode_s"], f["decoded"] / f["decode_s"]
                step_c, step_f = statistics.median(c["steps"]), statistics.median(f["steps"])
                rounds.append({"constrained_tokens_per_s": c["rows"] / step_c, "unconstrained_tokens_per_s": f["rows"] / step_f,
                               "ratio": step_f / step_c,
                               "constrained_ms_per_step": 1e3 * step_c, "unconstrained_ms_per_step": 1e3 * step_f,
                               "whole_run_constrained_tokens_per_s": rate_c, "whole_run_unconstrained_tokens_per_s": rate_f,
                               "whole_run_ratio": rate_c / rate_f,
                               "constrained_tokens": c["tokens"], "unconstrained_tokens": f["tokens"],
                               "grammar_ms_per_step": 1e3 * c["grammar_s"] / max(c["grammar_steps"], 1),
                               "grammar_share_of_decode": c["grammar_s"] / c["decode_s"]})
                print(f"{name} run {i}: per step constrained {1e3 * step_c:.1f} ms, unconstrained {1e3 * step_f:.1f} ms, "
                      f"ratio {step_f / step_c:.3f} (whole runs {rate_c:.1f} / {rate_f:.1f} tok/s = {rate_c / rate_f:.3f}), "
                      f"grammar {rounds[-1]['grammar_ms_per_step']:.2f} ms/step", flush=True)
            valid = _valid(c["text"])
            out[name] = {
                "ratio_median": statistics.median(r["ratio"] for r in rounds),
                "constrained_tokens_per_s_median": statistics.median(r["constrained_tokens_per_s"] for r in rounds),
                "unconstrained_tokens_per_s_median": statistics.median(r["unconstrained_tokens_per_s"] for r in rounds),
                "whole_run_ratio_median": statistics.median(r["whole_run_ratio"] for r in rounds),
                "grammar_ms_per_step_median": statistics.median(r["grammar_ms_per_step"] for r in rounds),
                "grammar_share_of_decode_median": statistics.median(r["grammar_share_of_decode"] for r in rounds),
                "constrained_output_is_a_valid_prefix": valid, "constrained_sample": c["text"][:160],
                "rounds": rounds,
            }
        session.deactivate()
    result = {"benchmark": "constrained_decoding", "model": "SmolLM2-135M-Instruct FP32 (ONNX Runtime, CPU)",
              "engine": "llguidance", "new_tokens": args.new_tokens, "runs": args.runs, "schema": SCHEMA,
              "target_ratio": 0.9, "setups": out, "machine": machine(),
              "load_before": load_before, "time": utc_time()}
    write_result("constrained_decoding", result, args.out)
    for name, e in out.items():
        print(f"{name:16s} ratio {e['ratio_median']:.3f} (constrained {e['constrained_tokens_per_s_median']:.1f}, "
              f"unconstrained {e['unconstrained_tokens_per_s_median']:.1f} tok/s; whole runs "
              f"{e['whole_run_ratio_median']:.3f}; grammar "
              f"{e['grammar_ms_per_step_median']:.2f} ms/step, {100 * e['grammar_share_of_decode_median']:.1f}% of decode)")
    print(f"wrote {args.out}")
    return 0


def _valid(text: str) -> bool:
    """Whether the (cut) JSON text is a prefix of a packing list: it starts as one and every complete item parses."""
    import re

    items = re.findall(r"\{\"name\": (\"(?:[^\"\\\\]|\\\\.)*\"), \"quantity\": (\d+)\}", text)
    return text.startswith('{"items": [{"name": ') and len(items) >= 1 and all(
        isinstance(json.loads(n), str) and 1 <= int(q) <= 100 for n, q in items)


if __name__ == "__main__":
    raise SystemExit(main())
