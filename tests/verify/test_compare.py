"""kvforge compare: docs/design.md's verification metrics against the Torch reference, and per-layer attribution."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from kvforge import runtime
from kvforge.cli import main
from kvforge.errors import KvforgeError
from kvforge.metrics import windows
from kvforge.model_defs.evaluate import heldout_text
from kvforge.runtime.evaluate import perplexity
from kvforge.verify import REPORT_METRICS, compare
from kvforge.verify.compare import write_report
from kvforge.attribution import block_outputs

QUICK = dict(max_tokens=1024, steps=8, prompts=2)
# The JSON keys docs/verification.md promises.
STABLE_KEYS = set(REPORT_METRICS) | {"candidate", "candidate_backend", "precision", "reference", "reference_backend", "data",
                                     "tokens", "seq_len", "steps", "prompts", "prompt_len", "drift", "per_layer",
                                     "tolerances", "failures", "passed", "seconds"}


@pytest.fixture(scope="module")
def fp32_report(tiny_fp32):
    return compare(tiny_fp32.path, per_layer=True, **QUICK)


def test_fp32_bundle_computes_the_reference_function(fp32_report):
    r = fp32_report.result
    assert set(r) == STABLE_KEYS
    assert r["passed"] and r["failures"] == []
    assert r["precision"] == "float32" and r["candidate_backend"] == "onnxruntime" and r["reference"] == "tiny"
    assert abs(r["perplexity_delta_pct"]) < 1e-3
    assert r["top1_agreement"] == 1.0 and r["greedy_agreement"] == 1.0 and r["greedy_prefix_match"] == 1.0
    assert r["logits_rel_l2"] < 1e-5 and r["logits_cosine"] > 1 - 1e-9 and r["present_rel_l2"] < 1e-5
    assert len(r["drift"]) == 8 and all(d["logits_rel_l2"] < 1e-5 for d in r["drift"])
    # every block's residual stream matches the reference's (ONNX tensor found by scope = Torch hook)
    assert [row["layer"] for row in r["per_layer"]] == [f"layers.{i}" for i in range(4)]
    assert all(row["rel_l2"] < 1e-5 and row["contribution"] < 1e-5 for row in r["per_layer"])


def test_perplexities_equal_an_independent_computation(tiny_fp32, fp32_report):
    """The streaming sums give what runtime.evaluate.perplexity gives on the same windows."""
    with runtime.load("tiny", backend="torch") as ref, runtime.load(tiny_fp32.path) as cand:
        ids = ref.tokenizer.encode(heldout_text(), add_special_tokens=False)[: 1024 + 1]
        assert fp32_report["tokens"] == windows(ids, 256)[:, :-1].size
        assert math.isclose(fp32_report["perplexity_reference"], perplexity(ref, ids, 256), rel_tol=1e-9)
        assert math.isclose(fp32_report["perplexity_candidate"], perplexity(cand, ids, 256), rel_tol=1e-9)


def test_int8_error_is_measured_and_within_its_default_bounds(tiny_int8, tmp_path):
    report = compare(tiny_int8.path, max_tokens=1024, steps=32, prompts=2)
    r = report.result
    assert r["precision"] == "int8" and report.passed, report.failures
    # quantization error is visible, and bounded
    assert 0.85 < r["top1_agreement"] < 1.0
    assert 1e-5 < r["kl_divergence_mean"] < 0.05
    assert 1e-3 < r["logits_rel_l2"] < 0.1 and r["logits_max_abs"] > 1e-3
    assert abs(r["perplexity_delta_pct"]) < 2.0
    written = write_report(report, tmp_path / "int8.json")
    assert [p.name for p in written] == ["int8.json", "int8-drift.png"]
    assert json.loads(written[0].read_text())["top1_agreement"] == r["top1_agreement"]
    assert written[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and written[1].stat().st_size > 5000


def test_a_tolerance_that_fails_fails_the_comparison_and_the_cli(tiny_int8, tmp_path):
    report = compare(tiny_int8.path, tolerances={"top1_agreement": 1.0}, **QUICK)
    assert not report.passed
    assert any(f.startswith("top1_agreement") for f in report.failures)
    out = CliRunner().invoke(main, ["compare", str(tiny_int8.path), "--tolerance", "top1_agreement=1.0", "--max-tokens", "512",
                                    "--steps", "4", "--prompts", "1", "--quiet", "--json", str(tmp_path / "r.json")])
    assert out.exit_code == 1, out.output
    assert "FAILED" in out.output and "top1_agreement" in out.output
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["passed"] is False and saved["tolerances"]["top1_agreement"] == 1.0


def test_per_layer_ranks_the_only_quantized_block_first(tiny_fp32, tmp_path):
    """A planted cause: only block 2 is quantized, so attribution must name it."""
    from kvforge.calibration import calibrate

    only2 = calibrate(tiny_fp32.path, tmp_path / "only2", precision="int8", samples=16, seq_len=128,
                      exclude=[r"layers\.[013]\."], quantize_lm_head=False)  # (a quantized tied head: the embedding too)
    report = compare(only2.path, per_layer=True, max_tokens=512, steps=2, prompts=1)
    rows = {row["layer"]: row for row in report["per_layer"]}
    assert rows["layers.2"]["rank"] == 1
    assert rows["layers.2"]["contribution"] > 1e-3
    for name in ("layers.0", "layers.1", "layers.3"):
        assert rows[name]["contribution"] < 1e-5  # float blocks add no error of their own
    assert rows["layers.0"]["rel_l2"] < 1e-5 and rows["layers.3"]["rel_l2"] > 1e-3  # accumulated: error flows on
    written = write_report(report, tmp_path / "only2.json")
    assert written[-1].name == "only2-layers.png" and written[-1].read_bytes()[:4] == b"\x89PNG"


def test_block_outputs_survive_calibration(tiny_fp32, tiny_int8):
    import onnx

    names = block_outputs(onnx.load(str(tiny_fp32.graph_file)), 4)
    assert len(set(names)) == 4
    assert block_outputs(onnx.load(str(tiny_int8.graph_file)), 4) == names


def test_bad_requests_get_clear_errors(tiny_fp32, tmp_path):
    with pytest.raises(KvforgeError, match="not a bundle"):
        compare(tmp_path)
    with pytest.raises(KvforgeError, match="unknown tolerance 'top1'"):
        from kvforge.metrics import parse_tolerances

        parse_tolerances(["top1=0.9"])
    for item, message in [("top1_agreement=2", "lies in \\[0, 1\\]"), ("perplexity_delta_pct=-1", "finite number >= 0 \\(on \\|change\\|\\)"),
                          ("kl_divergence_mean=nan", "finite number >= 0"), ("logits_max_abs=inf", "finite number >= 0")]:
        with pytest.raises(KvforgeError, match=message):
            parse_tolerances([item])
    assert parse_tolerances(["top1_agreement=0.95", "perplexity_delta_pct=1"]) == {"top1_agreement": 0.95, "perplexity_delta_pct": 1.0}
    short = tmp_path / "short.txt"
    short.write_text("x = 1\n")
    with pytest.raises(KvforgeError, match="need more than 256 tokens"):
        compare(tiny_fp32.path, data=short, **QUICK)
    with pytest.raises(KvforgeError, match="per-layer reads intermediate tensors from the ONNX graph"):
        compare(tiny_fp32.path, backend="torch", per_layer=True, **QUICK)


def test_random_tokens_and_a_reference_bundle(tiny_fp32):
    report = compare(tiny_fp32.path, reference=tiny_fp32.path, random_data=True, max_tokens=512, steps=4, prompts=1)
    assert report.passed and report["reference"] == str(tiny_fp32.path)
    assert report["data"].startswith("random tokens") and report["top1_agreement"] == 1.0
    # random text is far less predictable than code: perplexity near the vocabulary size's order
    assert report["perplexity_reference"] > 200
    assert np.isfinite(report["kl_divergence_mean"])
