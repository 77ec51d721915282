"""The artifact bundle: a directory with a manifest (kvforge.json), the graph and the tokenizer.

Every stage reads a bundle and writes a new one; it never edits its input.
Writes are atomic (kvforge/outputs.py): a bundle is staged beside its target
and renamed into place whole, its manifest written last (`write_manifest`).

Torch-free: the runtime reads bundles with numpy, onnx and onnxruntime only.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.cache import cache_root
from kvforge.errors import KvforgeError
from kvforge.kinds import Kind, kind_of
from kvforge.manifest import check_file_name, session_format, validate_manifest
from kvforge.schema import SchemaError
from kvforge.tensorrt_env import is_engine_bundle

MANIFEST = "kvforge.json"
_FLOAT_TYPES = {1, 10, 11, 16}  # onnx TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16
# ops whose initializer inputs are a model's weights (projections, embeddings, norms' scales, quantized codes' scales)
_WEIGHT_OPS = {"MatMul", "Gemm", "Gather", "Conv", "DequantizeLinear", "MatMulNBits", "LayerNormalization",
               "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization", "Mul", "Add"}
FORMAT = "kvforge-bundle"
FORMAT_VERSION = 1

# The IO contract's symbolic dimensions (docs/design.md). total = past + sequence.
BATCH, SEQ, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"
IMAGES, FEATURE_ROWS = "images", "image_feature_rows"  # a vision-language model's images; its feature rows
HEIGHT, WIDTH = "height", "width"  # a vision graph's image sides, where the processing keeps each image's size
IMAGE_TOKENS = "image_tokens"  # a vision graph's features per image, where each image's patch grid decides them
# a vision-language model's graph inputs: the vision graph's pixels, the decoder's feature rows and (multimodal RoPE)
# its position offsets
PIXELS, FEATURES, OFFSETS = "pixel_values", "image_features", "rope_offsets"


def window_dims(window: int) -> tuple[str, str]:
    """The dimensions of a capped cache of `window` positions: its past holds min(past, W) positions
    (`past_sequence_length_wW`), its present min(total, W) (`total_sequence_length_wW`)."""
    return f"{PAST}_w{window}", f"{TOTAL}_w{window}"


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tree(paths: list[Path], root: Path | None = None) -> str:
    """One digest over several files (names relative to root, and contents)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(root) if root else p.name).encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


@dataclass
class TensorSpec:
    """One graph input or output: name, dtype (numpy name), symbolic/static shape."""

    name: str
    dtype: str
    shape: list[str | int]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(d["name"], d["dtype"], list(d["shape"]))


@dataclass
class IOSpec:
    """The graph's inputs and outputs, and which of them carry the KV cache.

    `past[i]` / `present[i]` name the cache tensors of layer i (for per-head
    K/V: [key, value]). The runtime reads these names; it never guesses them.
    `windows[i]` is layer i's sliding window W when its cache is capped (a
    rolling buffer of the last W positions: see `window_dims`), else None.
    """

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    past: list[list[str]]
    present: list[list[str]]
    cache_layout: str = "batch,kv_heads,seq,head_dim"
    max_context: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    windows: list[int | None] | None = None

    def __post_init__(self):
        if self.windows is None:
            self.windows = [None] * len(self.past)
        if len(self.windows) != len(self.past) or any(
                w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1) for w in self.windows):
            raise KvforgeError(f"kv_cache windows {self.windows} must give one positive int or null per layer ({len(self.past)})")

    def to_dict(self) -> dict[str, Any]:
        kv_cache = {"past": self.past, "present": self.present, "layout": self.cache_layout}
        if any(w is not None for w in self.windows):
            kv_cache["windows"] = self.windows
        return {
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "kv_cache": kv_cache,
            "max_context": self.max_context,
            **({"extra": self.extra} if self.extra else {}),
        }

    def dim_values(self, batch: int, seq: int, past: int) -> dict[str, int]:
        """Every symbolic dimension's value for a step of `seq` tokens over a past of `past`."""
        values = {BATCH: batch, SEQ: seq, PAST: past, TOTAL: past + seq}
        for w in {w for w in self.windows if w is not None}:
            past_w, total_w = window_dims(w)
            values[past_w], values[total_w] = min(past, w), min(past + seq, w)
        return values

    @property
    def feature_token(self) -> int | None:
        """The token id whose positions take the graph's image feature rows (a vision-language decoder's), else None."""
        vision = self.extra.get("vision")
        return int(vision["image_token_id"]) if vision else None

    def cache_lengths(self, past: int) -> list[int]:
        """How many positions each layer's cache holds after `past` tokens."""
        return [past if w is None else min(past, w) for w in self.windows]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> IOSpec:
        try:
            return cls(
                inputs=[TensorSpec.from_dict(t) for t in d["inputs"]],
                outputs=[TensorSpec.from_dict(t) for t in d["outputs"]],
                past=d["kv_cache"]["past"],
                present=d["kv_cache"]["present"],
                cache_layout=d["kv_cache"].get("layout", "batch,kv_heads,seq,head_dim"),
                max_context=d.get("max_context"),
                extra=d.get("extra", {}),
                windows=d["kv_cache"].get("windows"),
            )
        except (KeyError, TypeError) as e:
            raise KvforgeError(f"malformed IO spec in manifest: missing {e}") from e

    def empty_shape(self, name: str, batch: int) -> list[int]:
        """The shape of cache input `name` holding no positions: [batch, heads, 0, features] (per-head K/V or a
        latent: the spec's static dims say which)."""
        shape = self.input(name).shape
        return [batch, int(shape[1]), 0, int(shape[3])]

    def cache_shapes(self, batch: int) -> dict[str, list[int]]:
        """Every cache input's empty shape, in IO order."""
        return {n: self.empty_shape(n, batch) for layer in self.past for n in layer}

    def input(self, name: str) -> TensorSpec:
        for t in self.inputs:
            if t.name == name:
                return t
        raise KvforgeError(f"the graph has no input {name!r}; inputs: {[t.name for t in self.inputs]}")


class Bundle:
    """A bundle directory and its manifest."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest = self.path / MANIFEST
        if not self.path.is_dir():
            raise KvforgeError(f"{self.path} is not a bundle directory")
        if not manifest.is_file():
            raise KvforgeError(f"{self.path} is not a kvforge bundle: no {MANIFEST}")
        try:
            self.manifest: dict[str, Any] = json.loads(manifest.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise KvforgeError(f"{manifest} is not valid JSON: {e}") from e
        if isinstance(self.manifest, dict) and "format" not in self.manifest:
            raise KvforgeError(f"{manifest} is damaged: 'format' is missing (a kvforge bundle's says {FORMAT!r})")
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            found = self.manifest.get("format") if isinstance(self.manifest, dict) else type(self.manifest).__name__
            raise KvforgeError(f"{manifest}: format {found!r} is not {FORMAT!r}")
        version = self.manifest.get("format_version", 0)
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise KvforgeError(f"{manifest}: bundle format {version} is newer than this kvforge reads ({FORMAT_VERSION})")
        validate_manifest(self.manifest, str(manifest))
        try:
            IOSpec.from_dict(self.manifest["io"])
        except (KvforgeError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise KvforgeError(f"{manifest} is damaged: its io entry does not read ({type(e).__name__}: {e})") from e
        self._graphs = _graphs_of(self.manifest, str(manifest))

    # -- the typed face: what stages ask of a bundle, read from the validated manifest -----------------------
    @property
    def architecture(self) -> str:
        return self.kind.name

    @property
    def kind(self) -> Kind:
        """What this bundle's model kind can do (kvforge/kinds.py): stages ask it, never the kind's name."""
        return kind_of(self.manifest["model"])

    @property
    def dtype(self) -> str:
        """The float dtype of the graph's computation (float32, float16, bfloat16)."""
        return self.manifest["precision"]["dtype"]

    @property
    def quantization(self) -> dict[str, Any] | None:
        """The quantization record (format, weights, activations, ...), or None for a float bundle."""
        return self.manifest["precision"].get("quantization")

    @property
    def quantization_format(self) -> str | None:
        return (self.quantization or {}).get("format")

    @property
    def session_format(self) -> str | None:
        """How ONNX Runtime must be told to run its Q/DQ (kvforge.ort_session.QUANT_SESSION_CONFIG): the format,
        except that weight-only INT8 is "int8-weights" (no activation Q/DQ to fuse, and its block-wise weights must
        not become MatMulNBits, which would quantize the activations)."""
        q = self.quantization or {}
        return session_format(q.get("format"), bool(q.get("weight_only")))

    @property
    def precision_key(self) -> str:
        """Its Q/DQ format, else its float dtype: what tolerances and tables are keyed by."""
        return self.quantization_format or self.dtype

    @property
    def is_engine(self) -> bool:
        """Written by `kvforge build`: its graph is a serialized TensorRT engine."""
        return is_engine_bundle(self.manifest)

    @property
    def graph_sha256(self) -> str | None:
        """The sha256 the manifest records for the graph file: the model's identity (caches, lineage, a repository's
        record), None where it records none."""
        return self.manifest.get("files", {}).get(self.manifest.get("graph"), {}).get("sha256")

    @property
    def recorded_source(self) -> str | None:
        """The model source the first stage read (a preset name or a checkpoint path), when recorded."""
        lineage = self.manifest.get("lineage") or [{}]
        return (lineage[0].get("input") or {}).get("source")

    @staticmethod
    def is_bundle(path: str | Path) -> bool:
        return (Path(path) / MANIFEST).is_file()

    @property
    def io(self) -> IOSpec:
        return IOSpec.from_dict(self.manifest["io"])

    @property
    def model_config(self) -> dict[str, Any]:
        return self.manifest["model"]

    @property
    def text_config(self) -> dict[str, Any]:
        """The config of the model's text side (a vision-language model's decoder; the model itself elsewhere)."""
        nested = self.kind.text_config
        return self.model_config[nested] if nested else self.model_config

    @property
    def graph_file(self) -> Path:
        return self.path / self.manifest["graph"]

    @property
    def graphs(self) -> dict[str, str]:
        """The bundle's graphs, role -> file: its kind's graph_roles ("model" for one graph; "encoder" or "vision",
        and "decoder", for two), `graph` among them. Every reader asks this, for every bundle (docs/bundle.md)."""
        return dict(self._graphs)

    @property
    def tokenizer_file(self) -> Path | None:
        """tokenizer.json, or None for a bundle made without one; one the manifest lists but the disk lacks is damage."""
        p = self.path / "tokenizer.json"
        if p.is_file():
            return p
        if "tokenizer.json" in self.manifest.get("files", {}):
            raise KvforgeError(f"bundle {self.path} is damaged: tokenizer.json is missing")
        return None

    def load_graph(self, external_data: bool = True, graph: str | None = None):
        """The graph (an onnx ModelProto; `graph`: another of the bundle's graphs by file name), after checking
        that its external weights lie inside this bundle: a location that is absolute or climbs out with '..' is
        refused before any loader follows it."""
        import onnx
        from onnx.external_data_helper import _get_all_tensors, uses_external_data

        graph_file = self.path / graph if graph else self.graph_file
        try:
            model = onnx.load(str(graph_file), load_external_data=False)
        except Exception as e:  # protobuf DecodeError, a missing file, ...
            raise KvforgeError(f"{graph_file} is not a readable ONNX model: {e}") from e
        root = self.path.resolve()
        for tensor in _get_all_tensors(model):
            if not uses_external_data(tensor):
                continue
            location = next((e.value for e in tensor.external_data if e.key == "location"), "")
            target = (root / location).resolve()
            if os.path.isabs(location) or root not in target.parents:
                raise KvforgeError(f"{graph_file} keeps the weights of {tensor.name!r} as external data at "
                                   f"{location!r}, outside the bundle; refusing to read them")
            if not target.is_file():
                raise KvforgeError(f"bundle {self.path} is damaged: the external data file {location} that "
                                   f"{graph_file.name} names is missing")
        if external_data:
            from onnx.external_data_helper import load_external_data_for_model

            load_external_data_for_model(model, str(root))
        return model

    def verify_files(self) -> None:
        """Check every file the manifest lists against its recorded size and hash."""
        problems = self._size_problems()
        if not problems:
            for name, meta in self.manifest["files"].items():
                if sha256_file(self.path / name) != meta["sha256"]:
                    problems.append(f"{name} does not match its recorded sha256")
        if problems:
            raise KvforgeError(f"bundle {self.path} is damaged: " + "; ".join(problems))

    def _size_problems(self) -> list[str]:
        problems = []
        for name, meta in self.manifest["files"].items():
            p = self.path / name
            if p.is_symlink() or not p.is_file():
                problems.append(f"{name} is missing" if not p.is_symlink() else f"{name} is a link, not the bundle's own file")
            elif p.stat().st_size != meta["bytes"]:
                problems.append(f"{name} has {p.stat().st_size} bytes, the manifest says {meta['bytes']}")
        return problems

    def verify(self, full: bool = False) -> None:
        """What is checked before a bundle runs or feeds another stage.

        Always (a stat per file): every recorded file is there with its recorded size. The first time a
        bundle's files are seen in their present state (path, size, inode, mtime and ctime of each, recorded
        under $KVFORGE_CACHE/verified), and whenever `full`: every file's sha256 against the manifest, and every
        float initializer of its ONNX graphs finite. So a file rewritten in place (even to the same size, even
        with its mtime put back: the ctime still moves) is hashed again before anything derived from it, such
        as a cached ORT variant, is used.
        """
        problems = self._size_problems()
        if problems:
            raise KvforgeError(f"bundle {self.path} is damaged: " + "; ".join(problems))
        state = self._file_state()
        record = self._verified_record()
        if not full and record is not None and record.is_file():
            try:
                if json.loads(record.read_text()) == state:
                    return
            except (OSError, ValueError):
                pass
        self.verify_files()
        self.check_finite()
        if record is not None:
            try:
                record.parent.mkdir(parents=True, exist_ok=True)
                record.write_text(json.dumps(state))
            except OSError:
                pass  # no record: the next load verifies in full again

    def _file_state(self) -> dict[str, list[int]]:
        state = {}
        for name in sorted(self.manifest["files"]):
            st = (self.path / name).stat()
            state[name] = [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
        return state

    def _verified_record(self) -> Path | None:
        key = hashlib.sha256(str(self.path.resolve()).encode()
                             + json.dumps(self.manifest["files"], sort_keys=True).encode()).hexdigest()[:32]
        try:
            return cache_root() / "verified" / f"{key}.json"
        except KvforgeError:
            return None

    def onnx_files(self) -> list[str]:
        """The bundle's ONNX graphs (an engine bundle has none)."""
        return [name for name in self.manifest["files"] if name.endswith(".onnx")]

    def check_finite(self) -> None:
        """Refuse a bundle whose graphs hold NaN weights, or infinite ones where a weight is read (they run, and
        generate garbage). An infinite constant elsewhere is the graph's own (a mask's -inf, a routing bound)."""
        from onnx import numpy_helper

        bad = {}
        for name in self.onnx_files():
            model = self.load_graph(external_data=False, graph=name)  # each weight is read alone
            weight_reads = {x for node in model.graph.node if node.op_type in _WEIGHT_OPS for x in node.input}
            for init in model.graph.initializer:
                if init.data_type not in _FLOAT_TYPES:
                    continue
                values = numpy_helper.to_array(init, str(self.path)).astype(np.float32, copy=False)
                count = int(np.isnan(values).sum())
                if init.name in weight_reads and values.size > 1:
                    count += int(np.isinf(values).sum())
                if count:
                    bad[f"{name}:{init.name}"] = count
            del model
        if bad:
            listed = ", ".join(f"{k} holds {n} NaN or infinite values" for k, n in sorted(bad.items())[:3])
            raise KvforgeError(f"bundle {self.path} is damaged: {listed}"
                               + (f" (and {len(bad) - 3} more tensors)" if len(bad) > 3 else "")
                               + "; re-export it from a finite checkpoint")


def _graphs_of(manifest: dict[str, Any], where: str) -> dict[str, str]:
    """The manifest's `graphs` (validated by the schema); for a manifest written before export always wrote it,
    the same map from where it kept its graphs: a one-graph bundle's is `graph`; an encoder-decoder's encoder and
    a vision-language model's vision graph are named in io.extra beside their IO, the decoder is `graph`. This is
    the one place that knows those layouts."""
    if "graphs" in manifest:
        return dict(manifest["graphs"])
    kind = kind_of(manifest["model"])
    if not kind.multi_graph:
        return {kind.graph_roles[0]: manifest["graph"]}
    side, main = kind.graph_roles  # ("encoder" or "vision", "decoder")
    spec = manifest["io"].get("extra", {}).get(side)
    name = spec.get("graph") if isinstance(spec, dict) else None
    if not isinstance(name, str) or name not in manifest["files"]:
        raise KvforgeError(f"{where} is damaged: it has no 'graphs' entry, and its io.extra.{side}.graph "
                           f"({name!r}) is not one of the bundle's recorded files")
    return {side: name, main: manifest["graph"]}


def file_records(directory: Path, under: str | None = None) -> dict[str, dict[str, Any]]:
    """Every file in the bundle at `directory` but its manifest, by its '/'-separated path inside the bundle (the
    adapters' adapters/NAME/FILE too), with its bytes and sha256; under: only those in that subdirectory. A
    hidden directory (`kvforge lora add` staging an adapter, or removing one) is not the bundle's yet, or any
    more: it is left out. A file the manifest could not list (in another subdirectory) is refused by name."""
    directory = Path(directory)
    top = directory / under if under else directory
    records = {}
    for root, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # os.walk follows no link to a directory
        for name in files:
            p = Path(root) / name
            if not p.is_file() or p == directory / MANIFEST:
                continue
            rel = p.relative_to(directory).as_posix()
            try:
                check_file_name(rel, rel)
            except SchemaError as e:
                raise KvforgeError(f"{directory} holds {rel}, which a bundle's manifest cannot list: it {e.problem}; "
                                   "remove it") from e
            records[rel] = {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    return dict(sorted(records.items()))


def write_manifest(directory: Path, manifest: dict[str, Any], files: dict[str, dict[str, Any]] | None = None
                   ) -> dict[str, Any]:
    """Complete the manifest with the file records (file_records: every file in the bundle) and write it (last,
    after every file; in one rename, so a reader of a bundle in use sees the old manifest or the new one).
    files: the records to write instead (those write_manifest returned before, where no file but the manifest
    changed since: an entry added after a check that reads the written bundle)."""
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest,
                "files": file_records(directory) if files is None else files}
    staged = directory / f".{MANIFEST}.tmp-{os.getpid()}"
    try:
        staged.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        os.replace(staged, directory / MANIFEST)
    finally:
        staged.unlink(missing_ok=True)
    return manifest
