"""A bundle's LoRA adapters: files beside its graph, never inside it (`kvforge lora add/list/remove`).

A bundle exported with LoRA slots (io.extra.lora) serves any adapter that fits them. Each adapter lives in
`adapters/NAME/`: `adapter.safetensors` (per slot `{slot}.a` (in, rank) and `{slot}.b` (rank, out), the scaling
folded into b; float32) and `adapter.json` (its rank, slots, where it came from and the safetensors file's
sha256). Adding one writes a staged directory and renames it into place, so a reader sees a whole adapter or
none; then, as after removing one, the manifest lists the adapters' files again (`record_adapters`: each hashed,
the other files' records kept as they were); the graph is not touched. A bundle derived from this one (calibrate,
build: kvforge/derived.py) carries its adapters. Reading checks the file's hash and that every slot it fills is
one of the bundle's, of the bundle's shapes, within its max rank: an adapter copied from another bundle is refused
by name.

numpy and safetensors only: the runtime reads adapters without torch (export/lora.py converts PEFT adapters).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .bundle import Bundle, file_records, sha256_file, write_manifest
from .errors import KvforgeError
from .manifest import ADAPTERS

MASK = "lora_mask"  # the graph input: per row, 1 over the columns of its adapter in the concatenated ranks
LORA_WIDTH = "lora_width"  # the inputs' dynamic dimension: the step's adapters' ranks side by side
WEIGHTS, RECORD = "adapter.safetensors", "adapter.json"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass
class AdapterInfo:
    name: str
    rank: int
    slots: list[str]
    source: str | None
    path: Path
    sha256: str | None = None  # of its weights file: what tells one version of a name from another

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "slots": len(self.slots), "source": self.source}


def slot_input_names(slot: str) -> tuple[str, str]:
    """The graph inputs of one slot: its adapters' A and B, concatenated along the rank."""
    return f"lora.{slot}.a", f"lora.{slot}.b"


def lora_spec(bundle: Bundle) -> dict[str, Any]:
    """The bundle's io.extra.lora record; a bundle without slots is refused, naming the fix."""
    spec = bundle.manifest["io"].get("extra", {}).get("lora")
    if spec is None:
        raise KvforgeError(f"{bundle.path} has no LoRA slots: export it with --lora-max-rank R to serve adapters")
    return spec


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise KvforgeError(f"adapter name {name!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a "
                           "letter or digit")
    return name


def adapter_dir(bundle: Bundle, name: str) -> Path:
    return bundle.path / ADAPTERS / check_name(name)


def list_adapters(bundle: Bundle | str | Path) -> list[AdapterInfo]:
    """The adapters stored beside a bundle (a Bundle, or its directory: the server lists them per request without
    reading the manifest again)."""
    root = Path(getattr(bundle, "path", bundle)) / ADAPTERS
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.iterdir()):
        if d.is_dir() and _NAME.fullmatch(d.name) and (d / RECORD).is_file():
            out.append(_info(d))
    return out


def _info(directory: Path) -> AdapterInfo:
    try:
        record = json.loads((directory / RECORD).read_text())
        return AdapterInfo(directory.name, int(record["rank"]), list(record["slots"]), record.get("source"), directory,
                           record.get("sha256"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise KvforgeError(f"adapter {directory} is damaged: {RECORD} does not read ({type(e).__name__}: {e})") from e


def check_fits(spec: dict[str, Any], slots: dict[str, tuple[np.ndarray, np.ndarray]], where: str) -> int:
    """The adapter's rank, after checking that each slot it fills is the bundle's, of its shapes, and the rank is
    within the bundle's max rank."""
    rank = 0
    for slot, (a, b) in slots.items():
        if slot not in spec["slots"]:
            raise KvforgeError(f"{where} fills the slot {slot!r}, which this bundle does not have (its targets are "
                               f"{spec['targets']}): an adapter of another bundle?")
        fan_in, fan_out = spec["slots"][slot]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != fan_in or b.shape[1] != fan_out or a.shape[1] != b.shape[0]:
            raise KvforgeError(f"{where}: slot {slot!r} holds A {a.shape} and B {b.shape}, but the bundle's is "
                               f"{fan_in} -> {fan_out}: an adapter of another base model?")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise KvforgeError(f"{where}: slot {slot!r} holds NaN or infinite values")
        rank = max(rank, a.shape[1])
    if rank > spec["max_rank"]:
        raise KvforgeError(f"{where} has rank {rank}, above the bundle's LoRA max rank {spec['max_rank']}")
    return rank


def write_adapter(bundle: Bundle, name: str, slots: dict[str, tuple[np.ndarray, np.ndarray]], record: dict[str, Any],
                  force: bool = False) -> AdapterInfo:
    """Store an adapter (already in the bundle's slots) as `name`; an existing one is replaced only with force."""
    from safetensors.numpy import save_file

    spec = lora_spec(bundle)
    target = adapter_dir(bundle, name)
    if not slots:
        raise KvforgeError(f"adapter {name!r} fills no slot")
    rank = check_fits(spec, slots, f"adapter {name!r}")
    if target.exists() and not force:
        raise KvforgeError(f"{bundle.path} already has an adapter {name!r}: remove it first, or pass --force")
    target.parent.mkdir(exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        tensors = {}
        for slot, (a, b) in slots.items():
            tensors[f"{slot}.a"] = np.ascontiguousarray(a, np.float32)
            tensors[f"{slot}.b"] = np.ascontiguousarray(b, np.float32)
        save_file(tensors, str(staged / WEIGHTS))
        full = {**record, "name": name, "rank": rank, "slots": sorted(slots), "sha256": sha256_file(staged / WEIGHTS)}
        (staged / RECORD).write_text(json.dumps(full, indent=2) + "\n")
        old = None
        if target.exists():  # --force: the old one is moved aside, then removed once the new one is in place
            old = target.with_name(f".{name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
        os.replace(staged, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    record_adapters(bundle)
    return _info(target)


def read_adapter(bundle: Bundle, name: str) -> tuple[AdapterInfo, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """An adapter's slots, checked against its recorded hash and the bundle's slots."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    spec = lora_spec(bundle)
    directory = adapter_dir(bundle, name)
    if not (directory / RECORD).is_file():
        have = [a.name for a in list_adapters(bundle)]
        raise KvforgeError(f"{bundle.path} has no adapter {name!r}; it has {have} (kvforge lora add)")
    info = _info(directory)
    try:
        record = json.loads((directory / RECORD).read_text())
        if sha256_file(directory / WEIGHTS) != record.get("sha256"):
            raise KvforgeError(f"adapter {name!r} is damaged: {WEIGHTS} does not match its recorded sha256")
        tensors = load_file(str(directory / WEIGHTS))
    except (OSError, SafetensorError, ValueError) as e:
        raise KvforgeError(f"adapter {name!r} is damaged: {type(e).__name__}: {e}") from e
    slots = {}
    for slot in info.slots:
        if f"{slot}.a" not in tensors or f"{slot}.b" not in tensors:
            raise KvforgeError(f"adapter {name!r} is damaged: {WEIGHTS} lacks slot {slot!r}")
        slots[slot] = (tensors[f"{slot}.a"], tensors[f"{slot}.b"])
    check_fits(spec, slots, f"adapter {name!r}")
    return info, slots


def remove_adapter(bundle: Bundle, name: str) -> None:
    directory = adapter_dir(bundle, name)
    if not directory.is_dir():
        have = [a.name for a in list_adapters(bundle)]
        raise KvforgeError(f"{bundle.path} has no adapter {name!r}; it has {have}")
    gone = directory.with_name(f".{name}.removed")
    shutil.rmtree(gone, ignore_errors=True)
    os.replace(directory, gone)  # one rename: a reader sees the adapter whole or not at all
    record_adapters(bundle)
    shutil.rmtree(gone, ignore_errors=True)


def record_adapters(bundle: Bundle) -> None:
    """Record the adapters the bundle holds now in its manifest's files (each of their files listed and hashed;
    write_manifest); the other files' records stay as they were, not hashed again, so a graph altered since it
    was written is still caught."""
    manifest = Bundle(bundle.path).manifest  # as it is now: another `lora add` may have written it since
    kept = {name: rec for name, rec in manifest["files"].items() if not name.startswith(f"{ADAPTERS}/")}
    write_manifest(bundle.path, manifest, dict(sorted({**kept, **file_records(bundle.path, ADAPTERS)}.items())))


def copy_adapters(source: Path, directory: Path) -> list[str]:
    """Copy the bundle at `source`'s adapters (whole ones: not one being staged or removed) into the bundle being
    written at `directory` (one derived from it: kvforge/derived.py); returns their names."""
    names = []
    for d in sorted((Path(source) / ADAPTERS).glob("*")):
        if d.is_dir() and not d.name.startswith(".") and (d / RECORD).is_file():
            shutil.copytree(d, Path(directory) / ADAPTERS / d.name)
            names.append(d.name)
    return names


def rank_of(adapter: dict[str, tuple[np.ndarray, np.ndarray]]) -> int:
    """The columns an adapter takes in the concatenated inputs: its largest slot's rank."""
    return max(a.shape[1] for a, _ in adapter.values())


def concatenated(spec: dict[str, Any], adapters: list[dict[str, tuple[np.ndarray, np.ndarray]]], dtype=np.float32
                 ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per slot of the bundle, A (in, W) and B (W, out): the adapters side by side along the rank, adapter j in
    columns offsets[j]:offsets[j] + rank_of(j) (zeros where its slot's rank is smaller, or it has no such slot).
    No adapter: W = 1, all zeros."""
    width = sum(rank_of(ad) for ad in adapters) or 1
    out = {}
    for slot, (fan_in, fan_out) in spec["slots"].items():
        a = np.zeros((fan_in, width), dtype)
        b = np.zeros((width, fan_out), dtype)
        at = 0
        for ad in adapters:
            if slot in ad:
                r = ad[slot][0].shape[1]
                a[:, at:at + r] = ad[slot][0]
                b[at:at + r, :] = ad[slot][1]
            at += rank_of(ad)
        out[slot] = (a, b)
    return out


def graph_inputs(spec: dict[str, Any], adapters: list[dict[str, tuple[np.ndarray, np.ndarray]]], dtype=np.float32
                 ) -> dict[str, np.ndarray]:
    """concatenated(...) by the graph's input names (slot_input_names)."""
    out = {}
    for slot, (a, b) in concatenated(spec, adapters, dtype).items():
        a_name, b_name = slot_input_names(slot)
        out[a_name], out[b_name] = a, b
    return out


def no_adapter_inputs(spec: dict[str, Any], rows: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """A step's LoRA inputs when no row has an adapter (what a slotted graph is fed to run as its base model)."""
    return {MASK: row_mask([], [None] * rows, dtype), **graph_inputs(spec, [], dtype)}


def row_mask(ranks: list[int], rows: list[int | None], dtype=np.float32) -> np.ndarray:
    """(rows, W): row i is 1 over the columns of adapter rows[i] (an index into `ranks`; None: all 0)."""
    offsets = np.concatenate([[0], np.cumsum(ranks)]).astype(int)
    mask = np.zeros((len(rows), max(int(offsets[-1]), 1)), dtype)
    for i, j in enumerate(rows):
        if j is not None:
            mask[i, offsets[j]:offsets[j + 1]] = 1
    return mask
