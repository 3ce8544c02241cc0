"""The local cache: file contents addressed by git blob SHA, outside the repository.

Anything read back is re-hashed first; a corrupt entry is deleted and treated as missing, never used.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import filelock
import platformdirs

from pin_and_cite.atomic import atomic_write
from pin_and_cite.errors import PinAndCiteError
from pin_and_cite.gitobj import blob_sha


def default_cache_dir() -> Path:
    """$PIN_AND_CITE_CACHE (a directory, or a new one in an existing directory: a typo must not grow a tree
    of folders somewhere), else the user cache directory."""
    configured = os.environ.get("PIN_AND_CITE_CACHE")
    if not configured:
        return Path(platformdirs.user_cache_dir("pin-and-cite"))
    path = Path(configured)
    if path.exists() and not path.is_dir():
        raise PinAndCiteError(f"PIN_AND_CITE_CACHE={configured!r} is not a directory; point it at one")
    if not path.exists() and not path.parent.is_dir():
        raise PinAndCiteError(f"PIN_AND_CITE_CACHE={configured!r}: {path.parent} is not a directory; create it, "
                              f"or point the variable at an existing directory")
    return path


class Store:
    def __init__(self, root: Path):
        self.root = root
        self._memo: dict[str, bytes] = {}

    def _blob_path(self, blob: str) -> Path:
        return self.root / "blobs" / blob[:2] / blob[2:]

    def get(self, blob: str) -> bytes | None:
        if blob in self._memo:
            return self._memo[blob]
        path = self._blob_path(blob)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if blob_sha(data) != blob:
            path.unlink(missing_ok=True)
            return None
        self._memo[blob] = data
        return data

    def put(self, blob: str, data: bytes) -> None:
        found = blob_sha(data)
        if found != blob:
            raise PinAndCiteError(f"refusing to cache bytes with blob {found[:12]} under {blob[:12]}")
        atomic_write(self._blob_path(blob), data)
        self._memo[blob] = data

    def lock(self, name: str) -> filelock.FileLock:
        """A cross-process lock on one part of the cache (two `fetch` runs at once take turns)."""
        self.root.mkdir(parents=True, exist_ok=True)
        key = hashlib.sha1(name.encode()).hexdigest()[:16]
        return filelock.FileLock(str(self.root / f".{key}.lock"))

    def git_dir(self, url: str) -> Path:
        """Where the partial repository for one remote URL lives."""
        return self.root / "git" / hashlib.sha1(url.encode()).hexdigest()[:16]
