"""Checks of a bundle derived from another (kvforge/derived.py: calibrate, build), shared by the stages' tests."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvforge.bundle import MANIFEST, Bundle, sha256_file
from kvforge.derived import CARRIED
from kvforge.errors import KvforgeError


def bundle_files(path: Path) -> set[str]:
    """Every file under the bundle directory but its manifest, '/'-separated, relative to it."""
    found = set()
    for root, _, files in os.walk(path):
        found |= {(Path(root) / name).relative_to(path).as_posix() for name in files}
    return found - {MANIFEST}


def assert_every_file_hashed(bundle: Bundle) -> None:
    """The manifest lists exactly the files in the directory, each with its size and sha256; the full check passes."""
    files = bundle.manifest["files"]
    assert set(files) == bundle_files(bundle.path)
    for name, record in files.items():
        assert record == {"bytes": (bundle.path / name).stat().st_size, "sha256": sha256_file(bundle.path / name)}, name
    bundle.verify(full=True)


def assert_derived(source: Bundle, derived: Bundle, stage: str) -> None:
    """`derived` holds `source`'s carried files and adapters byte for byte, every file listed and hashed, and its
    lineage is the source's plus this stage's."""
    carried = [name for name in CARRIED if (source.path / name).is_file()]
    assert "tokenizer.json" in carried  # a test of carrying carries something
    adapters = sorted(name for name in bundle_files(source.path) if name.startswith("adapters/"))
    for name in carried + adapters:
        assert (derived.path / name).read_bytes() == (source.path / name).read_bytes(), name
    assert sorted(name for name in bundle_files(derived.path) if name.startswith("adapters/")) == adapters
    assert_every_file_hashed(derived)
    assert derived.manifest["stage"] == stage
    assert derived.manifest["lineage"][:-1] == source.manifest["lineage"]
    last = derived.manifest["lineage"][-1]
    assert last["stage"] == stage and last["input"] == {"source": str(source.path.resolve()), "kind": "bundle",
                                                         "sha256": source.graph_sha256}


def assert_altered_adapter_is_caught(bundle: Bundle, name: str) -> None:
    """Rewriting an adapter's weights in place (same size) fails the bundle's full check, naming the file; so does
    an edited adapter.json."""
    weights = bundle.path / "adapters" / name / "adapter.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(KvforgeError, match=f"is damaged: adapters/{name}/adapter.safetensors does not match its "
                                           "recorded sha256"):
        Bundle(bundle.path).verify(full=True)
    weights.write_bytes(original)
    Bundle(bundle.path).verify(full=True)
    record = bundle.path / "adapters" / name / "adapter.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "rank": 99}))
    with pytest.raises(KvforgeError, match=f"adapters/{name}/adapter.json has \\d+ bytes, the manifest says"):
        Bundle(bundle.path).verify()


def add_raw_adapter(bundle: Bundle, name: str = "x") -> Bundle:
    """An adapter directory written by hand (its contents are not read: the carrying and the hashing are what is
    tested), then recorded in the manifest as `kvforge lora add` records one."""
    from kvforge.adapters import record_adapters

    directory = bundle.path / "adapters" / name
    directory.mkdir(parents=True)
    (directory / "adapter.safetensors").write_bytes(os.urandom(64))
    (directory / "adapter.json").write_text(json.dumps({"name": name, "rank": 1, "slots": [],
                                                        "sha256": sha256_file(directory / "adapter.safetensors")}))
    record_adapters(bundle)
    return Bundle(bundle.path)
