"""Shared fixtures: Hugging Face checkpoints made locally from configs (random weights)."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    """Keep the runtime's ORT-variant cache inside the test run, not in ~/.cache."""
    import os
    import tempfile

    os.environ.setdefault("KVFORGE_CACHE", tempfile.mkdtemp(prefix="kvforge-test-cache-"))

# One small config per supported family; each exercises the family's quirks
# (GPT-2 fused Conv1D qkv, Llama-3 rope scaling + GQA, Mistral sliding window,
# Qwen2 q/k/v biases + per-layer window + MQA).
HF_CONFIGS = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=300, activation_function="gelu_new",
             bos_token_id=299, eos_token_id=299),
    "llama": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32),
    ),
    "mistral": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, max_position_embeddings=256, sliding_window=5, head_dim=16,
    ),
    "qwen2": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
        vocab_size=300, max_position_embeddings=256, use_sliding_window=True, sliding_window=5, max_window_layers=1,
        tie_word_embeddings=True,
    ),
}
HF_FAMILIES = tuple(HF_CONFIGS)


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A transformers model of `family` with seeded random weights, every one perturbed.

    transformers initializes biases to 0 and norm weights to 1; perturbing all
    of them makes a mapping mistake (a dropped bias, swapped norms) visible.
    """
    import torch
    import transformers

    config_cls = {
        "gpt2": transformers.GPT2Config,
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[family]
    model_cls = {
        "gpt2": transformers.GPT2LMHeadModel,
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
    }[family]
    config = config_cls(**{**HF_CONFIGS[family], **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: family -> directory holding config.json + model.safetensors (cached per session)."""
    cache = {}

    def make(family: str):
        if family not in cache:
            directory = tmp_path_factory.mktemp(f"hf-{family}")
            make_hf_model(family).save_pretrained(directory, safe_serialization=True)
            cache[family] = directory
        return cache[family]

    return make


# -- GPU tier: TensorRT and an NVIDIA GPU ------------------------------------------------------
from kvforge.runtime.trt_backend import tensorrt_gpu_missing  # noqa: E402

# Only these two facts (the package, a CUDA GPU) decide a gpu test's skip; any other failure of a gpu test is a failure.
_TRT_GPU_ABSENT = tensorrt_gpu_missing()
# Use as a decorator together with @pytest.mark.gpu.
requires_tensorrt_gpu = pytest.mark.skipif(_TRT_GPU_ABSENT is not None, reason=f"needs TensorRT and an NVIDIA GPU: {_TRT_GPU_ABSENT}")


# -- shared artifacts ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_fp32(tmp_path_factory):
    """One validated FP32 export of the built-in tiny model for the whole run (tests only read it)."""
    from kvforge.export import export

    return export("tiny", tmp_path_factory.mktemp("shared") / "tiny-fp32")


@pytest.fixture(scope="session")
def tiny_heldout(tiny_fp32):
    """The first 40 windows of 256 tokens of tiny's held-out text."""
    from kvforge.model_defs.evaluate import heldout_text
    from kvforge.runtime.evaluate import windows
    from kvforge.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tiny_fp32.tokenizer_file)
    return windows(tok.encode(heldout_text(), add_special_tokens=False), 256)[:40]


@pytest.fixture(scope="session")
def tiny_int8(tiny_fp32, tmp_path_factory):
    """tiny calibrated to INT8 (max, built-in corpus, 32 samples of 128 tokens: quick)."""
    from kvforge.calibration import calibrate

    return calibrate(tiny_fp32.path, tmp_path_factory.mktemp("shared") / "tiny-int8", "int8", samples=32, seq_len=128)
