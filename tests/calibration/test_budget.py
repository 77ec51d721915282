"""calibrate --accuracy-budget: the most sensitive blocks stay in float until the budget holds."""

from __future__ import annotations

import pytest

from kvforge.calibration import calibrate
from kvforge.errors import KvforgeError

QUICK = dict(recipe="fixed", samples=32, seq_len=128, budget_tokens=1024)


def test_a_met_budget_keeps_nothing_and_a_tighter_one_keeps_the_top_ranked_blocks(tiny_fp32, tmp_path):
    loose = calibrate(tiny_fp32.path, tmp_path / "loose", precision="int8", accuracy_budget={"top1_agreement": 0.5}, **QUICK)
    fit = loose.manifest["calibration"]["accuracy_budget"]
    assert fit["kept_in_float"] == [] and fit["ranking"] is None and len(fit["iterations"]) == 1
    full_top1 = fit["iterations"][0]["top1_agreement"]
    assert 0.8 < full_top1 < 1.0

    target = min(full_top1 + 0.01, 0.995)
    tight = calibrate(tiny_fp32.path, tmp_path / "tight", precision="int8", accuracy_budget={"top1_agreement": target}, **QUICK)
    fit = tight.manifest["calibration"]["accuracy_budget"]
    ranked = [r["layer"] for r in sorted(fit["ranking"], key=lambda r: r["rank"])]
    kept = fit["kept_in_float"]
    assert kept and kept == ranked[: len(kept)]  # most sensitive first, by compare --per-layer's ranking
    assert fit["iterations"][-1]["top1_agreement"] >= target
    assert all(it["top1_agreement"] < target for it in fit["iterations"][:-1])  # it stopped as soon as it held
    q = tight.manifest["precision"]["quantization"]
    for block in kept:
        assert any(name.startswith(block + ".") for name in q["excluded_layers"])
        assert not any(name.startswith(block + ".") for name in q["quantized_layers"])
    speed = fit["speed"]
    assert speed["float_decode_tokens_per_s"] > 0 and speed["result_decode_tokens_per_s"] > 0
    assert tight.manifest["lineage"][-1]["options"]["accuracy_budget"] == {"top1_agreement": target}


def test_an_unreachable_budget_writes_nothing(tiny_fp32, tmp_path):
    with pytest.raises(KvforgeError, match="accuracy budget cannot be met"):
        calibrate(tiny_fp32.path, tmp_path / "out", precision="int8", accuracy_budget={"kl_divergence_mean": 0.0}, **QUICK)
    # refused before any work
    for budget, message in [({"top1_agreement": 1.01}, "an agreement bound lies in"), ({"top1_agreement": -0.5}, "an agreement bound lies in"),
                            ({"greedy_agreement": 0.9}, "greedy_agreement.. is not among them"),
                            (["greedy_agreement=0.9"], "greedy_agreement.. is not among them")]:  # the CLI's form
        with pytest.raises(KvforgeError, match=message):
            calibrate(tiny_fp32.path, tmp_path / "out", precision="int8", accuracy_budget=budget, **QUICK)
    with pytest.raises(KvforgeError, match="--budget-tokens must be at least the budget's window of 256 tokens, got 100"):
        calibrate(tiny_fp32.path, tmp_path / "out", precision="int8", accuracy_budget={"top1_agreement": 0.9}, **{**QUICK, "budget_tokens": 100})
    (tmp_path / "short.txt").write_text("def f(x):\n    return x\n")
    with pytest.raises(KvforgeError, match="needs more than 256 tokens of held-out text; .*short.txt gives"):
        calibrate(tiny_fp32.path, tmp_path / "out", precision="int8", accuracy_budget={"top1_agreement": 0.9},
                  budget_data=tmp_path / "short.txt", **QUICK)
    assert not (tmp_path / "out").exists()
