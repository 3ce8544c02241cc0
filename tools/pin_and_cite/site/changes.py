"""The site's change pages: what the latest `bump` of each source changed in the cited code.

For every citation a bump recorded as changed or deleted (lock.BumpRecord), one page under notes/changes/
shows the notes that cite it, the old and new pin, its status, and the old vs new excerpt as a diff numbered
with the upstream lines (review.excerpt_diff, the bump report's diff); a deleted citation has an old excerpt
only. notes/changes/index.md, "Changes between pins", lists them, or says that no bump is recorded. The
excerpts are read from the blobs the record names (fetched and verified like every cited file) and must hash
to the record's text hashes, which `check` proves offline with the same function the pages use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

from pin_and_cite.core.citation import parse_spec
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.fences import code_span, fence_for
from pin_and_cite.core.lock import REVIEWED, STATUSES, BumpRecord, RecordedChange, RecordedFile
from pin_and_cite.core.notes import note_templates
from pin_and_cite.core.project import Project
from pin_and_cite.core.resolve import Resolver, cited_text, text_sha256
from pin_and_cite.relocation.review import Side, excerpt_diff, numbered_diff

CHANGES_DIR = "changes"
INDEX_TITLE = "Changes between pins"


def page_name(key: str) -> str:
    """The change page of citation `key`: readable, stable across builds, unique by a hash of the key."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", key).strip("-")
    return f"{readable}-{hashlib.sha256(key.encode()).hexdigest()[:8]}.md"


def _side(
    resolver: Resolver, source: str, path: str, blob: str | None, commit: str, lines: tuple[int, int], sha256: str
) -> Side:
    """One recorded excerpt, read from its blob and proven against the record's text hash."""
    if blob is None:
        raise PinAndCiteError(f"the record has lines at {commit[:12]} but no blob for {path} there")
    text = resolver.lines_of(source, path, blob)
    if not 1 <= lines[0] <= lines[1] <= len(text):
        raise PinAndCiteError(f"L{lines[0]}-L{lines[1]} lies outside {path} at {commit[:12]} ({len(text)} lines)")
    cited = list(text[lines[0] - 1 : lines[1]])
    if text_sha256(cited_text(cited)) != sha256:
        raise PinAndCiteError(
            f"the text at L{lines[0]}-L{lines[1]} of {path} at {commit[:12]} differs from the record's hash"
        )
    return Side(commit, lines, cited)


def recorded_sides(resolver: Resolver, source: str, record: BumpRecord, key: str) -> tuple[Side, Side]:
    """The old and new excerpt of one recorded change, proven; PinAndCiteError says why not."""
    change = record.changes[key]
    spec = parse_spec(key)
    if spec.source != source:
        raise PinAndCiteError(f"recorded under the bump of {source}")
    if change.status not in REVIEWED:
        raise PinAndCiteError(f"status {change.status!r}: a bump records only {' and '.join(REVIEWED)} citations")
    deleted = change.status == "deleted"
    if deleted != (change.new_lines is None) or deleted != (change.new_text_sha256 is None):
        raise PinAndCiteError("a changed citation has new lines and a new text hash, a deleted one neither")
    if change.new_cite is not None:
        parse_spec(change.new_cite)
    old_file, new_file = _recorded_file(record, spec.path), _recorded_file(record, change.new_path or spec.path)
    old = _side(
        resolver, source, spec.path, old_file.old_blob, record.old_commit, change.old_lines, change.old_text_sha256
    )
    if change.new_lines is None:
        return old, Side(record.new_commit, None, [])
    return old, _side(
        resolver,
        source,
        change.new_path or spec.path,
        new_file.new_blob,
        record.new_commit,
        change.new_lines,
        change.new_text_sha256,
    )


def _recorded_file(record: BumpRecord, path: str) -> RecordedFile:
    if path not in record.files:
        raise PinAndCiteError(f"the record has no blobs for {path}")
    return record.files[path]


def _proven(
    project: Project, resolver: Resolver
) -> tuple[list[tuple[str, str]], dict[str, dict[str, tuple[Side, Side]]]]:
    """(what, why) for every recorded bump or change that does not hold, checked offline from the cache, and
    source -> key -> the proven (old, new) excerpts of every change that does."""
    problems, sides = [], {}
    for source, record in sorted(project.lock.bumps.items()):
        sides[source] = {}
        try:
            project.pins.get(source)  # its SHAs were checked with the lock (schema.LOCK)
        except PinAndCiteError as exc:
            problems.append((f"bump record of {source}", str(exc)))
            continue
        for key in sorted(record.changes):
            try:
                sides[source][key] = recorded_sides(resolver, source, record, key)
            except PinAndCiteError as exc:
                problems.append((key, f"bump record of {source}: {exc}"))
    return problems, sides


def record_problems(project: Project, resolver: Resolver) -> list[tuple[str, str]]:
    """(what, why) for every recorded bump or change that does not hold, checked offline from the cache."""
    return _proven(project, resolver)[0]


def _cited_by(project: Project, change: RecordedChange, pages: dict[str, Path]) -> str:
    """Links to the rendered notes that cited the region at the bump (plain text where the note is gone);
    `pages`: each note template by its path from the project root."""
    links = []
    for where in change.cited_at:
        template = pages.get(where.rsplit(":", 1)[0])
        rendered = template.relative_to(project.notes_dir).with_suffix("").as_posix() if template else None
        links.append(f"[`{where}`](../{rendered})" if rendered else f"`{where}`")
    return ", ".join(links) or "no note: the citation was only in `reading_notes/citations.lock`"


def _status(change: RecordedChange) -> str:
    if change.status == "deleted":
        return (
            "deleted: there is no counterpart at the new pin, so only the old excerpt is shown. The notes kept "
            "citing it as written, and `tools/pin-and-cite check` fails on it until a person edits them."
        )
    if change.new_cite:
        return (
            f"changed: the code is still there but its text differs. The notes now cite `{change.new_cite}`: "
            "check that what they say still holds."
        )
    return (
        "changed: the code is still there, but not under the cited name. The notes kept citing it as "
        "written, and `tools/pin-and-cite check` fails on it until a person edits them."
    )


def _pin(project: Project, source: str, side: Side, path: str) -> str:
    where = (
        f"L{side.lines[0]}–L{side.lines[1]} @ `{side.commit[:12]}`"
        if side.lines
        else f"no counterpart @ `{side.commit[:12]}`"
    )
    link = side.lines and dataclasses.replace(project.pins.get(source), commit=side.commit).permalink(path, side.lines)
    return f"[{where}]({link})" if link else where


def _page(
    project: Project, source: str, record: BumpRecord, key: str, old: Side, new: Side, notes: dict[str, Path]
) -> str:
    change, spec = record.changes[key], parse_spec(key)
    name = f" ({spec.symbol})" if spec.symbol else ""
    diff = excerpt_diff(spec.path, old, new, change.new_path)
    out = [
        f"# {change.status}: {spec.path} L{old.lines[0]}–L{old.lines[1]}{name}",
        "",
        f"`{key}`, as the notes cited it when `tools/pin-and-cite bump` moved the pin of `{source}`.",
        "",
        f"- **Status:** {_status(change)}",
        f"- **Old pin:** {_pin(project, source, old, spec.path)}",
        f"- **New pin:** {_pin(project, source, new, change.new_path or spec.path)}"
        + (f" (`{record.tag}`)" if record.tag else ""),
        f"- **Cited by:** {_cited_by(project, change, notes)}",
        "",
    ]
    if not diff:
        out.append(
            "The text is the same at both pins, but there it has identical copies and which one the notes "
            "mean could not be decided: review the new lines."
        )
    else:
        block = "\n".join(numbered_diff(diff)) + "\n"
        out += [f"{fence_for(block)}diff", block.rstrip("\n"), fence_for(block)]
    return "\n".join(out) + "\n"


def _index(project: Project, entries: dict[str, list[tuple[str, RecordedChange, str]]]) -> str:
    out = [f"# {INDEX_TITLE}", ""]
    if not project.lock.bumps:
        out.append(
            "No bump is recorded in `reading_notes/citations.lock`: every citation is shown at the pin it "
            "was made at, so there is nothing to compare. After `tools/pin-and-cite bump NAME --ref REF` "
            "moves a pin, this page lists every cited region whose text changed or was deleted, each with "
            "its old and new excerpt as a diff."
        )
        return "\n".join(out) + "\n"
    out.append(
        "Every cited region whose text changed, or that was deleted, when `tools/pin-and-cite bump` last "
        "moved each source's pin: one page each, with the notes that cite it and the old and new excerpts "
        "as a diff numbered with the upstream lines. Only each source's latest bump is kept."
    )
    for source, record in sorted(project.lock.bumps.items()):
        tag = f" ({record.tag})" if record.tag else ""
        counts = ", ".join(f"{record.counts.get(s, 0)} {s}" for s in STATUSES)
        out += [
            "",
            f"## {source}: `{record.old_commit[:12]}` → `{record.new_commit[:12]}`{tag}",
            "",
            f"{sum(record.counts.values())} citation(s): {counts}.",
            "",
        ]
        if record.defaults:
            out += [
                "Parameter defaults the notes render (`default(...)`) whose text changed: the prose around "
                "them may need a new reading.",
                "",
                "| default | before | after |",
                "| --- | --- | --- |",
            ]
            out += [
                f"| `{key}` | {code_span(change.old_value)} | "
                + (f"{code_span(change.new_value)} |" if change.new_value is not None else "gone |")
                for key, change in sorted(record.defaults.items())
            ] + [""]
        if not entries[source]:
            out.append("Every citation kept its text: nothing to review.")
            continue
        out += ["| cited region | status | cited at |", "| --- | --- | --- |"]
        for key, change, page in entries[source]:
            cited_at = ", ".join(f"`{where}`" for where in change.cited_at) or "the lock only"
            out.append(f"| [`{key}`]({page}) | {change.status} | {cited_at} |")
    return "\n".join(out) + "\n"


def change_pages(project: Project, resolver: Resolver, out_dir: Path) -> dict[Path, str]:
    """{path under out_dir/changes/: Markdown}: the index and one page per recorded change. A record that does
    not hold stops the build with `check`'s first complaint about it."""
    problems, sides = _proven(project, resolver)
    if problems:
        raise PinAndCiteError(f"reading_notes/citations.lock: {problems[0][0]}: {problems[0][1]}")
    pages, entries = {}, {}
    notes = {str(t.relative_to(project.root)): t for t in note_templates(project.notes_dir)}
    for source, record in sorted(project.lock.bumps.items()):
        entries[source] = []
        for key, (old, new) in sides[source].items():
            name = page_name(key)
            pages[out_dir / CHANGES_DIR / name] = _page(project, source, record, key, old, new, notes)
            entries[source].append((key, record.changes[key], name))
    pages[out_dir / CHANGES_DIR / "index.md"] = _index(project, entries)
    return pages
