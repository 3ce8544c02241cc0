"""What the AST of a Python file yields (its definitions, its statement boundaries, a parameter's default)
and the calls a note template writes (pin_and_cite.core.notes),
kept on disk under the cache and keyed by the file's git blob SHA: parsing the large pinned files is most of
the work of a `check`, and the facts of one blob never change.

Safe by construction: the key is the hash of the file's bytes, so a changed file never meets a stale entry;
the folder is named by a hash of the code that computes the entries (the reader modules below), so a change
to that code starts afresh. An entry that cannot be read or decoded is ignored and written again; a cache that
cannot be written only costs time. Entries are JSON, never pickles: reading one runs no code.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pin_and_cite.core import defaults, highlights, symbols
from pin_and_cite.core.atomic import atomic_write
from pin_and_cite.core.gitobj import blob_sha, is_full_sha

Spans = dict[str, list[tuple[int, int]]]
T = TypeVar("T")


READERS = ("symbols.py", "highlights.py", "defaults.py", "notes.py", "verified_by.py", "parse_cache.py")  # core/


def _readers_version() -> str:
    """A hash of the modules whose results are cached: editing one of them is a new cache."""
    digest = hashlib.sha256()
    for name in READERS:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:16]


class ParseCache:
    """Per-blob parse results under `<cache>/parsed/<readers version>/`, memoized in memory too."""

    def __init__(self, cache_root: Path):
        self.folder = cache_root / "parsed" / _readers_version()
        self._memo: dict[tuple[str, str], object] = {}

    def get(self, blob: str, what: str, compute: Callable[[], object], decode: Callable[[object], T]) -> T:
        """decode(the JSON value `compute()` gives for `what` of the file whose blob SHA is `blob`), computed
        once: a stored value that does not decode is computed again."""
        if (blob, what) in self._memo:
            return self._memo[(blob, what)]
        if not is_full_sha(blob):
            raise ValueError(f"parse cache key {blob[:80]!r} is not a full blob SHA")
        path = self.folder / blob[:2] / blob[2:] / f"{hashlib.sha256(what.encode()).hexdigest()[:32]}.json"
        try:
            entry = json.loads(path.read_bytes())
            if entry["what"] != what:
                raise KeyError(what)
            found = decode(entry["value"])
        except Exception:  # missing, truncated, or not an entry of this shape: compute it again
            value = compute()
            found = decode(value)
            try:
                atomic_write(path, json.dumps({"what": what, "value": value}).encode())
            except (OSError, TypeError, ValueError):  # a full disk, or a value JSON cannot hold: it costs time
                pass
        self._memo[(blob, what)] = found
        return found

    def for_this_run(self, key: tuple, compute: Callable[[], T]) -> T:
        """compute(), once per key for the life of this cache (one check, one build), in memory only: for facts
        of the checkout that one run asks for many times and the next run must ask again."""
        if ("run", key) not in self._memo:
            self._memo[("run", key)] = compute()
        return self._memo[("run", key)]

    def definitions(self, blob: str, parse: Callable[[], object]) -> Spans:
        """symbols.definitions_in of the tree `parse()` gives, for the file `blob`."""
        return self.get(
            blob,
            "definitions",
            lambda: symbols.definitions_in(parse()),
            lambda found: {str(name): [_span(span) for span in spans] for name, spans in found.items()},
        )

    def definitions_in_text(self, data: bytes, text: str, filename: str) -> Spans:
        """The definitions of a file of this repository (its bytes and their text), for ours()."""
        return self.definitions(blob_sha(data), lambda: symbols.parse(text, filename))

    def docstrings_in_text(self, data: bytes, text: str, filename: str) -> dict[str, tuple[int, int]]:
        """symbols.docstrings_in of a file of this repository (its bytes and their text), for mirrors()."""
        return self.get(
            blob_sha(data),
            "docstrings",
            lambda: symbols.docstrings_in(symbols.parse(text, filename)),
            lambda found: {str(name): _span(span) for name, span in found.items()},
        )

    def statements(self, blob: str, parse: Callable[[], object], lines) -> highlights.Statements:
        """The statement boundaries of the file `blob` (its `lines`, the tree `parse()` gives)."""
        return self.get(
            blob,
            "statements",
            lambda: highlights.Statements.of(parse(), lines).as_json(),
            lambda found: highlights.Statements.from_json(found, lines),
        )

    def default(
        self, blob: str, ref: defaults.DefaultRef, read: Callable[[], defaults.FoundDefault]
    ) -> defaults.FoundDefault:
        """The default `ref` names in the file `blob`; a missing default is an error, never cached."""
        return self.get(
            blob,
            f"default {ref}",
            lambda: [(found := read()).value, found.line],
            lambda found: defaults.FoundDefault(str(found[0]), int(found[1])),
        )


def _span(span) -> tuple[int, int]:
    first, last = span
    return int(first), int(last)
