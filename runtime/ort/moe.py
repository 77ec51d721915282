"""Skip the experts no token chose, in the ONNX Runtime variant of a mixture of experts.

The bundle's graph runs every expert's dispatch (model_defs/moe.py: the NonZero of its routing mask, gathers,
its gated FFN on the rows routed to it, a scatter into the layer's output), whatever the routing: an expert
no token chose runs ~25 kernels on empty tensors. At batch 1 a decode step routes one token to k of N
experts, so N - k experts per layer cost kernel launches and nothing else. The variant wraps each expert's
dispatch in an `If` on "some token chose this expert", whose else branch passes the layer's running output
through: the same function, and an unchosen expert costs one `If`. The bundle's graph (what TensorRT builds)
is untouched. An expert whose dispatch does not form a self-contained region of the graph is left as it is.
"""

from __future__ import annotations

import numpy as np

from kvforge.onnx_graph import layer_name, router_choices


def skip_unchosen_experts(model, elem_type: int = 1) -> int:
    """Wrap each expert's dispatch in an If on whether any token chose it; returns how many were wrapped.
    elem_type: the ONNX element type of the layer's activations (1 float32, 10 float16, 16 bfloat16)."""
    g = model.graph
    choices = router_choices(model)  # moe prefix -> (tokens, k) expert indices
    if not choices:
        return 0
    deps = _Dependencies(g)
    replacements: dict[int, tuple[list, object]] = {}  # the region's last position -> (nodes before it, the If)
    removed: set[int] = set()
    for prefix, index in choices.items():
        scatters = [k for k, n in enumerate(g.node) if n.op_type == "ScatterND" and deps.names[k] == f"{prefix}.experts"]
        router_out = [k for k, nm in enumerate(deps.names) if nm == f"{prefix}.router"]
        if not scatters or not router_out:
            continue
        # what every expert reads from the layer: its input, the router's choice and weights (its last node's
        # output), and everything before them
        x = next(g.node[k].input[0] for k in router_out if g.node[k].op_type in ("Gemm", "MatMul"))
        shared = deps.ancestors([x, index, *g.node[max(router_out)].output], set())
        tag = prefix.replace(".", "_")
        setup = _chosen_flags(g, tag, index, len(scatters))
        for e, k_scatter in enumerate(scatters):
            region = _expert_region(g, deps, k_scatter, shared)
            if region is None or region & removed:
                continue
            pre, node = _expert_if(g, tag, e, [g.node[k] for k in sorted(region)], g.node[k_scatter], elem_type)
            replacements[max(region)] = (setup + pre, node)
            setup = []  # the layer's flags are computed once, before its first wrapped expert
            removed |= region
    if not replacements:
        return 0
    kept = []
    for k, n in enumerate(g.node):
        if k in replacements:
            pre, node = replacements[k]
            kept += pre + [node]
        elif k not in removed:
            kept.append(n)
    del g.node[:]
    g.node.extend(kept)
    return len(replacements)


class _Dependencies:
    """Who produces and who reads each value of a graph (by node position), and every node's layer name."""

    def __init__(self, g):
        self.g = g
        self.producer = {o: k for k, n in enumerate(g.node) for o in n.output}
        self.consumers: dict[str, set[int]] = {}
        for k, n in enumerate(g.node):
            for x in n.input:
                self.consumers.setdefault(x, set()).add(k)
        self.graph_outputs = {o.name for o in g.output}
        self.names = [layer_name(n) for n in g.node]

    def ancestors(self, values, stop: set[int]) -> set[int]:
        """The positions of the nodes these values depend on, not walking past `stop`."""
        producer = self.producer
        seen, todo = set(), [producer[v] for v in values if v in producer]
        while todo:
            k = todo.pop()
            if k in seen or k in stop:
                continue
            seen.add(k)
            todo += [producer[x] for x in self.g.node[k].input if x in producer]
        return seen


def _expert_region(g, deps: _Dependencies, k_scatter: int, shared: set[int]) -> set[int] | None:
    """The nodes of one expert's dispatch, ending at its ScatterND; None where they are not self-contained."""
    running = g.node[k_scatter].input[0]  # the layer output so far (zeros before the first expert)
    stop = shared | deps.ancestors([running], set()) | ({deps.producer[running]} if running in deps.producer else set())
    region = deps.ancestors(g.node[k_scatter].output, stop)
    out = g.node[k_scatter].output[0]
    # a node that reads only what lies outside the region (the router's weights unsqueezed once, shared
    # by every expert) stays in the main graph
    inner = {o for k in region for o in g.node[k].output}
    region -= {k for k in region if k != k_scatter and not inner & set(g.node[k].input)}
    # self-contained: nothing outside the region reads what it computes, except its output
    leaks = [o for k in region for o in g.node[k].output if o != out and
             (o in deps.graph_outputs or deps.consumers.get(o, set()) - region)]
    return None if k_scatter not in region or leaks else region


def _chosen_flags(g, tag: str, index: str, n_experts: int) -> list:
    """Nodes computing `{tag}_chosen`, (N,) float: 1 where some token chose the expert (their constants added)."""
    from onnx import helper, numpy_helper

    g.initializer.extend([
        numpy_helper.from_array(np.array([-1], np.int64), f"{tag}_last_axis"),
        numpy_helper.from_array(np.arange(n_experts, dtype=np.int64), f"{tag}_experts"),
        numpy_helper.from_array(np.array([0, 1], np.int64), f"{tag}_token_axes"),
    ])
    return [
        helper.make_node("Unsqueeze", [index, f"{tag}_last_axis"], [f"{tag}_idx3"]),
        helper.make_node("Equal", [f"{tag}_idx3", f"{tag}_experts"], [f"{tag}_onehot"]),
        helper.make_node("Cast", [f"{tag}_onehot"], [f"{tag}_onehot_f"], to=1),
        helper.make_node("ReduceMax", [f"{tag}_onehot_f", f"{tag}_token_axes"], [f"{tag}_chosen"], keepdims=0),
    ]


def _expert_if(g, tag: str, e: int, region_nodes: list, scatter, elem_type: int) -> tuple[list, object]:
    """(the nodes reading expert e's flag, the If that runs its region when chosen and else passes the layer's
    running output through)."""
    from onnx import helper, numpy_helper

    out, running = scatter.output[0], scatter.input[0]
    body = []
    for n in region_nodes:
        c = type(n)()
        c.CopyFrom(n)
        c.output[:] = [f"{o}_then" if o == out else o for o in c.output]
        body.append(c)
    then_g = helper.make_graph(body, f"{tag}_expert{e}_then", [],
                               [helper.make_tensor_value_info(f"{out}_then", elem_type, None)])
    else_g = helper.make_graph([helper.make_node("Identity", [running], [f"{out}_else"])],
                               f"{tag}_expert{e}_else", [], [helper.make_tensor_value_info(f"{out}_else", elem_type, None)])
    cond = f"{tag}_chosen_{e}"
    g.initializer.append(numpy_helper.from_array(np.array(e, np.int64), f"{tag}_e{e}"))
    pre = [helper.make_node("Gather", [f"{tag}_chosen", f"{tag}_e{e}"], [f"{cond}_f"], axis=0),
           helper.make_node("Cast", [f"{cond}_f"], [cond], to=9)]
    return pre, helper.make_node("If", [cond], [out], then_branch=then_g, else_branch=else_g,
                                 name=f"{tag}_expert{e}_if")
