"""The Llama-style decoder families (separate q/k/v/o projections and a gated MLP): Llama, Mistral, Qwen2,
Qwen3, OLMo 2, Granite, Cohere, Phi-3, Gemma 1-3, and the mixture-of-experts ones (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, DeepSeek-V2/V3): their config mappers and weight tables."""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvforge.errors import KvforgeError

from .hf_common import (
    Table,
    Transform,
    activation,
    chain,
    first,
    flatten,
    half_split,
    kv_heads,
    linear_weights,
    plus_one,
    query_heads,
    refuse,
    repeat_heads,
    rope_fields,
    rope_parameters,
    rows,
    special_ids,
    windowed_layers,
    yarn_mscale,
)


# --- Llama-style families -------------------------------------------------------
def llama_like(hf: dict[str, Any], family: str, *, eps: float = 1e-6, head_dim: int | None = None,
               kv_heads_default: int | None = None, theta: float = 10000.0, tie: bool = False,
               act_key: str = "hidden_act", act_default: str = "silu", attention_bias: bool | None = None,
               rope: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields every decoder with separate q/k/v/o projections and a gated MLP shares.

    rope: the RoPE fields when the family reads them its own way (default: whole-head RoPE from rope_parameters).
    """
    heads = hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False)) if attention_bias is None else attention_bias
    if rope is None:
        rope = rope_fields(rope_parameters(hf, default_theta=theta), hf, partial_rotary=False)
    return dict(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or kv_heads_default or heads,
        head_dim=hf.get("head_dim") or head_dim or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings") or 2048,
        norm="rmsnorm",
        norm_eps=first(hf, "rms_norm_eps", default=eps),
        activation=activation(hf, act_key, act_default),
        gated_ffn=True,
        ffn_bias=bool(hf.get("mlp_bias", False)),
        qkv_bias=bias,
        out_bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", tie)),
        family=family,
        **rope,
        **special_ids(hf),
    )


def llama(hf):
    return llama_like(hf, "llama")


def mistral(hf):
    cfg = llama_like(hf, "mistral", attention_bias=False)
    cfg["ffn_bias"] = False  # transformers' Mistral has no biases, whatever the config says
    cfg["sliding_window"] = hf.get("sliding_window")
    return cfg


def _qwen_windows(hf: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """Qwen2/Qwen3: layer_types, or (older configs) the layers from max_window_layers on slide when use_sliding_window."""
    layer_types = hf.get("layer_types")
    if layer_types is None:
        if not hf.get("use_sliding_window"):
            return {}
        first_windowed = hf.get("max_window_layers", n_layers)
        layer_types = ["sliding_attention" if i >= first_windowed else "full_attention" for i in range(n_layers)]
    if not hf.get("sliding_window"):
        return {}  # transformers drops the window when use_sliding_window is off
    return windowed_layers(hf, n_layers, hf.get("sliding_window"), layer_types)


def qwen2(hf):
    cfg = llama_like(hf, "qwen2", attention_bias=True)
    cfg.update(out_bias=False, ffn_bias=False)
    cfg.update(_qwen_windows(hf, cfg["n_layers"]))
    return cfg


def qwen3(hf):
    # Qwen3's config defaults: head_dim 128 (not hidden / heads) and 32 KV heads when the keys are absent.
    cfg = llama_like(hf, "qwen3", head_dim=128, kv_heads_default=32)
    cfg.update(ffn_bias=False, qk_norm="head")
    cfg.update(_qwen_windows(hf, cfg["n_layers"]))
    return cfg


def olmo2(hf):
    cfg = llama_like(hf, "olmo2", eps=1e-5)
    cfg.update(ffn_bias=False, norm_placement="output", qk_norm="proj")
    return cfg


def _moe_layers(hf: dict[str, Any], n_layers: int) -> list[int]:
    """Qwen-MoE's layers with experts: every decoder_sparse_step-th one not in mlp_only_layers."""
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    return [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]


def _n_experts(hf: dict[str, Any], default: int) -> int:
    """The routed expert count: num_experts, or num_local_experts (Mixtral's name, and transformers 5's for Qwen3-MoE)."""
    return int(next((hf[k] for k in ("num_experts", "num_local_experts") if hf.get(k) is not None), default))


def mixtral(hf):
    cfg = mistral(hf)
    cfg.update(family="mixtral", n_experts=_n_experts(hf, 8), experts_per_token=hf.get("num_experts_per_tok", 2),
               expert_ffn_dim=hf.get("intermediate_size", 14336), norm_topk_prob=True)
    return cfg


def qwen2_moe(hf):
    cfg = qwen2(hf)
    cfg.update(family="qwen2_moe", n_experts=_n_experts(hf, 60), experts_per_token=hf.get("num_experts_per_tok", 4),
               expert_ffn_dim=hf.get("moe_intermediate_size", 1408), norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
               shared_expert_ffn_dim=hf.get("shared_expert_intermediate_size", 5632), shared_expert_gate=True,
               moe_layers=_moe_layers(hf, cfg["n_layers"]))
    return cfg


def qwen3_moe(hf):
    cfg = qwen3(hf)
    cfg.update(family="qwen3_moe", n_experts=_n_experts(hf, 128), experts_per_token=hf.get("num_experts_per_tok", 8),
               expert_ffn_dim=hf.get("moe_intermediate_size", 768), norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
               moe_layers=_moe_layers(hf, cfg["n_layers"]))
    return cfg


def olmoe(hf):
    if hf.get("clip_qkv") is not None:
        raise KvforgeError("olmoe clip_qkv (clamping q, k and v) is not supported")
    cfg = llama_like(hf, "olmoe", eps=1e-5)
    cfg.update(ffn_bias=False, qk_norm="proj", n_experts=_n_experts(hf, 64),
               experts_per_token=hf.get("num_experts_per_tok", 8), expert_ffn_dim=hf.get("intermediate_size", 1024),
               norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    return cfg


def _deepseek(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """DeepSeek-V2/V3: latent attention, a dense FFN on the first first_k_dense_replace layers, then routed experts
    beside always-on shared ones (n_shared_experts of them: one FFN of that multiple of moe_intermediate_size)."""
    v3 = family == "deepseek_v3"
    if not v3 and hf.get("mlp_bias"):
        raise KvforgeError("deepseek_v2 mlp_bias is not supported: transformers' experts have no biases while its "
                           "dense and shared FFNs would")
    heads = hf["num_attention_heads"]
    cfg = llama_like(hf, family, kv_heads_default=heads)
    n = cfg["n_layers"]
    rope_dim, nope = int(hf.get("qk_rope_head_dim", 64)), int(hf.get("qk_nope_head_dim", 128))
    method = "group_limited_greedy" if v3 else hf.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise KvforgeError(f"deepseek_v2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    groups = int(hf.get("n_group") or 1) if method == "group_limited_greedy" else 1
    cfg.update(
        n_kv_heads=heads, head_dim=rope_dim, kv_lora_rank=int(hf.get("kv_lora_rank", 512)),
        q_lora_rank=hf.get("q_lora_rank", 1536), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
        v_head_dim=int(hf.get("v_head_dim") or 128), ffn_bias=bool(hf.get("mlp_bias", False)),
        n_experts=_n_experts({"num_experts": hf.get("n_routed_experts")}, 256 if v3 else 64),
        experts_per_token=int(hf.get("num_experts_per_tok") or (8 if v3 else 6)),
        expert_ffn_dim=int(hf.get("moe_intermediate_size", 2048 if v3 else 1407)),
        router_scoring="sigmoid" if v3 else "softmax", router_correction_bias=v3,
        # transformers' V2 router never renormalizes its top-k, whatever norm_topk_prob says
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)) if v3 else False,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        router_groups=groups, router_topk_groups=int(hf.get("topk_group") or 1) if groups > 1 else 1,
        router_group_score="top2" if v3 else "max",
        shared_expert_ffn_dim=int(hf.get("moe_intermediate_size", 2048 if v3 else 1407))
        * int(hf.get("n_shared_experts") or 0),
        moe_layers=list(range(int(hf.get("first_k_dense_replace") or 0), n)),
    )
    params = rope_parameters(hf)
    mscale_all = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all:
        # YaRN's softmax scale: 1/sqrt(qk head dim) * mscale(factor, mscale_all_dim)^2
        cfg["attn_scale"] = (nope + rope_dim) ** -0.5 * yarn_mscale(float(params["factor"]), float(mscale_all)) ** 2
    return cfg


def deepseek_v2(hf):
    return _deepseek(hf, "deepseek_v2")


def deepseek_v3(hf):
    return _deepseek(hf, "deepseek_v3")


def granite(hf):
    cfg = llama_like(hf, "granite")
    cfg.update(
        embed_scale=float(hf.get("embedding_multiplier", 1.0)),
        residual_scale=float(hf.get("residual_multiplier", 1.0)),
        attn_scale=float(hf.get("attention_multiplier", 1.0)),  # replaces 1/sqrt(head_dim); its default is 1.0
        logit_scale=1.0 / float(hf.get("logits_scaling", 1.0)),  # transformers divides the logits by logits_scaling
    )
    return cfg


def cohere(hf):
    if hf.get("logit_scale", 0.0625) is None:
        raise KvforgeError("cohere config.json has logit_scale null, which transformers' Cohere cannot run (it multiplies by it)")
    cfg = llama_like(hf, "cohere", theta=500000.0, tie=True)
    cfg.update(
        norm="layernorm", norm_bias=False, norm_eps=hf.get("layer_norm_eps", 1e-5), block="parallel", ffn_bias=False,
        qk_norm="head" if hf.get("use_qk_norm") else None, logit_scale=float(hf.get("logit_scale", 0.0625)),
    )
    return cfg


def phi3(hf):
    # Phi-3 reads partial_rotary_factor, allows default and longrope (older configs say su or yarn for it), and
    # takes original_max_position_embeddings from the top level whatever rope_scaling says.
    params = rope_parameters(hf)
    if params["rope_type"] in ("su", "yarn"):
        params["rope_type"] = "longrope"
    if params["rope_type"] not in ("default", "longrope"):
        raise KvforgeError(f"phi3 rope type {params['rope_type']!r} is not one transformers' Phi-3 runs (default, longrope)")
    params["original_max_position_embeddings"] = hf.get("original_max_position_embeddings") or 4096  # the class default
    cfg = llama_like(hf, "phi3", eps=1e-5, attention_bias=False, rope=rope_fields(params, hf, partial_rotary=True))
    cfg["ffn_bias"] = False
    if hf.get("sliding_window"):
        cfg["sliding_window"] = int(hf["sliding_window"])
    return cfg


def _gemma_common(hf, family: str, act_key: str, rope: dict[str, Any] | None = None) -> dict[str, Any]:
    refuse(hf, "bidirectional attention makes an encoder (an embedding model), and kvforge exports causal decoders"
                + ("" if family == "gemma3_text" else "; transformers' Gemma runs it only on some of its paths"),
            "use_bidirectional_attention")
    cfg = llama_like(hf, family, head_dim=256, tie=True, act_key=act_key, act_default="gelu_pytorch_tanh", rope=rope)
    cfg.update(ffn_bias=False, embed_scale=float(torch.tensor(hf["hidden_size"] ** 0.5, dtype=torch.float32)))
    return cfg


def gemma(hf):
    cfg = _gemma_common(hf, "gemma", "hidden_act")
    if hf.get("hidden_act") == "gelu":  # transformers' Gemma rewrites it: Gemma's GELU is the tanh one
        cfg["activation"] = "gelu_tanh"
    return cfg


def gemma2(hf):
    cfg = _gemma_common(hf, "gemma2", "hidden_activation")
    n = cfg["n_layers"]
    layer_types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    cfg.update(
        norm_placement="sandwich",
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=hf.get("attn_logit_softcapping", 50.0),
        final_softcap=hf.get("final_logit_softcapping", 30.0),
        **windowed_layers(hf, n, hf.get("sliding_window", 4096), layer_types),
    )
    return cfg


def _gemma3_rope(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(full-attention, sliding-attention) rope parameters, as Gemma3TextConfig builds them: nested
    rope_parameters (or two default ones), a legacy rope_scaling merged into the full layers' only, and the
    bases a nested dict lacks from rope_theta (full, 1e6) and rope_local_base_freq (sliding, 1e4)."""
    nested = {k: dict(v) for k, v in (hf.get("rope_parameters") or {}).items() if isinstance(v, dict)}
    full = nested.get("full_attention") or {"rope_type": "default"}
    local = nested.get("sliding_attention") or {"rope_type": "default"}
    if hf.get("rope_scaling"):
        full.update(hf["rope_scaling"])
    full.setdefault("rope_theta", hf.get("rope_theta", 1000000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    for params in (full, local):
        params.setdefault("rope_type", params.get("type", "default"))
        # transformers' YaRN reads `truncate` from the top of rope_parameters, which for Gemma 3 holds the two
        # layer types' dicts: it always truncates
        params["truncate"] = (hf.get("rope_parameters") or {}).get("truncate", True)
    return full, local


def gemma3_text(hf):
    n = hf["num_hidden_layers"]
    pattern = hf.get("sliding_window_pattern", 6)  # transformers reads this key only (not _sliding_window_pattern)
    layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    full, local = _gemma3_rope(hf)
    cfg = _gemma_common(hf, "gemma3_text", "hidden_activation", rope=rope_fields(full, hf, partial_rotary=False))
    windows = windowed_layers(hf, n, hf.get("sliding_window", 4096), layer_types)
    if windows:
        local_rope = rope_fields(local, hf, partial_rotary=False)
        if local_rope.get("rope_scaling", {}).get("type") == "longrope":
            raise KvforgeError("gemma3 sliding-attention RoPE of type 'longrope' is not supported (linear, llama3, yarn are)")
        cfg.update(local_rope_theta=local_rope["rope_theta"], local_rope_scaling=local_rope.get("rope_scaling"))
    cfg.update(
        norm_placement="sandwich", qk_norm="head",
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=None,  # transformers' Gemma 3 never applies attn_logit_softcapping
        final_softcap=hf.get("final_logit_softcapping"),
        **windows,
    )
    return cfg


# --- weight tables --------------------------------------------------------------
def llama_weights(norms: dict[str, str] | None = None, norm_transform: Transform | None = None) -> Table:
    """model.layers.{i}.self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj; `norms` maps kvforge's block norms to
    the family's names (default: Llama's input_layernorm / post_attention_layernorm)."""
    norms = norms or {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    table: Table = {
        "embed.weight": ("model.embed_tokens.weight", None),
        "norm.weight": ("model.norm.weight", norm_transform),
        "lm_head.weight": ("lm_head.weight", None),
    }
    for ours, theirs in norms.items():
        table[f"layers.{{i}}.{ours}.weight"] = (f"model.layers.{{i}}.{theirs}.weight", norm_transform)
    for p in ("q", "k", "v", "o"):
        table.update(linear_weights(f"layers.{{i}}.attn.{p}_proj", f"model.layers.{{i}}.self_attn.{p}_proj"))
    for p in ("gate", "up", "down"):
        table.update(linear_weights(f"layers.{{i}}.ffn.{p}_proj", f"model.layers.{{i}}.mlp.{p}_proj"))
    return table


def moe_weights(layer: str, experts: str, names: tuple[str, str, str], router: str, shared: str | None = None,
                shared_gate: str | None = None) -> Table:
    """A MoE FFN's table: the router, each expert's gate/up/down (`names`, under {layer}.{experts}.{j}), the shared
    expert and its gate."""
    table: Table = {"layers.{i}.ffn.router.weight": (f"{layer}.{router}.weight", None)}
    for ours, theirs in zip(("gate_proj", "up_proj", "down_proj"), names):
        table[f"layers.{{i}}.ffn.experts.experts.{{j}}.{ours}.weight"] = (f"{layer}.{experts}.{{j}}.{theirs}.weight", None)
    if shared:
        for p in ("gate", "up", "down"):
            table.update(linear_weights(f"layers.{{i}}.ffn.shared.{p}_proj", f"{layer}.{shared}.{p}_proj"))
    if shared_gate:
        table["layers.{i}.ffn.shared_gate.weight"] = (f"{layer}.{shared_gate}.weight", None)
    return table


def mixtral_weights(hf, cfg) -> Table:
    return {**llama_weights(), **moe_weights("model.layers.{i}.block_sparse_moe", "experts", ("w1", "w3", "w2"), "gate")}


def qwen_moe_weights(shared: bool) -> Callable[[dict[str, Any], Any], Table]:
    def table(hf, cfg) -> Table:
        out = {**llama_weights(), **moe_weights("model.layers.{i}.mlp", "experts", ("gate_proj", "up_proj", "down_proj"),
                                                "gate", "shared_expert" if shared else None,
                                                "shared_expert_gate" if shared else None)}
        if not shared:  # Qwen3-MoE: per-head q/k norms
            out.update(_qk_norms("weight", repeat_heads(query_heads), repeat_heads(kv_heads)))
        return out
    return table


def olmoe_weights(hf, cfg) -> Table:
    return {**llama_weights(), **_qk_norms("weight", None, None),
            **moe_weights("model.layers.{i}.mlp", "experts", ("gate_proj", "up_proj", "down_proj"), "gate")}


def mla_half_split(which: str) -> Transform:
    """DeepSeek rotates interleaved pairs of the RoPE dims (V2 always, V3 with rope_interleave): reorder them to
    kvforge's halves, in each head's query rows (`q`: [nope | rope] per head) or the shared key's (`kv_a`: the
    last qk_rope_head_dim rows of kv_a_proj_with_mqa, after the latent's)."""

    def f(t, cfg):
        dr, dn = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
        perm = torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])
        if which == "kv_a":
            r = cfg.kv_lora_rank
            return torch.cat([t[:r], t[r:][perm]])
        x = t.reshape(cfg.n_heads, dn + dr, *t.shape[1:])
        return torch.cat([x[:, :dn], x[:, dn:][:, perm]], dim=1).reshape(t.shape)
    return f


def deepseek_weights(hf, cfg) -> Table:
    interleaved = hf.get("model_type") == "deepseek_v2" or hf.get("rope_interleave", True)
    q_rows = mla_half_split("q") if interleaved else None
    attn = "model.layers.{i}.self_attn"
    table = {k: v for k, v in llama_weights().items() if ".attn." not in k}
    table.update(linear_weights("layers.{i}.attn.q_proj", f"{attn}.q_proj", q_rows))
    table.update(linear_weights("layers.{i}.attn.q_a_proj", f"{attn}.q_a_proj"))
    table["layers.{i}.attn.q_a_norm.weight"] = (f"{attn}.q_a_layernorm.weight", None)
    table.update(linear_weights("layers.{i}.attn.q_b_proj", f"{attn}.q_b_proj", q_rows))
    table.update(linear_weights("layers.{i}.attn.kv_a_proj", f"{attn}.kv_a_proj_with_mqa",
                         mla_half_split("kv_a") if interleaved else None))
    table["layers.{i}.attn.kv_a_norm.weight"] = (f"{attn}.kv_a_layernorm.weight", None)
    table.update(linear_weights("layers.{i}.attn.kv_b_proj", f"{attn}.kv_b_proj"))
    table.update(linear_weights("layers.{i}.attn.o_proj", f"{attn}.o_proj"))
    table.update(moe_weights("model.layers.{i}.mlp", "experts", ("gate_proj", "up_proj", "down_proj"), "gate",
                             "shared_experts"))
    table["layers.{i}.ffn.router.bias"] = ("model.layers.{i}.mlp.gate.e_score_correction_bias", None)
    return table


def _qk_norms(theirs: str, q: Transform | None, k: Transform | None) -> Table:
    return {
        "layers.{i}.attn.q_norm.weight": (f"model.layers.{{i}}.self_attn.q_norm.{theirs}", q),
        "layers.{i}.attn.k_norm.weight": (f"model.layers.{{i}}.self_attn.k_norm.{theirs}", k),
    }


_SANDWICH = {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "ffn_out_norm": "post_feedforward_layernorm"}


def qwen3_weights(hf, cfg) -> Table:
    return {**llama_weights(), **_qk_norms("weight", repeat_heads(query_heads), repeat_heads(kv_heads))}


def olmo2_weights(hf, cfg) -> Table:
    return {**llama_weights({"attn_out_norm": "post_attention_layernorm", "ffn_out_norm": "post_feedforward_layernorm"}),
            **_qk_norms("weight", None, None)}


def gemma_weights(hf, cfg) -> Table:
    return llama_weights(norm_transform=plus_one)


def gemma2_weights(hf, cfg) -> Table:
    return llama_weights(_SANDWICH, norm_transform=plus_one)


def gemma3_weights(hf, cfg) -> Table:
    return {**llama_weights(_SANDWICH, norm_transform=plus_one),
            **_qk_norms("weight", chain(plus_one, repeat_heads(query_heads)), chain(plus_one, repeat_heads(kv_heads)))}


def cohere_weights(hf, cfg) -> Table:
    table = llama_weights({"attn_norm": "input_layernorm"})
    for p, heads in (("q", query_heads), ("k", kv_heads)):
        table.update(linear_weights(f"layers.{{i}}.attn.{p}_proj", f"model.layers.{{i}}.self_attn.{p}_proj", half_split(heads)))
    # per-head LayerNorm weights (heads, head_dim), permuted like the features they scale
    table.update(_qk_norms("weight", chain(flatten, half_split(query_heads)), chain(flatten, half_split(kv_heads))))
    return table


def phi3_weights(hf, cfg) -> Table:
    table = llama_weights()
    qkv = lambda c: [c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.n_kv_heads * c.head_dim]  # noqa: E731
    for j, p in enumerate("qkv"):
        table[f"layers.{{i}}.attn.{p}_proj.weight"] = ("model.layers.{i}.self_attn.qkv_proj.weight", rows(qkv, j))
    gate_up = lambda c: [c.ffn_dim, c.ffn_dim]  # noqa: E731
    for j, p in enumerate(("gate", "up")):
        table[f"layers.{{i}}.ffn.{p}_proj.weight"] = ("model.layers.{i}.mlp.gate_up_proj.weight", rows(gate_up, j))
    return table
