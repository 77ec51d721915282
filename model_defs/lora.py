"""LoRA slots: low-rank adapters as inputs of the model, chosen per row, so that one exported graph serves every
adapter and a batch mixes them (the design TensorRT-LLM and ONNX Runtime GenAI use for multi-LoRA).

A targeted linear layer y = x W^T + b gains

    y += ((x @ A) * mask[:, None, :]) @ B

where A (in, W) and B (W, out) are the adapters of one forward side by side along their ranks (W the sum of
their ranks; the scaling alpha/r already folded into B) and mask (batch, W) is 1 over the columns of each row's
own adapter, 0 elsewhere (all 0: no adapter). A step reads each adapter it serves once, whichever rows take it,
and only those: an adapter of rank 16 is fed as 16 columns, not padded to the bundle's max rank, and no per-row
copy of the weights is made (a gather of each row's adapter would copy them, then read them again). The other
adapters' columns are exact zeros in a row's sum, so a row computes what it computes alone (to the GEMM's
summation order).

Slots are plain nn.Linear modules whose class is swapped for LoraLinear: their parameters keep their names, so
checkpoints, weight tables and exported initializer names are those of the model without slots. The adapter
tensors reach the layers through the model's LoraFeed, set for one forward by `feeding()`.

`peft_adapter()` reads a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) into
kvforge's slots through the family's Hugging Face weight table: each module's delta W = scale * B A is carried
through the same transform as the base weight (row splits of fused q/k/v, transposes of Conv1D layouts, head
permutations), then factored again to its rank (an SVD in float64, exact to float32 rounding: the transforms
only select, permute and transpose).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn

from kvforge.adapters import concatenated, rank_of, row_mask
from kvforge.errors import KvforgeError

from .hf import normalize_names, source_name
from .hf_families import FAMILIES
from .lora_slots import LoraFeed, LoraLinear

# what `--lora-targets` names, as kvforge's module names: q -> q_proj (attention), gate -> gate_proj (FFN) ...
DEFAULT_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The layers' linear layers that can take a slot (the projections: not the embedding, the head, a router, nor
    one its module only reads the weight of: `LORA_EXCLUDED`)."""
    modules = dict(model.named_modules())
    return {name: m for name, m in modules.items()
            if isinstance(m, nn.Linear) and name.startswith("layers.") and name.endswith("_proj")
            and name.rsplit(".", 1)[-1] not in _excluded_in(modules.get(name.rsplit(".", 1)[0]))}


def _excluded_in(parent) -> dict[str, str]:
    return getattr(parent, "LORA_EXCLUDED", {}) if parent is not None else {}


def excluded_layers(model: nn.Module) -> dict[str, str]:
    """Short target name -> why its layers take no slot (a module reads their weight instead of calling them)."""
    out = {}
    for module in model.modules():
        for leaf, why in _excluded_in(module).items():
            out[leaf.removesuffix("_proj")] = why
    return out


def _short(module: str) -> str:
    """A module's target name: "layers.0.attn.q_proj" -> "q"; a mixture's routed experts take their own,
    "layers.1.ffn.experts.experts.3.gate_proj" -> "experts.gate" (opt-in: a mixture has many)."""
    leaf = module.rsplit(".", 1)[-1].removesuffix("_proj")
    return f"experts.{leaf}" if ".experts." in module else leaf


def target_names(modules) -> list[str]:
    """The short target names of these module names, sorted, each once."""
    return sorted({_short(n) for n in modules})


def target_modules(model: nn.Module, targets: tuple[str, ...] | list[str] | None = None) -> dict[str, nn.Linear]:
    """kvforge's linear layers that the short target names select ("q" -> every layer's ...q_proj; "experts.down"
    -> every routed expert's down_proj), by module name; None: those of DEFAULT_TARGETS the model has (a GPT-2 has
    no gate; a mixture's routed experts are targets only when named)."""
    linears = _linears(model)
    have = target_names(linears)
    if targets is None:
        targets = [t for t in DEFAULT_TARGETS if t in have]
    missing = sorted(set(targets) - set(have))
    excluded = excluded_layers(model)
    for target in missing:
        if target in excluded:
            raise KvforgeError(f"LoRA target {target!r} takes no slot: {excluded[target]}")
    if missing:
        raise KvforgeError(f"LoRA target(s) {missing} are not linear layers of this model; it has {have}")
    return {name: m for name, m in linears.items() if _short(name) in set(targets)}


def add_slots(model: nn.Module, targets: tuple[str, ...] | list[str] | None = None) -> list[str]:
    """Give `model`'s targeted linear layers LoRA slots (in place); returns the slot names (the module names)."""
    slots = target_modules(model, targets)
    for name, module in slots.items():
        module.__class__ = LoraLinear
        module.lora_slot = name
        module.lora_owner = [model]
    model.lora_feed = None
    model.lora_slots = list(slots)
    return list(slots)


@contextlib.contextmanager
def feeding(model: nn.Module, feed: LoraFeed | None) -> Iterator[None]:
    """Run forwards of `model` with `feed`'s adapters (None: the slots add nothing)."""
    before = getattr(model, "lora_feed", None)
    model.lora_feed = feed
    try:
        yield
    finally:
        model.lora_feed = before


def slot_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Per slot: (in features, out features)."""
    modules = dict(model.named_modules())
    return {s: (modules[s].in_features, modules[s].out_features) for s in model.lora_slots}


def torch_feed(rows: list[int | None], adapters: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
               model: nn.Module) -> LoraFeed:
    """A LoraFeed of `adapters` (side by side as kvforge/adapters.py lays them out) for rows taking adapter
    rows[i] (an index into adapters; None: none)."""
    as_numpy = [{s: (a.numpy(), b.numpy()) for s, (a, b) in ad.items()} for ad in adapters]
    joined = concatenated({"slots": slot_shapes(model)}, as_numpy)
    mask = row_mask([rank_of(ad) for ad in as_numpy], rows)
    return LoraFeed(torch.from_numpy(mask), {s: (torch.from_numpy(a), torch.from_numpy(b)) for s, (a, b) in joined.items()})


def validation_feed(model: nn.Module, rank: int, seed: int = 0) -> LoraFeed:
    """A random adapter of `rank` on every slot, small enough to keep the activations in range and large enough
    to move the logits, fed to every row (mask None): what export validation runs the slots with."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for slot, (fan_in, fan_out) in slot_shapes(model).items():
        a = torch.randn(fan_in, rank, generator=gen) / math.sqrt(fan_in)
        b = torch.randn(rank, fan_out, generator=gen) * (0.05 / math.sqrt(rank))
        weights[slot] = (a, b)
    return LoraFeed(None, weights)


# -- PEFT adapters ----------------------------------------------------------------------------------------------
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
# PEFT's LoRA on parameters (target_parameters: transformers' fused experts, (experts, out, in) tensors): one
# wrapper per parameter, nested, so each pair after the first sits under more ".base_layer"s
_PARAM_WRAPPER = re.compile(r"\.base_layer$")
# the fused experts' parameters a kvforge slot takes: per expert, (out, in) rows -> kvforge's expert layers
_FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _check_rank(directory: Path, module: str, r: int, max_rank: int | None) -> None:
    if max_rank is not None and r > max_rank:
        raise KvforgeError(f"{directory}: {module} has rank {r}, above the bundle's LoRA max rank {max_rank} "
                           "(export with a larger --lora-max-rank)")


def _target_parameters(config: dict[str, Any], module: str) -> list[str]:
    """The parameters of `module` (their leaf names) that the adapter's target_parameters name."""
    return [t.rsplit(".", 1)[-1] for t in config.get("target_parameters") or []
            if f"{module}.{t.rsplit('.', 1)[-1]}".endswith(t)]


def _expert_deltas(directory: Path, module: str, a: torch.Tensor, b: torch.Tensor, model: nn.Module,
                   config: dict[str, Any], max_rank: int | None) -> dict[str, tuple[torch.Tensor, int]]:
    """A PEFT LoRA on a fused experts parameter (transformers' gate_up_proj or down_proj of a mixture, each
    expert's (out, in) stacked): lora_A (r x experts, in) and lora_B (out, r x experts), expert e's delta
    scale * B[:, :, e] @ A[e] (PEFT's ParamWrapper), as kvforge's per-expert slots. Which of the module's
    parameters a pair is follows from its shapes (gate_up: in = hidden, out = 2 x expert width; down: the
    reverse), which never coincide."""
    owner = module
    while _PARAM_WRAPPER.search(owner):
        owner = _PARAM_WRAPPER.sub("", owner)
    layer = re.search(r"(?:^|\.)layers\.(\d+)\.", owner + ".")
    params = _target_parameters(config, owner)
    shapes = slot_shapes(model)
    experts = {}  # expert index -> {kvforge layer: (in, out)}
    if layer is not None:
        pattern = re.compile(rf"^layers\.{layer.group(1)}\.ffn\.experts\.experts\.(\d+)\.(\w+_proj)$")
        for slot, shape in shapes.items():
            m = pattern.match(slot)
            if m:
                experts.setdefault(int(m.group(1)), {})[m.group(2)] = shape
    unknown = [p for p in params if p not in _FUSED_EXPERTS]
    if layer is None or unknown or not params:
        raise KvforgeError(f"{directory}: the adapter trains the parameter(s) {unknown or params or [module]} of "
                           f"{owner} (target_parameters), which kvforge maps only for a mixture's fused experts "
                           f"({sorted(_FUSED_EXPERTS)})")
    if not experts:
        raise KvforgeError(f"{directory}: the adapter trains the experts of {owner}, which have no LoRA slots in this "
                           "bundle (export with --lora-targets naming experts.gate, experts.up, experts.down)")
    n = len(experts)
    r, rest = divmod(a.shape[0], n)
    fan_in, fan_out = a.shape[1], b.shape[0]
    some = next(iter(experts.values()))
    fits = {p: (sum(some.get(k, (0, 0))[1] for k in _FUSED_EXPERTS[p]), some.get(_FUSED_EXPERTS[p][0], (0, 0))[0])
            for p in params}  # parameter -> (out, in) of one expert
    which = [p for p, (out, inp) in fits.items() if (out, inp) == (fan_out, fan_in)]
    if rest or r < 1 or len(which) != 1:
        raise KvforgeError(f"{directory}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} fit none "
                           f"of {owner}'s {n} experts' parameters {params}: an adapter of another base model?")
    param = which[0]
    _check_rank(directory, f"{owner}.{param}", r, max_rank)
    scale = _alpha(config, f"{owner}.{param}") / (math.sqrt(r) if config.get("use_rslora") else r)
    a3, b3 = a.reshape(n, r, fan_in), b.reshape(fan_out, r, n)
    out: dict[str, tuple[torch.Tensor, int]] = {}
    for e, layers in sorted(experts.items()):
        delta = scale * (b3[:, :, e] @ a3[e])  # (out, in)
        at = 0
        for kind in _FUSED_EXPERTS[param]:
            if kind not in layers:
                raise KvforgeError(f"{directory}: the adapter trains {owner}.{param}, but expert {e}'s {kind} has no "
                                   "LoRA slot in this bundle (export with --lora-targets covering it)")
            rows = layers[kind][1]
            out[f"layers.{layer.group(1)}.ffn.experts.experts.{e}.{kind}"] = (delta[at:at + rows], r)
            at += rows
    return out


@dataclass
class PeftAdapter:
    """A PEFT LoRA adapter in kvforge's slots: per slot (A (in, r), B (r, out)) with the scaling folded into B."""

    rank: int
    slots: dict[str, tuple[torch.Tensor, torch.Tensor]]
    config: dict[str, Any]


def read_adapter_config(directory: Path) -> dict[str, Any]:
    path = Path(directory) / "adapter_config.json"
    if not path.is_file():
        raise KvforgeError(f"{directory} is not a PEFT adapter: it has no adapter_config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KvforgeError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(config, dict):
        raise KvforgeError(f"{path} holds {type(config).__name__}, not an object")
    kind = config.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise KvforgeError(f"{path}: peft_type {kind!r} is not a LoRA adapter")
    if config.get("modules_to_save"):
        raise KvforgeError(f"{path}: modules_to_save {config['modules_to_save']} trains whole modules beside the "
                           "low-rank ones; kvforge serves adapters over one base, so it takes LoRA weights only")
    if config.get("use_dora"):
        raise KvforgeError(f"{path}: DoRA adapters (use_dora) rescale the base weights; kvforge takes plain LoRA")
    if config.get("bias", "none") != "none":
        raise KvforgeError(f"{path}: bias={config['bias']!r} trains the base's biases; kvforge takes bias='none'")
    for key in ("lora_alpha", "r"):
        if key in config and not isinstance(config[key], (int, float)):
            raise KvforgeError(f"{path}: {key} must be a number, got {config[key]!r}")
    return config


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    directory = Path(directory)
    path = directory / "adapter_model.safetensors"
    if not path.is_file():
        pickled = [p.name for p in directory.glob("adapter_model*.bin")] + [p.name for p in directory.glob("*.pt")]
        if pickled:
            raise KvforgeError(f"{directory} holds its weights as a pickle ({pickled[0]}), which kvforge does not "
                               "load (it can run code); save the adapter with safetensors (PEFT's default, "
                               "save_pretrained(..., safe_serialization=True))")
        raise KvforgeError(f"{directory} has no adapter_model.safetensors")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise KvforgeError(f"{path} is not a readable safetensors file: {e}") from e


def _alpha(config: dict[str, Any], module: str) -> float:
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{pattern}", module):
            return float(value)
    return float(config.get("lora_alpha", 8))


def peft_adapter(directory: Path, model: nn.Module, family: str, hf_config: dict[str, Any] | None = None,
                 max_rank: int | None = None) -> PeftAdapter:
    """`directory`'s PEFT LoRA adapter in the slots of `model` (a Transformer with add_slots), whose weights follow
    the Hugging Face family `family`'s weight table. Refuses, naming the problem: no LoRA weights, a module the
    model has no slot for, shapes of another base, a rank above max_rank, weights that are not finite."""
    directory = Path(directory)
    config = read_adapter_config(directory)
    tensors = _read_tensors(directory)
    if family not in FAMILIES:
        raise KvforgeError(f"LoRA adapters are read through a Hugging Face family's weight names; this model's "
                           f"family {family!r} is not one of them")
    spec = FAMILIES[family]
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _PEFT_KEY.match(key)
        if m is None:
            raise KvforgeError(f"{directory}: {key!r} is not a LoRA weight (lora_A / lora_B); kvforge takes LoRA "
                               "weights only")
        pairs.setdefault(m.group("module"), {})[m.group("which")] = t
    if not pairs:
        raise KvforgeError(f"{directory}: adapter_model.safetensors holds no LoRA weights")
    # the kvforge slot each checkpoint weight feeds, through the family's table
    table = spec.weights(hf_config or {}, model.config)
    fed_by: dict[str, list[tuple[str, Any]]] = {}
    for slot in model.lora_slots:
        name, transform = source_name(table, family, f"{slot}.weight")
        fed_by.setdefault(name, []).append((slot, transform))
    shapes = slot_shapes(model)
    fan_in_fan_out = bool(config.get("fan_in_fan_out", False))
    deltas: dict[str, tuple[torch.Tensor, int]] = {}  # slot -> (its delta (out, in), float64; the adapter's rank)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise KvforgeError(f"{directory}: {module} has lora_{''.join(sorted(ab))} but not both A and B")
        a, b = ab["A"].double(), ab["B"].double()
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise KvforgeError(f"{directory}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not "
                               "a rank-r pair (r x in, out x r)")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise KvforgeError(f"{directory}: {module}'s LoRA weights hold NaN or infinite values")
        if _PARAM_WRAPPER.search(module) or _target_parameters(config, module):
            deltas.update(_expert_deltas(directory, module, a, b, model, config, max_rank))
            continue
        r = a.shape[0]
        _check_rank(directory, module, r, max_rank)
        weight = normalize_names(family, {f"{module}.weight": None}).popitem()[0]
        targets = fed_by.get(weight)
        if not targets:
            leaf = module.rsplit(".", 1)[-1]
            why = next((w for short, w in excluded_layers(model).items() if leaf.startswith(f"{short}_proj")), None)
            raise KvforgeError(f"{directory}: the adapter trains {module}, which has no LoRA slot in this bundle "
                               + (f"and takes none: {why}" if why else
                                  f"(its slots are {target_names(model.lora_slots)}; export with --lora-targets "
                                  "covering it)"))
        scale = _alpha(config, module) / (math.sqrt(r) if config.get("use_rslora") else r)
        delta = scale * (b @ a)  # (out, in): nn.Linear's layout
        if fan_in_fan_out:
            delta = delta.T  # the checkpoint stores this module (GPT-2's Conv1D) as (in, out)
        for slot, transform in targets:
            try:
                ours = delta if transform is None else transform(delta, model.config)
            except (RuntimeError, ValueError) as e:
                raise KvforgeError(f"{directory}: {module}'s LoRA delta {tuple(delta.shape)} does not fit this "
                                   f"model's {slot} ({e}): an adapter of another base model?") from e
            deltas[slot] = (ours, r)
    slots: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for slot, (delta, r) in deltas.items():
        fan_in, fan_out = shapes[slot]
        if tuple(delta.shape) != (fan_out, fan_in):
            raise KvforgeError(f"{directory}: the LoRA delta for {slot} has the shape {tuple(delta.shape)}, but this "
                               f"model's is {(fan_out, fan_in)}: an adapter of another base model?")
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
        slots[slot] = (vh[:r].T.float().contiguous(), (u[:, :r] * s[:r]).T.float().contiguous())  # (in, r), (r, out)
        rank = max(rank, r)
    return PeftAdapter(rank, slots, config)
