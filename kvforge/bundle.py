"""The artifact bundle: a directory with a manifest (kvforge.json), the graph and the tokenizer.

Every stage reads a bundle and writes a new one; it never edits its input.
Writes are atomic: files go to a temporary directory beside the target,
which is renamed into place only once everything is written and checked,
so a crash or a failed validation leaves no half-written bundle, and an
existing bundle replaced with `force` survives until the new one is whole.

Torch-free: the runtime reads bundles with numpy, onnx and onnxruntime only.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from kvforge.cache import cache_root
from kvforge.errors import KvforgeError
from kvforge.kinds import Kind, kind_of
from kvforge.manifest import validate_manifest
from kvforge.schema import ListOf, RelPath, SchemaError, check
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
    def precision_key(self) -> str:
        """Its Q/DQ format, else its float dtype: what tolerances and tables are keyed by."""
        return self.quantization_format or self.dtype

    @property
    def is_engine(self) -> bool:
        """Written by `kvforge build`: its graph is a serialized TensorRT engine."""
        return is_engine_bundle(self.manifest)

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
    def graph_file(self) -> Path:
        return self.path / self.manifest["graph"]

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
            model = self.load_graph(external_data=True, graph=name)
            weight_reads = {x for node in model.graph.node if node.op_type in _WEIGHT_OPS for x in node.input}
            for init in model.graph.initializer:
                if init.data_type not in _FLOAT_TYPES:
                    continue
                values = numpy_helper.to_array(init).astype(np.float32, copy=False)
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


def file_records(directory: Path) -> dict[str, dict[str, Any]]:
    return {
        p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name != MANIFEST
    }


def check_output_path(out: str | Path, force: bool, inputs: Iterable[str | Path | None] = (), marker: str = MANIFEST) -> Path:
    """Refuse, before any work is done: an output that is or holds one of the inputs or the current directory,
    an existing output (unless force), a non-empty directory kvforge cannot prove it wrote (force replaces only
    those: see owned_entries), an output location that cannot be written. Returns the output's absolute path.

    marker: the file that records what kvforge wrote there (a bundle's manifest; a Triton repository's record).
    """
    out = Path(out)
    target = out.resolve()
    for source in inputs:
        if source is None or not Path(source).exists():  # a preset name is not a path
            continue
        where = Path(source).resolve()
        if where == target or target in where.parents:
            raise KvforgeError(f"the output {out} is, or holds, the input {source}; write the output somewhere else")
        if where in target.parents and Bundle.is_bundle(where):
            raise KvforgeError(f"the output {out} would sit inside the input bundle {source}; write the output somewhere else")
    if out.exists() and not force:
        raise KvforgeError(f"{out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise KvforgeError(f"{out} exists and is not a directory")
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the current directory was removed
        cwd = None
    if out.exists() and cwd is not None and (target == cwd or target in cwd.parents):
        raise KvforgeError(f"the output {out} is the current directory (or holds it): replacing it would leave this "
                           "shell in a removed directory; run the command from outside it")
    if out.is_dir() and any(out.iterdir()):
        owned_entries(out, marker)
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvforgeError(f"cannot create {parent}: {e.strerror or e}") from e
    try:  # a real write: permissions, a read-only filesystem, /proc, a full disk all answer here, before any work
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent))
    except OSError as e:
        raise KvforgeError(f"cannot write to {parent}: {e.strerror or e}") from e
    return target


def owned_entries(directory: Path, marker: str = MANIFEST) -> set[str]:
    """The paths under `directory` that kvforge can prove it wrote, when that is all of them; else KvforgeError.

    Proof is a record that kvforge writes last and that lists every file: a bundle's manifest (valid against the
    bundle schema, its `files` covering every file in the directory) or another output's record (a JSON object
    whose `files` lists every file by relative path). A file name alone is no proof: a directory holding
    anything the record does not list is refused by name, and nothing in it is touched.
    """
    record = directory / marker
    kind = "bundle" if marker == MANIFEST else "output"
    refuse = (f"--force replaces only a {kind} kvforge wrote (or an empty directory); remove it yourself or choose "
              "another output")
    if not record.is_file():
        raise KvforgeError(f"{directory} is a directory but not a kvforge {kind} (no {marker}); {refuse}")
    if marker == MANIFEST:
        try:
            listed = set(Bundle(directory).manifest["files"])
        except KvforgeError as e:
            raise KvforgeError(f"{directory} holds a {marker} that is not a valid bundle manifest ({e}); {refuse}") from e
    else:
        listed = _record_files(record)
        if listed is None:
            raise KvforgeError(f"{directory} holds a {marker} that does not list the files kvforge wrote; {refuse}")
    listed.add(marker)
    found = _tree(directory)
    folders = {p.as_posix() for name in listed for p in Path(name).parents if p != Path(".")}
    # Python writes bytecode beside a module it imports (a Triton repository's model.py, once served)
    bytecode = {(Path(name).parent / "__pycache__").as_posix() for name in listed if name.endswith(".py")}
    stray = sorted(p for p, is_dir in found.items()
                   if p not in listed and not (is_dir and p in folders | bytecode)
                   and not (not is_dir and Path(p).parent.as_posix() in bytecode and p.endswith(".pyc")))
    if stray:
        shown = ", ".join(stray[:5]) + (f" and {len(stray) - 5} more" if len(stray) > 5 else "")
        raise KvforgeError(f"{directory} holds files its {marker} does not list ({shown}); {refuse}")
    return set(found)


def _record_files(record: Path) -> set[str] | None:
    try:
        files = json.loads(record.read_text(encoding="utf-8"))["files"]
        check(files, ListOf(RelPath(directories=True)), "files")
    except (OSError, ValueError, KeyError, TypeError, SchemaError):  # SchemaError is a ValueError too
        return None
    return set(files)


def _tree(directory: Path) -> dict[str, bool]:
    """Every path under directory (relative, '/'-separated) -> whether it is a real directory (links are files)."""
    found = {}
    for root, dirs, files in os.walk(directory):
        rel = Path(root).relative_to(directory)
        for name in dirs:
            p = Path(root) / name
            found[(rel / name).as_posix()] = not p.is_symlink()
        for name in files:
            found[(rel / name).as_posix()] = False
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
    return found


@contextlib.contextmanager
def staged_bundle(out: str | Path, force: bool = False, inputs: Iterable[str | Path | None] = (),
                  marker: str = MANIFEST) -> Iterator[Path]:
    """Yield a temporary directory; on success it becomes `out`, on any error it vanishes.

    The caller writes the files and finally `write_manifest`; an existing
    `out` (with force) is replaced only after the block completes, in one step
    where the OS can swap two directories (Linux), so a process killed at any
    point leaves either the previous bundle or the new one at `out`. A bundle
    that another process wrote at `out` meanwhile is not replaced without
    force. What a killed process left beside `out` is cleared by the next
    write there.
    """
    out = check_output_path(out, force, inputs, marker)
    parent = out.parent
    _clear_leftovers(out, marker)
    existed = out.exists()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=parent))
    try:
        yield tmp
        if not (tmp / marker).is_file():
            raise KvforgeError(f"internal error: an output was staged without its {marker}")
        if out.exists() and not (existed and force):
            raise KvforgeError(f"{out} was written by another process while this one ran; it is left as that process "
                               "wrote it (pass --force to replace it)")
        if out.exists():
            if _exchange(tmp, out):
                shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous bundle
                return
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            moved = False
            try:
                os.replace(out, old)
                moved = True
                os.replace(tmp, out)
            except BaseException:
                if moved and not out.exists():  # interrupted between the two renames: the previous bundle goes back
                    os.replace(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, out)
            except OSError as e:  # another process made `out` between the check above and now
                raise KvforgeError(f"{out} was written by another process while this one ran ({e.strerror}); it is "
                                   "left as that process wrote it") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the OS cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import errno

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # an older kernel, or a filesystem without it
        return False
    raise OSError(err, os.strerror(err), str(b))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _clear_leftovers(out: Path, marker: str = MANIFEST) -> None:
    """Remove what a killed writer of `out` left beside it: its staging directory, and a previous bundle it had
    moved aside (put back when `out` itself is missing)."""
    for leftover in out.resolve().parent.glob(f".{glob.escape(out.name)}.*-*"):
        kind, _, rest = leftover.name[len(out.name) + 2:].partition("-")
        pid = rest.split("-")[0]
        if kind not in ("tmp", "old") or not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == "old" and not out.exists() and (leftover / marker).is_file():
            os.replace(leftover, out)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Complete the manifest with the file records and write it (last, after every file)."""
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "files": file_records(directory)}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest
