"""The public API's wide functions take their options by keyword (docs/design.md, "Recipes instead of wide
signatures"): past the first two parameters, every parameter of a public function or session method with more than
four is keyword-only, so a call reads as what it sets and an option added later cannot shift the others."""

from __future__ import annotations

import importlib
import inspect

import pytest

# The packages a user imports, and the public entry points that live outside their __all__.
PACKAGES = ["kvforge.model_defs", "kvforge.export", "kvforge.calibration", "kvforge.runtime", "kvforge.serving",
            "kvforge.verify"]
EXTRA = [("kvforge.verify.check", "check"), ("kvforge.verify.pipeline", "pipeline")]
SESSIONS = [("kvforge.runtime", "Session"), ("kvforge.runtime", "EncoderSession"),
            ("kvforge.runtime.seq2seq_session", "Seq2SeqSession")]


def wide_positionals(fn) -> list[str]:
    """The parameters of a function with more than four that a caller may still pass by position past the second."""
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(params) <= 4:
        return []
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional[2:]


def public_functions():
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                yield f"{package}.{name}", obj
    for module, name in EXTRA:
        yield f"{module}.{name}", getattr(importlib.import_module(module), name)
    for module, name in SESSIONS:
        cls = getattr(importlib.import_module(module), name)
        for attr, obj in vars(cls).items():
            if inspect.isfunction(obj) and not attr.startswith("_"):
                yield f"{name}.{attr}", obj


def test_wide_public_functions_take_options_by_keyword():
    found = {name: wide_positionals(fn) for name, fn in public_functions()}
    assert len(found) > 20 and "kvforge.calibration.calibrate" in found and "Session.generate" in found
    offenders = {name: params for name, params in found.items() if params}
    assert offenders == {}, "make these keyword-only (a `*` after the second parameter)"


def test_the_signature_check_can_fail():
    def wide(a, b, c, d, e):
        pass

    def narrow(a, b, c, d):
        pass

    def keyword(a, b, *, c, d, e):
        pass

    assert wide_positionals(wide) == ["c", "d", "e"]
    assert wide_positionals(narrow) == [] and wide_positionals(keyword) == []


@pytest.mark.parametrize("precision", ["int8"])
def test_calibrate_refuses_options_by_position(precision):
    from kvforge.calibration import calibrate

    with pytest.raises(TypeError, match="positional argument"):
        calibrate("bundle", "out", precision)
