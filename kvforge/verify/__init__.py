"""kvforge.verify: every artifact compared numerically against the Torch reference.

    from kvforge.verify import compare
    report = compare("runs/tiny/int8")            # reference: the source it was exported from
    report.passed, report["top1_agreement"]
"""

from .compare import DEFAULT_TOLERANCES, REPORT_METRICS, Report, compare

__all__ = ["DEFAULT_TOLERANCES", "REPORT_METRICS", "Report", "compare"]
