"""ONNX Runtime's MoE kernel for the mixture-of-experts layers of the ORT variant.

The bundle's graph routes each token with standard ops (TopK, then per expert NonZero / GatherND / its gated
FFN / ScatterND: model_defs/moe.py), which TensorRT parses and which computes only the chosen experts. On
ONNX Runtime's CPU provider those per-expert ops cost a kernel launch each, a good part of a decode step at
batch 1. The variant replaces each MoE layer's routed experts by one com.microsoft MoE node where it computes
the same function:

    MoE(x, router_logits, fc1 (N, 2F, C) = each expert's gate and up rows interleaved, fc2 (N, C, F) = its down
        projection), k = experts_per_token, activation "swiglu" (SiLU(gate) * up: alpha 1, beta 0, no clamp),
        normalize_routing_weights = norm_topk_prob

which is softmax routing, top-k, optionally renormalized, unscaled: routers with sigmoid scores, a correction
bias, group-limited choice or a scaling factor (DeepSeek) keep the graph's form, as do quantized experts
(their Q/DQ weights stay what the bundle says) and any graph that does not match exactly. The router's
MatMul stays (its logits feed the kernel), and the shared expert is untouched.
"""

from __future__ import annotations

import re

import numpy as np

from .ort_fusions import MS_DOMAIN, _use_ms_domain, drop_dead_nodes


def eligible(config: dict) -> bool:
    """Whether the model's routing is the function ORT's MoE kernel computes."""
    groups = config.get("router_groups", 1)
    return (bool(config.get("n_experts")) and config.get("router_scoring", "softmax") == "softmax"
            and not config.get("router_correction_bias") and config.get("routed_scaling_factor", 1.0) == 1.0
            and (groups == 1 or config.get("router_topk_groups", 1) >= groups)
            and config.get("activation") == "silu" and config.get("gated_ffn", True) and not config.get("ffn_bias"))


def use_moe_kernel(model, config: dict) -> int:
    """Replace each float MoE layer's routed experts by one MoE node; returns how many layers were replaced."""
    from onnx import helper, numpy_helper

    from kvforge.calibration.qdq import layer_name

    if not eligible(config):
        return 0
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    names = [layer_name(n) for n in g.node]
    consumers: dict[str, list[int]] = {}
    for k, node in enumerate(g.node):
        for x in node.input:
            consumers.setdefault(x, []).append(k)
    graph_outputs = {o.name for o in g.output}
    n_experts = config["n_experts"]
    prefixes = sorted({m.group(1) for nm in names if (m := re.match(r"(layers\.\d+\.ffn)\.experts\b", nm))})
    added: list[tuple[int, object, str, str]] = []  # (position, node, old output, new output)
    new_inits = []
    for prefix in prefixes:
        router = [n for n, nm in zip(g.node, names) if nm == f"{prefix}.router" and n.op_type in ("MatMul", "Gemm")]
        weights: dict[tuple[int, str], np.ndarray] = {}
        for n, nm in zip(g.node, names):
            m = re.fullmatch(rf"{re.escape(prefix)}\.experts\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)", nm)
            if m and n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]].dims) == 2:
                weights[(int(m.group(1)), m.group(2))] = numpy_helper.to_array(inits[n.input[1]])
        if len(router) != 1 or len(weights) != 3 * n_experts:
            continue
        scope = [k for k, nm in enumerate(names) if nm == f"{prefix}.experts" or nm.startswith(f"{prefix}.experts.")]
        inside = set(scope)
        leaving = {o for k in scope for o in g.node[k].output
                   if o in graph_outputs or any(c not in inside for c in consumers.get(o, []))}
        if len(leaving) != 1 or leaving & graph_outputs:
            continue
        (old,) = leaving
        gate = np.stack([weights[(e, "gate_proj")].T for e in range(n_experts)])  # (N, F, C)
        up = np.stack([weights[(e, "up_proj")].T for e in range(n_experts)])
        fc1 = np.stack([gate, up], axis=2).reshape(n_experts, -1, gate.shape[-1])  # rows gate_0, up_0, gate_1, ...
        fc2 = np.stack([weights[(e, "down_proj")].T for e in range(n_experts)])  # (N, C, F)
        if fc1.dtype != np.float32:
            continue
        tag = prefix.replace(".", "_")
        new_inits += [numpy_helper.from_array(np.ascontiguousarray(fc1), f"{tag}_moe_fc1"),
                      numpy_helper.from_array(np.ascontiguousarray(fc2), f"{tag}_moe_fc2")]
        node = helper.make_node(
            "MoE", [router[0].input[0], router[0].output[0], f"{tag}_moe_fc1", "", f"{tag}_moe_fc2", ""],
            [f"{tag}_moe_out"], name=f"{tag}_moe", domain=MS_DOMAIN, k=int(config["experts_per_token"]),
            activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
            swiglu_limit=float(np.finfo(np.float32).max), normalize_routing_weights=int(bool(config.get("norm_topk_prob", True))))
        added.append((max(scope), node, old, f"{tag}_moe_out"))
    if not added:
        return 0
    for position, node, old, new in sorted(added, key=lambda a: a[0], reverse=True):
        for n in g.node:  # the layer's consumers now read the kernel's output
            n.input[:] = [new if x == old else x for x in n.input]
        g.node.insert(position + 1, node)
    g.initializer.extend(new_inits)
    _use_ms_domain(model)
    drop_dead_nodes(model)
    return len(added)
