"""Pre-quantized checkpoints: each weight's codes as its checkpoint stores them, carried into the bundle's Q/DQ.

Every format kvforge reads (GGUF's block types, compressed-tensors, GPTQ, AWQ, block FP8) reduces to one form
per weight, in nn.Linear's [out, in] layout (an embedding: [vocab, hidden]) with blocks along `in`:

    w = (codes - zero_point) * scale + offset          float32, in this order, each term per block

`codes` are what the file stores (int4, uint4, int8, uint8 or FP8 E4M3, widened to the narrowest of these that
holds them), `scale` and the optional `zero_point` (integer, the codes' type) and `offset` (float: GGUF's block
minimum, its K-quants' dmin * m) one value per block. That is what an ONNX DequantizeLinear with a block size
computes, with an Add after it for the offset (export/checkpoint_codes.py), so the bundle's weights equal the
checkpoint's dequantization bit for bit wherever a reader produced this form: `WeightCodes.dequantize` is the
graph's arithmetic, and every reader checks it against the format's own dequantization before it claims a
tensor is kept exactly. GPTQ's act-order stores the input channels permuted: `input_order[j]` is the input
channel that column j of the codes holds.

A checkpoint's tensors reach kvforge's parameters through the family's weight table (row permutations, fused
projections split, transposes); `follow` carries a tensor's codes through such a transform when it only selects
rows, and the import checks the result against the float parameter bit for bit (model_defs/hf.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np
import torch

from kvforge.metrics import row_slices

ROW_CHUNK_VALUES = 4 << 20  # values a weight's decoding or comparison makes at a time (16 MB of float32)


def row_chunks(rows: int, row_values: int) -> list[slice]:
    """metrics.row_slices of ROW_CHUNK_VALUES values: what a large weight is decoded, compared or narrowed by."""
    return row_slices(rows, row_values, ROW_CHUNK_VALUES)

CODE_TYPES = ("int4", "uint4", "int8", "uint8", "fp8")
_RANGES = {"int4": (-8, 7), "uint4": (0, 15), "int8": (-128, 127), "uint8": (0, 255)}


def code_dtype(kind: str):
    import ml_dtypes

    return {"int4": ml_dtypes.int4, "uint4": ml_dtypes.uint4, "int8": np.int8, "uint8": np.uint8,
            "fp8": ml_dtypes.float8_e4m3fn}[kind]


def narrowest(values: np.ndarray) -> str:
    """The narrowest integer code type that holds `values` (integers as any dtype)."""
    lo, hi = int(values.min(initial=0)), int(values.max(initial=0))
    for kind in ("int4", "uint4", "int8", "uint8"):
        if _RANGES[kind][0] <= lo and hi <= _RANGES[kind][1]:
            return kind
    raise ValueError(f"codes in [{lo}, {hi}] fit no 8-bit type")


def as_codes(values: np.ndarray, kind: str | None = None) -> np.ndarray:
    """Integer codes (any integer or integral float array) stored as `kind` (default: the narrowest that holds them)."""
    kind = kind or narrowest(values)
    values = np.asarray(values)
    if kind == "fp8":
        return values
    # through int16 (a float's or an unsigned type's values to any code type) a chunk at a time: whole, the int16
    # copy of a 168M-value embedding was 336 MB besides its codes
    out = np.empty(values.shape, code_dtype(kind))
    flat, into = values.reshape(-1), out.reshape(-1)
    for part in row_chunks(flat.size, 1):
        into[part] = flat[part].astype(np.int16).astype(out.dtype)
    return out


@dataclass
class WeightCodes:
    """One weight as its checkpoint quantized it: w = (codes - zero_point) * scale + offset, blocks along `in`."""

    codes: np.ndarray  # [out, in]
    scale: np.ndarray  # [out, in // block] float32
    block: int  # block length along `in` (in itself: one scale per output row)
    zero_point: np.ndarray | None = None  # [out, in // block], the codes' dtype
    offset: np.ndarray | None = None  # [out, in // block] float32, added after the scaling
    source: str = ""  # the checkpoint's name for the type ("Q4_1", "GPTQ int4 group 128", ...)
    input_order: np.ndarray | None = None  # act-order: column j of the codes is input channel input_order[j]
    activation: dict[str, Any] | None = None  # W8A8: {"format": "int8" | "fp8", "scale": float, or None: per token}
    reference: np.ndarray | None = None  # converted codes only: the checkpoint's own dequantization, [out, in]

    def __post_init__(self):
        out, k = self.codes.shape
        if k % self.block:
            raise ValueError(f"block {self.block} does not divide the input size {k}")
        want = (out, k // self.block)
        for name in ("scale", "zero_point", "offset"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != want:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, not {want}")

    @property
    def kind(self) -> str:
        """The code type: one of CODE_TYPES."""
        import ml_dtypes

        dt = self.codes.dtype
        table = {np.dtype(np.int8): "int8", np.dtype(np.uint8): "uint8", np.dtype(ml_dtypes.int4): "int4",
                 np.dtype(ml_dtypes.uint4): "uint4", np.dtype(ml_dtypes.float8_e4m3fn): "fp8"}
        return table[np.dtype(dt)]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def per_element(self, a: np.ndarray) -> np.ndarray:
        return np.repeat(a, self.block, axis=1)

    def dequantize(self) -> np.ndarray:
        """The weight as the graph computes it ([out, in] float32, input order undone), made ROW_CHUNK_VALUES
        values at a time: the arithmetic holds four arrays of its input's size (Gemma 3's 262k-row embedding
        was 2.7 GB of them for a 0.67 GB result); each value is computed alike either way."""
        w = np.empty(self.shape, np.float32)
        for rows in row_chunks(*self.shape):
            w[rows] = self.dequantize_rows(rows)
        return w

    def dequantize_rows(self, rows: slice) -> np.ndarray:
        """Those rows of dequantize()."""
        q = self.codes[rows].astype(np.float32)
        if self.zero_point is not None:
            q = q - self.per_element(self.zero_point[rows].astype(np.float32))
        w = q * self.per_element(self.scale[rows].astype(np.float32))
        if self.offset is not None:
            w = w + self.per_element(self.offset[rows].astype(np.float32))
        if self.input_order is not None:
            w = w[:, np.argsort(self.input_order)]
        return w.astype(np.float32, copy=False)

    def weight_rows(self, rows: slice) -> np.ndarray:
        """Those rows of weight()."""
        return self.dequantize_rows(rows) if self.reference is None else self.reference[rows]

    def matches(self, weight: np.ndarray, transposed: bool = False) -> bool:
        """Whether weight() equals `weight` ([out, in] float32 values, or [in, out] where transposed) bit for
        bit, compared a chunk of rows at a time (neither side is made whole in float32 again)."""
        out, k = self.shape
        if tuple(weight.shape) != ((k, out) if transposed else (out, k)):
            return False
        for rows in row_chunks(out, k):
            part = weight[:, rows].T if transposed else weight[rows]
            if not np.array_equal(self.weight_rows(rows).view(np.uint32), np.asarray(part, np.float32).view(np.uint32)):
                return False
        return True

    def rows(self, index: np.ndarray) -> "WeightCodes":
        """These codes with only the rows `index` (a row permutation, a split of a fused projection)."""
        pick = lambda a: None if a is None else np.ascontiguousarray(a[index])  # noqa: E731
        return replace(self, codes=pick(self.codes), scale=pick(self.scale), zero_point=pick(self.zero_point),
                       offset=pick(self.offset), reference=pick(self.reference))

    def weight(self) -> np.ndarray:
        """The checkpoint's weight: the codes' dequantization, or for converted codes the file's own."""
        return self.dequantize() if self.reference is None else self.reference

    def record(self) -> dict[str, Any]:
        """What the manifest says of a kept tensor."""
        return {"type": self.source, "codes": self.kind, "block": self.block, "zero_point": self.zero_point is not None,
                "offset": self.offset is not None, "act_order": self.input_order is not None,
                **({"activation": self.activation} if self.activation else {})}


@dataclass
class QuantizedCheckpoint:
    """A pre-quantized checkpoint's codes and what the import says of each tensor.

    codes: tensor name -> WeightCodes (a reader's names; after the import, kvforge's parameter names);
    converted: tensors whose type no Q/DQ expresses, stored as other codes -> {"type", "as", "max_abs", "rel_l2"};
    kept_float: tensors that stay float -> why (the file holds them in float, or their codes cannot follow the
    weight table's transform)."""

    format: str  # "gguf", "compressed-tensors", "gptq", "awq", "fp8-block"
    config: dict[str, Any]  # the checkpoint's quantization config as the file states it
    codes: dict[str, WeightCodes] = field(default_factory=dict)
    converted: dict[str, dict[str, Any]] = field(default_factory=dict)
    kept_float: dict[str, str] = field(default_factory=dict)
    # a reader's name -> the layout change from its codes' layout to the tensor's (GGUF: llama.cpp's rows and
    # stacked experts -> transformers'); the import carries codes through it and the weight table's transform
    layouts: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        """Whether a graph of these codes computes the checkpoint's own float model, bit for bit in its weights:
        they quantize no activation, and none was converted from a type no Q/DQ expresses."""
        return not self.converted and not any(c.activation for c in self.codes.values())

    def record(self) -> dict[str, Any]:
        return {"format": self.format, "config": self.config,
                "kept": {name: c.record() for name, c in sorted(self.codes.items()) if name not in self.converted},
                "converted": dict(sorted(self.converted.items())), "kept_float": dict(sorted(self.kept_float.items()))}


def conversion_error(reference: np.ndarray, codes: WeightCodes) -> dict[str, float]:
    """max |error| and relative L2 error of `codes` against the checkpoint's own dequantization."""
    ref = reference.astype(np.float64)
    err = codes.dequantize().astype(np.float64) - ref
    norm = float(np.linalg.norm(ref))
    return {"max_abs": float(np.abs(err).max(initial=0.0)), "rel_l2": float(np.linalg.norm(err) / norm) if norm else 0.0}


def requantize_int8(w: np.ndarray, source: str, block: int = 32) -> WeightCodes:
    """Round-to-nearest symmetric INT8 codes, `block` along `in` (the whole row where it does not divide): what a
    type no Q/DQ expresses is converted to."""
    out, k = w.shape
    block = block if k % block == 0 else k
    blocks = w.astype(np.float32).reshape(out, k // block, block)
    amax = np.abs(blocks).max(axis=2)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(blocks / scale[..., None]), -127, 127).astype(np.int8).reshape(out, k)
    return WeightCodes(q, scale, block, source=f"{source} (as int8 block {block})", reference=w.astype(np.float32))


def follow(codes: WeightCodes, fn: Callable[[torch.Tensor], torch.Tensor], transposed: bool = False) -> WeightCodes | None:
    """`codes` carried through `fn`, a transform of the float tensor (which holds the codes' [out, in] layout,
    or its transpose where `transposed`), when `fn` only selects whole rows; None when it does anything else.

    fn runs on two index tensors, each element's row and column in the codes: its result must keep every
    column in place and give each row one source row."""
    out, k = codes.shape
    r2 = c2 = None
    # the index tensors first as broadcast views (no memory: a 262k-row embedding's two float32 index tables were
    # 1.3 GB), then, where fn cannot take a view, whole
    for dense in (False, True):
        r = torch.arange(out, dtype=torch.float32)[:, None].expand(out, k)
        c = torch.arange(k, dtype=torch.float32)[None, :].expand(out, k)
        if transposed:
            r, c = r.T, c.T
        if dense:
            r, c = r.contiguous(), c.contiguous()
        try:
            r2, c2 = fn(r), fn(c)
            break
        except (RuntimeError, ValueError):
            continue
    if r2 is None:
        return None
    if r2.ndim != 2 or r2.shape != c2.shape or r2.shape[1] != k:
        return None
    if not torch.equal(c2, torch.arange(k, dtype=torch.float32).expand_as(c2)):
        return None
    rows = r2[:, 0]
    if not torch.equal(r2, rows[:, None].expand_as(r2)) or not torch.equal(rows, rows.round()):
        return None
    index = rows.long().numpy()
    if index.min(initial=0) < 0 or index.max(initial=0) >= out:
        return None
    return codes if np.array_equal(index, np.arange(out)) else codes.rows(index)


def exact(codes: WeightCodes, weight: np.ndarray | torch.Tensor) -> bool:
    """Whether the codes stand for `weight` ([out, in]) bit for bit: they dequantize to it, or (converted codes)
    their reference is it."""
    w = weight.detach().float().numpy() if isinstance(weight, torch.Tensor) else np.asarray(weight, np.float32)
    return codes.matches(w)
