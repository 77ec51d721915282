"""kvforge.calibration: INT8 / FP8 W8A8 and INT4 weight-only quantization with TensorRT-friendly Q/DQ.

    from kvforge.calibration import calibrate
    q = calibrate("runs/tiny-fp32", "runs/tiny-int8", precision="int8", method="percentile")
"""

from .api import calibrate
from .data import load_calibration_set
from .observers import METHODS, TensorObserver
from .qdq import FORMATS

__all__ = ["FORMATS", "METHODS", "TensorObserver", "calibrate", "load_calibration_set"]
