"""Checkpoint import: round trips, sharded files, and every error path with a clear message."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvforge.errors import KvforgeError
from kvforge.model_defs import load, save_checkpoint

from ..conftest import make_hf_model


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@torch.no_grad()
def test_kvforge_checkpoint_round_trip(tmp_path):
    model, tok = load("qwen2-micro")
    path = save_checkpoint(model, tmp_path / "ckpt", tok)
    again, tok2 = load(path)
    ids = torch.randint(0, 259, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(again(ids)[0], model(ids)[0], atol=0, rtol=0)
    assert again.config == model.config
    assert tok2.encode("héllo") == tok.encode("héllo")


def test_save_refuses_to_overwrite_and_leaves_nothing_half_written(tmp_path):
    model, _ = load("gpt2-micro")
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    with pytest.raises(KvforgeError, match="already exists"):
        save_checkpoint(model, target)
    assert (target / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directory left behind


@torch.no_grad()
def test_sharded_hf_checkpoint_with_tokenizer(tmp_path):
    hf_model = make_hf_model("llama")
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    from kvforge.tokenizer import Tokenizer

    Tokenizer.byte_level().save(tmp_path)
    model, tok = load(tmp_path)
    ids = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids)[0], hf_model(ids).logits, atol=1e-4, rtol=0)
    assert tok is not None and tok.bos_token_id == 256


def test_half_precision_load(hf_checkpoint):
    model, _ = load(hf_checkpoint("mistral"), dtype="float16")
    assert model.dtype == torch.float16
    logits, present = model(torch.tensor([[5, 6, 7]]))
    assert logits.dtype == torch.float32 and present[0][0].dtype == torch.float16


def test_unsupported_architecture(tmp_path, hf_checkpoint):
    d = _copy(hf_checkpoint("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="mamba", architectures=["MambaForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KvforgeError, match=r"unsupported architecture: model_type='mamba'.*MambaForCausalLM.*gpt2"):
        load(d)


def _edit_weights(d, edit):
    f = d / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))


def test_missing_extra_and_misshapen_tensors_are_all_listed(tmp_path, hf_checkpoint):
    d = _copy(hf_checkpoint("llama"), tmp_path / "m")

    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
        t["model.norm.weight"] = torch.zeros(63)

    _edit_weights(d, edit)
    with pytest.raises(KvforgeError) as err:
        load(d)
    msg = str(err.value)
    assert "missing tensors (1): ['model.layers.1.mlp.up_proj.weight']" in msg
    assert "unexpected tensors (1): ['model.layers.0.self_attn.extra.weight']" in msg
    assert "model.norm.weight: checkpoint (63,) vs config (64,)" in msg


def test_gpt2_checkpoint_without_prefix_and_with_legacy_buffers(tmp_path, hf_checkpoint):
    """Original GPT-2 files have no 'transformer.' prefix and carry attn.bias mask buffers."""
    d = _copy(hf_checkpoint("gpt2"), tmp_path / "m")

    def edit(t):
        for k in list(t):
            t[k.removeprefix("transformer.")] = t.pop(k)
        t["h.0.attn.bias"] = torch.ones(1, 1, 4, 4)

    _edit_weights(d, edit)
    model, _ = load(d)
    reference, _ = load(hf_checkpoint("gpt2"))
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(model(ids)[0], reference(ids)[0], atol=0, rtol=0)


def test_pickle_checkpoints_are_refused(tmp_path, hf_checkpoint):
    d = _copy(hf_checkpoint("gpt2"), tmp_path / "m")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(KvforgeError, match=r"pytorch_model\.bin cannot be read as tensors alone.*runs no code"):
        load(d)


def test_other_safetensors_beside_the_model_are_not_read(tmp_path, hf_checkpoint):
    """As in transformers: model.safetensors is the model; an adapter or a consolidated copy beside it is not."""
    d = _copy(hf_checkpoint("gpt2"), tmp_path / "m")
    save_file({"lora_A": torch.zeros(2, 2)}, str(d / "adapter_model.safetensors"))
    model, _ = load(d)
    reference, _ = load(hf_checkpoint("gpt2"))
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(model(ids)[0], reference(ids)[0], atol=0, rtol=0)
    (d / "model.safetensors").rename(d / "weights.safetensors")
    with pytest.raises(KvforgeError, match="several .safetensors files .* neither model.safetensors nor"):
        load(d)
    (d / "adapter_model.safetensors").unlink()
    torch.testing.assert_close(load(d)[0](ids)[0], reference(ids)[0], atol=0, rtol=0)  # one file, any name


def test_corrupt_safetensors(tmp_path, hf_checkpoint):
    d = _copy(hf_checkpoint("gpt2"), tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(KvforgeError, match="cannot read .*model.safetensors"):
        load(d)


def test_bad_sources(tmp_path):
    with pytest.raises(KvforgeError, match="unknown model source 'no-such-model'.*tiny"):
        load("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(KvforgeError, match="neither a kvforge checkpoint"):
        load(tmp_path / "empty")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(KvforgeError, match="is a file"):
        load(tmp_path / "file.txt")
    with pytest.raises(KvforgeError, match="dtype 'int8' is not supported"):
        load("gpt2-micro", dtype="int8")


def test_tokenizer_larger_than_vocabulary_is_refused(tmp_path, hf_checkpoint):
    d = _copy(hf_checkpoint("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 200
    (d / "config.json").write_text(json.dumps(cfg))
    _edit_weights(d, lambda t: t.update({k: v[:200] for k, v in t.items() if k in ("model.embed_tokens.weight", "lm_head.weight")}))
    from kvforge.tokenizer import Tokenizer

    Tokenizer.byte_level().save(d)
    with pytest.raises(KvforgeError, match="259 tokens but the model only 200"):
        load(d)


@pytest.mark.parametrize("rope, match", [
    ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}, "rope type 'dynamic' is not supported"),
    ({"rope_type": "proportional", "rope_theta": 10000.0, "factor": 4.0}, "rope type 'proportional' is not supported"),
])
def test_rope_types_we_do_not_implement_are_refused(tmp_path, hf_checkpoint, rope, match):
    d = _copy(hf_checkpoint("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = rope
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KvforgeError, match=match):
        load(d)


def test_legacy_v4_config_keys(tmp_path, hf_checkpoint):
    """transformers 4.x wrote rope_theta/rope_scaling at top level and no layer_types for Qwen2."""
    d = _copy(hf_checkpoint("qwen2"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg.pop("layer_types")
    cfg.update(rope_theta=theta, rope_scaling=None)
    (d / "config.json").write_text(json.dumps(cfg))
    model, _ = load(d)
    new, _ = load(hf_checkpoint("qwen2"))
    assert model.config == new.config


def test_a_bundle_is_not_a_model_source(tmp_path, micro_bundle):
    """A bundle holds config.json (for Optimum) beside kvforge.json; it is still no checkpoint to export from."""
    bundle = micro_bundle("llama3-micro")
    assert (bundle.path / "config.json").is_file()
    with pytest.raises(KvforgeError, match="is a kvforge bundle \\(an exported graph\\), not a model source"):
        load(bundle.path)
