"""The ORT variant's RMSNorm and RoPE fusions: they fire on the exporter's chains, keep the function, and touch nothing else."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge import runtime
from kvforge.bundle import Bundle
from kvforge.onnx_graph import drop_dead_nodes
from kvforge.runtime.ort.fusions import fuse_rms_norms, fuse_rotary, fuse_skip_rms_norms
from kvforge.runtime.ort.variant import variant_path


def _ops(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


# llama3-micro: Llama-3 RoPE scaling; geglu-micro: partial rotary (12 of head_dim 24), linear scaling;
# qwen2-micro: MQA, qkv biases, a sliding window on one layer (a capped cache: no packed attention).
@pytest.mark.parametrize("preset, packed", [("llama3-micro", True), ("geglu-micro", True), ("qwen2-micro", False)])
def test_fused_variant_computes_the_bundle_graph(preset, packed, micro_bundle):
    bundle = micro_bundle(preset)
    layers = bundle.model_config["n_layers"]
    ops = _ops(variant_path(Bundle(bundle.path)))
    # two norms per block and the final one; all but the first read a residual Add, which joins them
    assert ops["SkipSimplifiedLayerNormalization"] == 2 * layers and ops["SimplifiedLayerNormalization"] == 1
    assert ops["RotaryEmbedding"] == 2 * layers  # q and k per block
    assert ops["Pow"] == ops["Neg"] == ops["Reciprocal"] == 0  # nothing of the chains is left over
    ops = _ops(variant_path(Bundle(bundle.path), attention=True))
    assert ops["GroupQueryAttention"] == (layers if packed else 0)
    assert ops["Softmax"] == (0 if packed else layers)  # all attention or none of it

    _assert_variant_equals_graph(bundle.path, packed=packed)


def _assert_variant_equals_graph(path, steps: int = 3, packed: bool | None = None, atol: float = 2e-5) -> None:
    """A left-padded batch: prefill, then decode steps, through the bundle's graph and the fused variant (with
    its attention as exported, and as the CPU backend runs it: GroupQueryAttention over a packed cache where the
    graph allows, which `packed` states when given). Logits and cache columns at padding positions are outside
    the contract (the mask hides them), so only real positions are compared."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 259, (2, 11), dtype=np.int64)
    mask = np.ones((2, 11), np.int64)
    mask[1, :4] = 0
    pos = np.clip(np.cumsum(mask, 1) - 1, 0, None)
    with runtime.load(path, variant=False) as plain, runtime.load(path, attention="graph") as fused, \
            runtime.load(path) as fast:
        assert not fused.backend.packed
        if packed is not None:
            assert fast.backend.packed == packed
        a, ca = plain.forward(ids, mask, position_ids=pos)
        caches = []
        for s in (fused, fast):
            b, cb = s.forward(ids, mask, position_ids=pos)
            np.testing.assert_allclose(b[mask == 1], a[mask == 1], atol=atol, rtol=0)
            caches.append(cb)
        for step in range(steps):
            token = rng.integers(0, 259, (2, 1), dtype=np.int64)
            mask = np.concatenate([mask, np.ones((2, 1), np.int64)], 1)
            pos = pos[:, -1:] + 1
            a, ca = plain.forward(token, mask, position_ids=pos, cache=ca)
            for i, s in enumerate((fused, fast)):
                b, caches[i] = s.forward(token, mask, position_ids=pos, cache=caches[i])
                np.testing.assert_allclose(b, a, atol=atol, rtol=0)
        real = mask[:, None, :, None] == 1
        for s, cb in zip((fused, fast), caches):
            for x, y in zip(plain.backend.cache_arrays(ca), s.backend.cache_arrays(cb)):
                held = real[:, :, -x.shape[2]:]  # a capped (windowed) layer holds the last W columns
                np.testing.assert_allclose(np.where(held, y, 0), np.where(held, x, 0), atol=atol, rtol=0)


# The decoder designs beyond Llama: where a fusion's pattern is broken (a q/k norm before RoPE, sandwich or
# output norms, LayerNorms, ALiBi) it must be skipped, and the variant must still compute the bundle's graph.
# Decode runs past gemma-micro's window of 8, so its capped caches roll.
@pytest.mark.parametrize("preset, fused", [
    ("alibi-micro", {"RotaryEmbedding": 0, "SimplifiedLayerNormalization": 0, "LayerNormalization": 6}),
    ("neox-micro", {"RotaryEmbedding": 4, "SimplifiedLayerNormalization": 0}),  # partial rotary fuses
    ("parallel-micro", {"RotaryEmbedding": 4, "LayerNormalization": 7}),  # per-head q/k LayerNorms are LayerNorms
    # norms on outputs and whole-projection q/k norms are plain RMSNorms; only the final one reads a residual Add
    ("olmo-micro", {"SimplifiedLayerNormalization": 8, "SkipSimplifiedLayerNormalization": 1, "RotaryEmbedding": 4}),
    ("granite-micro", {"SkipSimplifiedLayerNormalization": 4, "SimplifiedLayerNormalization": 1, "RotaryEmbedding": 4}),
    # per-head q/k RMSNorms (a reshape inside the chain) stay decomposed: one Pow each
    ("gemma-micro", {"RotaryEmbedding": 8, "Pow": 8}),
    # learned positions, biases, MHA: no RoPE to fuse; its attention is packed (GroupQueryAttention with 4/4 heads)
    ("gpt2-micro", {"RotaryEmbedding": 0, "LayerNormalization": 5}),
    # each expert's dispatch (its NonZero, gathers, FFN and scatter) runs under an If on whether any token chose
    # it (ort_moe.py): one If per expert and MoE layer, nothing of the dispatch left in the main graph; the
    # latent attention of deepseek-micro keeps its exported form (no packed GroupQueryAttention over a latent)
    ("mixtral-micro", {"If": 16, "NonZero": 0, "ScatterND": 0, "RotaryEmbedding": 4}),
    ("qwen2moe-micro", {"If": 6, "NonZero": 0}),
    ("deepseek-micro", {"If": 8, "NonZero": 0, "GroupQueryAttention": 0}),
])
def test_variant_of_every_decoder_design_computes_the_bundle_graph(micro_bundle, preset, fused):
    bundle = micro_bundle(preset)
    ops = _ops(variant_path(Bundle(bundle.path)))
    for op, count in fused.items():
        assert ops[op] == count, (op, ops[op])
    # ALiBi's bias and Gemma's windows keep the exported attention; every other design's is packed
    _assert_variant_equals_graph(bundle.path, steps=6, packed=preset not in ("alibi-micro", "gemma-micro", "deepseek-micro"))


# Quantized siblings (q/k/v, gate/up) become one DequantizeLinear of their codes side by side and one MatMul: W8A8
# quantizes the shared activation once; INT4 block 32 and FP8 fuse alike. The variant keeps the graph's function.
@pytest.mark.parametrize("precision, options", [("int8", {"smoothquant": 0.5}), ("int4", {"block_size": 32}), ("fp8", {})])
def test_quantized_sibling_matmuls_fuse(micro_bundle, tmp_path, precision, options):
    from kvforge.calibration import calibrate

    fp32 = micro_bundle("llama3-micro")
    q = calibrate(fp32.path, tmp_path / precision, recipe="fixed", precision=precision, random_data=True, samples=8,
                  seq_len=32, **options)
    layers = q.model_config["n_layers"]
    before, after = _ops(q.graph_file), _ops(variant_path(Bundle(q.path), attention=True))
    assert before["MatMul"] - after["MatMul"] >= 3 * layers  # q/k/v: 3 -> 1, gate/up: 2 -> 1 per layer
    assert after["DequantizeLinear"] == before["DequantizeLinear"] - 3 * layers * (2 if precision != "int4" else 1)
    assert after["GroupQueryAttention"] == layers
    if options.get("smoothquant"):  # the 1/s before q/k/v and gate/up fold into the norms; o and down keep theirs
        smooth = sorted(n.name.split(".")[-2] for n in onnx.load(str(variant_path(Bundle(q.path), attention=True))).graph.node
                        if n.op_type == "Mul" and n.name.endswith("input_smooth"))
        assert smooth == ["down_proj"] * layers + ["o_proj"] * layers
    _assert_variant_equals_graph(q.path, packed=True, atol=1e-4)


def test_half_precision_and_rope_free_graphs_are_left_unfused(micro_bundle, half_bundle):
    """float16 chains carry Casts (and the fusions are float32-only); a LayerNorm, sinusoidal model has no chain."""
    half = half_bundle("llama3-micro", "float16")
    ops = _ops(variant_path(Bundle(half.path)))
    assert ops["SimplifiedLayerNormalization"] == ops["RotaryEmbedding"] == ops["SkipSimplifiedLayerNormalization"] == 0
    assert ops["Pow"] > 0
    classic = micro_bundle("classic-micro")
    ops = _ops(variant_path(Bundle(classic.path)))
    assert ops["SimplifiedLayerNormalization"] == ops["RotaryEmbedding"] == 0 and ops["LayerNormalization"] > 0


def _rms_graph(extra_output: str | None = None, exponent: float = 2.0, axis: int = -1):
    f = TensorProto.FLOAT
    inits = [
        numpy_helper.from_array(np.array(exponent, np.float32), "two"),
        numpy_helper.from_array(np.array([axis], np.int64), "axes"),
        numpy_helper.from_array(np.array(1e-5, np.float32), "eps"),
        numpy_helper.from_array(np.linspace(0.5, 1.5, 8).astype(np.float32), "w"),
    ]
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["p"]),
        helper.make_node("ReduceMean", ["p", "axes"], ["m"], keepdims=1),
        helper.make_node("Add", ["m", "eps"], ["a"]),
        helper.make_node("Sqrt", ["a"], ["s"]),
        helper.make_node("Reciprocal", ["s"], ["r"]),
        helper.make_node("Mul", ["x", "r"], ["n"]),
        helper.make_node("Mul", ["w", "n"], ["y"]),
    ]
    outputs = [helper.make_tensor_value_info("y", f, [2, 3, 8])]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, f, None))
    graph = helper.make_graph(nodes, "rms", [helper.make_tensor_value_info("x", f, [2, 3, 8])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _run(model, x):
    import onnxruntime as ort

    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})


def test_per_channel_scales_after_a_norm_fold_into_it():
    """SmoothQuant's 1/s Mul after a norm becomes part of the norm's scale (and bias); a Mul whose input another
    node also reads, or whose constant is not per channel, stays."""
    from kvforge.runtime.ort.variant import fold_scales_into_norms

    f = TensorProto.FLOAT
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.uniform(0.5, 1.5, 8).astype(np.float32), n) for n in ("w", "b", "c", "c2")]
    inits.append(numpy_helper.from_array(np.array(2.0, np.float32), "two"))
    nodes = [
        helper.make_node("LayerNormalization", ["x", "w", "b"], ["n1"], axis=-1, epsilon=1e-5),
        helper.make_node("Mul", ["n1", "c"], ["y1"]),  # folds
        helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["n2"], axis=-1, epsilon=1e-5),
        helper.make_node("Mul", ["c2", "n2"], ["y2"]),  # folds (the constant may come first)
        helper.make_node("LayerNormalization", ["x", "w", "b"], ["n3"], axis=-1, epsilon=1e-5),
        helper.make_node("Mul", ["n3", "two"], ["y3"]),  # a scalar: stays
        helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["n4"], axis=-1, epsilon=1e-5),
        helper.make_node("Mul", ["n4", "c"], ["y4"]),  # n4 is also a graph output: stays
    ]
    outputs = [helper.make_tensor_value_info(n, f, [2, 3, 8]) for n in ("y1", "y2", "y3", "y4", "n4")]
    graph = helper.make_graph(nodes, "fold", [helper.make_tensor_value_info("x", f, [2, 3, 8])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    expected = _run(model, x)
    assert fold_scales_into_norms(model) == 2
    assert [n.op_type for n in model.graph.node].count("Mul") == 2
    for got, want in zip(_run(model, x), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_rms_norm_fusion_matches_and_refuses_near_misses():
    x = np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)
    model = _rms_graph()
    expected = _run(model, x)[0]
    assert fuse_rms_norms(model) == 1
    assert [n.op_type for n in model.graph.node] == ["SimplifiedLayerNormalization"]
    np.testing.assert_allclose(_run(model, x)[0], expected, atol=1e-6, rtol=0)
    assert fuse_skip_rms_norms(model) == 0  # x is a graph input, not a residual Add
    # an intermediate the graph also returns, another exponent, another axis: not an RMSNorm chain to replace
    for near_miss in (_rms_graph(extra_output="r"), _rms_graph(exponent=3.0), _rms_graph(axis=1)):
        before = [n.op_type for n in near_miss.graph.node]
        assert fuse_rms_norms(near_miss) == 0
        assert [n.op_type for n in near_miss.graph.node] == before


def test_rotary_fusion_needs_the_whole_rotate_half_chain(micro_bundle):
    """A RoPE chain whose q rotation is also read elsewhere is left decomposed; the rest still fuses."""
    bundle = micro_bundle("llama3-micro")
    model = onnx.load(str(bundle.graph_file))
    concat = next(n for n in model.graph.node if n.op_type == "Concat" and any(
        p.op_type == "Neg" for p in model.graph.node if p.output[0] in n.input))
    model.graph.output.append(helper.make_tensor_value_info(concat.output[0], TensorProto.FLOAT, None))
    assert fuse_rotary(model) == 2 * bundle.model_config["n_layers"] - 1
    assert drop_dead_nodes(model) == 0  # the chain left decomposed still reads the Cos/Sin tables
    assert any(n.output[0] == concat.output[0] for n in model.graph.node)  # and is still computed


def test_unchosen_experts_are_skipped_and_chosen_ones_run(micro_bundle, tmp_path):
    """The If on each expert: a decode step of one token runs the FFN of only the k = 2 experts it chose per
    layer (the others take the else branch, which passes the running output through), with the bundle graph's
    logits."""
    import json

    import onnxruntime as ort

    bundle = micro_bundle("mixtral-micro")
    path = variant_path(Bundle(bundle.path))
    ifs = [n for n in onnx.load(str(path)).graph.node if n.op_type == "If"]
    assert len(ifs) == 16
    expert_matmuls = []  # per If (layer-major, expert order): the names of the MatMuls in its then branch
    for node in ifs:
        branches = {a.name: a.g for a in node.attribute}
        assert [n.op_type for n in branches["else_branch"].node] == ["Identity"]
        then_ops = collections.Counter(n.op_type for n in branches["then_branch"].node)
        assert then_ops["NonZero"] == 1 and then_ops["ScatterND"] == 1 and then_ops["MatMul"] >= 2
        expert_matmuls.append({n.name for n in branches["then_branch"].node if n.op_type == "MatMul"})
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "moe")
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([[7]]), "attention_mask": np.ones((1, 1), np.int64),
             "position_ids": np.zeros((1, 1), np.int64), "num_logits_to_keep": np.array([1])}
    feeds.update({n: np.zeros(bundle.io.empty_shape(n, 1), np.float32) for layer in bundle.io.past for n in layer})
    (logits,) = sess.run(["logits"], feeds)
    events = json.loads(Path(sess.end_profiling()).read_text())
    ran = {e["name"].removesuffix("_kernel_time") for e in events if e.get("cat") == "Node"}
    chosen = [i for i, names in enumerate(expert_matmuls) if names & ran]
    assert [sum(1 for i in chosen if i // 8 == layer) for layer in (0, 1)] == [2, 2], chosen
    with runtime.load(bundle.path, variant=False) as plain:
        np.testing.assert_allclose(logits, plain.forward(np.array([[7]]))[0], atol=2e-5, rtol=0)
