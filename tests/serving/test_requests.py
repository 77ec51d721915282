"""What a generate request may say (no server): checked inputs, stop strings, the repository kvforge writes."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from kvforge import runtime
from kvforge.errors import KvforgeError
from kvforge.serving.kinds import Service
from kvforge.serving.repository import RECORD, repository_model, write_repository
from kvforge.serving.requests import BadRequest, StopText, parse


@pytest.fixture(scope="module")
def tiny(tiny_fp32):
    """The service the Triton model builds over the session (its runner starts with the first request: none here)."""
    with runtime.load(tiny_fp32.path) as session:
        yield Service(session, tiny_fp32.kind)


def _inputs(**kw):
    return {k: np.array([v.encode() if isinstance(v, str) else v]) if not isinstance(v, list) else
            np.array([s.encode() for s in v], dtype=np.object_) for k, v in kw.items()}


def test_a_request_becomes_a_prompt_and_a_config(tiny):
    job = parse(_inputs(text_input="def add(a, b):", max_tokens=np.int32(7), temperature=np.float32(0.5),
                        top_k=np.int32(3), seed=np.int64(9), stop=["\n\n", "return"], stream=True), tiny)
    assert job.prompt == tiny.encode("def add(a, b):") and job.stream and job.stop == ["\n\n", "return"]
    c = job.config
    assert (c.max_new_tokens, c.temperature, c.top_k, c.seed, c.top_p) == (7, 0.5, 3, 9, 1.0)
    default = parse(_inputs(text_input="x"), tiny)
    assert default.config.max_new_tokens == 16 and default.config.temperature == 0 and not default.stream


@pytest.mark.parametrize("inputs, field", [
    (dict(), "text_input is required"),
    (dict(text_input=""), "text_input is required"),
    (dict(text_input="x", max_tokens=0), "max_tokens must be >= 1"),
    (dict(text_input="x", max_tokens=-3), "max_tokens must be >= 1"),
    (dict(text_input="x", max_tokens=5000), "max_tokens 5000 goes beyond the context"),
    (dict(text_input="x " * 1500), "text_input is .* tokens; the model's context is 1024"),
    (dict(text_input="x", temperature=-0.5), "temperature must be >= 0"),
    (dict(text_input="x", top_p=0.0), "top_p must be in"),
    (dict(text_input="x", top_k=-1), "top_k must be >= 0"),
    (dict(text_input="x", stop=[""]), "stop strings must not be empty"),
])
def test_bad_requests_name_the_field(tiny, inputs, field):
    with pytest.raises(BadRequest, match=field):
        parse(_inputs(**inputs), tiny)


def test_invalid_utf8_is_refused(tiny):
    with pytest.raises(BadRequest, match="not valid UTF-8"):
        parse({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, tiny)


@pytest.mark.parametrize("deltas, stops, released, stopped", [
    (["Hel", "lo wor", "ld"], ["wor"], "Hello ", True),  # found inside one delta
    (["a", "<", "/", "s", ">", "b"], ["</s>"], "a", True),  # spread over several: nothing of it is released
    (["a", "<", "/", "x"], ["</s>"], "a</x", False),  # a false start is released once it cannot match
    (["ab", "c"], ["bcd"], "abc", False),  # held back until the last delta, then released
    (["no stop here"], [], "no stop here", False),
])
def test_stop_strings_hold_back_only_what_could_match(deltas, stops, released, stopped):
    st = StopText(stops)
    out, hit = "", False
    for i, d in enumerate(deltas):
        piece, hit = st.push(d, last=i == len(deltas) - 1)
        out += piece
        if hit:
            break
    assert (out, hit) == (released, stopped)


def test_the_repository_holds_config_model_and_bundle(tiny_fp32, tmp_path):
    batching = runtime.BatchOptions(max_batch=4, max_cache_tokens=4096, prefix_cache_tokens=0, prefill_chunk=64,
                                    mixed_steps=True)
    repo = write_repository(tiny_fp32.path, tmp_path / "repo", model_name="tiny-llm", instances=2, batching=batching)
    config = (repo / "tiny-llm" / "config.pbtxt").read_text()
    assert 'name: "tiny-llm"' in config and "decoupled: true" in config and "count: 2" in config
    for name in ("text_input", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "text_output"):
        assert f'name: "{name}"' in config
    assert 'key: "max_batch" value: { string_value: "4" }' in config and '"4096"' in config
    params = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', config))
    assert runtime.BatchOptions.from_params(params) == batching  # what the model reads back is what was asked
    with pytest.raises(KvforgeError, match="prefill_chunk must be an integer, got 'many'"):
        runtime.BatchOptions.from_params({**params, "prefill_chunk": "many"})
    with pytest.raises(KvforgeError, match="mixed_steps must be True or False, got 'yes'"):
        runtime.BatchOptions.from_params({**params, "mixed_steps": "yes"})
    assert "kvforge.serving.triton_model import TritonPythonModel" in (repo / "tiny-llm" / "1" / "model.py").read_text()
    inside = repo / "tiny-llm" / "1" / "bundle"
    for f in tiny_fp32.path.iterdir():
        assert (inside / f.name).read_bytes() == f.read_bytes()
    assert repository_model(repo) == "tiny-llm"
    record = json.loads((repo / RECORD).read_text())
    assert record["model_name"] == "tiny-llm" and record["batching"]["max_batch"] == 4
    # an existing repository is kept unless --force; --force replaces it; a foreign directory is never replaced
    with pytest.raises(KvforgeError, match="already exists"):
        write_repository(tiny_fp32.path, repo)
    write_repository(tiny_fp32.path, repo, model_name="other", force=True)
    assert sorted(p.name for p in repo.iterdir()) == ["kvforge-triton.json", "other"]
    foreign = tmp_path / "mine"
    (foreign / "x").mkdir(parents=True)
    with pytest.raises(KvforgeError, match="not a kvforge output"):
        write_repository(tiny_fp32.path, foreign, force=True)
    assert (foreign / "x").is_dir()


@pytest.mark.parametrize("kwargs, message", [
    (dict(model_name="a/b"), "model name"),
    (dict(instances=0), "instances must be an integer >= 1"),
    (dict(batching=dict(max_batch=4)), "batching must be a kvforge.runtime.BatchOptions"),
    (dict(backend="tpu"), "backend 'tpu'"),
])
def test_bad_repository_options_are_refused_and_nothing_is_written(tiny_fp32, tmp_path, kwargs, message):
    with pytest.raises(KvforgeError, match=message):
        write_repository(tiny_fp32.path, tmp_path / "repo", **kwargs)
    assert not (tmp_path / "repo").exists()


def test_a_damaged_bundle_is_refused(tiny_fp32, tmp_path):
    import shutil

    bundle = shutil.copytree(tiny_fp32.path, tmp_path / "b")
    with open(bundle / "model.onnx", "r+b") as f:
        f.seek(100)
        f.write(b"\0\0\0\0")
    with pytest.raises(KvforgeError, match="model.onnx"):
        write_repository(bundle, tmp_path / "repo")
    with pytest.raises(KvforgeError, match="not a kvforge bundle"):
        write_repository(tmp_path, tmp_path / "repo2")
