"""Mixture-of-experts FFNs: the dispatch computes what running every expert and weighting the chosen ones
computes, routes as configured, and exports to a graph that runs only the chosen experts."""

from __future__ import annotations

import onnx
import pytest
import torch

from kvforge.errors import KvforgeError
from kvforge.model_defs import ModelConfig, load
from kvforge.model_defs.model import build_model, init_random_weights
from kvforge.model_defs.moe import MoE


def _dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, the chosen ones weighted: the function the dispatch must compute."""
    flat = x.reshape(-1, x.shape[-1])
    weights, index = moe.router(flat)
    out = torch.zeros_like(flat)
    for e, expert in enumerate(moe.experts.experts):
        w = (weights * (index == e)).sum(-1, keepdim=True)
        out = out + w * expert(flat)
    if moe.shared is not None:
        s = moe.shared(flat)
        out = out + (torch.sigmoid(moe.shared_gate(flat)) * s if moe.shared_gate is not None else s)
    return out.reshape(x.shape)


@pytest.mark.parametrize("preset", ["mixtral-micro", "qwen2moe-micro"])
@torch.no_grad()
def test_dispatch_equals_every_expert_weighted(preset):
    model, _ = load(preset)
    cfg = model.config
    layer = next(i for i in range(cfg.n_layers) if cfg.is_moe_layer(i))
    moe = model.layers[layer].ffn
    assert isinstance(moe, MoE)
    x = torch.randn(3, 7, cfg.dim, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(moe(x), _dense_reference(moe, x), atol=1e-5, rtol=0)
    weights, index = moe.router(x.reshape(-1, cfg.dim))
    assert index.shape == (21, cfg.experts_per_token)
    assert all(len(set(row.tolist())) == cfg.experts_per_token for row in index)  # k distinct experts per token
    if cfg.norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(21), atol=1e-6, rtol=0)
    else:  # softmax probabilities of the chosen experts, not renormalized: less than one
        assert (weights.sum(-1) < 1).all()
    assert cfg.is_moe_layer(0) == (preset == "mixtral-micro")  # qwen2moe-micro's first layer is dense


@torch.no_grad()
def test_sigmoid_routing_with_a_correction_bias_and_scaling():
    cfg = ModelConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2, ffn_dim=32, n_experts=4, experts_per_token=2,
                      router_scoring="sigmoid", router_correction_bias=True, routed_scaling_factor=2.5)
    moe = init_random_weights(build_model(cfg)).layers[0].ffn
    moe.router.bias.copy_(torch.tensor([10.0, 0.0, 0.0, -10.0]))  # steers the choice only: expert 0 always, 3 never
    x = torch.randn(5, 16)
    weights, index = moe.router(x)
    assert (index == 0).any(-1).all() and not (index == 3).any()
    scores = torch.sigmoid(x @ moe.router.weight.T)
    expected = scores.gather(-1, index)
    torch.testing.assert_close(weights, 2.5 * expected / expected.sum(-1, keepdim=True), atol=1e-6, rtol=0)


def test_moe_configs_are_checked():
    base = dict(vocab_size=50, dim=16, n_layers=2, n_heads=2, ffn_dim=32)
    with pytest.raises(KvforgeError, match="experts_per_token must be in 1..n_experts=4"):
        ModelConfig(**base, n_experts=4, experts_per_token=5)
    with pytest.raises(KvforgeError, match="moe_layers"):
        ModelConfig(**base, n_experts=4, moe_layers=[2])
    with pytest.raises(KvforgeError, match="shared_expert_gate gates the shared expert"):
        ModelConfig(**base, n_experts=4, shared_expert_gate=True)


def test_exported_graph_runs_only_the_chosen_experts(micro_bundle):
    """Each expert's matmuls read only the rows routed to it (a Gather by the NonZero of its routing mask),
    so a decode step's cost follows the active experts; the graph matches the reference (export validation)."""
    bundle = micro_bundle("mixtral-micro")
    assert bundle.manifest["validation"]["passed"] and bundle.manifest["lint"]["passed"]
    graph = onnx.load(str(bundle.graph_file), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("NonZero") == 2 * 8  # one per expert per layer
    assert ops.count("TopK") == 2 and "ScatterND" in ops
    producer = {o: n for n in graph.node for o in n.output}

    def source_ops(name: str, depth: int = 3) -> list[str]:
        ops = []
        for _ in range(depth):
            node = producer.get(name)
            if node is None:
                break
            ops.append(node.op_type)
            name = node.input[0]
        return ops

    for layer in range(2):
        for e in range(8):
            for proj in ("gate_proj", "up_proj"):
                weight = f"model.layers.{layer}.ffn.experts.experts.{e}.{proj}.weight"
                (matmul,) = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] == weight]
                # the expert reads the rows gathered for it, never the whole batch
                assert "GatherND" in source_ops(matmul.input[0]), (weight, source_ops(matmul.input[0]))


@pytest.mark.parametrize("group_score", ["max", "top2"])
@torch.no_grad()
def test_group_limited_routing_chooses_only_within_the_best_groups(group_score):
    """DeepSeek's group-limited top-k against a per-token brute force: rank the groups by their best expert
    (V2) or best two summed (V3), keep the best topk_groups, take the top-k experts among them."""
    cfg = ModelConfig(vocab_size=50, dim=16, n_layers=1, n_heads=2, ffn_dim=32, n_experts=12, experts_per_token=3,
                      router_groups=4, router_topk_groups=2, router_group_score=group_score, router_scoring="sigmoid",
                      router_correction_bias=True)
    router = init_random_weights(build_model(cfg), seed=3).layers[0].ffn.router
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    weights, index = router(x)
    choice = (torch.sigmoid(x @ router.weight.T) + router.bias).reshape(64, 4, 3)
    for t in range(64):
        per_group = choice[t].max(-1).values if group_score == "max" else choice[t].topk(2, -1).values.sum(-1)
        kept = per_group.topk(2).indices.tolist()
        allowed = torch.full((12,), float("-inf"))
        for g in kept:
            allowed[3 * g:3 * g + 3] = choice[t, g]
        assert sorted(index[t].tolist()) == sorted(allowed.topk(3).indices.tolist())
        assert {int(e) // 3 for e in index[t]} <= set(kept)
    with pytest.raises(KvforgeError, match="not divisible into router_groups=5"):
        ModelConfig(**{**cfg.to_dict(), "router_groups": 5})
    with pytest.raises(KvforgeError, match="exceeds the 3 experts of router_topk_groups=1"):
        ModelConfig(**{**cfg.to_dict(), "router_topk_groups": 1, "experts_per_token": 4})


def test_latent_attention_configs_are_checked():
    base = dict(vocab_size=50, dim=32, n_layers=1, n_heads=4, head_dim=8, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=8)
    assert ModelConfig(**base).cache_entries(0) == [("latent", 1, 24)]
    with pytest.raises(KvforgeError, match="head_dim .* must equal qk_rope_head_dim=8"):
        ModelConfig(**{**base, "head_dim": 16})
    with pytest.raises(KvforgeError, match="latent attention needs v_head_dim to be a positive integer"):
        ModelConfig(**{**base, "v_head_dim": 0})
    with pytest.raises(KvforgeError, match="sliding_window is not supported"):
        ModelConfig(**{**base, "sliding_window": 8})
    with pytest.raises(KvforgeError, match="position must be 'rope'"):
        ModelConfig(**{**base, "position": "alibi"})


@torch.no_grad()
def test_absorbed_latent_attention_equals_expanding_the_latent():
    """The graph's form (queries and outputs through kv_b_proj's halves, attention over the latent) against
    DeepSeek's written-out form: per-head keys [k_nope | k_pe] and values from kv_b_proj(latent)."""
    from kvforge.model_defs.layers import attention_mask_bool
    from kvforge.model_defs.positions import apply_rope

    model, _ = load("deepseek-micro")
    cfg, attn = model.config, model.layers[0].attn
    H, r, dn, dr, dv = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    x = torch.randn(2, 9, cfg.dim, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9)
    rope = model.rope(pos)
    mask = attention_mask_bool(torch.ones(2, 9, dtype=torch.int64), 0, 9, None)
    out, (latent,) = attn(x, mask, rope, None)
    assert latent.shape == (2, 1, 9, r + dr)

    q = attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(x))).view(2, 9, H, dn + dr).transpose(1, 2)
    q = torch.cat([q[..., :dn], apply_rope(q[..., dn:], *rope)], -1)
    kv = attn.kv_b_proj(latent[:, 0, :, :r]).view(2, 9, H, dn + dv).transpose(1, 2)
    k = torch.cat([kv[..., :dn], latent[:, :, :, r:].expand(2, H, 9, dr)], -1)
    scores = (q @ k.transpose(-1, -2)) * attn.scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1)
    expected = attn.o_proj((probs @ kv[..., dn:]).transpose(1, 2).reshape(2, 9, H * dv))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_routing_decision_margins_are_the_gaps_at_each_choice():
    """Router.decision_margin (what export validation reads to tell a routing tie from a defect) against gaps
    computed here by sorting: k-th vs next expert, and last kept vs first dropped group; zero at an exact tie."""
    from kvforge.model_defs.moe import Router

    torch.manual_seed(0)
    x = torch.randn(16, 8)
    plain = Router(8, 6, top_k=2)
    torch.nn.init.normal_(plain.weight)
    s = torch.softmax(x @ plain.weight.T, -1).sort(-1, descending=True).values
    torch.testing.assert_close(plain.decision_margin(x), s[:, 1] - s[:, 2])
    grouped = Router(8, 8, top_k=2, scoring="sigmoid", groups=4, topk_groups=2, group_score="top2")
    torch.nn.init.normal_(grouped.weight)
    c = torch.sigmoid(x @ grouped.weight.T)
    g = c.reshape(16, 4, 2).sum(-1)  # top-2 of 2 experts: both
    g_sorted, order = g.sort(-1, descending=True)
    kept = torch.zeros(16, 4, dtype=torch.bool).scatter(1, order[:, :2], True).repeat_interleave(2, 1)
    e = c.masked_fill(~kept, float("-inf")).sort(-1, descending=True).values
    expected = torch.minimum(g_sorted[:, 1] - g_sorted[:, 2], e[:, 1] - e[:, 2])
    torch.testing.assert_close(grouped.decision_margin(x), expected)
    tie = Router(8, 2, top_k=1)
    with torch.no_grad():
        tie.weight.copy_(torch.stack([plain.weight[0], plain.weight[0]]))
    assert torch.all(tie.decision_margin(x) == 0)  # the two experts score alike: every token sits at a tie
