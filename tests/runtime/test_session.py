"""The runtime Session: one contract over every backend, generation, validation, threads."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from kvforge import runtime
from kvforge.errors import KvforgeError
from kvforge.export import export
from kvforge.model_defs import load as load_model
from kvforge.model_defs.evaluate import greedy_continuation

from ..conftest import HF_FAMILIES, make_hf_model, second_sweep

PROMPT = "def fibonacci(n):\n    if n"


@pytest.fixture(scope="module")
def tiny_bundle(tiny_fp32):
    return tiny_fp32.path


@pytest.fixture(scope="module")
def mistral_bundle(micro_bundle):
    return micro_bundle("mistral-micro").path


# -- the contract, over every available backend ------------------------------------
@pytest.mark.parametrize("backend", runtime.available_backends())
def test_backend_contract(tiny_bundle, backend):
    """Every backend: same interface, same shapes and dtypes, same numbers as the Torch reference."""
    model, tok = load_model("tiny")
    with runtime.load(tiny_bundle, backend=backend) as s:
        assert s.backend_name == backend and s.vocab_size == 4096 and s.max_context == 1024
        ids = np.array([tok.encode(PROMPT)], np.int64)
        logits, cache = s.forward(ids)
        assert logits.dtype == np.float32 and logits.shape == (1, ids.shape[1], 4096)
        assert cache.length == ids.shape[1] and cache.batch == 1
        step, cache2 = s.forward(np.array([[42]], np.int64), cache=cache)
        assert step.shape == (1, 1, 4096) and cache2.length == ids.shape[1] + 1
        arrays = s.backend.cache_arrays(cache2)
        assert len(arrays) == 2 * model.config.n_layers
        assert arrays[0].shape == (1, 4, ids.shape[1] + 1, 32)
        with torch.no_grad():
            ref, _ = model(torch.from_numpy(ids))
            ref_step, _ = model(torch.tensor([[42]]), past_key_values=model(torch.from_numpy(ids))[1])
        np.testing.assert_allclose(logits, ref.numpy(), atol=1e-4, rtol=0)
        np.testing.assert_allclose(step, ref_step.numpy(), atol=1e-4, rtol=0)
        result = s.generate(PROMPT, max_new_tokens=24)
        assert result.tokens == greedy_continuation(model, tok.encode(PROMPT), 24)
        assert result.text == tok.decode(result.tokens) and result.finish_reason == "length"
        assert result.prompt_tokens == ids.shape[1]


def test_onnxruntime_path_imports_no_torch(tiny_bundle):
    code = f"""
import sys
from kvforge import runtime
with runtime.load({str(tiny_bundle)!r}) as s:
    out = s.generate("def f(x):", max_new_tokens=5)
assert len(out.tokens) == 5, out
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.") or m.startswith("kvforge.model_defs")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.slow  # reads the slow tier's exports of every family (tests/export/test_export.py)
@pytest.mark.parametrize("family", second_sweep(HF_FAMILIES))
def test_greedy_matches_torch_reference_and_transformers_generate(hf_bundle, hf_checkpoint, family):
    bundle = hf_bundle(family).path
    hf_model = make_hf_model(family)
    prompt = [5, 77, 123, 9, 250, 31]
    with runtime.load(bundle) as s:
        ours = s.generate(prompt, max_new_tokens=20, ignore_eos=True).tokens
    model, _ = load_model(hf_checkpoint(family))
    assert ours == greedy_continuation(model, prompt, 20)[: len(ours)]
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == hf[0, len(prompt):].tolist()


def test_generation_config_eos_stops_generation_as_in_transformers(tmp_path):
    """generation_config.json's eos_token_id is what transformers' generate stops on; so does the runtime."""
    import transformers

    make_hf_model("llama").save_pretrained(tmp_path)
    prompt = [5, 77, 123, 9, 250, 31]
    with runtime.load(tmp_path) as s:
        free = s.generate(prompt, max_new_tokens=12, ignore_eos=True).tokens
    stop = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])  # first new token from the 4th on
    config_eos = json.loads((tmp_path / "config.json").read_text()).get("eos_token_id")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [config_eos, stop], "do_sample": False}))
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        hf = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, pad_token_id=0)[0, len(prompt):].tolist()
    with runtime.load(tmp_path) as s:
        ours = s.generate(prompt, max_new_tokens=12)
    first_stop = next(i for i, t in enumerate(free) if t in (config_eos, stop))
    assert ours.tokens == hf == free[: first_stop + 1] and ours.finish_reason == "stop"


# -- generation ---------------------------------------------------------------------
def test_batched_left_padded_generation_equals_each_prompt_alone(mistral_bundle):
    prompts = [[10, 20, 30, 40, 50, 60, 70, 80, 90], [5, 6], [200, 100, 50, 25]]
    with runtime.load(mistral_bundle) as s:
        batched = s.generate(prompts, max_new_tokens=12, ignore_eos=True)
        alone = [s.generate(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
    assert [r.tokens for r in batched] == [r.tokens for r in alone]


@pytest.fixture(scope="module")
def short_context(tmp_path_factory):
    """Exports with a max context of 16, past the window (8) of every windowed layer."""
    cache = {}

    def make(preset):
        if preset not in cache:
            cache[preset] = export(preset, tmp_path_factory.mktemp("ctx") / preset, max_context=16).path
        return cache[preset]
    return make


# mistral-micro: every layer windowed (8); gemma-micro: windowed (8) and full layers alternate, so dropping
# padding columns shortens the full layers' caches and only those capped ones that hold more than remains
@pytest.mark.parametrize("preset", ["mistral-micro", "gemma-micro"])
@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_a_batch_at_the_context_limit_gives_each_row_its_own_length(short_context, backend, preset):
    """A short prompt batched with one near the max context is not cut short by the other's padding."""
    bundle = short_context(preset)
    prompts = [list(range(20, 34)), [7, 8, 9]]  # 14 and 3 tokens
    with runtime.load(bundle, backend=backend) as s:
        batched = s.generate(prompts, max_new_tokens=10, ignore_eos=True)
        alone = [s.generate(p, max_new_tokens=10, ignore_eos=True) for p in prompts]
        streamed = list(s.stream(prompts[0], max_new_tokens=10, ignore_eos=True))
    assert [(r.tokens, r.finish_reason) for r in batched] == [(r.tokens, r.finish_reason) for r in alone]
    assert [len(r.tokens) for r in batched] == [2, 10] and [r.finish_reason for r in batched] == ["context", "length"]
    assert [e.token for e in streamed] == alone[0].tokens and streamed[-1].finish_reason == "context"


def test_windowed_layers_keep_capped_caches_over_four_windows(micro_bundle):
    """gemma-micro (window 8 on layers 0 and 2, full attention on 1 and 3) generates 4 x 8 tokens: at every
    step a windowed layer's cache holds min(length, 8) positions and a full layer's all of them, and the
    tokens are the Torch reference's."""
    bundle = micro_bundle("gemma-micro")
    window, prompt = 8, [5, 77, 123, 9, 250]
    assert bundle.io.windows == [window, None, window, None]
    with runtime.load(bundle.path) as s:
        logits, cache = s.forward(np.array([prompt], np.int64), last_logits_only=True)
        tokens = []
        for _ in range(4 * window):
            tokens.append(int(logits[0, -1].argmax()))
            logits, cache = s.forward(np.array([[tokens[-1]]], np.int64), cache=cache, last_logits_only=True)
            held = [a.shape[2] for a in s.backend.cache_arrays(cache)]
            n = cache.length
            assert held == [min(n, window)] * 2 + [n] * 2 + [min(n, window)] * 2 + [n] * 2, (n, held)
        assert cache.length == len(prompt) + 4 * window
        generated = s.generate(prompt, max_new_tokens=4 * window, ignore_eos=True).tokens
    model, _ = load_model("gemma-micro")
    assert tokens == generated == greedy_continuation(model, prompt, 4 * window)


def test_sampling_is_seeded_and_its_limits_hold(tiny_bundle):
    with runtime.load(tiny_bundle) as s:
        kw = dict(max_new_tokens=16, temperature=1.0, seed=7)
        a, b = s.generate(PROMPT, **kw), s.generate(PROMPT, **kw)
        c = s.generate(PROMPT, **{**kw, "seed": 8})
        assert a.tokens == b.tokens and a.tokens != c.tokens
        greedy = s.generate(PROMPT, max_new_tokens=16)
        assert s.generate(PROMPT, max_new_tokens=16, temperature=1.0, top_k=1, seed=3).tokens == greedy.tokens
        assert s.generate(PROMPT, max_new_tokens=16, temperature=1.0, top_p=1e-6, seed=3).tokens == greedy.tokens


def test_repetition_penalty_discourages_repeats(tiny_bundle):
    with runtime.load(tiny_bundle) as s:
        plain = s.generate("import os\nimport", max_new_tokens=40)
        penalized = s.generate("import os\nimport", max_new_tokens=40, repetition_penalty=1.8)
    distinct = lambda t: len(set(t)) / len(t)  # noqa: E731
    assert distinct(penalized.tokens) > distinct(plain.tokens)


def test_stop_tokens_and_max_context(tiny_bundle, mistral_bundle):
    with runtime.load(tiny_bundle) as s:
        free = s.generate(PROMPT, max_new_tokens=10)
        stop_at = free.tokens[3]
        stopped = s.generate(PROMPT, max_new_tokens=10, stop_token_ids=[stop_at])
        assert stopped.tokens == free.tokens[: free.tokens.index(stop_at) + 1] and stopped.finish_reason == "stop"
    with runtime.load(mistral_bundle) as s:  # max context 256
        out = s.generate([1] * 250, max_new_tokens=20, ignore_eos=True)
        assert len(out.tokens) == 6 and out.finish_reason == "context"


def test_stream_yields_the_same_tokens_and_text(tiny_bundle):
    with runtime.load(tiny_bundle) as s:
        full = s.generate(PROMPT, max_new_tokens=20)
        events = list(s.stream(PROMPT, max_new_tokens=20))
    assert [e.token for e in events] == full.tokens
    assert "".join(e.text for e in events) == full.text
    assert events[-1].last and not any(e.last for e in events[:-1])


def test_stream_never_splits_a_utf8_character():
    """Byte-level tokens: each multi-byte character arrives over several tokens; text waits for all of them."""
    from kvforge.runtime.generate import TextStream
    from kvforge.tokenizer import Tokenizer

    text = "naïve → 🙂 done"
    tokens = list(text.encode())
    stream = TextStream(Tokenizer.byte_level())
    deltas = [stream.push(t, last=i == len(tokens) - 1) for i, t in enumerate(tokens)]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[tokens.index(0xF0)] == ""  # the emoji's first byte alone releases nothing


# -- validation -----------------------------------------------------------------
def test_inputs_are_validated_against_the_io_spec(mistral_bundle):
    with runtime.load(mistral_bundle) as s:
        with pytest.raises(KvforgeError, match="input_ids must be int64 .* got int32"):
            s.forward(np.zeros((1, 3), np.int32))
        with pytest.raises(KvforgeError, match=r"must have 2 dimensions \[batch, seq\], got shape \(3,\)"):
            s.forward(np.zeros(3, np.int64))
        with pytest.raises(KvforgeError, match=r"token ids \[259, 1000\] are outside the vocabulary \(0..258\)"):
            s.forward(np.array([[1, 259, 1000]], np.int64))
        with pytest.raises(KvforgeError, match=r"attention_mask must have shape \(1, 3\)"):
            s.forward(np.zeros((1, 3), np.int64), attention_mask=np.ones((1, 5), np.int64))
        with pytest.raises(KvforgeError, match="exceeds the bundle's maximum of 256"):
            s.forward(np.zeros((1, 257), np.int64))
        _, cache = s.forward(np.zeros((2, 3), np.int64))
        with pytest.raises(KvforgeError, match="the cache holds 2 rows but input_ids has 1"):
            s.forward(np.zeros((1, 1), np.int64), cache=cache)
        with pytest.raises(KvforgeError, match="prompt token ids \\[300\\] are outside"):
            s.generate([1, 300])
        with pytest.raises(KvforgeError, match="top_p must be in"):
            s.generate([1, 2], top_p=0.0)
        with pytest.raises(KvforgeError, match="a prompt of 300 tokens exceeds"):
            s.generate([1] * 300)


def test_bad_bundles_and_backends(tmp_path, mistral_bundle):
    with pytest.raises(KvforgeError, match="unknown backend 'tensorflow'"):
        runtime.load(mistral_bundle, backend="tensorflow")
    with pytest.raises(KvforgeError, match="not a bundle; export it first"):
        runtime.load("tiny", backend="onnxruntime")
    import shutil

    broken = shutil.copytree(mistral_bundle, tmp_path / "broken")
    (broken / "model.onnx").write_bytes(b"garbage")
    with pytest.raises(KvforgeError, match="is damaged: model.onnx has 7 bytes, the manifest says"):
        runtime.load(broken).activate()
    with pytest.raises(KvforgeError, match="is damaged: model.onnx has 7 bytes"):  # checked on opening, variant or not
        runtime.load(broken, variant=False).activate()


def test_backend_options_are_checked_and_source_reaches_the_torch_backend(mistral_bundle):
    for options, message in [
        (dict(threeads=2), r"unknown onnxruntime backend option\(s\) \['threeads'\]; it takes: device, threads"),
        (dict(device="gpu"), "onnxruntime device 'gpu' is not one of"),
        (dict(optimization="max"), "optimization 'max' is not one of"),
        (dict(threads=0), "threads must be a positive int"),
    ]:
        with pytest.raises(KvforgeError, match=message):
            runtime.load(mistral_bundle, **options)
    with pytest.raises(KvforgeError, match="torch device 'tpu' is not"):
        runtime.load(mistral_bundle, backend="torch", device="tpu")
    ids = np.array([[3, 1, 4, 1, 5]], np.int64)
    with runtime.load(mistral_bundle, backend="torch", source="mistral-micro") as ref, runtime.load(mistral_bundle) as ort:
        np.testing.assert_allclose(ort.forward(ids)[0], ref.forward(ids)[0], atol=1e-4, rtol=0)


def test_a_cache_continues_only_the_model_that_made_it(micro_bundle, mistral_bundle):
    """Same shapes, another model: refused, not silently wrong; another session of the same bundle: accepted."""
    other = micro_bundle("llama3-micro").path  # the same cache shapes as mistral-micro
    ids = np.array([[3, 1, 4, 1, 5]], np.int64)
    with runtime.load(mistral_bundle) as a, runtime.load(mistral_bundle) as b, runtime.load(other) as c:
        _, cache = a.forward(ids)
        with pytest.raises(KvforgeError, match="made by a session of another model"):
            c.forward(np.array([[2]], np.int64), cache=cache)
        step_a, _ = a.forward(np.array([[2]], np.int64), cache=cache)
        step_b, _ = b.forward(np.array([[2]], np.int64), cache=cache)
        np.testing.assert_array_equal(step_a, step_b)


def test_generation_options_are_checked(mistral_bundle):
    with runtime.load(mistral_bundle) as s:
        for options, message in [
            (dict(stop_token_ids=5), "stop_token_ids takes a list"),
            (dict(stop_token_ids=["a"]), "stop_token_ids must be token ids"),
            (dict(stop_token_ids=[10**6]), r"stop_token_ids \[1000000\] are outside the vocabulary"),
            (dict(top_k=2.5), "top_k must be an int"),
            (dict(max_new_tokens=2.5), "max_new_tokens must be an int"),
            (dict(max_new_tokens=None), "max_new_tokens must be an int"),
            (dict(seed="x"), "seed must be an int >= 0 or None"),
            (dict(temperature="hot"), "temperature must be a number"),
            (dict(max_tokens=3), r"unknown generation option\(s\) \['max_tokens'\]"),
        ]:
            with pytest.raises(KvforgeError, match=message):
                s.generate("abc", **options)
        greedy = s.generate("abc", max_new_tokens=6).tokens
        assert s.generate("abc", max_new_tokens=6, temperature=1e-300, seed=1).tokens == greedy  # no overflow to NaN


def test_seeded_sampling_in_a_batch_gives_each_row_what_it_samples_alone(mistral_bundle):
    prompts = ["abc", "hello there", "abc"]
    kw = dict(max_new_tokens=10, temperature=0.9, seed=5, ignore_eos=True)
    with runtime.load(mistral_bundle) as s:
        batched = [r.tokens for r in s.generate(prompts, **kw)]
        alone = [s.generate(p, **kw).tokens for p in prompts]
    assert batched == alone and batched[0] == batched[2]


def test_a_session_shared_by_threads_gives_each_the_result_it_gets_alone(mistral_bundle):
    prompts = [[i + 1, 2 * i + 3, 7] for i in range(6)]
    with runtime.load(mistral_bundle) as s:
        expected = [s.generate(p, max_new_tokens=8, ignore_eos=True).tokens for p in prompts]
        got = [None] * len(prompts)

        def work(i):
            got[i] = s.generate(prompts[i], max_new_tokens=8, ignore_eos=True).tokens

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert got == expected


def test_torch_backend_refuses_a_quantized_bundle(tiny_int8):
    """The torch backend rebuilds the float model a bundle came from: for a quantized bundle that would be a false reference."""
    with pytest.raises(KvforgeError, match=r"is quantized \(int8\); the torch backend would run the float model"):
        runtime.load(tiny_int8.path, backend="torch")


def test_torch_backend_on_a_model_source_needs_no_bundle():
    with runtime.load("llama3-micro") as s:
        assert s.backend_name == "torch"
        out = s.generate([3, 4, 5], max_new_tokens=6, ignore_eos=True)
    model, _ = load_model("llama3-micro")
    assert out.tokens == greedy_continuation(model, [3, 4, 5], 6)


def test_generate_cli_json_and_bench(tiny_bundle):
    from click.testing import CliRunner

    from kvforge.cli import main

    r = CliRunner().invoke(main, ["generate", str(tiny_bundle), "--prompt", PROMPT, "--max-new-tokens", "12", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output.strip().splitlines()[-1])
    model, tok = load_model("tiny")
    assert data["tokens"] == greedy_continuation(model, tok.encode(PROMPT), 12)
    assert data["text"] == tok.decode(data["tokens"])
    b = CliRunner().invoke(main, ["bench", str(tiny_bundle), "--prompt-len", "16", "--new-tokens", "8", "--runs", "2", "--json"])
    assert b.exit_code == 0, b.output
    res = json.loads(b.output.strip().splitlines()[-1])
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "ttft_ms", "peak_rss_mb"):
        assert res[key] > 0


def test_ort_variant_is_exact_and_slices_logits(tiny_bundle):
    """The ORT-specific variant (fused sibling MatMuls, num_logits_to_keep) computes the bundle graph's function."""
    import onnx

    from kvforge.bundle import Bundle
    from kvforge.runtime.ort.variant import KEEP_INPUT, variant_path

    path = variant_path(Bundle(tiny_bundle))
    graph = onnx.load(str(path), load_external_data=False).graph
    assert KEEP_INPUT in [i.name for i in graph.input]
    assert sum(n.op_type == "MatMul" and n.name.endswith("_siblings") for n in graph.node) == 2 * 4  # qkv + gate/up per layer
    ids = np.random.default_rng(0).integers(0, 4096, (2, 9), dtype=np.int64)
    with runtime.load(tiny_bundle, variant=False) as plain, runtime.load(tiny_bundle) as fast:
        a, ca = plain.forward(ids)
        b, cb = fast.forward(ids)
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
        last, _ = fast.forward(ids, last_logits_only=True)
        assert last.shape == (2, 1, 4096)
        np.testing.assert_allclose(last[:, 0], a[:, -1], atol=1e-5, rtol=0)
        for x, y in zip(plain.backend.cache_arrays(ca), fast.backend.cache_arrays(cb)):
            np.testing.assert_allclose(y, x, atol=1e-5, rtol=0)
    assert variant_path(Bundle(tiny_bundle)) == path  # built once, then cached


@pytest.mark.slow
def test_float16_bundles_and_their_int8_calibration_run(half_bundle, tmp_path):
    """Half-precision graphs cast logits to float32 after the vocabulary projection; the runtime handles it."""
    from kvforge.calibration import calibrate

    fp16 = half_bundle("tiny", "float16")
    model, tok = load_model("tiny")
    reference = greedy_continuation(model, tok.encode(PROMPT), 16)
    with runtime.load(fp16.path) as s:
        out = s.generate(PROMPT, max_new_tokens=16)
        full, _ = s.forward(np.array([tok.encode(PROMPT)]))
        last, _ = s.forward(np.array([tok.encode(PROMPT)]), last_logits_only=True)
    np.testing.assert_allclose(last[:, 0], full[:, -1], atol=1e-3, rtol=0)
    assert sum(a == b for a, b in zip(out.tokens, reference)) >= 14
    q = calibrate(fp16.path, tmp_path / "int8", precision="int8", samples=16, seq_len=128)
    with runtime.load(q.path) as s:
        assert len(s.generate(PROMPT, max_new_tokens=8).tokens) == 8
