"""Pre-quantized Hugging Face checkpoints exported with their codes kept (`kvforge export DIR`), end to end on
micro Llamas, against oracles that are not kvforge:

- compressed-tensors: the package's own quantized forward (weights fake-quantized from their stored scales,
  activations quantized as the scheme says: dynamic per token, or the static scale) on the model it then
  compresses and saves;
- GPTQ (4-bit, act-order, asymmetric): transformers' model holding a plain numpy dequantization of the packed
  codes (tests/model_defs/test_hf_quantized.py packs them as gptqmodel does);
- DeepSeek-style block FP8 with dynamic per-token-group FP8 activations: a Torch forward that dequantizes the
  blocks and quantizes each Linear's input as DeepSeek-V3's reference `act_quant` does.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from kvforge import runtime
from kvforge.bundle import Bundle
from kvforge.export import export

from ..conftest import make_hf_model
from ..model_defs.test_hf_quantized import fill_qparams, gptq_tensors

transformers = pytest.importorskip("transformers")
HAVE_CT = importlib.util.find_spec("compressed_tensors") is not None
MICRO = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256, vocab_size=300,
             num_hidden_layers=1, rope_parameters=dict(rope_type="default", rope_theta=10000.0))
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
IDS = np.random.default_rng(11).integers(0, 300, (2, 13))


def _save(model, directory, tensors: dict[str, torch.Tensor], quantization_config: dict | None = None):
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def _bundle_logits(source, out) -> tuple[np.ndarray, dict]:
    bundle = export(source, out)
    with runtime.load(bundle.path) as session:
        logits, _ = session.forward(IDS)
    return logits, bundle.quantization


def _logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(IDS)).logits.float().numpy()


@pytest.mark.skipif(not HAVE_CT, reason="the compressed-tensors package (the oracle) is not installed")
@pytest.mark.parametrize("preset,static,activations", [
    ("W8A8", False, "int8 per token"), ("W8A8", True, "int8 static")])
def test_compressed_tensors_checkpoint_runs_as_the_package_computes_it(tmp_path, preset, static, activations):
    """W8A8 INT8 with dynamic per-token and with static activation scales (compressed-tensors' other schemes are
    read against its own decompression in tests/model_defs/test_hf_quantized.py)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    model = make_hf_model("llama", seed=9, **MICRO)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if static:
        scheme.input_activations = QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True,
                                                    dynamic=False)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"],
                                                        quantization_status="frozen"))
    fill_qparams(model, scheme, seed=2, input_scale=0.02)
    expected = _logits(model)  # the package's forward: fake-quantized weights and activations
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    directory = _save(model, tmp_path / "ct", dict(model.state_dict()))
    compressor.update_config(str(directory))
    got, quant = _bundle_logits(directory, tmp_path / "bundle")
    record = quant["checkpoint"]
    assert record["format"] == "compressed-tensors" and len(record["kept"]) == MICRO["num_hidden_layers"] * len(LINEARS)
    assert quant["activations"] == activations
    # activations quantized: the graph departs from the float model by design; its float graph was validated
    assert Bundle(tmp_path / "bundle").manifest["validation"]["graph"].startswith("the float graph")
    # weight-only: the same weights, FP32 noise; with activations quantized, a value that lands on a rounding
    # boundary may take the neighbouring code in one of the two (ONNX Runtime and Torch reduce in other orders)
    _close_but_for_rounding_flips(got, expected)  # weight-only 4-bit with zero points: the GPTQ test below


def _close_but_for_rounding_flips(got: np.ndarray, expected: np.ndarray) -> None:
    """Activations quantized on the fly: each token's logits equal the oracle's to FP32 noise, except where an
    input value sat on a rounding boundary and took the neighbouring code in one of the two (ONNX Runtime and
    Torch sum in other orders); a flip also moves the later tokens that attend to it."""
    exact = np.abs(got - expected).max(axis=-1) <= 1e-4
    assert exact.mean() >= 0.6, exact
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) <= 2e-2


def test_gptq_act_order_checkpoint_is_its_dequantized_codes(tmp_path):
    model = make_hf_model("llama", seed=10, **MICRO)
    rng = np.random.default_rng(0)
    tensors = {k: v for k, v in model.state_dict().items() if not any(f".{m}." in k for m in LINEARS)}
    state = model.state_dict()
    for i in range(MICRO["num_hidden_layers"]):
        for linear in LINEARS:
            prefix = f"model.layers.{i}.{linear}"
            out, k = state[f"{prefix}.weight"].shape
            packed, dequantized = gptq_tensors(rng, out, k, 4, 32, True, False, True, prefix)
            packed.pop(f"{prefix}.bias")  # Llama's projections have none
            tensors.update(packed)
            state[f"{prefix}.weight"] = torch.from_numpy(dequantized)
    model.load_state_dict(state)
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
              "checkpoint_format": "gptq"}
    got, quant = _bundle_logits(_save(model, tmp_path / "gptq", tensors, config), tmp_path / "bundle")
    kept = quant["checkpoint"]["kept"]
    assert len(kept) == MICRO["num_hidden_layers"] * len(LINEARS) and all(r["act_order"] and r["zero_point"] for r in kept.values())
    assert np.abs(got - _logits(model)).max() <= 1e-4
    # codes of weights alone stand for the float weights bit for bit: the graph validated is the one written
    assert Bundle(tmp_path / "bundle").manifest["validation"]["graph"] == "as written"


def _fp8_act_quant(module, args):
    """DeepSeek-V3's act_quant: per token and 128 inputs, scale = max |x| / 448, x / scale cast to E4M3."""
    (x,) = args
    groups = x.reshape(*x.shape[:-1], -1, 128)
    scale = groups.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 448.0
    return ((groups / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape),


def test_block_fp8_checkpoint_runs_as_deepseeks_reference(tmp_path):
    model = make_hf_model("llama", seed=12, **MICRO)
    torch.manual_seed(3)
    tensors = dict(model.state_dict())
    state = model.state_dict()
    for i in range(MICRO["num_hidden_layers"]):
        for linear in LINEARS:
            name = f"model.layers.{i}.{linear}.weight"
            out, k = state[name].shape
            scale_inv = torch.rand(-(-out // 128), -(-k // 128)) * 1e-3 + 1e-4
            codes = (torch.randn(out, k) * 64).to(torch.float8_e4m3fn)
            tensors[name], tensors[name + "_scale_inv"] = codes, scale_inv
            state[name] = codes.float() * scale_inv.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :k]
    model.load_state_dict(state)
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    got, quant = _bundle_logits(_save(model, tmp_path / "fp8", tensors, config), tmp_path / "bundle")
    assert quant["checkpoint"]["format"] == "fp8-block" and quant["activations"] == "fp8 per token group of 128"
    hooks = [m.register_forward_pre_hook(_fp8_act_quant) for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    expected = _logits(model)
    for hook in hooks:
        hook.remove()
    _close_but_for_rounding_flips(got, expected)
