"""Bundle sizes of ~125M-parameter models: a tied embedding and head stored once, in every precision.

GPT-2 small's shape (`gpt2-124m`: 50257 x 768 tied embedding and head) is exported FP32 and calibrated INT8
(random data: the preset has random weights), with the head kept in float and with it quantized; the quantized
head is measured both as kvforge stores it (the embedding reads the head's codes: one table) and as it was
stored before (the head's own transposed INT8 copy beside the float embedding: `share_tied_head` disabled).
The 125M Llama of the runtime benchmarks (`llama-125m`) has an untied head: its FP32 bundle is measured
against its parameter bytes, which it equals (every weight stored once).

    python3 -m benchmarks.features.tied_head_size
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from unittest import mock

from benchmarks.harness import load_average, machine, utc_time, write_result


def bundle_mb(bundle) -> float:
    return sum(p.stat().st_size for p in bundle.path.iterdir() if p.name.startswith("model.onnx")) / 1e6


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()  # no options: --help only
    load_before = load_average()
    from kvforge.calibration import calibrate, qdq
    from kvforge.export import export
    from kvforge.model_defs import ModelConfig, build_model

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for preset in ("gpt2-124m", "llama-125m"):
            cfg = ModelConfig.from_name(preset)
            params = build_model(cfg).num_parameters()
            fp32 = export(preset, tmp / preset)
            rows[f"{preset} fp32"] = {"mb": bundle_mb(fp32), "parameters": params, "parameter_mb_fp32": 4 * params / 1e6,
                                      "tied": cfg.tie_embeddings}
            if not cfg.tie_embeddings:
                continue
            kw = dict(random_data=True, samples=4, seq_len=64)
            rows[f"{preset} int8, head float"] = {"mb": bundle_mb(calibrate(fp32.path, tmp / "h", precision="int8", **kw))}
            shared = calibrate(fp32.path, tmp / "s", precision="int8", quantize_lm_head=True, **kw)
            rows[f"{preset} int8, head quantized, stored once"] = {"mb": bundle_mb(shared)}
            with mock.patch.object(qdq, "share_tied_head", lambda *a, **k: None):  # the layout before: a second table
                copied = calibrate(fp32.path, tmp / "c", precision="int8", quantize_lm_head=True, **kw)
            rows[f"{preset} int8, head quantized, own copy (before)"] = {"mb": bundle_mb(copied)}
    result = {"benchmark": "tied_head_size", "bundles": rows, "machine": machine(), "load_before": load_before,
              "time": utc_time()}
    write_result("tied_head_size", result)
    for name, row in rows.items():
        print(f"{name:55s} {row['mb']:8.1f} MB" + (f"  (parameters x 4 bytes: {row['parameter_mb_fp32']:.1f} MB)" if "parameters" in row else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
