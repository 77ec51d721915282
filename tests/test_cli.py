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
    arch = {p["name"]: p["architecture"] for p in data["presets"]}
    assert {"tiny", "llama-125m", "mistral-micro"} <= {n for n, a in arch.items() if a == "decoder"}
    assert arch["bert-micro"] == "encoder" and arch["perceiver-micro"] == "perceiver"
    assert arch["t5-micro"] == arch["bart-micro"] == "encoder-decoder" and arch["llava-micro"] == "vision-language"
    assert set(data["hf_families"]) == {"gpt2", "llama", "mistral", "qwen2", "qwen3", "olmo2", "granite", "cohere", "phi3",
                                        "gemma", "gemma2", "gemma3_text", "gpt_neox", "gptj", "falcon", "bloom",
                                        "bert", "roberta", "t5", "bart", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                                        "llava", "idefics2", "idefics3", "qwen2_vl"}
    design = {p["name"]: p["design"] for p in data["presets"]}
    assert design["gemma-micro"] == ("rope rmsnorm-sandwich gated-gelu_tanh qk-norm=head window=8 on [0, 2] "
                                     "softcap=5.0/3.0 scaled")
    assert design["neox-micro"] == "rope x0.25 layernorm-pre gelu block=parallel_two_norms"
    assert design["perceiver-micro"] == "16 latents absolute positions layernorm-pre gelu head=classification"
    assert design["llava-micro"] == ("vit 30px/10 2 layers -> 9 image tokens, mlp projector; decoder: rope "
                                     "rmsnorm-pre gated-silu")


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
    out = run("calibrate", tiny_fp32.path, "-o", tmp_path / "q", "--precision", "int4", "--recipe", "fixed",
              "--gptq", "--samples", "4", "--seq-len", "32", "--quiet")
    assert out.exit_code == 0, out.output
    assert "block-wise weights, GPTQ-rounded" in out.output and "4 x 32 tokens of built-in tiny corpus" in out.output
    manifest = json.loads(run("inspect", tmp_path / "q", "--json").output)
    assert manifest["precision"]["quantization"]["weight_rounding"] == "gptq"


def test_a_bundle_for_onnx_runtime_only_says_so_instead_of_failing_its_tensorrt_lint(run, tmp_path, tiny_fp32):
    """Per-token activations (the automatic INT8 recipe's usual choice) are a form TensorRT does not take at all:
    calibrate and inspect say the bundle is for ONNX Runtime and why, not "lint FAILED"; `kvforge lint` still
    lists each node TensorRT's parser would refuse (exit 1) and adds why."""
    out = run("calibrate", tiny_fp32.path, "-o", tmp_path / "q", "--precision", "int8", "--recipe", "fixed",
              "--activations", "per-token", "--samples", "2", "--seq-len", "16", "--quiet")
    assert out.exit_code == 0, out.output
    assert "lint: for ONNX Runtime, not TensorRT (this bundle's INT8 activations are scaled per token" in out.output
    assert "lint FAILED" not in out.output and "--activations static for TensorRT" in out.output
    shown = run("inspect", tmp_path / "q")
    assert "lint: for ONNX Runtime, not TensorRT" in shown.output and "(when written)" in shown.output
    linted = run("lint", tmp_path / "q")
    errors = json.loads(run("lint", tmp_path / "q", "--json").output)["errors"]
    assert linted.exit_code == 1 and errors > 0 and f"; {errors} errors" in linted.output
    assert linted.output.splitlines()[-1].startswith("note: this bundle's INT8 activations are scaled per token")
    # a defect any runtime fails (here a node reading what nothing gives) is still a failed lint, named first
    from onnx import TensorProto, helper

    from kvforge.export import lint as lint_graph
    from kvforge.manifest import lint_summary

    broken = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["nowhere"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]), opset_imports=[helper.make_opsetid("", 21)])
    manifest = json.loads((tmp_path / "q" / "kvforge.json").read_text())
    manifest["lint"] = lint_graph(broken)
    said = lint_summary(manifest)
    assert said.startswith("lint FAILED (1 errors") and "which no graph input, initializer or earlier" in said, said


def test_damaged_bundles_are_named_and_force_never_replaces_inputs_or_other_files(run, tmp_path):
    import shutil

    from tests.conftest import make_hf_model

    bundle = tmp_path / "b"
    assert run("export", "gpt2-micro", "-o", bundle, "--quiet").exit_code == 0
    damaged = tmp_path / "damaged"
    shutil.copytree(bundle, damaged)
    graph = (damaged / "model.onnx").read_bytes()
    (damaged / "model.onnx").write_bytes(graph[: len(graph) // 2])
    shown = run("inspect", damaged)
    assert shown.exit_code == 1 and f"model.onnx has {len(graph) // 2} bytes, the manifest says {len(graph)}" in shown.output
    assert run("inspect", bundle).exit_code == 0 and "files: intact" in run("inspect", bundle).output
    calib = run("calibrate", damaged, "-o", tmp_path / "q", "--precision", "int8", "--random-data", "--quiet")
    assert calib.exit_code == 1 and "is damaged: model.onnx has" in calib.output and not (tmp_path / "q").exists()

    # --force replaces bundles only, and never the input it reads
    same = run("calibrate", bundle, "-o", bundle, "--precision", "int8", "--random-data", "--force", "--quiet")
    assert same.exit_code == 1 and "is, or holds, the input" in same.output
    parent = tmp_path / "parent"
    make_hf_model("gpt2").save_pretrained(parent / "child")
    (parent / "notes.txt").write_text("mine")
    for out in (parent, parent / "child"):
        refused = run("export", parent / "child", "-o", out, "--force", "--quiet")
        assert refused.exit_code == 1 and "is, or holds, the input" in refused.output
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    refused = run("export", "gpt2-micro", "-o", other, "--force", "--quiet")
    assert refused.exit_code == 1 and "not a kvforge bundle" in refused.output
    assert (other / "notes.txt").read_text() == (parent / "notes.txt").read_text() == "mine"
    assert (parent / "child" / "config.json").is_file()
    assert run("inspect", bundle).exit_code == 0  # untouched


def test_eval_keeps_to_the_models_context(run, tmp_path):
    """GPT-2 with 16 learned positions: windows shrink to the context; a longer prompt is a clear error."""
    from kvforge.tokenizer import Tokenizer

    from tests.conftest import make_hf_model

    make_hf_model("gpt2", n_positions=16).save_pretrained(tmp_path / "m")
    Tokenizer.byte_level().save(tmp_path / "m")
    corpus = tmp_path / "c.txt"
    corpus.write_text("x = 1\n" * 30)
    result = run("eval", tmp_path / "m", "--data", corpus, "--prompt", "x =", "--max-new-tokens", "20", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert 1.0 < data["perplexity"] < 10 * data["uniform_perplexity"]
    long = run("eval", tmp_path / "m", "--data", corpus, "--prompt", "y" * 40)
    assert long.exit_code == 1 and "the prompt is 41 tokens" in long.output and "takes at most 16" in long.output


def test_tiny_contexts_lint_structure_and_bench_edges(run, tmp_path):
    """--max-context 3 exports (validation fits its grid into 3 positions); lint names a node that reads nothing;
    bench with one new token has no decode rate, and a prompt may fill the context."""
    import onnx

    bundle = tmp_path / "b"
    out = run("export", "classic-micro", "-o", bundle, "--max-context", "3", "--quiet")
    assert out.exit_code == 0 and "validation passed" in out.output, out.output
    gen = json.loads(run("generate", bundle, "--prompt", "ab", "--max-new-tokens", "5", "--json").output.strip().splitlines()[-1])
    assert len(gen["tokens"]) == 1  # BOS + 2 prompt tokens fill 3 positions; one token is chosen, none fed back
    bench = run("bench", bundle, "--prompt-len", "3", "--new-tokens", "1", "--runs", "1", "--json")
    assert bench.exit_code == 0, bench.output
    result = json.loads(bench.output.strip().splitlines()[-1])
    assert result["decode_tokens_per_s"] is None and result["prefill_tokens_per_s"] > 0
    # the backend's settings are recorded with the figures; --accuracy-level 4 is ONNX Runtime's opt-in, and
    # --prefill-accuracy-level 0 runs the prompt at level 0 beside it
    fast = run("bench", bundle, "--prompt-len", "2", "--new-tokens", "1", "--runs", "1", "--accuracy-level", "4",
               "--prefill-accuracy-level", "0", "--json")
    assert fast.exit_code == 0, fast.output
    assert (result["backend_settings"]["accuracy_level"], result["backend_settings"]["prefill_accuracy_level"]) == (0, None)
    settings = json.loads(fast.output.strip().splitlines()[-1])["backend_settings"]
    assert (settings["accuracy_level"], settings["prefill_accuracy_level"]) == (4, 0)
    refused = run("bench", bundle, "--backend", "torch", "--accuracy-level", "4")
    assert refused.exit_code == 1 and "--accuracy-level is an ONNX Runtime setting" in refused.output
    refused = run("bench", bundle, "--backend", "torch", "--prefill-accuracy-level", "4")
    assert refused.exit_code == 1 and "--prefill-accuracy-level is an ONNX Runtime setting" in refused.output
    over = run("bench", bundle, "--prompt-len", "3", "--new-tokens", "2", "--runs", "1")
    assert over.exit_code == 1 and "need 4 positions; the bundle's max context is 3" in over.output

    model = onnx.load(str(bundle / "model.onnx"))
    del model.graph.node[next(i for i, n in enumerate(model.graph.node) if n.op_type == "MatMul")]
    onnx.save(model, str(tmp_path / "broken.onnx"))
    lint = run("lint", tmp_path / "broken.onnx")
    assert lint.exit_code == 1 and "which no graph input, initializer or earlier node provides" in lint.output
