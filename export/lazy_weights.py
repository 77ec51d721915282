"""Graph weights that are read when the file is written, not when the graph is made (model_defs/weights.py).

A traced parameter that carries a lazy value (`weights.for_tracing`) is bound to the graph as that value, so the
graph holds no weight until `ir.save` writes each initializer in turn. The exporter reads a linear layer's
weight through a Transpose, which the optimizer would fold into a second, transposed copy of every weight in
memory; `fold_weight_transposes` folds them first into lazy values that read and transpose one weight as it is
written. Weights held in memory take the same path (their transposes are read from the model's tensors).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from typing import Callable

import torch

from kvforge.errors import KvforgeError
from kvforge.model_defs.weights import lazy_tensor


def ir_tensor(value: torch.Tensor, name: str):
    """The graph value of a module's tensor: its lazy value where it carries one, else the tensor (no copy)."""
    from onnx_ir.tensor_adapters import TorchTensor

    lazy = lazy_tensor(value)
    if lazy is not None:
        lazy.name = name
        return lazy
    return TorchTensor(value.detach(), name=name)


def fold_weight_transposes(graph) -> int:
    """Replace each Transpose whose input is an initializer read by it alone with a lazy initializer that reads
    and transposes that one (named `val_...` as the optimizer names its folds; export names them after their
    module); returns how many were folded."""
    import onnx_ir as ir

    folded = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
            continue
        source = node.inputs[0]
        if source is None or source.name not in graph.initializers or source.const_value is None \
                or len(list(source.uses())) != 1 or source in graph.outputs:
            continue
        shape = source.const_value.shape
        perm_attr = node.attributes.get("perm")
        perm = list(perm_attr.value) if perm_attr is not None else list(range(len(shape)))[::-1]
        tensor = source.const_value
        out_shape = ir.Shape([shape[p] for p in perm])

        def read(tensor=tensor, perm=perm):
            return ir.Tensor(tensor.numpy().transpose(perm).copy())

        output = node.outputs[0]
        value = ir.Value(name=f"val_t_{source.name}", shape=out_shape, type=ir.TensorType(tensor.dtype),
                         const_value=ir.LazyTensor(read, tensor.dtype, out_shape, name=f"val_t_{source.name}"))
        graph.register_initializer(value)
        output.replace_all_uses_with(value)
        if output in graph.outputs:
            continue
        graph.remove(node, safe=True)
        del graph.initializers[source.name]
        folded += 1
    return folded


@contextlib.contextmanager
def reading_weights():
    """A weight that cannot be read while the graph is optimized or written (a damaged or truncated checkpoint)
    surfaces as its own KvforgeError, not inside the optimizer's or serializer's error."""
    try:
        yield
    except KvforgeError:
        raise
    except Exception as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, KvforgeError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from e


_WRITE_PROGRESS: contextvars.ContextVar[Callable[[int, int], None] | None] = contextvars.ContextVar(
    "kvforge_write_progress", default=None)


@contextlib.contextmanager
def write_progress(progress: Callable[[int, int], None]):
    """Within: progress(done, total) as each weight read when the graph is written is written (count_writes)."""
    token = _WRITE_PROGRESS.set(progress)
    try:
        yield
    finally:
        _WRITE_PROGRESS.reset(token)


def count_writes(graph) -> None:
    """Make each lazy initializer of `graph` report to write_progress's callback when it is read to be written
    (where no callback is set, nothing changes)."""
    import onnx_ir as ir

    progress = _WRITE_PROGRESS.get()
    lazy = [v for v in graph.initializers.values() if isinstance(v.const_value, ir.LazyTensor)]
    if progress is None or not lazy:
        return
    done = 0

    def counted(tensor):
        def read():
            nonlocal done
            value = tensor.raw()
            done += 1
            progress(done, len(lazy))
            return value

        return ir.LazyTensor(read, tensor.dtype, tensor.shape, name=tensor.name, doc_string=tensor.doc_string,
                             metadata_props=tensor.metadata_props)

    for value in lazy:
        value.const_value = counted(value.const_value)
    progress(0, len(lazy))


# onnxscript rewrite rules the optimizer runs without. SlicesSplit (two Slices that cover a tensor -> one Split)
# looks for its second Slice by listing every node of the graph again for each Slice: quadratic in the graph's
# size, more than half the optimizer's time on a mixture of experts' graph, where it never applies. Without it
# such a pair stays two Slices: the same values, and the Slices are what runtime/ort/fusions.py looks for.
SKIPPED_REWRITE_RULES = frozenset({"SlicesSplit"})


@contextlib.contextmanager
def _without_skipped_rules():
    """onnxscript's default rewrite rules less SKIPPED_REWRITE_RULES while the optimizer runs (an onnxscript
    without that table runs all its rules)."""
    try:
        from onnxscript import rewriter

        rules = rewriter._DEFAULT_REWRITE_RULES
    except (ImportError, AttributeError):
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in rules if getattr(r, "name", None) not in SKIPPED_REWRITE_RULES)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules


def optimize(program) -> None:
    """The onnxscript optimizer over `program`, after the weights' transposes are folded lazily."""
    fold_weight_transposes(program.model.graph)
    with warnings.catch_warnings(), reading_weights(), _without_skipped_rules():
        warnings.simplefilter("ignore")
        program.optimize()
