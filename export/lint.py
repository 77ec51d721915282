"""`kvforge lint`: check a graph against TensorRT's documented ONNX rules, on the CPU.

Rules (each finding names the offending node):
- opset: the default-domain opset lies in the parser's range for every
  targeted TensorRT version; no custom domains (com.microsoft & co.);
- operators: every op is one the parser supports;
- dtypes: each op's data input has a type the parser accepts for that op;
  float64 anywhere is flagged (TensorRT silently narrows it to float32);
- control flow: no If / Loop / Scan on a path to a graph output;
- inputs and attributes the parser needs in a given form (onnx-tensorrt's
  operator table, the notes column): CumSum's axis, Slice's axes and TopK's K
  are constants, TopK's K is below 3840 and `sorted` is 1, ScatterND has no
  `reduction` (MoE routing: TopK, then gather and scatter of the chosen
  experts' tokens; a capped cache's Slice of its newest positions);
- data-dependent shapes: a tensor whose shape depends on tensor values
  (NonZero's output, or a shape computed from such values) may flow inside the
  graph, but no graph output's shape may depend on one: kvforge's TensorRT
  backend sizes every output from the input shapes before a step;
- Q/DQ (docs/design.md's recipe): zero points are zero; scales are positive
  constants whose dtype equals the dequantized dtype; FP8 needs opset >= 19
  and block-wise INT4 needs opset >= 21 and whole blocks (TensorRT reads the
  block size as the blocked length over the scale's).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.errors import KvforgeError
from kvforge.onnx_graph import TYPE_NAMES, constant, value_types
from kvforge.schema import path_problem

from .trt_ops import SUPPORTED_OPS, UNSUPPORTED_OPS

# The TensorRT versions kvforge targets and their parser's opset range.
TARGETS = {"TensorRT 10.15": (9, 24), "TensorRT 11": (9, 25)}
EXTRA_OPS_BY_TARGET = {"TensorRT 11": {"Swish": ("FP32", "FP16", "BF16")}}
CONTROL_FLOW = {"If", "Loop", "Scan"}

_FLOATS = {1, 10, 16}
# Which input carries the data whose type the parser's table constrains.
_DATA_INPUT = {"Where": 1}
# Ops whose table entry covers the output type (the input is always float).
_TYPE_FROM_ATTR = {"Cast": "to"}


@dataclass
class Finding:
    severity: str  # "error" fails the lint, "warning" does not
    rule: str
    message: str
    node: str | None = None
    op: str | None = None

    def __str__(self) -> str:
        where = f" [{self.op} {self.node}]" if self.node else ""
        return f"{self.severity}: {self.rule}{where}: {self.message}"


def _load(model_or_path) -> Any:
    import onnx

    if isinstance(model_or_path, (str, Path)):
        path = Path(model_or_path)
        if not path.is_file():
            raise KvforgeError(f"no ONNX file at {path}")
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # onnx raises DecodeError and others on damaged files
            raise KvforgeError(f"{path} is not a readable ONNX model: {e}") from e
        _load_qdq_parameters(model, path.parent)
        return model
    return model_or_path


def _load_qdq_parameters(model, directory: Path) -> None:
    """Read the scales and zero points that a graph keeps as external data (an encoder-decoder's two graphs
    share one weight file), and only those: the Q/DQ rules check their values, not the weights'."""
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    wanted = {n.input[i] for n in model.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
              for i in (1, 2) if len(n.input) > i}
    for init in model.graph.initializer:
        if init.name in wanted and uses_external_data(init):
            if path_problem(next((e.value for e in init.external_data if e.key == "location"), "")):
                continue  # never read outside the graph's folder: _external_data_findings names it
            try:
                load_external_data_for_tensor(init, str(directory))
            except OSError:  # a missing or short data file: the rule then reports a non-constant scale
                continue
            del init.external_data[:]
            init.data_location = 0  # DEFAULT: the values are inline now


def _output_path_nodes(graph) -> set[int]:
    """Indices of nodes from which a graph output can be reached."""
    producer = {out: i for i, n in enumerate(graph.node) for out in n.output}
    seen: set[int] = set()
    stack = [producer[o.name] for o in graph.output if o.name in producer]
    while stack:
        i = stack.pop()
        if i in seen:
            continue
        seen.add(i)
        stack += [producer[x] for x in graph.node[i].input if x in producer]
    return seen


def _qdq_findings(graph, types: dict[str, int], opset: int) -> list[Finding]:
    findings = []
    consumers: dict[str, list] = {}
    for n in graph.node:
        for x in n.input:
            consumers.setdefault(x, []).append(n)
    for node in graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        name, op = node.name or node.output[0], node.op_type
        q_tensor = node.output[0] if op == "QuantizeLinear" else node.input[0]
        q_type = TYPE_NAMES.get(types.get(q_tensor, 0), "?")
        if q_type == "FP8" and opset < 19:
            findings.append(Finding("error", "qdq", f"FP8 Q/DQ needs opset >= 19, the graph has {opset}", name, op))
        block = next((a.i for a in node.attribute if a.name == "block_size"), 0)
        if block and opset < 21:
            findings.append(Finding("error", "qdq", f"block-wise Q/DQ needs opset >= 21, the graph has {opset}", name, op))
        if block and q_type == "INT8":
            findings.append(Finding("error", "qdq", "block-wise INT8 Q/DQ (weight-only INT8, which ONNX Runtime runs): "
                                    "TensorRT's weight-only quantization is INT4's; calibrate with --precision int4, "
                                    "or W8A8 int8, for TensorRT", name, op))
        if block and q_type == "INT4" and block not in (64, 128):
            findings.append(Finding("warning", "qdq", f"TensorRT documents INT4 block sizes 64 and 128, this is {block}", name, op))
        if block and op == "DequantizeLinear":
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
            dims = next((list(i.dims) for i in graph.initializer if i.name == node.input[0]), None)
            if dims and dims[axis] % block:
                findings.append(Finding(
                    "error", "qdq",
                    f"blocked axis has {dims[axis]} elements, not a multiple of block_size {block}: TensorRT reads the "
                    f"block size as that length over the scale's, so the last block must be padded whole", name, op))
        scale = constant(graph, node.input[1])
        if scale is None:  # computed in the graph: per-token activations (calibration/qdq.py), ONNX Runtime's
            findings.append(Finding("error", "qdq", "scale is computed at run time (per-token activations, which "
                                    "ONNX Runtime runs); TensorRT takes constant scales: calibrate with "
                                    "--activations static for TensorRT", name, op))
        elif not np.all(scale.astype(np.float32) > 0):
            findings.append(Finding("error", "qdq", "scales must be positive", name, op))
        if len(node.input) > 2 and node.input[2] and scale is not None:
            zp = constant(graph, node.input[2])
            if zp is None:
                findings.append(Finding("error", "qdq", "zero point must be a constant (and zero)", name, op))
            elif np.any(zp.astype(np.float32) != 0):
                findings.append(Finding("error", "qdq", "zero point must be zero (symmetric quantization: TensorRT takes no other; "
                                        "calibrate int4 with --no-zero-points for TensorRT)", name, op))
        s_type = types.get(node.input[1])
        if op == "QuantizeLinear":
            f_type = types.get(node.input[0])
            if s_type and f_type and s_type != f_type:
                findings.append(Finding("error", "qdq", f"scale dtype {TYPE_NAMES.get(s_type)} differs from the quantized tensor's {TYPE_NAMES.get(f_type)}", name, op))
            continue
        # A DequantizeLinear outputs the scale's dtype; it must be the dtype of the
        # float tensors it is combined with (the model dtype).
        for consumer in consumers.get(node.output[0], []):
            for other in consumer.input:
                o_type = types.get(other)
                if other != node.output[0] and o_type in _FLOATS and s_type and o_type != s_type:
                    findings.append(Finding(
                        "error", "qdq",
                        f"scale dtype {TYPE_NAMES.get(s_type)} differs from the {TYPE_NAMES.get(o_type)} tensor {other!r} it meets in {consumer.op_type}",
                        name, op,
                    ))
    return findings


# (op, input index, what) the parser reads as a constant (an initializer or a Constant node)
_CONSTANT_INPUTS = [("CumSum", 1, "axis"), ("Slice", 3, "axes"), ("TopK", 1, "K")]
TOPK_MAX_K = 3840  # the parser's bound on TopK's K (onnx-tensorrt operators.md)
# Inputs read as a shape: a data-dependent value there makes the output's shape data-dependent.
_SHAPE_INPUTS = {"Reshape": (1,), "Expand": (1,), "ConstantOfShape": (0,), "Tile": (1,), "Range": (0, 1, 2),
                 "Slice": (1, 2), "TopK": (1,), "Resize": (2, 3), "Pad": (1,), "OneHot": (1,), "Upsample": (1,)}
# Ops whose output shape is their first input's, whatever their other inputs hold.
_SHAPE_OF_FIRST = {"ScatterND", "ScatterElements", "Scatter"}
_DATA_DEPENDENT = {"NonZero"}


def _attribute_findings(graph) -> list[Finding]:
    findings = []
    for i, node in enumerate(graph.node):
        name, op = node.name or (node.output[0] if node.output else f"#{i}"), node.op_type
        for rule_op, index, what in _CONSTANT_INPUTS:
            if op != rule_op or len(node.input) <= index or not node.input[index]:
                continue
            value = constant(graph, node.input[index])
            if value is None:
                findings.append(Finding("error", "constant-input", f"{op}'s {what} ({node.input[index]!r}) must be a "
                                        "constant (an initializer or a Constant node) for TensorRT's parser", name, op))
            elif op == "TopK" and int(np.max(value)) >= TOPK_MAX_K:
                findings.append(Finding("error", "attribute", f"TopK's K is {int(np.max(value))}; TensorRT takes K < {TOPK_MAX_K}", name, op))
        attrs = {a.name: a for a in node.attribute}
        if op == "TopK" and "sorted" in attrs and attrs["sorted"].i != 1:
            findings.append(Finding("error", "attribute", "TopK with sorted=0: TensorRT's parser needs sorted=1", name, op))
        if op == "ScatterND" and "reduction" in attrs and attrs["reduction"].s not in (b"", b"none"):
            findings.append(Finding("error", "attribute", f"ScatterND reduction {attrs['reduction'].s.decode()!r} is not "
                                    "supported by TensorRT (only reduction='none')", name, op))
        if op == "ScatterElements" and "reduction" in attrs and attrs["reduction"].s not in (b"", b"none"):
            findings.append(Finding("warning", "attribute", f"ScatterElements reduction {attrs['reduction'].s.decode()!r}: "
                                    "TensorRT's parser does not support every reduction (onnx-tensorrt #953)", name, op))
    return findings


def _data_dependent_findings(graph) -> list[Finding]:
    """Follow shapes that depend on tensor values (from NonZero) forward; flag graph outputs they reach."""
    shaped: dict[str, str] = {}  # tensor -> the node whose values decide its shape
    valued: dict[str, str] = {}  # tensor -> the node whose values decide its values' being a shape (Shape of the above)
    findings = []
    for i, node in enumerate(graph.node):
        name, op = node.name or (node.output[0] if node.output else f"#{i}"), node.op_type
        if op in _DATA_DEPENDENT:
            findings.append(Finding("warning", "data-dependent-shape", f"{op} makes a shape that depends on tensor values; "
                                    "it may not reach a graph output's shape", name, op))
            for out in node.output:
                shaped[out] = valued[out] = name
            continue
        ins = [x for x in node.input if x]
        if op in ("Shape", "Size"):
            origin = next((shaped[x] for x in ins if x in shaped), None)
            if origin:
                valued[node.output[0]] = origin
            continue
        origin = None
        for idx in _SHAPE_INPUTS.get(op, ()):
            if idx < len(node.input) and node.input[idx] in valued:
                origin = valued[node.input[idx]]
        if origin is None:
            sources = ins[:1] if op in _SHAPE_OF_FIRST else ins
            origin = next((shaped[x] for x in sources if x in shaped), None)
        value_origin = next((valued[x] for x in ins if x in valued), None)
        for out in node.output:
            if origin:
                shaped[out] = origin
            if value_origin:
                valued[out] = value_origin
    for out in graph.output:
        if out.name in shaped:
            findings.append(Finding("error", "data-dependent-shape", f"graph output {out.name!r} has a shape that depends "
                                    f"on tensor values (from {shaped[out.name]}); kvforge's TensorRT backend sizes every "
                                    "output from the input shapes before a step"))
    return findings


def _structure_findings(graph) -> list[Finding]:
    """Every tensor a node reads is a graph input, an initializer or an earlier node's output; every output is produced."""
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    findings = []
    for i, node in enumerate(graph.node):
        name = node.name or (node.output[0] if node.output else f"#{i}")
        missing = [x for x in node.input if x not in known]
        if missing:
            findings.append(Finding("error", "structure", f"reads {missing[:3]}, which no graph input, initializer or earlier "
                                    "node provides (a broken or unsorted graph)", name, node.op_type))
        known.update(node.output)
    for out in graph.output:
        if out.name not in known:
            findings.append(Finding("error", "structure", f"graph output {out.name!r} is produced by no node"))
    return findings


def _external_data_findings(model, directory: Path) -> list[Finding]:
    """Each initializer whose external data is not a file of the graph's own folder (an absolute location, one
    that climbs out or into a subfolder) or lies past its file's end: the graph would read what is not its own,
    or fail to load, wherever it is copied."""
    from onnx.external_data_helper import uses_external_data

    findings, sizes = [], {}
    for init in model.graph.initializer:
        if not uses_external_data(init):
            continue
        entry = {e.key: e.value for e in init.external_data}
        location = entry.get("location", "")
        problem = path_problem(location)
        if problem:
            findings.append(Finding("error", "external-data", f"initializer {init.name!r}'s data location "
                                                              f"{location!r} {problem}"))
            continue
        if location not in sizes:
            file = directory / location
            sizes[location] = file.stat().st_size if file.is_file() else None
        end = int(entry.get("offset", 0)) + int(entry.get("length", 0))
        if sizes[location] is None:
            findings.append(Finding("error", "external-data", f"initializer {init.name!r}'s data file {location!r} "
                                                              f"is not beside the graph"))
        elif end > sizes[location]:
            findings.append(Finding("error", "external-data", f"initializer {init.name!r} ends at byte {end} of "
                                                              f"{location!r}, which holds {sizes[location]}"))
    return findings


def lint(model_or_path) -> dict[str, Any]:
    """Return {"passed": bool, "targets": {...}, "findings": [...]} for a model or an .onnx path (for a path, the
    external data it names is checked too: inside the graph's folder, within its files)."""
    model = _load(model_or_path)
    graph = model.graph
    findings: list[Finding] = []
    if isinstance(model_or_path, (str, Path)):
        findings += _external_data_findings(model, Path(model_or_path).parent)

    opset = None
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            opset = imp.version
        else:
            findings.append(Finding("error", "opset", f"custom operator domain {imp.domain!r} (version {imp.version}) is not parsed by TensorRT"))
    if opset is None:
        findings.append(Finding("error", "opset", "the model imports no default-domain opset"))
        opset = 0
    targets = {}
    for target, (lo, hi) in TARGETS.items():
        ok = lo <= opset <= hi
        targets[target] = ok
        if not ok:
            findings.append(Finding("error", "opset", f"opset {opset} is outside {target}'s range {lo}..{hi}"))

    types = value_types(model)
    on_output_path = _output_path_nodes(graph)
    for i, node in enumerate(graph.node):
        name, op = node.name or (node.output[0] if node.output else f"#{i}"), node.op_type
        if node.domain not in ("", "ai.onnx"):
            findings.append(Finding("error", "operator", f"custom op {node.domain}::{op} is not supported by TensorRT", name, op))
            continue
        missing_in = [t for t in TARGETS if op not in SUPPORTED_OPS and op not in EXTRA_OPS_BY_TARGET.get(t, {})]
        if op in UNSUPPORTED_OPS or missing_in:
            where = "any targeted TensorRT" if op in UNSUPPORTED_OPS or len(missing_in) == len(TARGETS) else ", ".join(missing_in)
            findings.append(Finding("error", "operator", f"{op} is not supported by {where}", name, op))
            continue
        if op in CONTROL_FLOW and i in on_output_path:
            findings.append(Finding("error", "control-flow", f"{op} lies on the path to a graph output", name, op))
        allowed = SUPPORTED_OPS.get(op) or EXTRA_OPS_BY_TARGET["TensorRT 11"].get(op, ())
        if op in _TYPE_FROM_ATTR:
            t = next((a.i for a in node.attribute if a.name == _TYPE_FROM_ATTR[op]), None)
        else:
            idx = _DATA_INPUT.get(op, 0)
            t = types.get(node.input[idx]) if len(node.input) > idx and node.input[idx] else None
        tname = TYPE_NAMES.get(t) if t else None
        if tname == "DOUBLE":
            findings.append(Finding("warning", "dtype", "float64 tensor: TensorRT narrows it to float32", name, op))
        elif tname and tname not in allowed:
            findings.append(Finding("error", "dtype", f"{op} does not take {tname} in TensorRT (accepts {', '.join(allowed)})", name, op))

    findings += _structure_findings(graph)
    findings += _attribute_findings(graph)
    findings += _data_dependent_findings(graph)
    findings += _qdq_findings(graph, types, opset)
    return {
        "passed": not any(f.severity == "error" for f in findings),
        "opset": opset,
        "targets": targets,
        "errors": sum(f.severity == "error" for f in findings),
        "warnings": sum(f.severity == "warning" for f in findings),
        "findings": [asdict(f) for f in findings],
    }


def merge_lint(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One record for the graphs of a bundle (an encoder-decoder has two): each finding names its graph."""
    if len(results) == 1:
        return next(iter(results.values()))
    first = next(iter(results.values()))
    return {
        "passed": all(r["passed"] for r in results.values()),
        "opset": first["opset"],
        "targets": {t: all(r["targets"][t] for r in results.values()) for t in first["targets"]},
        "errors": sum(r["errors"] for r in results.values()),
        "warnings": sum(r["warnings"] for r in results.values()),
        "findings": [{**f, "graph": role} for role, r in results.items() for f in r["findings"]],
        "graphs": {role: {"passed": r["passed"], "errors": r["errors"], "warnings": r["warnings"]} for role, r in results.items()},
    }
