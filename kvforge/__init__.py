"""kvforge: Torch reference LMs -> ONNX with KV cache -> quantized -> TensorRT, verified numerically.

The stage packages are `kvforge.model_defs`, `kvforge.export`,
`kvforge.calibration` and `kvforge.runtime`; importing `kvforge` itself
imports none of them (and no Torch).
"""

from kvforge.errors import KvforgeError, MissingDependencyError

__version__ = "0.1.0"
__all__ = ["KvforgeError", "MissingDependencyError", "__version__"]
