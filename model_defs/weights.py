"""Weights read where they are used: a model's structure without its weights, and a source that reads each of
its parameters from the checkpoint on demand (docs/design.md, "Export that streams its weights").

A model of billions of parameters does not fit twice in a workstation's memory, and export holds it several
times over when it loads it whole (an FP32 reference, an FP64 copy, the traced graph's weights, the session that
validates it). Here the model is built as a *skeleton*: its modules, buffers and configuration as `build` makes
them, and every parameter a placeholder of its shape and dtype that holds one element (a zero-stride view). A
`WeightSource` reads any parameter by name: from a Hugging Face directory's safetensors shards, one tensor at a
time with plain reads into one reused buffer (not memory-mapped, so the page cache is not counted as the
process's memory), each mapped by the family's weight table as `load` maps it and checked finite once.

- `streamed(model, source, dtype)` makes a skeleton compute: each module of its blocks reads its own weights
  when it runs and lets them go after, and what is outside the blocks (embeddings, final norm, head) for the
  model's forward; so about one matrix's weights are held at a time (with the released buffers kept for reuse,
  one of each shape), in any dtype (the float64 reference of validation too).
- `for_tracing(model, dtype, source)` gives a copy whose parameters are uninitialized memory that is never
  written (the kernel backs it by no page) and each tagged with its lazy value for the ONNX graph
  (`lazy_tensor`): torch.onnx traces it without reading a weight, and the graph's initializers are read from
  the source one at a time as the file is written (export/lazy_weights.py).

The values are those `load` gives: each checkpoint tensor mapped by the weight table's transform in its own
dtype, then made float32 (the reference), then cast to the dtype asked for.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import struct
import weakref
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from kvforge.errors import KvforgeError
from kvforge.resources import release_freed_memory

# what a checkpoint's source keeps of the values it read (WeightSource.keep_bytes): a small model is read once,
# a large one streamed past it
KEEP_BYTES = 768 << 20
# the largest read buffer a reader keeps for its next reads (a block's weights, read on every forward of a streamed
# reference); a larger tensor is read into memory of its own: kept, Gemma 3's 671 MB embedding (read whole to
# write it and to match its codes) stayed resident through the whole export
KEEP_BUFFER_BYTES = 256 << 20
_LAZY = "_kvforge_lazy"  # the attribute of a traced parameter that holds its lazy graph value

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class WeightSource:
    """A model's parameters by name (the untied ones: a tied head reads the embedding's), read on demand.

    shapes: name -> shape. read(name) -> the parameter's value in its checkpoint's dtype after the family's
    transform (float32 is the reference's: `load` makes every value float32 before any other cast); it may be
    a view of a buffer the next read reuses, or the model's own tensor for a source in memory: read copies it.
    read_rows(name, rows) -> some rows of it alone (same terms), or None where the source cannot."""

    def __init__(self, shapes: dict[str, torch.Size], read: Callable[[str], torch.Tensor], origin: str,
                 keep_bytes: int = 0, read_rows: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None,
                 scratch_bytes: int = 0):
        self.shapes = shapes
        self.scratch_bytes = scratch_bytes  # what its reader writes to a scratch file once all is read (resources)
        self._read = read
        self._read_rows = read_rows
        self.origin = origin
        # float32 values kept once read, when all of them fit in keep_bytes (a small model is then read once, its
        # other dtypes cast from them; a large one streams: keeping a part would cost memory where it is short
        # and save little)
        self.keep = self.nbytes(torch.float32) <= keep_bytes
        self._kept: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def read(self, name: str, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None,
             copy: bool = True) -> torch.Tensor:
        """The weight `name` in `dtype` (the reference's float32 values cast), into `out` when given. copy=False:
        where no cast is needed, the reader's own value, which may be a view of a buffer the next read reuses
        (for a caller done with it before then: a weight written out, or compared, as it is read)."""
        kept = self._kept.get((name, dtype))
        if kept is None:
            if name not in self.shapes:
                raise KvforgeError(f"{self.origin} has no weight {name!r}")
            base = self._kept.get((name, torch.float32))  # another dtype of a value kept: cast from it
            value = self._read(name) if base is None else base
            if tuple(value.shape) != tuple(self.shapes[name]):
                raise KvforgeError(f"{self.origin}: {name} reads as {tuple(value.shape)}, not "
                                   f"{tuple(self.shapes[name])}")
            if self.keep and base is None:
                base = self._kept[(name, torch.float32)] = _cast(value, torch.float32)
            if dtype != torch.float32 or base is None:
                value = value if base is None else base
                if not copy and out is None and value.dtype == dtype:
                    return value
                return _cast(value, dtype, out)
            kept = base
        return kept if out is None else out.copy_(kept)

    def read_rows(self, name: str, rows: torch.Tensor, dtype: torch.dtype = torch.float32,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `rows` (sorted, distinct) of a weight: read alone where the source can (a table stored as is),
        else cut from the whole value."""
        for kept_dtype in (dtype, torch.float32):
            kept = self._kept.get((name, kept_dtype))
            if kept is not None:
                return _cast(kept[rows], dtype, out)
        value = self._read_rows(name, rows) if self._read_rows is not None and not self.keep else None
        if value is None:
            return _cast(self.read(name, dtype)[rows], dtype, out)
        return _cast(value, dtype, out)

    def nbytes(self, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum(int(torch.Size(s).numel()) * size for s in self.shapes.values())


def _cast(value: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """`value` in `dtype` as the reference makes it (float32 first), into `out` or a new tensor."""
    if value.is_floating_point() and value.dtype not in (torch.float32, torch.float64) \
            and dtype not in (torch.float32, torch.float64):
        value = value.float()  # bfloat16 -> float16 as load -> .to(float16) rounds: through float32
    if out is None:
        return value.to(dtype, copy=True)
    return out.copy_(value)


class SafetensorsShards:
    """The tensors of safetensors files, read one at a time from their headers' offsets (no memory map), into
    one buffer that each read reuses (fresh memory each time would cost a page fault per page)."""

    scratch_bytes = 0  # read where they lie: no scratch file

    def __init__(self, files: list[Path]):
        self.checked: set[str] = set()  # tensors found finite (each checked whole on its first read)
        self._fds: dict[Path, int] = {}
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self.entries: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        for f in files:
            try:
                with open(f, "rb") as fh:
                    (size,) = struct.unpack("<Q", fh.read(8))
                    if size > 100 << 20:
                        raise ValueError(f"a header of {size} bytes")
                    header = json.loads(fh.read(size))
            except (OSError, ValueError, struct.error) as e:
                raise KvforgeError(f"cannot read {f}: not a safetensors file ({e})") from e
            data = 8 + size
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if name in self.entries:
                    raise KvforgeError(f"tensors ['{name}'] appear in more than one shard ({f.name})")
                dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
                if dtype is None:
                    raise KvforgeError(f"{f}: {name} has dtype {entry.get('dtype')!r}, which kvforge does not read")
                begin, end = entry["data_offsets"]
                self.entries[name] = (f, dtype, tuple(entry["shape"]), data + begin, end - begin)

    def read_meta(self, name: str) -> torch.Tensor:
        """The tensor's shape and dtype, on the meta device."""
        _, dtype, shape, _, _ = self.entries[name]
        return torch.empty(shape, dtype=dtype, device="meta")

    def read(self, name: str, copy: bool = False) -> torch.Tensor:
        """The tensor `name`: a view of the shared buffer the next read overwrites (copy: a tensor of its own)."""
        return self.read_rows(name, None, copy)

    def read_rows(self, name: str, rows: torch.Tensor | None, copy: bool = False) -> torch.Tensor:
        """Rows of a tensor (sorted, distinct; None: all), each run of consecutive rows read at once."""
        f, dtype, shape, offset, length = self.entries[name]
        if name not in self.checked and rows is not None:  # a whole read is checked as it is read, below
            self._check(name)
        row = length // shape[0] if shape and shape[0] else length
        runs = [(0, shape[0] if shape else 1)] if rows is None else _runs(rows.tolist())
        count = sum(n for _, n in runs)
        size = count * row
        buffer = torch.empty(size, dtype=torch.uint8) if copy else self._scratch(size)
        at = 0
        for first, n in runs:
            self._pread(f, name, buffer[at:at + n * row], offset + first * row)
            at += n * row
        out_shape = tuple(shape) if rows is None else (count, *shape[1:])
        if not size:
            return torch.empty(out_shape, dtype=dtype)
        value = buffer.view(dtype).reshape(out_shape)
        if name not in self.checked:
            self._checked(name, count_non_finite(value))
        return value

    def _check(self, name: str) -> None:
        """NaN or infinity anywhere in the tensor is refused (read whole once, 64 MiB at a time; an integer tensor
        holds none and is not read)."""
        f, dtype, shape, offset, length = self.entries[name]
        size = torch.empty((), dtype=dtype).element_size()
        total, step, bad = length // size if dtype.is_floating_point else 0, max(1, (64 << 20) // size), 0
        for start in range(0, total, step):
            part = self._scratch(min(step, total - start) * size)
            self._pread(f, name, part, offset + start * size)
            bad += count_non_finite(part.view(dtype))
        self._checked(name, bad)

    def _checked(self, name: str, bad: int) -> None:
        """`name` recorded as checked, or refused where it holds `bad` NaN or infinite values."""
        if bad:
            raise KvforgeError(f"{self.entries[name][0]} is damaged: {name} holds {bad} NaN or infinite values")
        self.checked.add(name)

    def _scratch(self, size: int) -> torch.Tensor:
        if size > KEEP_BUFFER_BYTES:  # a vocabulary table: memory of its own, given back once its reader drops it
            return torch.empty(size, dtype=torch.uint8)
        if self._buffer.numel() < size:
            self._buffer = torch.empty(size, dtype=torch.uint8)
        return self._buffer[:size]

    def _pread(self, f: Path, name: str, into: torch.Tensor, offset: int) -> None:
        fd = self._fds.get(f)
        if fd is None:
            fd = self._fds[f] = os.open(f, os.O_RDONLY)
        view, done = memoryview(into.numpy()), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise KvforgeError(f"{f} is truncated: {name} ends past the file's end")
            done += n

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)


class TorchPickleShards:
    """The tensors of PyTorch checkpoint files (pytorch_model.bin and its shards), read with
    torch.load(weights_only=True): the unpickler builds tensors and plain containers only and never runs code
    from the file (anything else is refused). Memory-mapped where the file is torch's zip format, so a tensor's
    pages are read where it is read; the same reads as SafetensorsShards'."""

    scratch_bytes = 0

    def __init__(self, files: list[Path]):
        import pickle

        self.checked: set[str] = set()
        self.entries: dict[str, torch.Tensor] = {}
        self.files: dict[str, Path] = {}
        for f in files:
            try:
                try:
                    state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as e:  # a legacy (pre-zip) file cannot be mapped: read whole
                    if "mmap" not in str(e):
                        raise
                    state = torch.load(f, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as e:
                first = str(e).split(". ")[0].splitlines()[0]
                raise KvforgeError(f"{f} cannot be read as tensors alone: torch.load(weights_only=True) refuses it "
                                   f"({first}); kvforge runs no code from a checkpoint") from e
            except (OSError, RuntimeError, EOFError) as e:
                raise KvforgeError(f"cannot read {f}: {e}") from e
            if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
                raise KvforgeError(f"{f} is not a state dict (tensor name -> tensor): it holds {type(state).__name__}")
            for name, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise KvforgeError(f"{f}: {name} is a {type(value).__name__}, not a tensor")
                if name in self.entries:
                    raise KvforgeError(f"tensors ['{name}'] appear in more than one shard ({f.name})")
                self.entries[name], self.files[name] = value, f

    def read_meta(self, name: str) -> torch.Tensor:
        value = self.entries[name]
        return torch.empty(value.shape, dtype=value.dtype, device="meta")

    def read(self, name: str, copy: bool = False) -> torch.Tensor:
        return self.read_rows(name, None, copy)

    def read_rows(self, name: str, rows: torch.Tensor | None, copy: bool = False) -> torch.Tensor:
        value = self.entries[name]
        if name not in self.checked:  # NaN or infinity anywhere is refused, as in a safetensors file
            bad = count_non_finite(value)
            if bad:
                raise KvforgeError(f"{self.files[name]} is damaged: {name} holds {bad} NaN or infinite values")
            self.checked.add(name)
        if rows is not None:
            return value[rows]
        return value.clone() if copy else value


class ScratchTensors(SafetensorsShards):
    """Tensors written once to an unlinked temporary file (under TMPDIR) and read back as a shard's are
    (SafetensorsShards' reads: one reused buffer, some rows alone where asked): values that cost far more to make
    again than to read back (a GGUF tensor's decoding: ~15 ns a value here against ~1 for a read), kept without
    holding them in memory. The file has no name, so it goes with the process however it ends."""

    def __init__(self):
        super().__init__([])
        self._file: Path | None = None  # the name it had, the key of its descriptor in _fds
        self._end = 0

    def add(self, name: str, value: torch.Tensor) -> None:
        """Append `value` (checked by its maker: it is read back unchecked)."""
        import tempfile

        data = value.detach().contiguous().reshape(-1).view(torch.uint8)
        view, done = memoryview(data.numpy()), 0
        try:
            if self._file is None:
                fd, path = tempfile.mkstemp(prefix="kvforge-scratch-")
                self._file = Path(path)
                self._fds[self._file] = fd  # closed with the object, whatever happens next
                os.unlink(path)
            while done < len(view):
                done += os.pwrite(self._fds[self._file], view[done:], self._end + done)
        except OSError as e:
            raise KvforgeError(f"cannot keep the decoded {name} ({len(view) / 2**20:.0f} MiB) in a scratch file under "
                               f"{tempfile.gettempdir()}: {e.strerror or e}; point TMPDIR at a disk with room") from e
        self.entries[name] = (self._file, value.dtype, tuple(value.shape), self._end, len(view))
        self.checked.add(name)
        self._end += len(view)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


FINITE_CHECK_VALUES = 4 << 20  # values count_non_finite checks at a time


def count_non_finite(values: torch.Tensor) -> int:
    """How many NaN or infinite values a tensor holds (0 for integers; FP8 counted through float32), counted a
    slice of its first axis at a time: torch.isfinite makes |x| and two masks of its input's size (Gemma 3's
    262k-row embedding, 0.67 GB of float32, took 1.2 GB more to check whole)."""
    if not values.is_floating_point():
        return 0
    if values.dim() == 0:
        values = values.reshape(1)
    step = max(1, FINITE_CHECK_VALUES // max(1, values[0].numel()))
    return sum(int((~torch.isfinite(part if part.element_size() > 1 else part.float())).sum())
               for part in values.split(step))


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct row numbers -> (first, count) of each run of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][0] + runs[-1][1] == r:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((r, 1))
    return runs


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """Modules built inside leave their parameters as allocated (torch.empty: memory no page backs until it is
    written) instead of initializing them: building a model to load or stream its weights costs nothing."""
    names = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
             "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
    saved = {n: getattr(nn.init, n) for n in names if hasattr(nn.init, n)}
    try:
        for n in saved:
            setattr(nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` and `dtype` that holds one element (every index reads it)."""
    return torch.zeros((), dtype=dtype).expand(*shape)


def _unique_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters())


def skeleton(model: nn.Module) -> nn.Module:
    """`model` with every parameter replaced by a placeholder of its dtype (buffers kept): built under
    no_init, it never held a weight."""
    for p in _unique_parameters(model).values():
        p.data = placeholder(p.shape, p.dtype)
    return model


def cast_skeleton(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of the skeleton in `dtype` (floating placeholders and buffers cast, as `model.to(dtype)` does)."""
    # each parameter copied as a new placeholder: deepcopy would write each one out whole (a zero-stride view's clone)
    memo = {id(p): nn.Parameter(placeholder(p.shape, p.dtype), requires_grad=p.requires_grad)
            for p in _unique_parameters(model).values()}
    out = copy.deepcopy(model, memo)
    for p in _unique_parameters(out).values():
        p.data = placeholder(p.shape, dtype if p.is_floating_point() else p.dtype)
    cast_buffers(out, dtype)
    return out


def cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """The floating buffers cast in place as `model.to(dtype)` casts them: float32 tables kept (Float32Tables)."""
    for module in model.modules():
        if getattr(module, "float32_tables", False):
            continue
        for b in module.buffers(recurse=False):
            if b.is_floating_point():
                b.data = b.data.to(dtype)


# ---------------------------------------------------------------------------------------------- streaming

_STREAMED: "weakref.WeakKeyDictionary[nn.Module, tuple[WeightSource, torch.dtype]]" = weakref.WeakKeyDictionary()


def blocks(model: nn.Module) -> list[nn.Module]:
    """The units that stream their own weights: the members of the model's outermost module lists (its layers)."""
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                out.extend(child)
            else:
                visit(child)

    visit(model)
    return out


HEAD_CHUNK_BYTES = 64 << 20  # a streamed head's rows read at a time


def _loading_modules(block: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """(module, the parameters it loads when it runs) within a block: each module its own parameters, so that one
    matrix's values are held at a time rather than the block's (a 3B layer in FP64 is 0.8 GB; its largest matrix
    0.2 GB); a module that reads its children's weights itself, not by calling them (`reads_child_weights`: MLA's
    attention), loads all of its own and its children's."""
    out = []

    def visit(module: nn.Module) -> None:
        if getattr(module, "reads_child_weights", False):
            out.append((module, list(module.parameters())))
            return
        own = list(module.parameters(recurse=False))
        if own:
            out.append((module, own))
        for child in module.children():
            visit(child)

    visit(block)
    return out


def streamed(model: nn.Module, source: WeightSource, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Make the skeleton `model` compute with `source`'s weights in `dtype`, one module's at a time within its
    blocks (_loading_modules); returns it.

    Outside the blocks an embedding reads only the rows its ids select and a linear layer (the head) its rows
    a chunk at a time (vocabulary-sized tables are the largest weights), and the other weights (norms) are read
    for the whole forward. Its parameters are placeholders again after each forward."""
    names = {id(p): n for n, p in _unique_parameters(model).items()}
    units = blocks(model)
    inner = {id(p) for u in units for p in u.parameters()}
    tables = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.Linear)) and id(m.weight) not in inner]
    inner |= {id(m.weight) for m in tables}
    outer = [p for p in _unique_parameters(model).values() if id(p) not in inner]

    # released tensors, reused by the next of their shape (blocks share their shapes): fresh memory for every
    # weight of every forward would cost a page fault per page; none where the source keeps its values
    spare: dict[tuple, list[torch.Tensor]] = {}

    def buffer(shape) -> torch.Tensor | None:
        if source.keep and dtype == torch.float32:  # the kept values themselves
            return None
        free = spare.get((tuple(shape), dtype))
        return free.pop() if free else torch.empty(shape, dtype=dtype)

    def load(params):
        for p in params:
            p.data = source.read(names[id(p)], dtype, buffer(source.shapes[names[id(p)]]))

    def release(params, trim: bool = True):
        for p in params:
            if not (source.keep and dtype == torch.float32) and p.data.stride() and p.dtype == dtype:
                spare.setdefault((tuple(p.shape), dtype), []).append(p.data)
            p.data = placeholder(source.shapes[names[id(p)]], p.dtype)
        if trim and not source.keep:  # what reading and casting the weights freed, back to the system (see there)
            release_freed_memory()

    def gather(module, args):  # the embedding of the rows the ids select: ids renumbered over them
        ids, *rest = args
        rows, index = torch.unique(ids, return_inverse=True)
        module.weight.data = source.read_rows(names[id(module.weight)], rows, dtype)
        return (index.reshape(ids.shape), *rest)

    def head(module, x):  # rows of the weight a chunk at a time, each read when used
        weight, bias = module.weight, module.bias
        step = max(1, HEAD_CHUNK_BYTES // (weight.shape[1] * torch.empty((), dtype=dtype).element_size()))
        parts = []
        for start in range(0, weight.shape[0], step):
            rows = torch.arange(start, min(start + step, weight.shape[0]))
            chunk = buffer((len(rows), *weight.shape[1:]))
            w = source.read_rows(names[id(weight)], rows, dtype, chunk)
            b = None if bias is None else source.read_rows(names[id(bias)], rows, dtype)
            parts.append(nn.functional.linear(x, w, b))
            if chunk is not None:
                spare.setdefault((tuple(chunk.shape), dtype), []).append(chunk)
        return torch.cat(parts, dim=-1)

    for unit in units:
        for module, own in _loading_modules(unit):
            module.register_forward_pre_hook(lambda m, args, own=own: load(own))
            module.register_forward_hook(lambda m, args, out, own=own: release(own, trim=False))
        unit.register_forward_hook(lambda m, args, out: release([]))  # trimmed once a block
    for table in tables:
        if isinstance(table, nn.Embedding):
            table.register_forward_pre_hook(gather)
            table.register_forward_hook(lambda m, args, out: release([m.weight]))
        else:
            table.forward = functools.partial(head, table)
    model.register_forward_pre_hook(lambda m, args: load(outer))

    def done(module, args, out):
        spare.clear()  # reused within a forward (block after block), not held between forwards
        release(outer)  # (and what the spares held, trimmed with the rest)

    model.register_forward_hook(done)
    for p in _unique_parameters(model).values():
        p.data = placeholder(p.shape, dtype if p.is_floating_point() else p.dtype)
    cast_buffers(model, dtype)
    _STREAMED[model] = (source, dtype)
    return model


def streamed_source(model: nn.Module) -> WeightSource | None:
    """The source a streamed model reads (None: its weights are its own)."""
    entry = _STREAMED.get(model)
    return entry[0] if entry else None


def copy_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` in `dtype`: a copy cast whole (`deepcopy().to()`) when it holds its weights; another skeleton of
    its config streamed from the same source when it is streamed."""
    from .architectures import build

    source = streamed_source(model)
    if source is None:
        return copy.deepcopy(model).to(dtype)
    with no_init():
        return streamed(skeleton(build(model.config)), source, dtype).eval()


# ---------------------------------------------------------------------------------------------- tracing


def lazy_tensor(value):
    """The lazy graph value a traced parameter carries (for_tracing), or None."""
    return getattr(value, _LAZY, None)


def for_tracing(model: nn.Module, dtype: torch.dtype, source: WeightSource) -> nn.Module:
    """A copy of the skeleton `model` to trace in `dtype`: parameters of unwritten memory (no page backs them),
    each carrying its lazy ONNX value read from `source` and cast to `dtype` when the graph is saved."""
    import onnx_ir as ir
    from onnx_ir.tensor_adapters import TorchTensor

    out = cast_skeleton(model, dtype)
    for name, p in _unique_parameters(out).items():
        target = dtype if p.is_floating_point() else p.dtype
        p.data = torch.empty(p.shape, dtype=target)
        # the reader's buffer itself where no cast is needed: the graph's writer copies each value out before
        # the next is read (a copy made here was Gemma 3's 0.67 GB embedding twice)
        read = lambda name=name, target=target: TorchTensor(source.read(name, target, copy=False), name=name)  # noqa: E731
        setattr(p, _LAZY, ir.LazyTensor(read, ir.DataType.from_numpy(_numpy_dtype(target)) if target != torch.bfloat16
                                        else ir.DataType.BFLOAT16, ir.Shape(list(p.shape)), name=name))
    return out


def _numpy_dtype(dtype: torch.dtype):
    return torch.empty((), dtype=dtype).numpy().dtype
