"""The ONNX Runtime variant's attention: each layer's exported attention as one com.microsoft GroupQueryAttention.

The exported graph (standard ONNX, what TensorRT reads) concatenates each
layer's whole cache with the new keys and values every step and masks the
scores with the attention mask. On ONNX Runtime's CPU provider that Concat,
and the dozen small ops around the two attention MatMuls, cost more than the
attention itself at batch 1. GroupQueryAttention computes the same function
over a cache buffer that past and present share: a step writes its new
positions into the buffer in place and reads each row's valid prefix.

The cache it reads is laid out differently from the graph's: each row's
positions are packed from index 0 (no padding columns) and each row has its
own length (`seqlens_k`, the row's length after the step minus one). The
ONNX Runtime backend keeps caches in that layout and turns the session's
left-padded inputs into it (packed_cache.py).

Per layer, the rewrite matches, from the cache's Concats:

    present.k = Concat(past.k, k, axis=2)  present.v = Concat(past.v, v, axis=2)
    scores = MatMul(Reshape(Mul(q, scale)), Transpose(Unsqueeze(present.k)))
    [Cast] [Div cap -> Tanh -> Mul cap] Where(mask, MIN, .) Softmax [Cast]
    out = Reshape(Transpose(Reshape(MatMul(probs, Unsqueeze(present.v)))))

with q (B, H, T, D) and k, v (B, KV, T, D) after RoPE and q/k norms, and
puts GroupQueryAttention(q, k, v as (B, T, heads * D), the buffers) in
place of `out` and both Concats. A windowed layer's capped cache (present =
the Concat's newest W positions, its mask's columns lined up with the keys
through their Shape) becomes a whole buffer too, the window the kernel's
`local_window_size` (W); the packed layout then holds every position of
every layer, and the backend gives a capped layer's newest W where the
contract's layout is asked for. Anything else between the scores and the
Softmax (an ALiBi bias, a quantized cache) is not matched, and a graph in
which any layer does not match keeps its attention as exported: the
backend's cache layout is all or nothing.
"""

from __future__ import annotations

import numpy as np

from kvforge.onnx_graph import (MS_DOMAIN, GraphIndex, drop_dead_nodes, node_attribute, node_reads, replace_nodes,
                                 scalar_value, use_ms_domain)

CHUNK_SEQLENS = "kvforge_chunk_seqlens_k"  # int32 [1]: the mixed graph's prompt row's (see _mixed_attention)
CHUNK_TOTAL = "kvforge_chunk_total_length"  # int32 [1]
MIX_ROWS = "kvforge_mix_rows"  # the mixed graph's decode rows, Shape(SEQLENS)
SEQLENS = "kvforge_seqlens_k"  # int32 (B,): each row's valid cache length after this step, minus one
TOTAL = "kvforge_total_length"  # int32 [1]: the longest row's length after this step
LOGITS_ROWS = "kvforge_logits_rows"  # int64 (B, K): flat (batch * T + position) rows whose logits are computed


def _renamed(value_info, name: str, batch: int):
    """A copy of a graph input's or output's type under another name, with a fixed batch."""
    copy = type(value_info)()
    copy.CopyFrom(value_info)
    copy.name = name
    copy.type.tensor_type.shape.dim[0].dim_value = batch
    return copy


def _next(g: GraphIndex, name: str):
    """The one node reading `name`, whatever its op (None where several or none do)."""
    users = g.consumers.get(name, [])
    return users[0] if len(users) == 1 else None


def _perm(node) -> list[int]:
    return list(node_attribute(node, "perm", []))


def _heads_merged(g: GraphIndex, x: str):
    """The last node of Reshape(Transpose(Reshape(x), perm 0 2 1 3)): the attention output's heads merged back
    into (B, T, hidden), or None where x does not go on that way."""
    r1 = g.only_consumer(x, "Reshape")
    tr = g.only_consumer(r1.output[0], "Transpose") if r1 is not None else None
    return g.only_consumer(tr.output[0], "Reshape") if tr is not None and _perm(tr) == [0, 2, 1, 3] else None


def _capped(g: GraphIndex, present: str):
    """(the Concat, W) where `present` = Slice(Concat(past, new), -W:, axis 2): a windowed layer's capped cache
    (its newest W positions); (the Concat, None) where `present` is the Concat itself; None otherwise."""
    node = g.producer.get(present)
    if node is None or node.op_type != "Slice":
        return node, None
    starts, ends, axes, steps = (g.const(x) if x else None for x in [*node.input[1:5], "", "", "", ""][:4])
    if starts is None or ends is None or axes is None or starts.size != 1 or axes.tolist() not in ([2], [-2]) \
            or int(starts[0]) >= 0 or int(ends[0]) < 2 ** 31 or (steps is not None and steps.tolist() != [1]):
        return None
    return g.producer.get(node.input[0]), -int(starts[0])


def _match_layer(g: GraphIndex, past_k: str, past_v: str, present_k: str, present_v: str):
    """The nodes and tensors of one layer's attention, or None where it is not the plain pattern (nor a windowed
    layer's: its present the newest W of the Concat's positions, its mask's columns lined up with the keys)."""
    (cat_k, window), (cat_v, window_v) = _capped(g, present_k) or (None, None), _capped(g, present_v) or (None, None)
    for cat, past in ((cat_k, past_k), (cat_v, past_v)):
        if cat is None or cat.op_type != "Concat" or node_attribute(cat, "axis") not in (2, -2) or len(cat.input) != 2 or cat.input[0] != past:
            return None
    if window != window_v:
        return None
    shapes = []  # a windowed layer's: the keys' Shape, which lines the mask's columns up with them
    users_k, users_v = [], []
    for cat, users in ((cat_k, users_k), (cat_v, users_v)):
        for u in g.consumers[cat.output[0]]:
            if u.op_type == "Shape" and window is not None:
                shapes.append(u)
            elif not (window is not None and u.op_type == "Slice" and u.output[0] in (present_k, present_v)):
                users.append(u)
    if window is not None and (cat_k.output[0] in g.outputs or cat_v.output[0] in g.outputs):
        return None
    if len(users_k) != 1 or len(users_v) != 1 or users_k[0].op_type != "Unsqueeze" or users_v[0].op_type != "Unsqueeze":
        return None
    if any(g.axes(u) is None or g.axes(u).tolist() != [2] for u in (users_k[0], users_v[0])):
        return None
    tk = g.only_consumer(users_k[0].output[0], "Transpose")
    if tk is None or _perm(tk) != [0, 1, 2, 4, 3]:
        return None
    scores_mm = g.only_consumer(tk.output[0], "MatMul")
    if scores_mm is None or scores_mm.input[1] != tk.output[0]:
        return None
    grouped = g.producer.get(scores_mm.input[0])
    scaled = g.producer.get(grouped.input[0]) if grouped is not None and grouped.op_type == "Reshape" else None
    if scaled is None or scaled.op_type != "Mul" or g.only_consumer(scaled.output[0], "Reshape") is not grouped:
        return None
    scale = next((scalar_value(g.const(x)) for x in scaled.input if g.const(x) is not None), None)
    q = next((x for x in scaled.input if g.const(x) is None), None)
    if scale is None or q is None or scale <= 0:
        return None
    # scores -> [Cast] -> [soft-cap] -> Where -> Softmax -> [Cast]
    x, softcap = scores_mm.output[0], None
    nxt = _next(g, x)
    if nxt is not None and nxt.op_type == "Cast":
        x = nxt.output[0]
        nxt = _next(g, x)
    if nxt is not None and nxt.op_type == "Div":
        cap = scalar_value(g.const(nxt.input[1]))
        tanh = g.only_consumer(nxt.output[0], "Tanh")
        mul = g.only_consumer(tanh.output[0], "Mul") if tanh is not None else None
        if cap is None or mul is None or scalar_value(g.const(g.other_input(mul, tanh.output[0]) or "")) != cap or nxt.input[0] != x:
            return None
        softcap, x = cap, mul.output[0]
        nxt = _next(g, x)
    if nxt is None or nxt.op_type != "Where" or nxt.input[2] != x:
        return None
    where = nxt
    softmax = g.only_consumer(nxt.output[0], "Softmax")
    if softmax is None or node_attribute(softmax, "axis", -1) not in (-1, 4):
        return None
    x = softmax.output[0]
    nxt = _next(g, x)
    if nxt is not None and nxt.op_type == "Cast":
        x = nxt.output[0]
        nxt = _next(g, x)
    if nxt is None or nxt.op_type != "MatMul" or nxt.input != [x, users_v[0].output[0]]:
        return None
    r2 = _heads_merged(g, nxt.output[0])
    if r2 is None or not all(_mask_only_masks(g, {id(where)}, u.output[0], True) for u in shapes):
        return None
    caps = [g.producer[p] for p in (present_k, present_v)] if window is not None else []
    return {"q": q, "k": cat_k.input[1], "v": cat_v.input[1], "scale": scale, "softcap": softcap,
            "out": r2.output[0], "replace": r2, "concats": (cat_k, cat_v), "where": where, "window": window,
            "present": (present_k, present_v), "caps": caps}


def _mask_only_masks(g: GraphIndex, wheres: set[int], start: str = "attention_mask", condition: bool = False) -> bool:
    """Whether `start` (the attention mask; a windowed layer's keys' Shape, which lines the mask's columns up with
    the keys) reaches no graph output except through the matched Wheres (by their condition, input 0, where
    `condition`): then the packed layout, which drops the mask, loses nothing the graph computes from it."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in g.outputs:
            return False
        for node in g.consumers.get(name, []):
            if id(node) in wheres:
                if condition and node.input[0] != name:
                    return False
            elif id(node) not in seen:
                seen.add(id(node))
                todo.extend(node.output)
    return True


def _split_heads_source(g: GraphIndex, x: str, heads: int, head_dim: int) -> str | None:
    """s for x = Transpose(Reshape(s -> (B, T, heads, head_dim)), perm 0 2 1 3) with s (B, T, heads * head_dim)."""
    t = g.producer.get(x)
    r = g.producer.get(t.input[0]) if t is not None and t.op_type == "Transpose" and _perm(t) == [0, 2, 1, 3] else None
    if r is None or r.op_type != "Reshape":
        return None
    split, source = g.dims(r.output[0]), g.dims(r.input[0])
    if split is None or source is None or len(split) != 4 or split[2:] != [heads, head_dim] or len(source) != 3 \
            or source[2] != heads * head_dim:
        return None
    return r.input[0]


def _as_bsd(g: GraphIndex, x: str, heads: int, head_dim: int, name: str) -> tuple[list, str]:
    """Nodes giving x (B, heads, T, D) as (B, T, heads * D), and that tensor. Where x is the exporter's split into
    heads (through a fused RotaryEmbedding, which also takes the (B, T, hidden) layout), the split is skipped."""
    from onnx import helper

    node = g.producer.get(x)
    if node is not None and node.op_type == "RotaryEmbedding" and node.domain == MS_DOMAIN:
        source = _split_heads_source(g, node.input[0], heads, head_dim)
        if source is not None:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            attrs["num_heads"] = heads
            return [helper.make_node("RotaryEmbedding", [source, *node.input[1:]], [name], domain=MS_DOMAIN,
                                     name=f"{name}_rope", **attrs)], name
    source = _split_heads_source(g, x, heads, head_dim)
    if source is not None:
        return [], source
    return [helper.make_node("Transpose", [x], [f"{name}_bthd"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [f"{name}_bthd", "kvforge_gqa_bsd"], [name])], name


def chunk_name(name: str) -> str:
    """The mixed graph's name for the prompt row's cache tensor beside the decode rows' `name`."""
    return f"kvforge_chunk.{name}"


def _mixed_attention(i: int, inputs: list[str], heads: tuple[int, int, int], head_dim: int, attrs: dict, out: str,
                     past: tuple[str, str], present: tuple[str, str]) -> list:
    """One layer's attention in the mixed graph: the step's tokens (1, N, .) are the decode rows' one token each
    (the first R, R = the length of SEQLENS) and then one prompt row's T tokens. Each part gets its own
    GroupQueryAttention over its own buffers; the outputs are put back side by side."""
    from onnx import helper

    nodes, decode, prompt = [], [], []
    for x, h in zip(inputs, heads):
        width = h * head_dim
        nodes += [helper.make_node("Slice", [x, "kvforge_mix_zero", MIX_ROWS, "kvforge_mix_axis"], [f"{x}_rows"]),
                  helper.make_node("Reshape", [f"{x}_rows", f"kvforge_mix_rows_{width}"], [f"{x}_rows_bsd"]),
                  helper.make_node("Slice", [x, MIX_ROWS, "kvforge_mix_end", "kvforge_mix_axis"], [f"{x}_prompt"])]
        decode.append(f"{x}_rows_bsd")
        prompt.append(f"{x}_prompt")
    name = f"kvforge_gqa{i}"
    nodes += [
        helper.make_node("GroupQueryAttention", decode + [*past, SEQLENS, TOTAL], [f"{name}_rows", *present],
                         domain=MS_DOMAIN, name=name, **attrs),
        helper.make_node("GroupQueryAttention", prompt + [chunk_name(past[0]), chunk_name(past[1]), CHUNK_SEQLENS,
                                                           CHUNK_TOTAL],
                         [f"{name}_prompt", chunk_name(present[0]), chunk_name(present[1])], domain=MS_DOMAIN,
                         name=f"{name}_prompt", **attrs),
        helper.make_node("Reshape", [f"{name}_rows", f"kvforge_mix_line_{heads[0] * head_dim}"], [f"{name}_line"]),
        helper.make_node("Concat", [f"{name}_line", f"{name}_prompt"], [out], axis=1),
    ]
    return nodes


def use_group_query_attention(model, past: list[list[str]], present: list[list[str]], n_heads: int, n_kv_heads: int,
                              head_dim: int, mixed: bool = False, windows: list[int | None] | None = None) -> int:
    """Rewrite every layer's attention as GroupQueryAttention over shared past/present buffers; returns the layers
    rewritten (0, graph untouched, unless every layer matches and the shape suits the kernel; with mixed, a 0
    may leave the graph half rewritten: drop it).

    windows: each layer's sliding window W as the bundle declares it (None: full attention). A windowed layer's
    capped cache (its newest W positions) becomes a whole buffer like the others', and the kernel's
    local_window_size (W) masks what the window left behind.

    mixed: the graph of a mixed step instead (see _mixed_attention): input_ids (1, R + T) are R decode rows'
    tokens and one prompt row's T; the decode rows' cache is read and written as in the plain graph (SEQLENS,
    TOTAL, the past/present buffers), the prompt row's through its own (CHUNK_SEQLENS, CHUNK_TOTAL, and the
    buffers named chunk_name(past/present)). GroupQueryAttention takes several new tokens over a past only at
    batch 1, so a step that decodes some rows and feeds a prompt chunk to another is two calls of the plain
    graph, each reading every weight; the mixed graph reads them once. Every other op works token by token."""
    from onnx import TensorProto, helper, numpy_helper

    if head_dim % 8 or n_heads % n_kv_heads or any(len(p) != 2 for p in past):
        return 0
    g = GraphIndex(model.graph)
    layers = [_match_layer(g, pk, pv, ck, cv) for (pk, pv), (ck, cv) in zip(past, present)]
    if not layers or any(m is None for m in layers) or not _mask_only_masks(g, {id(m["where"]) for m in layers}):
        return 0
    if [m["window"] for m in layers] != list(windows or [None] * len(layers)):
        return 0
    graph = model.graph
    graph.initializer.extend([
        numpy_helper.from_array(np.array([0, 0, -1], np.int64), "kvforge_gqa_bsd"),
    ])
    if mixed:
        graph.initializer.extend([numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (
            ("kvforge_mix_zero", [0]), ("kvforge_mix_end", [np.iinfo(np.int64).max]), ("kvforge_mix_axis", [1]),
            *((f"kvforge_mix_rows_{w}", [-1, 1, w]) for w in {n_heads * head_dim, n_kv_heads * head_dim}),
            (f"kvforge_mix_line_{n_heads * head_dim}", [1, -1, n_heads * head_dim]))])
        graph.node.insert(0, helper.make_node("Shape", [SEQLENS], [MIX_ROWS], name="kvforge_mix_rows"))
    removed, added = set(), {}
    for i, m in enumerate(layers):
        nodes, inputs = [], []
        for role, heads in (("q", n_heads), ("k", n_kv_heads), ("v", n_kv_heads)):  # (B, heads, T, D) -> (B, T, heads * D)
            made, x = _as_bsd(g, m[role], heads, head_dim, f"kvforge_gqa{i}_{role}")
            nodes += made
            inputs.append(x)
        cat_k, cat_v = m["concats"]
        attrs = {"num_heads": n_heads, "kv_num_heads": n_kv_heads, "scale": float(m["scale"])}
        if m["softcap"] is not None:
            attrs["softcap"] = float(m["softcap"])
        if m["window"] is not None:  # W keys, the query's own included, as ONNX Runtime's kernel counts them
            attrs["local_window_size"] = m["window"]  # (held to the exported graph in the tests)
        if mixed:
            nodes += _mixed_attention(i, inputs, (n_heads, n_kv_heads, n_kv_heads), head_dim, attrs, m["out"],
                                      (cat_k.input[0], cat_v.input[0]), m["present"])
        else:
            nodes.append(helper.make_node(
                "GroupQueryAttention", inputs + [cat_k.input[0], cat_v.input[0], SEQLENS, TOTAL],
                [m["out"], *m["present"]], domain=MS_DOMAIN, name=f"kvforge_gqa{i}", **attrs))
        removed |= {id(m["replace"]), id(cat_k), id(cat_v), *(id(c) for c in m["caps"])}
        added[id(m["replace"])] = nodes
    replace_nodes(graph, removed, added)
    graph.input.extend([helper.make_tensor_value_info(SEQLENS, TensorProto.INT32, ["decode_rows" if mixed else "batch"]),
                        helper.make_tensor_value_info(TOTAL, TensorProto.INT32, [1])])
    if mixed:  # the prompt row's buffers, lengths and total, after the decode rows'
        chunk_io = {n for pair in past + present for n in pair}
        graph.input.extend([_renamed(v, chunk_name(v.name), 1) for v in graph.input if v.name in chunk_io])
        graph.output.extend([_renamed(v, chunk_name(v.name), 1) for v in graph.output if v.name in chunk_io])
        graph.input.extend([helper.make_tensor_value_info(CHUNK_SEQLENS, TensorProto.INT32, [1]),
                            helper.make_tensor_value_info(CHUNK_TOTAL, TensorProto.INT32, [1])])
    use_ms_domain(model)
    drop_dead_nodes(model)
    if mixed:  # anything but the attention that still reads a cache tensor (its shape, for the batch) would see the
        # decode rows' batch where the mixed graph's is 1: no mixed graph (the caller drops this half-made one)
        names = {n for pair in past for n in pair}
        if any(n.op_type != "GroupQueryAttention" and names & set(n.input) for n in graph.node):
            return 0
    # The cache buffers are longer than the graph's past/total dims say: let their length be any.
    for v in [*graph.input, *graph.output]:
        if v.name in {n for pair in past + present for n in pair}:
            v.type.tensor_type.shape.dim[2].dim_param = "cache_capacity"
            if mixed:  # the decode rows are not the graph's batch (which is 1: one line of tokens)
                v.type.tensor_type.shape.dim[0].dim_param = "decode_rows"
        elif v.name.startswith("kvforge_chunk."):
            v.type.tensor_type.shape.dim[2].dim_param = "chunk_capacity"
    # The mask is now dead (the cache's row lengths replace it) and leaves the contract; every other input stays,
    # read or not: a model without positions (NoPE) still takes position_ids, as its manifest says.
    used = {x for n in graph.node for x in node_reads(n)}
    kept = [i for i in graph.input if i.name in used or i.name != "attention_mask"]
    del graph.input[:]
    graph.input.extend(kept)
    return len(layers)


# -- an encoder's attention: MultiHeadAttention with a key padding mask ------------------------------------------
_MASK_PATH_OPS = {"Unsqueeze", "Expand", "Cast", "Reshape", "Not"}


def _key_padding_only(g: GraphIndex, where) -> bool:
    """Whether a Where's condition masks exactly the padded keys: computed from `attention_mask` (B, T) by shape
    ops and one Not alone (masked where the mask is 0), its filler a large negative constant."""
    fill = scalar_value(g.const(where.input[1]))
    if fill is None or fill > -1e4:
        return False
    name, nots = where.input[0], 0
    while name != "attention_mask":
        node = g.producer.get(name)
        if node is None or node.op_type not in _MASK_PATH_OPS:
            return False
        nots += node.op_type == "Not"
        name = node.input[0]
    return nots == 1


def _match_encoder_layer(g: GraphIndex, softmax):
    """One bidirectional attention layer around `softmax`, or None where it is not the exporter's plain pattern:

        scores = MatMul(Reshape(Mul(q, scale)), Transpose(Unsqueeze(k), perm 0 1 2 4 3))
        probs = Softmax(Where(key padding, MIN, scores))
        out = Reshape(Transpose(Reshape(MatMul(probs, Unsqueeze(v))), perm 0 2 1 3))

    with q, k, v (B, H, T, D), one key/value head per query head."""
    where = g.producer.get(softmax.input[0])
    if where is None or where.op_type != "Where" or node_attribute(softmax, "axis", -1) not in (-1, 4) \
            or g.only_consumer(where.output[0], "Softmax") is not softmax or not _key_padding_only(g, where):
        return None
    scores_mm = g.producer.get(where.input[2])
    if scores_mm is None or scores_mm.op_type != "MatMul" or g.only_consumer(scores_mm.output[0], "Where") is not where:
        return None
    grouped, tk = g.producer.get(scores_mm.input[0]), g.producer.get(scores_mm.input[1])
    scaled = g.producer.get(grouped.input[0]) if grouped is not None and grouped.op_type == "Reshape" else None
    if scaled is None or scaled.op_type != "Mul" or tk is None or tk.op_type != "Transpose" or _perm(tk) != [0, 1, 2, 4, 3]:
        return None
    scale = next((scalar_value(g.const(x)) for x in scaled.input if g.const(x) is not None), None)
    q = next((x for x in scaled.input if g.const(x) is None), None)
    uk = g.producer.get(tk.input[0])
    if scale is None or q is None or scale <= 0 or uk is None or uk.op_type != "Unsqueeze" or g.axes(uk) is None \
            or g.axes(uk).tolist() != [2]:
        return None
    av = g.only_consumer(softmax.output[0], "MatMul")
    uv = g.producer.get(av.input[1]) if av is not None and av.input[0] == softmax.output[0] else None
    if uv is None or uv.op_type != "Unsqueeze" or g.axes(uv) is None or g.axes(uv).tolist() != [2]:
        return None
    r2 = _heads_merged(g, av.output[0])
    if r2 is None:
        return None
    return {"q": q, "k": uk.input[0], "v": uv.input[0], "scale": scale, "out": r2.output[0], "replace": r2}


def use_multi_head_attention(model, n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """Every bidirectional attention layer that masks only padded keys as one com.microsoft MultiHeadAttention
    over (B, T, heads * D) inputs and the key padding mask (`attention_mask` as int32): the same function in one
    kernel, without the head transposes, the grouped reshapes and the Where. A layer whose q, k and v the graph
    does not record as (B, n_heads, T, head_dim) is left as it is (another attention's heads: an encoder-decoder's
    decoder). Returns the layers rewritten (0 and nothing changed where a layer has several key/value heads per
    group, or no `attention_mask` input)."""
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    if n_kv_heads != n_heads or "attention_mask" not in {i.name for i in graph.input}:
        return 0
    g = GraphIndex(graph)
    def heads_as_configured(m) -> bool:  # each of q, k, v recorded as (B, n_heads, T, head_dim): num_heads is right
        shapes = [g.dims(m[role]) for role in ("q", "k", "v")]
        return all(d is not None and len(d) == 4 and d[1] == n_heads and d[3] == head_dim for d in shapes)

    layers = [m for m in (_match_encoder_layer(g, n) for n in graph.node if n.op_type == "Softmax")
              if m is not None and heads_as_configured(m)]
    if not layers:
        return 0
    mask = "kvforge_key_padding_mask"
    graph.initializer.append(numpy_helper.from_array(np.array([0, 0, -1], np.int64), "kvforge_gqa_bsd"))
    added = {}
    for i, m in enumerate(layers):  # in graph order: the mask's Cast goes in before the first layer's
        nodes, bsd = [] if i else [helper.make_node("Cast", ["attention_mask"], [mask], to=TensorProto.INT32, name=mask)], []
        for role in ("q", "k", "v"):
            made, name = _as_bsd(g, m[role], n_heads, head_dim, f"kvforge_mha{i}_{role}")
            nodes += made
            bsd.append(name)
        nodes.append(helper.make_node("MultiHeadAttention", [*bsd, "", mask], [m["out"]], domain=MS_DOMAIN,
                                      name=f"kvforge_mha{i}", num_heads=n_heads, scale=float(m["scale"])))
        added[id(m["replace"])] = nodes
    replace_nodes(graph, {id(m["replace"]) for m in layers}, added)
    use_ms_domain(model)
    drop_dead_nodes(model)
    return len(layers)
