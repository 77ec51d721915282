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


# --- tiny-moe: latent attention + a mixture of experts, trained on tiny's corpus with tiny's tokenizer ---
def _moe_record() -> dict:
    from kvforge.model_defs.checkpoint import TRAINED

    return json.loads((TRAINED["tiny-moe"] / "training.json").read_text())


@torch.no_grad()
def test_tiny_moe_ships_trained_with_tinys_tokenizer():
    from kvforge.model_defs import ModelConfig
    from kvforge.model_defs.checkpoint import TRAINED
    from kvforge.model_defs.evaluate import greedy_continuation

    record = _moe_record()
    assert (TRAINED["tiny-moe"] / "model.safetensors").stat().st_size <= 14 * 2**20
    model, tok = load("tiny-moe")
    assert model.config == ModelConfig.from_name("tiny-moe") and model.config.kv_lora_rank and model.config.n_experts
    assert 4_000_000 <= model.num_parameters() == record["parameters"] <= 8_000_000
    assert (TRAINED["tiny-moe"] / "tokenizer.json").read_bytes() == (TINY_DIR / "tokenizer.json").read_bytes()
    assert record["train_seconds"] < 90 * 60  # trained here in under 90 minutes
    assert record["heldout_perplexity"] < record["uniform_perplexity"] / 40  # it learned Python, not noise
    out = tok.decode(greedy_continuation(model, tok.encode(record["sample_prompt"]), 48, stop=[tok.eos_token_id]))
    assert out == record["sample_greedy"]


def test_a_trained_preset_without_its_weights_says_how_to_train_them(tmp_path, monkeypatch):
    from kvforge.errors import KvforgeError
    from kvforge.model_defs import checkpoint

    monkeypatch.setitem(checkpoint.TRAINED, "tiny-moe", tmp_path / "nothing-here")
    with pytest.raises(KvforgeError, match="train_tiny --preset tiny-moe"):
        load("tiny-moe")
