"""Pre-quantized Hugging Face safetensors checkpoints (config.json with a `quantization_config`) read into
kvforge's one form of a quantized weight, WeightCodes (model_defs/quantized.py).

    read_quantized(hf_config, tensors) -> (float tensors, QuantizedCheckpoint)

`tensors` are the checkpoint's raw safetensors tensors. The float tensors come back under the plain model's names
(`...q_proj.weight`), each quantized weight as float32 equal bit for bit to its codes' dequantization, with every
quantization tensor gone (qweight, qzeros, scales, g_idx, weight_packed, weight_shape, weight_scale,
weight_zero_point, weight_g_idx, weight_scale_inv, input_scale, activation_scale, kv-cache k_scale/v_scale, ...);
the other tensors pass through as the file holds them. The codes are keyed by the checkpoint's weight name.

| quant_method        | tensors of one weight                                  | codes            | block             |
|---------------------|--------------------------------------------------------|------------------|-------------------|
| compressed-tensors  | int-/float-/naive-quantized: weight (int8 or FP8 E4M3),| int4/int8 or fp8 | in (tensor,       |
|                     | weight_scale, weight_zero_point; pack-quantized:       | (signed, zero    | channel), group,  |
|                     | weight_packed (int32, dense along in), weight_shape,   | point signed)    | block's columns   |
|                     | weight_zero_point (int32, packed along out)            |                  |                   |
| gptq                | qweight (int32 along in), qzeros (int32 along out),    | uint4 / uint8    | group_size        |
|                     | scales [groups, out], g_idx (act-order); 2, 3, 4, 8 bit| or signed (sym)  | (in: -1)          |
| awq (gemm)          | qweight / qzeros (int32 along out, AWQ's interleave),  | uint4, or int4   | group_size        |
|                     | scales [groups, out]                                   |                  |                   |
| fp8 (block FP8)     | weight (FP8 E4M3), weight_scale_inv [ceil(out/bh),     | fp8              | bw along in, rows |
|                     | ceil(in/bw)] (or one value: per tensor)                |                  | expanded          |

Every weight is w = (codes - zero_point) * scale in float32: the format's own dequantization, in the file's input
order and with its own group indexing, is computed here independently of the codes and compared with
`quantized.exact` before the codes are claimed. Zero points that are all zero are dropped, and unsigned codes
whose zero points are all at mid-range (GPTQ's symmetric 8 for 4 bits) become signed codes without one.

Blocks: WeightCodes has one block length along `in`. A format's groups (in the codes' column order: act-order
sorts the input channels by g_idx, `input_order`) become blocks of the greatest common divisor of the groups'
lengths, each block lying inside one group, so a last partial group (in not a multiple of the group size, FP8's
128) still has exact codes. Where that divisor is below MIN_BLOCK and the groups are not all of one length the
weight stays float, with the reason in `kept_float`.

W8A8 schemes carry `activation`: {"format": "int8" | "fp8", "scale": float (static, per tensor) or None
(dynamic)}; dynamic quantization that is not per token adds "granularity" ("tensor", "token group") and
"group_size"; a static asymmetric scheme adds "zero_point" (int).

Layouts followed (the oracles in tests/model_defs/test_hf_quantized.py): compressed-tensors' own compressors
(compressors/pack_quantized/helpers.py pack_to_int32, naive_quantized/base.py; quantization/lifecycle/forward.py
dequantize); GPTQ as gptqmodel packs it (nn_modules/qlinear PackableQuantLinear.pack_original: qweight field j of
row r is input channel r * 32/bits + j, qzeros field j of column c is output c * 32/bits + j; 3 bits as one dense
little-endian bit stream) with checkpoint_format "gptq" (v1: every zero stored minus one, undone as
gptqmodel's convert_gptq_v1_to_v2_format_module does, by adding 0x11111111 (4 bits) / 0x01010101 (8) /
0x55555555 (2) to each int32 word, the exact inverse of its v2 -> v1 subtraction; field-wise for 3 bits) or
"gptq_v2" (stored as is); AWQ as AutoAWQ's WQLinear_GEMM.from_linear packs it (order_map [0, 2, 4, 6, 1, 3, 5, 7]
within each word) and compressed-tensors' AutoAWQConverter unpacks it (no qzeros: zero point 8); block FP8 as
DeepSeek-V3 / transformers' FineGrainedFP8 stores it (weight.float() * weight_scale_inv over bh x bw blocks).

Not read (KvforgeError): other quant_methods; GPTQ formats marlin / bitblas / gptq_p (planar 5-7 bits) and
AWQ versions other than gemm; compressed-tensors formats other than int-, float-, naive- and pack-quantized (and
mixed-precision made of those), tensor-group (NVFP4 global scales), transforms (online rotations), sparsity
compression; quantized weights that are not 2-D (fused MoE experts); pack-quantized 3/5/6/7-bit weights in the
older padded layout.
"""

from __future__ import annotations

import math
import re
from functools import reduce
from typing import Any

import numpy as np
import torch

from kvforge.errors import KvforgeError

from .quantized import QuantizedCheckpoint, WeightCodes, as_codes, exact

READ_METHODS = ("compressed-tensors", "gptq", "awq", "fp8")
MIN_BLOCK = 16  # the shortest block a split of unequal groups may use before the weight stays float

_CT_FORMATS = ("int-quantized", "float-quantized", "naive-quantized", "pack-quantized")
# per-module tensors that are quantization parameters, never model weights
_CT_PARAMS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx",
              "weight_global_scale", "input_scale", "input_zero_point", "input_global_scale", "output_scale",
              "output_zero_point", "output_global_scale")
_KV_PARAMS = ("k_scale", "v_scale", "q_scale", "k_zero_point", "v_zero_point", "q_zero_point")


def read_quantized(hf_config: dict[str, Any], tensors: dict[str, torch.Tensor]
                   ) -> tuple[dict[str, torch.Tensor], QuantizedCheckpoint]:
    """A pre-quantized checkpoint's float tensors (quantized weights as float32, exactly their codes'
    dequantization; quantization tensors removed) and its codes (see the module docstring)."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict):
        raise KvforgeError("config.json has no quantization_config: the checkpoint is not pre-quantized")
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    readers = {"compressed-tensors": _read_compressed_tensors, "gptq": _read_gptq, "awq": _read_awq,
               "fp8": _read_fp8}
    if method not in readers:
        raise KvforgeError(f"quantization_config.quant_method {qc.get('quant_method')!r} is not read by kvforge: "
                           f"it reads {', '.join(READ_METHODS)} (fp8: block FP8 as DeepSeek-V3 stores it)")
    result = _Result(dict(tensors), QuantizedCheckpoint(_FORMAT_NAMES[method], dict(qc)))
    readers[method](qc, result)
    result.note_float_weights()
    return result.tensors, result.checkpoint


_FORMAT_NAMES = {"compressed-tensors": "compressed-tensors", "gptq": "gptq", "awq": "awq", "fp8": "fp8-block"}


class _Result:
    """The tensors being rewritten and the checkpoint's record."""

    def __init__(self, tensors: dict[str, torch.Tensor], checkpoint: QuantizedCheckpoint):
        self.tensors = tensors
        self.checkpoint = checkpoint
        self.quantized: set[str] = set()  # weight names that were quantized in the file
        self.ignored: set[str] = set()  # modules the config names as not quantized

    def modules(self, marker: str) -> dict[str, dict[str, torch.Tensor]]:
        """module name -> its tensors (by their last name component), for each module that has `marker`."""
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in self.tensors.items():
            module, _, param = key.rpartition(".")
            by_module.setdefault(module, {})[param] = value
        return {m: params for m, params in sorted(by_module.items()) if marker in params}

    def float_weights(self) -> list[str]:
        """The modules whose weight is a 2-D float tensor that was not quantized in the file."""
        return [k[: -len(".weight")] for k, t in self.tensors.items()
                if k.endswith(".weight") and k not in self.quantized and t.ndim == 2 and t.is_floating_point()]

    def drop(self, module: str, params) -> None:
        for p in params:
            self.tensors.pop(f"{module}.{p}", None)

    def put(self, name: str, codes: WeightCodes | None, reference: np.ndarray, why: str | None) -> None:
        """The weight `name`: its codes where they reproduce `reference` (the format's dequantization)."""
        self.quantized.add(name)
        if codes is not None and exact(codes, reference):
            self.checkpoint.codes[name] = codes
            self.tensors[name] = torch.from_numpy(reference)  # exact: codes.dequantize(), bit for bit
            return
        self.tensors[name] = torch.from_numpy(np.ascontiguousarray(reference, np.float32))
        self.checkpoint.kept_float[name] = why or "the codes do not reproduce the format's dequantization bit for bit"

    def note_float_weights(self) -> None:
        """kept_float for the 2-D weights the file holds in float."""
        for module in self.float_weights():
            name = module + ".weight"
            why = f"{str(self.tensors[name].dtype).removeprefix('torch.')} in the file"
            if module in self.ignored:
                why += " (the quantization config leaves it unquantized)"
            self.checkpoint.kept_float.setdefault(name, why)

    def ignore_by_substring(self, names) -> None:
        """AutoAWQ's and transformers' modules_to_not_convert: a module whose name contains one of `names`."""
        names = [n for n in names or [] if n]
        self.ignored.update(m for m in self.float_weights() if any(n in m for n in names))


# ---------------------------------------------------------------------------------------------------- helpers


def _f32(t: torch.Tensor) -> np.ndarray:
    """A scale tensor as float32 (bfloat16, float16, float8_e8m0fnu and float32 convert exactly)."""
    return t.detach().cpu().to(torch.float32).numpy()


def _fp8(t: torch.Tensor, name: str) -> np.ndarray:
    import ml_dtypes

    if t.dtype != torch.float8_e4m3fn:
        raise KvforgeError(f"{name} is {t.dtype}, not float8_e4m3fn: kvforge reads FP8 E4M3 weights only")
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)


def _ints(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.int16)


def _unpack(words: np.ndarray, bits: int, count: int, what: str) -> np.ndarray:
    """`count` unsigned fields of `bits` bits from int32 words along the last axis, as one little-endian bit
    stream per row (field i at bit i * bits; for 1, 2, 4, 8 bits: field j of word w is value w * 32/bits + j)."""
    w = np.ascontiguousarray(words)
    if w.dtype not in (np.int32, np.uint32):
        raise KvforgeError(f"{what} is {w.dtype}, not int32 words")
    w = w.view(np.uint32)
    need = -(-count * bits // 32)
    if w.shape[-1] != need:
        raise KvforgeError(f"{what} has {w.shape[-1]} int32 words along its packed axis, not the {need} that "
                           f"{count} {bits}-bit values take")
    if 32 % bits == 0:
        shifts = np.arange(32 // bits, dtype=np.uint32) * np.uint32(bits)
        f = ((w[..., None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(*w.shape[:-1], -1)
    else:
        b = np.unpackbits(w.astype("<u4").view(np.uint8), axis=-1, bitorder="little")
        b = b[..., : count * bits].reshape(*w.shape[:-1], count, bits).astype(np.uint16)
        f = (b << np.arange(bits, dtype=np.uint16)).sum(-1)
    return f[..., :count].astype(np.int16)


def _kind(bits: int, signed: bool) -> str:
    if not 1 <= bits <= 8:
        raise KvforgeError(f"{bits}-bit codes: kvforge reads codes of 1 to 8 bits")
    return ("int" if signed else "uint") + ("4" if bits <= 4 else "8")


def _runs(sorted_groups: np.ndarray) -> np.ndarray:
    cuts = np.flatnonzero(np.diff(sorted_groups)) + 1
    return np.diff(np.concatenate([[0], cuts, [len(sorted_groups)]]))


def _codes(q: np.ndarray, kind: str, scale: np.ndarray, zero: np.ndarray | None, groups: np.ndarray, source: str,
           activation: dict[str, Any] | None = None, bits: int = 8) -> tuple[WeightCodes | None, np.ndarray, str | None]:
    """A weight's codes and the format's own dequantization.

    q: [out, in] codes in the file's input order (int16 values of `bits` bits, or FP8 E4M3); scale, zero: [out, n]
    one column per group (rows already expanded); groups: [in], each input channel's group column. Returns (codes
    or None, reference float32 [out, in], why the codes were not kept)."""
    gi = torch.from_numpy(np.ascontiguousarray(groups, np.int64))
    s = np.ascontiguousarray(scale, np.float32)
    # the format's dequantization in the file's input order (torch for the gathers; its float32 subtraction and
    # multiplication round as numpy's and WeightCodes.dequantize's do)
    s_el = torch.from_numpy(s).index_select(1, gi)
    if zero is not None:
        z_el = torch.from_numpy(np.ascontiguousarray(zero, np.float32)).index_select(1, gi)
        reference = ((_float(q) - z_el) * s_el).numpy()
    else:
        reference = (_float(q) * s_el).numpy()
    if kind != "fp8" and zero is not None:
        if not zero.any():
            zero = None
        elif kind.startswith("uint") and np.all(zero == 1 << (bits - 1)):  # symmetric: signed codes, no zero point
            q, zero, kind = q - (1 << (bits - 1)), None, kind[1:]
    groups = gi.numpy()
    order = np.argsort(groups, kind="stable")
    identity = bool(np.array_equal(order, np.arange(len(order))))
    sg = groups[order]
    runs = _runs(sg)
    block = reduce(math.gcd, runs.tolist())
    if block < MIN_BLOCK and len(set(runs.tolist())) > 1:
        sizes = sorted(set(runs.tolist()))
        return None, reference, (f"{source}: groups of {sizes} input channels share no block of at least "
                                 f"{MIN_BLOCK} (their common divisor is {block})")
    cols = sg[::block]
    codes_q = q if identity else _columns(q, order)
    codes = WeightCodes(as_codes(codes_q, kind), np.ascontiguousarray(s[:, cols]), block,
                        zero_point=None if zero is None else as_codes(np.ascontiguousarray(zero[:, cols]), kind),
                        source=source, input_order=None if identity else order, activation=activation)
    return codes, reference, None


def _float(q: np.ndarray) -> torch.Tensor:
    """Codes (int16 values or FP8 E4M3) as a float32 tensor."""
    if q.dtype == np.int16:
        return torch.from_numpy(np.ascontiguousarray(q)).to(torch.float32)
    return torch.from_numpy(np.ascontiguousarray(q).view(np.uint8)).view(torch.float8_e4m3fn).to(torch.float32)


def _columns(q: np.ndarray, order: np.ndarray) -> np.ndarray:
    """q[:, order] (int16 or FP8 codes), gathered by torch."""
    index = torch.from_numpy(order.astype(np.int64))
    if q.dtype == np.int16:
        return torch.from_numpy(np.ascontiguousarray(q)).index_select(1, index).numpy()
    return torch.from_numpy(np.ascontiguousarray(q).view(np.uint8)).index_select(1, index).numpy().view(q.dtype)


# ---------------------------------------------------------------------------------------- compressed-tensors


def _ct_schemes(qc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    groups = qc.get("config_groups") or {}
    schemes = {}
    for name, scheme in groups.items():
        if isinstance(scheme, list):  # a preset name mapped to its targets
            try:
                from compressed_tensors.quantization import preset_name_to_scheme
            except ImportError as e:
                raise KvforgeError(f"quantization_config.config_groups names the preset scheme {name!r}: "
                                   "reading it needs the compressed-tensors package (pip install compressed-tensors)") from e
            scheme = preset_name_to_scheme(name, scheme).model_dump(mode="json")
        schemes[name] = scheme
    return schemes


def _ct_match(name: str, target: str) -> int | None:
    """compressed-tensors' matching (utils/match.py): 0 exact name, 1 "re:" regex (re.match), 2 a class name. A
    module's class is not in the file: "...Embedding" matches the modules named like embeddings, "...Linear" the
    others, any other class name (3) any module."""
    if target.startswith("re:"):
        return 1 if re.match(target[3:], name) else None
    if target == name:
        return 0
    if not re.fullmatch(r"[A-Z]\w*", target):
        return None
    embedding = re.search(r"(^|\.)(embed\w*|wte|wpe|shared|word_embeddings)$", name) is not None
    if target.endswith("Embedding"):
        return 2 if embedding else None
    if target.endswith("Linear"):
        return None if embedding else 2
    return 3


def _ct_scheme(module: str, schemes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    best = None
    for gname, scheme in schemes.items():
        for target in scheme.get("targets") or []:
            rank = _ct_match(module, target)
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, gname)
    if best is None:
        raise KvforgeError(f"{module} holds quantized tensors but no config group of quantization_config targets it")
    return schemes[best[1]]


def _ct_ignored(module: str, ignore: list[str]) -> bool:
    return any(_ct_match(module, t) in (0, 1) for t in ignore)


def _activation(args: dict[str, Any] | None, params: dict[str, torch.Tensor], module: str) -> dict[str, Any] | None:
    if not args:
        return None
    kind, bits = args.get("type", "int"), args.get("num_bits", 8)
    if bits != 8 or kind not in ("int", "float"):
        raise KvforgeError(f"{module}: its input activations are quantized to {bits}-bit {kind}: kvforge reads "
                           "8-bit (int8, fp8) activation quantization only")
    fmt = "int8" if kind == "int" else "fp8"
    strategy = args.get("strategy") or "tensor"
    if args.get("dynamic") in (True, "true", "True"):
        if not args.get("symmetric", True):
            raise KvforgeError(f"{module}: dynamic asymmetric activation quantization is not read (symmetric only)")
        act: dict[str, Any] = {"format": fmt, "scale": None}
        if strategy == "tensor":
            act["granularity"] = "tensor"
        elif strategy == "group":
            act.update(granularity="token group", group_size=int(args.get("group_size")))
        elif strategy != "token":
            raise KvforgeError(f"{module}: dynamic {strategy} activation quantization is not read")
        return act
    if strategy != "tensor" or "input_scale" not in params or params["input_scale"].numel() != 1:
        raise KvforgeError(f"{module}: static activation quantization other than one scale per tensor "
                           f"({strategy}) is not read")
    act = {"format": fmt, "scale": float(_f32(params["input_scale"]).reshape(-1)[0])}
    if not args.get("symmetric", True) and "input_zero_point" in params:
        act["zero_point"] = int(_ints(params["input_zero_point"]).reshape(-1)[0])
    return act


def _read_compressed_tensors(qc: dict[str, Any], result: _Result) -> None:
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise KvforgeError(f"compressed-tensors checkpoint with quantization_status {status!r}: kvforge reads "
                           "compressed checkpoints (quantization_status 'compressed')")
    transform = qc.get("transform_config")
    if transform and (transform.get("config_groups") if isinstance(transform, dict) else True):
        raise KvforgeError("compressed-tensors checkpoint with a transform_config (online rotations): its weights "
                           "alone do not define the model, and kvforge does not read it")
    sparsity = qc.get("sparsity_config")
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise KvforgeError(f"compressed-tensors sparsity format {sparsity.get('format')!r} is not read")
    top = qc.get("format") or "fakequant"
    schemes = _ct_schemes(qc)
    ignore = list(qc.get("ignore") or [])
    modules = {**result.modules("weight_scale"), **result.modules("weight_packed")}
    for module in sorted(modules):
        params = modules[module]
        if _ct_ignored(module, ignore):
            raise KvforgeError(f"{module} is in quantization_config.ignore but holds quantized tensors")
        scheme = _ct_scheme(module, schemes)
        fmt = scheme.get("format") or top
        if fmt == "mixed-precision":
            fmt = "pack-quantized" if "weight_packed" in params else "naive-quantized"
        if fmt not in _CT_FORMATS:
            raise KvforgeError(f"{module}: compressed-tensors format {fmt!r} is not read: kvforge reads "
                               f"{', '.join(_CT_FORMATS)} (and mixed-precision of those)")
        name = module + ".weight"
        codes, reference, why = _ct_weight(module, params, scheme, fmt)
        result.put(name, codes, reference, why)
        result.drop(module, _CT_PARAMS)
    result.ignored.update(m for m in result.float_weights() if _ct_ignored(m, ignore))
    # what is left: activation-only quantization of float weights, the kv cache's scales
    drop = _CT_PARAMS + (_KV_PARAMS if qc.get("kv_cache_scheme") else ())
    for k in [k for k in result.tensors if k.rpartition(".")[2] in drop]:
        del result.tensors[k]


def _ct_weight(module: str, params: dict[str, torch.Tensor], scheme: dict[str, Any], fmt: str):
    args = scheme.get("weights")
    if not args:
        raise KvforgeError(f"{module} holds quantized tensors but its scheme quantizes no weights")
    bits, wtype = int(args.get("num_bits", 8)), args.get("type", "int")
    strategy = args.get("strategy") or "tensor"
    if "weight_global_scale" in params or strategy == "tensor_group":
        raise KvforgeError(f"{module}: tensor-group quantization (a global scale, NVFP4) is not read")
    if wtype == "float" and bits != 8:
        raise KvforgeError(f"{module}: {bits}-bit float weights are not read (FP8 E4M3 is)")
    if "weight_packed" in params:
        shape = tuple(int(d) for d in params["weight_shape"].reshape(-1).tolist())
        if len(shape) != 2:
            raise KvforgeError(f"{module}: a quantized weight of shape {shape}: kvforge reads 2-D weights")
        out, k = shape
        packed = params["weight_packed"].detach().cpu().numpy()
        if packed.ndim != 2 or packed.shape[0] != out:
            raise KvforgeError(f"{module}.weight_packed has shape {packed.shape}, not [{out}, ...]")
        if packed.shape[1] != -(-k * bits // 32) and 32 % bits and packed.shape[1] == -(-k // (32 // bits)):
            raise KvforgeError(f"{module}: {bits}-bit values packed {32 // bits} to a word (the older padded "
                               "layout) are not read")
        q = _unpack(packed, bits, k, f"{module}.weight_packed") - (1 << (bits - 1))
        kind = _kind(bits, True)
    else:
        w = params["weight"]
        if w.ndim != 2:
            raise KvforgeError(f"{module}: a quantized weight of shape {tuple(w.shape)}: kvforge reads 2-D weights")
        out, k = w.shape
        if wtype == "float":
            q, kind = _fp8(w, module + ".weight"), "fp8"
        else:
            if w.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32):
                raise KvforgeError(f"{module}.weight is {w.dtype}: int{bits} codes were expected")
            q, kind = _ints(w), _kind(bits, True)
    scale = _f32(params["weight_scale"])
    zero = None
    if not args.get("symmetric", True):
        if wtype == "float":
            raise KvforgeError(f"{module}: asymmetric float weights are not read")
        zp = params.get("weight_zero_point")
        if zp is None:
            raise KvforgeError(f"{module}: asymmetric weights without weight_zero_point")
        if zp.dtype == torch.int32 and "weight_packed" in params:
            zero = _ct_zero_points(zp.detach().cpu().numpy(), bits, scale.shape, module)
        else:
            zero = _ints(zp)
    scale_full, zero_full, groups, label = _ct_layout(module, strategy, args, scale, zero, out, k)
    g_idx = params.get("weight_g_idx")
    if g_idx is not None and strategy == "group":
        g = g_idx.detach().cpu().numpy().astype(np.int64).reshape(-1)
        if not np.all(g == -1):  # compressed-tensors initialized g_idx to -1 where no act-order ran
            if g.shape != (k,) or g.min() < 0 or g.max() >= scale_full.shape[1]:
                raise KvforgeError(f"{module}.weight_g_idx does not index its {scale_full.shape[1]} groups")
            groups, label = g, label + " act-order"
    source = f"compressed-tensors {fmt} {'fp8' if kind == 'fp8' else f'int{bits}'} {label}"
    activation = _activation(scheme.get("input_activations"), params, module)
    return _codes(q, kind, scale_full, zero_full, groups, source, activation, bits=bits)


def _ct_zero_points(zp: np.ndarray, bits: int, scale_shape: tuple[int, ...], module: str) -> np.ndarray:
    """pack-quantized zero points: int32 packed along the output axis (packed_dim=0), offset by 2^(bits-1)."""
    out, n = scale_shape
    if zp.shape[1:] == (n,) and zp.shape[0] == -(-out * bits // 32):
        return _unpack(zp.T, bits, out, f"{module}.weight_zero_point").T - (1 << (bits - 1))
    if zp.shape[0] == out and zp.shape[1] == -(-n * bits // 32):  # packed along the groups
        return _unpack(zp, bits, n, f"{module}.weight_zero_point") - (1 << (bits - 1))
    raise KvforgeError(f"{module}.weight_zero_point has shape {zp.shape}: not {bits}-bit zero points for scales "
                       f"of shape {scale_shape}")


def _ct_layout(module, strategy, args, scale, zero, out, k):
    """Per-row scales [out, n], zero points and each input channel's column for one strategy."""
    def every_row(a):
        return None if a is None else np.full((out, 1), a.reshape(-1)[0], a.dtype)

    if strategy == "tensor":
        if scale.size != 1 or (zero is not None and zero.size != 1):
            raise KvforgeError(f"{module}.weight_scale has {scale.size} values for tensor quantization")
        return every_row(scale), every_row(zero), np.zeros(k, np.int64), "tensor"
    if strategy == "channel":
        if scale.size != out:
            raise KvforgeError(f"{module}.weight_scale has shape {scale.shape} for channel quantization of {out} rows")
        return scale.reshape(out, 1), None if zero is None else zero.reshape(out, 1), np.zeros(k, np.int64), "channel"
    if strategy == "group":
        gs = int(args.get("group_size") or 0)
        n = -(-k // gs) if gs > 0 else 0
        if gs <= 0 or scale.shape != (out, n):
            raise KvforgeError(f"{module}.weight_scale has shape {scale.shape}, not [{out}, {n}] for group size {gs}")
        if zero is not None:
            zero = zero.reshape(out, n)
        return scale, zero, np.arange(k) // gs, f"group {gs}"
    if strategy == "block":
        bh, bw = (int(v) for v in args.get("block_structure") or (0, 0))
        if bh <= 0 or bw <= 0 or scale.ndim != 2 or scale.shape[0] * bh < out or scale.shape[1] * bw < k:
            raise KvforgeError(f"{module}.weight_scale has shape {scale.shape}: not block {bh}x{bw} scales for "
                               f"a [{out}, {k}] weight")
        r = np.arange(out) // bh
        return (np.ascontiguousarray(scale[r]), None if zero is None else np.ascontiguousarray(zero[r]),
                np.arange(k) // bw, f"block {bh}x{bw}")
    raise KvforgeError(f"{module}: weight quantization strategy {strategy!r} is not read")


# ---------------------------------------------------------------------------------------------------- GPTQ


def _gptq_overrides(qc: dict[str, Any], module: str) -> dict[str, Any] | None:
    """gptqmodel's `dynamic`: per-module overrides ("+:" or bare regex) or exclusions ("-:"), by re.match."""
    for pattern, values in (qc.get("dynamic") or {}).items():
        negative = pattern.startswith("-:")
        if re.match(pattern.removeprefix("+:").removeprefix("-:"), module):
            return None if negative else dict(values or {})
    return {}


_V1_WORD = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


def _read_gptq(qc: dict[str, Any], result: _Result) -> None:
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise KvforgeError(f"GPTQ checkpoint_format {fmt!r} is not read: kvforge reads 'gptq' (v1) and 'gptq_v2'")
    for module, params in result.modules("qweight").items():
        over = _gptq_overrides(qc, module)
        if over is None:
            raise KvforgeError(f"{module} holds GPTQ tensors but quantization_config.dynamic excludes it")
        bits = int(over.get("bits", qc.get("bits", 4)))
        gs = int(over.get("group_size", qc.get("group_size", 128)))
        if bits not in (2, 3, 4, 8):
            raise KvforgeError(f"{module}: {bits}-bit GPTQ is not read (2, 3, 4 and 8 bits are)")
        for need in ("scales", "qzeros"):
            if need not in params:
                raise KvforgeError(f"{module} has a qweight but no {need}")
        qweight = params["qweight"].detach().cpu().numpy()
        scales = _f32(params["scales"])
        qzeros = params["qzeros"].detach().cpu().numpy()
        out, n = scales.shape[1], scales.shape[0]
        g_idx = params.get("g_idx")
        k = int(g_idx.numel()) if g_idx is not None else qweight.shape[0] * 32 // bits
        if qweight.shape[1] != out:
            raise KvforgeError(f"{module}.qweight has shape {qweight.shape}: its scales have {out} outputs")
        q = _unpack(qweight.T, bits, k, f"{module}.qweight")  # [out, in]
        if fmt == "gptq":  # v1: each zero stored minus one
            if 32 % bits == 0:
                qzeros = (qzeros.astype(np.int32).view(np.uint32) + np.uint32(_V1_WORD[bits])).view(np.int32)
                z = _unpack(qzeros, bits, out, f"{module}.qzeros")
            else:
                z = (_unpack(qzeros, bits, out, f"{module}.qzeros") + 1) & ((1 << bits) - 1)
        else:
            z = _unpack(qzeros, bits, out, f"{module}.qzeros")
        if z.shape[0] != n:
            raise KvforgeError(f"{module}.qzeros has {z.shape[0]} groups, its scales {n}")
        if g_idx is not None:
            groups = g_idx.detach().cpu().numpy().astype(np.int64).reshape(-1)
        else:
            groups = np.arange(k) // (gs if gs > 0 else k)
        if groups.min(initial=0) < 0 or groups.max(initial=0) >= n:
            raise KvforgeError(f"{module}.g_idx does not index its {n} groups")
        natural = np.array_equal(groups, np.arange(k) // (gs if gs > 0 else k))
        label = f"GPTQ int{bits} group {gs if gs > 0 else k}" + ("" if natural else " act-order")
        codes, reference, why = _codes(q, _kind(bits, False), scales.T, z.T, groups, label, bits=bits)
        result.put(module + ".weight", codes, reference, why)
        result.drop(module, ("qweight", "qzeros", "scales", "g_idx"))
    result.ignored.update(m for m in result.float_weights() if _gptq_overrides(qc, m) is None)


# ---------------------------------------------------------------------------------------------------- AWQ

_AWQ_ORDER = np.array([0, 2, 4, 6, 1, 3, 5, 7])  # field i of each word holds column 8 * word + _AWQ_ORDER[i]


def _awq_unpack(words: np.ndarray, count: int, what: str) -> np.ndarray:
    fields = _unpack(words, 4, count, what)
    cols = (np.arange(count) // 8) * 8 + _AWQ_ORDER[np.arange(count) % 8]
    out = np.empty_like(fields)
    out[:, cols] = fields
    return out


def _read_awq(qc: dict[str, Any], result: _Result) -> None:
    version = str(qc.get("version") or "gemm").lower()
    if version != "gemm":
        raise KvforgeError(f"AWQ version {version!r} is not read: kvforge reads AWQ 'gemm'")
    bits = int(qc.get("bits") or qc.get("w_bit") or 4)
    if bits != 4:
        raise KvforgeError(f"{bits}-bit AWQ is not read (4 bits is)")
    for module, params in result.modules("qweight").items():
        if "scales" not in params:
            raise KvforgeError(f"{module} has a qweight but no scales")
        qweight = params["qweight"].detach().cpu().numpy()
        scales = _f32(params["scales"])
        n, out = scales.shape
        k = qweight.shape[0]
        if out % 8 or k % n:
            raise KvforgeError(f"{module}: scales of shape {scales.shape} do not fit a qweight of shape {qweight.shape}")
        gs = k // n
        q = _awq_unpack(qweight, out, f"{module}.qweight").T  # [out, in]
        if "qzeros" in params:
            z = _awq_unpack(params["qzeros"].detach().cpu().numpy(), out, f"{module}.qzeros").T  # [out, groups]
        else:
            z = np.full((out, n), 8, np.int16)
        codes, reference, why = _codes(q, "uint4", scales.T, z, np.arange(k) // gs, f"AWQ int4 group {gs}", bits=4)
        result.put(module + ".weight", codes, reference, why)
        result.drop(module, ("qweight", "qzeros", "scales"))
    result.ignore_by_substring(qc.get("modules_to_not_convert"))


# ---------------------------------------------------------------------------------------------------- block FP8


def _read_fp8(qc: dict[str, Any], result: _Result) -> None:
    fmt = str(qc.get("fmt") or "e4m3").lower()
    if fmt != "e4m3":
        raise KvforgeError(f"FP8 checkpoint in {fmt!r}: kvforge reads FP8 E4M3")
    block = qc.get("weight_block_size")
    scheme = str(qc.get("activation_scheme") or "dynamic").lower()
    for module, params in result.modules("weight_scale_inv").items():
        w = params.get("weight")
        if w is None:
            raise KvforgeError(f"{module} has a weight_scale_inv but no weight")
        if w.ndim != 2:
            raise KvforgeError(f"{module}: a quantized weight of shape {tuple(w.shape)}: kvforge reads 2-D weights")
        q = _fp8(w, module + ".weight")
        out, k = q.shape
        s = _f32(params["weight_scale_inv"])
        if block is None:
            if s.size != 1:
                raise KvforgeError(f"{module}.weight_scale_inv has {s.size} values and no weight_block_size")
            scale, groups, label, bw = np.full((out, 1), s.reshape(-1)[0], np.float32), np.zeros(k, np.int64), "tensor", k
        else:
            bh, bw = (int(v) for v in block)
            if s.ndim != 2 or s.shape[0] * bh < out or s.shape[1] * bw < k:
                raise KvforgeError(f"{module}.weight_scale_inv has shape {s.shape}: not {bh}x{bw} block scales "
                                   f"for a [{out}, {k}] weight")
            scale, groups, label = np.ascontiguousarray(s[np.arange(out) // bh]), np.arange(k) // bw, f"block {bh}x{bw}"
        if scheme == "static":
            a = params.get("activation_scale", params.get("input_scale"))
            if a is None or a.numel() != 1:
                raise KvforgeError(f"{module}: static activation scheme without one activation_scale")
            activation = {"format": "fp8", "scale": float(_f32(a).reshape(-1)[0])}
        elif block is None:
            activation = {"format": "fp8", "scale": None}
        else:
            activation = {"format": "fp8", "scale": None, "granularity": "token group", "group_size": bw}
        codes, reference, why = _codes(q, "fp8", scale, None, groups, f"FP8 E4M3 {label}", activation)
        result.put(module + ".weight", codes, reference, why)
        result.drop(module, ("weight_scale_inv", "activation_scale", "input_scale"))
    result.ignore_by_substring(qc.get("modules_to_not_convert"))
