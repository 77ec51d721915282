"""A GGUF file's index: its metadata and tensor table read without turning every element into an object.

gguf's GGUFReader turns each element of every metadata array into numpy views of its own (a string token is a
length array and a bytes array): parsing Gemma 3's 262k-token vocabulary takes 18 s and holds 0.68 GB for as
long as the reader lives, in every process that reads the file (an export holds it throughout). What kvforge
reads from a file is small: scalar metadata, a few arrays (tokens, their types and scores, merges) and the
tensor table (name, shape, type, where the bytes are). `GgufIndex` walks the file once (GGUF v2/v3, little
endian: llama.cpp's spec), keeps each array as its place in the file, and decodes it when asked; the tensors'
bytes are views of one read-only memory map, as GGUFReader gives them (the same shapes and dtypes: a quantized
tensor's rows of bytes, a float tensor in its own dtype).

The interface is the part of GGUFReader kvforge reads: `fields[key].contents()`, and `tensors` whose items have
`name`, `tensor_type`, `shape` (GGUF's order, fastest dimension first), `n_elements`, `n_bytes` and `data`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# GGUFValueType: (struct code, size) of each scalar type
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
# tensors GGUFReader gives in their own dtype; every other type as rows of bytes
_FLOAT_ITEMS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


class GgufFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (named by where they stop making sense)."""


@dataclass(frozen=True)
class Field:
    """One metadata value: where it is in the file, decoded by contents()."""

    index: GgufIndex
    kind: int  # GGUFValueType
    offset: int  # of the value (for an array: of its element type)

    def contents(self) -> Any:
        return self.index._value(self.kind, self.offset)[0]


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF's order: fastest dimension first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GgufIndex:
    def __init__(self, path: str | Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)
        if bytes(self._buf[:4]) != MAGIC:
            raise GgufFormatError(f"no GGUF magic at the start (found {bytes(self._buf[:4])!r})")
        version, n_tensors, n_fields = self._unpack("<IQQ", 4)
        if version not in (2, 3):
            raise GgufFormatError(f"GGUF version {version} (a big-endian file reads as a huge one): this reader "
                                  "takes little-endian versions 2 and 3")
        offset = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key, offset = self._string(offset)
            (kind,), offset = self._unpack("<I", offset), offset + 4
            self.fields[key] = Field(self, kind, offset)
            offset = self._skip(kind, offset)
        infos = []
        for _ in range(n_tensors):
            name, offset = self._string(offset)
            (n_dims,) = self._unpack("<I", offset)
            dims = np.frombuffer(self._buf, "<u8", n_dims, offset + 4).copy()
            offset += 4 + 8 * n_dims
            raw_type, relative = self._unpack("<IQ", offset)
            offset += 12
            infos.append((name, dims, raw_type, relative))
        alignment = self.fields["general.alignment"].contents() if "general.alignment" in self.fields else 32
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
            raise GgufFormatError(f"general.alignment is {alignment!r}, not a positive integer")
        start = -(-offset // alignment) * alignment
        self.tensors: list[Tensor] = []
        seen = set()
        for name, dims, raw_type, relative in infos:
            if name in seen:
                raise GgufFormatError(f"tensor {name!r} is listed twice")
            seen.add(name)
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(dims, dtype=np.int64)) if len(dims) else 1
            n_bytes = n_elements * type_size // block
            at = start + int(relative)
            if at + n_bytes > len(self._map):
                raise GgufFormatError(f"tensor {name!r} ends at byte {at + n_bytes}, past the file's {len(self._map)}")
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            item = _FLOAT_ITEMS.get(qtype.name)
            if item is None:  # rows of bytes: the fastest dimension in blocks of type_size bytes
                data = self._map[at:at + n_bytes].reshape(*np_dims[:-1], np_dims[-1] // block * type_size)
            else:
                data = self._map[at:at + n_bytes].view(item).reshape(np_dims)
            self.tensors.append(Tensor(name, qtype, dims, n_elements, n_bytes, at, data))

    # -- the walk --
    def _unpack(self, fmt: str, offset: int) -> tuple:
        try:
            return struct.unpack_from(fmt, self._buf, offset)
        except struct.error as e:
            raise GgufFormatError(f"the file ends inside its index (byte {offset})") from e

    def _string(self, offset: int) -> tuple[str, int]:
        (n,) = self._unpack("<Q", offset)
        end = offset + 8 + n
        if end > len(self._map):
            raise GgufFormatError(f"a string at byte {offset} runs past the end of the file")
        return bytes(self._buf[offset + 8:end]).decode("utf-8"), end

    def _skip(self, kind: int, offset: int) -> int:
        """The offset after a value of type `kind` at `offset`, decoding nothing but lengths."""
        if kind in _SCALARS:
            return offset + _SCALARS[kind][1]
        if kind == _STRING:
            (n,) = self._unpack("<Q", offset)
            return offset + 8 + n
        if kind == _ARRAY:
            sub, count = self._unpack("<IQ", offset)
            offset += 12
            if sub in _SCALARS:
                return offset + count * _SCALARS[sub][1]
            for _ in range(count):
                offset = self._skip(sub, offset)
            return offset
        raise GgufFormatError(f"unknown metadata value type {kind} at byte {offset}")

    def _value(self, kind: int, offset: int) -> tuple[Any, int]:
        if kind in _SCALARS:
            fmt, size = _SCALARS[kind]
            return self._unpack(fmt, offset)[0], offset + size
        if kind == _STRING:
            return self._string(offset)
        if kind == _ARRAY:
            sub, count = self._unpack("<IQ", offset)
            offset += 12
            if sub in _SCALARS:
                values = np.frombuffer(self._buf, _DTYPES[sub], count, offset)
                return values.tolist(), offset + count * _SCALARS[sub][1]
            items = []
            for _ in range(count):
                item, offset = self._value(sub, offset)
                items.append(item)
            return items, offset
        raise GgufFormatError(f"unknown metadata value type {kind} at byte {offset}")
