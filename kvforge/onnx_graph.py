"""Reading ONNX graphs: element type names, every value's type, constants, the module a node came from and a
mixture's routing. Shared by export's lint and engine plan, calibration's Q/DQ rewrite and experts, and the
runtime's ONNX Runtime rewrites (docs/design.md, Layers).

`onnx` is imported where it is used: the core is imported by users of the ONNX Runtime path alone.
"""

from __future__ import annotations

import ast
import collections
from typing import Any

import numpy as np

MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib operators

# TensorProto element types by their names in TensorRT's tables (FP8 covers every 8-bit float).
TYPE_NAMES = {
    1: "FP32", 10: "FP16", 16: "BF16", 6: "INT32", 7: "INT64", 9: "BOOL", 3: "INT8", 2: "UINT8",
    17: "FP8", 18: "FP8", 19: "FP8", 20: "FP8", 22: "INT4", 21: "UINT4", 23: "FP4", 11: "DOUBLE",
    5: "INT16", 4: "UINT16", 12: "UINT32", 13: "UINT64", 8: "STRING",
}


def layer_name(node) -> str:
    """The module a node came from, from the exporter's name scopes ("layers.0.attn.q_proj"); else its name."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                break
            if len(scopes) >= 2:
                return scopes[-2].removeprefix("model.")
    return node.name


def router_choices(model) -> dict[str, str]:
    """Each MoE layer's routing decision: moe prefix ("layers.1.ffn") -> the (tokens, k) expert indices tensor
    (the last TopK under its router: a group-limited router picks groups first). Calibration's experts and the
    runtime's ONNX Runtime variant (runtime/ort/moe.py) read it."""
    out = {}
    for node in model.graph.node:
        name = layer_name(node)
        if node.op_type == "TopK" and name.endswith(".router"):
            out[name[: -len(".router")]] = node.output[1]
    return out


def value_types(model) -> dict[str, int]:
    """Every value's element type: inferred where shape inference can, else as declared; initializers and Constants."""
    import onnx

    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # inference is best-effort here: fall back to declared types
        inferred = model
    g = inferred.graph
    types = {}
    for v in list(g.value_info) + list(g.input) + list(g.output):
        types[v.name] = v.type.tensor_type.elem_type
    for init in g.initializer:
        types[init.name] = init.data_type
    for node in g.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    types[node.output[0]] = a.t.data_type
    return types


def constant(graph, name: str) -> Any:
    """The value of an initializer or Constant output as an array; None when it is computed (or stored outside)."""
    from onnx import numpy_helper

    for init in graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init) if not init.external_data else None
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
    return None


class GraphIndex:
    """Producer/consumer maps and constant lookup over an ONNX graph."""

    def __init__(self, graph):
        from onnx import numpy_helper

        self.producer = {o: n for n in graph.node for o in n.output}
        self.consumers = collections.defaultdict(list)
        for n in graph.node:
            for i in n.input:
                self.consumers[i].append(n)
        self.outputs = {o.name for o in graph.output}
        self._inits = {i.name: i for i in graph.initializer}
        self._to_array = numpy_helper.to_array
        self._shapes = {v.name: v.type.tensor_type for v in (*graph.input, *graph.value_info)}

    def dims(self, name: str) -> list | None:
        """The shape recorded for `name` (ints and symbols), or None where the graph records none."""
        t = self._shapes.get(name)
        if t is None or not t.HasField("shape"):
            return None
        return [d.dim_param or d.dim_value for d in t.shape.dim]

    def axes(self, node) -> np.ndarray | None:
        """A Reduce/Unsqueeze node's axes: its second input (opset >= 13/18) or its `axes` attribute."""
        return self.const(node.input[1]) if len(node.input) > 1 else np.array(node_attribute(node, "axes", []))

    def const(self, name: str) -> np.ndarray | None:
        if name in self._inits:
            return self._to_array(self._inits[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            return self._to_array(node.attribute[0].t)
        return None

    def only_consumer(self, name: str, op_type: str):
        """The single consumer of `name` if it has op_type and `name` is not a graph output."""
        users = self.consumers.get(name, [])
        if len(users) == 1 and users[0].op_type == op_type and name not in self.outputs:
            return users[0]
        return None

    def other_input(self, node, name: str) -> str | None:
        ins = list(node.input)
        if len(ins) != 2 or name not in ins:
            return None
        return ins[1] if ins[0] == name else ins[0]


def node_attribute(node, name, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def scalar_value(value: np.ndarray | None) -> float | None:
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def block_dequantized(codes: np.ndarray, scale: np.ndarray, block: int, axis: int = 0,
                      zero_point: np.ndarray | None = None) -> np.ndarray:
    """DequantizeLinear's block-wise result in float32, (codes - zero_point) * scale, each scale and zero point
    spread over its `block` elements along `axis` (the last block cut to the codes' length)."""
    def spread(a):
        return np.repeat(np.asarray(a, np.float32), block, axis=axis)[tuple(slice(0, d) for d in codes.shape)]

    q = codes.astype(np.float32)
    return ((q - spread(zero_point)) if zero_point is not None else q) * spread(scale)


def replace_nodes(graph, removed: set[int], added: dict[int, list]) -> None:
    """Drop nodes whose id is in `removed`; put added[id] where that node stood. The caller holds the nodes it took
    ids of (a list of them, or a map such as producers): protobuf's upb makes a node's Python object when it is
    read and may give a freed one's id to the next."""
    nodes = []
    for n in graph.node:
        nodes += added.get(id(n), [])
        if id(n) not in removed:
            nodes.append(n)
    del graph.node[:]
    graph.node.extend(nodes)


def use_ms_domain(model) -> None:
    """Declare the com.microsoft opset (ONNX Runtime's contrib ops) if the model does not yet."""
    from onnx import helper

    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))


def computed_weights(graph) -> set[str]:
    """The values `graph` computes from its initializers alone (a checkpoint's codes behind a DequantizeLinear
    and the ops after it, a half weight's Cast), besides the initializers themselves; nodes in graph order."""
    constant = {i.name for i in graph.initializer}
    for n in graph.node:
        if n.op_type not in ("RandomNormal", "RandomUniform", "Multinomial") \
                and all(name in constant for name in node_reads(n)):
            constant.update(o for o in n.output if o)
    return constant


def matmul_transposed_weights(model) -> int:
    """Rewrite each MatMul(x, Transpose(W)) whose W is a 2-D initializer, or a 2-D weight computed from
    initializers alone (a checkpoint's codes dequantized), read through that Transpose alone as
    FusedMatMul(x, W, transB=1) (ONNX Runtime's contrib op: the same products, the weight read in place);
    returns how many. ONNX Runtime makes this fusion itself for a float32 initializer, not for a float16 graph on
    the CPU (its FusedMatMul kernel is float32's) nor for a computed weight, where the Transpose then runs as a
    node: a transposed copy of the weight (a tied head's table, 1.2 GiB as float32 for Qwen2.5-1.5B's
    vocabulary)."""
    from onnx import helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    computed = computed_weights(g) - set(inits)
    producers = {o: n for n in g.node for o in n.output}
    uses: dict[str, int] = {}
    for n in g.node:
        for name in node_reads(n):
            uses[name] = uses.get(name, 0) + 1
    outputs = {o.name for o in g.output}
    removed, added = set(), {}
    held = list(g.node)  # alive until replace_nodes has found them by id
    for n in held:
        t = producers.get(n.input[1]) if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") else None
        if t is None or t.op_type != "Transpose" or uses.get(t.output[0]) != 1 or t.output[0] in outputs:
            continue
        perm = node_attribute(t, "perm", None)
        swapped = perm is not None and list(perm) == [1, 0]
        two_d = (t.input[0] in inits and len(inits[t.input[0]].dims) == 2 and (perm is None or swapped)) \
            or (t.input[0] in computed and swapped)
        if not two_d:
            continue
        fused = helper.make_node("FusedMatMul", [n.input[0], t.input[0]], list(n.output), name=n.name or None,
                                 domain=MS_DOMAIN, transA=0, transB=1, alpha=1.0)
        removed |= {id(n), id(t)}
        added[id(n)] = [fused]
    if removed:
        replace_nodes(g, removed, added)
        use_ms_domain(model)
    return len(added)


def dequantizes_weights(model) -> bool:
    """Whether the graph computes a weight by a DequantizeLinear of initializers alone (a checkpoint's codes)."""
    inits = {i.name for i in model.graph.initializer}
    return any(n.op_type == "DequantizeLinear" and all(i in inits for i in n.input if i) for n in model.graph.node)


def dequantizes_with_run_time_scales(model) -> bool:
    """Whether a DequantizeLinear of the graph reads a scale computed as it runs (per-token activations: a scale
    per row), not a stored one (an initializer or a Constant)."""
    g = model.graph
    stored = {i.name for i in g.initializer} | {o for n in g.node if n.op_type == "Constant" for o in n.output}
    return any(n.op_type == "DequantizeLinear" and len(n.input) > 1 and n.input[1] not in stored for n in g.node)


def compute_weights_where_read(model) -> int:
    """Move the nodes that compute a weight from initializers alone (computed_weights: a checkpoint's codes behind
    a DequantizeLinear and the ops after it) to just before each node that reads it, a copy for each such node;
    returns how many reads. A session that runs nodes in priority order (ORT's PRIORITY_BASED, ties in graph
    order) then computes each weight where it is used and frees it before the next: a checkpoint's codes graph
    dequantizes every weight at its head, so each ran at the start of a run and the whole float model was live
    (Gemma 3 270M: 1.07 GB beside 0.31 GB of codes), and a tied embedding read by the lookup (the first node)
    and by the head (the last) stays live between them unless each reads its own."""
    from onnx import NodeProto

    g, inits, producers, held = _tables(model)
    computed = computed_weights(g) - set(inits)
    order = {id(n): k for k, n in enumerate(held)}

    def chain(name: str) -> list:
        """The nodes that compute `name` from the initializers, in graph order (each once)."""
        nodes, seen, todo = [], set(), [name]
        while todo:
            node = producers.get(todo.pop())
            if node is not None and id(node) not in seen:
                seen.add(id(node))
                nodes.append(node)
                todo += [i for i in node_reads(node) if i not in inits]
        return sorted(nodes, key=lambda n: order[id(n)])

    added, reads = {}, 0
    for reader in held:
        if all(o in computed for o in reader.output if o):
            continue  # part of a weight's computation: copied with it
        for index, name in enumerate(reader.input):
            if name not in computed:
                continue
            name = _past_identities(producers, name)  # what an Identity passes on (a copy where it runs)
            if name in inits:
                reader.input[index] = name
                continue
            reads += 1
            nodes = chain(name)
            renamed = {o: f"{o}__read{reads}" for n in nodes for o in n.output if o}
            for n in nodes:
                c = NodeProto()
                c.CopyFrom(n)
                c.name = f"{n.name or n.output[0]}__read{reads}"
                c.input[:] = [renamed.get(i, i) for i in n.input]
                c.output[:] = [renamed.get(o, o) for o in n.output]
                added.setdefault(id(reader), []).append(c)
            reader.input[index] = renamed[name]
    if added:
        replace_nodes(g, set(), added)
        drop_dead_nodes(model)  # the weights' first nodes, read by none now
    return reads


HALF_BLOCK_BYTES = 64 << 20  # the float32 copy of a weight's block of rows: what a half session casts at a time


def read_half_weights_in_blocks(model, block_bytes: int = HALF_BLOCK_BYTES) -> int:
    """Rewrite each MatMul / FusedMatMul(transB=1) whose weight is a 2-D float16 / bfloat16 initializer in external
    data, and larger than `block_bytes` as float32, to read it a block of rows at a time: each block is an
    initializer over the same bytes of the data file (its offset and length), so ONNX Runtime, which casts a half
    weight to float32 where it is used, casts one block at a time (a tied head's table: 1.5 GiB as float32 for
    Llama-3.2-3B's vocabulary) and frees it before the next. FusedMatMul(x, W[out, in], transB=1): each block's
    output columns, concatenated; MatMul(x, W[in, out]): each block's rows times its slice of x's last axis,
    added in turn. The products are the same; a MatMul's sums are split at the blocks. Returns how many."""
    from onnx import TensorProto, helper, numpy_helper

    half = {TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2}
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    removed, added, blocks_of = set(), {}, {}
    held = list(g.node)  # alive until replace_nodes has found them by id
    for n in held:
        w = inits.get(n.input[1]) if len(n.input) > 1 else None
        fused = n.op_type == "FusedMatMul" and n.domain == MS_DOMAIN
        if w is None or not (fused or (n.op_type == "MatMul" and n.domain in ("", "ai.onnx"))) \
                or w.data_type not in half or len(w.dims) != 2 or w.data_location != TensorProto.EXTERNAL:
            continue
        if fused and (node_attribute(n, "transB", 0) != 1 or node_attribute(n, "transA", 0) != 0):
            continue
        rows, cols = w.dims
        count = -(-rows * cols * 4 // block_bytes)
        if count < 2:
            continue
        if w.name not in blocks_of:
            blocks_of[w.name] = _row_blocks(w, -(-rows // count), half[w.data_type])
            g.initializer.extend(blocks_of[w.name])
        out, nodes = n.output[0], []
        parts = [f"{out}__block{i}" for i in range(len(blocks_of[w.name]))]
        if fused:
            for block, part in zip(blocks_of[w.name], parts):
                nodes.append(helper.make_node("FusedMatMul", [n.input[0], block.name], [part], domain=MS_DOMAIN,
                                              transA=0, transB=1, alpha=node_attribute(n, "alpha", 1.0)))
            nodes.append(helper.make_node("Concat", parts, [out], axis=-1))
        else:
            start, axes, total = 0, f"{out}__axes", None
            g.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), axes))
            for i, (block, part) in enumerate(zip(blocks_of[w.name], parts)):
                end = start + block.dims[0]
                bounds = [f"{out}__starts{i}", f"{out}__ends{i}"]
                g.initializer.extend(numpy_helper.from_array(np.array([v], np.int64), b)
                                     for v, b in zip((start, end), bounds))
                nodes += [helper.make_node("Slice", [n.input[0], *bounds, axes], [f"{part}__x"]),
                          helper.make_node("MatMul", [f"{part}__x", block.name], [part])]
                if total is not None:
                    last = i == len(parts) - 1
                    nodes.append(helper.make_node("Add", [total, part], [out if last else f"{part}__sum"]))
                    part = out if last else f"{part}__sum"
                total, start = part, end
        removed.add(id(n))
        added[id(n)] = nodes
    if removed:
        replace_nodes(g, removed, added)
    return len(removed)


def read_dequantized_weights_in_blocks(model, block_bytes: int = HALF_BLOCK_BYTES) -> int:
    """Rewrite each FusedMatMul(x, W, transB=1) whose W ([out, in]) a DequantizeLinear computes from initializers
    in external data whose first axis is W's rows (a checkpoint's codes for a tied head, their scales and zero
    points; Identity nodes between) and whose float32 copy exceeds `block_bytes`, to compute W a block of rows
    at a time: each block's DequantizeLinear reads initializers over the same bytes of the data file, its
    FusedMatMul gives the block's output columns, and they are concatenated. The products are the same; a
    session that computes weights where they are used (ort_session.compute_weights_when_used) holds one block's
    float32 copy instead of the whole (Gemma 3's 262k-row head: 0.67 GB). Returns how many."""
    from onnx import TensorProto, helper

    item = {TensorProto.INT8: 1, TensorProto.UINT8: 1, TensorProto.INT4: 0.5, TensorProto.UINT4: 0.5,
            TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2}
    g, inits, producers, held = _tables(model)
    removed, added = set(), {}
    for n in held:
        if n.op_type != "FusedMatMul" or n.domain != MS_DOMAIN or node_attribute(n, "transB", 0) != 1 \
                or node_attribute(n, "transA", 0) != 0:
            continue
        dq = _dequantize_behind(producers, n.input[1])
        if dq is None:
            continue
        tensors = [inits.get(name) for name in dq.input if name]
        if any(t is None or t.data_location != TensorProto.EXTERNAL or t.data_type not in item or not t.dims
               for t in tensors):
            continue
        codes = tensors[0]
        rows = codes.dims[0]
        axis = node_attribute(dq, "axis", 1)
        if len(codes.dims) != 2 or any(t.dims[0] != rows for t in tensors) or (axis in (0, -2)) != all(
                len(t.dims) == 1 for t in tensors[1:]):
            continue  # not [out, in] codes with per-row scales (per axis 0) or blocks along `in` (axis 1)
        count = -(-rows * codes.dims[1] * 4 // block_bytes)
        step = -(-rows // max(count, 1))
        if count < 2 or any((step * _row_values(t) * item[t.data_type]) % 1 for t in tensors):
            continue
        blocks = [_row_blocks(t, step, item[t.data_type]) for t in tensors]
        g.initializer.extend(b for bs in blocks for b in bs)
        out, nodes, parts = n.output[0], [], []
        for i, inputs in enumerate(zip(*blocks)):
            part = f"{out}__block{i}"
            nodes += [helper.make_node("DequantizeLinear", [t.name for t in inputs], [f"{part}__w"],
                                       **{a.name: helper.get_attribute_value(a) for a in dq.attribute}),
                      helper.make_node("FusedMatMul", [n.input[0], f"{part}__w"], [part], domain=MS_DOMAIN,
                                       transA=0, transB=1, alpha=node_attribute(n, "alpha", 1.0))]
            parts.append(part)
        nodes.append(helper.make_node("Concat", parts, [out], axis=-1))
        removed.add(id(n))
        added[id(n)] = nodes
    return _replaced(model, removed, added)


def gather_dequantized_rows(model) -> int:
    """Rewrite each Gather along axis 0 (an embedding lookup) of a weight a DequantizeLinear computes from
    initializers with blocks along its second axis (a checkpoint's codes for an embedding table; Identity nodes
    between) as a DequantizeLinear of the gathered codes, scales and zero points: the same values, without the
    whole table's float32 copy (Gemma 3's 262k-row table: 0.67 GB). Returns how many."""
    from onnx import TensorProto, helper

    g, inits, producers, held = _tables(model)
    removed, added = set(), {}
    for n in held:
        if n.op_type != "Gather" or n.domain not in ("", "ai.onnx") or node_attribute(n, "axis", 0) != 0:
            continue
        dq = _dequantize_behind(producers, n.input[0])
        if dq is None or node_attribute(dq, "axis", 1) not in (1, -1) or not node_attribute(dq, "block_size", 0):
            continue
        tensors = [inits.get(name) for name in dq.input if name]
        if any(t is None or len(t.dims) != 2 for t in tensors) \
                or tensors[0].data_type not in (TensorProto.INT8, TensorProto.UINT8):
            continue  # not [rows, in] 8-bit codes (ONNX Runtime gathers no 4-bit type) with [rows, in / block] scales
        out, nodes, gathered = n.output[0], [], []
        for k, name in enumerate(dq.input):
            if name:
                gathered.append(f"{out}__gathered{k}")
                nodes.append(helper.make_node("Gather", [name, n.input[1]], [gathered[-1]], axis=0))
        attributes = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
        nodes.append(helper.make_node("DequantizeLinear", gathered, [out], **{**attributes, "axis": -1}))
        removed.add(id(n))
        added[id(n)] = nodes
    return _replaced(model, removed, added)


def _tables(model) -> tuple:
    """(the graph, its initializers by name, each value's producing node, its nodes held in a list: alive until
    replace_nodes has found them by id)."""
    g = model.graph
    return g, {i.name: i for i in g.initializer}, {o: n for n in g.node for o in n.output}, list(g.node)


def _past_identities(producers: dict, name: str) -> str:
    """`name`, or what the Identity nodes that produce it pass on."""
    while name in producers and producers[name].op_type == "Identity":
        name = producers[name].input[0]
    return name


def _dequantize_behind(producers: dict, name: str):
    """The DequantizeLinear that computes `name` (through Identity nodes), or None."""
    node = producers.get(_past_identities(producers, name))
    return node if node is not None and node.op_type == "DequantizeLinear" else None


def _replaced(model, removed: set[int], added: dict[int, list]) -> int:
    """replace_nodes, then drop what the new nodes left unread (a whole weight's DequantizeLinear); how many."""
    if removed:
        replace_nodes(model.graph, removed, added)
        drop_dead_nodes(model)
    return len(removed)


def _row_values(w) -> int:
    """Values in one row (along the first axis) of initializer `w`."""
    return int(np.prod(w.dims[1:], dtype=np.int64)) if len(w.dims) > 1 else 1


def _row_blocks(w, rows_per_block: int, item: float) -> list:
    """Initializers over consecutive blocks of `w`'s rows (its first axis), each reading its bytes of w's external
    data file (item: bytes a value, half a byte for 4-bit codes)."""
    from onnx import TensorProto

    where = {e.key: e.value for e in w.external_data}
    offset, rows, cols = int(where.get("offset", 0)), w.dims[0], _row_values(w)
    out = []
    for start in range(0, rows, rows_per_block):
        n = min(rows_per_block, rows - start)
        block = TensorProto(name=f"{w.name}__rows{start}", data_type=w.data_type, dims=[n, *w.dims[1:]],
                            data_location=TensorProto.EXTERNAL)
        for key, value in (("location", where["location"]), ("offset", str(int(offset + start * cols * item))),
                           ("length", str(int(n * cols * item)))):
            entry = block.external_data.add()
            entry.key, entry.value = key, value
        out.append(block)
    return out


def node_reads(node) -> list[str]:
    """What a node reads: its inputs and, for If / Loop / Scan, every name its subgraphs read."""
    names = [i for i in node.input if i]
    for attr in node.attribute:
        for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
            for n in sub.node:
                names += node_reads(n)
    return names


def nodes_between(index: GraphIndex, source: str, output: str) -> list:
    """The nodes that read `source` (directly or not) and that `output` depends on (`index`: the graph's)."""
    after, todo = {}, list(index.consumers.get(source, []))
    while todo:
        n = todo.pop()
        if id(n) not in after:
            after[id(n)] = n
            todo += [c for o in n.output for c in index.consumers.get(o, [])]
    before, todo = set(), [index.producer[output]] if output in index.producer else []
    while todo:
        n = todo.pop()
        if id(n) not in before and id(n) in after:  # (what does not read `source` is not followed further)
            before.add(id(n))
            todo += [index.producer[i] for i in n.input if i in index.producer]
    return [n for key, n in after.items() if key in before]


def drop_dead_nodes(model) -> int:
    """Remove nodes none of whose outputs reach a graph output (left behind by the fusions); returns how many."""
    g = model.graph
    needed = {o.name for o in g.output}
    kept = []
    for n in reversed(g.node):
        if any(o in needed for o in n.output):
            kept.append(n)
            needed.update(node_reads(n))
    dropped = len(g.node) - len(kept)
    if dropped:
        del g.node[:]
        g.node.extend(reversed(kept))
        used = [i for i in g.initializer if i.name in needed]
        del g.initializer[:]
        g.initializer.extend(used)
        produced = {o for n in kept for o in n.output}
        infos = [v for v in g.value_info if v.name in produced]
        del g.value_info[:]
        g.value_info.extend(infos)
    return dropped


def external_bytes(tensor) -> int:
    """The bytes a tensor keeps in an external data file (0 for one held in the graph)."""
    entries = {e.key: e.value for e in tensor.external_data}
    return int(entries.get("length", 0)) if tensor.data_location == 1 else 0


def save_with_data(model, path, base_dir, location: str, inline_max: int = 1024, align: int = 1 << 16,
                   align_from: int = 1 << 20) -> None:
    """Write `model` to `path` with each initializer of more than `inline_max` bytes in one data file, `location`
    beside it, and the rest in the graph file: a weight held in the graph is moved out of it (the model then
    refers to the new file), a weight already external (its file under `base_dir`, such as the float bundle a
    calibrated graph was made from) is copied across in pieces. So no weight is held whole in memory twice, and
    those that stayed on disk are never read whole. Tensors of `align_from` bytes or more start on a multiple of
    `align` bytes, as onnx places them, so that ONNX Runtime can map each from the file."""
    import os

    from onnx import external_data_helper

    path = os.fspath(path)
    target = os.path.join(os.path.dirname(path), location)
    chunk = 64 << 20
    with open(target, "xb") as out:
        for tensor in external_data_helper._get_all_tensors(model):
            external = tensor.data_location == 1
            size = external_bytes(tensor) if external else len(tensor.raw_data)
            if not external and (size <= inline_max or not tensor.HasField("raw_data")):
                continue
            offset = out.tell()
            if size >= align_from and offset % align:
                offset += align - offset % align
                out.seek(offset)
            if external:
                entries = {e.key: e.value for e in tensor.external_data}
                with open(os.path.join(os.fspath(base_dir), entries["location"]), "rb") as src:
                    src.seek(int(entries.get("offset", 0)))
                    left = size
                    while left:
                        piece = src.read(min(chunk, left))
                        if not piece:
                            raise OSError(f"{entries['location']} ends before {tensor.name}'s {size} bytes")
                        out.write(piece)
                        left -= len(piece)
            else:
                out.write(tensor.raw_data)
            tensor.ClearField("raw_data")
            del tensor.external_data[:]
            tensor.data_location = 1
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(size))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
    import onnx

    onnx.save(model, path)
