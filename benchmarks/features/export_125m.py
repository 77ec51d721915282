"""Export time and peak memory for a ~125M-parameter Llama-shaped checkpoint.

The checkpoint is a Hugging Face Llama directory made locally from a config
(hidden 768, 12 layers, 12 heads / 4 KV heads, FFN 2048, vocab 32000; random
weights). Each run is `kvforge export` in a fresh process (so peak RSS is that
run's own); the script reports the median over runs of the total time (load,
export, lint, validation, write), the torch.onnx step alone, and peak RSS.

    python3 -m benchmarks.features.export_125m [--runs 3] [--out benchmarks/results/export_125m.json]
    python3 -m benchmarks.features.export_125m --source gpt2-124m --runs 1 \
        --out benchmarks/results/export_gpt2_124m.json

--source exports a preset (or any source `kvforge export` takes) instead: gpt2-124m is the other design at this
scale (learned positions, LayerNorm, fused QKV, a 50k vocabulary); each run's record says whether validation
passed, its worst logits difference and how many of the 32 lockstep steps chose the reference's token. (The test
tiers export the design at micro size and against transformers, and the real SmolLM2-135M and Gemma 3 270M at
scale; a 124M random-weight export is a minute of CI that adds no design.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import RESULTS, load_average, machine, utc_time, write_result

CONFIG = dict(
    hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
    intermediate_size=2048, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

CHILD = r"""
import json, resource, sys, time
from kvforge.export import export
t = time.perf_counter()
b = export(sys.argv[1], sys.argv[2], dtype=sys.argv[3], force=True)
total = time.perf_counter() - t
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
v = b.manifest["validation"]
print(json.dumps({"total_s": total, "export_s": b.manifest["lineage"][0]["seconds"]["export"], "peak_rss_mb": rss_mb,
                  "validation_passed": v["passed"], "lint_passed": b.manifest["lint"]["passed"],
                  "logits_max_abs": v["logits"]["max_abs"], "greedy": v["lockstep"]["greedy_matching_steps"],
                  "onnx_bytes": b.manifest["files"]["model.onnx"]["bytes"]}))
"""


def make_checkpoint(directory: Path) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--source", default=None, help="a preset or source to export instead of the Llama checkpoint")
    ap.add_argument("--out", type=Path, default=RESULTS / "export_125m.json")
    args = ap.parse_args()
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        if args.source is None:
            ckpt = Path(tmp) / "llama-125m"
            params = make_checkpoint(ckpt)
        else:
            from kvforge.model_defs.checkpoint import source_parameters

            ckpt, params = args.source, source_parameters(args.source)
        runs = []
        for i in range(args.runs):
            out = subprocess.run([sys.executable, "-c", CHILD, str(ckpt), str(Path(tmp) / "bundle"), args.dtype],
                                 capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"run {i}: {runs[-1]}", flush=True)
    result = {
        "benchmark": "export_125m",
        "source": args.source or "llama-125m (a Hugging Face Llama directory made locally: CONFIG)",
        "parameters": params,
        "dtype": args.dtype,
        "runs": runs,
        "median_total_s": statistics.median(r["total_s"] for r in runs),
        "median_export_s": statistics.median(r["export_s"] for r in runs),
        "median_peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result("export_125m", result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
