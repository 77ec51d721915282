"""Calibrating a mixture of experts: tokens counted per expert, starved experts covered or kept in float."""

from __future__ import annotations

import pytest

from kvforge.calibration import calibrate
from kvforge.errors import KvforgeError


def _tokens_per_layer(record) -> dict[str, int]:
    return {moe: sum(r["tokens"] for r in experts.values()) for moe, experts in record.items()}


def test_every_expert_is_counted_and_the_starved_are_covered(micro_bundle, tmp_path):
    fp32 = micro_bundle("mixtral-micro")
    samples, seq_len = 4, 16  # 64 tokens, 2 experts each: 128 routings over 8 experts per layer
    b = calibrate(fp32.path, tmp_path / "int8", precision="int8", random_data=True, samples=samples, seq_len=seq_len,
                  min_expert_tokens=20)
    record = b.manifest["calibration"]["experts"]
    assert set(record) == {"layers.0.ffn", "layers.1.ffn"} and all(len(e) == 8 for e in record.values())
    assert _tokens_per_layer(record) == {"layers.0.ffn": 128, "layers.1.ffn": 128}
    states = {r["calibrated"] for experts in record.values() for r in experts.values()}
    starved = [(moe, e) for moe, experts in record.items() for e, r in experts.items() if r["tokens"] < 20]
    assert starved and states == {"routed", "all-tokens"}
    assert all(record[moe][e]["calibrated"] == "all-tokens" for moe, e in starved)
    acts = b.manifest["calibration"]["scales"]["activations"]
    q = b.manifest["precision"]["quantization"]
    moe, e = starved[0]
    assert f"{moe}.experts.experts.{e}.down_proj" in q["quantized_layers"]
    # a starved expert's input scale is the whole layer input's (every token routed to it), not its few rows'
    gate = acts[f"{moe}.experts.experts.{e}.gate_proj.input"]
    busiest = max(record[moe], key=lambda k: record[moe][k]["tokens"])
    assert gate["amax"] >= acts[f"{moe}.experts.experts.{busiest}.gate_proj.input"]["amax"]
    assert b.manifest["lineage"][-1]["options"]["starved_experts"] == "all-tokens"

    kept = calibrate(fp32.path, tmp_path / "int8-float", precision="int8", random_data=True, samples=samples, seq_len=seq_len,
                     min_expert_tokens=20, starved_experts="float")
    kq = kept.manifest["precision"]["quantization"]
    for moe, e in starved:
        layer = f"{moe}.experts.experts.{e}.down_proj"
        assert layer in kq["excluded_layers"] and layer not in kq["quantized_layers"]
        assert kept.manifest["calibration"]["experts"][moe][e]["calibrated"] == "float"
    with pytest.raises(KvforgeError, match="starved-experts"):
        calibrate(fp32.path, tmp_path / "x", precision="int8", random_data=True, starved_experts="drop")


# cosine bounds on random weights: FP8 is close; 4-bit codes of random 16-wide blocks are coarse
@pytest.mark.parametrize("precision, options, cosine", [
    ("fp8", {"random_data": True, "samples": 4, "seq_len": 16}, 0.95), ("int4", {"recipe": "fixed", "block_size": 16}, 0.8)])
def test_latent_attention_and_grouped_routing_quantize(micro_bundle, tmp_path, precision, options, cosine):
    """DeepSeek-shaped (latent attention, sigmoid group-limited routing): every projection quantizes, the router
    and the absorbed per-head kv_b_proj halves (3-D, no linear layer) stay float, the cache stays the latent,
    and the quantized graph stays close to the float one."""
    import numpy as np

    from kvforge import runtime

    fp32 = micro_bundle("deepseek-micro")
    q = calibrate(fp32.path, tmp_path / precision, precision=precision, **options)
    layers = set(q.manifest["precision"]["quantization"]["quantized_layers"])
    for proj in ("q_a_proj", "q_b_proj", "kv_a_proj", "o_proj"):
        assert f"layers.0.attn.{proj}" in layers
    assert "layers.1.ffn.experts.experts.3.down_proj" in layers and "layers.1.ffn.shared.up_proj" in layers
    assert not any("router" in name or "kv_b_proj" in name for name in layers)
    assert q.io.past == fp32.io.past and q.io.inputs == fp32.io.inputs
    ids = np.random.default_rng(0).integers(3, 259, (1, 12))
    with runtime.load(q.path) as s, runtime.load(fp32.path) as f:
        got, cache = s.forward(ids)
        want, _ = f.forward(ids)
        assert s.backend.cache_arrays(cache)[0].shape == (1, 1, 12, 24)
    measured = (got * want).sum() / np.linalg.norm(got) / np.linalg.norm(want)
    assert measured > cosine, measured
