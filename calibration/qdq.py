"""Quantization primitives and the Q/DQ rewrite of docs/design.md's recipe.

Targets are the linear layers: MatMuls whose second input is a 2-D constant
weight [K, N]. Normalization, softmax, embeddings and residual adds stay in
float; `lm_head` stays in float unless asked. Per target:
- the weight is stored quantized behind a DequantizeLinear: INT8 / FP8 E4M3
  per output channel (axis 1), symmetric, scale = amax / 127 or / 448;
  weight-only formats (INT4, and INT8 with `--weights-only`) block-wise along K (axis 0, `block_size`),
  scale = amax / 7 or / 127; where the block size does not divide K, the codes get zero rows to the last
  block's end and the activation as many zero columns (a Pad), as TensorRT reads the block size as K / scale
  rows;
- W8A8 (INT8, FP8): the activation gets one per-tensor scale, shared by every
  target that reads it, and a QuantizeLinear -> DequantizeLinear pair per
  target (ONNX Runtime fuses a pair into an integer MatMul only when it feeds
  that one MatMul; TensorRT takes either form);
- per-token INT8 activations (`per_token`): each row of the activation (a token) gets its own asymmetric
  uint8 scale and zero point, computed in the graph from the row's min and max (ReduceMax / ReduceMin, then a
  per-axis QuantizeLinear -> DequantizeLinear on the (tokens, K) view, the MatMul on that view and a Reshape
  back). No range is calibrated, and a token's outliers do not coarsen the others': per-tensor ranges cost
  all-MiniLM-L6-v2's embeddings 0.02-0.05 of mean cosine (0.06-0.14 at worst), a range per token 0.0014
  (0.0075; benchmarks/peers/minilm_embeddings.py).
  FP8 per token: each row's scale max|row| / 448, symmetric (zero points FP8 zeros, made by a Cast).
  ONNX Runtime runs it (runtime/ort/per_token.py: INT8 on integer kernels); TensorRT takes only constant scales;
- asymmetric INT4 blocks (`zero_points`): a float minimum per block beside its scale, llama.cpp's Q4_1 and
  Q4_K form (minimum_blocks: scale and minimum a least-squares fit to the block). The codes are signed INT4
  behind a DequantizeLinear with no zero point, c * scale; the minimum (stored as offset = minimum + 8 * scale)
  joins on the activation side, x @ (W + offsets spread over their blocks) = x @ W + blocksum(x) @ offsets (a
  Reshape and ReduceSum shared by the activation's readers, a small MatMul and an Add per layer), so ONNX
  Runtime still runs the weight as MatMulNBits. A tied head quantized with the embedding keeps uint4 codes with
  an integer zero point per block (zero_point_blocks), which its embedding Gather reads as well;
- SmoothQuant (INT8): the activation is divided per input channel by s and
  the weight rows multiplied by s (s_k = amax_x,k^a / amax_w,k^(1-a)),
  an exact rewrite that moves outliers from activations into weights.
Scales have the dtype of the tensor they quantize; zero points (but asymmetric INT4's and per-token INT8's) are zero and
typed like the quantized tensor (an int8 zero point makes ONNX Runtime fuse
the pattern into integer kernels; omitting it would mean uint8).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kvforge.errors import KvforgeError
from kvforge.onnx_graph import block_dequantized, layer_name

FORMATS = ("int8", "fp8", "int4")
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 7.0}


@dataclass
class Target:
    node: object  # the MatMul NodeProto
    layer: str  # module path, e.g. "layers.0.attn.q_proj" or "lm_head"
    weight: str  # initializer name
    activation: str  # the MatMul's first input


TIED_FROM = "kvforge: tied to "
BLOCK_OFFSETS = "kvforge: INT4 block offsets"  # the doc string of minimum_blocks' offset tables (not layers)


def untie_lm_head(model, base_dir: str = "") -> bool:
    """Give a tied vocabulary projection (MatMul over Transpose(embedding)) its own [K, N] weight, in place.

    The projection gets a transposed copy, which calibration then quantizes like any linear layer; once
    quantized, share_tied_head makes the embedding read the same codes, so the bundle stores the tensor
    once. base_dir: where the graph's external data lies (a graph loaded without it). Returns whether the graph
    changed.
    """
    from onnx import numpy_helper

    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    head = next((n for n in g.node if "logits" in n.output), None)
    while head is not None and head.op_type == "Cast":
        head = producer.get(head.input[0])
    inits = {i.name: i for i in g.initializer}
    if head is None or head.op_type != "MatMul" or head.input[1] in inits:
        return False
    transpose = producer.get(head.input[1])
    if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in inits:
        return False
    perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), [1, 0])
    embedding = numpy_helper.to_array(inits[transpose.input[0]], base_dir)
    if embedding.ndim != 2 or perm != [1, 0]:
        return False
    name = "lm_head.untied_weight"
    untied = numpy_helper.from_array(np.ascontiguousarray(embedding.T), name)
    untied.doc_string = f"{TIED_FROM}{transpose.input[0]}"  # the rewrite stores the two as one again (share_tied_head)
    g.initializer.append(untied)
    head.input[1] = name
    if not any(transpose.output[0] in n.input for n in g.node) and transpose.output[0] not in {o.name for o in g.output}:
        g.node.remove(transpose)
    return True


def find_targets(model, exclude: list[str] = (), quantize_lm_head: bool = False,
                 require_matches: bool = True, base_dir: str = "") -> tuple[list[Target], list[str]]:
    """The linear layers to quantize, and the names of those excluded (quantize_lm_head unties a tied head).

    require_matches: an exclude pattern that names no layer is an error (a typo); callers that quantize
    several graphs check that over all of them instead."""
    g = model.graph
    if quantize_lm_head:
        untie_lm_head(model, base_dir)
    inits = {i.name: i for i in g.initializer}
    patterns = []
    for p in exclude:
        try:
            patterns.append(re.compile(p))
        except re.error as e:
            raise KvforgeError(f"--exclude {p!r} is not a valid regular expression: {e}") from e
    targets, excluded, names = [], [], []
    for node in g.node:
        if node.op_type != "MatMul" or node.input[1] not in inits or len(inits[node.input[1]].dims) != 2 \
                or inits[node.input[1]].doc_string == BLOCK_OFFSETS:
            continue
        name = "lm_head" if "logits" in node.output else layer_name(node)
        names.append(name)
        router = name.endswith(".router")  # a mixture's router stays in float: a flipped choice costs a whole expert
        if (name == "lm_head" and not quantize_lm_head) or router or any(p.search(name) for p in patterns):
            excluded.append(name)
            continue
        targets.append(Target(node, name, node.input[1], node.input[0]))
    unmatched = [p.pattern for p in patterns if not any(p.search(n) for n in names)]
    if unmatched and require_matches:  # a typo would otherwise quantize what the user meant to keep
        raise KvforgeError(f"--exclude {unmatched} matches no linear layer; their names look like {names[:3]}")
    if not targets and require_matches:
        raise KvforgeError("no linear layer is left to quantize" + (f" after excluding {excluded}" if excluded else ""))
    return targets, excluded


# --- primitives (numpy) ----------------------------------------------------------
def check_weights_finite(model, targets: list[Target], base_dir: str = "") -> None:
    """A NaN or inf weight would quietly become a scale of 1 or inf (or NaN codes); name the layer instead."""
    from onnx import numpy_helper

    inits = {i.name: i for i in model.graph.initializer}
    for t in targets:
        w = numpy_helper.to_array(inits[t.weight], base_dir)
        bad = int(w.size - np.count_nonzero(np.isfinite(w)))
        if bad:
            raise KvforgeError(f"layer {t.layer}'s weight holds {bad} NaN or infinite values: the float bundle is broken; "
                               "re-export it from a sound checkpoint")


def stored_scale(scale, dtype=np.float32) -> np.ndarray:
    """A scale as the graph stores it: in the model dtype, and at least that dtype's smallest normal number.

    In float16 a scale under ~6e-5 would lose precision as a subnormal, or flush to 0 (which TensorRT
    refuses); a larger scale only means smaller codes for values that small.
    """
    return np.maximum(np.asarray(scale, np.float32), np.finfo(dtype).tiny).astype(dtype)


def weight_scales(w: np.ndarray, fmt: str, block_size: int | None = None, dtype=np.float32) -> np.ndarray:
    """Symmetric scales of a [K, N] weight: per output channel [N], or per block [ceil(K/B), N] given a block size
    (the weight-only formats).

    float32, with values the model dtype `dtype` stores exactly (stored_scale), so codes round against
    the scale the graph will hold.
    """
    a = np.abs(w.astype(np.float32))
    if block_size:
        K = w.shape[0]
        blocks = -(-K // block_size)
        padded = np.zeros((blocks * block_size, w.shape[1]), np.float32)
        padded[:K] = a
        amax = padded.reshape(blocks, block_size, -1).max(axis=1)
    else:
        amax = a.max(axis=0)
    return stored_scale(np.where(amax > 0, amax / QMAX[fmt], 1.0), dtype).astype(np.float32)


# the range shrinks an asymmetric INT4 block's search tries at each end (zero_point_blocks)
SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def zero_point_blocks(w: np.ndarray, block_size: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric INT4 blocks of a [K, N] weight: (scales [ceil(K/B), N] float32, exact in `dtype`; zero points
    [ceil(K/B), N] uint8 in [0, 15]), codes q in [0, 15] standing for (q - z) * scale, as llama.cpp's Q4_1 and
    AWQ's blocks (with a code for zero: ONNX's zero point is an integer).

    Each block's range [lo, hi] (lo <= 0 <= hi) is the one, of its min and max each shrunk by SHRINKS, whose
    rounding leaves the smallest squared error on the block (an outlier may be clipped so the rest round finer)."""
    K, N = w.shape
    blocks = -(-K // block_size)
    padded = np.zeros((blocks * block_size, N), np.float32)
    padded[:K] = w
    b = padded.reshape(blocks, block_size, N)
    lo0, hi0 = np.minimum(b.min(axis=1), 0), np.maximum(b.max(axis=1), 0)
    best = None
    for f_lo in SHRINKS:
        for f_hi in SHRINKS:
            span = hi0 * f_hi - lo0 * f_lo
            scale = stored_scale(np.where(span > 0, span / 15, 1.0), dtype).astype(np.float32)
            zp = np.clip(np.rint(-lo0 * f_lo / scale), 0, 15)
            q = np.clip(np.rint(b / scale[:, None]) + zp[:, None], 0, 15)
            best = _per_block_best(best, (((q - zp[:, None]) * scale[:, None] - b) ** 2).sum(axis=1), scale, zp)
    _, best_scale, best_zp = best
    return best_scale, best_zp.astype(np.uint8)


def _per_block_best(best: tuple | None, err: np.ndarray, *values: np.ndarray) -> tuple:
    """(error, *values) per block: this candidate's where its error is smaller than `best`'s (None: the first)."""
    if best is None:
        return (err, *values)
    better = err < best[0]
    return (np.where(better, err, best[0]), *(np.where(better, v, kept) for v, kept in zip(values, best[1:])))


# where an INT4 block's least-squares fit of its scale and minimum starts (minimum_blocks): its [min, max] range,
# each end moved inwards by (1 - f) / 2 of the span; and how many times it rounds and refits from there
MINIMUM_STARTS = (1.0, 0.9, 0.8)
FIT_STEPS = 4


def minimum_blocks(w: np.ndarray, block_size: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric INT4 blocks of a [K, N] weight with a float minimum each, llama.cpp's Q4_1 and Q4_K form:
    (scales, offsets), each [ceil(K/B), N] and exact in `dtype`; signed codes c in [-8, 7] stand for
    c * scale + offset (offset = the block's minimum + 8 * scale).

    Each block's pair is a least-squares fit: from its range (each end moved in by MINIMUM_STARTS), the codes are
    rounded and (scale, offset) refit to them FIT_STEPS times; the start that ends with the smallest squared error
    on the block is kept. A weight that was itself Q4_1 or Q4_K blocks of this size comes back on its own grid."""
    K, N = w.shape
    blocks = -(-K // block_size)
    padded = np.zeros((blocks * block_size, N), np.float32)
    padded[:K] = w
    b = padded.reshape(blocks, block_size, N)
    mask = (np.arange(blocks * block_size) < K).astype(np.float32).reshape(blocks, block_size, 1)
    count = mask.sum(axis=1)  # [blocks, 1]: a last block cut short fits its real rows only
    big = np.float32(np.finfo(np.float32).max)
    lo0, hi0 = np.where(mask > 0, b, big).min(axis=1), np.where(mask > 0, b, -big).max(axis=1)
    span0 = hi0 - lo0
    mean_b = (b * mask).sum(axis=1) / count
    tiny = np.finfo(dtype).tiny

    def rounded(scale, offset):
        return np.clip(np.rint((b - offset[:, None]) / scale[:, None]), -8, 7)

    best = None
    for f_lo in MINIMUM_STARTS:
        for f_hi in MINIMUM_STARTS:
            lo = lo0 + (1 - f_lo) / 2 * span0
            scale = np.maximum((hi0 - (1 - f_hi) / 2 * span0 - lo) / 15, tiny)
            offset = lo + 8 * scale
            for _ in range(FIT_STEPS):
                c = rounded(scale, offset)
                mean_c = (c * mask).sum(axis=1) / count
                dc = (c - mean_c[:, None]) * mask
                var, cov = (dc * dc).sum(axis=1), (dc * (b - mean_b[:, None])).sum(axis=1)
                fit = (var > 0) & (cov > 0)
                scale = np.where(fit, cov / np.where(fit, var, 1), scale)
                offset = mean_b - scale * mean_c
            scale = stored_scale(scale, dtype).astype(np.float32)
            offset = offset.astype(dtype).astype(np.float32)
            err = ((((rounded(scale, offset) * scale[:, None] + offset[:, None]) - b) ** 2) * mask).sum(axis=1)
            best = _per_block_best(best, err, scale, offset)
    return best[1], best[2]


def quantize(x: np.ndarray, scale: np.ndarray, fmt: str, block_size: int | None = None,
             zero_point: np.ndarray | None = None, offset: np.ndarray | None = None) -> np.ndarray:
    """ONNX QuantizeLinear semantics (round half to even, saturate); `scale` per output channel [N] or per block of
    `block_size` rows [ceil(K/B), N]; zero point 0, or INT4's `zero_point` (shaped like scale: uint4 codes), or
    INT4's float `offset` (shaped like scale: minimum_blocks' signed codes of x - offset)."""
    import ml_dtypes

    if np.ndim(scale) == 2:
        scale = np.repeat(scale, block_size, axis=0)[: x.shape[0]]
    if offset is not None:
        x = x - np.repeat(offset, block_size, axis=0)[: x.shape[0]]
    y = x.astype(np.float32) / scale
    if zero_point is not None:
        if np.ndim(zero_point) == 2:
            zero_point = np.repeat(zero_point, block_size, axis=0)[: x.shape[0]]
        return np.clip(np.rint(y) + zero_point, 0, 15).astype(ml_dtypes.uint4)
    if fmt == "int8":
        return np.clip(np.rint(y), -128, 127).astype(np.int8)
    if fmt == "int4":
        return np.clip(np.rint(y), -8, 7).astype(ml_dtypes.int4)
    return np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn)


def dequantize(q: np.ndarray, scale: np.ndarray, fmt: str, block_size: int | None = None,
               zero_point: np.ndarray | None = None, offset: np.ndarray | None = None) -> np.ndarray:
    if np.ndim(scale) == 2:  # blocks along K (axis 0 of a [K, N] weight)
        w = block_dequantized(q, scale, block_size, 0, zero_point)
        return w if offset is None else w + np.repeat(np.asarray(offset, np.float32), block_size, axis=0)[: q.shape[0]]
    if zero_point is not None:
        return (q.astype(np.float32) - zero_point) * scale
    return q.astype(np.float32) * scale


def dequantized_rows(x: np.ndarray, fmt: str, dtype=np.float32) -> np.ndarray:
    """What the per-token Q/DQ pair (_QdqEdit.activation_per_token) makes of x's rows (..., K), in float32: INT8
    asymmetric uint8 over [min(row, 0), max(row, 0)], FP8 E4M3 symmetric over max|row|; scales in `dtype`."""
    import ml_dtypes

    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    tiny = np.finfo(dtype).tiny
    if fmt == "fp8":
        scale = np.maximum((np.abs(rows).max(1) * np.float32(1 / 448)).astype(dtype), tiny).astype(np.float32)[:, None]
        q = np.clip(rows / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        return (q * scale).reshape(x.shape)
    lo, hi = np.minimum(rows.min(1), 0), np.maximum(rows.max(1), 0)
    scale = np.maximum(((hi - lo) * np.float32(1 / 255)).astype(dtype), tiny).astype(np.float32)
    zp = np.clip(np.rint(-lo / scale), 0, 255)
    q = np.clip(np.rint(rows / scale[:, None]) + zp[:, None], 0, 255)
    return ((q - zp[:, None]) * scale[:, None]).reshape(x.shape)


def smoothquant_factors(act_amax: np.ndarray, weight: np.ndarray, alpha: float) -> np.ndarray:
    """s_k = amax_x,k^alpha / amax_w,k^(1 - alpha), over the input channels k of a [K, N] weight."""
    w_amax = np.abs(weight).max(axis=1)
    s = np.power(np.maximum(act_amax, 1e-5), alpha) / np.power(np.maximum(w_amax, 1e-5), 1 - alpha)
    return np.clip(s, 1e-4, 1e4).astype(np.float32)


def digest(a: np.ndarray) -> dict:
    """A block-wise weight's scales (offsets, zero points) for the manifest: their shape, range and the sha256 of
    the array's bytes as the graph stores them (every block's value would make the manifest as large as the
    scales: 150 MB for Gemma 3 270M's INT4)."""
    import hashlib

    a = np.ascontiguousarray(a)
    return {"shape": list(a.shape), "dtype": str(a.dtype), "min": float(a.min()), "max": float(a.max()),
            "sha256": hashlib.sha256(a.tobytes()).hexdigest()}


def recorded(scale: np.ndarray) -> list:
    """Scales for the manifest: each the shortest decimal that reads back as the float32 the graph stores."""
    a = np.asarray(scale, np.float32)
    return np.array([float(str(v)) for v in a.ravel()], np.float64).reshape(a.shape).tolist()


# --- the graph rewrite -------------------------------------------------------------
def rewrite(model, targets: list[Target], fmt: str, act_amax: dict[str, float] | None, block_size: int | None,
            smooth: dict[str, np.ndarray] | None, float_dtype: np.dtype, round_weight=None, base_dir: str = "",
            progress=None, per_token: bool = False, zero_points: bool = False) -> dict:
    """Quantize the targets' weights in place and insert activation Q/DQ; returns the scales used.

    act_amax: each activation's calibrated range (W8A8 with static scales), or None: weight-only; per_token: INT8
    activations scaled per row at run time (act_amax is not read; smooth, SmoothQuant's factors, is).

    zero_points: INT4 blocks asymmetric (a float minimum per block: minimum_blocks; a tied head, zero_point_blocks;
    the form kvforge runs on ONNX Runtime).

    round_weight(target, w) -> (codes, scales[, offsets]) replaces round-to-nearest (GPTQ); `w` is already smoothed,
    and the scales it returns must be exact in `float_dtype` (weight_scales(..., dtype=float_dtype)). base_dir:
    where the graph's external data lies, for a graph loaded without it: each weight is read when it is quantized,
    and the weights that stay float stay where they are. progress(done, total): after each target's weight.
    """
    edit = _QdqEdit(model, fmt, block_size, smooth, float_dtype, base_dir, zero_points)
    for i, t in enumerate(targets, 1):
        edit.weight(t, round_weight)
        if per_token:
            edit.activation_per_token(t)
        elif act_amax is not None:  # W8A8; weight-only formats stop at the weight
            edit.activation(t, act_amax[t.activation])
        if progress is not None:
            progress(i, len(targets))
    edit.splice()
    inits = edit.inits
    tied = [(t, inits[t.weight].doc_string[len(TIED_FROM):]) for t in targets
            if inits[t.weight].doc_string.startswith(TIED_FROM)]
    for t, embedding in tied:
        share_tied_head(model, t, embedding, fmt, block_size, smooth.get(t.activation) if smooth else None)
        edit.record["weights"][t.layer]["shared_with_embedding"] = embedding
    return edit.record


class _QdqEdit:
    """One Q/DQ rewrite of a graph in progress: new initializers go in at once, new nodes are collected per
    target node and spliced in before it at the end (so node indices stay valid while targets are visited)."""

    def __init__(self, model, fmt: str, block_size: int | None, smooth: dict[str, np.ndarray] | None, float_dtype,
                 base_dir: str = "", zero_points: bool = False):
        from onnx import TensorProto

        self.g = model.graph
        self.inits = {i.name: i for i in self.g.initializer}
        self.fmt, self.block_size, self.smooth, self.float_dtype = fmt, block_size, smooth, float_dtype
        self.zero_points = zero_points  # INT4 blocks asymmetric (minimum_blocks), ONNX Runtime's form
        self.base_dir = base_dir
        self.q_type = {"int8": TensorProto.INT8, "fp8": TensorProto.FLOAT8E4M3FN, "int4": TensorProto.INT4}[fmt]
        self.new_nodes: dict[int, list] = {}  # node index -> nodes to insert before it
        self.after_nodes: dict[int, list] = {}  # node index -> nodes to insert after it
        self.opset = next((i.version for i in model.opset_import if i.domain in ("", "ai.onnx")), 0)
        # a reshape target whose 0 is a length, not "copy the input's axis" (ONNX's default): a mixture's expert
        # that no token chose reads (1, 0, K) and its rows (0, K) go back to (1, 0, N). allowzero came in opset 14
        self.zero_is_zero = {"allowzero": 1} if self.opset >= 14 else {}
        self.index = {id(n): i for i, n in enumerate(self.g.node)}
        self.record = {"weights": {}, "activations": {}}
        self.shared: dict[str, tuple[str, str]] = {}  # activation -> (its scale's prefix, the tensor consumers read)
        self.padded: dict[str, str] = {}  # block-wise: activation -> its copy padded to whole blocks along K
        self.block_sums: dict[str, str] = {}  # minimum_blocks: the MatMul input -> its blocks' sums

    def before(self, t: Target, *nodes) -> None:
        self.new_nodes.setdefault(self.index[id(t.node)], []).extend(nodes)

    def weight(self, t: Target, round_weight) -> None:
        """The target's weight stored quantized behind a DequantizeLinear (block-wise: K padded to whole blocks)."""
        from onnx import helper, numpy_helper

        g, fmt, block_size = self.g, self.fmt, self.block_size
        w = numpy_helper.to_array(self.inits[t.weight], self.base_dir).astype(np.float32)
        if self.smooth and t.activation in self.smooth:
            w = w * self.smooth[t.activation][:, None]  # W' = diag(s) W
        zp = offset = None
        # a tied head's codes are also its embedding's rows (share_tied_head): integer zero points, read by both
        tied = self.zero_points and self.inits[t.weight].doc_string.startswith(TIED_FROM)
        if round_weight is not None and not tied:
            q, scale, *offset = round_weight(t, w)
            offset = offset[0] if offset else None
        elif tied:
            scale, zp = zero_point_blocks(w, block_size, self.float_dtype)
            q = quantize(w, scale, fmt, block_size, zp)
        elif self.zero_points:
            scale, offset = minimum_blocks(w, block_size, self.float_dtype)
            q = quantize(w, scale, fmt, block_size, offset=offset)
        else:
            scale = weight_scales(w, fmt, block_size, self.float_dtype)
            q = quantize(w, scale, fmt, block_size)
        k_padding = -w.shape[0] % block_size if block_size else 0
        if k_padding:
            # TensorRT reads the block size as K / scale rows, so every block must be whole: the codes
            # get zero rows up to the last block's end (its zero point where it has one: the value 0), and the
            # activation as many zero columns.
            pad = np.broadcast_to(zp[-1:] if zp is not None else np.zeros((1, q.shape[1])), (k_padding, q.shape[1]))
            q = np.concatenate([q, pad.astype(q.dtype)])
            if t.activation not in self.padded:
                pads = f"{t.layer}.input_pads"
                g.initializer.append(numpy_helper.from_array(np.array([0, k_padding], np.int64), pads))
                if "input_pad_axes" not in self.inits and not self.padded:  # the first padded activation (of any
                    # rewrite of this graph) adds the axes initializer they all share
                    g.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), "input_pad_axes"))
                self.padded[t.activation] = f"{t.layer}.input_padded"
                self.before(t, helper.make_node("Pad", [t.activation, pads, "", "input_pad_axes"],
                                                [self.padded[t.activation]], name=f"{t.layer}.input_pad"))
            t.node.input[0] = self.padded[t.activation]
        base = f"{t.layer}.weight"
        q_name, s_name, z_name = f"{base}_quantized", f"{base}_scale", f"{base}_zero_point"
        g.initializer.remove(self.inits[t.weight])
        g.initializer.append(numpy_helper.from_array(q, q_name))
        g.initializer.append(numpy_helper.from_array(scale.astype(self.float_dtype), s_name))
        dq_inputs = [q_name, s_name]
        attrs = {"axis": 0, "block_size": block_size} if block_size else {"axis": 1}
        if zp is not None:  # asymmetric INT4 blocks: uint4 codes and zero points
            import ml_dtypes

            g.initializer.append(numpy_helper.from_array(zp.astype(ml_dtypes.uint4), z_name))
            dq_inputs.append(z_name)
        if not block_size:
            zp = np.zeros(scale.shape, np.int8) if fmt == "int8" else None
            g.initializer.append(
                numpy_helper.from_array(zp, z_name) if zp is not None
                else helper.make_tensor(z_name, self.q_type, list(scale.shape), [0.0] * scale.size)
            )
            dq_inputs.append(z_name)
        self.before(t, helper.make_node("DequantizeLinear", dq_inputs, [f"{base}_dequantized"], name=f"{base}_dq",
                                        **attrs))
        t.node.input[1] = f"{base}_dequantized"
        if offset is not None:
            self.block_offsets(t, offset, -(-w.shape[0] // block_size), block_size)
        # per channel: the scales themselves; per block (ceil(K/B) x N of them): a digest of the stored tensors
        summary = digest if block_size else recorded
        self.record["weights"][t.layer] = {"shape": list(w.shape), "scale": summary(scale.astype(self.float_dtype)),
                                           **({"zero_point": digest(zp.astype(np.uint8))} if zp is not None else {}),
                                           **({"offset": digest(offset.astype(self.float_dtype))}
                                              if offset is not None else {}),
                                           **({"k_padding": k_padding} if k_padding else {})}

    def block_offsets(self, t: Target, offset: np.ndarray, blocks: int, block_size: int) -> None:
        """The blocks' offsets on the activation side: the target's output plus blocksum(x) @ offset, x its input
        (padded to whole blocks where it is); the block sums (a Reshape to [..., blocks, B] and a ReduceSum) are
        shared by the activation's readers."""
        from onnx import helper, numpy_helper

        g, x = self.g, t.node.input[0]
        if x not in self.block_sums:
            p = f"{t.layer}.input_blocks"
            g.initializer.extend([numpy_helper.from_array(np.array([0], np.int64), p + "_lead_start"),
                                  numpy_helper.from_array(np.array([-1], np.int64), p + "_lead_end"),
                                  numpy_helper.from_array(np.array([blocks, block_size], np.int64), p + "_block_shape"),
                                  numpy_helper.from_array(np.array([-1], np.int64), p + "_axes")])
            self.before(t,
                        helper.make_node("Shape", [x], [p + "_shape"], name=p + "_shape"),
                        helper.make_node("Slice", [p + "_shape", p + "_lead_start", p + "_lead_end"], [p + "_lead"],
                                         name=p + "_lead"),
                        helper.make_node("Concat", [p + "_lead", p + "_block_shape"], [p + "_blocked_shape"],
                                         name=p + "_blocked_shape", axis=0),
                        helper.make_node("Reshape", [x, p + "_blocked_shape"], [p + "_blocked"], name=p + "_blocked"),
                        helper.make_node("ReduceSum", [p + "_blocked", p + "_axes"], [p + "_sums"], name=p + "_sums",
                                         keepdims=0))
            self.block_sums[x] = p + "_sums"
        base, out = f"{t.layer}.weight", t.node.output[0]
        table = numpy_helper.from_array(offset.astype(self.float_dtype), f"{base}_offset")
        table.doc_string = BLOCK_OFFSETS  # not a layer: find_targets passes it by
        g.initializer.append(table)
        t.node.output[0] = f"{t.layer}.output_without_offsets"
        self.after_nodes.setdefault(self.index[id(t.node)], []).extend([
            helper.make_node("MatMul", [self.block_sums[x], f"{base}_offset"], [f"{base}_offsets"],
                             name=f"{base}_offsets"),
            helper.make_node("Add", [t.node.output[0], f"{base}_offsets"], [out], name=f"{base}_plus_offsets")])

    def smoothed(self, t: Target, prefix: str) -> str:
        """The target's input divided by SmoothQuant's factors (a Mul by 1/s) where it has them, else the input."""
        from onnx import helper, numpy_helper

        act = t.activation
        if not (self.smooth and act in self.smooth):
            return act
        self.g.initializer.append(numpy_helper.from_array((1.0 / self.smooth[act]).astype(self.float_dtype),
                                                          f"{prefix}_smooth"))
        self.before(t, helper.make_node("Mul", [act, f"{prefix}_smooth"], [f"{prefix}_smoothed"], name=f"{prefix}_smooth"))
        return f"{prefix}_smoothed"

    def activation(self, t: Target, amax: float) -> None:
        """A QuantizeLinear -> DequantizeLinear pair on the target's input, its scale shared per activation."""
        from onnx import helper, numpy_helper

        g = self.g
        if t.activation not in self.shared:  # one scale (and smoothing) per activation, shared by its consumers
            prefix = f"{t.layer}.input"
            act = self.smoothed(t, prefix)
            a_scale = stored_scale(max(amax, 1e-8) / QMAX[self.fmt], self.float_dtype)
            g.initializer.append(numpy_helper.from_array(a_scale, f"{prefix}_scale"))
            g.initializer.append(
                numpy_helper.from_array(np.array(0, np.int8), f"{prefix}_zero_point") if self.fmt == "int8"
                else helper.make_tensor(f"{prefix}_zero_point", self.q_type, [], [0.0])
            )
            self.shared[t.activation] = (prefix, act)
            self.record["activations"][t.layer + ".input"] = {"tensor": t.activation, "amax": float(amax),
                                                              "scale": float(a_scale)}
        # ... and a QuantizeLinear -> DequantizeLinear pair per consumer: ONNX Runtime fuses a
        # Q/DQ/MatMul group into an integer kernel only when the pair feeds that one MatMul.
        prefix, act = self.shared[t.activation]
        scale, zp, mine = f"{prefix}_scale", f"{prefix}_zero_point", f"{t.layer}.input"
        self.before(t,
                    helper.make_node("QuantizeLinear", [act, scale, zp], [f"{mine}_quantized"], name=f"{mine}_q"),
                    helper.make_node("DequantizeLinear", [f"{mine}_quantized", scale, zp], [f"{mine}_dequantized"],
                                     name=f"{mine}_dq"))
        t.node.input[0] = f"{mine}_dequantized"

    def activation_per_token(self, t: Target) -> None:
        """The target's input quantized per row (a token) at run time: one QuantizeLinear -> DequantizeLinear pair
        (axis 0) on its (tokens, K) view, shared by the activation's consumers, with the row's scale (and zero
        point) computed in the graph (_row_scales). The MatMul reads that view, and its output is reshaped back to
        the activation's leading dimensions."""
        from onnx import helper, numpy_helper

        g = self.g
        k, n = (int(d) for d in self.record["weights"][t.layer]["shape"])
        if t.activation not in self.shared:
            p = f"{t.layer}.input"
            act = self.smoothed(t, p)  # SmoothQuant: x / s, its rows then quantized (W' = diag(s) W)
            g.initializer.extend([numpy_helper.from_array(np.array([-1, k], np.int64), p + "_rows_shape"),
                                  numpy_helper.from_array(np.array([0], np.int64), p + "_lead_start"),
                                  numpy_helper.from_array(np.array([-1], np.int64), p + "_lead_end")])
            rows = f"{p}_rows"
            self.before(t, helper.make_node("Reshape", [act, p + "_rows_shape"], [rows], name=f"{p}_rows"))
            scale, zp = self._row_scales(t, p, rows)
            self.before(t,
                        helper.make_node("QuantizeLinear", [rows, scale, zp], [p + "_quantized"], name=f"{p}_q", axis=0),
                        helper.make_node("DequantizeLinear", [p + "_quantized", scale, zp], [p + "_dequantized"],
                                         name=f"{p}_dq", axis=0),
                        helper.make_node("Shape", [act], [p + "_shape"], name=f"{p}_shape"),
                        helper.make_node("Slice", [p + "_shape", p + "_lead_start", p + "_lead_end"], [p + "_lead"],
                                         name=f"{p}_lead"))
            self.shared[t.activation] = (p, p + "_dequantized")
            self.record["activations"][t.layer + ".input"] = {"tensor": t.activation, "scale": "per-token dynamic"}
        prefix, rows_dq = self.shared[t.activation]
        out, mine = t.node.output[0], f"{t.layer}.output"
        g.initializer.append(numpy_helper.from_array(np.array([n], np.int64), f"{mine}_width"))
        t.node.input[0] = rows_dq
        t.node.output[0] = f"{mine}_rows"
        self.after_nodes.setdefault(self.index[id(t.node)], []).extend([
            helper.make_node("Concat", [f"{prefix}_lead", f"{mine}_width"], [f"{mine}_shape"], axis=0),
            helper.make_node("Reshape", [f"{mine}_rows", f"{mine}_shape"], [out], name=f"{mine}_reshape",
                             **self.zero_is_zero)])

    def _row_scales(self, t: Target, p: str, rows: str) -> tuple[str, str]:
        """Nodes computing each row's scale and zero point (names returned). INT8: asymmetric uint8, the row's min
        and max (each widened to include 0) give scale (max - min) / 255 and zero point round(-min / scale). FP8:
        symmetric E4M3, scale max|row| / 448 and a zero zero point (typed FP8: made by a Cast, one per row)."""
        from onnx import TensorProto, helper, numpy_helper

        dt = self.float_dtype
        fp8 = self.fmt == "fp8"
        consts = {"_zero": np.array(0, dt), "_tiny": np.array(np.finfo(dt).tiny, dt),
                  "_inv_levels": np.array(1 / (448 if fp8 else 255), dt)}
        if not fp8:
            consts["_levels"] = np.array(255, dt)
        self.g.initializer.extend(numpy_helper.from_array(v, p + name) for name, v in consts.items())
        if self.opset >= 18:  # axes became an input in opset 18
            self.g.initializer.append(numpy_helper.from_array(np.array([1], np.int64), f"{p}_axes"))
            reduce = lambda op, x, out: helper.make_node(op, [x, f"{p}_axes"], [out], keepdims=0)  # noqa: E731
        else:
            reduce = lambda op, x, out: helper.make_node(op, [x], [out], axes=[1], keepdims=0)  # noqa: E731
        if fp8:
            self.before(t,
                        helper.make_node("Abs", [rows], [p + "_rows_abs"]),
                        reduce("ReduceMax", p + "_rows_abs", p + "_row_amax"),
                        helper.make_node("Mul", [p + "_row_amax", p + "_inv_levels"], [p + "_row_scale_raw"]),
                        helper.make_node("Max", [p + "_row_scale_raw", p + "_tiny"], [p + "_row_scale"]),
                        helper.make_node("Mul", [p + "_row_scale", p + "_zero"], [p + "_row_zp_float"]),
                        helper.make_node("Cast", [p + "_row_zp_float"], [p + "_row_zero_point"],
                                         to=TensorProto.FLOAT8E4M3FN))
            return p + "_row_scale", p + "_row_zero_point"
        lo, hi = f"{p}_row_min", f"{p}_row_max"
        self.before(t,
                    reduce("ReduceMin", rows, lo + "_raw"), reduce("ReduceMax", rows, hi + "_raw"),
                    helper.make_node("Min", [lo + "_raw", p + "_zero"], [lo]),
                    helper.make_node("Max", [hi + "_raw", p + "_zero"], [hi]),
                    helper.make_node("Sub", [hi, lo], [p + "_row_range"]),
                    helper.make_node("Mul", [p + "_row_range", p + "_inv_levels"], [p + "_row_scale_raw"]),
                    helper.make_node("Max", [p + "_row_scale_raw", p + "_tiny"], [p + "_row_scale"]),
                    helper.make_node("Div", [lo, p + "_row_scale"], [p + "_row_min_steps"]),
                    helper.make_node("Neg", [p + "_row_min_steps"], [p + "_row_zp_raw"]),
                    helper.make_node("Round", [p + "_row_zp_raw"], [p + "_row_zp_rounded"]),
                    helper.make_node("Clip", [p + "_row_zp_rounded", p + "_zero", p + "_levels"], [p + "_row_zp_float"]),
                    helper.make_node("Cast", [p + "_row_zp_float"], [p + "_row_zero_point"], to=TensorProto.UINT8))
        return p + "_row_scale", p + "_row_zero_point"

    def splice(self) -> None:
        """Every collected node in, before the node it feeds (or after the node it reads)."""
        nodes = []
        for i, n in enumerate(self.g.node):
            nodes += self.new_nodes.get(i, [])
            nodes.append(n)
            nodes += self.after_nodes.get(i, [])
        del self.g.node[:]
        self.g.node.extend(nodes)


def share_tied_head(model, head: Target, embedding: str, fmt: str, block_size: int | None,
                    smoothing: np.ndarray | None = None) -> None:
    """Store a tied embedding and its quantized head once: the codes in the embedding's [N, K] layout.

    The head reads Transpose(DequantizeLinear(codes)) and the embedding Gather reads the same
    DequantizeLinear (without the zero rows block-wise codes pad K with), so the embedding takes the head's
    quantization too. SmoothQuant folded diag(s) into the head's rows of K; the embedding's rows are
    divided by s after the Gather. ONNX Runtime's variant gives each its fast form again at load
    (runtime/ort/variant.py); the bundle holds one tensor.
    """
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    base = f"{head.layer}.weight"
    codes = numpy_helper.to_array(inits[f"{base}_quantized"])  # [K', N]
    scale = numpy_helper.to_array(inits[f"{base}_scale"])  # [N], or [K'/B, N] block-wise
    block_zp = numpy_helper.to_array(inits[f"{base}_zero_point"]) if block_size and f"{base}_zero_point" in inits \
        else None  # asymmetric INT4 blocks' zero points [K'/B, N]
    emb = inits[embedding]
    n_vocab, k = emb.dims
    name = "model.embed_and_lm_head.weight"
    for suffix in ("_quantized", "_scale", "_zero_point"):
        if f"{base}{suffix}" in inits:
            g.initializer.remove(inits[f"{base}{suffix}"])
    g.initializer.remove(emb)
    shared = [numpy_helper.from_array(np.ascontiguousarray(codes.T), f"{name}_quantized"),
              numpy_helper.from_array(np.ascontiguousarray(scale.T) if scale.ndim == 2 else scale, f"{name}_scale")]
    dq_inputs = [f"{name}_quantized", f"{name}_scale"]
    if block_zp is not None:
        shared.append(numpy_helper.from_array(np.ascontiguousarray(block_zp.T), f"{name}_zero_point"))
        dq_inputs.append(f"{name}_zero_point")
    if not block_size:
        zp = helper.make_tensor(f"{name}_zero_point", shared[0].data_type, [n_vocab], np.zeros(n_vocab).tolist()) \
            if fmt == "fp8" else numpy_helper.from_array(np.zeros(n_vocab, np.int8), f"{name}_zero_point")
        shared.append(zp)
        dq_inputs.append(f"{name}_zero_point")
    g.initializer.extend(shared)
    attrs = {"axis": 1, "block_size": block_size} if block_size else {"axis": 0}  # per vocab row, or blocks along K
    old_dq = next(n for n in g.node if n.op_type == "DequantizeLinear" and n.output[0] == f"{base}_dequantized")
    readers = [i for i, n in enumerate(g.node) if n is old_dq or (n.op_type == "Gather" and n.input[0] == embedding)]
    index = min(readers)  # before the first reader: the embedding Gather comes first
    g.node.remove(old_dq)
    nodes = [
        helper.make_node("DequantizeLinear", dq_inputs, [f"{name}_dequantized"], name=f"{name}_dq", **attrs),
        helper.make_node("Transpose", [f"{name}_dequantized"], [f"{base}_dequantized"], name=f"{base}_transpose", perm=[1, 0]),
    ]
    table = f"{name}_dequantized"
    if codes.shape[0] != k:  # the zero rows that complete K's last block: not part of the embedding
        g.initializer.extend([numpy_helper.from_array(np.array([0], np.int64), f"{name}_start"),
                              numpy_helper.from_array(np.array([k], np.int64), f"{name}_end"),
                              numpy_helper.from_array(np.array([1], np.int64), f"{name}_axis")])
        nodes.append(helper.make_node("Slice", [table, f"{name}_start", f"{name}_end", f"{name}_axis"], [f"{name}_rows"],
                                      name=f"{name}_unpad"))
        table = f"{name}_rows"
    for offset, node in enumerate(nodes):
        g.node.insert(index + offset, node)
    gathers = [node for node in g.node if node.op_type == "Gather" and node.input[0] == embedding]
    if smoothing is not None:
        g.initializer.append(numpy_helper.from_array((1.0 / smoothing).astype(scale.dtype), f"{name}_unsmooth"))
    for node in gathers:
        node.input[0] = table
        if smoothing is not None:  # the rows hold W^T diag(s): the embedding is each row / s
            rows, node.output[0] = node.output[0], f"{node.output[0]}_smoothed"
            g.node.insert(list(g.node).index(node) + 1, helper.make_node(
                "Mul", [node.output[0], f"{name}_unsmooth"], [rows], name=f"{node.name}_unsmooth"))


def add_kv_cache_qdq(model, present_amax: dict[str, float], float_dtype) -> dict:
    """FP8 KV cache: quantize each cache write (the new K/V entering the `present` Concat).

    Per-tensor E4M3 scales from the calibrated amax of each present tensor.
    The cache then only ever holds FP8-representable values (past entries
    were written the same way), so it can be stored in FP8 losslessly.
    """
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    inserted, record = [], {}
    for name, amax in present_amax.items():
        concat = producer.get(name)
        if concat is not None and concat.op_type == "Slice":  # a capped (windowed) cache keeps the Concat's newest W
            concat = producer.get(concat.input[0])
        if concat is None or concat.op_type != "Concat" or len(concat.input) != 2:
            raise KvforgeError(f"cannot find the cache write of {name} (expected Concat(past, new))")
        scale = stored_scale(max(amax, 1e-8) / QMAX["fp8"], float_dtype)
        g.initializer.append(numpy_helper.from_array(scale, f"{name}.kv_scale"))
        g.initializer.append(helper.make_tensor(f"{name}.kv_zero_point", TensorProto.FLOAT8E4M3FN, [], [0.0]))
        new = concat.input[1]
        q = helper.make_node("QuantizeLinear", [new, f"{name}.kv_scale", f"{name}.kv_zero_point"], [f"{name}.kv_quantized"], name=f"{name}.kv_q")
        dq = helper.make_node("DequantizeLinear", [f"{name}.kv_quantized", f"{name}.kv_scale", f"{name}.kv_zero_point"],
                              [f"{name}.kv_dequantized"], name=f"{name}.kv_dq")
        concat.input[1] = f"{name}.kv_dequantized"
        inserted.append((concat, [q, dq]))
        record[name] = {"amax": float(amax), "scale": float(scale)}
    nodes = []
    targets = {id(c): qdq for c, qdq in inserted}
    for n in g.node:
        nodes += targets.get(id(n), [])
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    return record
