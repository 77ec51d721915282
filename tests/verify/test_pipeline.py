"""kvforge pipeline: the main job's report, the plain TensorRT skip, and its refusals."""

from __future__ import annotations

import importlib.util
import json

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.errors import KvforgeError
from kvforge.verify.pipeline import pipeline, recipes


@pytest.mark.slow
def test_pipeline_writes_bundles_a_report_and_pictures(tmp_path):
    work = tmp_path / "run"
    out = CliRunner().invoke(main, ["pipeline", "-o", str(work), "--precision", "fp32", "--precision", "int4", "--quiet"])
    assert out.exit_code == 0, out.output
    for name in ("fp32", "int4"):
        assert (work / name / "kvforge.json").is_file()
        assert f"{name}" in out.output
    report = json.loads((work / "report.json").read_text())
    assert set(report["results"]) >= {"fp32/onnxruntime", "int4/onnxruntime"}
    fp32, int4 = report["results"]["fp32/onnxruntime"], report["results"]["int4/onnxruntime"]
    assert fp32["passed"] and fp32["top1_agreement"] == 1.0
    assert int4["passed"] and int4["top1_agreement"] < 1.0 and int4["per_layer"] is not None
    assert (work / "drift.png").read_bytes()[:4] == b"\x89PNG" and (work / "int4-layers.png").is_file()
    # the pictures written, by name (the console wraps a long work path's line where it likes)
    assert "(+ drift.png, int4-layers.png)" in " ".join(out.output.split())
    assert "compare fp32 on onnxruntime" not in out.output  # --quiet: no stage lines, only the summary
    assert report["sample"].startswith("int4: 'def fibonacci(n):")
    int4_manifest = json.loads((work / "int4" / "kvforge.json").read_text())
    # kvforge calibrate's defaults: the automatic recipe, measured on tiny's own held-out corpus
    assert int4_manifest["precision"]["quantization"]["recipe"] == "auto"
    assert int4_manifest["calibration"]["recipe"]["measured_on"]["data"] == "held-out pieces of built-in tiny corpus"
    if importlib.util.find_spec("tensorrt") is None:  # said plainly, once, and recorded
        assert "TensorRT engine build skipped" in out.output and "TensorRT" in report["tensorrt_skipped"]
        assert not any(k.endswith("/tensorrt") for k in report["results"])


def test_pipeline_refuses_a_used_workdir_and_unknown_precisions(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(KvforgeError, match="not empty; pass --force"):
        pipeline(workdir=tmp_path, precisions=["fp32"])
    with pytest.raises(KvforgeError, match="must be a non-empty choice"):
        pipeline(workdir=tmp_path / "new", precisions=["int2"])
    assert (tmp_path / "keep.txt").read_text() == "mine" and not (tmp_path / "new").exists()


def test_recipes_take_calibrates_defaults_and_random_tokens_only_when_asked():
    arts = recipes(["fp32", "int8", "fp8", "int4"], "tiny")
    assert {a.name: a.calibrate for a in arts if a.precision} == {"int8": {}, "fp8": {}, "int4": {}}
    random = recipes(["fp8", "int4"], "llama3-micro", random_data=True)
    assert random[0].calibrate == {"random_data": True} and random[1].calibrate == {}  # weight-only INT4 reads no tokens


def test_pipeline_and_check_on_an_encoder_and_an_encoder_decoder(tmp_path):
    """The main job and the regression check take the other model shapes: their own metrics, no decode drift."""
    from kvforge.model_defs.evaluate import heldout_text
    from kvforge.verify.check import check

    text = tmp_path / "text.txt"
    text.write_text(heldout_text()[:12000])
    result = pipeline("bart-micro", tmp_path / "bart", precisions=("fp32",), calibration_data=str(text), log=lambda m: None)
    report = json.loads((tmp_path / "bart" / "report.json").read_text())
    assert set(report["results"]) == {"fp32/onnxruntime"}
    fp32 = report["results"]["fp32/onnxruntime"]
    assert fp32["kind"] == "encoder-decoder" and fp32["top1_agreement"] == 1.0 and fp32["greedy_agreement"] == 1.0
    assert not (tmp_path / "bart" / "drift.png").exists()  # no lockstep drift curve for this shape
    assert result.sample.startswith("fp32: 'def fibonacci(n):")
    spec = tmp_path / "bert.toml"
    spec.write_text(f'source = "roberta-micro"\nbaseline = "bert.baseline.json"\n[data]\neval = "{text}"\n'
                    f'calibration = "{text}"\n[[artifacts]]\nname = "int8"\nprecision = "int8"\n')
    written = check(spec, update_baseline=True, workdir=tmp_path / "work", log=lambda m: None)
    assert written.passed
    baseline = json.loads((tmp_path / "bert.baseline.json").read_text())["results"]["int8/onnxruntime"]
    assert 0.99 < baseline["embedding_cosine_min"] < 1.0 and "greedy_agreement" not in baseline
    again = check(spec, workdir=tmp_path / "work2", log=lambda m: None)
    assert again.passed and {f.metric for f in again.findings} >= {"embedding_cosine_min", "hidden_rel_l2", "top1_agreement"}
