"""Traced programs by structure: a model's trace does not depend on its weights, so it is made once per structure.

torch.onnx traces a module with fake weights: its graph names each parameter and buffer (by its module path) and
holds no value of theirs. So two modules that differ in weights alone (two checkpoints of one architecture, a
preset at two seeds) share their trace; another dtype is another structure. `traced` keeps, per structure, the
unoptimized traced graph with the module's tensors left out (a template) and gives each export a copy of it with
that module's own tensors bound by name, then optimized; only the first of a structure pays for torch.export
(seconds to minutes, most of an export's time).

A structure is what the trace can read besides tensor values (`structure_key`): the modules' classes and every
attribute they hold (configs, flags, sizes, functions by their code, forward hooks), the name, shape and dtype
of every parameter and buffer (a tied weight as one tensor under two names), the contents of any other tensor a
module holds (the trace bakes those in as constants), and the example inputs, dynamic shapes, names and opset. A
module holding what cannot be told apart by value (an object without a stable description) is traced afresh.

Templates are kept in this process (at most MAX_TEMPLATES, the least recently used dropped first) and, where
every module class of the structure is kvforge's or torch's (code whose version the key can name), under
$KVFORGE_CACHE/traces, keyed also by the versions of torch, onnxscript and onnx-ir and a digest of kvforge's
sources: another process (a second export, a CLI run, a test worker) of the same structure reads it instead of
tracing. A template holds the graph alone (each weight an external reference to nothing), so it is small whatever
the model's size. Every export still validates its graph against the Torch reference, so a template cannot pass
unnoticed where it does not fit; KVFORGE_TRACE_CACHE=0 traces every export afresh.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import tempfile
import types
from collections import OrderedDict
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from kvforge.errors import KvforgeError

from . import lazy_weights

_log = logging.getLogger("kvforge.export")
MAX_TEMPLATES = 32
_templates: OrderedDict[str, Any] = OrderedDict()

# nn.Module's own bookkeeping: tensors and submodules are keyed separately
_MODULE_STATE = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}


class Unkeyable(Exception):
    """A value the key cannot describe by content."""


def module_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` by the name the traced graph gives it (tied ones under each name)."""
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    return tensors


def _describe(value, depth: int = 0) -> str:
    if depth > 8:
        raise Unkeyable("nested too deep")
    if value is None or isinstance(value, (bool, int, float, str, bytes, complex, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, torch.Tensor):
        if value.is_meta or isinstance(value, torch._subclasses.FakeTensor):
            raise Unkeyable("a tensor without values")
        data = value.detach().contiguous().cpu()
        digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
        return f"tensor({data.dtype},{tuple(data.shape)},{digest})"
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_describe(v, depth + 1) for v in value]
        return f"{type(value).__name__}[{','.join(sorted(items) if isinstance(value, (set, frozenset)) else items)}]"
    if isinstance(value, dict):
        items = sorted(f"{_describe(k, depth + 1)}:{_describe(v, depth + 1)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    if is_dataclass(value) and not isinstance(value, type):
        return f"{type(value).__qualname__}(" + ",".join(
            f"{f.name}={_describe(getattr(value, f.name), depth + 1)}" for f in fields(value)) + ")"
    if isinstance(value, functools.partial):
        return f"partial({_describe((value.func, value.args, value.keywords), depth + 1)})"
    if isinstance(value, types.FunctionType):  # by its code, so that a lambda or a local function has a key too
        closure = [cell.cell_contents for cell in value.__closure__ or ()]
        return (f"fn({value.__module__}.{value.__qualname__},{_describe_code(value.__code__, depth + 1)},"
                f"{_describe((value.__defaults__, value.__kwdefaults__, closure), depth + 1)})")
    if isinstance(value, (types.BuiltinFunctionType, type)):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, types.MethodType) and isinstance(value.__self__, nn.Module):
        return f"method({type(value.__self__).__qualname__}.{value.__func__.__qualname__})"
    if isinstance(value, nn.Module):  # a module held outside _modules: its structure is keyed where it sits
        return f"module({type(value).__qualname__})"
    raise Unkeyable(f"{type(value).__qualname__}")


def _describe_code(code: types.CodeType, depth: int) -> str:
    consts = [_describe_code(c, depth + 1) if isinstance(c, types.CodeType) else _describe(c, depth + 1)
              for c in code.co_consts]
    return hashlib.sha256(code.co_code + repr((code.co_names, code.co_varnames, consts)).encode()).hexdigest()


def structure_key(module: nn.Module, *parts) -> str | None:
    """A digest of all `module`'s trace can read but its tensors' values, with `parts` (example inputs, names,
    options); None where a module holds something the key cannot describe."""
    digest = hashlib.sha256()
    try:
        for name, sub in module.named_modules(remove_duplicate=False):
            digest.update(f"|{name}:{type(sub).__module__}.{type(sub).__qualname__}".encode())
            for attr, value in sorted(vars(sub).items()):
                if attr in _MODULE_STATE:
                    continue
                if attr.startswith("_") and "hook" in attr and isinstance(value, dict):
                    value = list(value.values())  # a forward hook is traced; its handle's number is not
                digest.update(f"{attr}={_describe(value)};".encode())
        first: dict[int, str] = {}
        for name, tensor in module_tensors(module).items():  # with the name a tied tensor is first found under
            digest.update(f"|{name}={first.setdefault(id(tensor), name)}:{tensor.dtype}{tuple(tensor.shape)}".encode())
        for part in parts:
            digest.update(f"|{_describe_shapes(part)}".encode())
    except Unkeyable:
        return None
    return digest.hexdigest()


def _describe_shapes(value) -> str:
    """Example inputs by dtype and shape (their values do not enter a trace with dynamic dims), the rest described."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_describe_shapes(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k!r}:{_describe_shapes(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.export.Dim.DYNAMIC.__class__):
        return repr(value)
    return _describe(value)


def bind(model, tensors: dict[str, torch.Tensor]) -> list[str]:
    """Give each weightless initializer of `model` the one of `tensors` it names (no copy); returns the names of
    those left without one."""
    from .lazy_weights import ir_tensor

    missing = []
    for name, value in model.graph.initializers.items():
        if name in tensors:
            value.const_value = ir_tensor(tensors[name], name)
        elif value.const_value is None or _absent(value.const_value):
            missing.append(name)
    return missing


_ABSENT = "absent-weights"  # where a stored template's weights point: they are bound, never read


def _absent(tensor) -> bool:
    return getattr(tensor, "location", None) == _ABSENT


def _template(model, tensors: dict[str, torch.Tensor]):
    """A weightless copy of the traced `model`: each initializer named in `tensors` keeps its name, dtype and
    shape and points at no data."""
    import onnx_ir as ir

    template = model.clone()
    for name, value in template.graph.initializers.items():
        if name in tensors:
            value.const_value = ir.ExternalTensor(_ABSENT, 0, 0, value.dtype, shape=value.shape, name=name,
                                                  base_dir=os.devnull)
    return template


@functools.cache
def _code_digest() -> str:
    """The versions of what traces, and the sources of kvforge's core, models and export."""
    digest = hashlib.sha256()
    for dist in ("torch", "onnxscript", "onnx-ir", "onnx"):
        try:
            digest.update(f"{dist}={importlib.metadata.version(dist)};".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{dist}=?;".encode())
    roots = [Path(p) for package in ("kvforge", "kvforge.model_defs", "kvforge.export")
             for p in importlib.util.find_spec(package).submodule_search_locations]
    for root in sorted(set(roots)):
        for path in sorted(root.rglob("*.py")):
            digest.update(f"|{path.relative_to(root.parent)}:".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _persistent(module: nn.Module) -> bool:
    """Whether every module class in `module` is kvforge's or torch's, whose code the cache key names."""
    return all(type(sub).__module__.split(".")[0] in ("kvforge", "torch") for sub in module.modules())


def _enabled() -> bool:
    return os.environ.get("KVFORGE_TRACE_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


@contextlib.contextmanager
def _stored(key: str):
    """The directory of the stored template `key` (its template.onnx there or not), held under a lock so that a
    second process that needs it waits for the first to trace it instead of tracing it as well; None where the
    cache cannot be written (the export goes on, its trace kept in this process only)."""
    from kvforge.cache import cache_dir

    try:
        root = cache_dir("traces")
        lock = open(root / f"{key}.lock", "w")
    except (KvforgeError, OSError) as e:
        _log.warning("traces are not kept on disk: %s", e)
        yield None
        return
    with lock:
        try:
            import fcntl
            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # no advisory locks here: two processes may both trace; the first stored wins
            pass
        yield root / key


def _store(directory: Path, template) -> None:
    """Write `template` as `directory` at once; a cache that cannot take it is only warned about."""
    import onnx_ir as ir

    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    except OSError as e:
        _log.warning("a trace is not kept on disk: %s", e)
        return
    try:
        ir.save(template, tmp / "template.onnx")
        os.replace(tmp, directory)
    except OSError as e:  # stored meanwhile by a process without the lock, or no room
        shutil.rmtree(tmp, ignore_errors=True)
        if not (directory / "template.onnx").is_file():
            _log.warning("a trace is not kept on disk: %s", e)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _from_template(template, tensors: dict[str, torch.Tensor]):
    """A program of `template` with `tensors` bound; None where some weight of it has no tensor here."""
    from torch.onnx import ONNXProgram

    model = template.clone()
    return None if bind(model, tensors) else ONNXProgram(model, None)


def traced(module: nn.Module, key_parts: tuple, trace: Callable[[], Any], optimize: bool):
    """The torch.onnx program of `module`: a copy of its structure's template with its tensors bound, or
    trace() (an unoptimized torch.onnx program of it), kept as the template; optimized when asked."""
    key = structure_key(module, *key_parts) if _enabled() else None
    program = None
    tensors = module_tensors(module)
    if key is not None:
        if key in _templates:
            _templates.move_to_end(key)
            program = _from_template(_templates[key], tensors)
        if program is None and _persistent(module):
            program = _traced_on_disk(hashlib.sha256(f"{key}|{_code_digest()}".encode()).hexdigest()[:32], tensors,
                                      trace, key)
    if program is None:
        program = _fresh(trace, tensors)
        if key is not None:
            _remember(key, _template(program.model, tensors))
    if optimize:
        lazy_weights.optimize(program)
    return program


def _fresh(trace: Callable[[], Any], tensors: dict[str, torch.Tensor]):
    """trace(), its weights bound again: a module's weights may be lazy values (model_defs/weights.py), its
    traced parameters memory that holds none of them."""
    program = trace()
    bind(program.model, tensors)
    return program


def _traced_on_disk(stored_key: str, tensors: dict[str, torch.Tensor], trace: Callable[[], Any], key: str):
    import onnx_ir as ir

    with _stored(stored_key) as directory:
        if directory is None:
            return None
        path = directory / "template.onnx"
        if path.is_file():
            try:
                template = ir.load(path)
            except Exception:  # a damaged entry is traced again and replaced
                shutil.rmtree(directory, ignore_errors=True)
            else:
                program = _from_template(template, tensors)
                if program is not None:
                    _remember(key, template)
                    return program
                shutil.rmtree(directory, ignore_errors=True)
        program = _fresh(trace, tensors)
        template = _template(program.model, tensors)
        _store(directory, template)
        _remember(key, template)
        return program


def _remember(key: str, template) -> None:
    _templates[key] = template
    _templates.move_to_end(key)
    while len(_templates) > MAX_TEMPLATES:
        _templates.popitem(last=False)
