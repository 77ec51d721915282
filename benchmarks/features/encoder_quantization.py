"""Quantized encoders and encoder-decoders as `kvforge compare` reports them: INT8, FP8 and INT4 of the
BERT-, Perceiver-, T5- and BART-shaped micro presets (random weights, the byte-level tokenizer).

Each preset is exported (FP32, validated), calibrated on the built-in calibration corpus (64 samples of
128 tokens; INT4 weight-only with block 32, the micro widths being 64..128) and compared with its Torch
reference on the held-out text: for encoders embedding cosine, hidden-state error and top-1 agreement of
the masked-LM or class predictions; for encoder-decoders target perplexity given the source, top-1,
KL and greedy agreement. Random weights give flat next-token distributions, so top-1 and greedy figures
here are lower than on a trained model for the same numerical error (the hidden-state and logits errors
are the figures to compare across precisions).

    python3 -m benchmarks.features.encoder_quantization
Writes benchmarks/results/encoder_quantization.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.harness import load_average, machine, utc_time, write_result

PRESETS = ("bert-micro", "perceiver-micro", "t5-micro", "bart-micro")
PRECISIONS = ("int8", "fp8", "int4")
KEYS = {
    "encoder": ("embedding_cosine_mean", "embedding_cosine_min", "hidden_rel_l2", "top1_agreement", "kl_divergence_mean"),
    "encoder-decoder": ("perplexity_reference", "perplexity_candidate", "perplexity_delta_pct", "top1_agreement",
                        "kl_divergence_mean", "logits_rel_l2", "greedy_agreement"),
}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options: --help only
    load_before = load_average()
    from kvforge.calibration import calibrate
    from kvforge.export import export
    from kvforge.model_defs.checkpoint import TINY_DIR
    from kvforge.verify.compare import compare

    corpus = TINY_DIR / "calibration.txt"
    results = {}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for preset in PRESETS:
            fp32 = export(preset, tmp / preset, max_context=256)
            kind = "encoder-decoder" if fp32.manifest["model"]["architecture"] == "encoder-decoder" else "encoder"
            seq_len = 64 if kind == "encoder-decoder" else 128
            results[preset] = {}
            for precision in ("fp32", *PRECISIONS):
                bundle = fp32 if precision == "fp32" else calibrate(
                    fp32.path, tmp / f"{preset}-{precision}", recipe="fixed", precision=precision, data=corpus, samples=64, seq_len=128,
                    block_size=32 if precision == "int4" else None)
                r = compare(bundle.path, seq_len=seq_len).result
                results[preset][precision] = {k: r[k] for k in KEYS[kind] if r.get(k) is not None}
                results[preset][precision]["passed_default_bounds"] = r["passed"]
                print(preset, precision, json.dumps(results[preset][precision]), flush=True)
    out = {"benchmark": "encoder_quantization", "data": "held-out text (compare's default)",
           "calibration": "built-in calibration corpus, 64 x 128 tokens", "seconds": round(time.time() - started, 1),
           "results": results, "machine": machine(), "load_before": load_before, "time": utc_time()}
    path = write_result("encoder_quantization", out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
