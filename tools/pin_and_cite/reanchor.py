"""Relocate a batch of citations of one remote between two commits, fetching each file once per commit.

The network cost does not depend on how many citations there are: per commit, the commit object and the
trees on the cited paths (one request per directory level), then every needed blob of both commits in one
request. Each blob is verified by its git hash and kept in the cache, so a second run fetches nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from pin_and_cite.citation import Spec, parse_location
from pin_and_cite.errors import PinAndCiteError
from pin_and_cite.relocate import FilePair, Relocation
from pin_and_cite.remote import Remote
from pin_and_cite.resolve import split_lines
from pin_and_cite.store import Store, default_cache_dir

LocalBytes = Callable[[str, str], "bytes | None"]     # (path, blob) -> verified bytes from somewhere local


def fetch_files(remote: Remote, store: Store, wanted: dict[str, Iterable[str]], known: dict | None = None,
                local: LocalBytes | None = None) -> dict[tuple[str, str], bytes | None]:
    """(commit, path) -> bytes (None when the path is absent at that commit) for every path wanted at each
    commit. `known` maps (commit, path) to blob ids already known (say, from a lock); `local` may supply
    verified bytes (say, an installed distribution) before the network is asked."""
    blobs: dict[tuple[str, str], str | None] = dict(known or {})
    with remote.lock:
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


def file_pairs(paths: Iterable[str], old: str, new: str,
               files: dict[tuple[str, str], bytes | None]) -> dict[str, FilePair | str]:
    """Each path's FilePair (its lines at both commits, split once), or why it has none."""
    pairs: dict[str, FilePair | str] = {}
    for path in paths:
        try:
            texts = []
            for commit in (old, new):
                data = files[(commit, path)]
                if data is None:
                    raise PinAndCiteError(f"{path} does not exist at {commit[:12]}")
                texts.append(split_lines(data, f"{path} at {commit[:12]}"))
            pairs[path] = FilePair(path, *texts, old_label=old[:12], new_label=new[:12])
        except PinAndCiteError as exc:
            pairs[path] = str(exc)
    return pairs


def relocate_pairs(cites: list[Spec], pairs: dict[str, FilePair | str]) -> list[Relocation]:
    """Answer every citation from its file's pair, in order; a pair that is an error string answers `error`."""
    answers = []
    for cite in cites:
        pair = pairs[cite.path]
        if isinstance(pair, str):
            answers.append(Relocation("error", None, pair))
        elif cite.symbol:
            answers.append(pair.relocate_symbol(cite.symbol))
        else:
            answers.append(pair.relocate_range(*cite.lines))
    return answers


def relocate_batch(cites: list[Spec], old: str, new: str, files: dict[tuple[str, str], bytes | None]) -> list[Relocation]:
    """Answer every citation, in order; problems with one citation become its own `error` answer."""
    return relocate_pairs(cites, file_pairs(dict.fromkeys(c.path for c in cites), old, new, files))


def relocate_texts(source: str, old_ref: str, new_ref: str, texts: list[str], timeout: float) -> list[dict]:
    """The `relocate` verb: citation strings of one repository (URL or local directory), answered in input
    order as JSON-ready dicts; a malformed citation is its own error answer."""
    url = str(Path(source).resolve()) if Path(source).is_dir() else source
    store = Store(default_cache_dir())
    remote = Remote(url, store.git_dir(url), timeout)
    old, new = remote.resolve_ref(old_ref), remote.resolve_ref(new_ref)
    specs, answers = {}, {}
    for i, text in enumerate(texts):
        try:
            specs[i] = parse_location(text)
        except PinAndCiteError as exc:
            answers[i] = Relocation("error", None, str(exc))
    paths = sorted({spec.path for spec in specs.values()})
    files = fetch_files(remote, store, {old: paths, new: paths})
    answers.update(zip(specs, relocate_batch(list(specs.values()), old, new, files)))
    return [answers[i].as_json(text.strip()) for i, text in enumerate(texts)]
