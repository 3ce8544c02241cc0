"""The local cache: file contents addressed by git blob SHA, outside the repository.

A path in the cache is only ever built from a full 40-hex SHA, and its folder must resolve inside the cache
root: a lock from an untrusted branch cannot name a file elsewhere to read, write or delete. Anything read
back is a regular file (pin_and_cite.core.regular_file), read no further than the blob's size, and re-hashed; a
corrupt entry is deleted and treated as missing, never used.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import platformdirs

from pin_and_cite.core.atomic import atomic_write
from pin_and_cite.core.errors import PinAndCiteError, SourceUnavailable
from pin_and_cite.core.gitobj import blob_sha, is_full_sha
from pin_and_cite.core.regular_file import NotRegularFile, read_regular

if TYPE_CHECKING:
    import filelock

MAX_BLOB_BYTES = 100 << 20  # GitHub refuses files over 100 MiB: the bound when the lock gives no size


def default_cache_dir() -> Path:
    """$PIN_AND_CITE_CACHE (a directory, or a new one in an existing directory: a typo must not grow a tree
    of folders somewhere), absolute and outside the git checkout the run starts in; else the user cache
    directory."""
    configured = os.environ.get("PIN_AND_CITE_CACHE")
    if not configured:
        return Path(platformdirs.user_cache_dir("pin-and-cite"))
    path = Path(configured)
    if not path.is_absolute():
        raise PinAndCiteError(
            f"PIN_AND_CITE_CACHE={configured!r} is relative, so it would name a folder of the checkout a run "
            "starts in; give an absolute path outside any checkout"
        )
    cwd = Path.cwd()
    checkout = next((folder for folder in [cwd, *cwd.parents] if (folder / ".git").exists()), None)
    if checkout is not None:
        refuse_cache_inside(path, checkout, "the checkout of the current directory")
    if path.exists() and not path.is_dir():
        raise PinAndCiteError(f"PIN_AND_CITE_CACHE={configured!r} is not a directory; point it at one")
    if not path.exists() and not path.parent.is_dir():
        raise PinAndCiteError(
            f"PIN_AND_CITE_CACHE={configured!r}: {path.parent} is not a directory; create it, "
            f"or point the variable at an existing directory"
        )
    return path


def refuse_cache_inside(cache: Path, folder: Path, what: str) -> None:
    """A cache inside a checkout holds what the checkout's branch planted (partial repositories whose git config
    runs commands, entries a reader trusts to be the owner's): refuse it."""
    if cache.resolve().is_relative_to(folder.resolve()):
        raise PinAndCiteError(
            f"cache {cache} is inside {what} ({folder}); point PIN_AND_CITE_CACHE at a directory outside it"
        )


class Store:
    def __init__(self, root: Path):
        self.root = root
        self._memo: dict[str, bytes] = {}

    def _blob_path(self, blob: str) -> Path:
        if not is_full_sha(blob):
            raise PinAndCiteError(f"refusing {blob[:80]!r} as a cache key: not a full 40-hex blob SHA")
        path = self.root / "blobs" / blob[:2] / blob[2:]
        if not path.parent.resolve().is_relative_to(self.root.resolve()):
            raise SourceUnavailable(f"cache folder {path.parent} leads outside the cache {self.root}; remove it")
        return path

    def get(self, blob: str, size: int | None = None) -> bytes | None:
        """The verified bytes of `blob`, or None when the cache has no good copy. `size`, the blob's size
        when the lock records it, bounds the read (else MAX_BLOB_BYTES)."""
        if blob in self._memo:
            return self._memo[blob]
        path = self._blob_path(blob)
        limit = MAX_BLOB_BYTES if size is None else size
        try:
            data = read_regular(path, limit)
        except NotRegularFile as exc:
            raise SourceUnavailable(f"cache entry {exc}; remove it and run `pin-and-cite fetch`") from None
        if data is None:
            return None
        if len(data) > limit or blob_sha(data) != blob:
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
        """A cross-process lock on one part of the cache (two `fetch` runs at once take turns). filelock is
        imported here, not with the module: `check`, which never fetches, would spend a hundredth of a second
        importing it (and the logging it loads)."""
        import filelock

        self.root.mkdir(parents=True, exist_ok=True)
        key = hashlib.sha1(name.encode()).hexdigest()[:16]
        return filelock.FileLock(str(self.root / f".{key}.lock"))

    def git_dir(self, url: str) -> Path:
        """Where the partial repository for one remote URL lives."""
        return self.root / "git" / hashlib.sha1(url.encode()).hexdigest()[:16]
