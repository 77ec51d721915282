"""Trace each distinct layer once and replicate it in the ONNX graph: export time that does not grow with depth.

torch.onnx's dynamo export costs ~3.8 s per decoder layer on one core whatever the layer's size
(benchmarks/kernels/export_trace_layers.py): a 30-layer model spends two minutes tracing thirty copies of one block.
Layers of one *design* (the same modules, attributes and buffers: the same window, the same dense or mixture
FFN) compute the same graph on different weights, so the exporter traces only the shortest prefix of layers that
holds every design, and each later layer is a copy of its design's traced layer whose weights, cache inputs and
outputs are renamed to its own:

    trace layers 0..K-1 (hidden states between them marked as extra outputs), unoptimized: initializers are
    the parameters, named as in the model
    per traced layer r: its nodes = those that depend on its input hidden state, its cache or its weights, and
    that its output hidden state or its present needs (what only the shared inputs feed, the masks and RoPE
    tables, stays shared)
    per later layer i: the nodes of its design's layer r copied, reading layer i-1's hidden state, layer i's
    cache inputs, weights (the model's own tensors) and LoRA inputs, writing present.{i}.*
    then the optimizer over the whole graph, as torch.onnx runs it after a full trace

A layer that reads another layer's values besides the hidden state (shared KV, cross-layer residuals) or whose
nodes hold subgraphs is not replicated: `replicate` raises NotReplicable and the export traces every layer.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from .lazy_weights import ir_tensor, optimize
from .traces import module_tensors

HIDDEN = "kvforge.hidden"  # the traced prefix's extra outputs: the hidden state entering each layer, then the last's


class NotReplicable(Exception):
    """The traced layers cannot be copied for the others; the caller traces every layer."""


def _plain(value, index: int):
    """A module attribute as part of its layer's design: plain values as they are (a string naming the layer's
    own modules with the layer's index replaced), callables by name, other objects by identity."""
    if isinstance(value, str):
        return re.sub(rf"(^|\.)layers\.{index}(?=\.|$)", r"\1layers.#", value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v, index) for v in value)
    if isinstance(value, torch.dtype):
        return str(value)
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return ("object", id(value))


def layer_design(block: nn.Module, index: int) -> tuple:
    """What decides the graph a block traces to: its modules' classes, their attributes, parameter shapes and
    dtypes, and buffer values. Two layers with equal designs trace to the same graph on different weights."""
    parts = []
    for name, module in block.named_modules():
        attrs = tuple(sorted((k, _plain(v, index)) for k, v in vars(module).items()
                             if not k.startswith("_") and k != "training"))
        params = tuple((k, tuple(p.shape), str(p.dtype)) for k, p in module._parameters.items() if p is not None)
        buffers = tuple((k, tuple(b.shape), str(b.dtype), hash(b.detach().cpu().numpy().tobytes()))
                        for k, b in module._buffers.items() if b is not None)
        parts.append((name, type(module).__qualname__, attrs, params, buffers))
    return tuple(parts)


def traced_prefix(layers: Iterable[nn.Module]) -> tuple[int, list[int]]:
    """(K, rep): trace layers 0..K-1, the shortest prefix holding every design; layer i is a copy of rep[i]
    (the last traced layer of its design; rep[i] = i for i < K)."""
    designs = [layer_design(block, i) for i, block in enumerate(layers)]
    first: dict[tuple, int] = {}
    for i, d in enumerate(designs):
        first.setdefault(d, i)
    k = max(first.values()) + 1
    last = {d: i for i, d in enumerate(designs[:k])}
    return k, [i if i < k else last[d] for i, d in enumerate(designs)]


def relayer(name: str, r: int, i: int) -> str:
    """`name` of layer r's weight, cache tensor or LoRA input, as layer i's."""
    name = re.sub(rf"(^|\.)layers\.{r}\.", rf"\1layers.{i}.", name)
    return re.sub(rf"^(past_key_values|present)\.{r}\.", rf"\1.{i}.", name)


def layer_of(name: str) -> int | None:
    """The layer whose weight, cache tensor, LoRA slot or input `name` is ("layers.3.attn.q_proj" -> 3), or None."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name) or re.match(r"(?:past_key_values|present)\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _through_identity(value):
    """The value an output Identity copies (the exporter's way to give one value two output names), else itself."""
    while value.producer() is not None and value.producer().op_type == "Identity":
        value = value.producer().inputs[0]
    return value


def _forward(seeds: set) -> set:
    """The nodes that depend on `seeds` (a layer's hidden state, cache inputs and weights). The shape of a cache
    input or weight is not the layer's own: the exporter reads the batch size from whichever input it chose, and
    layers of one design have the same cache and weight shapes."""
    nodes, stack = set(), list(seeds)
    while stack:
        value = stack.pop()
        for use in value.uses():
            if use.node.op_type == "Shape" and value.producer() is None:
                continue
            if use.node not in nodes:
                nodes.add(use.node)
                stack.extend(use.node.outputs)
    return nodes


def _backward(values) -> set:
    nodes, stack = set(), [v.producer() for v in values if v.producer() is not None]
    while stack:
        node = stack.pop()
        if node in nodes:
            continue
        nodes.add(node)
        stack.extend(v.producer() for v in node.inputs if v is not None and v.producer() is not None)
    return nodes


def _own_shape(shape, i: int):
    """A copied value's shape: a data-dependent size (the exporter's u0, u1, ...: a mixture's tokens per expert)
    is the layer's own, so it is renamed; sizes of the inputs (s0, s1, ...) are shared."""
    import onnx_ir as ir

    if shape is None:
        return None
    return ir.Shape([d if isinstance(d, int) or d.value is None
                     else ir.SymbolicDim(re.sub(r"\b(u\d+)\b", rf"\1_l{i}", d.value)) for d in shape])


def replicate(ir_model, k: int, rep: list[int], tensors: dict[str, torch.Tensor], output_order: list[str],
              input_order: list[str]) -> None:
    """Make the graph of a traced prefix of k layers (with the HIDDEN outputs) the whole model's, in place.

    rep: each layer's traced layer (traced_prefix); tensors: every parameter and buffer by its initializer name
    (the model's names under the traced wrapper's prefix); output_order, input_order: the whole graph's names.
    """
    import onnx_ir as ir

    graph = ir_model.graph
    # The outputs by position: the contract's for the traced layers, then the k + 1 hidden states (a value that is
    # two outputs, an encoder's last hidden state, carries only one of the names).
    prefix_names = [n for n in output_order if layer_of(n) is None or layer_of(n) < k]
    if len(graph.outputs) != len(prefix_names) + k + 1:
        raise NotReplicable("the traced graph lacks the layers' hidden states")
    outputs = dict(zip(prefix_names, list(graph.outputs)[:len(prefix_names)]))
    hidden = [_through_identity(v) for v in list(graph.outputs)[len(prefix_names):]]
    for j, h in enumerate(hidden):
        if h.name.startswith(HIDDEN):  # before the copies take their names from it
            h.name = f"hidden_states.{j}"
    inputs = {v.name: v for v in graph.inputs}
    inits = dict(graph.initializers)

    def own(j: int) -> list:
        return [v for v in list(inputs.values()) + list(inits.values()) if layer_of(v.name) == j]

    members, layer_outputs = [], []
    for r in range(k):
        outs = [hidden[r + 1]] + [v for name, v in outputs.items() if name.startswith(f"present.{r}.")]
        nodes = _forward({hidden[r], *own(r)}) & _backward(outs)
        members.append(nodes)
        layer_outputs.append(outs)
    for r, nodes in enumerate(members):
        for node in nodes:
            if any(isinstance(a.value, ir.Graph) or isinstance(a.value, list) and a.value and isinstance(a.value[0], ir.Graph)
                   for a in node.attributes.values()):
                raise NotReplicable(f"layer {r} holds a node with a subgraph ({node.op_type})")
            for v in node.inputs:
                producer = v.producer() if v is not None else None
                if producer is not None and producer not in nodes and v is not hidden[r] and any(
                        producer in other for s, other in enumerate(members) if s != r):
                    raise NotReplicable(f"layer {r} reads another layer's value {v.name!r}")
            for v in node.outputs:
                for use in v.uses():
                    if use.node not in nodes and v not in layer_outputs[r] and not (v is hidden[r + 1]):
                        raise NotReplicable(f"layer {r}'s value {v.name!r} is read outside it")
    head_uses = [(u.node, u.idx) for u in hidden[k].uses() if not any(u.node in m for m in members)]

    order = {node: n for n, node in enumerate(graph)}
    last = hidden[k]
    new_outputs = []
    for i in range(k, len(rep)):
        r = rep[i]
        mapping = {hidden[r]: last}
        for v in own(r):
            name = relayer(v.name, r, i)
            if v.name in inits and v.name not in tensors:
                continue  # a constant the layer's code made, not a weight: the same for every layer of its design
            if v.name in inits:
                if name not in tensors:
                    raise NotReplicable(f"layer {i} has no tensor {name!r} for layer {r}'s {v.name!r}")
                tensor = tensors[name]
                if tuple(tensor.shape) != tuple(v.shape):
                    raise NotReplicable(f"{name!r} is {tuple(tensor.shape)}, layer {r}'s is {tuple(v.shape)}")
                copy = ir.Value(name=name, shape=ir.Shape(v.shape), type=v.type,
                                const_value=ir_tensor(tensor, name))
                graph.register_initializer(copy)
            else:
                copy = ir.Value(name=name, shape=v.shape, type=v.type)
                graph.inputs.append(copy)
            mapping[v] = copy
        for node in sorted(members[r], key=order.__getitem__):
            clone = ir.Node(node.domain, node.op_type, [mapping.get(v, v) if v is not None else None for v in node.inputs],
                            attributes=list(node.attributes.values()), overload=node.overload,
                            num_outputs=len(node.outputs), version=node.version,
                            name=relayer(node.name or "", r, i) + f"_l{i}",
                            metadata_props={key: re.sub(rf"layers\.{r}(?=[.'\"])", f"layers.{i}", text)
                                            for key, text in node.metadata_props.items()})
            for old, new in zip(node.outputs, clone.outputs):
                new.name = relayer(old.name, r, i) if old.name.startswith("present.") else f"{old.name}_l{i}"
                new.shape, new.type = _own_shape(old.shape, i), old.type
                mapping[old] = new
            graph.append(clone)
        new_outputs += [mapping[v] for v in layer_outputs[r][1:]]
        last = mapping[hidden[r + 1]]
    for node, idx in head_uses:
        node.replace_input_with(idx, last)
    by_name = {name: last if _through_identity(v) is hidden[k] else v for name, v in outputs.items()}
    by_name.update({v.name: v for v in new_outputs})
    graph.outputs.clear()
    for name in output_order:
        value = by_name[name]
        if value in graph.outputs:  # one value, two outputs: the second through an Identity
            node = ir.Node("", "Identity", [value], num_outputs=1)
            graph.append(node)
            value = node.outputs[0]
            value.shape, value.type = by_name[name].shape, by_name[name].type
        value.name = name
        graph.outputs.append(value)
    by_name = {v.name: v for v in graph.inputs}
    if set(by_name) != set(input_order):
        raise NotReplicable(f"the replicated graph's inputs {sorted(set(by_name) ^ set(input_order))} differ from the contract's")
    graph.inputs.clear()
    graph.inputs.extend(by_name[name] for name in input_order)
    graph.sort()


def prefix(model: nn.Module, n_layers: int) -> nn.Module:
    """A shallow copy of `model` (its blocks in `model.layers`) that runs its first n layers, sharing their
    modules and weights: what a traced prefix traces."""
    short = copy.copy(model)
    short._modules = dict(model._modules)
    short.layers = nn.ModuleList(list(model.layers)[:n_layers])
    return short


@contextlib.contextmanager
def hidden_states(layers: nn.ModuleList) -> Iterator[list]:
    """While it is open, the hidden state entering each of `layers` and the last one's output (a block returns
    (hidden, present)) are appended to the list it gives: a traced prefix returns them as the HIDDEN outputs."""
    hidden: list = []
    hooks = [layer.register_forward_pre_hook(lambda module, args: hidden.append(args[0])) for layer in layers]
    hooks.append(layers[-1].register_forward_hook(lambda module, args, out: hidden.append(out[0])))
    try:
        yield hidden
    finally:
        for hook in hooks:
            hook.remove()


def hidden_names(n_layers: int) -> list[str]:
    return [f"{HIDDEN}.{j}" for j in range(n_layers + 1)]


def traced_program(model: nn.Module, trace_prefix: Callable[[int], object], trace_whole: Callable[[], object],
                   input_order: list[str], output_order: list[str], every_layer: bool = False):
    """The torch.onnx program of `model` (blocks in `model.layers`, weights under the wrapper's "model." prefix):
    its traced prefix, replicated and optimized, or (every_layer, one design per layer, or NotReplicable: with a
    warning) the whole model traced. trace_prefix(k): the unoptimized trace of the first k layers with the
    HIDDEN outputs after the contract's; trace_whole(): the optimized trace of all of them."""
    if every_layer or not len(model.layers):
        return trace_whole()
    k, rep = traced_prefix(model.layers)
    if k < len(model.layers):
        program = trace_prefix(k)
        tensors = {f"model.{name}": t for name, t in module_tensors(model).items()}
        try:
            replicate(program.model, k, rep, tensors, output_order, input_order)
        except NotReplicable as e:
            logging.getLogger("kvforge.export").warning("tracing all %d layers: %s", len(model.layers), e)
        else:
            optimize(program)
            return program
    return trace_whole()
