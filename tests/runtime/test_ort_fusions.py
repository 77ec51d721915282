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
# qwen2-micro: MQA, qkv biases, a sliding window on one layer (a capped cache, packed whole: the kernel's window).
@pytest.mark.parametrize("preset, packed", [("llama3-micro", True), ("geglu-micro", True), ("qwen2-micro", True)])
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
    # ALiBi's bias and a latent cache keep the exported attention; every other design's is packed (Gemma's
    # windowed layers too: 11 prompt tokens and 6 steps run past its window of 8)
    _assert_variant_equals_graph(bundle.path, steps=6, packed=preset not in ("alibi-micro", "deepseek-micro"))


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


# -- MatMulNBits accuracy level 4 (the backend's opt-in accuracy_level=4) ---------------------------------------------
_CODE_RANGES = {TensorProto.INT8: (-128, 128), TensorProto.UINT8: (0, 256), TensorProto.INT4: (-8, 8),
                TensorProto.UINT4: (0, 16)}


def _llama_cpp_matmul(x: np.ndarray, w_int: np.ndarray, scale: np.ndarray, block: int,
                      offset: np.ndarray | None = None) -> np.ndarray:
    """The oracle, in numpy as llama.cpp's Q8 dot products compute it: each block of `block` inputs along K
    quantized to int8 with its own scale d = max|x| / 127 (round to nearest), integer products summed per block,
    times d and the weight's block scale. w_int: [K, N] integer codes less their zero points; scale: [K/B, N]; a
    block offset [K/B, N] (GGUF's minimum) adds sum(x over the block) * offset, in float (as kvforge computes it)."""
    k = x.shape[-1]
    xb = x.reshape(-1, k // block, block)
    d = np.abs(xb).max(-1, keepdims=True) / np.float32(127)
    xq = np.rint(xb * np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32))
    assert np.abs(xq).max() <= 127
    dots = np.einsum("mbk,bkn->mbn", xq.astype(np.float64), w_int.reshape(k // block, block, -1).astype(np.float64))
    y = (dots * d.astype(np.float64) * scale[None].astype(np.float64)).sum(1)
    if offset is not None:
        y += xb.astype(np.float64).sum(-1) @ offset.astype(np.float64)
    return y.reshape(*x.shape[:-1], -1)


def _codes_chain(dtype: int, block: int, offset: bool, zero_point: bool, k: int = 256, n: int = 48, seed: int = 0):
    """A one-MatMul graph whose weight is a checkpoint-code chain as export/checkpoint_codes.py writes it
    (DequantizeLinear [-> Reshape -> Add(offset) -> Reshape] -> Identity "*_weight"), its input x [2, 3, K]; and
    (x, integer codes less zero points [K, N], scales [K/B, N], offsets [K/B, N] or None)."""
    rng = np.random.default_rng(seed)
    lo, hi = _CODE_RANGES[dtype]
    codes = rng.integers(lo, hi, (k, n))
    scale = (rng.random((k // block, n)) * 0.02 + 0.001).astype(np.float32)
    zp = rng.integers(lo, hi, (k // block, n)) if zero_point else np.zeros((k // block, n), np.int64)
    inits = [helper.make_tensor("w_quantized", dtype, [k, n], codes.flatten().tolist()),
             numpy_helper.from_array(scale, "w_scale")]
    inputs = ["w_quantized", "w_scale"]
    if zero_point:
        inits.append(helper.make_tensor("w_zero_point", dtype, [k // block, n], zp.flatten().tolist()))
        inputs.append("w_zero_point")
    nodes = [helper.make_node("DequantizeLinear", inputs, ["w_dequantized"], name="w_dq", axis=0, block_size=block)]
    current, rows = "w_dequantized", None
    if offset:
        rows = (rng.standard_normal((k // block, n)) * 0.05).astype(np.float32)
        inits += [numpy_helper.from_array(np.array([k // block, block, n], np.int64), "w_blocks"),
                  numpy_helper.from_array(rows[:, None], "w_offset"), numpy_helper.from_array(np.array([k, n], np.int64), "w_shape")]
        nodes += [helper.make_node("Reshape", [current, "w_blocks"], ["w_in_blocks"], name="w_split"),
                  helper.make_node("Add", ["w_in_blocks", "w_offset"], ["w_offset_added"], name="w_add_offset"),
                  helper.make_node("Reshape", ["w_offset_added", "w_shape"], ["w_blocked"], name="w_join")]
        current = "w_blocked"
    nodes += [helper.make_node("Identity", [current], ["w"], name="w_weight"),
              helper.make_node("MatMul", ["x", "w"], ["y"], name="linear")]
    graph = helper.make_graph(nodes, "codes", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    x[1, 2, :16] *= 40  # an outlier block: its own scale, as llama.cpp's per-block quantization gives it
    return model, (x, codes - np.repeat(zp, block, axis=0), scale, rows)


def _rel(a, b) -> float:
    """max |a - b| over the scale of b."""
    return float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())


def _within_int8_rounding(got: np.ndarray, exact: np.ndarray, x: np.ndarray, w_scaled: np.ndarray, block: int) -> bool:
    """Whether `got` departs from the exact product x @ w_scaled by no more than rounding each input to its block's
    int8 step allows: |error| <= sum over blocks of (max|x_block| / 127) / 2 * sum |w| over the block, per output."""
    k = x.shape[-1]
    step = np.abs(x.reshape(-1, k // block, block)).max(-1).astype(np.float64) / 127
    bound = step @ np.abs(w_scaled).reshape(k // block, block, -1).sum(1) / 2
    error = np.abs(got.astype(np.float64) - exact).reshape(bound.shape)
    return bool((error <= bound * (1 + 1e-5) + 1e-6 * np.abs(exact).max()).all())


# GGUF's layouts (export/checkpoint_codes.py): Q8_0 int8 block 32; Q6_K int8 block 16; Q5_1 uint8 block 32 with a zero
# point and a block minimum; Q4_0 int4; Q4_1 uint4 with its minimum. An int8 block of 8 is no MatMulNBits block.
@pytest.mark.parametrize("dtype, block, offset, zero_point, bits", [
    (TensorProto.INT8, 32, False, False, 8), (TensorProto.INT8, 16, False, False, 8),
    (TensorProto.UINT8, 32, True, True, 8), (TensorProto.INT4, 32, False, False, 4),
    (TensorProto.UINT4, 32, True, True, 4), (TensorProto.INT8, 8, False, False, None)],
    ids=["Q8_0", "Q6_K", "Q5_1", "Q4_0", "Q4_1", "int8-block-8"])
def test_accuracy_level_4_runs_checkpoint_codes_as_llama_cpp_dot_products(dtype, block, offset, zero_point, bits):
    """At accuracy level 4 a checkpoint's 4-bit and 8-bit code chains run as MatMulNBits at that level, and compute
    what numpy computes as llama.cpp does (activations quantized to int8 per weight block, max|x| / 127): within
    1e-5 of the output's scale (float sums in another order), while they sit 1e-4 to 5e-2 from the exact product
    (8-bit activations: each input off by at most half its block's step, max|x| / 127 / 2, which bounds each
    output's error; an outlier block is measured too). At level 0 nothing changes: 4-bit chains run
    MatMulNBits at level 0 (exact to float rounding), 8-bit ones a float weight, bit for bit the bundle's."""
    from kvforge.ort_session import make_session
    from kvforge.runtime.ort.codes import checkpoint_kernels

    model, (x, w_int, scale, rows) = _codes_chain(dtype, block, offset, zero_point)
    exact = x.astype(np.float64) @ (w_int * np.repeat(scale, block, axis=0))
    if rows is not None:
        exact += x.reshape(2, 3, -1, block).astype(np.float64).sum(-1) @ rows
    as_written = make_session(model.SerializeToString(), "checkpoint").run(None, {"x": x})[0]
    results = {}
    for level in (0, 4):
        variant = onnx.ModelProto()
        variant.CopyFrom(model)
        checkpoint_kernels(variant, accuracy_level=level)
        nbits = [{a.name: helper.get_attribute_value(a) for a in n.attribute}
                 for n in variant.graph.node if n.op_type == "MatMulNBits"]
        expected = bits if level == 4 else (4 if bits == 4 else None)
        assert [(a["bits"], a["accuracy_level"]) for a in nbits] == ([(expected, level)] if expected else [])
        results[level] = make_session(variant.SerializeToString(), "checkpoint").run(None, {"x": x})[0]
        if level == 0:
            default = onnx.ModelProto()
            default.CopyFrom(model)
            checkpoint_kernels(default)  # the level-0 graph is the one the variant always built
            assert default.SerializeToString() == variant.SerializeToString()
    assert _rel(results[0], exact) < 2e-6 and _rel(as_written, exact) < 2e-6
    if bits != 4:  # the weight evaluated to float: the bundle's own computation, bit for bit
        assert np.array_equal(results[0], as_written)
    if bits is None:
        assert np.array_equal(results[4], results[0])
        return
    assert _rel(results[4], _llama_cpp_matmul(x, w_int, scale, block, rows)) < 1e-5
    assert 1e-4 < _rel(results[4], exact) < 5e-2
    assert _within_int8_rounding(results[4], exact, x, w_int * np.repeat(scale, block, axis=0), block)


def test_a_tied_float_heads_transpose_is_written_so_the_table_is_the_gathers_alone():
    """A float table read by an embedding Gather and, through a Transpose, by the head's MatMul: the variant
    writes the transposed table as the MatMul's own weight (ONNX Runtime folds it at load anyway), so the table is
    read by the Gather alone (the table two sessions share, WEIGHT_DIGESTS); rows and logits as numpy's. The
    Transpose of a weight no Gather reads stays."""
    from kvforge.ort_session import make_session
    from kvforge.runtime.ort.variant import fold_tied_head_transposes

    rng = np.random.default_rng(6)
    vocab, k = 96, 64
    table = rng.standard_normal((vocab, k)).astype(np.float32)
    w = rng.standard_normal((8, vocab)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["t", "ids"], ["rows"], name="embedding"),
             helper.make_node("Transpose", ["t"], ["t_T"], name="t_transpose", perm=[1, 0]),
             helper.make_node("MatMul", ["x", "t_T"], ["logits"], name="head"),
             helper.make_node("Transpose", ["w"], ["w_T"], name="w_transpose", perm=[1, 0]),
             helper.make_node("MatMul", ["logits", "w_T"], ["y"], name="other")]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, k]),
                                              helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("rows", "logits", "y")],
                              [numpy_helper.from_array(table, "t"), numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)

    def readers(name):
        return [(n.op_type, list(n.input).index(name)) for n in model.graph.node if name in n.input]

    assert readers("t") == [("Gather", 0), ("Transpose", 0)]
    assert fold_tied_head_transposes(model) == 1
    assert [n.name for n in model.graph.node if n.op_type == "Transpose"] == ["w_transpose"]
    assert readers("t") == [("Gather", 0)] and readers("w") == [("Transpose", 0)]
    x = rng.standard_normal((1, 2, k)).astype(np.float32)
    ids = np.array([[0, 7, vocab - 1]])
    rows, logits, y = make_session(model.SerializeToString()).run(None, {"x": x, "ids": ids})
    np.testing.assert_array_equal(rows, table[ids])
    np.testing.assert_allclose(logits, x @ table.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, (x @ table.T) @ w.T, rtol=1e-4, atol=1e-4)

@pytest.mark.parametrize("dtype, levels", [(TensorProto.INT8, {0: None, 4: 8}), (TensorProto.INT4, {0: 4, 4: 4})],
                         ids=["Q8_0", "Q4_0"])
def test_a_tied_head_runs_on_its_embedding_tables_codes(dtype, levels):
    """A tied embedding table on the checkpoint's codes ([V, K], blocks along K: GGUF's token_embd), read by a Gather
    and, transposed, by the vocabulary projection: the Gather reads the table evaluated to float (exactly the
    bundle's rows), and the head runs as MatMulNBits on the table's own codes where its width allows (4-bit at any
    level; 8-bit at level 4): at level 0 within float rounding of the exact product, at level 4 what numpy computes
    as llama.cpp does (1e-5)."""
    from kvforge.ort_session import make_session
    from kvforge.runtime.ort.codes import checkpoint_kernels

    rng = np.random.default_rng(5)
    vocab, k, block = 96, 128, 32
    lo, hi = _CODE_RANGES[dtype]
    codes = rng.integers(lo, hi, (vocab, k))
    scale = (rng.random((vocab, k // block)) * 0.02 + 0.001).astype(np.float32)
    nodes = [helper.make_node("DequantizeLinear", ["t_quantized", "t_scale"], ["t_dequantized"], name="t_dq", axis=1,
                              block_size=block),
             helper.make_node("Identity", ["t_dequantized"], ["t"], name="t_weight"),
             helper.make_node("Gather", ["t", "ids"], ["rows"], name="embedding"),
             helper.make_node("Transpose", ["t"], ["t_T"], name="t_transpose", perm=[1, 0]),
             helper.make_node("MatMul", ["x", "t_T"], ["logits"], name="head")]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, k]),
                                              helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 3])],
                              [helper.make_tensor_value_info("rows", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                              [helper.make_tensor("t_quantized", dtype, [vocab, k], codes.flatten().tolist()),
                               numpy_helper.from_array(scale, "t_scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    x = rng.standard_normal((1, 2, k)).astype(np.float32)
    ids = np.array([[0, 7, vocab - 1]])
    table = codes * np.repeat(scale, block, axis=1)
    exact = x.astype(np.float64) @ table.T
    for level, bits in levels.items():
        variant = onnx.ModelProto()
        variant.CopyFrom(model)
        checkpoint_kernels(variant, accuracy_level=level)
        nbits = [n for n in variant.graph.node if n.op_type == "MatMulNBits"]
        assert [helper.get_attribute_value(next(a for a in n.attribute if a.name == "bits")) for n in nbits] == \
            ([bits] if bits else [])
        rows, logits = make_session(variant.SerializeToString(), "checkpoint").run(None, {"x": x, "ids": ids})
        np.testing.assert_array_equal(rows, table[ids].astype(np.float32))
        if level == 0:
            assert _rel(logits, exact) < 2e-6
        else:
            assert _rel(logits, _llama_cpp_matmul(x, codes.T, scale.T, block)) < 1e-5
            assert 1e-4 < _rel(logits, exact) < 5e-2


def test_accuracy_level_4_fuses_an_int4_bundles_int8_blocks():
    """An INT4 bundle's layers kept as INT8 blocks: at level 0 the variant makes them float weights (exact); at level
    4 it keeps the block-wise DequantizeLinears that only MatMuls read, and ONNX Runtime (the int4 session config at
    that level) runs them and the INT4 layer as MatMulNBits with 8-bit activations: each MatMul within 1e-5 of the
    llama.cpp-style oracle. A table also read by a Gather (a tied embedding) becomes float at either level."""
    from kvforge.ort_session import make_session
    from kvforge.runtime.ort.variant import float_int8_blocks

    rng = np.random.default_rng(1)
    k, block = 128, 32
    c4, c8 = rng.integers(-8, 8, (k, k)), rng.integers(-128, 128, (k, k))
    s4, s8 = [(rng.random((k // block, k)) * 0.02 + 0.001).astype(np.float32) for _ in range(2)]
    inits = [helper.make_tensor("w4_q", TensorProto.INT4, [k, k], c4.flatten().tolist()), numpy_helper.from_array(s4, "w4_s"),
             numpy_helper.from_array(c8.astype(np.int8), "w8_q"), numpy_helper.from_array(s8, "w8_s"),
             numpy_helper.from_array(c8.astype(np.int8), "t_q"), numpy_helper.from_array(s8, "t_s"),
             numpy_helper.from_array(np.array([3], np.int64), "row")]
    nodes = [helper.make_node("DequantizeLinear", ["w4_q", "w4_s"], ["w4"], axis=0, block_size=block),
             helper.make_node("MatMul", ["x", "w4"], ["h"]),
             helper.make_node("DequantizeLinear", ["w8_q", "w8_s"], ["w8"], axis=0, block_size=block),
             helper.make_node("MatMul", ["h", "w8"], ["y"]),
             helper.make_node("DequantizeLinear", ["t_q", "t_s"], ["t"], axis=0, block_size=block),
             helper.make_node("Gather", ["t", "row"], ["g"]), helper.make_node("MatMul", ["x", "t"], ["z"])]
    graph = helper.make_graph(nodes, "int4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, k])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("h", "y", "g", "z")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    x = rng.standard_normal((1, 2, k)).astype(np.float32)
    kept, floated = onnx.ModelProto(), onnx.ModelProto()
    kept.CopyFrom(model)
    floated.CopyFrom(model)
    assert float_int8_blocks(kept, keep_matmul_weights=True) == 1  # the table read by the Gather
    assert float_int8_blocks(floated) == 2
    assert [n.input[0] for n in kept.graph.node if n.op_type == "DequantizeLinear"] == ["w4_q", "w8_q"]
    w8 = c8 * np.repeat(s8, block, axis=0).astype(np.float64)
    h0, y0 = make_session(floated.SerializeToString(), "int4").run(["h", "y"], {"x": x})
    assert _rel(h0, x.astype(np.float64) @ (c4 * np.repeat(s4, block, axis=0))) < 2e-6
    assert _rel(y0, h0.astype(np.float64) @ w8) < 2e-6
    h4, y4, z4 = make_session(kept.SerializeToString(), "int4", accuracy_level=4).run(["h", "y", "z"], {"x": x})
    assert _rel(h4, _llama_cpp_matmul(x, c4, s4, block)) < 1e-5
    assert _rel(y4, _llama_cpp_matmul(h4, c8, s8, block)) < 1e-5  # the second MatMul over the first's output
    assert 1e-4 < _rel(y4, h4.astype(np.float64) @ w8) < 5e-2
    assert _within_int8_rounding(y4, h4.astype(np.float64) @ w8, h4, w8, block)
    assert _rel(z4, x.astype(np.float64) @ w8) < 2e-6  # the table's MatMul reads a float weight


@pytest.fixture(scope="module")
def int4_micro(micro_bundle, tmp_path_factory):
    """llama3-micro calibrated to INT4 (blocks of 32): a bundle whose MatMulNBits the accuracy level changes."""
    from kvforge.calibration import calibrate

    return calibrate(micro_bundle("llama3-micro").path, tmp_path_factory.mktemp("acc") / "int4", recipe="fixed",
                     precision="int4", random_data=True, samples=8, seq_len=32, block_size=32)


def test_accuracy_level_is_opt_in_recorded_and_refused_unless_0_or_4(int4_micro):
    """An INT4 bundle on ONNX Runtime: level 0 by default; accuracy_level=4 builds a variant of its own (the cache
    key names the level; level 0's is the key it always had), is recorded in the backend's settings (and in what
    benchmark() returns), and changes the logits a little (8-bit activations), with the variant and with the
    bundle's graph alike. Any other level is refused by name, before any work."""
    from kvforge.errors import KvforgeError
    from kvforge.runtime.bench import benchmark

    q = int4_micro
    p0, p4 = (variant_path(Bundle(q.path), attention=True, accuracy_level=level) for level in (0, 4))
    assert p0 != p4 and p4.parent.name == f"{p0.parent.name}-acc4" and "acc" not in p0.parent.name
    nbits = [{a.name: helper.get_attribute_value(a) for a in n.attribute}
             for n in onnx.load(str(p4), load_external_data=False).graph.node if n.op_type == "MatMulNBits"]
    assert nbits == []  # the variant keeps INT4's DequantizeLinears: ORT fuses them at the session's level
    ids = np.random.default_rng(0).integers(0, 259, (2, 9))
    logits = {}
    for variant in (True, False):
        for level in (0, 4):
            with runtime.load(q.path, variant=variant, **({"accuracy_level": level} if level else {})) as s:
                assert s.backend.settings["accuracy_level"] == level and f"accuracy_level={level}" in repr(s.backend)
                logits[variant, level] = s.forward(ids)[0]
                if variant and level:
                    assert benchmark(s, 1, 4, 2, runs=1, warmup=0)["backend_settings"]["accuracy_level"] == 4
    np.testing.assert_allclose(logits[True, 0], logits[False, 0], atol=1e-4, rtol=0)
    for variant in (True, False):
        base, fast = logits[variant, 0], logits[variant, 4]
        rel_l2 = np.linalg.norm(fast - base) / np.linalg.norm(base)
        assert 1e-5 < rel_l2 < 5e-2, rel_l2
    for bad in (1, 2, 8, "4", True, None):
        with pytest.raises(KvforgeError, match=r"accuracy_level must be one of 0 \(.*exact.*\); 4 \(.*int8.*\); got"):
            runtime.load(q.path, accuracy_level=bad)
    with pytest.raises(KvforgeError, match="accuracy_level must be one of"):
        variant_path(Bundle(q.path), accuracy_level=3)


@pytest.mark.parametrize("attention", ["auto", "graph"])
def test_prefill_accuracy_level_runs_steps_of_many_tokens_on_a_session_at_that_level(int4_micro, attention):
    """accuracy_level=4 with prefill_accuracy_level=0: a step of more than one token a row (a prompt) runs on a
    second session at level 0, a one-token step at level 4; each step's logits are those a session at that level
    alone computes over the same cache (packed and the bundle's attention), and a level-0 prompt continues on
    level 4's decode steps. Both levels are recorded; a bad prefill level is refused by its option's name."""
    from kvforge.errors import KvforgeError

    q, rng = int4_micro, np.random.default_rng(1)
    ids, nxt = rng.integers(0, 259, (2, 9)), rng.integers(0, 259, (2, 1))
    with runtime.load(q.path, attention=attention) as exact, runtime.load(q.path, accuracy_level=4, attention=attention) as fast, \
            runtime.load(q.path, accuracy_level=4, prefill_accuracy_level=0, attention=attention) as both:
        assert (both.backend.settings["accuracy_level"], both.backend.settings["prefill_accuracy_level"]) == (4, 0)
        assert "prefill_accuracy_level=0" in repr(both.backend)
        p0, c0 = exact.forward(ids)
        p4, _ = fast.forward(ids)
        pb, cb = both.forward(ids)
        np.testing.assert_allclose(pb, p0, atol=1e-5, rtol=0)  # the prompt: level 0's kernels
        assert np.linalg.norm(p4 - p0) / np.linalg.norm(p0) > 1e-5  # (which level 4's would not give)
        arrays = both.cache_arrays(cb)
        for a, b in zip(arrays, exact.cache_arrays(c0)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
        d4, _ = fast.forward(nxt, cache=fast.cache_from_arrays(arrays, ids.shape[1]))
        d0, _ = exact.forward(nxt, cache=c0)
        db, cb2 = both.forward(nxt, cache=cb)
        np.testing.assert_allclose(db, d4, atol=1e-5, rtol=0)  # a decode step: level 4's
        assert np.linalg.norm(d4 - d0) / np.linalg.norm(d0) > 1e-5
        # the cache the decode step wrote goes on into another prompt-sized step, on level 0's session again
        more = rng.integers(0, 259, (2, 3))
        e0, _ = exact.forward(more, cache=exact.cache_from_arrays(both.cache_arrays(cb2), ids.shape[1] + 1))
        np.testing.assert_allclose(both.forward(more, cache=cb2)[0], e0, atol=1e-5, rtol=0)
    for bad in (2, "0", True):
        with pytest.raises(KvforgeError, match=r"prefill_accuracy_level must be one of 0 \(.*\); 4 \(.*\); got"):
            runtime.load(q.path, accuracy_level=4, prefill_accuracy_level=bad)


def test_two_levels_sessions_hold_the_weights_their_graphs_hold_alike_once(int4_micro, tmp_path, monkeypatch):
    """The two sessions of accuracy_level=4 with prefill_accuracy_level=0 share (as one OrtValue) exactly the
    tables (weights only Gathers read, as their data) both levels' variants hold under one name with equal values,
    as onnx reads the two files: the embedding. The micro model's weights are small, so every table is digested
    here (in use, those of 1 MiB and more). A shared MatMul weight would be neither folded nor prepacked."""
    from onnx import numpy_helper

    from kvforge.runtime.ort import variant

    monkeypatch.setattr(variant, "_DIGESTED_BYTES", 1)
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path))  # variants built anew, with every weight's digest
    ids = np.random.default_rng(2).integers(0, 259, (1, 7))
    with runtime.load(int4_micro.path, accuracy_level=4, prefill_accuracy_level=0) as both:
        logits, _ = both.forward(ids)
        shared = both.backend.shared_weights
    models = [onnx.load(str(variant_path(Bundle(int4_micro.path), attention=True, accuracy_level=level)))
              for level in (4, 0)]
    graphs = [{t.name: numpy_helper.to_array(t) for t in m.graph.initializer} for m in models]
    readers = [collections.defaultdict(set) for _ in models]
    for model, read in zip(models, readers):
        for node in model.graph.node:
            for i, name in enumerate(node.input):
                read[name].add((node.op_type, i))
    alike = {n for n, a in graphs[0].items() if n in graphs[1] and a.dtype == graphs[1][n].dtype
             and a.shape == graphs[1][n].shape and np.array_equal(a, graphs[1][n])
             and all(read[n] == {("Gather", 0)} for read in readers)}
    assert len(alike) == 1 and set(shared) == alike
    assert graphs[0][next(iter(alike))].shape == (259, 64)  # the embedding table
    with runtime.load(int4_micro.path) as exact:
        np.testing.assert_allclose(logits, exact.forward(ids)[0], atol=1e-5, rtol=0)
