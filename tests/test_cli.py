"""The CLI is a thin layer: commands exist, print what they did, and fail with one clear line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvforge.cli import main


@pytest.fixture
def run():
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(main, [str(a) for a in args], catch_exceptions=False)

    return invoke


def test_help_lists_the_commands(run):
    out = run("--help")
    assert out.exit_code == 0
    for command in ("models", "eval", "export", "lint", "inspect"):
        assert f"  {command}" in out.output


def test_models_json(run):
    out = run("models", "--json")
    data = json.loads(out.output)
    assert {"tiny", "llama-125m", "mistral-micro"} <= {p["name"] for p in data["presets"]}
    assert data["hf_families"] == ["gpt2", "llama", "mistral", "qwen2"]


def test_export_inspect_lint_and_refusals(run, tmp_path):
    out_dir = tmp_path / "b"
    result = run("export", "gpt2-micro", "-o", out_dir, "--quiet")
    assert result.exit_code == 0, result.output
    assert "validation passed" in result.output and "lint passed" in result.output
    shown = run("inspect", out_dir)
    assert "past_key_values.1.value" in shown.output and "total_sequence_length" in shown.output
    assert "validation: passed" in shown.output
    manifest = json.loads(run("inspect", out_dir, "--json").output)
    assert manifest["precision"]["dtype"] == "float32"
    assert run("lint", out_dir).exit_code == 0
    assert run("lint", out_dir / "model.onnx", "--json").exit_code == 0

    again = run("export", "gpt2-micro", "-o", out_dir, "--quiet")
    assert again.exit_code == 1 and "already exists; pass --force" in again.output


def test_errors_are_one_line_with_status_1(run, tmp_path):
    result = run("export", "no-such-model", "-o", tmp_path / "x", "--quiet")
    assert result.exit_code == 1
    assert result.output.strip().startswith("error: unknown model source 'no-such-model'")
    assert "Traceback" not in result.output
    assert not (tmp_path / "x").exists()
    bad = run("inspect", tmp_path)
    assert bad.exit_code == 1 and "no kvforge.json" in bad.output


def test_eval_on_a_text_file(run, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 40)
    result = run("eval", "llama3-micro", "--data", corpus, "--seq-len", "64", "--max-new-tokens", "4", "--json")
    data = json.loads(result.output)
    assert data["corpus_tokens"] == len(corpus.read_text().encode())  # byte tokenizer, no BOS
    assert 1.0 < data["perplexity"] < 10 * data["uniform_perplexity"]
    missing = run("eval", "llama3-micro", "--data", tmp_path / "nope.txt")
    assert missing.exit_code == 1 and "no such file" in missing.output


def test_calibrate_gptq_from_the_command_line(run, tmp_path, tiny_fp32):
    out = run("calibrate", tiny_fp32.path, "-o", tmp_path / "q", "--precision", "int4", "--gptq",
              "--samples", "4", "--seq-len", "32", "--quiet")
    assert out.exit_code == 0, out.output
    assert "block-wise weights, GPTQ-rounded" in out.output and "4 x 32 tokens of built-in tiny corpus" in out.output
    manifest = json.loads(run("inspect", tmp_path / "q", "--json").output)
    assert manifest["precision"]["quantization"]["weight_rounding"] == "gptq"
