"""kvforge.verify: every artifact compared numerically against the Torch reference.

    from kvforge.verify import compare
    report = compare("runs/tiny/int8")            # reference: the source it was exported from
    report.passed, report["top1_agreement"]
"""

from kvforge.metrics import REPORT_METRICS

from .compare import compare
from .report import DEFAULT_TOLERANCES, Report

__all__ = ["DEFAULT_TOLERANCES", "REPORT_METRICS", "Report", "compare"]
