"""kvforge.export: ONNX export with KV cache, validation against the reference, TensorRT lint.

    from kvforge.export import export, lint
    bundle = export("tiny", "out/tiny-fp32")       # validated on every export
    lint(bundle.graph_file)["passed"]
"""

from .api import DTYPES, ExportValidationError, export
from .lint import lint
from .onnx_export import DEFAULT_OPSET

__all__ = ["DEFAULT_OPSET", "DTYPES", "ExportValidationError", "export", "lint"]
