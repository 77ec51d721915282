"""Argument checks shared by every layer: what counts as an integer, a number, a count given as an option."""

from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A Python or numpy int or float, not a bool (NaN passes: range checks then refuse it)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def positive_int_or_none(value) -> bool:
    """None, or an integer (is_int) of at least 1: the test for counts and sizes given as options."""
    return value is None or (is_int(value) and value >= 1)
