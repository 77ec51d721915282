"""Deliberately broken exports are rejected, and the report says where, on tiny and on SmolLM2.

Each defect is injected into the ONNX graph of one shared, validated FP32 export per model (the session's
`tiny_fp32` and `smollm2_fp32_bundle`): a RoPE frequency table computed with another base, the norm epsilon
x10, two KV heads of one layer's k projection swapped, the causal mask's comparison shifted by one (key <= query
becomes key < query), and Softmax computed in FP16 (its input and output rounded to FP16). validate() then runs
against the correct reference on three cases (a prefill, a decode, a left-padded decode; no fuzzing and no
lockstep: the full set ran when the shared export was made), on inputs cut from the tokenizer's encoding of real
text. The unbroken graph passes the same checks. The same defects are injected into tiny's FP16 export (but the
FP16 Softmax, which an FP16 graph's scores are anyway).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.export.validate import TOLERANCES, validate
from kvforge.export.validate_inputs import Float64Reference, text_tokens
from kvforge.model_defs import load
from kvforge.model_defs.evaluate import heldout_text
from kvforge.model_defs.positions import rope_inv_freq

CASES = ("prefill b3", "decode after 1", "left-padded decode")


# -- the defects: each edits the graph in place ----------------------------------------------------------------
def _set(init: onnx.TensorProto, array: np.ndarray) -> None:
    init.CopyFrom(numpy_helper.from_array(array, init.name))


def wrong_rope_base(model: onnx.ModelProto, cfg, weights_dir: str) -> None:
    """The inverse-frequency table computed with a tenth of the model's RoPE base."""
    right = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling).numpy()
    tables = [i for i in model.graph.initializer if list(i.dims) == [right.size] and i.data_type == TensorProto.FLOAT
              and np.allclose(numpy_helper.to_array(i), right, rtol=1e-6)]
    assert len(tables) == 1, [i.name for i in tables]
    _set(tables[0], rope_inv_freq(cfg.rotary_dim, cfg.rope_theta / 10, cfg.rope_scaling).numpy())


def norm_eps_x10(model: onnx.ModelProto, cfg, weights_dir: str) -> None:
    """Every RMSNorm's epsilon (one shared scalar constant) ten times too large."""
    eps = [i for i in model.graph.initializer if not i.dims and i.data_type == TensorProto.FLOAT
           and numpy_helper.to_array(i) == np.float32(cfg.norm_eps)]
    assert len(eps) == 1, [i.name for i in eps]
    _set(eps[0], np.array(cfg.norm_eps * 10, np.float32))


def swap_kv_heads(layer: int):
    def defect(model: onnx.ModelProto, cfg, weights_dir: str) -> None:
        """KV heads 0 and 1 of `layer`'s k projection trade places (its weight is stored [in, out])."""
        init = next(i for i in model.graph.initializer if i.name == f"model.layers.{layer}.attn.k_proj.weight")
        w = numpy_helper.to_array(init, weights_dir).copy()  # stored inline again by _set
        d = cfg.head_dim
        w[:, :d], w[:, d:2 * d] = w[:, d:2 * d].copy(), w[:, :d].copy()
        _set(init, w)

    return defect


def mask_off_by_one(model: onnx.ModelProto, cfg, weights_dir: str) -> None:
    """The causal comparison key <= query becomes key < query: no token sees itself."""
    (node,) = [n for n in model.graph.node if n.op_type == "LessOrEqual"]
    node.op_type = "Less"


def softmax_fp16(model: onnx.ModelProto, cfg, weights_dir: str) -> None:
    """Every attention Softmax takes and gives FP16: its input and output rounded through FP16 (Cast pairs; ONNX
    Runtime's CPU provider has no FP16 Softmax and would cancel a lone Cast to FP16 in front of one)."""
    nodes = list(model.graph.node)
    del model.graph.node[:]
    for n in nodes:
        if n.op_type != "Softmax":
            model.graph.node.append(n)
            continue
        src, dst = n.input[0], n.output[0]
        n.input[0], n.output[0] = f"{src}__fp16_in", f"{dst}__fp16_out"
        model.graph.node.extend([*_through_fp16(src, n.input[0]), n, *_through_fp16(n.output[0], dst)])


def _through_fp16(src: str, dst: str) -> list[onnx.NodeProto]:
    return [helper.make_node("Cast", [src], [f"{dst}__half"], to=TensorProto.FLOAT16),
            helper.make_node("Cast", [f"{dst}__half"], [dst], to=TensorProto.FLOAT)]


def _defects(kv_layer: int) -> dict:
    """name -> (defect, the first layer whose cache must depart). The embeddings' norm and RoPE act before layer
    0's cache; a swapped k head is layer `kv_layer`'s own cache; mask and softmax act on layer 0's attention,
    whose output layer 1 caches first."""
    return {
        "rope base": (wrong_rope_base, 0),
        "norm epsilon x10": (norm_eps_x10, 0),
        "kv head swap": (swap_kv_heads(kv_layer), kv_layer),
        "mask off by one": (mask_off_by_one, 1),
        "softmax in fp16": (softmax_fp16, 1),
    }


# -- running them ---------------------------------------------------------------------------------------------
class Graph:
    """The shared export's graph with its weights written once to a file beside it: copy() gives an editable graph
    of a few kilobytes that reads the same weights file when saved into the same directory."""

    def __init__(self, graph_file, directory):
        self.directory = str(directory)
        onnx.save(onnx.load(str(graph_file)), str(directory / "correct.onnx"), save_as_external_data=True,
                  location="weights.data", size_threshold=1024)
        self.proto = onnx.load(str(directory / "correct.onnx"), load_external_data=False)

    def copy(self) -> onnx.ModelProto:
        graph = onnx.ModelProto()
        graph.CopyFrom(self.proto)
        return graph


def _run(graph: onnx.ModelProto, path, reference, tokens, max_context: int, reference64, dtype: str) -> dict:
    onnx.save(graph, str(path))
    return validate(path, reference, dtype, max_context, fuzz=0, cases=CASES, lockstep=False, tokens=tokens,
                    reference64=reference64)


NOISE = {"float32": "x the FP32 reference's rounding noise", "float16": "x the float16 reference's rounding noise"}


def _check_rejected(summary: dict, expected_layer: int, kv_layer: int, dtype: str) -> None:
    assert not summary["passed"]
    failed = {line.split(" (batch")[0] for line in summary["failures"]}
    if dtype == "float32":
        assert failed == set(CASES), summary["failures"]  # each case on its own catches it
    first = summary["first_failure"]
    assert first["case"] == CASES[0] and first["excess"] > 1.0
    assert first["ratio"] > TOLERANCES[dtype]["noise_multiple"]
    for result in summary["case_results"]:
        if result["case"] in failed:
            assert result["first_layer"] == expected_layer, (result, summary["failures"])
    for line in summary["failures"]:
        assert f"first departing cache: layer {expected_layer} (present.{expected_layer}." in line, line
        assert NOISE[dtype] in line, line
    if expected_layer == kv_layer:  # the swapped heads are keys: the key cache departs, not the value cache
        assert all(f"(present.{kv_layer}.key," in line for line in summary["failures"])


def _defect_tests(graph_file, reference, tokens, max_context, tmp_path, kv_layer, dtype="float32"):
    base = Graph(graph_file, tmp_path)
    reference64 = Float64Reference(reference) if dtype == "float32" else None
    control = _run(base.copy(), tmp_path / "control.onnx", reference, tokens, max_context, reference64, dtype)
    assert control["passed"], control["failures"]  # the same reduced checks pass the unbroken graph
    assert control["worst"]["excess"] <= 1.0 and control["first_failure"] is None
    defects = _defects(kv_layer)
    if dtype != "float32":  # a half graph's attention scores and probabilities are half values either way
        del defects["softmax in fp16"]
    for name, (defect, layer) in defects.items():
        graph = base.copy()
        defect(graph, reference.config, base.directory)
        summary = _run(graph, tmp_path / "broken.onnx", reference, tokens, max_context, reference64, dtype)
        try:
            _check_rejected(summary, layer, kv_layer, dtype)
        except AssertionError as e:
            raise AssertionError(f"defect {name!r}: {e}") from e


def test_tiny_defects_are_rejected_and_located(tiny_fp32, tmp_path):
    v = tiny_fp32.manifest["validation"]
    assert v["passed"]  # the full validation passed the correct export, on ids tiny itself sampled
    assert v["inputs"] == "token ids sampled from the reference"
    reference, tokenizer = load("tiny")
    assert text_tokens(tokenizer) == (None, None)
    tokens = tokenizer.encode(heldout_text()[:4000], add_special_tokens=False)  # here: its held-out text
    _defect_tests(tiny_fp32.graph_file, reference, tokens, reference.config.max_seq_len, tmp_path,
                  kv_layer=2)


def test_tiny_float16_defects_are_rejected_and_located(half_bundle, tmp_path):
    """In FP16 the bound is a multiple of the rounding noise of the reference computed in FP16 (HalfReference):
    the same defects as in FP32 are caught, each by the first case (the norm epsilon's, whose effect is within
    a few times FP16's rounding on short rows, not by every case)."""
    bundle = half_bundle("tiny", "float16")
    assert bundle.manifest["validation"]["passed"]
    reference, tokenizer = load("tiny")
    tokens = tokenizer.encode(heldout_text()[:4000], add_special_tokens=False)
    _defect_tests(bundle.graph_file, reference, tokens, reference.config.max_seq_len, tmp_path, kv_layer=2,
                  dtype="float16")


@pytest.mark.slow
def test_smollm2_defects_are_rejected_and_located(smollm2_fp32_bundle, tmp_path):
    v = smollm2_fp32_bundle.manifest["validation"]
    assert v["passed"] and not v["failures"] and v["worst"]["excess"] <= 1.0
    assert v["inputs"].startswith("token ids of built-in English prose")  # a real model reads real English
    reference, tokenizer = load("smollm2")
    _defect_tests(smollm2_fp32_bundle.graph_file, reference, text_tokens(tokenizer)[0], reference.config.max_seq_len,
                  tmp_path, kv_layer=5)
