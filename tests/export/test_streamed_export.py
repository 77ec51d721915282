"""Export from a checkpoint whose weights are read where they are used (model_defs/weights.py, issue 48).

A checkpoint in the Hub's layout (BF16 safetensors in shards with model.safetensors.index.json, as transformers
writes a large model) is exported without loading the model: the graph's weights are read one at a time as the
file is written, the validating reference reads each block's as it runs. transformers, loading the same
directory, is the oracle for the values; memory is measured by benchmarks/features/export_scale.py.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from kvforge.errors import KvforgeError
from kvforge.export import export
from kvforge.model_defs import load
from kvforge.model_defs.checkpoint import load_streamed
from kvforge.model_defs.weights import copy_in, streamed

from ..conftest import once_per_run


def _write(directory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, torch_dtype="bfloat16")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # norms away from 1, so that a norm read wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="60KB")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A BF16 Llama checkpoint in several shards with an index (made once per run)."""
    return once_per_run(tmp_path_factory, "streamed-llama-bf16", _write)


def _transformers(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()


def test_the_checkpoint_is_sharded_with_an_index(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3  # the layout this test is about


def test_a_streamed_reference_computes_what_transformers_and_the_loaded_model_compute(sharded):
    skeleton, _, weights = load_streamed(sharded)
    assert all(p.stride() == (0,) * p.dim() for p in skeleton.parameters())  # no weight is held
    reference = streamed(skeleton, weights)
    ids = torch.tensor([[5, 17, 203, 9, 77, 2, 150]])
    with torch.no_grad():
        ours, present = reference(ids)
        theirs = _transformers(sharded)(ids).logits
        loaded, _ = load(sharded)
        eager, eager_present = loaded(ids)
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-4), (ours - theirs).abs().max()
    # the head is read a chunk of rows at a time, so float32 sums may round apart by an ulp; the cache exactly
    assert torch.allclose(ours, eager, rtol=0, atol=1e-5)
    assert all(torch.equal(a, b) for la, lb in zip(present, eager_present) for a, b in zip(la, lb))
    # its float64 copy streams too, and is the loaded model's float64 copy exactly
    with torch.no_grad():
        ours64, _ = copy_in(reference, torch.float64)(ids)
        eager64, _ = copy_in(loaded, torch.float64)(ids)
    assert torch.equal(ours64, eager64)
    assert all(p.stride() == (0,) * p.dim() for p in reference.parameters())  # let go after the forward


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_export_writes_the_checkpoints_weights_and_runs_as_transformers(sharded, tmp_path, dtype):
    external = dtype == "float32"  # a model this small is one file unless asked; each way is written as read
    seen = []
    bundle = export(sharded, tmp_path / "b", dtype=dtype, external_data=True if external else None,
                    progress=lambda phase, done, total: seen.append((phase, done, total)))
    assert bundle.manifest["validation"]["passed"]
    # a bar per weight: each parameter read from the checkpoint once, counted as it is written, in order
    skeleton, _, _ = load_streamed(sharded)
    weights = [(done, total) for phase, done, total in seen if phase == "weights"]
    assert weights == [(i, len(dict(skeleton.named_parameters()))) for i in range(len(weights))]
    assert weights[-1][0] == weights[-1][1] == 3 * 9 + 2  # 9 tensors a layer, the embedding (tied) and the norm
    assert (bundle.path / "model.onnx.data").is_file() == external
    graph = onnx.load(str(bundle.path / "model.onnx"))
    reference = _transformers(sharded)
    inits = {i.name: i for i in graph.graph.initializer}
    want = getattr(torch, dtype)
    q = onnx.numpy_helper.to_array(inits["model.layers.1.attn.q_proj.weight"], base_dir=str(bundle.path))
    expected = reference.model.layers[1].self_attn.q_proj.weight.detach().to(want).T.numpy()
    assert np.array_equal(q, expected)  # stored [in, out] as the export always has, the value exactly
    # the tied embedding once: the lookup and the head read one initializer
    assert sum(tuple(i.dims) == (300, 64) for i in graph.graph.initializer) == 1

    session = ort.InferenceSession(str(bundle.path / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.array([[5, 17, 203, 9, 77, 2, 150]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(7)[None]}
    for i in session.get_inputs()[3:]:
        feeds[i.name] = np.zeros((1, 2, 0, 16), dtype=np.float16 if dtype == "float16" else np.float32)
    logits = session.run(["logits"], feeds)[0]
    with torch.no_grad():
        theirs = reference(torch.from_numpy(ids)).logits.numpy()
    rel = np.linalg.norm(logits - theirs) / np.linalg.norm(theirs)
    assert rel < (1e-5 if dtype == "float32" else 1e-2), rel


def _damage(directory, tensor: str, value: float) -> None:
    """Write `value` over the first element of `tensor` in its shard (a BF16 checkpoint)."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = directory / index["weight_map"][tensor]
    raw = bytearray(shard.read_bytes())
    (size,) = struct.unpack("<Q", raw[:8])
    start = 8 + size + json.loads(raw[8:8 + size])[tensor]["data_offsets"][0]
    raw[start:start + 2] = torch.tensor([value], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    shard.write_bytes(bytes(raw))


def test_a_damaged_weight_is_named_and_nothing_is_written(sharded, tmp_path):
    import shutil

    directory = tmp_path / "damaged"
    shutil.copytree(sharded, directory)
    _damage(directory, "model.layers.2.mlp.down_proj.weight", float("nan"))
    with pytest.raises(KvforgeError, match=r"damaged: model\.layers\.2\.mlp\.down_proj\.weight holds 1 NaN"):
        export(directory, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staged leftovers


def test_a_truncated_shard_is_named(sharded, tmp_path):
    import shutil

    directory = tmp_path / "truncated"
    shutil.copytree(sharded, directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = directory / index["weight_map"]["model.norm.weight"]
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(KvforgeError, match="truncated"):
        export(directory, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_reference_streamed_from_disk_hands_freed_memory_back_after_each_block(sharded, monkeypatch):
    """glibc kept ~1 GiB of what reading and casting a 3B model's blocks freed (resources.release_freed_memory):
    a source that streams (keeps nothing) trims after each block's weights are let go, one that keeps its values
    never; the outputs are the same either way."""
    from kvforge.model_defs import checkpoint, weights

    calls = []
    monkeypatch.setattr(weights, "release_freed_memory", lambda: calls.append(1))
    ids = torch.tensor([[5, 17, 203, 9]])
    outputs = {}
    for keep in (checkpoint.KEEP_BYTES, 0):
        monkeypatch.setattr(checkpoint, "KEEP_BYTES", keep)
        skeleton, _, source = load_streamed(sharded)
        assert source.keep == bool(keep)
        calls.clear()
        with torch.no_grad():
            outputs[keep] = streamed(skeleton, source)(ids)[0]
        # each block, the embedding table, then the weights outside the blocks (the final norm)
        assert len(calls) == (0 if keep else skeleton.config.n_layers + 2)
    assert torch.equal(outputs[checkpoint.KEEP_BYTES], outputs[0])


def test_a_streamed_reference_holds_one_modules_weights_at_a_time(sharded):
    """Within a block each module reads its own weights as it runs (a 3B layer in FP64 is 0.8 GB, its largest
    matrix 0.2 GB): whenever a block's module runs, the block's weights that hold values are that module's only;
    and the float64 reference computes what the loaded model computes in float64."""
    from kvforge.model_defs.weights import blocks

    skeleton, _, source = load_streamed(sharded)
    model = streamed(skeleton, source, torch.float64)
    held = []

    def holding(module, args, block):  # after the module's own pre-hook has loaded its weights
        real = {id(p) for p in block.parameters() if p.stride() != (0,) * p.dim()}
        held.append((module, real))

    for block in blocks(model):
        for module in block.modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(lambda m, a, block=block: holding(m, a, block))
    ids = torch.tensor([[5, 17, 203, 9, 44]])
    with torch.no_grad():
        out = model(ids)[0]
        expected = load(sharded).model.double()(ids)[0]
    assert len(held) > 3 * len(blocks(model)) and all(real == {id(p) for p in m.parameters()} for m, real in held)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
