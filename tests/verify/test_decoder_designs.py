"""Every stage after the export on every decoder design beyond Llama: calibrate (INT8, FP8, INT4), the
runtime, compare, check and the engine's dry-run plan.

The presets have random weights, whose next-token distributions are flat (near-ties everywhere), so
top-1 agreement says little here; the bounds are on the logits' cosine similarity to the FP32 Torch
reference, with headroom over what each format gives (seen: INT8 >= 0.998, FP8 >= 0.993, INT4 >= 0.94).
"""

from __future__ import annotations

import pytest

from kvforge.calibration import calibrate
from kvforge.export.engine import build_plan
from kvforge.verify.check import check
from kvforge.verify.compare import compare

DESIGNS = ["alibi-micro", "neox-micro", "parallel-micro", "olmo-micro", "granite-micro", "gemma-micro"]
MIN_COSINE = {"int8": 0.995, "fp8": 0.985, "int4": 0.92}


def _linears_per_layer(cfg: dict) -> int:
    return 4 + (3 if cfg["gated_ffn"] else 2)  # q, k, v, o + gate, up, down (or up, down)


@pytest.mark.parametrize("preset", DESIGNS)
def test_calibrate_compare_and_plan_every_design(micro_bundle, tmp_path, preset):
    fp32 = micro_bundle(preset)
    cfg = fp32.model_config
    for precision in ("int8", "fp8", "int4"):
        # each calibrated for TensorRT (the plan below): static activation scales, symmetric INT4 blocks
        form = dict(zero_points=False) if precision == "int4" else dict(activations="static")
        q = calibrate(fp32.path, tmp_path / precision, precision=precision, random_data=True, samples=8, seq_len=32,
                      **form)
        # every linear layer of every block was found and quantized, whatever the block's shape
        assert len(q.manifest["calibration"]["scales"]["weights"]) == cfg["n_layers"] * _linears_per_layer(cfg)
        assert q.manifest["lint"]["passed"], q.manifest["lint"]["findings"]
        report = compare(q.path, random_data=True, max_tokens=512, seq_len=64, steps=8, prompts=2, prompt_len=8)
        assert report["candidate_backend"] == "onnxruntime" and report["reference_backend"] == "torch"
        assert report["logits_cosine"] >= MIN_COSINE[precision], (precision, report["logits_cosine"])
        assert report["present_cosine"] >= MIN_COSINE[precision], (precision, report["present_cosine"])
    plan = build_plan(q.path)  # `kvforge build --dry-run` of the INT4 bundle
    assert plan["shape_check"]["passed"] and plan["shape_check"]["points"] == 6


def test_check_runs_a_spec_over_a_windowed_design(micro_bundle, tmp_path):
    """gemma-micro (capped caches, soft-capping, sandwich norms): export, calibrate and compare from a spec,
    a baseline written, then checked against it. The baseline is written from the run's export of gemma-micro
    (a spec whose fp32 artifact is that bundle, calibrated from it); the check then makes both from the source."""
    head = """
source = "gemma-micro"
baseline = "gemma.baseline.json"
[data]
random = true
max_tokens = 512
seq_len = 64
steps = 8
prompts = 2
"""
    int8 = """
[[artifacts]]
name = "int8"
precision = "int8"
random_data = true
samples = 8
seq_len = 32
tolerances = { top1_agreement = 0.9 }
"""
    given = tmp_path / "given.toml"
    given.write_text(f'{head}\n[[artifacts]]\nname = "fp32"\nbundle = "{micro_bundle("gemma-micro").path}"\n'
                     f'{int8}base = "fp32"\n')
    spec = tmp_path / "gemma.toml"
    spec.write_text(f'{head}\n[[artifacts]]\nname = "fp32"\ndtype = "float32"\n{int8}')
    written = check(given, update_baseline=True, workdir=tmp_path / "work", log=lambda m: None)
    assert written.baseline_written and written.passed
    again = check(spec, workdir=tmp_path / "work2", log=lambda m: None)
    assert again.passed, again.regressions
    assert {f.key for f in again.findings} == {"fp32/onnxruntime", "int8/onnxruntime"}
