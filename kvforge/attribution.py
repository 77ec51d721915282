"""Per-layer error attribution: the residual stream after every decoder block, in candidate and reference.

The candidate's block outputs are found in its ONNX graph from the
exporter's module scopes (`model.layers.{i}`): the last tensor a block
produces that the next block (or, for the last block, the final norm)
consumes. Calibration keeps tensor names, so the same names hold in every
bundle derived from one export. The reference's come from forward hooks on
the Torch model's blocks.

Two views per block. Accumulated: the candidate run end to end, its
residual stream against the reference's after each block (how error builds
up). Local: every block of the candidate fed the reference's input to that
block (the graph is cut at the block boundaries and the reference's tensors
injected there), so its output error is its own. A block's contribution is
its local rel L2; ranking blocks by it names the ones most worth keeping in
higher precision, undisturbed by the error that earlier blocks pass on.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import numpy as np

from kvforge import metrics
from kvforge.bundle import Bundle
from kvforge.errors import KvforgeError
from kvforge.ort_session import make_session, prefill_feeds

_BLOCK = re.compile(r"(?:model\.)?layers\.(\d+)")


def _block_of(node) -> int | None:
    """The decoder block a node came from; -1 for scoped nodes outside every block; None when unscoped."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return None
            for s in scopes:
                m = _BLOCK.fullmatch(s)
                if m:
                    return int(m.group(1))
            return -1
    return None


def block_outputs(model, n_layers: int) -> list[str]:
    """The tensor names of the residual stream after each of the n_layers blocks."""
    produced: dict[str, tuple[int, int]] = {}  # tensor -> (block, node index)
    consumers: dict[str, set[int]] = {}
    for idx, node in enumerate(model.graph.node):
        block = _block_of(node)
        for name in node.input:
            consumers.setdefault(name, set()).add(block)
        if block is not None and block >= 0:
            for name in node.output:
                produced[name] = (block, idx)
    graph_outputs = {o.name for o in model.graph.output}
    found: dict[int, tuple[int, str]] = {}
    for name, (block, idx) in produced.items():
        nxt = block + 1 if block + 1 < n_layers else -1
        if name in graph_outputs or nxt not in consumers.get(name, ()):
            continue
        if block not in found or idx > found[block][0]:
            found[block] = (idx, name)
    missing = [i for i in range(n_layers) if i not in found]
    if missing:
        raise KvforgeError(
            f"cannot find the outputs of blocks {missing} in the graph: per-layer comparison needs the exporter's "
            "module scopes (metadata 'pkg.torch.onnx.name_scopes'), which kvforge export keeps"
        )
    return [found[i][1] for i in range(n_layers)]


def onnx_block_outputs(bundle: Bundle, batch: np.ndarray, inject: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """Run the bundle's graph on ONNX Runtime (prefill, no past) with every block's output exposed.

    inject: the inputs of blocks 1..n-1 (the reference's outputs of blocks 0..n-2) to feed instead of
    the graph's own, so that each block's output error is its own.
    """
    quant = bundle.session_format
    return graph_block_outputs(bundle.load_graph(external_data=False), bundle.model_config, bundle.io,
                               bundle.dtype, quant, batch, inject, bundle.path)


def graph_block_outputs(model, cfg: dict[str, Any], io, dtype: str, quant: str | None, batch: np.ndarray,
                        inject: list[np.ndarray] | None = None, external_dir=None) -> list[np.ndarray]:
    """As onnx_block_outputs, for an in-memory graph (left unchanged) of the bundle format `quant`; external_dir:
    where its external data lies, for a graph loaded without it."""
    from onnx import TensorProto, helper

    names = block_outputs(model, cfg["n_layers"])
    probe = type(model)()
    probe.CopyFrom(model)
    elem = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}.get(dtype, TensorProto.FLOAT)
    for name in names:
        probe.graph.output.append(helper.make_tensor_value_info(name, elem, None))
    feeds = prefill_feeds(batch, cfg, io, dtype)
    if inject is not None:  # cut the graph at each block boundary: consumers read an input instead
        np_dtype = np.float16 if dtype == "float16" else np.float32
        for i, (name, value) in enumerate(zip(names[:-1], inject)):
            fed = f"kvforge_block_input_{i + 1}"
            for node in probe.graph.node:
                for k, inp in enumerate(node.input):
                    if inp == name:
                        node.input[k] = fed
            probe.graph.input.append(helper.make_tensor_value_info(fed, elem, None))
            feeds[fed] = value.astype(np_dtype)
    sess = make_session(probe.SerializeToString(), quant, external_dir=external_dir, half_weights=dtype == "float16")
    return [x.astype(np.float32) for x in sess.run(names, feeds)]


def torch_block_outputs(session, batch: np.ndarray) -> list[np.ndarray]:
    """The residual stream after each block of a Session on the torch backend (forward hooks)."""
    if session.backend_name != "torch":
        raise KvforgeError(f"reference intermediates come from the torch backend, not {session.backend_name}")
    session.activate()
    model = session.backend.model
    captured: list[np.ndarray] = []
    hooks = [layer.register_forward_hook(lambda mod, args, out: captured.append(out[0].float().cpu().numpy()))
             for layer in model.layers]
    try:
        session.forward(batch)
    finally:
        for h in hooks:
            h.remove()
    return captured


def attribute(candidate: list[np.ndarray], reference: list[np.ndarray], local: list[np.ndarray]) -> list[dict[str, Any]]:
    """Per block: metrics of the accumulated error after it; its contribution (local rel L2, see the
    module doc) and its rank by contribution (1 = largest)."""
    rows = []
    for i, (c, r, own) in enumerate(zip(candidate, reference, local)):
        rows.append({"layer": f"layers.{i}", **metrics.tensor_metrics(c, r), "contribution": metrics.rel_l2(own, r)})
    for rank, row in enumerate(sorted(rows, key=lambda r: -r["contribution"]), 1):
        row["rank"] = rank
    return rows


def compare_blocks(run_candidate, reference: list[np.ndarray]) -> list[dict[str, Any]]:
    """attribute() for a candidate runner (inject=None -> outputs) against the reference's block outputs."""
    return attribute(run_candidate(None), reference, run_candidate(reference[:-1]))


def ranking(rows: list[dict[str, Any]]) -> list[str]:
    """Block names, most error-contributing first."""
    return [r["layer"] for r in sorted(rows, key=lambda r: r["rank"])]
