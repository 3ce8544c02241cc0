"""The bytes of paths at commits of one remote: each blob once, from the cache, a local copy, or one request.

Blob ids come from the lock when it knows them, else from the commit's trees (only those on the paths);
every blob is verified by its git hash before it is used and kept in the cache, so a second run fetches nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pin_and_cite.core.remote import Remote
from pin_and_cite.core.store import Store

LocalBytes = Callable[[str, str], "bytes | None"]  # (path, blob) -> verified bytes from somewhere local


def fetch_files(
    remote: Remote,
    store: Store,
    wanted: dict[str, Iterable[str]],
    known: dict | None = None,
    local: LocalBytes | None = None,
) -> dict[tuple[str, str], bytes | None]:
    """(commit, path) -> bytes (None when the path is absent at that commit) for every path wanted at each
    commit. `known` maps (commit, path) to blob ids already known (say, from a lock); `local` may supply
    verified bytes (say, an installed distribution) before the network is asked."""
    blobs: dict[tuple[str, str], str | None] = dict(known or {})
    with remote.lock:  # the remote's own file lock (reentrant), as every fetch
        for commit, paths in wanted.items():
            unknown = sorted({p for p in paths if (commit, p) not in blobs})
            if unknown:
                blobs.update({(commit, p): oid for p, oid in remote.blob_ids(commit, unknown).items()})
        data: dict[str, bytes] = {}
        for (_, path), oid in blobs.items():
            if oid and oid not in data:
                found = store.get(oid)
                if found is None and local is not None:
                    found = local(path, oid)
                if found is not None:
                    data[oid] = found
        missing = sorted({oid for oid in blobs.values() if oid and oid not in data})
        for oid, raw in remote.fetch_blobs(missing, f"fetching {len(missing)} file(s)").items():
            store.put(oid, raw)
            data[oid] = raw
    return {key: (data[oid] if oid else None) for key, oid in blobs.items()}
