"""kvforge.calibration: INT8 / FP8 W8A8 and INT4 weight-only quantization with TensorRT-friendly Q/DQ.

    from kvforge.calibration import Recipe, calibrate
    q = calibrate("runs/tiny-fp32", "runs/tiny-int8", precision="int8", method="percentile")
    q = calibrate("runs/tiny-fp32", "runs/tiny-int4", options=Recipe(precision="int4", recipe="fixed", block_size=64))
"""

from .api import calibrate
from .data import load_calibration_set
from .observers import METHODS, TensorObserver
from .qdq import FORMATS
from .recipe import Recipe

__all__ = ["FORMATS", "METHODS", "Recipe", "TensorObserver", "calibrate", "load_calibration_set"]
