"""GGUF's quantized block types as WeightCodes (model_defs/quantized.py): codes, block scales, block offsets.

Each type stores blocks of 32 elements (or super-blocks of 256 with 16 or 8 sub-blocks) along a weight's input
axis. Those a DequantizeLinear with a block size can express, with an Add of the block offset where the type
has one, are decoded here into that form, in the arithmetic gguf's dequantization uses (float16 factors widened
to float32, their products in float32, then code * scale, then the offset):

| type   | codes (as stored)      | block | scale            | offset         |
|--------|------------------------|-------|------------------|----------------|
| Q8_0   | int8                   | 32    | d                | -              |
| Q4_0   | int4 (q - 8)           | 32    | d                | -              |
| Q4_1   | uint4                  | 32    | d                | m              |
| Q5_0   | int8 (q - 16, 5 bits)  | 32    | d                | -              |
| Q5_1   | uint8 (5 bits)         | 32    | d                | m              |
| Q2_K   | uint4 (2 bits)         | 16    | d * scale_j      | -(dmin * m_j)  |
| Q3_K   | int4 (3 bits)          | 16    | d * (scale_j-32) | -              |
| Q4_K   | uint4                  | 32    | d * scale_j      | -(dmin * m_j)  |
| Q5_K   | uint8 (5 bits)         | 32    | d * scale_j      | -(dmin * m_j)  |
| Q6_K   | int8 (q - 32, 6 bits)  | 16    | d * scale_j      | -              |
| IQ4_NL | int8 (its 16 values)   | 32    | d                | -              |
| IQ4_XS | int8 (its 16 values)   | 32    | d * (scale_j-32) | -              |

ONNX has no 2-, 3-, 5- or 6-bit type, so those codes widen to the next type that holds them (the bundle is
larger than the file there). Every decoded tensor is checked bit for bit against `gguf.quants.dequantize` before
it is called exact. The other types (the IQ1-3 grids, TQ, MXFP4, NVFP4) have no such form: they are converted to
INT8 codes (block 32, round to nearest) and the error against the file's dequantization is recorded.
"""

from __future__ import annotations

import numpy as np

from .quantized import WeightCodes, as_codes, conversion_error, requantize_int8

QK_K = 256


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields ([n, 2] bytes) widened to float32 [n, 1]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(-1, 1)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """4-bit fields: each `group` bytes hold `group` low nibbles, then the same bytes' high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, group) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _q8_0(b):
    return b[:, 2:].view(np.int8), _f16(b[:, :2]), None, 32


def _q4_0(b):
    return _nibbles(b[:, 2:], 16).astype(np.int8) - 8, _f16(b[:, :2]), None, 32


def _q4_1(b):
    return _nibbles(b[:, 4:], 16), _f16(b[:, :2]), _f16(b[:, 2:4]), 32


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    n = qs.shape[0]
    high = (np.ascontiguousarray(qh).view(np.uint32).reshape(n, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & 1
    return _nibbles(qs, 16) | (high.astype(np.uint8) << 4)


def _q5_0(b):
    return _five_bits(b[:, 2:6], b[:, 6:]).astype(np.int8) - 16, _f16(b[:, :2]), None, 32


def _q5_1(b):
    return _five_bits(b[:, 4:8], b[:, 8:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 32


def _q2_k(b):
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    n = b.shape[0]
    q = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    scale = d * (scales & 0xF).astype(np.float32)
    offset = -(dmin * (scales >> 4).astype(np.float32))
    return q.reshape(n, QK_K), scale, offset, 16


def _q3_k(b):
    n = b.shape[0]
    hmask, qs, packed, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    scales = ((low & 0x0F) | ((high & 0x03) << 4)).astype(np.int8) - np.int8(32)
    ql = (qs.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)).reshape(n, QK_K) & 3
    qh = (hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)).reshape(n, QK_K) & 1
    q = ql.astype(np.int8) - ((qh ^ 1) << 2).astype(np.int8)
    return q, d * scales.astype(np.float32), None, 16


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's eight 6-bit scales and mins from their 12 packed bytes."""
    n = packed.shape[0]
    d, m, m_d = np.split(packed.reshape(n, 3, 4), 3, axis=1)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape(n, 8)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape(n, 8)
    return sc, mn


def _q4_k(b):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    q = _nibbles(b[:, 16:], 32)
    return q, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), 32


def _q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:]
    high = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [n, 8 sub-blocks, 32]
    q = _nibbles(qs, 32).reshape(n, 8, 32) | (high << 4)
    return q.reshape(n, QK_K), d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), 32


def _q6_k(b):
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    low = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    high = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(0x03)
    q = (low.reshape(n, -1, 32) | (high.reshape(n, -1, 32) << 4)).astype(np.int8) - np.int8(32)
    return q.reshape(n, QK_K), d * scales.view(np.int8).astype(np.float32), None, 16


def _iq4_values() -> np.ndarray:
    from gguf.quants import IQ4_NL

    return np.array(IQ4_NL.kvalues, np.int8)


def _iq4_nl(b):
    return _iq4_values()[_nibbles(b[:, 2:], 16)], _f16(b[:, :2]), None, 32


def _iq4_xs(b):
    n = b.shape[0]
    d = _f16(b[:, :2])
    high = (np.ascontiguousarray(b[:, 2:4]).view(np.uint16).reshape(n, 1)
            >> np.arange(0, 16, 2, dtype=np.uint16).reshape(1, 8)).astype(np.uint8) & 3
    low = (b[:, 4:8].reshape(n, 4, 1) >> np.array([0, 4], np.uint8).reshape(1, 1, 2)).reshape(n, 8) & 0x0F
    scales = (low | (high << 4)).astype(np.int8) - np.int8(32)
    q = _iq4_values()[_nibbles(b[:, 8:], 16)]
    return q, d * scales.astype(np.float32), None, 32


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q2_K": _q2_k,
             "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
EXACT_TYPES = tuple(_DECODERS)


def decode(raw: np.ndarray, type_name: str, shape: tuple[int, ...], dequantized: np.ndarray) -> tuple[WeightCodes, dict | None]:
    """The codes of a quantized GGUF tensor ([out, in]: `shape`; raw: its bytes) and, where they are converted
    rather than kept, the error record. `dequantized` is gguf's own dequantization ([out, in]: an array, or an
    object that makes a slice of rows where it is indexed and the whole in np.asarray): the check, a chunk of rows
    at a time, and what a converted tensor is requantized from."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    out, k = shape
    decoder = _DECODERS.get(type_name)
    if decoder is not None:
        _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
        blocks = np.ascontiguousarray(raw).reshape(-1, type_size)
        q, scale, offset, block = decoder(blocks)
        codes = WeightCodes(as_codes(q.reshape(out, k)), scale.reshape(out, k // block).astype(np.float32), block,
                            offset=None if offset is None else offset.reshape(out, k // block).astype(np.float32),
                            source=type_name)
        if codes.matches(dequantized):
            return codes, None
        type_name = f"{type_name} (not reproduced exactly)"
    dequantized = np.asarray(dequantized, np.float32)
    codes = requantize_int8(dequantized, type_name)
    return codes, {"type": type_name, "as": codes.source, **conversion_error(dequantized, codes)}
