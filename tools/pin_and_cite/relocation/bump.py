"""`bump`: move a source's pin to a new commit and carry every citation of it along, as one step.

Plan first, write last: every citation of the source (in the note templates and in the lock) is relocated
with the engine, range citations get their new line numbers, symbol citations keep their spec (both take the
new path, and a symbol its new name, when the code went into another file: pin_and_cite.relocation.crossfile),
and the new templates, pins.toml and lock are computed in memory. Only when all of that succeeded are the files
written, together (journal.write_all); `--dry-run` stops before writing. A citation that has no counterpart any
more (deleted, or a symbol under a new name) is left as written and not locked, so `check` keeps failing on
it until a person fixes the note: the review report lists it with its old text.

Highlights travel with their citations (pin_and_cite.relocation.bump_highlights): each cite() call's `highlight=` is
rewritten to where its lines went, or reported for review.

The lock also gets the source's bump record (lock.BumpRecord, replacing the one of its previous bump): per
changed or deleted citation its old and new lines, text hashes and where the notes cite it, and the blobs of
its file at both commits, so the site can show the same diffs later (pin_and_cite.site.changes).

The source's wheel follows the pin (pin_and_cite.core.release): a release tag moves pins.toml's `distribution`
and constraints.txt's line with it; `--distribution` names it for a pin no tag maps.

Locked parameter defaults (pin_and_cite.core.defaults) are read again at the new commit: the lock follows the new
text, and every default whose text changed, or that is gone, is recorded and reported, since the prose around
it may now be wrong. A default that is gone leaves the lock, so `check` fails on its note until a person fixes it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pin_and_cite.core import symbols
from pin_and_cite.core.atomic import atomic_write
from pin_and_cite.core.citation import Spec, parse_spec
from pin_and_cite.core.code_citations import code_citations, code_texts
from pin_and_cite.core.context import Context
from pin_and_cite.core.defaults import DefaultRef, parse_key
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.fetch import from_distribution
from pin_and_cite.core.gitobj import blob_sha, is_full_sha
from pin_and_cite.core.lock import (
    REVIEWED,
    STATUSES,
    BumpRecord,
    RecordedChange,
    RecordedDefault,
    RecordedFile,
    file_key,
)
from pin_and_cite.core.notes import rewrite_arguments, written_calls
from pin_and_cite.core.project import Project
from pin_and_cite.core.release import CONSTRAINTS, on_the_index, pinned_version, released, with_constraint
from pin_and_cite.core.resolve import Resolver, cited_text, text_sha256
from pin_and_cite.relocation import bump_highlights
from pin_and_cite.relocation.carried import Carried
from pin_and_cite.relocation.journal import write_all
from pin_and_cite.relocation.reanchor import Relocated, relocate_remote

CARRIED_CALLS = {"cite", "upstream"}  # the template calls whose spec a bump rewrites; default() names a symbol


class AlreadyPinned(Exception):
    """REF names the commit already pinned: bumping to it would replace the last bump's record with an empty
    one (a second run of the same bump, in parallel or after an unclear Ctrl-C), so it is a no-op."""

    def __init__(self, source: str, commit: str, ref: str):
        super().__init__(f"{source} is already pinned at {commit[:12]} ({ref}); nothing to bump")
        self.source, self.commit = source, commit


@dataclass
class Bump:
    source: str
    old: str
    new: str
    tag: str | None
    citations: list[Carried]
    record: BumpRecord
    writes: dict[Path, bytes]  # in the notes folder: written together (journal.write_all)
    distribution: tuple[str | None, str | None]  # the source's wheel before and after
    constraints: dict[Path, bytes]  # constraints.txt pinning the new wheel, written right after


def _citations_of(project: Project, name: str) -> dict[str, Carried]:
    """Every citation of source `name`: written by cite() or upstream() (a link to the same lines) in the notes,
    in the reference's docstrings (there to be listed where the bump record says it is cited; they are symbol
    citations, which name no line, so a move needs no rewrite), and in the lock."""
    found: dict[str, Carried] = {}
    for call in written_calls(Context(project.root), CARRIED_CALLS) + code_citations(code_texts(project.root)):
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


def _new_argument(argument: str, old: Spec, new: Spec) -> str:
    """The same literal with only what moved changed: the `#Lx-Ly` anchor (a one-line `#Lx` stays one-line if
    it can), and the path and symbol name when the code went into another file."""
    argument = argument.replace(f"{old.source}:{old.path}", f"{new.source}:{new.path}", 1)
    if new.symbol:
        return re.sub(r"::[\w.]+(?=\s*$)", f"::{new.symbol}", argument)
    single = re.search(r"#L\d+\s*$", argument) and new.lines[0] == new.lines[1]
    anchor = f"#L{new.lines[0]}" if single else f"#L{new.lines[0]}-L{new.lines[1]}"
    return re.sub(r"#L\d+(?:-L\d+)?(?=\s*$)", anchor, argument)


def _new_distribution(source, tag: str | None, asked: str | None) -> str | None:
    """The wheel of the new pin: `asked` (`none`: no wheel), else the release the new tag names
    (pin_and_cite.core.release), else the old one, left for `check` to refuse."""
    if asked is None:
        return released(source.distribution, tag) or source.distribution
    if asked == "none":
        return None
    if pinned_version(asked) is None:
        raise PinAndCiteError(f"--distribution takes NAME==VERSION or none, not {asked!r}")
    return asked


def plan(project: Project, name: str, ref: str, distribution: str | None = None) -> Bump:
    source = project.pins.get(name)
    if distribution is not None:
        _new_distribution(source, None, distribution)  # refuse a malformed one before any work
    remote = project.remote(source)
    new = remote.resolve_ref(ref)
    old = source.commit
    if new == old:
        raise AlreadyPinned(name, old, ref)
    tag = None if is_full_sha(ref) else ref
    wheel = _new_distribution(source, tag, distribution)
    if wheel != source.distribution and pinned_version(wheel) and on_the_index(wheel) is False:  # before the work
        raise PinAndCiteError(
            f"{wheel} is not on the package index pip uses here (`pip index versions {pinned_version(wheel)[0]}`), "
            f"so the upstream tests could not run it: the pin stays at {old[:12]}; name a release it has with "
            "--distribution NAME==VERSION, or --distribution none"
        )
    carried = list(_citations_of(project, name).values())
    defaults = {
        default: project.lock.defaults[key]
        for key in project.lock.defaults
        if (default := parse_key(key)).spec.source == name
    }
    paths = sorted({c.spec.path for c in carried})
    known = {}
    for path in paths:
        entry = project.lock.files.get(file_key(name, path))
        if entry is not None and entry.commit != old:
            raise PinAndCiteError(
                f"citations.lock has {name}:{path} at {entry.commit[:12]} but pins.toml pins "
                f"{old[:12]}; run `check` and re-cite before bumping"
            )
        if entry is not None:
            known[(old, path)] = entry.blob

    def installed(path: str, blob: str) -> bytes | None:
        found = from_distribution(project, name, path, blob)
        return found[0] if isinstance(found, tuple) else None

    relocated = relocate_remote(remote, project.store, [c.spec for c in carried], old, new, known, installed)
    for c, answer in zip(carried, relocated.answers):
        c.answer = answer
    failed = [c for c in carried if c.answer.status == "error"]
    if failed:
        where = failed[0].places[0].where(project.root) if failed[0].places else "citations.lock"
        raise PinAndCiteError(
            f"cannot bump {name}: {len(failed)} citation(s) cannot be relocated, e.g. {where}: "
            f"{failed[0].spec}: {failed[0].answer.reason}"
        )

    pins_bytes = project.pins.with_commit(name, source.url, new, tag)  # from here on, resolving means at `new`
    if wheel != source.distribution:
        pins_bytes = project.pins.with_distribution(name, wheel)
    resolver = Resolver(project)
    for table in (project.lock.citations, project.lock.files):
        for key in [k for k in table if k.startswith(f"{name}:")]:
            del table[key]
    for c in carried:
        _carry(c, resolver, relocated, old)
        c.highlights = bump_highlights.carry(c, relocated.same_file_pair(c.spec.path, c.answer), resolver)
    changed_defaults = {
        str(default): change
        for default, locked in defaults.items()
        if (change := _carry_default(default, locked.value, resolver))
    }
    blobs = {key: blob_sha(data) if data is not None else None for key, data in relocated.files.items()}
    blobs.update({(new, path): blob for path, blob in relocated.elsewhere.blobs.items()})
    record = project.lock.bumps[name] = _record(project.root, carried, old, new, tag, blobs)
    record.defaults = changed_defaults
    record.distribution = wheel if wheel != source.distribution or distribution else None
    return Bump(
        name,
        old,
        new,
        tag,
        carried,
        record,
        {project.pins.path: pins_bytes, **_templates(carried), project.lock.path: project.lock.dumps()},
        (source.distribution, wheel),
        _constraints(project, source.distribution, wheel),
    )


def _constraints(project: Project, old: str | None, new: str | None) -> dict[Path, bytes]:
    """constraints.txt (when present) pinning the new wheel where it pinned the old one."""
    path = project.root / CONSTRAINTS
    if not (old and new and old != new and pinned_version(old) and path.is_file()):
        return {}
    text = path.read_text(encoding="utf-8")
    changed = with_constraint(text, old, new)
    return {path: changed.encode()} if changed != text else {}


def _carry(c: Carried, resolver: Resolver, relocated: Relocated, old: str) -> None:
    """Decide the citation's new spec (in another file when the code went there), lock it, and keep both
    excerpts for the review report (the files' lines and symbol tables come from what the engine used, not
    split or parsed again)."""
    pair = relocated.pairs[c.spec.path]
    if c.spec.symbol:
        first, last = symbols.resolve(pair.definitions("old"), c.spec.symbol, f"{c.spec.path} at {old[:12]}")
    else:
        first, last = c.spec.lines
    c.old_lines = (first, last)
    c.old_text = list(pair.old_raw[first - 1 : last])
    if c.answer.lines:
        c.new_text = list(relocated.new_lines(c.spec.path, c.answer)[c.answer.lines[0] - 1 : c.answer.lines[1]])
    if c.answer.status == "deleted":
        return
    path = c.answer.path or c.spec.path
    spec = (
        Spec(c.spec.source, path, symbol=c.answer.symbol or c.spec.symbol)
        if c.spec.symbol
        else Spec(c.spec.source, path, lines=c.answer.lines)
    )
    try:
        excerpt, learned = resolver.resolve(spec)
    except PinAndCiteError:
        return  # a symbol that is gone or ambiguous under its name
    resolver.record(excerpt, learned)
    c.new_spec = spec


def _carry_default(ref: DefaultRef, old_value: str, resolver: Resolver) -> RecordedDefault | None:
    """Lock the default as the new commit writes it (the resolver resolves at the new pin); what changed, or
    that it is gone, or None."""
    del resolver.project.lock.defaults[str(ref)]
    try:
        found, excerpt, learned = resolver.resolve_default(ref)
    except PinAndCiteError:
        return RecordedDefault(old_value, None)
    resolver.record_default(ref, found, excerpt, learned)
    return None if found.value == old_value else RecordedDefault(old_value, found.value)


def _record(
    root: Path, carried: list[Carried], old: str, new: str, tag: str | None, blobs: dict[tuple[str, str], str | None]
) -> BumpRecord:
    """What the lock keeps of this bump: hashes, paths, lines and statuses, never upstream text."""
    changes, files = {}, {}
    for c in (c for c in carried if c.answer.status in REVIEWED):
        for path in {c.spec.path, c.answer.path or c.spec.path}:
            files[path] = RecordedFile(blobs.get((old, path)), blobs.get((new, path)))
        new_sha = text_sha256(cited_text(c.new_text)) if c.answer.lines else None
        changes[str(c.spec)] = RecordedChange(
            c.answer.status,
            c.old_lines,
            text_sha256(cited_text(c.old_text)),
            c.answer.lines,
            new_sha,
            str(c.new_spec) if c.new_spec else None,
            [call.where(root) for call in c.places],
            c.answer.path,
        )
    found = Counter(c.answer.status for c in carried)
    return BumpRecord(old, new, tag, {status: found[status] for status in STATUSES}, files, changes)


def _templates(carried: list[Carried]) -> dict[Path, bytes]:
    changes: dict[Path, list[tuple]] = {}
    for c in carried:
        spec_moved = c.new_spec is not None and c.new_spec != c.spec
        highlights = {id(h.place): h.literal for h in c.highlights if h.literal not in (None, h.place.highlight)}
        for call in c.places:
            if not call.file.name.endswith(".j2") or (not spec_moved and id(call) not in highlights):
                continue  # a docstring citation (reference/*.py) is left as written: `check` names it
            argument = _new_argument(call.argument, c.spec, c.new_spec) if spec_moved else call.argument
            highlight = (highlights[id(call)],) if id(call) in highlights else ()
            changes.setdefault(call.file, []).append((call, argument, *highlight))
    return {template: rewrite_arguments(template, edits) for template, edits in changes.items()}


def apply(bump: Bump, notes_dir: Path) -> None:
    """The notes folder's files together; then constraints.txt, outside it, atomically (killed in between,
    `check` says the constraint and pins.toml name different wheels)."""
    write_all(bump.writes, notes_dir)
    for path, data in bump.constraints.items():
        atomic_write(path, data)
