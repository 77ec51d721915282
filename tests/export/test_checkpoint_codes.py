"""A pre-quantized checkpoint's codes kept in the bundle (export/checkpoint_codes.py), against oracles that are
not kvforge: gguf's own dequantization of each block type, transformers' GGUF loading (weights and logits), and
on the real SmolLM2-135M-Instruct Q4_1 file, the perplexity of its dequantized Torch model."""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from kvforge import runtime
from kvforge.export import export
from kvforge.model_defs.gguf_codes import decode
from kvforge.ort_session import make_session

from ..conftest import make_hf_model
from ..model_defs.test_gguf import RANDOM_BLOCKS, random_blocks, write_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

# every block type a DequantizeLinear (+ an offset Add) expresses, one per weight over two layers, the embedding
# (tied to the head) Q8_0, one type no Q/DQ expresses (IQ2_XXS: converted, its error recorded) and one float
TYPES = {"blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q5_K, "blk.0.attn_v.weight": Q.Q6_K,
         "blk.0.attn_output.weight": Q.Q3_K, "blk.0.ffn_gate.weight": Q.Q2_K, "blk.0.ffn_up.weight": Q.IQ4_XS,
         "blk.0.ffn_down.weight": Q.Q8_0, "blk.1.attn_q.weight": Q.Q4_0, "blk.1.attn_k.weight": Q.Q4_1,
         "blk.1.attn_v.weight": Q.Q5_0, "blk.1.attn_output.weight": Q.Q5_1, "blk.1.ffn_gate.weight": Q.IQ4_NL,
         "blk.1.ffn_up.weight": Q.IQ2_XXS, "blk.1.ffn_down.weight": Q.F16, "token_embd.weight": Q.Q8_0}
# K-quants' super-blocks are 256 wide: every input size is a multiple of 256
LLAMA = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0), hidden_size=256, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=512, vocab_size=320, num_hidden_layers=2, tie_word_embeddings=True)
# kvforge's graph names -> transformers' for a Llama
MODULES = {"attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj",
           "attn.o_proj": "self_attn.o_proj", "ffn.gate_proj": "mlp.gate_proj", "ffn.up_proj": "mlp.up_proj",
           "ffn.down_proj": "mlp.down_proj"}


@pytest.fixture(scope="module")
def all_types(tmp_path_factory):
    """(GGUF file, transformers' model loaded from it, kvforge's bundle of it with the codes kept)."""
    root = tmp_path_factory.mktemp("gguf-types")
    path = write_gguf(make_hf_model("llama", seed=5, **LLAMA), root / "m.gguf", TYPES)
    oracle = transformers.AutoModelForCausalLM.from_pretrained(str(root), gguf_file="m.gguf", dtype=torch.float32).eval()
    return path, oracle, export(path, root / "bundle")


@pytest.mark.parametrize("qtype", sorted({*RANDOM_BLOCKS, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1}, key=lambda t: t.name))
def test_every_block_type_decodes_to_ggufs_dequantization_bit_for_bit(qtype):
    """Random blocks of each type: the codes' arithmetic (codes * scale + offset, float32) is gguf's, bit for bit,
    or the type is converted and its error is what an independent float64 computation says."""
    raw = random_blocks((8, 512), qtype, 7) if qtype in RANDOM_BLOCKS else gguf.quants.quantize(
        np.random.default_rng(7).standard_normal((8, 512)).astype(np.float32), qtype)
    reference = gguf.quants.dequantize(raw, qtype).reshape(8, 512).astype(np.float32)
    codes, error = decode(raw, qtype.name, (8, 512), reference)
    got = codes.dequantize()
    if error is None:
        assert codes.source == qtype.name
        assert np.array_equal(got.view(np.uint32), reference.view(np.uint32))
    else:
        assert qtype.name in ("IQ2_XXS", "TQ2_0") and codes.kind == "int8"
        diff = got.astype(np.float64) - reference
        assert error["max_abs"] == pytest.approx(np.abs(diff).max()) and 0 < error["rel_l2"] < 0.01
        assert error["rel_l2"] == pytest.approx(np.linalg.norm(diff) / np.linalg.norm(reference.astype(np.float64)))


def _graph_weights(bundle, names: list[str]) -> dict[str, np.ndarray]:
    """The tensors `names` as the bundle's graph computes them (exposed as outputs, run as the runtime runs it)."""
    model = onnx.load(str(bundle.graph_file))
    for name in names:
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    session = make_session(model.SerializeToString(), bundle.quantization_format)
    feeds = {"input_ids": np.zeros((1, 1), np.int64), "attention_mask": np.ones((1, 1), np.int64),
             "position_ids": np.zeros((1, 1), np.int64)}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((1, 2, 0, 64), np.float32)
    return dict(zip(names, session.run(names, feeds)))


def test_kept_codes_are_transformers_weights_bit_for_bit(all_types):
    _, oracle, bundle = all_types
    quant = bundle.quantization
    assert quant["format"] == "checkpoint"
    record = quant["checkpoint"]
    assert record["format"] == "gguf"
    kept_types = {r["type"] for r in record["kept"].values()}
    assert kept_types == {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
    assert list(record["converted"]) == ["layers.1.ffn.up_proj.weight"]
    assert record["converted"]["layers.1.ffn.up_proj.weight"]["type"] == "IQ2_XXS"
    assert "layers.1.ffn.down_proj.weight" in record["kept_float"]  # F16 in the file: a float weight
    graph = onnx.load(str(bundle.graph_file), load_external_data=False)
    stored = {i.name for i in graph.graph.initializer}
    names = {f"model.layers.{i}.{ours}.weight": f"model.layers.{i}.{theirs}.weight"
             for i in (0, 1) for ours, theirs in MODULES.items()}
    names = {ours: theirs for ours, theirs in names.items() if ours != "model.layers.1.ffn.up_proj.weight"}
    names["model.lm_head.weight"] = "model.embed_tokens.weight"  # the tied table, exported under the head's name
    weights = _graph_weights(bundle, sorted(names))
    state = oracle.state_dict()
    for ours, theirs in names.items():
        expected = state[theirs].float().numpy()
        got = weights[ours] if ours == "model.lm_head.weight" else weights[ours].T  # linear weights: [in, out]
        kept = f"{ours}_quantized" in stored
        assert kept == (ours != "model.layers.1.ffn.down_proj.weight"), ours
        assert np.array_equal(np.ascontiguousarray(got).view(np.uint32), expected.view(np.uint32)), ours


def test_kept_codes_in_a_data_file_are_the_graph_files_bit_for_bit(all_types, tmp_path):
    """With its weights in model.onnx.data, an export that keeps the codes moves them into a new data file and
    copies the weights that stay float from the old one: onnx's own reader gets every tensor of the one-file
    bundle back, bit for bit, and nothing of the old file is left behind."""
    path, _, inline = all_types
    external = export(path, tmp_path / "ext", external_data=True)
    assert (external.path / "model.onnx.data").is_file()
    assert sorted(p.name for p in external.path.iterdir()) == sorted(
        [p.name for p in inline.path.iterdir()] + ["model.onnx.data"])
    a = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(inline.graph_file)).graph.initializer}
    b = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(external.graph_file)).graph.initializer}
    assert a.keys() == b.keys() and any(n.endswith("_quantized") for n in a)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name


def test_kept_codes_bundle_matches_transformers_logits(all_types):
    """Within 1e-4 of transformers' logits on the same file, once the one converted weight (IQ2_XXS, which no
    Q/DQ expresses) is the bundle's in both; with the file's own, the conversion shows."""
    import copy

    _, oracle, bundle = all_types
    ids = np.random.default_rng(3).integers(0, 320, (2, 17))
    with runtime.load(bundle.path) as session:
        got, _ = session.forward(ids)
    converted = _graph_weights(bundle, ["model.layers.1.ffn.up_proj.weight"])["model.layers.1.ffn.up_proj.weight"]
    swapped = copy.deepcopy(oracle)
    with torch.no_grad():
        swapped.model.layers[1].mlp.up_proj.weight.copy_(torch.from_numpy(converted.T.copy()))
        expected = swapped(torch.from_numpy(ids)).logits.numpy()
        original = oracle(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(got - expected).max() <= 1e-4
    assert np.abs(got - original).max() > 1e-4
    # a converted weight departs from the file's float model: export validated the float graph, before the codes
    assert bundle.manifest["validation"]["graph"].startswith("the float graph")
    # the session ran ONNX Runtime's variant: the 4-bit codes (Q4_K, Q3_K, Q2_K, Q4_0, Q4_1) as MatMulNBits, two of
    # them sharing one with their siblings (layer 1's q and k read the same activation)
    from kvforge.bundle import Bundle
    from kvforge.runtime.ort.variant import variant_path

    variant = onnx.load(str(variant_path(Bundle(bundle.path))), load_external_data=False)
    nbits = [n for n in variant.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 4 and sum(n.op_type == "DequantizeLinear" for n in variant.graph.node) == 0


def test_accuracy_level_4_runs_the_8_bit_codes_as_matmul_nbits(all_types):
    """accuracy_level=4 (opt-in): the variant runs every kept weight that only MatMuls read as MatMulNBits at level 4,
    the 8-bit codes too (Q8_0, Q6_K, Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS and the converted IQ2_XXS's INT8 blocks, in
    groups by activation and block: 7 kernels beside the 4 of 4 bits), and the tied head on its embedding table's
    Q8_0 codes (the Gather keeps a float table), in a variant of its own; level 0's is the one it always was. The logits move by the 8-bit activations' rounding (this random model's: ~9% relative L2 across
    its Q2_K..Q8_0 layers, its greedy tokens the same); each kernel's arithmetic is checked against a numpy oracle in
    tests/runtime/test_ort_fusions.py."""
    from kvforge.bundle import Bundle
    from kvforge.runtime.ort.variant import variant_path

    _, _, bundle = all_types
    p0, p4 = (variant_path(Bundle(bundle.path), attention=True, accuracy_level=level) for level in (0, 4))
    assert "acc" not in p0.parent.name and p4.parent.name == f"{p0.parent.name}-acc4"
    for path, level, widths in ((p0, 0, [4] * 4), (p4, 4, [4] * 4 + [8] * 8)):
        graph = onnx.load(str(path), load_external_data=False).graph
        nbits = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
                 for n in graph.node if n.op_type == "MatMulNBits"]
        assert sorted(a["bits"] for a in nbits) == widths and {a["accuracy_level"] for a in nbits} == {level}
        assert not any(n.op_type == "DequantizeLinear" for n in graph.node)
        head = [n for n in graph.node if n.op_type == "MatMulNBits" and
                onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "N")) == 320]
        assert len(head) == (level == 4)  # the vocabulary projection, N = the vocabulary
    ids = np.random.default_rng(3).integers(0, 320, (2, 17))
    logits = {}
    for level in (0, 4):
        with runtime.load(bundle.path, accuracy_level=level) as session:
            assert session.backend.settings["accuracy_level"] == level
            logits[level] = session.forward(ids)[0]
    rel_l2 = np.linalg.norm(logits[4] - logits[0]) / np.linalg.norm(logits[0])
    assert 1e-3 < rel_l2 < 0.15, rel_l2
    assert (logits[4].argmax(-1) == logits[0].argmax(-1)).mean() >= 0.9


def test_a_dequantized_export_reads_the_file_tensor_by_tensor_and_computes_transformers_logits(all_types, tmp_path,
                                                                                                monkeypatch):
    """`export --dequantize` of a GGUF file streams it (model_defs/checkpoint.load_streamed): each tensor decoded
    where the graph's writer or a reference block reads it, the model never decoded whole (read_gguf, which
    decodes every tensor at once, is not called). Every block type of the file, within 1e-4 of transformers'
    logits on the same file, and no codes kept."""
    from kvforge.model_defs import gguf as gguf_module

    path, oracle, _ = all_types

    def whole(*args, **kwargs):
        raise AssertionError("the whole file was decoded")

    monkeypatch.setattr(gguf_module, "read_gguf", whole)
    bundle = export(path, tmp_path / "float", dequantize=True)
    assert bundle.quantization is None and bundle.manifest["validation"]["passed"]
    ids = np.random.default_rng(4).integers(0, 320, (2, 17))
    with runtime.load(bundle.path) as session:
        got, _ = session.forward(ids)
    with torch.no_grad():
        expected = oracle(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(got - expected).max() <= 1e-4


def test_pipeline_adds_the_checkpoints_codes_and_compares_them_with_its_dequantization(tmp_path):
    """A pre-quantized source's pipeline measures the float export of its dequantized weights and the bundle of
    its own codes (`checkpoint`), both against that dequantized Torch model, within float32's bounds."""
    from kvforge.bundle import Bundle
    from kvforge.verify.pipeline import pipeline

    small = dict(LLAMA, hidden_size=64, intermediate_size=96, num_hidden_layers=1)
    path = write_gguf(make_hf_model("llama", seed=7, **small), tmp_path / "q4.gguf", {".weight": Q.Q4_1})
    result = pipeline(path, tmp_path / "run", precisions=["fp32"], random_data=True, sample_prompt=None,
                      log=lambda line: None)
    reports = {o.artifact: o.report for o in result.outcomes}
    assert set(reports) == {"fp32", "checkpoint"} and result.passed
    assert reports["checkpoint"]["precision"] == "checkpoint" and reports["fp32"]["precision"] == "float32"
    assert abs(reports["checkpoint"]["perplexity_delta_pct"]) <= 0.01 and reports["checkpoint"]["top1_agreement"] == 1.0
    # the float artifact is `export --dequantize`: no codes, no DequantizeLinear; the checkpoint one keeps them
    fp32 = Bundle(tmp_path / "run" / "fp32")
    assert fp32.quantization is None and fp32.manifest["lineage"][0]["options"]["dequantize"] is True
    assert not any(n.op_type == "DequantizeLinear" for n in onnx.load(str(fp32.graph_file)).graph.node)
    assert Bundle(tmp_path / "run" / "checkpoint").quantization["checkpoint"]["kept"]


@pytest.mark.slow
def test_smollm2_q4_1_codes_keep_the_dequantized_models_perplexity(smollm2_fp32_bundle, tmp_path):
    """The real SmolLM2-135M-Instruct Q4_1 file: every quantized tensor kept (210 Q4_1 + the Q8_0 embedding), the
    graph about the file's size, and its perplexity on held-out prose the dequantized Torch model's within 0.1%.
    The codes go into the session's shared float export (one export of the real model per test run): the same
    rewrite `kvforge export smollm2` applies after validating that graph."""
    from kvforge.bundle import write_manifest
    from kvforge.export.api import keep_checkpoint_codes
    from kvforge.model_defs.checkpoint import load_quantized, packaged_file
    from kvforge.model_defs.evaluate import heldout_text, perplexity
    from kvforge.runtime.evaluate import perplexity as session_perplexity

    (reference, tokenizer), quantized = load_quantized("smollm2")
    out = tmp_path / "q4_1"
    shutil.copytree(smollm2_fp32_bundle.path, out)
    manifest = dict(smollm2_fp32_bundle.manifest)
    manifest["precision"] = {"dtype": "float32", "quantization": keep_checkpoint_codes(out, manifest["graph"], quantized)}
    write_manifest(out, manifest)
    record = manifest["precision"]["quantization"]["checkpoint"]
    assert len(record["kept"]) == 211 and not record["converted"] and not record["kept_float"]
    assert {r["type"] for r in record["kept"].values()} == {"Q4_1", "Q8_0"}
    size, file_size = (out / "model.onnx").stat().st_size, packaged_file("smollm2").stat().st_size
    assert size < 1.25 * file_size, (size, file_size)  # float32 scales and offsets where the file has float16
    ids = tokenizer.encode(heldout_text(), add_special_tokens=False)[:512]
    expected = perplexity(reference, ids, seq_len=256)
    with runtime.load(out) as session:
        got = session_perplexity(session, ids, seq_len=256)
    assert abs(got / expected - 1) <= 1e-3, (got, expected)


def test_tensorrt_is_refused_unsigned_codes_before_a_build(all_types):
    """TensorRT's DequantizeLinear takes signed codes only: a bundle that keeps Q4_1's or Q4_K's unsigned codes (a
    block minimum added after the scale) is refused by name before any engine build, as the lint says per node."""
    from kvforge.errors import KvforgeError
    from kvforge.export import lint
    from kvforge.tensorrt_env import check_precision_supported

    _, _, bundle = all_types
    with pytest.raises(KvforgeError, match=r"unsigned codes \(Q4_1, Q4_K: .*--dequantize"):
        check_precision_supported(bundle.quantization, "9.0", "H100")
    findings = {f["node"] for f in lint(bundle.graph_file)["findings"] if "UINT4" in f["message"]}
    assert findings == {"model.layers.1.attn.k_proj.weight_dq", "model.layers.0.attn.q_proj.weight_dq"}


def test_a_half_precision_export_of_kept_codes_is_refused_before_any_work(tmp_path):
    from kvforge.errors import KvforgeError

    small = dict(LLAMA, hidden_size=64, intermediate_size=96, num_hidden_layers=1)
    path = write_gguf(make_hf_model("llama", seed=8, **small), tmp_path / "q8.gguf", {".weight": Q.Q8_0})
    with pytest.raises(KvforgeError, match="kept in a float32 bundle.*--dequantize for a float16 bundle"):
        export(path, tmp_path / "half", dtype="float16")
    assert not (tmp_path / "half").exists()


def test_smollm2_against_transformers_from_text(smollm2_fp32_bundle):
    """The real SmolLM2-135M GGUF, exported: transformers' tokenizer and model read from the same file give the
    bundle's token ids on held-out text, and logits within its own FP32 rounding of the graph's (export/oracle.py),
    at export where transformers' GGUF reader (~3x the float model) fits the export's memory bound, else through
    `kvforge compare --against transformers`, which the export's record names."""
    from kvforge.export.oracle import against_transformers

    o = smollm2_fp32_bundle.manifest["oracle"]
    if not o["compared"]:
        assert "kvforge compare --against transformers" in o["reason"], o
        o = against_transformers(smollm2_fp32_bundle.path)
    assert o["compared"] and o["passed"] and o["token_ids_equal"] and o["inputs"] == "text", o
    assert o["outputs"] == ["logits"] and o["worst"]["ratio"] <= o["noise_multiple"]
