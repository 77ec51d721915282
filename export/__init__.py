"""kvforge.export: ONNX export with KV cache, validation against the reference, TensorRT lint and engine build.

    from kvforge.export import export, lint, build_engine
    bundle = export("tiny", "out/tiny-fp32")       # validated on every export
    lint(bundle.graph_file)["passed"]
    engine = build_engine(bundle.path, "out/tiny-fp32-engine")   # needs TensorRT and an NVIDIA GPU
"""

from .api import DTYPES, ExportValidationError, export
from .engine import build as build_engine
from .engine import build_plan, engine_manifest
from .engine_plan import BuildOptions, Limits, resolve_limits, synthesize_profiles
from .lint import lint
from .onnx_export import DEFAULT_OPSET

__all__ = [
    "DEFAULT_OPSET", "DTYPES", "BuildOptions", "ExportValidationError", "Limits", "build_engine", "build_plan",
    "engine_manifest", "export", "lint", "resolve_limits", "synthesize_profiles",
]
