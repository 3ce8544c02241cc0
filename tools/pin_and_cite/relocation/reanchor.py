"""Relocate a batch of citations of one remote between two commits, fetching each file once per commit.

The network cost does not depend on how many citations there are: per commit, the commit object and the
trees on the cited paths (one request per directory level), then every needed blob of both commits in one
request. Each blob is verified by its git hash and kept in the cache, so a second run fetches nothing.
Citations whose code left their file are then looked for in other files (pin_and_cite.relocation.crossfile), which
fetches more only for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pin_and_cite.core.citation import Spec, parse_location
from pin_and_cite.core.commit_files import LocalBytes, fetch_files
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.remote import Remote
from pin_and_cite.core.resolve import split_lines
from pin_and_cite.core.store import Store, default_cache_dir
from pin_and_cite.relocation.crossfile import CrossFile
from pin_and_cite.relocation.relocate import FilePair, Relocation


def file_pairs(
    paths: Iterable[str], old: str, new: str, files: dict[tuple[str, str], bytes | None]
) -> dict[str, FilePair | str]:
    """Each path's FilePair (its lines at both commits, split once), or why it has none. A path absent at the
    new commit is an empty file there: its citations are `deleted` until found in another file."""
    pairs: dict[str, FilePair | str] = {}
    for path in paths:
        try:
            if files[(old, path)] is None:
                raise PinAndCiteError(f"{path} does not exist at {old[:12]}")
            texts = [split_lines(files[(commit, path)] or b"", f"{path} at {commit[:12]}") for commit in (old, new)]
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


def relocate_batch(
    cites: list[Spec], old: str, new: str, files: dict[tuple[str, str], bytes | None]
) -> list[Relocation]:
    """Answer every citation, in order; problems with one citation become its own `error` answer."""
    return relocate_pairs(cites, file_pairs(dict.fromkeys(c.path for c in cites), old, new, files))


@dataclass
class Relocated:
    """A batch's answers, with what they were computed from (bump reads the texts and blobs back)."""

    answers: list[Relocation]
    files: dict[tuple[str, str], bytes | None]  # (commit, path) -> bytes of every cited path
    pairs: dict[str, FilePair | str]
    elsewhere: CrossFile  # the other files it looked into

    def same_file_pair(self, cited_path: str, answer: Relocation) -> FilePair | None:
        """The cited file at both commits, when the answer stays in that file (None: it went elsewhere or the
        file is gone), for relocating other lines of the same citation, such as its highlight."""
        pair = self.pairs[cited_path]
        return pair if isinstance(pair, FilePair) and not answer.path else None

    def new_lines(self, cited_path: str, answer: Relocation) -> tuple[str, ...]:
        """The lines of the file an answer points into, at the new commit."""
        if answer.path:
            return tuple(self.elsewhere.files[answer.path].raw)
        pair = self.pairs[cited_path]
        return tuple(pair.new_raw) if isinstance(pair, FilePair) else ()


def relocate_remote(
    remote: Remote,
    store: Store,
    cites: list[Spec],
    old: str,
    new: str,
    known: dict | None = None,
    local: LocalBytes | None = None,
) -> Relocated:
    """Answer every citation of one remote, in order: each cited file fetched once per commit, then the code
    that left its file followed into others."""
    paths = sorted({c.path for c in cites})
    files = fetch_files(remote, store, {old: paths, new: paths}, known, local)
    pairs = file_pairs(paths, old, new, files)
    elsewhere = CrossFile(remote, store, old, new, local)
    return Relocated(elsewhere.follow(cites, relocate_pairs(cites, pairs), pairs), files, pairs, elsewhere)


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
    answers.update(zip(specs, relocate_remote(remote, store, list(specs.values()), old, new).answers))
    return [answers[i].as_json(text.strip(), specs[i].path if i in specs else None) for i, text in enumerate(texts)]
