"""Bundles that other runtimes open as they are: ONNX Runtime GenAI, Hugging Face Optimum, Polygraphy.

GenAI is in the test extra. Optimum's ONNX Runtime models (optimum-onnx) need transformers < 4.58,
older than the one kvforge tests against, so they run in a side environment made once (a venv over
this one, with those two installed) and cached under $KVFORGE_CACHE; where it cannot be made (no
package index), the Optimum test skips and says why.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

from kvforge import runtime
from kvforge.calibration import calibrate
from kvforge.ecosystem import GENAI_CONFIG, HF_CONFIG

PROMPT = "def fibonacci(n):\n    if n"
NEW_TOKENS = 32
OPTIMUM_REQUIREMENTS = ["transformers>=4.45,<4.58", "optimum-onnx[onnxruntime]==0.1.0"]


@pytest.fixture(scope="module")
def tiny_int4(tiny_fp32, tmp_path_factory):
    return calibrate(tiny_fp32.path, tmp_path_factory.mktemp("eco") / "int4", recipe="fixed", precision="int4", block_size=128)


def _kvforge_greedy(path, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    with runtime.load(path) as s:
        return s.generate(prompt, max_new_tokens=n, ignore_eos=True).tokens


def _genai_greedy(path, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (the test extra has it)")
    model = og.Model(str(path))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, min_length=len(prompt) + n, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)][len(prompt):]


def _prompt(bundle) -> list[int]:
    with runtime.load(bundle.path) as s:
        return s.encode(PROMPT) if s.tokenizer is not None else [5, 77, 123, 9, 250, 31]


@pytest.mark.parametrize("which", ["tiny-fp32", "tiny-int4", "hf-llama"])
def test_genai_generates_what_kvforge_generates(tiny_fp32, tiny_int4, hf_bundle, which):
    bundle = {"tiny-fp32": tiny_fp32, "tiny-int4": tiny_int4, "hf-llama": hf_bundle("llama")}[which]
    assert bundle.manifest["ecosystem"]["onnxruntime_genai"] == {"config": GENAI_CONFIG, "reason": None}
    assert GENAI_CONFIG in bundle.manifest["files"]  # recorded with its hash like every file
    prompt = _prompt(bundle)
    ours = _kvforge_greedy(bundle.path, prompt)
    assert _genai_greedy(bundle.path, prompt) == ours and len(set(ours)) > 3


@pytest.mark.parametrize("which", ["tiny-fp32", "tiny-int4"])
def test_every_runtime_tokenizes_the_bundle_as_kvforge_does(tiny_fp32, tiny_int4, which):
    """The bundle's tokenizer files say that encoding adds the BOS (tokenizer_config.json's add_bos_token and a
    fast-tokenizer class, beside tokenizer.json's post-processor): transformers' AutoTokenizer and GenAI's
    tokenizer read the same ids kvforge does."""
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (the test extra has it)")
    transformers = pytest.importorskip("transformers")
    bundle = tiny_fp32 if which == "tiny-fp32" else tiny_int4
    with runtime.load(bundle.path) as s:
        ours, plain, bos = s.encode(PROMPT), s.tokenizer.encode(PROMPT, add_special_tokens=False), s.tokenizer.bos_token_id
    assert ours == [bos] + plain  # tiny's tokenizer puts the BOS first
    assert transformers.AutoTokenizer.from_pretrained(str(bundle.path))(PROMPT)["input_ids"] == ours
    tokenizer = og.Tokenizer(og.Model(str(bundle.path)))
    assert list(tokenizer.encode(PROMPT)) == plain  # GenAI's default adds none (its chat templates write them)
    tokenizer.update_options(add_special_tokens="true")
    assert list(tokenizer.encode(PROMPT)) == ours and tokenizer.decode(ours) == PROMPT


def test_genai_config_settings_that_keep_its_numbers_right(micro_bundle, tmp_path):
    """A capped (windowed) cache GenAI cannot feed: no config, and the manifest says why. FP8 asks GenAI for basic
    optimizations: at the extended level ONNX Runtime deletes a ReLU before an FP8 QuantizeLinear."""
    windowed = micro_bundle("gemma-micro")
    assert not (windowed.path / GENAI_CONFIG).exists()
    assert "capped caches" in windowed.manifest["ecosystem"]["onnxruntime_genai"]["reason"]
    fp8 = calibrate(micro_bundle("classic-micro").path, tmp_path / "fp8", precision="fp8", random_data=True, samples=8, seq_len=32)
    config = json.loads((fp8.path / GENAI_CONFIG).read_text())
    assert config["model"]["decoder"]["session_options"]["graph_optimization_level"] == "ORT_ENABLE_BASIC"
    prompt = [5, 77, 123, 9, 250, 31]
    assert _genai_greedy(fp8.path, prompt) == _kvforge_greedy(fp8.path, prompt)


# -- Optimum, in a side environment ------------------------------------------------------------------
@pytest.fixture(scope="session")
def optimum_python():
    """A Python that has optimum-onnx (and the transformers it needs) over this environment's packages.

    The side environment reads this one's site-packages through a .pth file, after its own: `venv
    --system-site-packages` would show it the base interpreter's packages instead (a virtual environment's are not
    the system's), and pip then installed a second Torch, with CUDA, 5.5 GB, into every test run's cache."""
    import sysconfig

    from kvforge.cache import cache_root

    key = hashlib.sha256(json.dumps([sys.prefix, sys.version, OPTIMUM_REQUIREMENTS]).encode()).hexdigest()[:12]
    env = cache_root() / f"optimum-env-{key}"
    python = env / "bin" / "python"
    if not (env / "ready").is_file():
        made = subprocess.run([sys.executable, "-m", "venv", str(env)], capture_output=True, text=True, timeout=300)
        if made.returncode == 0:
            ours = dict.fromkeys(sysconfig.get_paths()[name] for name in ("purelib", "platlib"))
            theirs = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                    capture_output=True, text=True, check=True).stdout.strip()
            Path(theirs, "outer-environment.pth").write_text(
                "import site; " + "; ".join(f"site.addsitedir({path!r})" for path in ours) + "\n")
            made = subprocess.run([str(python), "-m", "pip", "install", "-q", *OPTIMUM_REQUIREMENTS],
                                  capture_output=True, text=True, timeout=900)
        if made.returncode != 0:
            pytest.skip(f"cannot make a side environment with {OPTIMUM_REQUIREMENTS}: {made.stderr.strip()[-300:]}")
        (env / "ready").write_text("ok\n")
    return python


def _optimum_greedy(python: Path, path, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    script = textwrap.dedent(f"""
        import json, torch
        from optimum.onnxruntime import ORTModelForCausalLM
        model = ORTModelForCausalLM.from_pretrained({str(path)!r}, use_cache=True, use_io_binding=False)
        out = model.generate(torch.tensor([{prompt!r}]), max_new_tokens={n}, min_new_tokens={n}, do_sample=False)
        print(json.dumps(out[0, {len(prompt)}:].tolist()))
    """)
    done = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny-fp32", "hf-llama"])
def test_optimum_generates_what_kvforge_generates(optimum_python, tiny_fp32, hf_bundle, which):
    bundle = tiny_fp32 if which == "tiny-fp32" else hf_bundle("llama")
    record = bundle.manifest["ecosystem"]["optimum"]
    assert record["config"] == HF_CONFIG and record["model_type"] == "llama"
    assert record["from"] == ("kvforge (a Llama config)" if which == "tiny-fp32" else "the source checkpoint")
    prompt = _prompt(bundle)
    assert _optimum_greedy(optimum_python, bundle.path, prompt) == _kvforge_greedy(bundle.path, prompt)


def test_optimum_files_only_where_a_config_expresses_the_model(micro_bundle):
    record = micro_bundle("gemma-micro").manifest["ecosystem"]["optimum"]
    assert record["config"] is None and "no Llama config expresses this design" in record["reason"]
    assert not (micro_bundle("gemma-micro").path / HF_CONFIG).exists()


# -- Polygraphy ----------------------------------------------------------------------------------------
def test_polygraphy_runs_the_graph_at_the_shapes_the_dry_run_prints(tiny_fp32, tmp_path):
    """`polygraphy run model.onnx --onnxrt` on the decode profile's opt shapes (from `kvforge build --dry-run
    --json`), with real inputs: its outputs are the Torch reference's."""
    import torch
    from polygraphy.json import load_json, save_json

    from kvforge.export.onnx_export import FlatKVModel
    from kvforge.model_defs import load

    plan = json.loads(subprocess.run(["kvforge", "build", str(tiny_fp32.path), "--dry-run", "--json", "--max-context", "64",
                                      "--opt-context", "16"], capture_output=True, text=True, check=True).stdout)
    shapes = {name: box["opt"] for name, box in plan["profiles"][1]["shapes"].items()}  # decode: 1 token over 15
    rng = np.random.default_rng(0)
    past = shapes["attention_mask"][1] - 1
    feeds = {
        "input_ids": rng.integers(0, 4096, shapes["input_ids"], dtype=np.int64),
        "attention_mask": np.ones(shapes["attention_mask"], np.int64),
        "position_ids": np.full(shapes["position_ids"], past, np.int64),
        **{n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items() if n.startswith("past_key_values")},
    }
    save_json([feeds], str(tmp_path / "inputs.json"))
    done = subprocess.run(["polygraphy", "run", str(tiny_fp32.graph_file), "--onnxrt", "--load-inputs", str(tmp_path / "inputs.json"),
                           "--save-outputs", str(tmp_path / "outputs.json"),
                           "--input-shapes", *[f"{n}:{list(s)}".replace(" ", "") for n, s in shapes.items()]],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "PASSED" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    outputs = load_json(str(tmp_path / "outputs.json"))[0][1][0]  # runner results: [(runner, [iteration outputs])]
    model, _ = load("tiny")
    with torch.no_grad():
        reference = FlatKVModel(model)(*(torch.from_numpy(a) for a in feeds.values()))
    np.testing.assert_allclose(outputs["logits"], reference[0].numpy(), atol=1e-4, rtol=0)
    np.testing.assert_allclose(outputs["present.3.value"], reference[-1].numpy(), atol=1e-4, rtol=0)
    assert outputs["present.0.key"].shape == (1, 4, past + 1, 32)


def test_initializers_carry_module_names(tiny_fp32, tiny_int4):
    """No exporter placeholder names (val_123): linear weights are named after their module, as in the model."""
    for bundle in (tiny_fp32, tiny_int4):
        graph = onnx.load(str(bundle.graph_file), load_external_data=False).graph
        names = {i.name for i in graph.initializer}
        assert not [n for n in names if n.startswith("val_")]
        weights = {n.input[1] for n in graph.node if n.op_type == "MatMul" and n.input[1] in names}
        if bundle is tiny_fp32:
            assert "model.layers.0.attn.q_proj.weight" in weights and "model.layers.3.ffn.down_proj.weight" in weights
        else:
            assert "layers.0.attn.q_proj.weight_quantized" in names
