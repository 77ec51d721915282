"""What a refusal looks like, for the bad-input matrices (test_bad_inputs, test_data_safety).

A CLI case: the exit status asked for (1: kvforge's `error: ...`, exactly one such line, matching the case;
2: click's usage message), no Python traceback. An API case: the documented KvforgeError, matching the case.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.errors import KvforgeError


def assert_refused(made, message: str, status: int = 1) -> None:
    """made: a CLI argv, or a zero-argument callable (the Python API)."""
    if callable(made):
        with pytest.raises(KvforgeError) as e:
            made()
        assert re.search(message, str(e.value)), str(e.value)
        return
    result = CliRunner().invoke(main, made)
    output = result.output
    assert result.exit_code == status, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in output, output
    if status == 1:
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and re.search(message, errors[0]), output
    else:
        assert "Usage:" in output and re.search(message, output), output


def snapshot(*roots: Path) -> dict[str, tuple[int, str]]:
    """Every regular file under roots: its size and sha256 (a link is not followed)."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_file() and not p.is_symlink():
                out[str(p)] = (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
    return out
