"""A bundle derived from another (`calibrate`, `build`): written by `write_derived` and nowhere else.

Every such stage writes its own files (graphs, engines) and its own manifest entries; what it keeps of its
source is the same for all of them, so it is done here: the output is staged (outputs.staged_bundle), the files
a derived bundle keeps from its source are copied in (CARRIED and the LoRA adapters under adapters/), the
source's manifest is carried less what described its own files (`derived_manifest`), its graphs (role -> file,
Bundle.graphs) unless the stage names its own (a build's engines), the lineage gains the stage's entry, and
`write_manifest` records every file of the new bundle, adapters included, with its hash.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import kvforge
from kvforge.adapters import copy_adapters
from kvforge.bundle import Bundle, now_utc, write_manifest
from kvforge.ecosystem import HF_CONFIG
from kvforge.errors import KvforgeError
from kvforge.outputs import staged_bundle
from kvforge.tokenizer import SPECIALS_FILE, TOKENIZER_FILE

# copied from the source when it has them; a stage may write its own over them (calibrate's ecosystem files).
# config.json: `kvforge lora add` reads the family's weight names by it
CARRIED = (TOKENIZER_FILE, SPECIALS_FILE, HF_CONFIG)
# the source's records of its own artifact, which a derived bundle does not inherit
DROPPED = ("format", "format_version", "files", "validation", "lint")

# what a stage writes into the staged directory; returns its manifest entries and its lineage entry's fields
# (options, versions, seconds)
StageWriter = Callable[[Path], tuple[dict[str, Any], dict[str, Any]]]


def derived_manifest(source: dict[str, Any], source_path: str, stage: str, entries: dict[str, Any],
                     lineage: dict[str, Any]) -> dict[str, Any]:
    """The manifest (less its files) of a bundle that `stage` derived from the bundle at `source_path` whose
    manifest is `source`: the source's entries less DROPPED, updated with the stage's `entries`, and the source's
    lineage plus the stage's entry (`lineage`: its options, versions, seconds). Pure."""
    graph_sha256 = source.get("files", {}).get(source.get("graph"), {}).get("sha256")
    manifest = {k: v for k, v in source.items() if k not in DROPPED}
    manifest.update(entries, stage=stage, lineage=source.get("lineage", []) + [{
        "stage": stage,
        "tool": f"kvforge {kvforge.__version__}",
        "time": now_utc(),
        "input": {"source": source_path, "kind": "bundle", "sha256": graph_sha256},
        **lineage,
    }])
    return manifest


def carry_files(source: Path, directory: Path) -> None:
    """Copy what a derived bundle keeps of the bundle at `source` into `directory`: CARRIED, and the whole
    adapters under adapters/ (kvforge/adapters.py copy_adapters)."""
    for name in CARRIED:
        if (source / name).is_file():
            shutil.copy2(source / name, directory / name)
    copy_adapters(source, directory)


def write_derived(source: Bundle, out: str | Path, force: bool, stage: str, write: StageWriter) -> Bundle:
    """Write the bundle that `stage` derives from `source` at `out`, atomically, and return it.

    The directory is staged, the source's carried files are copied in (carry_files), then `write(directory)`
    writes the stage's own files (it may replace a carried one) and returns (manifest entries, lineage fields);
    the manifest is `derived_manifest`'s, its `graphs` the source's (Bundle.graphs: written even where the source's
    manifest predates the entry) unless the stage gives its own, and `write_manifest` lists and hashes every file
    in the bundle."""
    with staged_bundle(out, force, [source.path]) as tmp:
        carry_files(source.path, tmp)
        entries, lineage = write(tmp)
        entries = {"graphs": source.graphs, **entries}
        if "files" in entries or "lineage" in entries:
            raise KvforgeError(f"internal error: the {stage} stage gave its own files or lineage; write_derived "
                               "records them")
        write_manifest(tmp, derived_manifest(source.manifest, str(source.path.resolve()), stage, entries, lineage))
    return Bundle(out)
