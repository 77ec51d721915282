"""Every GGUF architecture kvforge reads (model_defs/gguf_families.py), against transformers.

Each micro model is written as llama.cpp's converter would (gguf_writer.py) and read back by transformers' own
GGUF loader, the oracle, and by kvforge; their FP32 logits must agree. Where transformers' loader cannot read a
layout (Gemma 1, Falcon-40B's grouped heads) or drops metadata kvforge reads (soft-capping, RoPE scaling), the
oracle is the transformers model the file was written from. The configs keep to what transformers' loader
reproduces: it reads no Qwen3 head_dim, no Qwen-MoE expert sizes, no GPT-2 n_positions, no Falcon eps and no
Gemma query scale from the file, so those stay at its defaults there (Gemma's head size: 256, which llama.cpp's
query scale follows).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from kvforge.errors import KvforgeError  # noqa: E402
from kvforge.model_defs import config_from_hf, load  # noqa: E402
from kvforge.model_defs.gguf_families import ARCHS, hf_tensors  # noqa: E402

from .gguf_writer import GGUF_ARCH, write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"), "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"), "falcon": ("FalconConfig", "FalconForCausalLM"),
    "bloom": ("BloomConfig", "BloomForCausalLM"),
}
# hidden 64, 4 heads, 2 KV heads, 2 layers, 300 tokens; GGUF-carried values off transformers' defaults
_BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=50000.0)
_FALCON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)  # eps at its default
CASES = {
    "llama": ("llama", _BASE),
    "mistral": ("mistral", dict(_BASE, sliding_window=None)),  # a `llama` file that transformers calls mistral
    "qwen2": ("qwen2", dict(_BASE, tie_word_embeddings=True)),  # q/k/v biases, tied head
    "qwen3": ("qwen3", dict(_BASE, head_dim=128)),  # per-head q/k norms
    "qwen2_moe": ("qwen2_moe", dict(_BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1408,
                                    shared_expert_intermediate_size=5632)),  # stacked experts, shared expert + gate
    "qwen3_moe": ("qwen3_moe", dict(_BASE, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768,
                                    norm_topk_prob=True)),
    "phi3": ("phi3", dict(_BASE, sliding_window=64, pad_token_id=0, eos_token_id=2)),  # fused qkv and gate_up
    "gemma2": ("gemma2", dict(_BASE, head_dim=256, sliding_window=4)),  # norms stored 1 + w, sandwich norms, windows
    "gemma3": ("gemma3_text", dict(_BASE, num_hidden_layers=6, head_dim=256, sliding_window=4)),  # + q/k norms, 5:1
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=300, layer_norm_epsilon=1e-4, bos_token_id=1,
                         eos_token_id=2)),  # Conv1D
    "falcon": ("falcon", dict(_FALCON)),  # Falcon-7B: one KV head, parallel block
    "bloom": ("bloom", dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=300, layer_norm_epsilon=1e-4)),  # ALiBi
}
# files transformers' loader cannot read (or reads wrong): the oracle is the model they were written from
BEYOND = {
    "gemma": ("gemma", dict(_BASE, head_dim=16)),
    "falcon40b": ("falcon", dict(_FALCON, new_decoder_architecture=True, num_kv_heads=2)),
    "falcon2_11b": ("falcon", dict(_FALCON, new_decoder_architecture=True, num_kv_heads=2,
                                   num_ln_in_parallel_attn=1)),
    "gemma2_softcaps": ("gemma2", dict(_BASE, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                       attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3_linear_rope": ("gemma3_text", dict(_BASE, num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16,
                                               sliding_window=4, rope_scaling=dict(rope_type="linear", factor=4.0))),
    "qwen2_yarn": ("qwen2", dict(_BASE, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                         original_max_position_embeddings=64))),
}
QUANTIZED = [("llama", Q.Q8_0), ("qwen2_moe", Q.Q4_0), ("qwen3", Q.Q5_1), ("gpt2", Q.Q4_1), ("falcon", Q.Q5_0),
             ("bloom", Q.Q8_0), ("phi3", Q.F16), ("gemma3", Q.BF16)]


def make_model(family: str, config: dict, seed: int = 0):
    """A transformers model with seeded random weights, each perturbed (biases and norms included)."""
    config_class, model_class = _CLASSES[family]
    cfg = getattr(transformers, config_class)(**config)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


IDS = torch.randint(0, 297, (2, 11), generator=torch.Generator().manual_seed(0))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS)
    return out.logits if hasattr(out, "logits") else out[0]


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _oracle(directory, name="m.gguf"):
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=name, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_kvforge_reads_each_architecture_as_transformers_does(tmp_path, case):
    """FP32 file: transformers' GGUF model reproduces the source (the writer is llama.cpp's layout), and kvforge's
    logits are transformers' within 1e-4."""
    family, config = CASES[case]
    source = make_model(family, config, seed=len(case))
    path = write_gguf(source, tmp_path / "m.gguf")
    expected = _logits(_oracle(tmp_path))
    assert _max_error(expected, _logits(source)) <= 1e-4  # the file is the model, as transformers reads it
    model, tokenizer = load(path)
    assert _max_error(_logits(model), expected) <= 1e-4
    assert tokenizer is not None and tokenizer.encode("the dog") != []


@pytest.mark.parametrize("case", sorted(BEYOND))
def test_layouts_and_metadata_transformers_gguf_loader_drops(tmp_path, case):
    """Gemma 1 and Falcon's grouped heads (which transformers' GGUF loader does not read), soft-capping and RoPE
    scaling (which it drops): kvforge's logits are those of the transformers model the file was written from."""
    family, config = BEYOND[case]
    source = make_model(family, config, seed=len(case))
    path = write_gguf(source, tmp_path / "m.gguf")
    model, _ = load(path)
    assert _max_error(_logits(model), _logits(source)) <= 1e-4


@pytest.mark.parametrize("case,qtype", QUANTIZED, ids=[f"{c}-{q.name}" for c, q in QUANTIZED])
def test_quantized_files_read_as_transformers_dequantizes_them(tmp_path, case, qtype):
    family, config = CASES[case]
    source = make_model(family, config, seed=7)
    path = write_gguf(source, tmp_path / "m.gguf", qtype=qtype)
    reader = gguf.GGUFReader(str(path))
    assert qtype in {t.tensor_type for t in reader.tensors}
    expected = _logits(_oracle(tmp_path))
    model, _ = load(path)
    assert _max_error(_logits(model), expected) <= 1e-4
    assert _max_error(expected, _logits(source)) > 1e-6  # the weights really were rounded


def _read_by_contract(path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The reading gguf_families.py's docstring prescribes, done here without model_defs/gguf.py."""
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))

    def field(key):
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    name = field("general.architecture")
    arch = ARCHS[name]
    hf = dict(arch.defaults, model_type=arch.model_type, architectures=list(arch.architectures))
    for key, hf_key in arch.config.items():
        if field(f"{name}.{key}") is not None:
            hf[hf_key] = field(f"{name}.{key}")
    hf["tie_word_embeddings"] = not any(t.name == arch.tied_head for t in reader.tensors)
    hf["vocab_size"] = field(f"{name}.vocab_size") or len(field("tokenizer.ggml.tokens"))
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    if arch.finish_config:
        arch.finish_config(field, hf, shapes)
    tensors = {}
    for t in reader.tensors:
        value = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shapes[t.name])
        tensors.update(hf_tensors(arch, hf, t.name, torch.from_numpy(value.copy())))
    return hf, tensors


@pytest.mark.parametrize("case", sorted(CASES) + sorted(BEYOND))
def test_the_table_gives_back_the_checkpoint(tmp_path, case):
    """The table alone (no reader): every tensor of the saved checkpoint, under its own name and layout, and the
    config keys the file carries, back from the file."""
    from safetensors.torch import load_file

    family, config = {**CASES, **BEYOND}[case]
    source = make_model(family, config)
    path = write_gguf(source, tmp_path / "m.gguf")
    source.save_pretrained(tmp_path / "hf", safe_serialization=True)
    checkpoint = load_file(str(tmp_path / "hf" / "model.safetensors"))
    hf, tensors = _read_by_contract(path)
    if family in ("gpt2", "bloom"):  # llama.cpp writes their tied head as a copy of the embeddings
        assert torch.equal(tensors.pop("lm_head.weight"), tensors["transformer.wte.weight" if family == "gpt2" else
                                                                  "transformer.word_embeddings.weight"])
        if family == "bloom":
            checkpoint = {k if k.startswith("transformer.") else f"transformer.{k}": v for k, v in checkpoint.items()}
    assert sorted(tensors) == sorted(checkpoint)
    for name, value in checkpoint.items():
        assert tensors[name].shape == value.shape, name
        assert torch.allclose(tensors[name], value.float(), atol=1e-6, rtol=0), name
    # the model kvforge builds from the file's config is the one config.json gives, but for what GGUF does not
    # carry or llama.cpp writes otherwise: the special ids (the file's tokenizer's), Mistral's name, the heads
    # llama.cpp writes as copies (untied), BLOOM's context (the converter writes n_embd), eps rounded to float32
    ours, theirs = (config_from_hf(c).to_dict() for c in (hf, source.config.to_dict()))
    assert ours.pop("norm_eps") == pytest.approx(theirs.pop("norm_eps"), rel=1e-6)
    skip = {"bos_token_id", "eos_token_id", "pad_token_id", "family", "tie_embeddings", "max_seq_len"}
    assert {k: v for k, v in ours.items() if k not in skip} == {k: v for k, v in theirs.items() if k not in skip}

def test_every_converter_architecture_is_mapped():
    assert set(GGUF_ARCH.values()) <= set(ARCHS)


def test_what_kvforge_cannot_read_is_refused_by_name():
    fields = {"phi3.rope.dimension_count": 16}
    hf = {"hidden_size": 64, "num_attention_heads": 4}
    with pytest.raises(KvforgeError, match="LongRoPE"):
        ARCHS["phi3"].finish_config(fields.get, hf, {"rope_factors_long.weight": (8,)})
    with pytest.raises(KvforgeError, match="rope_freqs"):
        ARCHS["llama"].finish_config({}.get, {}, {"rope_freqs.weight": (8,)})
    with pytest.raises(KvforgeError, match="'su'"):
        ARCHS["qwen2"].finish_config({"qwen2.rope.scaling.type": "su", "qwen2.rope.scaling.factor": 2.0}.get, {}, {})
    with pytest.raises(KvforgeError, match="blk.0.ffn_gate.weight.*qwen2_moe"):
        hf_tensors(ARCHS["qwen2moe"], {}, "blk.0.ffn_gate.weight", torch.zeros(2, 2))


@pytest.mark.parametrize("case,qtype", QUANTIZED, ids=[f"{c}-{q.name}" for c, q in QUANTIZED])
def test_a_streamed_reading_computes_transformers_logits(tmp_path, case, qtype):
    """The export's reader of a GGUF's float weights (load_streamed: the file's tensors decoded one at a time,
    where a block uses them, through the same names and layout changes): the skeleton streamed from the file
    gives transformers' logits within 1e-4, and every weight is bit for bit the one `load` decodes."""
    from kvforge.model_defs.checkpoint import load_streamed
    from kvforge.model_defs.weights import streamed

    family, config = CASES[case]
    path = write_gguf(make_model(family, config, seed=11), tmp_path / "m.gguf", qtype=qtype)
    expected = _logits(_oracle(tmp_path))
    skeleton, tokenizer, source = load_streamed(path)
    assert tokenizer is not None and tokenizer.vocab_size == load(path)[1].vocab_size
    assert all(p.data.untyped_storage().nbytes() <= p.element_size() for p in skeleton.parameters())  # none held
    loaded = load(path)[0].state_dict()
    for name in source.shapes:
        assert torch.equal(source.read(name), loaded[name]), name
    assert _max_error(_logits(streamed(skeleton, source)), expected) <= 1e-4


def test_a_damaged_tensor_is_named_when_the_streamed_reading_reaches_it(tmp_path):
    """A NaN in one tensor of an F32 file: refused by name when that tensor is decoded, not before."""
    from kvforge.model_defs.checkpoint import load_streamed

    family, config = CASES["llama"]
    model = make_model(family, config)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    path = write_gguf(model, tmp_path / "m.gguf")
    _, _, source = load_streamed(path)
    source.read("layers.0.ffn.up_proj.weight")
    with pytest.raises(KvforgeError, match=r"m.gguf is damaged: blk.1.ffn_up.weight holds 1 NaN"):
        source.read("layers.1.ffn.up_proj.weight")


def test_the_scratch_file_gives_back_what_was_written_whole_or_by_rows():
    """weights.ScratchTensors (where GgufTensors keeps what a tensor decodes to): each tensor read back whole or
    by rows equals what was written (torch indexing the oracle), a copy is the caller's own, and a shared read is
    overwritten by the next one (the buffer is reused, as the shards' reads reuse theirs)."""
    from kvforge.model_defs.weights import ScratchTensors

    gen = torch.Generator().manual_seed(3)
    written = {"table": torch.randn(50, 8, generator=gen), "norm": torch.randn(8, generator=gen),
               "stack": torch.randn(3, 4, 5, generator=gen), "half": torch.randn(6, 4, generator=gen).half()}
    scratch = ScratchTensors()
    for name, value in written.items():
        scratch.add(name, value)
    for name, value in written.items():
        assert torch.equal(scratch.read(name), value), name
    rows = torch.tensor([0, 1, 2, 7, 30, 31, 49])
    assert torch.equal(scratch.read_rows("table", rows), written["table"][rows])
    assert torch.equal(scratch.read_rows("stack", torch.tensor([2])), written["stack"][[2]])
    own = scratch.read("table", copy=True)
    shared = scratch.read("norm")
    scratch.read("table")
    assert torch.equal(own, written["table"]) and not torch.equal(shared, written["norm"])
    scratch.close()


def test_a_scratch_file_that_cannot_be_written_is_named_with_the_way_out(tmp_path, monkeypatch):
    """No room (or no permission) under TMPDIR for the decoded values: a KvforgeError naming the tensor, the
    directory and TMPDIR, not an OSError from inside the export."""
    import tempfile

    from kvforge.model_defs.weights import ScratchTensors

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "absent"))
    with pytest.raises(KvforgeError, match=r"cannot keep the decoded blk\.0\.x .*absent.*TMPDIR"):
        ScratchTensors().add("blk.0.x", torch.ones(4, 4))


def test_the_plan_counts_the_decoded_model_the_scratch_file_will_hold(tmp_path):
    """What the export's plan reserves under TMPDIR for a streamed GGUF file: every value of the file in
    float32 (each tensor's parts partition it), as the scratch file holds once all is read."""
    from kvforge.model_defs.checkpoint import load_streamed

    family, config = CASES["qwen2_moe"]
    path = write_gguf(make_model(family, config), tmp_path / "m.gguf", qtype=Q.Q4_0)
    reader = gguf.GGUFReader(str(path))
    _, _, source = load_streamed(path)
    assert source.scratch_bytes == 4 * sum(int(t.n_elements) for t in reader.tensors)
