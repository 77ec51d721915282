"""What validation feeds the graph and the references: inputs from the model's own distribution, and an FP64 reference.

Token ids are real ones (a tokenizer's encoding of text, when the caller has one) or sampled from the
reference itself (short documents packed end to end, as pretraining packs them); a past cache is the
reference's own `present` from a prefill of such ids, never random values: uniform random K/V are far from
what real weights produce (their activations have outlier channels), and a real model fed them amplifies
FP32 rounding well past what it shows on real inputs.

The FP64 reference is a float64 copy of the model run under `float64_mode()`: the model computes its norms,
softmax, RoPE angles and logits "in float32" (x.float()), which inside the mode means float64, so the copy
is float64 throughout (a plain .double() copy would keep those steps in FP32: on tiny that leaves it 1.2e-6
from true FP64, a third of the FP32 reference's own 3.5e-6) and carries FP64 rounding only (2^-53 per op).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.overrides import TorchFunctionMode

from kvforge.metrics import row_slices
from kvforge.model_defs.checkpoint import is_tiny_tokenizer
from kvforge.model_defs.moe import Router
from kvforge.model_defs.weights import copy_in
from kvforge.texts import builtin_prose

from .onnx_export import FlatKVModel

_F32, _F64 = torch.float32, torch.float64
SEGMENT = 32  # the longest sampled document: a pool row packs ceil(length / SEGMENT) of them


TEXT_CHARS = 20_000  # of real text for validation's token pool (a few thousand ids: more than any case reads)


def text_tokens(tokenizer) -> tuple[list[int] | None, str | None]:
    """Real token ids for validation and the text's name: the shipped English prose (kvforge.texts) in the
    checkpoint's own tokenizer. (None, None) without a tokenizer, or with the tokenizer of the built-in presets:
    they are trained on tiny's corpus (what they sample is their own text) or hold random weights (for which
    no text is more theirs than what they sample), so their ids are sampled from the reference."""
    if tokenizer is None or is_tiny_tokenizer(tokenizer):
        return None, None
    texts, name = builtin_prose("calibration")
    return tokenizer.encode(texts[0][:TEXT_CHARS], add_special_tokens=False), name


ROUTING_TIE = 1e-4  # a routing decision closer than this (between scores in [0, 1]) may go either way in FP32


class RoutingMargins:
    """While the reference runs inside it: the smallest routing decision margin of its mixture layers over that
    run (inf without one). A case whose routing sits at a tie is not judged: two correct implementations may
    route a token differently there, and then their outputs differ by a whole expert."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.smallest = math.inf
        self.handles: list = []

    def _hook(self, module, inputs) -> None:
        self.smallest = min(self.smallest, float(module.decision_margin(inputs[0]).min()))

    def __enter__(self) -> "RoutingMargins":
        self.smallest = math.inf
        # before the router runs: a streamed reference (model_defs/weights.py) holds a module's weights from
        # just before its forward to just after it, so a hook after the forward would read placeholders
        self.handles = [r.register_forward_pre_hook(self._hook) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()

    @property
    def tied(self) -> bool:
        return self.smallest < ROUTING_TIE


class ReferenceIn:
    """The reference computed in `dtype` under `mode` (a TorchFunctionMode): a copy made once in that dtype (or a
    skeleton streamed from the same source); call like FlatKVModel, inputs in any float dtype."""

    def __init__(self, reference, dtype: torch.dtype, mode):
        self.dtype, self.mode = dtype, mode
        self.flat = FlatKVModel(copy_in(reference, dtype)).eval()

    @torch.no_grad()
    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args = tuple(a.to(self.dtype) if a.is_floating_point() else a for a in args)
        with self.mode:
            return self.flat(*args)


class HalfReference(ReferenceIn):
    """The reference computed as half kernels compute a float16 / bfloat16 graph: weights, cache and every value
    between two operations held in the dtype, each operation computed in float32 from them and its result
    rounded to the dtype (as GPU kernels accumulate in float32 and store half; ONNX Runtime's CPU kernels compute
    in float32 and round at most as often); what the model computes in float32 itself (its norms, softmax, RoPE
    angles: x.float()) stays float32. Its distance from the FP32 reference is the dtype's own rounding noise on
    those inputs, the floor a half graph is judged by (judge_noise). A copy in the dtype made once (half the FP32
    copy's size), or one streamed from the source."""

    is_truth = False  # the FP32 reference is the truth; this one's distance from it is the noise

    def __init__(self, reference, dtype: torch.dtype):
        super().__init__(reference, dtype, half_mode(dtype))
        self.noise = f"the {str(dtype).removeprefix('torch.')} reference's rounding noise"


# functions whose result is the same in any dtype (casts, attribute reads, moving values): run as called
_AS_CALLED = {"__get__", "__set__", "detach", "to", "float", "half", "bfloat16", "double", "type", "type_as", "view",
              "reshape", "size", "dim", "element_size", "is_floating_point", "contiguous", "transpose", "permute",
              "unsqueeze", "squeeze", "expand", "flatten", "unflatten", "__getitem__", "__setitem__", "cat", "stack",
              "split", "chunk", "narrow", "embedding", "copy_", "clone", "new_empty", "new_zeros", "new_ones",
              "new_full"}
_LINEAR_CHUNK = 1 << 24  # weight values upcast at a time by a linear layer (a vocabulary-sized head in row blocks)


class half_mode(TorchFunctionMode):
    """Inside: an operation on `dtype` tensors computes in float32 and rounds its result to `dtype` (see
    HalfReference); one with a float32 tensor of one or more dimensions among its inputs, or a dtype asked for,
    returns what it computes (as type promotion would: a 0-d float32 tensor, like a Python number, does not
    promote a half one)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        floats = [(t.dtype, t.dim()) for t in _tensors((args, kwargs)) if t.is_floating_point()]
        if name in _AS_CALLED or not any(dtype == self.dtype for dtype, _ in floats):
            return func(*args, **kwargs)
        up_args, up_kwargs = _map_tensors((args, kwargs), lambda t: t.float() if t.dtype == self.dtype else t)
        if func is torch.nn.functional.linear and args[1].numel() > _LINEAR_CHUNK:
            bias = up_kwargs.get("bias", up_args[2] if len(up_args) > 2 else None)
            out = _linear_in_row_blocks(up_args[0], args[1], bias)
        else:
            out = func(*up_args, **up_kwargs)
        if name.endswith("_") and not name.endswith("__"):  # in place: the result into the input
            return args[0].copy_(out)
        if "dtype" in kwargs or any(dtype == _F32 and dims for dtype, dims in floats):
            return out
        return _map_tensors(out, lambda t: t.to(self.dtype) if t.dtype == _F32 else t)


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and dicts (a function's arguments)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def _map_tensors(tree, fn):
    """`tree` with fn applied to each tensor in it (tuples, lists and dicts rebuilt; anything else as is)."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map_tensors(item, fn) for item in tree) if not hasattr(tree, "_fields") \
            else type(tree)(*(_map_tensors(item, fn) for item in tree))
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    return tree


def _linear_in_row_blocks(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) in float32 with the half `weight` upcast a block of rows at a time."""
    return torch.cat([torch.nn.functional.linear(x, weight[rows].float(), None if bias is None else bias[rows])
                      for rows in row_slices(*weight.shape, _LINEAR_CHUNK)], dim=-1)


class float64_mode(TorchFunctionMode):
    """Inside: every float32 the model asks for (x.float(), .to(torch.float32), dtype=torch.float32) is float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].to(_F64)
        if func is torch.Tensor.to:
            args = tuple(_F64 if a is _F32 else a for a in args)
        if kwargs.get("dtype") is _F32:
            kwargs["dtype"] = _F64
        return func(*args, **kwargs)


class Float64Reference(ReferenceIn):
    """The reference evaluated in float64 throughout (float64_mode)."""

    is_truth = True  # the truth an FP32 graph is measured against; the FP32 reference's distance from it is the noise
    noise = "the FP32 reference's rounding noise"

    def __init__(self, reference):
        super().__init__(reference, _F64, float64_mode())


def positions_of(mask: torch.Tensor, seq: int) -> torch.Tensor:
    """Each real token's position is the count of real tokens before it (a left-padded row as if alone)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)[:, -seq:]


@dataclass
class TokenPool:
    """Token rows the cases are cut from, and the reference's own cache over them when it can be shared."""

    ids: torch.Tensor  # (rows, length)
    cache: tuple[torch.Tensor, ...] | None  # presents over the first ids of each row; None: not shared


@torch.no_grad()
def sample_tokens(flat: FlatKVModel, rows: int, length: int, seed: int) -> torch.Tensor:
    """(rows, length) ids sampled from the reference (temperature 1, top 40), each row a few documents packed
    end to end as in pretraining: every document starts at the BOS token and is sampled on its own, so all of
    them are decoded in one batch and a long row costs SEGMENT sequential steps, not `length`."""
    cfg = flat.model.config
    gen = torch.Generator().manual_seed(seed)
    docs = -(-length // SEGMENT)
    size = -(-length // docs)
    batch = rows * docs
    first = cfg.bos_token_id if cfg.bos_token_id is not None and cfg.bos_token_id < cfg.vocab_size else None
    ids = (torch.full((batch, 1), first, dtype=torch.int64) if first is not None
           else torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen))
    out, past = [ids], _empty(flat, batch)
    for step in range(size - 1):
        mask = torch.ones(batch, step + 1, dtype=torch.int64)
        logits, *past = flat(ids, mask, torch.full((batch, 1), step, dtype=torch.int64), *past)
        top = torch.topk(logits[:, -1].double(), min(40, cfg.vocab_size))
        pick = torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)
        ids = top.indices.gather(1, pick)
        out.append(ids)
    return torch.cat(out, 1).reshape(rows, docs * size)[:, :length]


@torch.no_grad()
def token_pool(flat: FlatKVModel, tokens: Sequence[int] | None, rows: int, length: int, seed: int,
               cached: int) -> TokenPool:
    """(rows, length) ids: windows of `tokens` at spread-out offsets (repeated when short), or sampled ones; with
    the reference's cache over their first `cached` ids when every layer keeps its whole past (a case's past is
    then a slice of it)."""
    cfg = flat.model.config
    if tokens is None or len(tokens) == 0:
        ids = sample_tokens(flat, rows, length, seed)
    else:
        ids = torch.as_tensor([int(t) % cfg.vocab_size for t in tokens], dtype=torch.int64)
        if ids.numel() < length + rows:
            ids = ids.repeat((length + rows) // ids.numel() + 1)
        stride = max(1, (ids.numel() - length) // rows)
        ids = torch.stack([ids[r * stride: r * stride + length] for r in range(rows)])
    if any(cfg.layer_window(i) is not None for i in range(cfg.n_layers)) or not cached:
        return TokenPool(ids, None)
    prefix = ids[:, :cached]
    mask = torch.ones_like(prefix)
    return TokenPool(ids, tuple(flat.cache_after(prefix, mask, positions_of(mask, cached), *_empty(flat, rows))))


@torch.no_grad()
def case_inputs(flat: FlatKVModel, pool: TokenPool, batch: int, seq: int, past: int,
                pad: tuple[int, ...] | None, index: int) -> tuple[torch.Tensor, ...]:
    """Inputs in IO-contract order for one case: rows of the pool, the past cache from the reference's prefill of
    the rows' first `past` ids (left padding masked in it), then the `seq` new ids with their mask and positions."""
    rows = [(index + j) % pool.ids.shape[0] for j in range(batch)]
    ids = pool.ids[rows, :past + seq]
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    for row, n in enumerate(pad or ()):
        mask[row, :n] = 0
    if not past:
        cache = _empty(flat, batch)
    elif pool.cache is not None and not pad and past <= pool.cache[0].shape[2]:  # the shared prefill's first positions
        cache = tuple(t[rows, :, :past].contiguous() for t in pool.cache)
    else:
        prefix = mask[:, :past]
        cache = flat.cache_after(ids[:, :past], prefix, positions_of(prefix, past), *_empty(flat, batch))
    return (ids[:, past:], mask, positions_of(mask, seq), *cache)


def _empty(flat: FlatKVModel, batch: int) -> tuple[torch.Tensor, ...]:
    return tuple(t for layer in flat.model.empty_cache(batch) for t in layer)
