"""`tiny` in every dtype. (The large presets at scale: benchmarks/features/export_125m.py, `--source gpt2-124m` for
GPT-2's design; the real SmolLM2-135M and Gemma 3 270M are exported at scale in the slow tier.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvforge.export.validate import TOLERANCES, OrtRunner
from kvforge.model_defs import load
from kvforge.model_defs.evaluate import greedy_continuation

PROMPT = "import os\n\n\ndef read_config(path):\n    "


def _ort_greedy(bundle, dtype, prompt_ids, steps):
    """Free-running greedy decode on ONNX Runtime, the cache fed back (independent of the validator's loop)."""
    runner = OrtRunner(bundle.graph_file, dtype)
    names = [t.name for t in bundle.io.inputs]
    past = [runner.cast(torch.zeros(bundle.io.empty_shape(n, 1))) for layer in bundle.io.past for n in layer]
    ids, tokens = list(prompt_ids), []
    step_ids = ids
    for _ in range(steps):
        total = len(ids)
        feeds = {
            "input_ids": np.array([step_ids], np.int64),
            "attention_mask": np.ones((1, total), np.int64),
            "position_ids": np.arange(total - len(step_ids), total, dtype=np.int64)[None],
            **dict(zip(names[3:], past)),
        }
        out = runner.session.run(None, feeds)
        token = int(out[0][0, -1].argmax())
        tokens.append(token)
        ids.append(token)
        step_ids, past = [token], out[1:]
    return tokens


def test_tiny_fp32_matches_and_decodes_identically(tiny_fp32):
    v = tiny_fp32.manifest["validation"]
    assert v["passed"] and v["logits"]["max_abs"] <= 1e-4 and v["lockstep"]["greedy_matching_steps"] == 32
    model, tok = load("tiny")
    prompt = tok.encode(PROMPT)
    assert _ort_greedy(tiny_fp32, "float32", prompt, 32) == greedy_continuation(model, prompt, 32)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tiny_half_precision_within_tolerance_and_30_of_32_greedy(half_bundle, dtype):
    bundle = half_bundle("tiny", dtype)
    v = bundle.manifest["validation"]
    assert v["passed"]
    # within the allowed multiple of the reference computed in the dtype's own rounding noise, which is itself of
    # the dtype's precision: a few ulps relative (unit roundoff: 2^-11 FP16, 2^-8 BF16)
    eps = float(torch.finfo(getattr(torch, dtype)).eps)
    for part in ("logits", "present"):
        assert v[part]["rel_l2"] <= TOLERANCES[dtype]["noise_multiple"] * max(v["noise"][part]["rel_l2"], eps)
        assert eps / 8 < v["noise"][part]["rel_l2"] < 16 * eps, (part, v["noise"])
    assert v["lockstep"]["greedy_matching_steps"] >= 30
    assert bundle.io.input("past_key_values.0.key").dtype == dtype
    model, tok = load("tiny")
    prompt = tok.encode(PROMPT)
    reference = greedy_continuation(model, prompt, 32)
    ours = _ort_greedy(bundle, dtype, prompt, 32)
    assert sum(a == b for a, b in zip(ours, reference)) >= 30, (tok.decode(ours), tok.decode(reference))
