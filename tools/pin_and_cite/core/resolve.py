"""Turn a citation spec into an excerpt: the exact lines at the pinned commit, proven by blob hash."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from pin_and_cite.core import symbols
from pin_and_cite.core.bounded import read_file
from pin_and_cite.core.citation import Spec
from pin_and_cite.core.defaults import DefaultRef, FoundDefault, read_default
from pin_and_cite.core.distribution import installed_file
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.fetch import load_blob
from pin_and_cite.core.gitobj import blob_sha
from pin_and_cite.core.highlights import Statements
from pin_and_cite.core.lock import LockedCitation, LockedDefault, LockedFile, file_key
from pin_and_cite.core.parse_cache import ParseCache
from pin_and_cite.core.pins import Source
from pin_and_cite.core.project import Project
from pin_and_cite.core.store import MAX_BLOB_BYTES


def cited_text(lines: Sequence[str]) -> str:
    """Cited lines as the lock hashes them: joined by '\\n', with a final '\\n'."""
    return "\n".join(lines) + "\n"


def text_sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Excerpt:
    spec: Spec
    source: Source
    blob: str
    lines: tuple[int, int]
    text: str

    @property
    def text_sha256(self) -> str:
        return text_sha256(self.text)

    @property
    def permalink(self) -> str | None:
        return self.source.permalink(self.spec.path, self.lines)

    def numbered(self) -> str:
        width = len(str(self.lines[1]))
        return "".join(
            f"{n:>{width}} | {line}\n"
            for n, line in zip(range(self.lines[0], self.lines[1] + 1), self.text.split("\n"))
        )

    def as_json(self) -> dict:
        return {
            "cite": str(self.spec),
            "source": self.source.name,
            "commit": self.source.commit,
            "path": self.spec.path,
            "blob": self.blob,
            "lines": list(self.lines),
            "symbol": self.spec.symbol,
            "text_sha256": self.text_sha256,
            "permalink": self.permalink,
            "text": self.text,
        }


def split_lines(data: bytes, where: str) -> tuple[str, ...]:
    """Lines as git and GitHub number them: split on '\\n' only."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise PinAndCiteError(f"{where} is not UTF-8 text; only text files can be cited") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return tuple(lines)


class Resolver:
    """Resolves specs against one project, memoizing per-blob work (lines, symbol tables) for bulk checks."""

    def __init__(self, project: Project, allow_remote: bool = True, trust_distribution: bool = False):
        self.project = project
        self.allow_remote = allow_remote
        self.trust_distribution = trust_distribution
        # per instance, not functools.cache on the methods: that would keep every Resolver (and the file
        # texts) alive for the process, one per rebuild under `mkdocs serve`
        self.lines_of = functools.cache(self._lines_of)
        self.tree_of = functools.cache(self._tree_of)
        self.resolve = functools.cache(self._resolve)  # check verifies a citation, then renders it
        self.parsed = ParseCache(project.cache_dir)  # what the trees yield, kept on disk by blob

    def definitions_of(self, source_name: str, path: str, blob: str) -> dict[str, list[tuple[int, int]]]:
        return self.parsed.definitions(blob, lambda: self.tree_of(source_name, path, blob))

    def statements_of(self, source_name: str, path: str, blob: str) -> Statements:
        return self.parsed.statements(
            blob, lambda: self.tree_of(source_name, path, blob), self.lines_of(source_name, path, blob)
        )

    def locked_blob(self, source: Source, path: str) -> str | None:
        locked = self.project.lock.files.get(file_key(source.name, path))
        return locked.blob if locked and locked.commit == source.commit else None

    def blob_for(self, source: Source, path: str) -> tuple[str, str]:
        """(blob, how it was learned) of `path` at the pinned commit: the lock, the git tree, or by request
        the installed distribution (for bootstrapping a lock where the git remote is out of reach)."""
        blob = self.locked_blob(source, path)
        if blob:
            return blob, "lock"
        where = f"{source.name}@{source.commit[:12]}"
        if self.trust_distribution:
            hit = installed_file(source.distribution_name or "", path)
            if hit is None:
                raise PinAndCiteError(
                    f"{path} is not in installed {source.distribution or 'distribution (none pinned)'}"
                )
            data = read_file(hit[1], MAX_BLOB_BYTES, str(hit[1]))
            return blob_sha(data or b""), f"distribution {source.distribution_name} {hit[0]}"
        if not self.allow_remote:
            raise PinAndCiteError(f"{source.name}:{path} is not in the lock; cite it once with network to lock it")
        blob = self.project.remote(source).blob_ids(source.commit, [path])[path]
        if blob is None:
            raise PinAndCiteError(f"{path} does not exist at {where}")
        return blob, "git tree"

    def _lines_of(self, source_name: str, path: str, blob: str) -> tuple[str, ...]:
        data = load_blob(self.project, source_name, path, blob, self.allow_remote)
        return split_lines(data, f"{source_name}:{path}")

    def _tree_of(self, source_name: str, path: str, blob: str):
        """The file's AST, parsed at most once per blob, and only when the parse cache lacks what it yields."""
        return symbols.parse("\n".join(self.lines_of(source_name, path, blob)), path)

    def statements_in(self, excerpt: Excerpt) -> Statements | None:
        """The statement boundaries a highlight of the excerpt must keep to; None when its file is not Python."""
        if not excerpt.spec.path.endswith(symbols.PYTHON_SUFFIXES):
            return None
        return self.statements_of(excerpt.source.name, excerpt.spec.path, excerpt.blob)

    def _resolve(self, spec: Spec) -> tuple[Excerpt, str]:
        """The excerpt and how its file's blob was learned."""
        source = self.project.pins.get(spec.source)
        blob, learned = self.blob_for(source, spec.path)
        lines = self.lines_of(source.name, spec.path, blob)
        where = f"{spec.path} at {source.name}@{source.commit[:12]}"
        if spec.symbol:
            span = symbols.resolve(self.definitions_of(source.name, spec.path, blob), spec.symbol, where)
        else:
            span = spec.lines
            if span[1] > len(lines):
                raise PinAndCiteError(f"{spec}: past the end of {where} ({len(lines)} lines)")
        return Excerpt(spec, source, blob, span, cited_text(lines[span[0] - 1 : span[1]])), learned

    def resolve_default(self, ref: DefaultRef) -> tuple[FoundDefault, Excerpt, str]:
        """The parameter's default as written at the pinned commit, the excerpt of the symbol declaring it,
        and how its file's blob was learned."""
        excerpt, learned = self.resolve(ref.spec)
        name, path = excerpt.source.name, ref.spec.path
        where = f"{path} at {name}@{excerpt.source.commit[:12]}"
        blob = (name, path, excerpt.blob)
        found = self.parsed.default(
            excerpt.blob,
            ref,
            lambda: read_default(self.lines_of(*blob), self.tree_of(*blob), where, self.definitions_of(*blob), ref),
        )
        return found, excerpt, learned

    def record_file(self, excerpt: Excerpt, learned: str) -> None:
        """Add the excerpt's file to the in-memory lock when it was learned from elsewhere than the lock."""
        if learned != "lock":
            size = len(load_blob(self.project, excerpt.source.name, excerpt.spec.path, excerpt.blob, self.allow_remote))
            self.project.lock.files[file_key(excerpt.source.name, excerpt.spec.path)] = LockedFile(
                excerpt.source.commit, excerpt.blob, size, learned
            )

    def record(self, excerpt: Excerpt, learned: str) -> None:
        """Add the excerpt's file and citation to the in-memory lock (the caller saves it)."""
        self.record_file(excerpt, learned)
        self.project.lock.citations[str(excerpt.spec)] = LockedCitation(
            excerpt.lines, excerpt.text_sha256, excerpt.spec.symbol
        )

    def record_default(self, ref: DefaultRef, found: FoundDefault, excerpt: Excerpt, learned: str) -> None:
        """Add the default (and its file) to the in-memory lock (the caller saves it)."""
        self.record_file(excerpt, learned)
        self.project.lock.defaults[str(ref)] = LockedDefault(found.value, found.line)
