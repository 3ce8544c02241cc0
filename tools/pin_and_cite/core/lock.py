"""reading_notes/citations.lock: per cited file its blob SHA at the pinned commit, per citation its text hash,
per parameter default a note renders its source text and line (pin_and_cite.core.defaults), and per source the record
of its latest `bump` (what the site's change pages show).

JSON with sorted keys, so a diff of the lock reads like a diff of what the notes cite. Like the rest of the lock,
a bump record holds only commits, blob SHAs, paths, line numbers, text hashes and statuses: the excerpts it
describes are read at build time from the blobs it names, fetched and verified like every other cited file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pin_and_cite.core import schema
from pin_and_cite.core.atomic import atomic_write
from pin_and_cite.core.bounded import parse, read_file
from pin_and_cite.core.citation import SOURCE_NAME, check_repo_path
from pin_and_cite.core.errors import PinAndCiteError

VERSION = 1  # schema.LOCK accepts this version only
MAX_BYTES = 16 << 20  # the project's lock holds 66 KB


@dataclass
class LockedFile:
    commit: str
    blob: str
    size: int
    resolved_from: str  # how the blob SHA was learned: "git tree" or "distribution NAME VERSION"


@dataclass
class LockedCitation:
    lines: tuple[int, int]
    text_sha256: str
    symbol: str | None = None


@dataclass
class LockedDefault:
    """A default a note renders, keyed `SOURCE:PATH::Qual.name(param)`: as written upstream, and where."""

    value: str
    line: int


@dataclass
class RecordedDefault:
    """A locked default whose text a bump changed (new_value None: the parameter or its default is gone)."""

    old_value: str
    new_value: str | None


@dataclass
class RecordedFile:
    old_blob: str | None  # None: absent at the old commit, or only a new side is read from this path
    new_blob: str | None  # None: the path is gone at the new commit


@dataclass
class RecordedChange:
    """A citation whose text a bump changed or deleted, keyed by the citation as it was written before."""

    status: str  # "changed" | "deleted"
    old_lines: tuple[int, int]
    old_text_sha256: str
    new_lines: tuple[int, int] | None  # the best counterpart at the new commit; None when deleted
    new_text_sha256: str | None
    new_cite: str | None  # what the lock cites now; None: left as written for a person
    cited_at: list[str]  # note template file:line at the bump ([]: only in the lock)
    new_path: str | None = None  # the file new_lines are in, when the code left the cited one


STATUSES = ("unchanged", "moved", "changed", "deleted")  # a bumped citation's relocation status
REVIEWED = ("changed", "deleted")  # the statuses a person must look at


@dataclass
class BumpRecord:
    """The latest `bump` of one source (a later bump of it replaces this record)."""

    old_commit: str
    new_commit: str
    tag: str | None
    counts: dict[str, int]  # citations per relocation status
    files: dict[str, RecordedFile]  # path -> its blobs at both commits, for every recorded change
    changes: dict[str, RecordedChange]
    defaults: dict[str, RecordedDefault] = field(default_factory=dict)
    distribution: str | None = None  # the wheel `NAME==VERSION` this bump set as the new pin's release


def _bump_record(data: dict) -> BumpRecord:
    changes = {
        k: RecordedChange(
            **{**v, "old_lines": tuple(v["old_lines"]), "new_lines": tuple(v["new_lines"]) if v["new_lines"] else None}
        )
        for k, v in data["changes"].items()
    }
    return BumpRecord(
        data["old_commit"],
        data["new_commit"],
        data.get("tag"),
        dict(data["counts"]),
        {k: RecordedFile(**v) for k, v in data["files"].items()},
        changes,
        {k: RecordedDefault(**v) for k, v in data.get("defaults", {}).items()},
        data.get("distribution"),
    )


def _check_keys(data: dict) -> None:
    """Keys that name files to read are checked as strictly as the paths of citations: a key the schema lets
    through as any string (`torch:../../../bin/torchrun`) must not name a file outside the repository, which
    an installed distribution's RECORD can list. (Citation and default keys are parsed where they are used.)"""
    for key in data["files"]:
        source, _, path = key.partition(":")
        if not SOURCE_NAME.fullmatch(source):
            raise PinAndCiteError(f"files key {key[:80]!r} does not start with a source name")
        check_repo_path(path)
    for record in data.get("bumps", {}).values():
        for path in record["files"]:
            check_repo_path(path)


def file_key(source: str, path: str) -> str:
    return f"{source}:{path}"


class Lock:
    def __init__(self, path: Path):
        self.path = path
        self.files: dict[str, LockedFile] = {}
        self.citations: dict[str, LockedCitation] = {}
        self.defaults: dict[str, LockedDefault] = {}
        self.bumps: dict[str, BumpRecord] = {}  # source name -> its latest bump
        if path.exists():
            self._load()

    def _load(self) -> None:
        """Read the lock, refusing anything that does not fit schema.LOCK before a field is used."""
        try:
            data = parse(json.loads, read_file(self.path, MAX_BYTES, str(self.path)), str(self.path))
        except ValueError as exc:  # also UnicodeDecodeError
            raise PinAndCiteError(f"{self.path} is not a valid lock ({exc}); restore it from git") from None
        schema.check(data, schema.LOCK, f"{self.path} is not a valid lock:", "restore it from git")
        try:
            _check_keys(data)
        except PinAndCiteError as exc:
            raise PinAndCiteError(f"{self.path} is not a valid lock: {exc}; restore it from git") from None
        self.files = {k: LockedFile(**v) for k, v in data["files"].items()}
        self.citations = {
            k: LockedCitation(tuple(v["lines"]), v["text_sha256"], v.get("symbol"))
            for k, v in data["citations"].items()
        }
        self.defaults = {k: LockedDefault(**v) for k, v in data.get("defaults", {}).items()}
        self.bumps = {k: _bump_record(v) for k, v in data.get("bumps", {}).items()}

    def save(self) -> None:
        atomic_write(self.path, self.dumps())

    def dumps(self) -> bytes:
        data = {
            "version": VERSION,
            "files": {k: asdict(v) for k, v in sorted(self.files.items())},
            "citations": {
                k: {key: val for key, val in asdict(v).items() if val is not None}
                for k, v in sorted(self.citations.items())
            },
        }
        if self.defaults:
            data["defaults"] = {k: asdict(v) for k, v in sorted(self.defaults.items())}
        if self.bumps:
            data["bumps"] = {
                k: {key: val for key, val in asdict(v).items() if key not in ("defaults", "distribution") or val}
                for k, v in self.bumps.items()
            }
        return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()

    def deleted_by_bump(self, key: str) -> str | None:
        """The tag (else commit) of the latest bump of `key`'s source when it deleted the code `key` cites: the
        same lines at the new pin hold other code, so re-locking them would put it under prose about the old."""
        record = self.bumps.get(key.split(":", 1)[0])
        change = record.changes.get(key) if record else None
        if change is None or change.status != "deleted":
            return None
        return record.tag or record.new_commit[:12]

    def left_by_bump(self, key: str) -> str | None:
        """Why the citation or default `key`, written in a note, is not locked because the latest bump of its
        source left it behind, as advice that never says to lock `key` again (its lines hold other code now),
        or None: the code is gone, or it changed and went elsewhere, or the default is gone."""
        record = self.bumps.get(key.split(":", 1)[0])
        if record is None or key in self.citations or key in self.defaults:
            return None
        bump = record.tag or record.new_commit[:12]
        change, default = record.changes.get(key), record.defaults.get(key)
        if change is not None and change.status == "deleted":
            return f"deleted by the bump to {bump}: rewrite the claim, then cite"
        if change is not None and change.new_cite and change.new_cite != key:
            carried = change.new_cite
            return f"the bump to {bump} changed this code and carried it to {carried}: check the claim, then cite that"
        if change is not None:
            where = f"L{change.new_lines[0]}-L{change.new_lines[1]}" if change.new_lines else "nowhere"
            return f"the bump to {bump} found no code under this name (its closest match is {where}): rewrite the claim"
        if default is not None and default.new_value is None:
            return f"the bump to {bump} removed this default: rewrite the claim"
        return None

    def blobs(self) -> list[tuple[str, str, str]]:
        """(source, path, blob) of every file that `fetch` must make available: each locked file, then each
        blob a bump record names that is not among them."""
        wanted = [(*key.split(":", 1), f.blob) for key, f in sorted(self.files.items())]
        seen = {blob for _, _, blob in wanted}
        for source, record in sorted(self.bumps.items()):
            for path, f in sorted(record.files.items()):
                for blob in (f.old_blob, f.new_blob):
                    if blob and blob not in seen:
                        seen.add(blob)
                        wanted.append((source, path, blob))
        return wanted
