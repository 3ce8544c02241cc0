"""`bump`: move a source's pin to a new commit and carry every citation of it along, as one step.

Plan first, write last: every citation of the source (in the note templates and in the lock) is relocated
with the engine, range citations get their new line numbers, symbol citations keep their spec, and the new
templates, pins.toml and lock are computed in memory. Only when all of that succeeded are the files written,
together (journal.write_all); `--dry-run` stops before writing. A citation that has no counterpart any
more (deleted, or a symbol under a new name) is left as written and not locked, so `check` keeps failing on
it until a person fixes the note: the review report lists it with its old text.

The lock also gets the source's bump record (lock.BumpRecord, replacing the one of its previous bump): per
changed or deleted citation its old and new lines, text hashes and where the notes cite it, and the blobs of
its file at both commits, so the site can show the same diffs later (pin_and_cite.changes).
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pin_and_cite import symbols
from pin_and_cite.citation import Spec, parse_spec
from pin_and_cite.errors import PinAndCiteError
from pin_and_cite.fetch import from_distribution
from pin_and_cite.gitobj import blob_sha, is_full_sha
from pin_and_cite.journal import write_all
from pin_and_cite.lock import BumpRecord, RecordedChange, RecordedFile, file_key
from pin_and_cite.notes import Written, rewrite_arguments, written_calls
from pin_and_cite.project import Project
from pin_and_cite.reanchor import fetch_files, file_pairs, relocate_pairs
from pin_and_cite.relocate import FilePair, Relocation
from pin_and_cite.resolve import Resolver, cited_text, text_sha256

STATUSES = ("unchanged", "moved", "changed", "deleted")
REVIEWED = ("changed", "deleted")             # the statuses a person must look at


class AlreadyPinned(Exception):
    """REF names the commit already pinned: bumping to it would replace the last bump's record with an empty
    one (a second run of the same bump, in parallel or after an unclear Ctrl-C), so it is a no-op."""

    def __init__(self, source: str, commit: str, ref: str):
        super().__init__(f"{source} is already pinned at {commit[:12]} ({ref}); nothing to bump")
        self.source, self.commit = source, commit


@dataclass
class Carried:
    """One citation of the bumped source: where it is written, what the engine answered, what it becomes."""
    spec: Spec
    places: list[Written]
    in_lock: bool
    answer: Relocation | None = None
    new_spec: Spec | None = None          # None: left as written (deleted, renamed symbol): needs a person
    old_lines: tuple[int, int] = (0, 0)
    old_text: list[str] = field(default_factory=list)
    new_text: list[str] = field(default_factory=list)


@dataclass
class Bump:
    source: str
    old: str
    new: str
    tag: str | None
    citations: list[Carried]
    record: BumpRecord
    writes: dict[Path, bytes]


def _citations_of(project: Project, name: str) -> dict[str, Carried]:
    found: dict[str, Carried] = {}
    for call in written_calls(project.notes_dir, {"cite"}):
        try:
            spec = parse_spec(call.argument)
        except PinAndCiteError as exc:
            raise PinAndCiteError(f"{call.where(project.root)}: {exc}") from None
        if spec.source == name:
            found.setdefault(str(spec), Carried(spec, [], False)).places.append(call)
    for key in project.lock.citations:
        spec = parse_spec(key)
        if spec.source == name:
            found.setdefault(key, Carried(spec, [], True)).in_lock = True
    return found


def _new_argument(argument: str, lines: tuple[int, int]) -> str:
    """The same literal with only its `#Lx-Ly` anchor changed (a one-line `#Lx` stays one-line if it can)."""
    single = re.search(r"#L\d+\s*$", argument) and lines[0] == lines[1]
    anchor = f"#L{lines[0]}" if single else f"#L{lines[0]}-L{lines[1]}"
    return re.sub(r"#L\d+(?:-L\d+)?(?=\s*$)", anchor, argument)


def plan(project: Project, name: str, ref: str) -> Bump:
    source = project.pins.get(name)
    remote = project.remote(source)
    new = remote.resolve_ref(ref)
    old = source.commit
    if new == old:
        raise AlreadyPinned(name, old, ref)
    carried = list(_citations_of(project, name).values())
    paths = sorted({c.spec.path for c in carried})
    known = {}
    for path in paths:
        entry = project.lock.files.get(file_key(name, path))
        if entry is not None and entry.commit != old:
            raise PinAndCiteError(f"citations.lock has {name}:{path} at {entry.commit[:12]} but pins.toml pins "
                                  f"{old[:12]}; run `check` and re-cite before bumping")
        if entry is not None:
            known[(old, path)] = entry.blob

    def installed(path: str, blob: str) -> bytes | None:
        found = from_distribution(project, name, path, blob)
        return found[0] if isinstance(found, tuple) else None

    files = fetch_files(remote, project.store, {old: paths, new: paths}, known, installed)
    pairs = file_pairs(paths, old, new, files)
    for c, answer in zip(carried, relocate_pairs([c.spec for c in carried], pairs)):
        c.answer = answer
    failed = [c for c in carried if c.answer.status == "error"]
    if failed:
        where = failed[0].places[0].where(project.root) if failed[0].places else "citations.lock"
        raise PinAndCiteError(f"cannot bump {name}: {len(failed)} citation(s) cannot be relocated, e.g. {where}: "
                              f"{failed[0].spec}: {failed[0].answer.reason}")

    tag = None if is_full_sha(ref) else ref
    pins_bytes = project.pins.with_commit(name, source.url, new, tag)   # from here on, resolving means at `new`
    resolver = Resolver(project)
    for table in (project.lock.citations, project.lock.files):
        for key in [k for k in table if k.startswith(f"{name}:")]:
            del table[key]
    for c in carried:
        _carry(c, resolver, pairs[c.spec.path], old)
    blobs = {key: blob_sha(data) if data is not None else None for key, data in files.items()}
    record = project.lock.bumps[name] = _record(project.root, carried, old, new, tag, blobs)
    return Bump(name, old, new, tag, carried, record, {project.pins.path: pins_bytes, **_templates(carried),
                                                       project.lock.path: project.lock.dumps()})


def _carry(c: Carried, resolver: Resolver, pair: FilePair, old: str) -> None:
    """Decide the citation's new spec, lock it, and keep both excerpts for the review report (the file's
    lines and symbol table come from the pair the engine used, not split or parsed again)."""
    old_lines, new_lines = pair.old_raw, pair.new_raw
    if c.spec.symbol:
        first, last = symbols.resolve(pair.definitions("old"), c.spec.symbol, f"{c.spec.path} at {old[:12]}")
    else:
        first, last = c.spec.lines
    c.old_lines = (first, last)
    c.old_text = list(old_lines[first - 1:last])
    if c.answer.lines:
        c.new_text = list(new_lines[c.answer.lines[0] - 1:c.answer.lines[1]])
    if c.answer.status == "deleted":
        return
    spec = c.spec if c.spec.symbol else Spec(c.spec.source, c.spec.path, lines=c.answer.lines)
    try:
        excerpt, learned = resolver.resolve(spec)
    except PinAndCiteError:
        return                                            # a symbol that is gone or ambiguous under its name
    resolver.record(excerpt, learned)
    c.new_spec = spec


def _record(root: Path, carried: list[Carried], old: str, new: str, tag: str | None,
            blobs: dict[tuple[str, str], str | None]) -> BumpRecord:
    """What the lock keeps of this bump: hashes, paths, lines and statuses, never upstream text."""
    changes, files = {}, {}
    for c in (c for c in carried if c.answer.status in REVIEWED):
        files[c.spec.path] = RecordedFile(blobs[(old, c.spec.path)], blobs[(new, c.spec.path)])
        new_sha = text_sha256(cited_text(c.new_text)) if c.answer.lines else None
        changes[str(c.spec)] = RecordedChange(c.answer.status, c.old_lines, text_sha256(cited_text(c.old_text)),
                                              c.answer.lines, new_sha, str(c.new_spec) if c.new_spec else None,
                                              [call.where(root) for call in c.places])
    found = Counter(c.answer.status for c in carried)
    return BumpRecord(old, new, tag, {status: found[status] for status in STATUSES}, files, changes)


def _templates(carried: list[Carried]) -> dict[Path, bytes]:
    changes: dict[Path, list[tuple[Written, str]]] = {}
    for c in carried:
        if c.new_spec is None or c.spec.symbol or c.new_spec.lines == c.spec.lines:
            continue
        for call in c.places:
            changes.setdefault(call.file, []).append((call, _new_argument(call.argument, c.new_spec.lines)))
    return {template: rewrite_arguments(template, edits) for template, edits in changes.items()}


def apply(bump: Bump, notes_dir: Path) -> None:
    write_all(bump.writes, notes_dir)
