"""Materialize locked files from the first source that proves it has the right bytes.

Order: the cache, an installed distribution, then one git request per source for all that is still
missing, wanted by blob SHA (so the old commit's files that a bump record names come the same way). Every
candidate is hashed as a git blob and compared with the lock before it is used or cached.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from pin_and_cite.core.distribution import installed_file
from pin_and_cite.core.errors import SourceUnavailable
from pin_and_cite.core.gitobj import blob_sha
from pin_and_cite.core.lock import file_key
from pin_and_cite.core.project import Project
from pin_and_cite.core.regular_file import NotRegularFile, read_regular
from pin_and_cite.core.store import MAX_BLOB_BYTES


@dataclass
class Fetched:
    source: str
    path: str
    blob: str
    origin: str  # "cache", "distribution NAME VERSION" or the git URL
    note: str = ""  # e.g. why an installed file was passed over


def from_distribution(project: Project, source_name: str, path: str, blob: str) -> tuple[bytes, str] | str:
    """The installed file's bytes and origin if it hashes to `blob`; else a reason it was not used. The file is
    read no further than the lock says the blob holds (a wheel's 434 MB `.so` named with `size: 10` is read
    for 11 bytes)."""
    source = project.pins.get(source_name)
    if not source.distribution_name:
        return ""
    hit = installed_file(source.distribution_name, path)
    if hit is None:
        return ""
    version, file = hit
    size = locked_size(project, source_name, path, blob)
    try:
        data = read_regular(file, MAX_BLOB_BYTES if size is None else size)
    except NotRegularFile as exc:
        return f"installed {source.distribution_name} {version}: {exc} (not used)"
    if data is None or blob_sha(data) != blob:
        return f"installed {source.distribution_name} {version} has other bytes for {path} (not used)"
    return data, f"distribution {source.distribution_name} {version}"


def locked_size(project: Project, source_name: str, path: str, blob: str) -> int | None:
    """The size the lock records for this blob (what a cache read is bounded by), if it records one."""
    entry = project.lock.files.get(file_key(source_name, path))
    return entry.size if entry is not None and entry.blob == blob else None


def fetch_all(project: Project, report: Callable[[Fetched, int, int], None]) -> list[Fetched]:
    """Make every file the lock needs (pinned files, and both ends of each recorded bump) available in the
    cache; raise SourceUnavailable naming what could not be had."""
    items = project.lock.blobs()
    done: list[Fetched] = []
    missing: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
    with project.store.lock("fetch"):
        for source_name, path, blob in items:
            if project.store.get(blob, locked_size(project, source_name, path, blob)) is not None:
                done.append(Fetched(source_name, path, blob, "cache"))
                report(done[-1], len(done), len(items))
                continue
            found = from_distribution(project, source_name, path, blob)
            if isinstance(found, tuple):
                project.store.put(blob, found[0])
                done.append(Fetched(source_name, path, blob, found[1]))
                report(done[-1], len(done), len(items))
            else:
                missing[source_name].append((path, blob, found))
        for source_name, wanted in missing.items():
            source = project.pins.get(source_name)
            remote = project.remote(source)
            with remote.lock:
                sizes = {blob: locked_size(project, source_name, path, blob) for path, blob, _ in wanted}
                data = remote.fetch_blobs(
                    [blob for _, blob, _ in wanted],
                    f"fetching {len(wanted)} file(s) of {source_name}",
                    {blob: size for blob, size in sizes.items() if size is not None},
                )
                for path, blob, note in wanted:
                    project.store.put(blob, data[blob])
                    done.append(Fetched(source_name, path, blob, remote.url, note))
                    report(done[-1], len(done), len(items))
    return done


def load_blob(project: Project, source_name: str, path: str, blob: str, allow_remote: bool) -> bytes:
    """One file's verified bytes: cache, then installed distribution, then (if allowed) git."""
    data = project.store.get(blob, locked_size(project, source_name, path, blob))
    if data is not None:
        return data
    found = from_distribution(project, source_name, path, blob)
    if isinstance(found, tuple):
        project.store.put(blob, found[0])
        return found[0]
    if not allow_remote:
        raise SourceUnavailable(f"{source_name}:{path} (blob {blob[:12]}) is not fetched; run `pin-and-cite fetch`")
    remote = project.remote(project.pins.get(source_name))
    with remote.lock:
        size = locked_size(project, source_name, path, blob)
        data = remote.fetch_blobs([blob], f"fetching {path}", {blob: size} if size is not None else None)[blob]
    project.store.put(blob, data)
    return data
