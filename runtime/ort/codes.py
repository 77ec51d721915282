"""ONNX Runtime's fast form of a bundle that keeps a pre-quantized checkpoint's codes (export/checkpoint_codes.py).

The bundle computes each kept weight as a chain ending in an Identity named for the weight:
DequantizeLinear -> [Reshape -> Add(offset) -> Reshape] -> [Gather(order)] -> Identity. ONNX Runtime computes it
exactly as written when the Q/DQ optimizations are off (the `checkpoint` session config), that is as a float
weight: correct, and as slow as the float bundle. In the variant:

- a 4-bit chain (int4 / uint4 codes in blocks along the input axis) whose weight only MatMuls read becomes
  ONNX Runtime's MatMulNBits over the same codes, scales and zero points (accuracy level 0: the weights
  dequantized in float32 as DequantizeLinear does them, the products summed in float32). A block offset (GGUF's
  Q4_1 minimum, the K-quants' dmin * m) joins as its exact counterpart on the activation side:
  x @ (W + 1 M) = x @ W + (x @ S) @ M, S the 0/1 [K, K/B] matrix that sums each block of inputs: two small
  float MatMuls and an Add (MatMulNBits' float zero points, -m / d, would not be exact, and ran 20x slower);
- every other chain is evaluated once into its float weight (the function of the graph, bit for bit), which
  the variant's float rewrites (sibling MatMuls merged, ...) then take like any float weight;
- a tied head: an embedding table [V, K] (blocks along K) that Gathers read and the vocabulary projection reads
  through a Transpose keeps its float table for the Gathers, and the projection runs as MatMulNBits on the table's
  own codes where their width allows (4 bits; 8 at level 4, below): GGUF's token_embd read once per token as codes.

At accuracy level 4 (the ONNX Runtime backend's opt-in `accuracy_level=4`, kvforge/ort_session.ACCURACY_LEVELS)
every MatMulNBits quantizes its activation to int8 per block (llama.cpp's dot products: faster, not exact), and
the 8-bit chains laid out the same way (int8 / uint8 codes in power-of-two blocks of at least 16 along the input
axis: GGUF's Q8_0, Q6_K, Q5_0, Q5_1, Q5_K, IQ4_NL, IQ4_XS) become 8-bit MatMulNBits too (one byte per code,
unsigned: signed codes shift by 128 with a zero point of 128), instead of float weights: at level 0 such a kernel
is several times slower than the float MatMul at batch 1, at level 4 as fast as the W8A8 integer kernel and faster
than the float MatMul (docs/ort-variant.md).
"""

from __future__ import annotations

import numpy as np

from kvforge.onnx_graph import MS_DOMAIN, node_attribute, use_ms_domain

_INT4, _UINT4 = 22, 21
_INT8, _UINT8 = 3, 2


def _chain(graph, identity, producer) -> list | None:
    """The nodes from the DequantizeLinear to `identity`, in order; None when the weight is not such a chain."""
    nodes, current = [identity], producer.get(identity.input[0])
    while current is not None and current.op_type != "DequantizeLinear":
        if current.op_type not in ("Reshape", "Add", "Gather"):
            return None
        nodes.append(current)
        current = producer.get(current.input[0])
    if current is None:
        return None
    nodes.append(current)
    return nodes[::-1]


def _evaluate(chain, inits: dict, name: str) -> np.ndarray:
    """The weight the chain computes, by ONNX Runtime with Q/DQ computed as written (as the bundle runs it)."""
    from onnx import helper

    from kvforge.ort_session import make_session

    used = {i for n in chain for i in n.input if i in inits}
    graph = helper.make_graph(list(chain), "weight", [], [helper.make_tensor_value_info(name, 1, None)],
                              [inits[i] for i in sorted(used)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return make_session(model.SerializeToString(), "checkpoint", optimization="none").run([name], {})[0]


def nbits_width(dq, codes, accuracy_level: int, axis: int = 0) -> int | None:
    """The MatMulNBits width the chain starting at `dq` (whose codes initializer is `codes`, blocked along `axis`,
    the MatMul's input axis: 0, or 1 for an embedding table [V, K] a tied head reads transposed) runs at on this
    level: 4 for 4-bit codes, 8 for 8-bit ones at level 4 (power-of-two blocks: MatMulNBits' own), None: a float
    weight."""
    if codes is None or node_attribute(dq, "axis", 1) != axis:
        return None
    block = node_attribute(dq, "block_size", 0)
    if codes.data_type in (_INT4, _UINT4) and block >= 16:
        return 4
    if accuracy_level == 4 and codes.data_type in (_INT8, _UINT8) and block >= 16 and not block & (block - 1) \
            and len(codes.dims) == 2 and codes.dims[axis] % block == 0:
        return 8
    return None


def _tied_heads(users: list, readers: dict) -> list | None:
    """(Transpose, MatMul) pairs where an embedding table's readers are Gathers and a tied head's Transpose -> MatMul
    (its weight input), else None."""
    heads = []
    for node, i in users:
        if node.op_type == "Gather" and i == 0:
            continue
        if node.op_type != "Transpose" or list(node_attribute(node, "perm", [1, 0])) != [1, 0]:
            return None
        after = readers.get(node.output[0], [])
        if not after or any(n.op_type != "MatMul" or j != 1 for n, j in after):
            return None
        heads += [(node, n) for n, _ in after]
    return heads or None


def checkpoint_kernels(model, accuracy_level: int = 0) -> int:
    """Rewrite every kept weight's chain (in place); returns how many MatMuls now run as MatMulNBits. MatMuls that
    read the same activation (q/k/v, gate/up) share one MatMulNBits (per width) and one block-sum over a
    concatenated N. accuracy_level: the MatMulNBits' (0: exact; 4: 8-bit activations, and 8-bit codes as
    MatMulNBits too)."""
    from onnx import numpy_helper

    from kvforge.ort_session import check_accuracy_level

    accuracy_level = check_accuracy_level(accuracy_level)

    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, list] = {}
    for n in g.node:
        for i, x in enumerate(n.input):
            readers.setdefault(x, []).append((n, i))
    inits = {i.name: i for i in g.initializer}
    chains = [(n, c) for n in g.node if n.op_type == "Identity" and n.name.endswith("_weight")
              for c in [_chain(g, n, producer)] if c is not None]
    drop, new_inits, groups = set(), [], {}
    for identity, chain in chains:
        name, dq = identity.output[0], chain[0]
        codes = inits.get(dq.input[0])
        users = readers.get(name, [])
        block = node_attribute(dq, "block_size", 0)
        bits = None if any(n.op_type == "Gather" for n in chain) else nbits_width(dq, codes, accuracy_level)
        if bits and users and all(n.op_type == "MatMul" and i == 1 for n, i in users):
            offset = next((numpy_helper.to_array(inits[n.input[1]]) for n in chain if n.op_type == "Add"), None)
            zp = numpy_helper.to_array(inits[dq.input[2]]) if len(dq.input) > 2 and dq.input[2] else None
            packed = pack_nbits(numpy_helper.to_array(codes), numpy_helper.to_array(inits[dq.input[1]]), zp, block, bits)
            k, n_out = int(codes.dims[0]), int(codes.dims[1])
            rows = None if offset is None else offset.reshape(k // block, n_out)
            for matmul, _ in users:
                key = (matmul.input[0], k, block) if bits == 4 else (matmul.input[0], k, block, bits)
                groups.setdefault(key, []).append((matmul, packed, rows, n_out))
        else:
            new_inits.append(numpy_helper.from_array(_evaluate(chain, inits, name), name))  # (a table's Gathers read it)
            head_bits = nbits_width(dq, codes, accuracy_level, axis=1) if len(chain) == 2 else None
            heads = _tied_heads(users, readers) if head_bits else None
            if heads:  # a tied head (GGUF's Q8_0 token_embd): its MatMul runs on the table's own codes
                zp = numpy_helper.to_array(inits[dq.input[2]]) if len(dq.input) > 2 and dq.input[2] else None
                packed = pack_nbits(numpy_helper.to_array(codes).T, numpy_helper.to_array(inits[dq.input[1]]).T,
                               None if zp is None else zp.T, block, head_bits)
                for transpose, matmul in heads:
                    drop.add(id(transpose))
                    groups.setdefault((matmul.input[0], int(codes.dims[1]), block, head_bits), []).append(
                        (matmul, packed, None, int(codes.dims[0])))
        drop |= {id(n) for n in chain}
    replace = {}
    for (x, k, block, *bits), members in groups.items():
        first = members[0][0]
        replace[id(first)] = _matmul_nbits(x, k, block, members, new_inits, bits[0] if bits else 4, accuracy_level)
        drop |= {id(m[0]) for m in members[1:]}
    nodes = []
    for n in g.node:
        if id(n) in drop:
            continue
        nodes += replace.get(id(n), [n])
    del g.node[:]
    g.node.extend(nodes)
    used = {x for n in g.node for x in n.input}
    kept = [i for i in list(g.initializer) + new_inits if i.name in used]
    del g.initializer[:]
    g.initializer.extend(kept)
    if groups:
        use_ms_domain(model)
    return sum(len(m) for m in groups.values())


def pack_nbits(codes: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, block: int, bits: int = 4):
    """MatMulNBits' inputs from DequantizeLinear's ([K, N] codes, [K/B, N] scales and zero points), per output
    column: codes as unsigned nibbles per block (low nibble first) [N, K/B, B/2], or at 8 bits one unsigned byte
    per code [N, K/B, B]; float scales [N, K/B]; zero points [N, K/B] (signed codes shift by 8, or 128, with a zero
    point of 8, or 128: the same (q - zp) * scale)."""
    q = codes.astype(np.int16)
    zp = np.zeros(scale.shape, np.int16) if zero_point is None else zero_point.astype(np.int16)
    if codes.dtype.name in ("int4", "int8"):
        shift = 1 << (bits - 1)
        q, zp = q + shift, zp + shift
    k, n = q.shape
    if bits == 8:
        return q.T.reshape(n, k // block, block).astype(np.uint8), np.ascontiguousarray(scale.T), zp.T.astype(np.uint8)
    nib = q.T.reshape(n, k // block, block // 2, 2).astype(np.uint8)
    return (nib[..., 0] | (nib[..., 1] << 4)).astype(np.uint8), np.ascontiguousarray(scale.T), zp.T.astype(np.uint8)


def _matmul_nbits(x: str, k: int, block: int, members: list, new_inits: list, bits: int = 4,
                  accuracy_level: int = 0) -> list:
    """One MatMulNBits for the MatMuls `members` (matmul, packed, offset rows, N) that read `x`: their outputs
    concatenated along N and split back; the block offsets as blocksum(x) @ rows, added before the split."""
    from onnx import helper, numpy_helper

    base = members[0][0].name or members[0][0].output[0]
    b = np.concatenate([m[1][0] for m in members])
    scales = np.concatenate([m[1][1] for m in members])
    zp = np.concatenate([m[1][2] for m in members])
    n_total, blocks = b.shape[0], k // block
    if bits == 4:  # two zero points a byte (low nibble first); at 8 bits one a byte
        if blocks % 2:
            zp = np.concatenate([zp, np.zeros((n_total, 1), np.uint8)], axis=1)
        zp = (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)
    new_inits += [numpy_helper.from_array(b, f"{base}_nbits"), numpy_helper.from_array(scales, f"{base}_nbits_scale"),
                  numpy_helper.from_array(zp, f"{base}_nbits_zero_point")]
    outputs = [m[0].output[0] for m in members]
    joined = outputs[0] if len(members) == 1 else f"{base}_nbits_joined"
    has_offset = any(m[2] is not None for m in members)
    main = f"{base}_nbits_out" if has_offset else joined
    nodes = [helper.make_node("MatMulNBits", [x, f"{base}_nbits", f"{base}_nbits_scale", f"{base}_nbits_zero_point"],
                              [main], name=f"{base}_nbits", domain=MS_DOMAIN, K=k, N=n_total, bits=bits, block_size=block,
                              accuracy_level=accuracy_level)]
    if has_offset:
        rows = np.concatenate([m[2] if m[2] is not None else np.zeros((blocks, m[3]), np.float32) for m in members], axis=1)
        sums = np.zeros((k, blocks), np.float32)  # x @ sums: each block's sum of inputs, for x of any rank
        sums[np.arange(k), np.arange(k) // block] = 1.0
        new_inits += [numpy_helper.from_array(np.ascontiguousarray(rows, np.float32), f"{base}_offset_rows"),
                      numpy_helper.from_array(sums, f"{base}_block_sums")]
        nodes += [helper.make_node("MatMul", [x, f"{base}_block_sums"], [f"{base}_x_block_sums"], name=f"{base}_x_block_sums"),
                  helper.make_node("MatMul", [f"{base}_x_block_sums", f"{base}_offset_rows"], [f"{base}_offsets"],
                                   name=f"{base}_offsets"),
                  helper.make_node("Add", [main, f"{base}_offsets"], [joined], name=f"{base}_plus_offsets")]
    if len(members) > 1:
        new_inits.append(numpy_helper.from_array(np.array([m[3] for m in members], np.int64), f"{base}_nbits_split"))
        nodes.append(helper.make_node("Split", [joined, f"{base}_nbits_split"], outputs, name=f"{base}_nbits_split",
                                      axis=-1))
    return nodes
