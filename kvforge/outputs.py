"""Writing kvforge's outputs: checked before any work, staged beside the target and renamed into place whole.

Every stage writes a new output (a bundle, an engine bundle, a Triton repository, a pipeline's work
directory); none edits its input. `check_output_path` refuses, before any work, what would harm the input or
the user's files; `staged_bundle` yields a temporary directory that becomes the output only once it is
complete, so a crash or a failed validation leaves no half-written output, and one replaced with --force
survives until the new one is whole. `owned_entries` is --force's proof that kvforge wrote what it replaces.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

from kvforge.bundle import MANIFEST, Bundle
from kvforge.errors import KvforgeError
from kvforge.schema import ListOf, RelPath, SchemaError, check


def check_output_path(out: str | Path, force: bool, inputs: Iterable[str | Path | None] = (), marker: str = MANIFEST) -> Path:
    """Refuse, before any work is done: an output that is or holds one of the inputs or the current directory,
    an existing output (unless force), a non-empty directory kvforge cannot prove it wrote (force replaces only
    those: see owned_entries), an output location that cannot be written. Returns the output's absolute path.

    marker: the file that records what kvforge wrote there (a bundle's manifest; a Triton repository's record).
    """
    out = Path(out)
    target = out.resolve()
    for source in inputs:
        if source is None or not Path(source).exists():  # a preset name is not a path
            continue
        where = Path(source).resolve()
        if where == target or target in where.parents:
            raise KvforgeError(f"the output {out} is, or holds, the input {source}; write the output somewhere else")
        if where in target.parents and Bundle.is_bundle(where):
            raise KvforgeError(f"the output {out} would sit inside the input bundle {source}; write the output somewhere else")
    if out.exists() and not force:
        raise KvforgeError(f"{out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise KvforgeError(f"{out} exists and is not a directory")
    try:
        cwd = Path.cwd().resolve()
    except OSError:  # the current directory was removed
        cwd = None
    if out.exists() and cwd is not None and (target == cwd or target in cwd.parents):
        raise KvforgeError(f"the output {out} is the current directory (or holds it): replacing it would leave this "
                           "shell in a removed directory; run the command from outside it")
    if out.is_dir() and any(out.iterdir()):
        owned_entries(out, marker)
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvforgeError(f"cannot create {parent}: {e.strerror or e}") from e
    try:  # a real write: permissions, a read-only filesystem, /proc, a full disk all answer here, before any work
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent))
    except OSError as e:
        raise KvforgeError(f"cannot write to {parent}: {e.strerror or e}") from e
    return target


def owned_entries(directory: Path, marker: str = MANIFEST) -> set[str]:
    """The paths under `directory` that kvforge can prove it wrote, when that is all of them; else KvforgeError.

    Proof is a record that kvforge writes last and that lists every file: a bundle's manifest (valid against the
    bundle schema, its `files` covering every file in the directory) or another output's record (a JSON object
    whose `files` lists every file by relative path). A file name alone is no proof: a directory holding
    anything the record does not list is refused by name, and nothing in it is touched.
    """
    record = directory / marker
    kind = "bundle" if marker == MANIFEST else "output"
    refuse = (f"--force replaces only a {kind} kvforge wrote (or an empty directory); remove it yourself or choose "
              "another output")
    if not record.is_file():
        raise KvforgeError(f"{directory} is a directory but not a kvforge {kind} (no {marker}); {refuse}")
    if marker == MANIFEST:
        try:
            listed = set(Bundle(directory).manifest["files"])
        except KvforgeError as e:
            raise KvforgeError(f"{directory} holds a {marker} that is not a valid bundle manifest ({e}); {refuse}") from e
    else:
        listed = _record_files(record)
        if listed is None:
            raise KvforgeError(f"{directory} holds a {marker} that does not list the files kvforge wrote; {refuse}")
    listed.add(marker)
    found = _tree(directory)
    folders = {p.as_posix() for name in listed for p in Path(name).parents if p != Path(".")}
    # Python writes bytecode beside a module it imports (a Triton repository's model.py, once served)
    bytecode = {(Path(name).parent / "__pycache__").as_posix() for name in listed if name.endswith(".py")}
    stray = sorted(p for p, is_dir in found.items()
                   if p not in listed and not (is_dir and p in folders | bytecode)
                   and not (not is_dir and Path(p).parent.as_posix() in bytecode and p.endswith(".pyc")))
    if stray:
        shown = ", ".join(stray[:5]) + (f" and {len(stray) - 5} more" if len(stray) > 5 else "")
        raise KvforgeError(f"{directory} holds files its {marker} does not list ({shown}); {refuse}")
    return set(found)


def _record_files(record: Path) -> set[str] | None:
    try:
        files = json.loads(record.read_text(encoding="utf-8"))["files"]
        check(files, ListOf(RelPath(directories=True)), "files")
    except (OSError, ValueError, KeyError, TypeError, SchemaError):  # SchemaError is a ValueError too
        return None
    return set(files)


def _tree(directory: Path) -> dict[str, bool]:
    """Every path under directory (relative, '/'-separated) -> whether it is a real directory (links are files)."""
    found = {}
    for root, dirs, files in os.walk(directory):
        rel = Path(root).relative_to(directory)
        for name in dirs:
            p = Path(root) / name
            found[(rel / name).as_posix()] = not p.is_symlink()
        for name in files:
            found[(rel / name).as_posix()] = False
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
    return found


@contextlib.contextmanager
def staged_bundle(out: str | Path, force: bool = False, inputs: Iterable[str | Path | None] = (),
                  marker: str = MANIFEST) -> Iterator[Path]:
    """Yield a temporary directory; on success it becomes `out`, on any error it vanishes.

    The caller writes the files and finally `write_manifest`; an existing
    `out` (with force) is replaced only after the block completes, in one step
    where the OS can swap two directories (Linux), so a process killed at any
    point leaves either the previous bundle or the new one at `out`. A bundle
    that another process wrote at `out` meanwhile is not replaced without
    force. What a killed process left beside `out` is cleared by the next
    write there.
    """
    out = check_output_path(out, force, inputs, marker)
    parent = out.parent
    _clear_leftovers(out, marker)
    existed = out.exists()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=parent))
    try:
        yield tmp
        if not (tmp / marker).is_file():
            raise KvforgeError(f"internal error: an output was staged without its {marker}")
        if out.exists() and not (existed and force):
            raise KvforgeError(f"{out} was written by another process while this one ran; it is left as that process "
                               "wrote it (pass --force to replace it)")
        if out.exists():
            if _exchange(tmp, out):
                shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous bundle
                return
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            moved = False
            try:
                os.replace(out, old)
                moved = True
                os.replace(tmp, out)
            except BaseException:
                if moved and not out.exists():  # interrupted between the two renames: the previous bundle goes back
                    os.replace(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                os.rename(tmp, out)
            except OSError as e:  # another process made `out` between the check above and now
                raise KvforgeError(f"{out} was written by another process while this one ran ({e.strerror}); it is "
                                   "left as that process wrote it") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE); False where the OS cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import errno

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):  # an older kernel, or a filesystem without it
        return False
    raise OSError(err, os.strerror(err), str(b))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _clear_leftovers(out: Path, marker: str = MANIFEST) -> None:
    """Remove what a killed writer of `out` left beside it: its staging directory, and a previous bundle it had
    moved aside (put back when `out` itself is missing)."""
    for leftover in out.resolve().parent.glob(f".{glob.escape(out.name)}.*-*"):
        kind, _, rest = leftover.name[len(out.name) + 2:].partition("-")
        pid = rest.split("-")[0]
        if kind not in ("tmp", "old") or not pid.isdigit() or _alive(int(pid)):
            continue
        if kind == "old" and not out.exists() and (leftover / marker).is_file():
            os.replace(leftover, out)
        else:
            shutil.rmtree(leftover, ignore_errors=True)
