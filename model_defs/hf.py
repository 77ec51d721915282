"""Import Hugging Face checkpoints (config.json + *.safetensors) of supported families.

Two explicit tables per family (hf_families.py): config keys -> ModelConfig
fields, and weight names -> kvforge parameter names (with the transform each
needs). Loading is strict: every kvforge parameter must come from exactly one
checkpoint tensor of the right shape, and every checkpoint tensor must be
used. Safetensors are read, and pytorch_model.bin through torch.load(weights_only=True), which runs no code.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Callable

import torch

from kvforge.errors import KvforgeError
from kvforge.schema import path_problem, read_json

from .architectures import ARCHITECTURES, tied_parameters
from .hf_families import FAMILIES, NOT_BUILT
from .quantized import QuantizedCheckpoint, exact, follow
from .sentence_transformers import read_embedding
from .weights import SafetensorsShards, TorchPickleShards, count_non_finite

SUPPORTED_FAMILIES = tuple(FAMILIES)

# Checkpoint entries that are buffers, not weights (older exports saved them).
_IGNORED = (
    re.compile(r"(^|\.)attn\.(bias|masked_bias)$"),
    re.compile(r"(^|\.)attention\.(bias|masked_bias)$"),
    re.compile(r"rotary_emb\.inv_freq$"),
    re.compile(r"(^|\.)embeddings\.(position_ids|token_type_ids)$"),  # BERT's buffers, saved by older transformers
)
# Names transformers renames on load for every model (TensorFlow-era BERT checkpoints: LayerNorm gamma and beta)
_LEGACY_SUFFIXES = (("LayerNorm.gamma", "LayerNorm.weight"), ("LayerNorm.beta", "LayerNorm.bias"))


def config_from_hf(hf: dict[str, Any], names=None):
    """The kvforge config of a config.json; names: the checkpoint's tensor names, where a head the config names
    may be absent from the file (Family.absent_heads)."""
    family = hf.get("model_type")
    if family in NOT_BUILT:
        raise KvforgeError(f"model_type={family!r} is not built by kvforge: {NOT_BUILT[family]}")
    if family not in FAMILIES:
        archs = hf.get("architectures")
        raise KvforgeError(
            f"unsupported architecture: model_type={family!r} (architectures={archs}); "
            f"supported model types: {list(SUPPORTED_FAMILIES)}"
        )
    try:
        spec = FAMILIES[family]
        config = ARCHITECTURES[spec.architecture].config(**spec.config(hf))
    except KeyError as e:
        raise KvforgeError(f"{family} config.json lacks the key {e.args[0]!r}") from e
    prefix = spec.absent_heads.get(getattr(config, "head", None))
    if prefix and names is not None and not any(n.startswith(prefix) for n in normalize_names(family, dict.fromkeys(names))):
        config = dataclasses.replace(config, head=None)
    if hf.get("sentence_transformers") and "embedding" in {f.name for f in dataclasses.fields(config)}:
        config = dataclasses.replace(config, embedding=hf["sentence_transformers"])
    return config


def source_name(table, family: str, ours: str) -> tuple[str, Any]:
    """The checkpoint name and transform that feed the kvforge parameter `ours`."""
    layer = re.match(r"layers\.(\d+)\.(.*)", ours)
    key = f"layers.{{i}}.{layer.group(2)}" if layer else ours
    expert = re.search(r"\.experts\.(\d+)\.", key)  # a mixture's expert: its index is {j}
    if expert:
        key = key[:expert.start()] + ".experts.{j}." + key[expert.end():]
    entry = table.get(key)
    if entry is None:
        raise KvforgeError(f"no {family} checkpoint name is known for parameter {ours!r}")
    name, transform = entry
    indices = {"i": layer.group(1) if layer else None, "j": expert.group(1) if expert else None}
    return name.format(**indices) if layer or expert else name, transform


def normalize_names(family: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names as the weight table writes them: the wrapper's prefix added to files saved from the
    base model (not to the heads' names), and older releases' names replaced by their aliases."""
    spec = FAMILIES[family]
    out = {}
    for name, t in tensors.items():
        for before, after in _LEGACY_SUFFIXES:
            if name.endswith(before):
                name = name[:-len(before)] + after
        for before, after in spec.renames:
            if name.startswith(before):
                name = after + name[len(before):]
        name = spec.aliases.get(name, name)
        if spec.add_prefix and not name.startswith((spec.add_prefix, *spec.head_prefixes)):
            name = spec.add_prefix + name
        if name in out:
            raise KvforgeError(f"{family} checkpoint holds {name!r} twice (with and without its prefix or alias)")
        out[name] = t
    return out


def weight_files(directory: Path) -> list[Path]:
    """The files that hold the model's weights, as transformers finds them: model.safetensors or the shards its
    index names; else pytorch_model.bin or the shards of pytorch_model.bin.index.json (read with
    torch.load(weights_only=True): no code from the file runs)."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = directory / index
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) and not path_problem(f)
                                                           for f in weight_map.values()):
                raise KvforgeError(f"{index} has no usable weight_map (tensor name -> a shard file beside it)")
            files = sorted({directory / f for f in weight_map.values()})
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise KvforgeError(f"{index} names shard files that do not exist: {missing}")
            return files
        if (directory / single).is_file():  # as transformers: other .safetensors (adapters, ...) are not the model
            return [directory / single]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = (f" It has {pickles}, which transformers does not read as a model's weights (it reads "
                f"pytorch_model.bin)." if pickles else "")
        raise KvforgeError(f"no model weights in {directory}: neither *.safetensors nor pytorch_model.bin.{hint}")
    if len(files) > 1:
        raise KvforgeError(f"{directory} has several .safetensors files ({[f.name for f in files]}) but neither "
                           "model.safetensors nor model.safetensors.index.json to say which hold the model")
    return files


def weight_shards(files: list[Path]):
    """The tensors of weight_files(), read one at a time (model_defs/weights.py)."""
    pickled = [f for f in files if f.suffix == ".bin"]
    return TorchPickleShards(pickled) if pickled else SafetensorsShards(files)


def read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of weight_files() (a safetensors file read whole, a pickle file mapped)."""
    if any(f.suffix == ".bin" for f in files):
        shards = TorchPickleShards(files)
        return {name: shards.read(name) for name in shards.entries}
    return read_safetensors(files)


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as e:
            raise KvforgeError(f"cannot read {f}: {e}") from e
        dup = sorted(set(part) & set(tensors))
        if dup:
            raise KvforgeError(f"tensors {dup[:5]} appear in more than one shard ({f.name})")
        bad = {name: count_non_finite(t) for name, t in part.items()}
        bad = {name: n for name, n in bad.items() if n}
        if bad:
            names = ", ".join(f"{name} holds {n} NaN or infinite values" for name, n in sorted(bad.items())[:5])
            raise KvforgeError(f"{f} is damaged: {names}" + (f" (and {len(bad) - 5} more tensors)" if len(bad) > 5 else ""))
        tensors.update(part)
    return tensors


def _tied_names(duplicates: tuple[tuple[str, str], ...]) -> dict[str, list[str]]:
    """Each name in Family.duplicates -> the other names of its tensor (pairs sharing a name are one tensor: T5's
    shared.weight, encoder.embed_tokens.weight and decoder.embed_tokens.weight)."""
    groups: dict[str, list[str]] = {}
    for a, b in duplicates:
        group = list(dict.fromkeys(groups.get(a, [a]) + groups.get(b, [b])))
        for name in group:
            groups[name] = group
    return {name: [other for other in group if other != name] for name, group in groups.items()}


def state_dict_from_hf(model: torch.nn.Module, family: str, tensors: dict[str, torch.Tensor],
                       hf_config: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Map checkpoint tensors onto `model`'s parameters, strictly (weight_plan's checks).

    Raises one KvforgeError that lists every missing tensor, every unused one
    and every shape mismatch.
    """
    tensors = normalize_names(family, tensors)
    same = lambda a, b: tensors[a].dtype == tensors[b].dtype and torch.equal(tensors[a], tensors[b])  # noqa: E731
    plan = weight_plan(model, family, {n: t.to("meta") for n, t in tensors.items()}, hf_config, same)
    return {ours: tensors[name] if transform is None else transform(tensors[name], model.config)
            for ours, (name, transform) in plan.items()}


def weight_plan(model: torch.nn.Module, family: str, tensors: dict[str, torch.Tensor],
                hf_config: dict[str, Any] | None, same: Callable[[str, str], bool],
                ignored: dict[str, str] | None = None) -> dict[str, tuple[str, Any]]:
    """Each of `model`'s parameters (but the tied ones) -> (the checkpoint tensor it comes from, the transform it
    takes), checked against `tensors` (names normalized; meta tensors do: only shapes are read): every parameter
    from exactly one tensor of the right shape after its transform, every tensor used; a copy of a used tensor
    (a tied head written anyway) is accepted where same(copy, name) says it equals it.

    Raises one KvforgeError that lists every missing tensor, every unused one and every shape mismatch. ignored:
    filled with each tensor the plan leaves unread and why (as transformers ignores it on load).
    """
    spec = FAMILIES[family]
    table = spec.weights(hf_config or {}, model.config)
    tied = tied_parameters(model)
    partners = _tied_names(spec.duplicates)
    expected = {n: p.shape for n, p in model.state_dict().items()}
    wanted = [n for n in expected if n not in tied]

    out, used, missing, shapes = {}, set(), [], []
    for ours in wanted:
        name, transform = source_name(table, family, ours)
        if name not in tensors:  # the same tied tensor, saved under another of its names
            name = next((other for other in partners.get(name, ()) if other in tensors), name)
        if name not in tensors:
            missing.append(name)
            continue
        used.add(name)
        try:
            value = tensors[name] if transform is None else transform(tensors[name], model.config)
        except (RuntimeError, ValueError) as e:  # a fused tensor that the config's sizes cannot split
            shapes.append(f"{name}: checkpoint {tuple(tensors[name].shape)} does not fit the config ({ours}: {e})")
            continue
        if tuple(value.shape) != tuple(expected[ours]):
            shapes.append(f"{name}: checkpoint {tuple(value.shape)} vs config {tuple(expected[ours])} ({ours})")
            continue
        out[ours] = (name, transform)
    leftovers = spec.leftovers(model.config)
    extra = sorted(k for k in tensors
                   if k not in used and not any(p.search(k) for p in _IGNORED) and not k.startswith(leftovers))
    # Copies of a used tensor: some exports write the tied head anyway (a copy of the embedding), and some
    # families save one tied tensor under two names. Accept a copy only if it really is equal.
    copies = [(source_name(table, family, ours)[0], source_name(table, family, spec.embedding)[0]) for ours in tied]
    copies += [(a, b) for a, others in partners.items() for b in others]
    differ = []
    for copy, name in copies:
        if copy in extra and name in used:
            extra.remove(copy)
            a, b = tensors[copy], tensors[name]
            if a.shape != b.shape or not same(copy, name):
                differ.append(f"{copy} (tied to {name})")
            elif ignored is not None:
                ignored[copy] = f"a copy of {name} (tied)"
    if missing or extra or shapes or differ:
        lines = []
        if missing:
            lines.append(f"missing tensors ({len(missing)}): {missing}")
        if extra:
            lines.append(f"unexpected tensors ({len(extra)}): {extra}")
        if differ:
            lines.append(f"tied tensors that differ from the tensor they share ({len(differ)}): {differ}")
        if shapes:
            lines.append("shape mismatches:\n    " + "\n    ".join(shapes))
        raise KvforgeError(f"{family} checkpoint does not match its config:\n  " + "\n  ".join(lines))
    if ignored is not None:
        for k in sorted(set(tensors) - used - set(ignored)):
            ignored[k] = ("a buffer transformers does not load" if any(p.search(k) for p in _IGNORED) else
                          "not part of the model this config builds (a head or pooler its task does not use)")
    return out


def codes_for_parameters(model: torch.nn.Module, family: str, quantized: QuantizedCheckpoint,
                         state: dict[str, torch.Tensor], hf_config: dict[str, Any] | None = None) -> QuantizedCheckpoint:
    """The checkpoint's codes under kvforge's parameter names: each tensor's codes carried through the weight
    table's transform where it only selects rows (model_defs/quantized.py: follow), and kept only where they
    dequantize to the imported parameter (`state`, from state_dict_from_hf) bit for bit; the others' parameters
    stay float, each with the reason."""
    spec = FAMILIES[family]
    table = spec.weights(hf_config or {}, model.config)
    partners = _tied_names(spec.duplicates)
    rename = lambda name: normalize_names(family, {name: None}).popitem()[0]  # noqa: E731
    codes = {rename(name): c for name, c in quantized.codes.items()}
    converted = {rename(name): e for name, e in quantized.converted.items()}
    kept_float = {rename(name): why for name, why in quantized.kept_float.items()}
    layouts = {rename(name): fn for name, fn in quantized.layouts.items()}
    out = QuantizedCheckpoint(quantized.format, quantized.config)
    for ours, value in state.items():
        name, transform = source_name(table, family, ours)
        name = next((n for n in [name, *partners.get(name, ())] if n in codes or n in kept_float), name)
        if name in kept_float:
            out.kept_float[ours] = kept_float[name]
        if name not in codes:
            continue
        layout = layouts.get(name)
        if layout is None and transform is None:
            carried = codes[name]
        else:
            carried = follow(codes[name], lambda x, fn=transform, lay=layout: _apply(fn, lay, x, model.config))
        if carried is None:
            out.kept_float[ours] = f"{codes[name].source}: {name}'s transform into this parameter is not a row selection"
        elif not exact(carried, value):
            out.kept_float[ours] = f"{codes[name].source}: the codes do not reproduce the imported {name} bit for bit"
        else:
            out.codes[ours] = carried
            if name in converted:
                out.converted[ours] = converted[name]
    return out


def _apply(transform, layout, x: torch.Tensor, cfg) -> torch.Tensor:
    x = x if layout is None else layout(x)
    return x if transform is None else transform(x, cfg)


# What transformers' generate reads from generation_config.json: the tokens it stops on, and an encoder-decoder's
# first decoder token and forced first / last tokens (transformers 5 writes the forced bos to that file only).
_GENERATION_KEYS = ("eos_token_id", "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id")


def read_hf_config(directory: Path) -> dict[str, Any]:
    """config.json, with generation_config.json's generation ids (_GENERATION_KEYS) over the config's."""
    hf = _read_json(directory / "config.json")
    processor = directory / "preprocessor_config.json"  # an image processor's (vision-language models)
    if processor.is_file() and "preprocessor_config" not in hf:
        hf["preprocessor_config"] = _read_json(processor)
    embedding = read_embedding(directory)  # a sentence-transformers directory's pooling and normalization
    if embedding is not None and "sentence_transformers" not in hf:
        hf["sentence_transformers"] = embedding
    generation = directory / "generation_config.json"
    if generation.is_file():
        gen = _read_json(generation)
        for key in _GENERATION_KEYS:
            if gen.get(key) is not None:
                hf[key] = gen[key]
    return hf


def _read_json(path: Path) -> dict[str, Any]:
    return read_json(path)
