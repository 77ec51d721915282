"""DeepSeek's multi-head latent attention exported: the cache is the latent, the past is never expanded to
per-head keys and values, and the runtime generates what transformers generates.

The DeepSeek-V3-shaped checkpoint is tests/conftest.py's (written by transformers, random weights, YaRN with
DeepSeek's mscale, group-limited sigmoid routing); its export is shared with tests/export/test_export.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

pytest.importorskip("transformers")

from kvforge import runtime  # noqa: E402
from kvforge.model_defs import load  # noqa: E402

from ..conftest import make_hf_model  # noqa: E402

# The slow tier (README's third command, run by .ci/run): every test here reads hf_bundle's exports of Hugging Face
# families, which the slow tier makes anyway (tests/export/test_export.py::test_every_hf_family_exports_and_matches);
# in the default tier they were six traces of their own (89 s of a run's 650 s of tracing). The default tier keeps
# latent attention and the mixtures through the micro presets (deepseek-micro, mixtral-micro, qwen2moe-micro).
pytestmark = pytest.mark.slow

# ops that move or reshape data without computing on it
_DATA_MOVEMENT = {"Concat", "Transpose", "Reshape", "Slice", "Unsqueeze", "Squeeze", "Expand", "Cast", "Identity",
                  "Split", "Gather"}


def _graph(bundle) -> onnx.ModelProto:
    return onnx.load(str(bundle.graph_file))


def test_deepseek_v3_cache_holds_the_latent_per_layer_and_token(hf_bundle):
    """The graph's cache inputs and outputs: one tensor per layer of kv_lora_rank + qk_rope_head_dim features."""
    bundle = hf_bundle("deepseek_v3")
    cfg = bundle.model_config
    width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert width == 16 + 8 and cfg["n_heads"] * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]) > width
    g = _graph(bundle).graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*g.input, *g.output]}
    past = [n for n in dims if n.startswith("past_key_values.")]
    present = [n for n in dims if n.startswith("present.")]
    assert past == [f"past_key_values.{i}.latent" for i in range(cfg["n_layers"])]
    assert present == [f"present.{i}.latent" for i in range(cfg["n_layers"])]
    for name in past:
        assert dims[name] == ["batch_size", 1, "past_sequence_length", width]
    for name in present:
        assert dims[name] == ["batch_size", 1, "total_sequence_length", width]
    assert bundle.io.past == [[n] for n in past] and bundle.io.empty_shape(past[0], 3) == [3, 1, 0, width]


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_the_cache_never_meets_a_weight(hf_bundle, family):
    """Weight absorption: from each past latent, through data movement only, the graph reaches exactly two
    MatMuls (the scores and the weighted sum) whose other operand is computed from the new tokens, never a
    weight: kv_b_proj is applied to the queries and the outputs, so no per-head K/V of the past is ever made."""
    g = _graph(hf_bundle(family)).graph
    weights = {i.name for i in g.initializer} | {o for n in g.node if n.op_type == "Constant" for o in n.output}
    consumers: dict[str, list] = {}
    for node in g.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    outputs = {o.name for o in g.output}
    for past in [i.name for i in g.input if i.name.startswith("past_key_values.")]:
        frontier, seen, matmuls, others = [past], set(), [], []
        while frontier:
            name = frontier.pop()
            for node in consumers.get(name, []):
                if node.name in seen:
                    continue
                seen.add(node.name)
                if node.op_type in _DATA_MOVEMENT:
                    frontier += [o for o in node.output if o not in outputs or consumers.get(o)]
                elif node.op_type in ("MatMul", "FusedMatMul", "Gemm"):
                    matmuls.append(node)
                elif node.op_type != "Shape":  # reading a shape computes nothing on the values
                    others.append(node.op_type)
        assert len(matmuls) == 2, (past, [m.name for m in matmuls])
        assert not others, (past, others)
        for m in matmuls:
            assert not set(m.input) & weights, f"{past} is multiplied by a weight in {m.name}"


# every routed family: the runtime's greedy tokens on the exported bundle are transformers' generate's
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
@torch.no_grad()
def test_runtime_greedy_generation_equals_transformers(hf_bundle, family):
    bundle = hf_bundle(family)
    hf_model = make_hf_model(family)
    hf_model.generation_config.eos_token_id = None  # both sides run the 16 steps and may pick the EOS id (no
    # min_new_tokens: it would forbid EOS, which kvforge's ignore_eos does not)
    prompt = [5, 17, 101, 42, 7, 250]
    theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    with runtime.load(bundle.path) as s:
        ours = s.generate(prompt, max_new_tokens=16, ignore_eos=True).tokens
        batch = s.generate([prompt, prompt[2:]], max_new_tokens=6, ignore_eos=True)  # left-padded rows
    assert ours == theirs[0, len(prompt):].tolist()
    short = hf_model.generate(torch.tensor([prompt[2:]]), max_new_tokens=6, do_sample=False)
    assert batch[0].tokens == ours[:6] and batch[1].tokens == short[0, 4:].tolist()


@torch.no_grad()
def test_torch_backend_runs_the_latent_cache(hf_checkpoint, hf_bundle):
    """The runtime's torch backend feeds the one-tensor-per-layer cache to the reference model."""
    bundle = hf_bundle("deepseek_v2")
    ids = np.array([[3, 9, 27, 81, 243]], np.int64)
    with runtime.load(bundle.path) as ort_s, runtime.load(bundle.path, backend="torch",
                                                          source=str(hf_checkpoint("deepseek_v2"))) as torch_s:
        a, cache_a = ort_s.forward(ids)
        b, cache_b = torch_s.forward(ids)
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)
        a2, _ = ort_s.forward(ids[:, :1], cache=cache_a)
        b2, _ = torch_s.forward(ids[:, :1], cache=cache_b)
        np.testing.assert_allclose(a2, b2, atol=1e-4, rtol=0)
    model, _ = load(hf_checkpoint("deepseek_v2"))
    ref, _ = model(torch.from_numpy(np.concatenate([ids, ids[:, :1]], axis=1)))
    np.testing.assert_allclose(a2[0, -1], ref[0, -1].numpy(), atol=1e-4, rtol=0)
