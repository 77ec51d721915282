"""An ONNX Runtime-specific variant of a bundle's graph, faster on ORT; the bundle's graph is untouched.

Rewrites that keep the arithmetic (fewer or narrower kernels):
- a bundle that keeps a pre-quantized checkpoint's codes runs its 4-bit weights as MatMulNBits and has its other
  weights evaluated to float once (codes.py);
- a tied embedding and quantized head that the bundle stores once get their
  fast forms back: the head's codes transposed for an integer kernel, the
  embedding a float table (unshare_tied_head);
- per-token INT8 MatMuls run on the integer kernels (per_token.py);
- an INT4 bundle's layers kept as INT8 blocks (the automatic recipe's, calibration/auto.py) get float weights,
  dequantized once (float_int8_blocks): ONNX Runtime would otherwise run them as 8-bit MatMulNBits at the exact
  accuracy level, 26x slower than the float MatMul at batch 1 (576 x 1536, measured on ORT 1.32);
- a tied float head's Transpose of the embedding's table is written transposed,
  so the table is its Gather's alone (fold_tied_head_transposes);
- sibling MatMuls that read the same activation with constant weights (q/k/v,
  gate/up) become one wider MatMul and a Split: one pass over the activation,
  one GEMV per group instead of three or two;
- a `num_logits_to_keep` input (int64 [1], as transformers calls it) slices
  the hidden states before the vocabulary projection, so a prefill that only
  needs the last position's logits does not compute the other positions';
- in float32 graphs, RMSNorm and RoPE chains become ONNX Runtime's fused
  kernels (see fusions.py);
- in a mixture of experts, each expert's dispatch runs under an `If` on
  whether any token chose it, so a decode step skips the unchosen experts'
  kernels (moe.py). (ONNX Runtime's own MoE kernel computes
  softmax-routed experts too, but measured slower on the CPU at batch 1.)

At MatMulNBits accuracy level 4 (the backend's opt-in `accuracy_level=4`: 8-bit activations, llama.cpp's dot
products, not the bundle's function) a checkpoint's 8-bit codes run as 8-bit MatMulNBits too (codes.py), and an
INT4 bundle's INT8 blocks stay block-wise DequantizeLinears, which ONNX Runtime fuses into 8-bit MatMulNBits at
that level (the session's config, kvforge/ort_session.py), instead of float weights; a per-token INT8 MatMul is
one 8-bit MatMulNBits over its float activation (per_token.py) instead of the integer kernel and its row scales.

The TensorRT-facing graph stays standard ONNX; the variant is built on first
use and cached under $KVFORGE_CACHE (default ~/.cache/kvforge), keyed by the
hash of the bundle's graph files (and the accuracy level, where it is not 0).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from kvforge.cache import cache_dir
from kvforge.errors import KvforgeError
from kvforge.onnx_graph import (GraphIndex, block_dequantized, drop_dead_nodes, node_attribute, node_reads,
                                nodes_between, replace_nodes)
from kvforge.ort_session import check_accuracy_level

from .attention import LOGITS_ROWS, use_group_query_attention
from .codes import checkpoint_kernels, nbits_width
from .fusions import fuse_rms_norms, fuse_rotary, fuse_skip_rms_norms
from .moe import skip_unchosen_experts
from .per_token import integer_per_token_matmuls

VARIANT_VERSION = 29  # 27: the rows branch reshapes with allowzero (no rows); 28: WEIGHT_DIGESTS; 29: tables only
KEEP_INPUT = "num_logits_to_keep"
_EXTERNAL_THRESHOLD = 1 << 30
# Beside each variant's graph: the sha256 of each table of at least _DIGESTED_BYTES (a weight only Gathers read, as
# their data: an embedding), by name, so that two variants of one bundle loaded together (two accuracy levels) find
# the tables they hold alike without reading them. Only tables: ONNX Runtime neither constant-folds nor prepacks an
# initializer given by SessionOptions.add_initializer, so a shared MatMul weight, or the Transpose of a tied head,
# ran every step (Gemma 3 270M's INT8 decode at level 4 fell from 54 to 22 tok/s)
WEIGHT_DIGESTS = "weights.json"
_DIGESTED_BYTES = 1 << 20
_PLAIN_TYPES = {1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13}  # TensorProto's types numpy holds as they are: not 4-bit, fp8


def float_int8_blocks(model, keep_matmul_weights: bool = False) -> int:
    """Every block-wise INT8 DequantizeLinear of a constant weight replaced by its float result (the same values,
    computed once); returns how many. keep_matmul_weights: keep those along the input axis, in power-of-two blocks
    of 16 or more, that only MatMuls read as their weight (ONNX Runtime fuses them into 8-bit MatMulNBits: at
    accuracy level 4 as fast as the integer kernels)."""
    from onnx import TensorProto, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    readers = collections.defaultdict(list)
    for n in g.node:
        for i, x in enumerate(n.input):
            readers[x].append((n, i))
    removed, done = set(), 0
    nodes = list(g.node)  # held: replace_nodes keys them by id
    for node in nodes:
        if node.op_type != "DequantizeLinear" or not all(i in inits for i in node.input if i):
            continue
        block = node_attribute(node, "block_size", 0)
        codes = inits[node.input[0]]
        if not block or codes.data_type != TensorProto.INT8:
            continue
        users = readers[node.output[0]]
        if keep_matmul_weights and nbits_width(node, codes, 4) == 8 and users \
                and all(n.op_type == "MatMul" and i == 1 for n, i in users):
            continue
        scale = numpy_helper.to_array(inits[node.input[1]])
        zp = numpy_helper.to_array(inits[node.input[2]]) if len(node.input) > 2 and node.input[2] else None
        w = block_dequantized(numpy_helper.to_array(codes), scale, block, node_attribute(node, "axis", 1),
                              zp).astype(scale.dtype)
        g.initializer.append(numpy_helper.from_array(w, node.output[0]))
        removed.add(id(node))
        done += 1
    if removed:
        _rewrite_nodes(g, removed, {})
    return done


def _rewrite_nodes(graph, removed: set[int], added: dict[int, list]) -> None:
    """Drop the nodes whose id is in `removed`, put added[id] where that node stood (onnx_graph.replace_nodes), then
    the initializers no node reads any more."""
    replace_nodes(graph, removed, added)
    used = {x for n in graph.node for x in node_reads(n)}
    kept = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def fuse_sibling_matmuls(model) -> int:
    """Merge MatMuls that share their activation and have 2-D constant weights; returns groups merged."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    consumers = collections.Counter(x for n in g.node for x in n.input)
    groups = collections.defaultdict(list)
    for n in g.node:
        w = inits.get(n.input[1]) if n.op_type == "MatMul" else None
        if w is not None and len(w.dims) == 2 and consumers[n.input[1]] == 1:
            groups[n.input[0]].append(n)
    replace, drop = {}, set()
    for x, nodes in groups.items():
        if len(nodes) < 2:
            continue
        weights = [numpy_helper.to_array(inits[n.input[1]]) for n in nodes]
        if len({w.shape[0] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
            continue
        base = f"{nodes[0].name or nodes[0].output[0]}_siblings"
        g.initializer.append(numpy_helper.from_array(np.concatenate(weights, axis=1), f"{base}.weight"))
        g.initializer.append(numpy_helper.from_array(np.array([w.shape[1] for w in weights], np.int64), f"{base}.split"))
        replace[id(nodes[0])] = [
            helper.make_node("MatMul", [x, f"{base}.weight"], [f"{base}.out"], name=base),
            helper.make_node("Split", [f"{base}.out", f"{base}.split"], [n.output[0] for n in nodes], name=f"{base}.split", axis=-1),
        ]
        drop |= {id(n) for n in nodes}
    _rewrite_nodes(g, drop, replace)
    return len(replace)


def fuse_sibling_quantized_matmuls(model, base_dir: str = "") -> int:
    """The quantized form of fuse_sibling_matmuls: MatMuls reading one activation (directly, or through
    Q -> DQ pairs with the same scale and zero point: W8A8) whose weights are DequantizeLinears of constant codes
    with the same format and axis become one DequantizeLinear of the codes side by side, one MatMul (ORT then runs
    one integer or MatMulNBits kernel, and quantizes the activation once) and a Split. Each output channel keeps
    its codes, scale and zero point: the function is the same. Returns groups merged. base_dir: where the graph's
    external data lies, for a graph loaded without it."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    consumers = collections.Counter(x for n in g.node for x in n.input)
    outputs = {o.name for o in g.output}

    def single(name):
        return consumers[name] == 1 and name not in outputs

    groups = collections.defaultdict(list)
    for n in g.node:
        if n.op_type != "MatMul":
            continue
        w = producer.get(n.input[1])
        if w is None or w.op_type != "DequantizeLinear" or not single(w.output[0]) or \
                any(x and (x not in inits or consumers[x] != 1) for x in w.input):
            continue
        attrs = tuple(sorted((a.name, helper.get_attribute_value(a)) for a in w.attribute))
        codes = inits[w.input[0]]
        if len(codes.dims) != 2:
            continue
        key = (n.input[0], None, attrs, codes.data_type, codes.dims[0], len(w.input))
        dq = producer.get(n.input[0])
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is not None and q.op_type == "QuantizeLinear" and single(dq.output[0]) and single(q.output[0]) \
                and list(q.input[1:]) == list(dq.input[1:]):
            key = (q.input[0], tuple(q.input[1:]), *key[2:])
        groups[key].append((n, w, dq if key[1] else None, q if key[1] else None))
    replace, drop = {}, set()
    for key, members in groups.items():
        if len(members) < 2:
            continue
        first, w0 = members[0][0], members[0][1]
        base = f"{first.name or first.output[0]}_siblings"
        arrays = [[numpy_helper.to_array(inits[x], base_dir) for x in w.input] for _, w, _, _ in members]
        widths = [a[0].shape[1] for a in arrays]
        fused = []
        for j, suffix in enumerate(("codes", "scale", "zero_point")[:len(w0.input)]):
            fused.append(numpy_helper.from_array(np.concatenate([a[j] for a in arrays], axis=-1), f"{base}.{suffix}"))
        g.initializer.extend(fused)
        g.initializer.append(numpy_helper.from_array(np.array(widths, np.int64), f"{base}.split"))
        replace[id(first)] = [
            helper.make_node("DequantizeLinear", [t.name for t in fused], [f"{base}.weight"], name=f"{base}.dq",
                             **dict(key[2])),
            helper.make_node("MatMul", [first.input[0], f"{base}.weight"], [f"{base}.out"], name=base),
            helper.make_node("Split", [f"{base}.out", f"{base}.split"], [n.output[0] for n, *_ in members],
                             name=f"{base}.split", axis=-1),
        ]
        for i, (n, w, dq, q) in enumerate(members):
            drop |= {id(n), id(w)} | ({id(dq), id(q)} if i and dq is not None else set())
    _rewrite_nodes(g, drop, replace)
    return len(replace)


_NORM_WEIGHTS = {"SimplifiedLayerNormalization": (1, None), "SkipSimplifiedLayerNormalization": (2, 3),
                 "LayerNormalization": (1, 2)}  # op -> (scale input, bias input)


def fold_scales_into_norms(model) -> int:
    """A constant per-channel Mul right after a norm (SmoothQuant's 1/s before a quantized MatMul) folded into the
    norm's scale (and bias): norm(x) * w * c = norm(x) * (w * c). One kernel less per folded Mul, the same function
    up to float rounding. Only where the norm's output feeds that Mul alone; returns how many were folded."""
    from onnx import numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    consumers = collections.Counter(x for n in g.node for x in n.input)
    outputs = {o.name for o in g.output}
    drop = set()
    for mul in g.node:
        if mul.op_type != "Mul" or len(mul.input) != 2:
            continue
        const = [x for x in mul.input if x in inits]
        live = [x for x in mul.input if x not in inits]
        norm = producer.get(live[0]) if len(const) == 1 and len(live) == 1 else None
        if norm is None or norm.op_type not in _NORM_WEIGHTS or norm.domain not in ("", "com.microsoft") \
                or norm.output[0] != live[0] or consumers[live[0]] != 1 or live[0] in outputs:
            continue
        c = numpy_helper.to_array(inits[const[0]])
        w_at, b_at = _NORM_WEIGHTS[norm.op_type]
        w_name = norm.input[w_at] if len(norm.input) > w_at else ""
        if w_name not in inits or c.ndim != 1:
            continue
        w = numpy_helper.to_array(inits[w_name])
        if w.shape != c.shape or w.dtype != c.dtype:
            continue
        base = mul.name or mul.output[0]
        g.initializer.append(numpy_helper.from_array(w * c, f"{base}.folded_scale"))
        norm.input[w_at] = f"{base}.folded_scale"
        if b_at is not None and len(norm.input) > b_at and norm.input[b_at] in inits:
            b = numpy_helper.to_array(inits[norm.input[b_at]])
            g.initializer.append(numpy_helper.from_array(b * c, f"{base}.folded_bias"))
            norm.input[b_at] = f"{base}.folded_bias"
        norm.output[0] = mul.output[0]
        drop.add(id(mul))
    if drop:
        _rewrite_nodes(g, drop, {})
    return len(drop)


_PER_POSITION = {"Cast", "Add", "Sub", "Mul", "Div", "Tanh", "Reshape"}
_PROJECTIONS = ("MatMul", "MatMulNBits", "MatMulIntegerToFloat")
# what quantizes the projection's activation (calibration/qdq.py's static pair or per-token rows; per_token.py's
# integer form): the hidden state is sliced before all of it
_HEAD_INPUT = {"QuantizeLinear", "DequantizeLinear", "Reshape", "Concat"}


def _head_entry(model) -> tuple[str, list]:
    """(the hidden state the vocabulary projection reads, the nodes on its way to `logits` that read it).

    The projection is the MatMul (or ONNX Runtime's quantized form of one) producing `logits` through per-position
    ops only: the Cast of half-precision graphs, a head bias, logit scaling and soft-capping, a per-token
    quantized head's reshape back and row scales. The hidden state is what its activation's quantization reads (a
    static Q -> DQ pair, per-token rows with their scales), so slicing it keeps that pattern whole (a Slice between
    DQ and MatMul makes ORT propagate the pair across the Slice with a mistyped zero point, and the session fails
    to load). Every node between the hidden state and `logits` must read only it, constants and each other (else
    the projection's input itself is the hidden state)."""
    g = model.graph
    index = GraphIndex(g)
    producer = index.producer
    constants = {i.name for i in g.initializer}
    for n in g.node:  # (in graph order) what constants alone compute: a weight's DequantizeLinear, say
        if all(i in constants for i in n.input if i):
            constants.update(n.output)
    head = producer.get("logits")
    while head is not None and head.op_type in _PER_POSITION:
        live = [i for i in head.input if i and i not in constants]
        # a per-token head's row scales multiply the projection's output (its first input)
        head = producer.get(live[0] if len(live) == 1 or head.op_type in ("Mul", "Reshape") else "")
    if head is None or head.op_type not in _PROJECTIONS:  # (a tied head on its codes: codes.py)
        raise KvforgeError("cannot find the vocabulary projection (a MatMul producing `logits`) to slice before")
    source = head.input[0]
    while producer.get(source) is not None and producer[source].op_type in _HEAD_INPUT:
        source = producer[source].input[0]
    region = nodes_between(index, source, "logits")
    inside = {id(n) for n in region}
    if source != head.input[0] and not all(i in constants or i in (source, "") or id(producer.get(i)) in inside
                                           for n in region for i in n.input):
        source = head.input[0]
        region = nodes_between(index, source, "logits")
    return source, [n for n in region if source in n.input]


def _insert_before_head(model, entry: tuple[str, list], nodes, result: str, dim: str) -> None:
    """Insert `nodes` (which read the hidden state and make `result`) before the head's first reader of the hidden
    state, and have its readers read `result`; `logits`' sequence axis is then named `dim`."""
    g = model.graph
    source, readers = entry
    index = min(i for i, n in enumerate(g.node) if any(n is r for r in readers))
    for r in readers:
        for i, x in enumerate(r.input):
            if x == source:
                r.input[i] = result
    for offset, n in enumerate(nodes):
        g.node.insert(index + offset, n)
    for out in g.output:
        if out.name == "logits":
            out.type.tensor_type.shape.dim[1].dim_param = dim


def add_logits_to_keep(model) -> None:
    """Slice the last `num_logits_to_keep` positions before the vocabulary projection."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    entry = _head_entry(model)
    g.input.append(helper.make_tensor_value_info(KEEP_INPUT, TensorProto.INT64, [1]))
    g.initializer.extend([
        numpy_helper.from_array(np.array([0], np.int64), "kvforge_zero"),
        numpy_helper.from_array(np.array([np.iinfo(np.int64).max], np.int64), "kvforge_end"),
        numpy_helper.from_array(np.array([1], np.int64), "kvforge_axis_seq"),
    ])
    nodes = [
        helper.make_node("Sub", ["kvforge_zero", KEEP_INPUT], ["kvforge_keep_start"], name="kvforge_keep_start"),
        helper.make_node("Slice", [entry[0], "kvforge_keep_start", "kvforge_end", "kvforge_axis_seq"],
                         ["kvforge_kept_hidden"], name="kvforge_keep_slice"),
    ]
    _insert_before_head(model, entry, nodes, "kvforge_kept_hidden", "num_logits_to_keep")


def add_logits_rows(model) -> None:
    """Project only the hidden states at the given flat (batch * T + position) rows: an int64 (B, K) input.

    What a packed cache needs: a right-aligned prefill's last real token sits at a different position in
    each row.
    """
    from onnx import TensorProto, helper

    g = model.graph
    entry = _head_entry(model)
    g.input.append(helper.make_tensor_value_info(LOGITS_ROWS, TensorProto.INT64, ["batch", "logits_kept"]))
    nodes = [
        helper.make_node("Flatten", [entry[0]], ["kvforge_flat_hidden"], name="kvforge_flat_hidden", axis=2),
        helper.make_node("Gather", ["kvforge_flat_hidden", LOGITS_ROWS], ["kvforge_kept_hidden"], name="kvforge_keep_rows", axis=0),
    ]
    _insert_before_head(model, entry, nodes, "kvforge_kept_hidden", "logits_kept")


def unshare_tied_head(model) -> int:
    """Give a tied embedding and quantized head, stored once (DequantizeLinear of [vocab, K] codes read by the
    embedding Gather and by the head through a Transpose), each its fast form: the head a DequantizeLinear of
    transposed codes feeding its MatMul directly (ONNX Runtime then fuses it into an integer kernel), the
    embedding a float table (a Gather of dequantized rows, not a dequantization of the whole table every
    step). Memory at run time is what an untied bundle's is; returns the tables rewritten."""
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    consumers = collections.defaultdict(list)
    for n in g.node:
        for x in n.input:
            consumers[x].append(n)
    done = 0
    for dq in [n for n in g.node if n.op_type == "DequantizeLinear" and n.input[0] in inits and n.input[1] in inits]:
        users = consumers[dq.output[0]]
        transposes = [u for u in users if u.op_type == "Transpose" and [list(a.ints) for a in u.attribute] in ([], [[1, 0]])]
        gathers = [u for u in users if u.op_type == "Gather" and u.input[0] == dq.output[0]]
        slices = [u for u in users if u.op_type == "Slice" and all(c.op_type == "Gather" for c in consumers[u.output[0]])]
        if not transposes or len(transposes) + len(gathers) + len(slices) != len(users):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
        axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
        codes = numpy_helper.to_array(inits[dq.input[0]])
        scale = numpy_helper.to_array(inits[dq.input[1]])
        base = dq.output[0]
        # the head: transposed codes, the scale along the other axis
        g.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(codes.T), f"{base}.T.codes"),
                              numpy_helper.from_array(np.ascontiguousarray(scale.T) if scale.ndim == 2 else scale, f"{base}.T.scale")])
        inputs = [f"{base}.T.codes", f"{base}.T.scale"] + list(dq.input[2:])
        zp = None  # blocks' zero points (a tied INT4 head with minimums keeps uint4 codes with one per block)
        if len(dq.input) > 2 and dq.input[2] and scale.ndim == 2:
            zp = numpy_helper.to_array(inits[dq.input[2]])
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(zp.T), f"{base}.T.zero_point"))
            inputs[2] = f"{base}.T.zero_point"
        new_attrs = {"axis": 1 - axis, **({"block_size": block} if block else {})}
        for t in transposes:
            idx = list(g.node).index(t)
            g.node.remove(t)
            g.node.insert(idx, helper.make_node("DequantizeLinear", inputs, [t.output[0]], name=f"{t.name}_dq", **new_attrs))
        # the embedding: float rows, dequantized once here
        table = (block_dequantized(codes, scale, block, axis, zp) if block else codes.astype(np.float32) * (
            scale[:, None] if axis == 0 else scale[None, :]).astype(np.float32)).astype(scale.dtype)
        g.initializer.append(numpy_helper.from_array(table, f"{base}.table"))
        for gather in gathers:
            gather.input[0] = f"{base}.table"
        for s in slices:  # INT4's padding columns: cut here, once
            start, end = (int(numpy_helper.to_array(inits[s.input[i]])[0]) for i in (1, 2))
            g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(table[:, start:end]), f"{s.output[0]}.table"))
            for gather in consumers[s.output[0]]:
                gather.input[0] = f"{s.output[0]}.table"
            g.node.remove(s)
        g.node.remove(dq)
        done += 1
    if done:
        _rewrite_nodes(g, set(), {})
    return done


def fold_tied_head_transposes(model) -> int:
    """A tied float head: each Transpose of a 2-D table that a Gather also reads (the embedding) replaced by the
    transposed table, under the Transpose's output name. ONNX Runtime folds it when the session loads anyway;
    written here, the table is read by the embedding's Gather alone, a table two sessions can share
    (WEIGHT_DIGESTS). Returns how many."""
    from onnx import numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    gathered = {n.input[0] for n in g.node if n.op_type == "Gather"}
    outputs = {o.name for o in g.output}
    removed, nodes = set(), list(g.node)  # (held: _rewrite_nodes keys them by id)
    for node in nodes:
        weight = inits.get(node.input[0]) if node.op_type == "Transpose" and node.input[0] in gathered else None
        if weight is None or len(weight.dims) != 2 or weight.data_type not in _PLAIN_TYPES or node.output[0] in outputs:
            continue
        array = numpy_helper.to_array(weight)
        folded = np.ascontiguousarray(np.transpose(array, node_attribute(node, "perm")))
        g.initializer.append(numpy_helper.from_array(folded, node.output[0]))
        removed.add(id(node))
    if removed:
        _rewrite_nodes(g, removed, {})
    return len(removed)


def rewrite_attention(model, bundle, mixed: bool = False, config: dict | None = None) -> int:
    """GroupQueryAttention in place of every layer's attention (0 and nothing changed where one does not match);
    mixed: the mixed step's graph (attention.py); config: the decoder's (a vision-language bundle's
    model_config["decoder"]), default the bundle's."""
    io, cfg = bundle.io, config or bundle.model_config
    head_dim = cfg.get("head_dim") or cfg["dim"] // cfg["n_heads"]  # (None in a config written by hand: the default)
    return use_group_query_attention(model, io.past, io.present, cfg["n_heads"], cfg["n_kv_heads"], head_dim, mixed,
                                     io.windows)


def variant_path(bundle, attention: bool = False, mixed: bool = False, config: dict | None = None,
                 accuracy_level: int = 0) -> Path | None:
    """Build (once) and return the cached ORT variant of `bundle`'s graph.

    attention: also rewrite the attention as GroupQueryAttention over a packed shared-buffer cache
    (attention.py) where every layer's pattern allows; what the CPU backend runs. Its logits input is
    then LOGITS_ROWS, else KEEP_INPUT.
    mixed (with attention): the graph of a mixed step, decode rows and one prompt row's chunk in one call
    (attention.py); None where the attention is not rewritten. config: the decoder's, as rewrite_attention takes it.
    accuracy_level: the MatMulNBits accuracy level the variant's quantized MatMuls are built for
    (kvforge/ort_session.ACCURACY_LEVELS; 0: exact, 4: 8-bit activations), a variant of its own."""
    accuracy_level = check_accuracy_level(accuracy_level)
    files = bundle.manifest.get("files", {})
    graph = bundle.manifest["graph"]
    # The cache is keyed by the manifest's hashes; a file that no longer matches
    # its recorded size must not be served someone else's cached variant.
    for name in filter(None, (graph, bundle.manifest.get("external_data"))):
        actual = (bundle.path / name).stat().st_size if (bundle.path / name).is_file() else None
        if name in files and actual != files[name]["bytes"]:
            raise KvforgeError(f"bundle {bundle.path} is damaged: {name} has {actual} bytes, the manifest says {files[name]['bytes']}")
    key_parts = [files.get(graph, {}).get("sha256", "")]
    if bundle.manifest.get("external_data"):
        key_parts.append(files.get(bundle.manifest["external_data"], {}).get("sha256", ""))
    key = "-".join(p[:16] for p in key_parts) + f"-v{VARIANT_VERSION}" + ("-gqa" if attention else "") + (
        "-mixed" if mixed else "") + (f"-acc{accuracy_level}" if accuracy_level else "")
    directory = cache_dir("ort-variants") / key
    target = directory / "model.onnx"
    if target.is_file():
        return target
    if (directory / "none").is_file():  # a mixed graph this bundle cannot have (found once, remembered)
        return None
    import onnx

    model = bundle.load_graph()
    if bundle.quantization_format == "checkpoint":  # a checkpoint's codes: 4-bit ones as MatMulNBits, others float
        checkpoint_kernels(model, accuracy_level)  # (at level 4, 8-bit ones as MatMulNBits too)
    # (first: a tied head's blocks then feed its MatMul alone, which level 4 keeps as codes)
    unshare_tied_head(model)
    fold_tied_head_transposes(model)  # (the embedding's table then a Gather's alone)
    if (bundle.quantization or {}).get("int8_layers"):  # at level 4 ORT fuses the MatMuls' into 8-bit MatMulNBits
        float_int8_blocks(model, keep_matmul_weights=accuracy_level == 4)
    fuse_sibling_matmuls(model)
    fuse_sibling_quantized_matmuls(model)
    try:  # the head's per-token MatMul waits for its rows' slicing (below): it then quantizes only the rows kept
        head = _head_entry(model)[0]
    except KvforgeError:
        head = None
    # (before the experts' If: moe.py moves a rewritten expert into its branch)
    integer_per_token_matmuls(model, accuracy_level=accuracy_level, leave=head)
    if bundle.dtype == "float32":
        fuse_rms_norms(model)
        fuse_skip_rms_norms(model)
        fuse_rotary(model)
        drop_dead_nodes(model)
        fold_scales_into_norms(model)
    skip_unchosen_experts(model, {"float16": 10, "bfloat16": 16}.get(bundle.dtype, 1))
    # after the RoPE fusion: GroupQueryAttention then reads RotaryEmbedding's (B, T, hidden) form directly
    if attention and rewrite_attention(model, bundle, mixed, config):
        add_logits_rows(model)
    elif mixed:
        model = None
    else:
        add_logits_to_keep(model)
    if model is not None:  # the head's
        integer_per_token_matmuls(model, accuracy_level=accuracy_level)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=directory.parent))
    try:
        if model is None:
            (tmp / "none").write_text("no mixed graph: some layer's attention or cache does not allow it\n")
        else:
            big = sum(len(i.raw_data) for i in model.graph.initializer) > _EXTERNAL_THRESHOLD
            tables = _tables(model)
            digests = {i.name: hashlib.sha256(i.raw_data).hexdigest() for i in model.graph.initializer
                       if len(i.raw_data) >= _DIGESTED_BYTES and i.name in tables}
            onnx.save(model, str(tmp / "model.onnx"), save_as_external_data=big, location="model.onnx.data")
            (tmp / WEIGHT_DIGESTS).write_text(json.dumps(digests, indent=0))
        try:
            os.replace(tmp, directory)
        except OSError:  # another process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target if model is not None else None


def _tables(model) -> set[str]:
    """The names only Gather nodes read, and only as their data (input 0), in the graph and its subgraphs."""
    table = {}
    for node in model.graph.node:
        if node.op_type == "Gather":
            for i, name in enumerate(node.input):
                table[name] = table.get(name, True) and i == 0
        else:
            for name in node_reads(node):
                table[name] = False
    return {name for name, only in table.items() if only}


def weights_alike(graphs: list[Path]) -> dict[str, np.ndarray]:
    """The tables (WEIGHT_DIGESTS': of at least _DIGESTED_BYTES, read by Gathers only) that the variants at `graphs`
    all hold under one name with the same bytes, read from the first: what sessions over them can share
    (make_session's `initializers`) instead of each holding its own copy. Empty where a variant has no digests."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import uses_external_data

    digests = []
    for graph in graphs:
        path = Path(graph).parent / WEIGHT_DIGESTS
        digests.append(json.loads(path.read_text()) if path.is_file() else {})
    names = {n for n, d in digests[0].items() if all(other.get(n) == d for other in digests[1:])}
    if not names:
        return {}
    first = Path(graphs[0])
    model = onnx.load(str(first), load_external_data=False)
    out = {}
    for tensor in model.graph.initializer:
        if tensor.name not in names or tensor.data_type not in _PLAIN_TYPES:  # (an OrtValue is made from numpy's)
            continue
        if uses_external_data(tensor):  # mapped from its file, as ONNX Runtime maps it: a table's rows are read
            where = {e.key: e.value for e in tensor.external_data}  # from disk as they are gathered
            out[tensor.name] = np.memmap(first.parent / where["location"], onnx.helper.tensor_dtype_to_np_dtype(
                tensor.data_type), "r", int(where.get("offset", 0)), tuple(tensor.dims))
        else:
            out[tensor.name] = numpy_helper.to_array(tensor)
    return out
