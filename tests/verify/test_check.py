"""kvforge check: a spec, a committed baseline, and a regression caught."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.bundle import MANIFEST, Bundle, write_manifest
from kvforge.cli import main
from kvforge.errors import KvforgeError
from kvforge.verify.check import check, limit_for, load_spec

SPEC = """
source = "tiny"
baseline = "baseline.json"
[data]
max_tokens = 1024
steps = 8
prompts = 2
[[artifacts]]
name = "int8"
bundle = "int8"
"""


def _corrupt_scale(bundle_dir, tensor: str, factor: float) -> None:
    """What a buggy calibrator would write: one activation scale off by `factor`, with a consistent manifest."""
    import onnx
    from onnx import numpy_helper

    path = bundle_dir / "model.onnx"
    model = onnx.load(str(path))
    init = next(i for i in model.graph.initializer if i.name == tensor)
    scale = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array((scale * factor).astype(scale.dtype), tensor))  # numpy 1 would widen a 0-d one
    onnx.save(model, str(path))
    manifest = json.loads((bundle_dir / MANIFEST).read_text())
    write_manifest(bundle_dir, {k: v for k, v in manifest.items() if k not in ("format", "format_version", "files")})
    Bundle(bundle_dir).verify_files()  # nothing but the numbers gives it away


@pytest.fixture
def spec(tiny_int8, tmp_path):
    shutil.copytree(tiny_int8.path, tmp_path / "int8")
    path = tmp_path / "check.toml"
    path.write_text(SPEC)
    return path


def test_check_passes_unmodified_and_catches_a_corrupted_scale(spec, tmp_path):
    written = check(spec, update_baseline=True, log=lambda m: None)
    assert written.baseline_written and written.passed
    baseline = json.loads((tmp_path / "baseline.json").read_text())
    assert set(baseline["results"]) == {"int8/onnxruntime"}

    again = check(spec, log=lambda m: None)
    assert again.passed, again.regressions
    assert {f.metric for f in again.findings} >= {"top1_agreement", "kl_divergence_mean", "perplexity_delta_pct"}

    _corrupt_scale(tmp_path / "int8", "layers.1.ffn.down_proj.input_scale", 0.1)
    broken = check(spec, log=lambda m: None)
    assert not broken.passed
    regressed = {f.metric for f in broken.regressions}
    assert {"kl_divergence_mean", "logits_rel_l2"} <= regressed
    assert all(f.key == "int8/onnxruntime" for f in broken.regressions)

    out = CliRunner().invoke(main, ["check", str(spec), "--quiet", "--report", str(tmp_path / "report.json")])
    assert out.exit_code == 1 and "check FAILED" in out.output and "regressed" in out.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] is False and report["results"]["int8/onnxruntime"]["passed"] in (True, False)
    assert (tmp_path / "report-drift.png").read_bytes()[:4] == b"\x89PNG"
    # the baseline is not touched by a failing check
    assert json.loads((tmp_path / "baseline.json").read_text()) == baseline


def test_the_recipe_estimate_is_shown_beside_the_checks_measurement(tiny_fp32, tmp_path):
    """An artifact the automatic recipe calibrated: the check reports the estimate the recipe printed (measured on its
    held-out text) beside its own measurement (on the check's text), in the result, the JSON report and the table."""
    shutil.copytree(tiny_fp32.path, tmp_path / "fp32")
    spec = tmp_path / "check.toml"
    spec.write_text('source = "tiny"\nbaseline = "baseline.json"\n[data]\nmax_tokens = 512\nsteps = 4\nprompts = 1\n'
                    '[[artifacts]]\nname = "fp32"\nbundle = "fp32"\n'
                    '[[artifacts]]\nname = "q"\nprecision = "int8"\nbase = "fp32"\nsamples = 8\nseq_len = 64\n')
    out = CliRunner().invoke(main, ["check", str(spec), "--quiet", "--update-baseline", "--workdir", str(tmp_path / "w"),
                                    "--report", str(tmp_path / "report.json")])
    assert out.exit_code == 0, out.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["recipe_estimates"]) == {"q/onnxruntime"}  # the float artifact has no recipe
    recipe = Bundle(tmp_path / "w" / "q").manifest["calibration"]["recipe"]
    pair, measured = report["recipe_estimates"]["q/onnxruntime"], report["results"]["q/onnxruntime"]
    assert pair["estimated"]["kl_divergence_mean"] == recipe["result"]["kl_divergence_mean"] > 0
    assert pair["estimated"]["data"] == recipe["measured_on"]["data"] != pair["measured"]["data"] == measured["data"]
    assert pair["measured"]["kl_divergence_mean"] == measured["kl_divergence_mean"] > 0
    assert "automatic recipe's estimate" in out.output


def test_an_artifact_missing_from_the_baseline_fails(spec, tmp_path):
    (tmp_path / "baseline.json").write_text(json.dumps({"results": {}}))
    result = check(spec, log=lambda m: None)
    assert not result.passed
    assert [f.note for f in result.regressions] == ["not in the baseline; run with --update-baseline"]


def test_regression_limits_move_in_the_bad_direction_only():
    assert limit_for("top1_agreement", 0.97, (0.01, 0.0)) == pytest.approx(0.96)
    assert limit_for("kl_divergence_mean", 0.01, (1e-4, 0.25)) == pytest.approx(0.0125)
    assert limit_for("kl_divergence_mean", 1e-9, (1e-4, 0.25)) == pytest.approx(1e-4 + 1e-9)
    assert limit_for("perplexity_delta_pct", -0.3, (0.1, 0.0)) == pytest.approx(0.4)


@pytest.mark.parametrize("text, message", [
    ('source = "tiny"\n', "lists no \\[\\[artifacts\\]\\]"),
    ('[[artifacts]]\nname = "a"\nprecison = "int8"\n', "unknown keys \\['precison'\\]"),
    ('[[artifacts]]\nname = "a"\nprecision = "int3"\n', "precision 'int3' is not one of"),
    ('[[artifacts]]\nname = "a"\nmethod = "mse"\n', "apply to calibrated artifacts"),
    ('[[artifacts]]\nname = "a"\nbackends = ["tpu"]\n', "backends \\['tpu'\\]"),
    ('[[artifacts]]\nname = "a"\nprecision = "int4"\nbackends = ["torch"]\n', "int4 artifact cannot run on the torch backend"),
    ('[data]\nsamples = 3\n[[artifacts]]\nname = "a"\n', "\\[data\\]: unknown keys"),
    ('[tolerances]\ntop1_agreement = "1%"\n[[artifacts]]\nname = "a"\n', "a number \\(absolute\\) or"),
    ('[tolerances]\ntop1 = 0.01\n[[artifacts]]\nname = "a"\n', "unknown metric 'top1'"),
    ('[[artifacts]]\nname = "a"\ntolerances = { top1 = 0.9 }\n', "unknown tolerance 'top1'"),
    ("source = \n", "not a valid TOML spec"),
    ("artifacts = 5\n", "artifacts must be an array of tables"),
    ('[artifacts]\nname = "a"\n', "artifacts must be an array of tables"),
    ('[[artifacts]]\nname = "a"\n[[artifacts]]\nname = "a"\n', "artifact names \\['a'\\] appear more than once"),
    ('[[artifacts]]\nname = "q"\nprecision = "int8"\nbase = "nope"\n', "base 'nope' is not an artifact"),
    ('[[artifacts]]\nname = "q"\nprecision = "int8"\nmethod = "bogus"\n', "method 'bogus' is not one of"),
    ('[[artifacts]]\nname = "q"\nbundle = "missing-dir"\n', "bundle .*missing-dir does not exist"),
    ('[data]\nsteps = -3\n[[artifacts]]\nname = "a"\n', "steps must be a positive integer"),
    ('[[artifacts]]\nname = "q"\nprecision = "int8"\nblock_size = 64\n', "block_size applies to the weight-only"),
])
def test_malformed_specs_are_refused(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(KvforgeError, match=message):
        load_spec(path)


def test_a_spec_takes_weight_only_int8_and_per_token_activations(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[[artifacts]]\nname = "w8"\nprecision = "int8"\nweights_only = true\nblock_size = 64\n'
                    '[[artifacts]]\nname = "pt"\nprecision = "int8"\nactivations = "per-token"\nrecipe = "fixed"\n')
    calibrate = {a.name: a.calibrate for a in load_spec(path).artifacts}
    assert calibrate == {"w8": {"weights_only": True, "block_size": 64},
                         "pt": {"activations": "per-token", "recipe": "fixed"}}


def test_a_missing_baseline_is_an_error_not_a_pass(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[[artifacts]]\nname = "fp32"\n')
    with pytest.raises(KvforgeError, match="no baseline at .*--update-baseline"):
        check(path, log=lambda m: None)


@pytest.mark.parametrize("spec_file", sorted((Path(__file__).parents[2] / "checks").glob("*.toml")), ids=lambda p: p.stem)
def test_every_committed_spec_loads_and_its_baseline_holds_each_artifact(spec_file):
    """A committed check (checks/*.toml) runs in someone's CI: its spec must load and its committed baseline must
    hold a result for every artifact it makes, else that check fails on its first run."""
    loaded = load_spec(spec_file)
    baseline = json.loads(loaded.baseline.read_text())
    assert baseline["spec"] == spec_file.name
    assert {key.split("/")[0] for key in baseline["results"]} == {a.name for a in loaded.artifacts}
