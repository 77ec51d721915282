"""Torch reference model -> ONNX graph with the KV-cache IO contract of docs/design.md.

One graph serves prefill (past 0) and decode (seq 1): batch, sequence and past
lengths are dynamic. Names follow Hugging Face Optimum / ONNX Runtime GenAI:

    input_ids                 int64       [batch_size, sequence_length]
    attention_mask            int64       [batch_size, total_sequence_length]
    position_ids              int64       [batch_size, sequence_length]
    past_key_values.{i}.key   model dtype [batch_size, kv_heads, past_sequence_length, head_dim]  (and .value)
    logits                    float32     [batch_size, sequence_length, vocab]
    present.{i}.key           model dtype [batch_size, kv_heads, total_sequence_length, head_dim] (and .value)

total_sequence_length = past_sequence_length + sequence_length.

A latent-attention layer (DeepSeek's MLA) caches one tensor instead of the pair:

    past_key_values.{i}.latent  model dtype [batch_size, 1, past_sequence_length, kv_lora_rank + qk_rope_head_dim]
    present.{i}.latent          (the same over total_sequence_length)

its features are [the normed latent c_kv | the rotated shared RoPE key] (ModelConfig.cache_entries).

A layer with a sliding window W keeps a capped cache (a rolling buffer of its
newest positions): its past is [batch_size, kv_heads, past_sequence_length_wW,
head_dim] with past_sequence_length_wW = min(past, W), and its present holds
total_sequence_length_wW = min(total, W) positions. The IO spec's
kv_cache.windows says which layers are capped.

A model with LoRA slots (model_defs/lora.py, `export --lora-max-rank`) takes, after the cache,

    lora_mask                 model dtype [batch_size, lora_width]  1 over each row's adapter's columns
    lora.{slot}.a             model dtype [in_features, lora_width]   per slot (module name): the adapters'
    lora.{slot}.b             model dtype [lora_width, out_features]  A and B side by side along their ranks

and io.extra.lora records the slots, their targets and the max rank.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from pathlib import Path

import torch

from kvforge.bundle import BATCH, PAST, SEQ, TOTAL, IOSpec, TensorSpec, window_dims
from kvforge.errors import KvforgeError
from kvforge.adapters import LORA_WIDTH, MASK, slot_input_names
from kvforge.model_defs.lora import LoraFeed, feeding, slot_shapes

from .lazy_weights import count_writes, reading_weights
from .replicate import hidden_names, hidden_states, layer_of, prefix, traced_program
from .traces import traced
# Example sizes for tracing: distinct, and neither 0 nor 1, so that the exporter
# neither merges two dynamic dimensions nor specializes one to a constant. A
# capped cache's example past (min(W, 4)) must differ from them too: a window
# of 2 or 3 takes the batch of 3 / the sequence of 2 instead.
_EX_BATCH, _EX_SEQ, _EX_PAST = 2, 3, 5


def example_sizes(windows: list[int | None]) -> tuple[int, int, int]:
    capped = {min(w, 4) for w in windows if w is not None}
    batch = next(b for b in (_EX_BATCH, 3, 6) if b not in capped)
    seq = next(s for s in (_EX_SEQ, 2, 7) if s not in capped | {batch})
    return batch, seq, _EX_PAST


DEFAULT_OPSET = 21
# ONNX's protobuf limit; above it weights must go to an external data file.
PROTOBUF_LIMIT = 2**31 - 1
EXTERNAL_DATA = "model.onnx.data"

NP_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def cache_names(cfg, prefix: str) -> list[list[str]]:
    """Per layer, its cache tensors' names: `{prefix}.{i}.key` and `.value`, or `.latent` (cfg.cache_entries)."""
    return [[f"{prefix}.{i}.{name}" for name, _, _ in cfg.cache_entries(i)] for i in range(cfg.n_layers)]


# the LoRA inputs' example width for tracing (distinct from the sizes above)
_EX_WIDTH = 11


def lora_input_names(slots: list[str]) -> list[str]:
    return [MASK] + [n for s in slots for n in slot_input_names(s)] if slots else []


def input_names(cfg, slots: list[str] | None = None) -> list[str]:
    return (["input_ids", "attention_mask", "position_ids"] + [n for layer in cache_names(cfg, "past_key_values") for n in layer]
            + lora_input_names(slots or []))


def output_names(cfg) -> list[str]:
    return ["logits"] + [n for layer in cache_names(cfg, "present") for n in layer]


def layer_windows(cfg) -> list[int | None]:
    """Each layer's sliding window (its cache is capped at it), or None."""
    return [cfg.layer_window(i) for i in range(cfg.n_layers)]


def io_spec(cfg, dtype: torch.dtype, max_context: int) -> IOSpec:
    kv = NP_DTYPES[dtype]
    windows = layer_windows(cfg)

    def cache(layer: int, present: bool, entry: int) -> list:
        length = (TOTAL if present else PAST) if windows[layer] is None else window_dims(windows[layer])[present]
        _, heads, dim = cfg.cache_entries(layer)[entry]
        return [BATCH, heads, length, dim]

    past, present = cache_names(cfg, "past_key_values"), cache_names(cfg, "present")
    inputs = [
        TensorSpec("input_ids", "int64", [BATCH, SEQ]),
        TensorSpec("attention_mask", "int64", [BATCH, TOTAL]),
        TensorSpec("position_ids", "int64", [BATCH, SEQ]),
    ] + [TensorSpec(n, kv, cache(i, False, j)) for i, names in enumerate(past) for j, n in enumerate(names)]
    outputs = [TensorSpec("logits", "float32", [BATCH, SEQ, cfg.vocab_size])] + [
        TensorSpec(n, kv, cache(i, True, j)) for i, names in enumerate(present) for j, n in enumerate(names)
    ]
    if cfg.kv_lora_rank:
        return IOSpec(inputs, outputs, past, present, max_context=max_context, windows=windows,
                      cache_layout="batch,1,seq,kv_lora_rank+qk_rope_head_dim")
    return IOSpec(inputs, outputs, past, present, max_context=max_context, windows=windows)


def with_lora_inputs(io: IOSpec, model, max_rank: int, targets: list[str]) -> IOSpec:
    """`io` with the LoRA slots' inputs of `model` (add_slots) and the io.extra.lora record."""
    kv = NP_DTYPES[model.dtype]
    shapes = slot_shapes(model)
    io.inputs.append(TensorSpec(MASK, kv, [BATCH, LORA_WIDTH]))
    for slot, (fan_in, fan_out) in shapes.items():
        a, b = slot_input_names(slot)
        io.inputs.append(TensorSpec(a, kv, [fan_in, LORA_WIDTH]))
        io.inputs.append(TensorSpec(b, kv, [LORA_WIDTH, fan_out]))
    io.extra["lora"] = {"max_rank": max_rank, "targets": list(targets), "mask": MASK,
                        "slots": {slot: [fan_in, fan_out] for slot, (fan_in, fan_out) in shapes.items()}}
    return io


def group_cache(cfg, flat, n_layers: int | None = None) -> tuple[tuple, list]:
    """Flat cache tensors in IO-contract order (and whatever follows them) -> (per layer, its tensors), the rest;
    n_layers: of the first n layers only."""
    cache, at = [], 0
    for i in range(cfg.n_layers if n_layers is None else n_layers):
        n = len(cfg.cache_entries(i))
        cache.append(tuple(flat[at:at + n]))
        at += n
    return tuple(cache), list(flat[at:])


class FlatKVModel(torch.nn.Module):
    """The model with flat tensor inputs and outputs, in IO-contract order.

    n_layers: run only the first n layers (a traced prefix, export/replicate.py), with the hidden state entering
    each of them and the last one's output as extra outputs after the present."""

    def __init__(self, model, n_layers: int | None = None):
        super().__init__()
        self.owner = [model]  # the model whose feed the LoRA slots read (a list: not a second submodule)
        self.n_layers = n_layers
        self.model = model if n_layers is None else prefix(model, n_layers)
        self.slots = [s for s in getattr(model, "lora_slots", None) or []
                      if n_layers is None or layer_of(s) < n_layers]

    def forward(self, input_ids, attention_mask, position_ids, *rest):
        """rest: the cache, then (a model with LoRA slots) lora_mask and each slot's A and B; without them the
        slots take what the model's feed holds (model_defs.lora.feeding)."""
        return self._run(input_ids, attention_mask, position_ids, rest)

    def cache_after(self, input_ids, attention_mask, position_ids, *rest) -> tuple[torch.Tensor, ...]:
        """The flat present alone (the forward's outputs after the logits), the head run on the last position
        only: what a prefill leaves in the cache, without its (B, T, vocab) logits (3 GB in FP32 for 3 rows of
        1,032 tokens over Gemma 3's 262k-token vocabulary)."""
        return self._run(input_ids, attention_mask, position_ids, rest, logits_to_keep=1)[1:]

    def _run(self, input_ids, attention_mask, position_ids, rest, **options):
        cache, lora = group_cache(self.model.config, rest, self.n_layers)
        capture = hidden_states(self.model.layers) if self.n_layers is not None else contextlib.nullcontext([])
        with capture as hidden:
            if lora:
                weights = {s: (lora[1 + 2 * j], lora[2 + 2 * j]) for j, s in enumerate(self.slots)}
                with feeding(self.owner[0], LoraFeed(lora[0], weights)):
                    logits, present = self.model(input_ids, attention_mask, position_ids, cache, **options)
            else:
                logits, present = self.model(input_ids, attention_mask, position_ids, cache, **options)
        return (logits, *[t for kv in present for t in kv], *hidden)


def example_inputs(cfg, dtype: torch.dtype, batch: int, seq: int, past: int, seed: int = 0,
                   capped_past: int | None = None) -> tuple[torch.Tensor, ...]:
    """Seeded, non-trivial inputs in IO-contract order (random ids and cache, consecutive positions).

    A windowed layer's cache holds min(past, W) positions (capped_past, when given, instead: for tracing).
    """
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    mask = torch.ones(batch, past + seq, dtype=torch.int64)
    positions = torch.arange(past, past + seq, dtype=torch.int64).expand(batch, seq).contiguous()
    lengths = [past if w is None else min(past, w) if capped_past is None else min(capped_past, w) for w in layer_windows(cfg)]
    cache = [
        torch.randn(batch, heads, n, dim, generator=gen).to(dtype)
        for i, n in enumerate(lengths) for _, heads, dim in cfg.cache_entries(i)
    ]
    return (ids, mask, positions, *cache)


def rename_dims(graph, cfg, slots: list[str] | None = None, extra: dict[str, dict[int, str]] | None = None) -> None:
    """Give the exporter's symbols (s0, s17 + s3, ...) the IO contract's names; `extra` names the dynamic axes of
    inputs beyond the contract's (input -> {axis: name})."""
    import onnx_ir as ir

    values = {v.name: v for v in list(graph.inputs) + list(graph.outputs)}
    symbol = {}
    windows = layer_windows(cfg)

    def sym(name, axis):
        dim = values[name].shape[axis]
        return str(dim) if not isinstance(dim, int) else None

    symbol[sym("input_ids", 0)] = BATCH
    symbol[sym("input_ids", 1)] = SEQ
    symbol[sym("attention_mask", 1)] = TOTAL
    # position_ids is unused by models without positions (NoPE, ALiBi): its symbols are free
    symbol.setdefault(sym("position_ids", 0), BATCH)
    symbol.setdefault(sym("position_ids", 1), SEQ)
    for window, names in zip(windows, cache_names(cfg, "past_key_values")):
        for name in names:
            symbol[sym(name, 2)] = PAST if window is None else window_dims(window)[0]
    if slots:
        symbol.setdefault(sym(MASK, 0), BATCH)
        symbol.setdefault(sym(MASK, 1), LORA_WIDTH)
        for slot in slots:
            a, b = slot_input_names(slot)
            for name, axis in ((a, 1), (b, 0)):
                symbol.setdefault(sym(name, axis), LORA_WIDTH)
    for name, axes in (extra or {}).items():
        for axis, dim in axes.items():
            symbol.setdefault(sym(name, axis), dim)
    symbol.pop(None, None)
    # A capped present's length is an expression of the exporter's (Max(0, ... - Max(...))): named here.
    for window, names in zip(windows, cache_names(cfg, "present")):
        for name in names:
            if window is not None and values[name].shape is not None:
                dims = list(values[name].shape)
                dims[2] = window_dims(window)[1]
                values[name].shape = ir.Shape(dims)

    def rename(text: str) -> str:
        named = re.sub(r"[A-Za-z_]\w*", lambda m: symbol.get(m.group(0), m.group(0)), text)
        compact = named.replace(" ", "")
        return TOTAL if compact in (f"{PAST}+{SEQ}", f"{SEQ}+{PAST}") else named

    for v in values.values():
        if v.shape is None:
            continue
        dims = [d if isinstance(d, int) else rename(str(d)) for d in v.shape]
        v.shape = ir.Shape(dims)
    known = {BATCH, SEQ, PAST, TOTAL, LORA_WIDTH} | {d for w in windows if w is not None for d in window_dims(w)}
    known |= {d for axes in (extra or {}).values() for d in axes.values()}
    unknown = {str(d) for v in values.values() for d in (v.shape or []) if not isinstance(d, int) and str(d) not in known}
    if unknown:
        shapes = {v.name: [str(d) for d in v.shape] for v in values.values() if v.shape is not None}
        raise KvforgeError(f"export produced dimensions outside the IO contract: {sorted(unknown)} in {shapes}")


# Exporter debug metadata: stack traces with local paths, FX node dumps. Dropped
# so artifacts are smaller and do not depend on where kvforge was installed;
# the module scopes ("namespace", "pkg.torch.onnx.name_scopes") are kept for
# per-layer error attribution.
_DEBUG_METADATA = ("pkg.torch.onnx.stack_trace", "pkg.torch.onnx.fx_node", "pkg.torch.onnx.class_hierarchy")


def _module_of(node) -> str:
    """The module a node came from ("model.layers.0.attn.q_proj"), from the exporter's name scopes."""
    import ast

    text = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    try:
        scopes = ast.literal_eval(text) if text else []
    except (ValueError, SyntaxError):
        scopes = []
    return scopes[-2] if len(scopes) >= 2 and scopes[-2] else "model"


def _name_initializers(graph) -> None:
    """Name the exporter's anonymous initializers (val_123) after the modules that read them: a linear layer's
    weight (stored [in, out]) becomes `model.layers.0.attn.q_proj.weight`, any other constant
    `<module>.const_<n>` under the modules its readers share. Tools that show or refit weights by name
    (Netron, Polygraphy, TensorRT's refitter) then see the names users know."""
    import os.path

    counters: dict[str, int] = {}
    for value in list(graph.initializers.values()):
        if not value.name.startswith("val_"):
            continue
        uses = list(value.uses())
        if not uses:
            continue
        modules = [_module_of(u.node) for u in uses]
        if len(uses) == 1 and uses[0].node.op_type in ("MatMul", "Gemm") and uses[0].idx == 1 and len(value.shape or ()) == 2:
            name = f"{modules[0]}.weight"
        else:
            common = os.path.commonprefix([m.split(".") for m in modules])
            scope = ".".join(common) or "model"
            counters[scope] = counters.get(scope, -1) + 1
            name = f"{scope}.const_{counters[scope]}"
        if name not in graph.initializers:
            value.name = name


def _strip_debug_metadata(graph) -> None:
    for node in graph:
        for key in _DEBUG_METADATA:
            node.metadata_props.pop(key, None)


_REGISTRIES: dict = {}


@contextlib.contextmanager
def _one_torchlib_registry():
    """torch.onnx.export with the registry of torchlib's ONNX functions built once per opset in this process, not
    once per export (about a second each time, a sixth of a small model's trace). kvforge passes no custom
    translation table, so nothing is registered into it; a torch without that seam builds its own each time."""
    try:
        from torch.onnx._internal.exporter import _registration

        build = _registration.ONNXRegistry.__dict__["from_torchlib"]
    except (ImportError, AttributeError, KeyError):
        yield
        return

    def cached(cls, opset_version=None):
        key = (cls, opset_version)
        if key not in _REGISTRIES:
            _REGISTRIES[key] = build.__func__(cls) if opset_version is None else build.__func__(cls, opset_version)
        return _REGISTRIES[key]

    _registration.ONNXRegistry.from_torchlib = classmethod(cached)
    try:
        yield
    finally:
        _registration.ONNXRegistry.from_torchlib = build


def trace(module, args, dynamic_shapes, input_names: list[str], output_names: list[str], opset: int,
          optimize: bool = True):
    """torch.onnx's dynamo export of `module` on `args`, quietly, made once per structure (export/traces.py);
    any failure is one KvforgeError."""
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level

    def export():
        try:
            with _one_torchlib_registry():
                return torch.onnx.export(module, args, dynamo=True, dynamic_shapes=dynamic_shapes, input_names=input_names,
                                         output_names=output_names, opset_version=opset, optimize=False,
                                         verbose=False)
        except Exception as e:  # the exporter raises many types; report them as one
            raise KvforgeError(f"torch.onnx export failed: {type(e).__name__}: {e}") from e

    quiet.setLevel(logging.ERROR)  # the exporter warns about optional torchvision ops
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            return traced(module, (args, dynamic_shapes, input_names, output_names, opset), export, optimize)
        finally:
            quiet.setLevel(level)


def export_onnx(model, path: Path, opset: int = DEFAULT_OPSET, external_data: bool | None = None,
                every_layer: bool = False) -> Path:
    """Export `model` (already in its target dtype, eval mode) to `path`; returns the path.

    Each distinct layer design is traced once and copied for the layers that share it (export/replicate.py);
    a model whose layers cannot be copied, or every_layer, is traced whole.
    external_data: True writes weights to model.onnx.data beside the graph; None
    does so only when the graph would exceed protobuf's 2 GB limit.
    """
    cfg = model.config
    slots = list(getattr(model, "lora_slots", None) or [])
    program = traced_program(model, lambda k: _trace_flat(model, opset, n_layers=k), lambda: _trace_flat(model, opset),
                             input_names(cfg, slots), output_names(cfg), every_layer)
    _batch_from_input_ids(program.model.graph)
    rename_dims(program.model.graph, cfg, slots)
    return save_program(program, path, external_data)


def _batch_from_input_ids(graph) -> None:
    """Read the batch size from input_ids where the exporter read it from attention_mask (the two share it by the
    contract): attention_mask then feeds the masks only, which the runtime's packed attention relies on when it
    drops that input (runtime/ort/attention.py). Which input the exporter picks depends on the traced inputs."""
    inputs = {v.name: v for v in graph.inputs}
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    for use in list(mask.uses()):
        node = use.node
        start = node.attributes.get("start")
        end = node.attributes.get("end")
        if node.op_type == "Shape" and start is not None and start.value == 0 and end is not None and end.value == 1:
            node.replace_input_with(use.idx, ids)


def _trace_flat(model, opset: int, n_layers: int | None = None):
    """The traced program of FlatKVModel(model, n_layers): optimized when whole, left for replicate when a prefix."""
    cfg = model.config
    flat = FlatKVModel(model, n_layers).eval()
    n = cfg.n_layers if n_layers is None else n_layers
    windows = layer_windows(cfg)
    batch, seq, past = example_sizes(windows)
    args = example_inputs(cfg, model.dtype, batch, seq, past, capped_past=4)
    n_past = sum(len(cfg.cache_entries(i)) for i in range(n))
    args = args[:3 + n_past]
    dyn = torch.export.Dim.DYNAMIC
    rest = [{0: dyn, 2: dyn} for _ in range(n_past)]
    if flat.slots:
        args = args + lora_example(model, batch, slots=flat.slots)
        rest += [{0: dyn, 1: dyn}] + [{1: dyn} if j % 2 == 0 else {0: dyn} for j in range(2 * len(flat.slots))]
    dynamic_shapes = {
        "input_ids": {0: dyn, 1: dyn},
        "attention_mask": {0: dyn, 1: dyn},
        "position_ids": {0: dyn, 1: dyn},
        "rest": tuple(rest),
    }
    names_in, names_out = input_names(cfg, flat.slots), output_names(cfg)
    if n_layers is not None:  # the first n layers' cache, then the hidden states
        names_in = names_in[:3] + [x for layer in cache_names(cfg, "past_key_values")[:n] for x in layer] + \
            lora_input_names(flat.slots)
        names_out = ["logits"] + [x for layer in cache_names(cfg, "present")[:n] for x in layer] + hidden_names(n)
    return trace(flat, args, dynamic_shapes, names_in, names_out, opset, optimize=n_layers is None)


def lora_example(model, batch: int, width: int = _EX_WIDTH, seed: int = 0, slots: list[str] | None = None) -> tuple:
    """Seeded LoRA inputs (lora_mask, then each slot's A and B) for `batch` rows over `width` columns; slots: of
    these slots only (the same tensors they get among all)."""
    gen = torch.Generator().manual_seed(seed)
    out = [(torch.rand(batch, width, generator=gen) > 0.5).to(model.dtype)]
    for slot, (fan_in, fan_out) in slot_shapes(model).items():
        a = (0.02 * torch.randn(fan_in, width, generator=gen)).to(model.dtype)
        b = (0.02 * torch.randn(width, fan_out, generator=gen)).to(model.dtype)
        if slots is None or slot in slots:
            out += [a, b]
    return tuple(out)


def save_program(program, path: Path, external_data: bool | None = None) -> Path:
    """Name the initializers, drop the exporter's debug metadata and save; external_data None: only when the
    weights would pass protobuf's limit."""
    import onnx_ir as ir

    graph = program.model.graph
    _name_initializers(graph)
    _strip_debug_metadata(graph)
    program.model.producer_name = "kvforge"
    weight_bytes = sum(v.const_value.nbytes for v in graph.initializers.values() if v.const_value is not None)
    if external_data is None:
        external_data = weight_bytes > PROTOBUF_LIMIT - (64 << 20)
    count_writes(graph)  # a progress bar per weight, where the export asked for one
    with reading_weights():
        ir.save(program.model, path, external_data=EXTERNAL_DATA if external_data else None)
    return path
