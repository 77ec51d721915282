"""Mixture-of-experts decode speed against dense models of the same active and the same total size.

Three kvforge models, random weights, FP32, exported (validated) and run by the runtime on ONNX Runtime,
batch 1, a 64-token prompt then greedy decode:

    moe           Mixtral-shaped: 8 layers, dim 512, GQA 8/2, 8 experts of FFN 1024, top-2 (~139M parameters)
    dense-active  the same with one dense FFN of 2048 (what a token computes in the MoE: 2 x 1024)
    dense-total   the same with one dense FFN of 8192 (all 8 experts' width: the MoE's total size)

The MoE graph computes only the chosen experts (each expert's matmuls read the rows routed to it), so its
decode should cost about what dense-active costs and far less than dense-total. Targets (issue 15): MoE
decode tokens/s >= 0.7 x dense-active and >= 2.5 x dense-total. Medians over runs, the three models
interleaved run by run; the memory bandwidth measured in the same run gives each model's weight-read bound.

    python3 -m benchmarks.features.moe_decode [--runs 5] [--new-tokens 64]
Writes benchmarks/results/moe_decode.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import RESULTS, bandwidth_gbs, load_average, machine, utc_time, write_result
from benchmarks.peers.runtime_125m import export_random

BASE = dict(vocab_size=32000, dim=512, n_layers=8, n_heads=8, n_kv_heads=2, max_seq_len=1024, family="llama",
            bos_token_id=1, eos_token_id=2)
MODELS = {
    "moe": dict(BASE, ffn_dim=1024, n_experts=8, experts_per_token=2, expert_ffn_dim=1024, family="mixtral"),
    "dense-active": dict(BASE, ffn_dim=2048),
    "dense-total": dict(BASE, ffn_dim=8192),
}
PROMPT = 64


def read_bytes_per_token(cfg, model) -> int:
    """Weight bytes a decode step reads: every parameter but the (gathered) embedding; for the MoE, only
    experts_per_token of its experts per layer."""
    total = sum(p.numel() for name, p in model.named_parameters() if name != "embed.weight")
    if cfg.n_experts:
        per_expert = 3 * cfg.dim * cfg.expert_ffn_dim
        total -= cfg.n_layers * (cfg.n_experts - cfg.experts_per_token) * per_expert
    return 4 * total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS / "moe_decode.json"))
    args = ap.parse_args()
    load_before = load_average()
    from kvforge import runtime
    from kvforge.runtime.bench import timed_greedy

    info, sessions = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, fields in MODELS.items():
            bundle, model, seconds = export_random(fields, tmp, name)
            info[name] = {"parameters": model.num_parameters(),
                          "bytes_read_per_token": read_bytes_per_token(model.config, model), "export_seconds": seconds}
            sessions[name] = runtime.load(bundle.path).activate()
            del model
        prompt = np.random.default_rng(0).integers(3, BASE["vocab_size"], (1, PROMPT)).astype(np.int64)
        for s in sessions.values():  # warm-up
            timed_greedy(s, prompt, 8)
        runs = {n: [] for n in MODELS}
        bandwidths = []
        for r in range(args.runs):
            bandwidths.append(bandwidth_gbs(reps=5))
            order = list(MODELS)[r % 3:] + list(MODELS)[:r % 3]
            for n in order:
                time.sleep(0.5)
                t = timed_greedy(sessions[n], prompt, args.new_tokens)
                runs[n].append({"decode_tokens_per_s": t["decode_steps"] / t["decode_s"],
                                "prefill_tokens_per_s": PROMPT / t["prefill_s"]})
            print(f"run {r + 1}: " + ", ".join(f"{n} {runs[n][-1]['decode_tokens_per_s']:.1f} tok/s" for n in MODELS), flush=True)
    bw = statistics.median(bandwidths)
    med = {n: {k: statistics.median(x[k] for x in runs[n]) for k in ("decode_tokens_per_s", "prefill_tokens_per_s")}
           for n in MODELS}
    for n in MODELS:
        roof = bw * 1e9 / info[n]["bytes_read_per_token"]
        med[n]["roofline_tokens_per_s"] = round(roof, 1)
        med[n]["of_roofline"] = round(med[n]["decode_tokens_per_s"] / roof, 3)
    vs_active = med["moe"]["decode_tokens_per_s"] / med["dense-active"]["decode_tokens_per_s"]
    vs_total = med["moe"]["decode_tokens_per_s"] / med["dense-total"]["decode_tokens_per_s"]
    result = {
        "benchmark": "moe_decode", "runs": args.runs, "prompt": PROMPT, "new_tokens": args.new_tokens,
        "bandwidth_gbs": round(bw, 2), "models": {n: {**MODELS[n], **info[n], **med[n]} for n in MODELS},
        "moe_vs_dense_active": round(vs_active, 3), "moe_vs_dense_total": round(vs_total, 3),
        "targets": {"vs_dense_active": 0.7, "vs_dense_total": 2.5},
        "passed": vs_active >= 0.7 and vs_total >= 2.5,
        "per_run": runs,
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result("moe_decode", result, args.out)
    print(json.dumps({k: v for k, v in result.items() if k != "per_run"}, indent=2))


if __name__ == "__main__":
    main()
