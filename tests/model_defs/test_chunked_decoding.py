"""Large weights decoded, compared and read a chunk of rows at a time (issue 48): a GGUF tensor's decoding, a
weight's codes dequantized or matched against a float tensor, codes narrowed to their type, and a checkpoint
reader's buffer. Each gives what the whole-array computation gives, bit for bit (the oracle: gguf's own
dequantization, and numpy's arithmetic on the whole array), and holds at most its result plus a chunk
(tracemalloc): whole, Gemma 3's 262k-row embedding held ~2.7 GB of intermediates for a 0.67 GB result, and its
reader's buffer stayed resident through the whole export."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from kvforge.model_defs import gguf as kvgguf  # noqa: E402
from kvforge.model_defs import quantized, weights  # noqa: E402
from kvforge.model_defs.gguf_codes import decode  # noqa: E402

from .test_gguf import RANDOM_BLOCKS, random_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
TYPES = sorted({*RANDOM_BLOCKS, Q.Q8_0, Q.Q4_0, Q.Q4_1}, key=lambda t: t.name)


def _raw(shape, qtype, seed=3) -> np.ndarray:
    if qtype in RANDOM_BLOCKS:
        return random_blocks(shape, qtype, seed)
    return gguf.quants.quantize(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), qtype)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_tensor_decoded_a_few_rows_at_a_time_is_ggufs_decoding(qtype, monkeypatch):
    """Chunks of 3 rows (not dividing the 16): the values are gguf's whole-tensor dequantization bit for bit; the
    codes made from them dequantize, and match, as the whole computation does, transposed or not."""
    monkeypatch.setattr(quantized, "ROW_CHUNK_VALUES", 3 * 512)
    raw = _raw((16, 512), qtype)
    want = gguf.quants.dequantize(raw, qtype).reshape(16, 512).astype(np.float32)
    got = kvgguf._dequantize(SimpleNamespace(data=raw, tensor_type=qtype), (16, 512))
    assert got.dtype == np.float32 and np.array_equal(_bits(got), _bits(want))
    codes, error = decode(raw, qtype.name, (16, 512), want)
    assert error is None or qtype.name in ("IQ2_XXS", "TQ2_0")
    whole = codes.reference if codes.reference is not None else _whole_dequantization(codes)
    assert np.array_equal(_bits(codes.dequantize() if codes.reference is None else codes.weight()), _bits(whole))
    assert codes.matches(whole) and codes.matches(np.ascontiguousarray(whole.T), transposed=True)
    assert quantized.exact(codes, torch.from_numpy(whole))
    off = whole.copy()
    off[13, 500] = np.nextafter(off[13, 500], np.float32(np.inf))  # one value one ulp off, in the last chunk
    assert not codes.matches(off) and not codes.matches(np.ascontiguousarray(off.T), transposed=True)
    assert not codes.matches(whole[:15]) and not codes.matches(whole, transposed=True)


def _whole_dequantization(codes) -> np.ndarray:
    """WeightCodes' formula on whole arrays, as it was computed before the chunks."""
    q = codes.codes.astype(np.float32)
    if codes.zero_point is not None:
        q = q - np.repeat(codes.zero_point.astype(np.float32), codes.block, axis=1)
    w = q * np.repeat(codes.scale.astype(np.float32), codes.block, axis=1)
    if codes.offset is not None:
        w = w + np.repeat(codes.offset.astype(np.float32), codes.block, axis=1)
    if codes.input_order is not None:
        w = w[:, np.argsort(codes.input_order)]
    return w.astype(np.float32)


def test_act_order_zero_points_and_every_code_type_survive_the_chunks(monkeypatch):
    """A GPTQ-style weight (zero points, a permuted input order) and codes narrowed to each type, in chunks of 2
    rows: equal to the whole computation."""
    monkeypatch.setattr(quantized, "ROW_CHUNK_VALUES", 2 * 64)
    rng = np.random.default_rng(0)
    for kind, lo, hi in (("int4", -8, 8), ("uint4", 0, 16), ("int8", -128, 128), ("uint8", 0, 256)):
        values = rng.integers(lo, hi, (7, 64))
        codes = quantized.as_codes(values.astype(np.float32), kind)
        assert codes.dtype == quantized.code_dtype(kind) and np.array_equal(codes.astype(np.int64), values)
    q = quantized.as_codes(rng.integers(0, 16, (7, 64)), "uint4")
    gptq = quantized.WeightCodes(q, rng.random((7, 2)).astype(np.float32) + 0.1, 32,
                                 zero_point=quantized.as_codes(rng.integers(0, 16, (7, 2)), "uint4"),
                                 input_order=rng.permutation(64))
    whole = _whole_dequantization(gptq)
    assert np.array_equal(_bits(gptq.dequantize()), _bits(whole)) and gptq.matches(whole)


def test_decoding_holds_its_result_and_one_chunk(monkeypatch):
    """A 4M-value Q6_K tensor in chunks of 64k values: tracemalloc's peak is within 1.25x its 16 MB result
    (gguf's own decoding of the whole tensor holds several times it); its codes' dequantization too."""
    monkeypatch.setattr(quantized, "ROW_CHUNK_VALUES", 1 << 16)
    raw = random_blocks((1024, 4096), Q.Q6_K, 1)
    result = 1024 * 4096 * 4
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        values = kvgguf._dequantize(SimpleNamespace(data=raw, tensor_type=Q.Q6_K), (1024, 4096))
        ours = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        gguf.quants.dequantize(raw, Q.Q6_K)
        theirs = tracemalloc.get_traced_memory()[1] - base
        codes, _ = decode(raw, "Q6_K", (1024, 4096), values)
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        codes.dequantize()
        dequantized = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert ours < 1.25 * result < 2 * result < theirs, (ours, theirs)
    assert dequantized < 1.25 * result, dequantized


def test_a_reader_keeps_no_buffer_for_a_table(tmp_path, monkeypatch):
    """A tensor larger than KEEP_BUFFER_BYTES is read into memory of its own, which goes with the caller's
    reference; smaller ones share the reused buffer. Values as safetensors reads them."""
    from safetensors.torch import load_file, save_file

    monkeypatch.setattr(weights, "KEEP_BUFFER_BYTES", 4096)
    path = tmp_path / "m.safetensors"
    save_file({"table": torch.randn(64, 32), "small": torch.randn(8, 8)}, str(path))
    want = load_file(str(path))
    shards = weights.SafetensorsShards([path])
    table = shards.read("table")
    assert torch.equal(table, want["table"]) and shards._buffer.numel() == 0
    small = shards.read("small")
    assert torch.equal(small, want["small"]) and shards._buffer.numel() == 8 * 8 * 4
    assert small.untyped_storage().data_ptr() == shards._buffer.untyped_storage().data_ptr()
    assert torch.equal(shards.read_rows("table", torch.tensor([1, 2, 40])), want["table"][[1, 2, 40]])


def test_following_a_transform_reads_index_views_not_tables():
    """follow() learns what a transform does to rows and columns from index tensors: as broadcast views first (a
    262k-row embedding's two float32 tables were 1.3 GB), whole only for a transform a view cannot take. The
    codes carried are what the transform does to the float weight, checked against the transform itself."""
    rows, cols = 64, 32
    w = np.random.default_rng(0).integers(-8, 8, (rows, cols)).astype(np.int8)
    codes = quantized.WeightCodes(w, np.ones((rows, 1), np.float32), cols)
    float_w = torch.from_numpy(codes.dequantize())
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
    seen = []

    def permute(x):  # a row permutation (GGUF's Q/K head order): its inputs' storage recorded
        seen.append(x.untyped_storage().nbytes())
        return x[perm]

    carried = quantized.follow(codes, permute)
    assert carried is not None and np.array_equal(carried.dequantize(), permute(float_w).numpy())
    assert max(seen[:2]) < rows * 8 + cols * 8  # the two probes were views of one index row each
    in_place = quantized.follow(codes, lambda x: x.mul_(1.0))  # a view cannot be written: the tables are made
    assert in_place is not None and np.array_equal(in_place.dequantize(), float_w.numpy())
    assert quantized.follow(codes, lambda x: x * 2.0) is None  # not a selection of rows
    assert quantized.follow(codes, lambda x: x[:, torch.arange(cols).flip(0)]) is None  # columns moved
