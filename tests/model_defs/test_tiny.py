"""The built-in `tiny` model: shipped, trained, and what its training record says."""

from __future__ import annotations

import json

import pytest
import torch

from kvforge.model_defs import load
from kvforge.model_defs.checkpoint import TINY_DIR
from kvforge.model_defs.evaluate import heldout_text, perplexity

RECORD = json.loads((TINY_DIR / "training.json").read_text())


def test_tiny_ships_small_and_loads():
    weights = TINY_DIR / "model.safetensors"
    assert weights.stat().st_size <= 10 * 2**20
    model, tok = load()  # the default model
    assert model.config.vocab_size == tok.vocab_size == 4096
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert model.num_parameters() == RECORD["parameters"]
    from kvforge.model_defs import ModelConfig

    assert model.config == ModelConfig.from_name("tiny")  # the preset and the shipped checkpoint agree


@pytest.mark.slow
def test_heldout_perplexity_is_what_the_record_says_and_far_below_uniform():
    model, tok = load("tiny")
    ids = tok.encode(heldout_text(), add_special_tokens=False)
    ppl = perplexity(model, ids, 256)
    assert ppl == pytest.approx(RECORD["heldout_perplexity"], rel=1e-3)
    assert ppl < RECORD["uniform_perplexity"] / 50  # it learned Python, not noise


@torch.no_grad()
def test_greedy_sample_is_reproducible_and_looks_like_python():
    from kvforge.model_defs.evaluate import greedy_continuation

    model, tok = load("tiny")
    out = tok.decode(greedy_continuation(model, tok.encode(RECORD["sample_prompt"]), 48, stop=[tok.eos_token_id]))
    assert out == RECORD["sample_greedy"]
