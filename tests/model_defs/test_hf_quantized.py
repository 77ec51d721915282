"""Pre-quantized Hugging Face checkpoints (model_defs/hf_quantized.py) against oracles that are not kvforge:

- compressed-tensors: checkpoints the compressed-tensors package writes itself (ModelCompressor on a small torch
  model, each preset scheme), read back and compared with the package's own decompression;
- GPTQ and AWQ: tensors packed in the test as gptqmodel and AutoAWQ pack them, from random integer codes, against
  a plain numpy dequantization of those codes (neither package can be a dependency here: gptqmodel 7.7 requires
  torch >= 2.14 and numpy >= 2.4, AutoAWQ is deprecated and its import needs datasets and triton); AWQ also
  against compressed-tensors' AutoAWQConverter and its pack-quantized decompression;
- block FP8: a torch dequantization over the 128x128 blocks, compressed-tensors' FP8BlockDequantizer and
  transformers' FineGrainedFP8 dequantization.
"""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from kvforge.errors import KvforgeError
from kvforge.model_defs.hf_quantized import MIN_BLOCK, read_quantized
from kvforge.model_defs.quantized import exact

_QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_shape", "weight_scale",
                   "weight_zero_point", "weight_scale_inv", "input_scale", "input_zero_point", "activation_scale")


def _no_quant_tensors(floats):
    left = [k for k in floats if k.rsplit(".", 1)[-1] in _QUANT_SUFFIXES]
    assert not left, left


def _check_codes(floats, ck):
    """Each kept weight's float tensor is its codes' dequantization, bit for bit."""
    for name, codes in ck.codes.items():
        assert floats[name].dtype == torch.float32
        assert exact(codes, floats[name]), name
        assert torch.equal(floats[name], torch.from_numpy(codes.dequantize()))


# --------------------------------------------------------------------------------------- compressed-tensors

HAVE_CT = importlib.util.find_spec("compressed_tensors") is not None
needs_ct = pytest.mark.skipif(not HAVE_CT, reason="the compressed-tensors package (the oracle) is not installed")


def _tiny(dtype):
    torch.manual_seed(0)
    m = nn.Module()
    m.model = nn.Module()
    m.model.embed_tokens = nn.Embedding(100, 64)
    m.model.layers = nn.ModuleList()
    for _ in range(2):
        layer = nn.Module()
        layer.self_attn, layer.mlp = nn.Module(), nn.Module()
        layer.self_attn.q_proj = nn.Linear(64, 64, bias=False)
        layer.self_attn.o_proj = nn.Linear(64, 64, bias=False)
        layer.mlp.up_proj = nn.Linear(64, 96, bias=True)
        layer.mlp.down_proj = nn.Linear(96, 64, bias=False)
        layer.input_layernorm = nn.LayerNorm(64)
        m.model.layers.append(layer)
    m.lm_head = nn.Linear(64, 100, bias=False)
    return m.to(dtype)


def minmax(w, args):
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    if args.strategy == "group":
        g = w.reshape(w.shape[0], -1, args.group_size)
        return g.amin(-1), g.amax(-1)
    bh, bw = args.block_structure  # block: the padded edge blocks as compressed-tensors pads them
    from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

    p = maybe_pad_tensor_for_block_quant(w, tuple(args.block_structure))
    b = p.reshape(p.shape[0] // bh, bh, p.shape[1] // bw, bw)
    return b.amin((1, 3)), b.amax((1, 3))


def fill_qparams(model, scheme, seed: int, input_scale: float) -> None:
    """Each quantized module's weight scales and zero points from its weights' ranges (compressed-tensors'
    calculate_qparams, as its observers would set them) and a static input scale in [input_scale, + 0.02)."""
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    gen = torch.Generator().manual_seed(seed)
    for _, mod in model.named_modules():
        if getattr(mod, "quantization_scheme", None) is None:
            continue
        lo, hi = minmax(mod.weight.data, scheme.weights)
        s, z = calculate_qparams(lo, hi, scheme.weights)
        mod.weight_scale.data.copy_(s.reshape(mod.weight_scale.shape))
        if hasattr(mod, "weight_zero_point"):
            mod.weight_zero_point.data.copy_(z.reshape(mod.weight_zero_point.shape))
        if hasattr(mod, "input_scale"):
            mod.input_scale.data.fill_(input_scale + 0.02 * torch.rand((), generator=gen).item())


def _ct_checkpoint(tmp_path, preset, dtype=torch.float32, fmt=None, edit=None, ignore=("lm_head",), targets=("Linear",)):
    """A checkpoint written by compressed-tensors (ModelCompressor, as llm-compressor saves one): config.json and
    model.safetensors; and the package's own decompression of it (the oracle)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from safetensors.torch import load_file, save_file

    m = _tiny(dtype)
    plain = set(m.state_dict())
    scheme = preset_name_to_scheme(preset, list(targets))
    if edit:
        edit(scheme)
    apply_quantization_config(m, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    fill_qparams(m, scheme, seed=1, input_scale=0.01)
    for _, mod in m.named_modules():
        if hasattr(mod, "input_zero_point") and not scheme.input_activations.symmetric:
            mod.input_zero_point.data.fill_(3)
    compressor = ModelCompressor.from_pretrained_model(m, quantization_format=fmt)
    compressor.compress_model(m)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    compressor.update_config(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    compressor.decompress_model(m)
    oracle = {k: v.detach().clone() for k, v in m.state_dict().items() if k in plain}
    return config, tensors, oracle, plain


def _static_int8(scheme):
    from compressed_tensors.quantization import QuantizationArgs

    scheme.input_activations = QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False)


def _static_int8_asym(scheme):
    from compressed_tensors.quantization import QuantizationArgs

    scheme.input_activations = QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=False, dynamic=False)


def _group(size):
    def edit(scheme):
        scheme.weights.group_size = size
    return edit


def _block(bh, bw):
    def edit(scheme):
        scheme.weights.block_structure = [bh, bw]
    return edit


CT_CASES = {
    # name: (preset, format override, edit, expected format, codes, block of q_proj [64, 64], activation)
    "W8A8 int dynamic": ("W8A8", None, None, "int-quantized", "int8", 64, {"format": "int8", "scale": None}),
    "W8A8 int static": ("W8A8", None, _static_int8, "int-quantized", "int8", 64, "static int8"),
    "FP8 per-tensor static": ("FP8", None, None, "float-quantized", "fp8", 64, "static fp8"),
    "FP8 per-channel dynamic": ("FP8_DYNAMIC", None, None, "float-quantized", "fp8", 64, {"format": "fp8", "scale": None}),
    "W4A16 sym group 32": ("W4A16", None, _group(32), "pack-quantized", "int4", 32, None),
    "W4A16 asym group 32": ("W4A16_ASYM", None, _group(32), "pack-quantized", "int4", 32, None),
    "W8A16 group 32": ("W8A16", None, _group(32), "pack-quantized", "int8", 32, None),
    "W3A16 group 16 (dense 3-bit packing)": ("W3A16", None, _group(16), "pack-quantized", "int4", 16, None),
    "W4A16 naive-quantized": ("W4A16", "naive-quantized", _group(32), "naive-quantized", "int4", 32, None),
    # 64x64 blocks: up_proj's 96 rows and down_proj's 96 inputs end in half blocks (compressed-tensors pads them)
    "FP8 block 64x64": ("FP8_BLOCK", None, _block(64, 64), "float-quantized", "fp8", 64,
                        {"format": "fp8", "scale": None, "granularity": "token group", "group_size": 128}),
}


@needs_ct
@pytest.mark.parametrize("case", list(CT_CASES))
def test_compressed_tensors_matches_its_own_decompression(tmp_path, case):
    preset, fmt, edit, want_format, kind, block, activation = CT_CASES[case]
    config, tensors, oracle, plain = _ct_checkpoint(tmp_path, preset, fmt=fmt, edit=edit)
    assert config["quantization_config"]["format"] == want_format
    floats, ck = read_quantized(config, tensors)
    assert ck.format == "compressed-tensors"
    _no_quant_tensors(floats)
    assert set(floats) == plain  # the plain model's names, nothing more
    linears = {k for k in plain if k.endswith("_proj.weight")}
    assert set(ck.codes) == linears
    for name in linears:  # float32 model: the package decompresses in float32, so bit for bit
        assert floats[name].dtype == torch.float32
        assert torch.equal(floats[name], oracle[name]), name
    _check_codes(floats, ck)
    assert ck.kept_float == {"lm_head.weight": "float32 in the file (the quantization config leaves it unquantized)",
                             "model.embed_tokens.weight": "float32 in the file"}
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.up_proj.bias"):
        assert torch.equal(floats[name], tensors[name])
    q = ck.codes["model.layers.0.self_attn.q_proj.weight"]
    assert (q.kind, q.block) == (kind, block)
    assert q.input_order is None and q.offset is None
    assert (q.zero_point is not None) == ("ASYM" in preset)
    if activation in ("static int8", "static fp8"):
        scale = float(tensors["model.layers.0.self_attn.q_proj.input_scale"].float())
        assert q.activation == {"format": activation.split()[1], "scale": scale}
    else:
        assert q.activation == activation
    if preset == "FP8_BLOCK":  # 96 inputs in blocks of 64: one block and a half, blocks of 32
        assert ck.codes["model.layers.0.mlp.down_proj.weight"].block == 32


@needs_ct
def test_compressed_tensors_static_asymmetric_activations(tmp_path):
    config, tensors, oracle, _ = _ct_checkpoint(tmp_path, "W8A8", edit=_static_int8_asym)
    floats, ck = read_quantized(config, tensors)
    q = ck.codes["model.layers.1.mlp.up_proj.weight"]
    assert q.activation == {"format": "int8", "scale": float(tensors["model.layers.1.mlp.up_proj.input_scale"]),
                            "zero_point": 3}
    assert torch.equal(floats["model.layers.1.mlp.up_proj.weight"], oracle["model.layers.1.mlp.up_proj.weight"])


@needs_ct
@pytest.mark.parametrize("preset,edit", [("W4A16_ASYM", _group(32)), ("FP8_DYNAMIC", None), ("W8A8", None)])
def test_compressed_tensors_bfloat16(tmp_path, preset, edit):
    """A bfloat16 model: the package decompresses in bfloat16 (each product rounded once); kvforge's float32 is
    the exact product (a bfloat16 scale times a code of at most 9 bits fits float32), so it rounds to the
    package's result bit for bit."""
    config, tensors, oracle, _ = _ct_checkpoint(tmp_path, preset, dtype=torch.bfloat16, edit=edit)
    floats, ck = read_quantized(config, tensors)
    assert ck.codes
    for name in ck.codes:
        assert oracle[name].dtype == torch.bfloat16
        assert torch.equal(floats[name].to(torch.bfloat16), oracle[name]), name
    _check_codes(floats, ck)
    assert floats["lm_head.weight"].dtype == torch.bfloat16  # float tensors pass through as the file holds them


@needs_ct
def test_compressed_tensors_targets_and_ignore(tmp_path):
    """Only the modules the config groups target (here by regex) are quantized; the ignore list stays float."""
    config, tensors, oracle, _ = _ct_checkpoint(tmp_path, "W4A16", edit=_group(32), targets=("re:.*mlp\\..*",),
                                                ignore=("model.layers.1.mlp.down_proj",))
    floats, ck = read_quantized(config, tensors)
    assert set(ck.codes) == {"model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight",
                             "model.layers.1.mlp.up_proj.weight"}
    # the package writes every Linear its targets leave out into the ignore list too
    assert "model.layers.0.self_attn.q_proj" in config["quantization_config"]["ignore"]
    for name in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert ck.kept_float[name] == "float32 in the file (the quantization config leaves it unquantized)"
    for name in ck.codes:
        assert torch.equal(floats[name], oracle[name])
    _no_quant_tensors(floats)
    # without that list, the targets alone decide
    qc = {**config["quantization_config"], "ignore": ["model.layers.1.mlp.down_proj"]}
    floats2, ck2 = read_quantized({**config, "quantization_config": qc}, tensors)
    assert set(ck2.codes) == set(ck.codes)
    assert ck2.kept_float["model.layers.0.self_attn.q_proj.weight"] == "float32 in the file"


@needs_ct
def test_compressed_tensors_kv_cache_scales_are_removed(tmp_path):
    config, tensors, _, plain = _ct_checkpoint(tmp_path, "FP8", edit=None)
    qc = {**config["quantization_config"], "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                               "dynamic": False, "symmetric": True}}
    tensors = {**tensors, "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
               "model.layers.0.self_attn.v_scale": torch.tensor(0.25)}
    floats, _ = read_quantized({**config, "quantization_config": qc}, tensors)
    assert set(floats) == plain


@needs_ct
def test_compressed_tensors_refuses_what_it_cannot_read(tmp_path):
    config, tensors, _, _ = _ct_checkpoint(tmp_path, "W4A16", edit=_group(32))
    qc = config["quantization_config"]
    with pytest.raises(KvforgeError, match="nvfp4-pack-quantized"):
        read_quantized({**config, "quantization_config": {**qc, "format": "nvfp4-pack-quantized",
                                                          "config_groups": {"g": {**qc["config_groups"]["group_0"], "format": None}}}},
                       tensors)
    with pytest.raises(KvforgeError, match="transform_config"):
        read_quantized({**config, "quantization_config": {**qc, "transform_config": {"config_groups": {"u": {}}}}}, tensors)
    with pytest.raises(KvforgeError, match="ignore"):
        read_quantized({**config, "quantization_config": {**qc, "ignore": ["re:.*q_proj"]}}, tensors)


# ---------------------------------------------------------------------------------------------------- GPTQ


def _gptq_pack_rows(intweight: np.ndarray, bits: int) -> np.ndarray:
    """[in, out] codes -> qweight, as gptqmodel's PackableQuantLinear.pack_original packs them
    (gptqmodel/nn_modules/qlinear/__init__.py, the same layout as AutoGPTQ's QuantLinear.pack)."""
    iw = intweight.astype(np.uint32)
    qweight = np.zeros((math.ceil(iw.shape[0] * bits / 32), iw.shape[1]), dtype=np.uint32)
    if bits in (2, 4, 8):
        pack_factor = 32 // bits
        for row in range(qweight.shape[0]):
            for j in range(min(pack_factor, iw.shape[0] - row * pack_factor)):
                qweight[row] |= iw[row * pack_factor + j] << (bits * j)
        return qweight
    assert bits == 3  # pack_original's 3-bit branch, as written there
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 10):
            qweight[row] |= iw[j] << (3 * (j - i))
        i += 10
        qweight[row] |= iw[i] << 30
        row += 1
        qweight[row] |= (iw[i] >> 2) & 1
        i += 1
        for j in range(i, i + 10):
            qweight[row] |= iw[j] << (3 * (j - i) + 1)
        i += 10
        qweight[row] |= iw[i] << 31
        row += 1
        qweight[row] |= (iw[i] >> 1) & 0x3
        i += 1
        for j in range(i, i + 10):
            qweight[row] |= iw[j] << (3 * (j - i) + 2)
        i += 10
        row += 1
    return qweight


def _gptq_pack_cols(zeros: np.ndarray, bits: int) -> np.ndarray:
    """[groups, out] zero points -> qzeros (pack_original: packed along the output axis)."""
    return np.ascontiguousarray(_gptq_pack_rows(zeros.T, bits).T)


def gptq_tensors(rng, out, k, bits, group_size, act_order, sym, v1, prefix="model.layers.0.mlp.up_proj"):
    """GPTQ tensors from random integer codes, and the numpy dequantization of those codes (the oracle)."""
    gs = group_size if group_size > 0 else k
    groups = -(-k // gs)
    q = rng.integers(0, 1 << bits, size=(k, out))  # [in, out]: GPTQ's own orientation
    if sym:
        zeros = np.full((groups, out), 1 << (bits - 1))
    else:
        zeros = rng.integers(0, 1 << bits, size=(groups, out))
        zeros[0, :4] = 0  # zero points of 0: v1's "minus one" borrows across fields
        zeros[-1, :3] = (1 << bits) - 1
    scales = (rng.random((groups, out)) * 0.02 + 0.001).astype(np.float16)
    g_idx = np.arange(k) // gs
    if act_order:
        g_idx = rng.permutation(g_idx)  # desc_act: channel i's group, in the file's (original) channel order
    qzeros = _gptq_pack_cols(zeros, bits)
    if v1:  # gptqmodel's convert_gptq_v2_to_v1_format_module: the whole word minus one in every field
        if bits == 3:
            qzeros = _gptq_pack_cols((zeros - 1) & 7, 3)
        else:
            qzeros = qzeros - np.uint32({2: 0x55555555, 4: 0x11111111, 8: 0x01010101}[bits])
    tensors = {f"{prefix}.qweight": torch.from_numpy(_gptq_pack_rows(q, bits).view(np.int32)),
               f"{prefix}.qzeros": torch.from_numpy(qzeros.astype(np.uint32).view(np.int32)),
               f"{prefix}.scales": torch.from_numpy(scales),
               f"{prefix}.g_idx": torch.from_numpy(g_idx.astype(np.int32)),
               f"{prefix}.bias": torch.randn(out, dtype=torch.float16)}
    s32 = scales.astype(np.float32)
    oracle = ((q.astype(np.float32) - zeros[g_idx].astype(np.float32)) * s32[g_idx]).T  # [out, in]
    return tensors, np.ascontiguousarray(oracle)


def _gptq_config(bits, group_size, act_order, sym, v1):
    return {"quantization_config": {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                    "desc_act": act_order, "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"}}


@pytest.mark.parametrize("bits,group_size,act_order,sym,v1", [
    (4, 32, False, True, True), (4, 32, True, False, True), (4, 32, True, False, False), (8, 32, True, False, True),
    (8, -1, False, True, False), (4, -1, True, False, True), (3, 32, True, False, True), (2, 16, False, False, True)])
def test_gptq(bits, group_size, act_order, sym, v1):
    rng = np.random.default_rng(bits * 100 + group_size + 7 * act_order + 3 * sym + v1)
    tensors, oracle = gptq_tensors(rng, 64, 128, bits, group_size, act_order, sym, v1)
    tensors["model.embed_tokens.weight"] = torch.randn(10, 128, dtype=torch.float16)
    floats, ck = read_quantized(_gptq_config(bits, group_size, act_order, sym, v1), tensors)
    name = "model.layers.0.mlp.up_proj.weight"
    _no_quant_tensors(floats)
    assert set(floats) == {name, "model.layers.0.mlp.up_proj.bias", "model.embed_tokens.weight"}
    assert np.array_equal(floats[name].numpy().view(np.uint32), oracle.view(np.uint32))
    _check_codes(floats, ck)
    c = ck.codes[name]
    assert c.block == (group_size if group_size > 0 else 128)
    assert (c.input_order is not None) == (act_order and group_size > 0)
    assert (c.zero_point is None) == sym  # symmetric: signed codes, no zero point
    assert c.kind == ("int" if sym else "uint") + ("8" if bits == 8 else "4")
    assert ck.kept_float == {"model.embed_tokens.weight": "float16 in the file"}
    assert ck.format == "gptq" and c.activation is None


def test_gptq_uneven_groups():
    """in = 80 with group size 32: groups of 32, 32 and 16 are exact in blocks of 16; in = 72 (groups of 32, 32
    and 8: blocks of 8) stays float, with the reason."""
    rng = np.random.default_rng(5)
    for k, kept in ((80, True), (72, False)):
        tensors, oracle = gptq_tensors(rng, 64, k, 4, 32, True, False, True)
        floats, ck = read_quantized(_gptq_config(4, 32, True, False, True), tensors)
        name = "model.layers.0.mlp.up_proj.weight"
        assert np.array_equal(floats[name].numpy().view(np.uint32), oracle.view(np.uint32))
        assert (name in ck.codes) == kept
        if kept:
            assert ck.codes[name].block == 16 >= MIN_BLOCK
            _check_codes(floats, ck)
        else:
            assert "share no block" in ck.kept_float[name]


def test_gptq_dynamic_overrides():
    """gptqmodel's per-module `dynamic`: "+:" overrides bits and group size, "-:" leaves a module float."""
    rng = np.random.default_rng(9)
    tensors, oracle = gptq_tensors(rng, 64, 128, 8, 64, True, False, True)
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.randn(128, 64, dtype=torch.float16)
    config = _gptq_config(4, 32, True, False, True)
    config["quantization_config"]["dynamic"] = {"+:.*up_proj": {"bits": 8, "group_size": 64}, "-:.*down_proj": {}}
    floats, ck = read_quantized(config, tensors)
    name = "model.layers.0.mlp.up_proj.weight"
    assert np.array_equal(floats[name].numpy().view(np.uint32), oracle.view(np.uint32))
    assert (ck.codes[name].kind, ck.codes[name].block) == ("uint8", 64)
    assert ck.kept_float == {"model.layers.0.mlp.down_proj.weight":
                             "float16 in the file (the quantization config leaves it unquantized)"}


def test_gptq_refuses_other_formats():
    rng = np.random.default_rng(0)
    tensors, _ = gptq_tensors(rng, 64, 64, 4, 32, False, True, True)
    config = _gptq_config(4, 32, False, True, True)
    config["quantization_config"]["checkpoint_format"] = "marlin"
    with pytest.raises(KvforgeError, match="marlin"):
        read_quantized(config, tensors)


# ---------------------------------------------------------------------------------------------------- AWQ

_AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


def _awq_pack(intweight: np.ndarray) -> np.ndarray:
    """[rows, out] 4-bit codes -> int32 [rows, out / 8], as AutoAWQ's WQLinear_GEMM.from_linear packs qweight and
    qzeros (awq/modules/linear/gemm.py: qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4))."""
    iw = intweight.astype(np.uint32)
    packed = np.zeros((iw.shape[0], iw.shape[1] // 8), dtype=np.uint32)
    for col in range(iw.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= iw[:, col * 8 + _AWQ_ORDER_MAP[i]] << (i * 4)
    return packed.view(np.int32)


def _awq_tensors(rng, out, k, gs, prefix="model.layers.0.self_attn.o_proj"):
    q = rng.integers(0, 16, size=(out, k))  # [out, in]
    groups = k // gs
    zeros = rng.integers(0, 16, size=(groups, out))
    scales = (rng.random((groups, out)) * 0.02 + 0.001).astype(np.float16)
    tensors = {f"{prefix}.qweight": torch.from_numpy(_awq_pack(q.T)),  # from_linear packs intweight.t()
               f"{prefix}.qzeros": torch.from_numpy(_awq_pack(zeros)),
               f"{prefix}.scales": torch.from_numpy(scales)}
    g = np.arange(k) // gs
    oracle = (q.astype(np.float32) - zeros.T[:, g].astype(np.float32)) * scales.T.astype(np.float32)[:, g]
    return tensors, oracle


def test_awq():
    rng = np.random.default_rng(3)
    tensors, oracle = _awq_tensors(rng, 64, 128, 32)
    tensors["lm_head.weight"] = torch.randn(10, 64, dtype=torch.float16)
    config = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                      "version": "gemm", "modules_to_not_convert": ["lm_head"]}}
    floats, ck = read_quantized(config, dict(tensors))
    name = "model.layers.0.self_attn.o_proj.weight"
    _no_quant_tensors(floats)
    assert set(floats) == {name, "lm_head.weight"}
    assert np.array_equal(floats[name].numpy().view(np.uint32), oracle.view(np.uint32))
    _check_codes(floats, ck)
    c = ck.codes[name]
    assert (c.kind, c.block, c.zero_point is not None, c.input_order) == ("uint4", 32, True, None)
    assert ck.format == "awq"
    assert ck.kept_float == {"lm_head.weight": "float16 in the file (the quantization config leaves it unquantized)"}

    # compressed-tensors' AutoAWQConverter unpacks AWQ into its pack-quantized form; its decompression (float16
    # arithmetic on float16 scales) is kvforge's exact float32 product rounded to float16
    if not HAVE_CT:
        return
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    converter = AutoAWQConverter.from_autoawq_config(config["quantization_config"])
    converted = converter.process(dict(tensors))
    scheme = converter._build_quant_config().config_groups["config_group_0"]
    prefix = "model.layers.0.self_attn.o_proj"
    state = {k.removeprefix(prefix + "."): v for k, v in converted.items() if k.startswith(prefix)}
    ct_weight = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    assert ct_weight.dtype == torch.float16
    assert torch.equal(floats[name].to(torch.float16), ct_weight)
    state["weight_scale"] = state["weight_scale"].float()  # float32 scales: the package's float32 product
    assert torch.equal(floats[name], PackedQuantizationCompressor.decompress(state, scheme)["weight"])


def test_awq_refuses_other_versions():
    rng = np.random.default_rng(4)
    tensors, _ = _awq_tensors(rng, 64, 64, 32)
    with pytest.raises(KvforgeError, match="gemv"):
        read_quantized({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32,
                                                "version": "gemv"}}, tensors)


# ---------------------------------------------------------------------------------------------------- block FP8


def _fp8_block_oracle(weight: torch.Tensor, scale_inv: torch.Tensor, b=128) -> torch.Tensor:
    out, k = weight.shape
    s = scale_inv.float().repeat_interleave(b, 0)[:out].repeat_interleave(b, 1)[:, :k]
    return weight.float() * s


def test_block_fp8():
    """DeepSeek-V3's layout: [200, 320] (rows end in a partial block of 72, inputs in one of 64: blocks of 64)
    keeps its codes; [136, 200] (inputs end in a block of 72: a common block of 8) stays float."""
    torch.manual_seed(0)
    config = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}}
    tensors, oracles = {}, {}
    for name, (out, k) in {"model.layers.0.mlp.gate_proj": (200, 320), "model.layers.0.mlp.down_proj": (136, 200)}.items():
        w = (torch.randn(out, k) * 100).to(torch.float8_e4m3fn)
        s = torch.rand(-(-out // 128), -(-k // 128)) * 0.01 + 1e-4
        tensors[name + ".weight"], tensors[name + ".weight_scale_inv"] = w, s
        oracles[name + ".weight"] = _fp8_block_oracle(w, s)
    tensors["model.norm.weight"] = torch.ones(320, dtype=torch.bfloat16)
    floats, ck = read_quantized(config, dict(tensors))
    _no_quant_tensors(floats)
    assert set(floats) == set(oracles) | {"model.norm.weight"}
    for name, want in oracles.items():
        assert floats[name].dtype == torch.float32
        assert torch.equal(floats[name], want), name
    _check_codes(floats, ck)
    assert set(ck.codes) == {"model.layers.0.mlp.gate_proj.weight"}
    c = ck.codes["model.layers.0.mlp.gate_proj.weight"]
    assert (c.kind, c.block, c.shape) == ("fp8", 64, (200, 320))
    assert c.activation == {"format": "fp8", "scale": None, "granularity": "token group", "group_size": 128}
    assert "share no block" in ck.kept_float["model.layers.0.mlp.down_proj.weight"]
    assert ck.format == "fp8-block"

    # the same dequantization by transformers' FineGrainedFP8 (5.x) and compressed-tensors' FP8BlockDequantizer
    try:
        from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    except ImportError:
        _dequantize_fp8_weight = None
    for name in oracles:
        w, s = tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"]
        if _dequantize_fp8_weight is not None:
            assert torch.equal(floats[name], _dequantize_fp8_weight(w, s, [128, 128], torch.float32))
        if HAVE_CT:
            from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

            assert torch.equal(floats[name], FP8BlockDequantizer(dtype=torch.float32)._create_dequantized_weight(w, s))


def test_fp8_per_tensor_static():
    torch.manual_seed(1)
    w = (torch.randn(64, 96) * 50).to(torch.float8_e4m3fn)
    tensors = {"lm.o_proj.weight": w, "lm.o_proj.weight_scale_inv": torch.tensor(0.0031),
               "lm.o_proj.activation_scale": torch.tensor(0.25)}
    config = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None}}
    floats, ck = read_quantized(config, tensors)
    assert set(floats) == {"lm.o_proj.weight"}
    assert torch.equal(floats["lm.o_proj.weight"], w.float() * torch.tensor(0.0031))
    c = ck.codes["lm.o_proj.weight"]
    assert (c.block, c.activation) == (96, {"format": "fp8", "scale": 0.25})


# ---------------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq", "torchao", "exl2"])
def test_unknown_quant_method_is_refused(method):
    with pytest.raises(KvforgeError) as e:
        read_quantized({"quantization_config": {"quant_method": method}}, {})
    message = str(e.value)
    assert method in message
    for readable in ("compressed-tensors", "gptq", "awq", "fp8"):
        assert readable in message


def test_no_quantization_config_is_refused():
    with pytest.raises(KvforgeError, match="no quantization_config"):
        read_quantized({"architectures": ["LlamaForCausalLM"]}, {})
