"""Where kvforge keeps what it derives from bundles and from the environment: $KVFORGE_CACHE (default ~/.cache/kvforge).

Everything under it can be rebuilt (ORT variants, engines built on first use, the
serving pre-flight's verdicts), and every entry is keyed by what it was built from,
so a stale entry is never read for a changed source.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvforge.errors import KvforgeError


def cache_root() -> Path:
    """The cache directory; a KVFORGE_CACHE that names something other than a directory is refused by name."""
    configured = os.environ.get("KVFORGE_CACHE")
    root = Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvforge"
    if root.exists() and not root.is_dir():
        what = "KVFORGE_CACHE" if configured else "the default cache location"
        raise KvforgeError(f"{what} {root} is not a directory: point KVFORGE_CACHE at a directory kvforge may write")
    return root


def cache_dir(*parts: str) -> Path:
    """cache_root()/parts..., created; an unwritable or blocked location is one error naming it."""
    directory = cache_root().joinpath(*parts)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KvforgeError(f"cannot create the cache directory {directory} ({e.strerror or e}): "
                           f"set KVFORGE_CACHE to a directory kvforge may write") from e
    return directory
