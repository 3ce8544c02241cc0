"""The review report of a bump, readable on one screen: counts per status, then one line per citation (status,
old -> new lines, where the notes cite it), every default that changed and every highlight to review; the old
and new excerpts of each changed or deleted citation, as one unified diff numbered as upstream, follow only on
request (`--diff`), since whole-function citations make them thousands of lines. The site's change pages
(pin_and_cite.site.changes) show the same diff, each line numbered."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from pin_and_cite.core.lock import REVIEWED, STATUSES
from pin_and_cite.core.release import pinned_version
from pin_and_cite.relocation.bump import Bump
from pin_and_cite.relocation.carried import Carried

HUNK = re.compile(r"@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@")


@dataclass(frozen=True)
class Side:
    """One end of a diff: the commit, the cited lines there (None: no counterpart) and their text."""

    commit: str
    lines: tuple[int, int] | None
    text: list[str]


def _anchor(lines: tuple[int, int] | None) -> str:
    return f"#L{lines[0]}-L{lines[1]}" if lines else " (no counterpart)"


def excerpt_diff(path: str, old: Side, new: Side, new_path: str | None = None) -> list[str]:
    """Old vs new excerpt, whole (every line as context), with hunk headers in upstream line numbers;
    `new_path` names the new side's file when the code went into another one."""
    old_start = old.lines[0]
    new_start = new.lines[0] if new.lines else 0
    diff = difflib.unified_diff(
        old.text,
        new.text,
        lineterm="",
        n=max(len(old.text), len(new.text)),
        fromfile=f"{path}{_anchor(old.lines)} @ {old.commit[:12]}",
        tofile=f"{new_path or path}{_anchor(new.lines)} @ {new.commit[:12]}",
    )

    def renumber(line: str) -> str:
        match = HUNK.fullmatch(line)
        if not match:
            return line
        a, b = int(match[1]) + old_start - 1, int(match[3]) + max(new_start - 1, 0)
        return f"@@ -{a}{match[2] or ''} +{b}{match[4] or ''} @@"

    return [renumber(line) for line in diff]


def numbered_diff(diff: list[str]) -> list[str]:
    """excerpt_diff's lines with each body line's old and new upstream line numbers after its -/+/space mark
    (blank where the line does not exist on that side), so the mark still colors the line as a diff."""
    head = next((i for i, line in enumerate(diff) if HUNK.fullmatch(line)), len(diff))  # after ---/+++
    rows, old, new = [], 0, 0
    for line in diff[head:]:
        if match := HUNK.fullmatch(line):  # a body line starts with -, + or space: never a hunk
            old, new = int(match[1]), int(match[3])
            rows.append((line, None, None))
            continue
        mark = line[:1]
        rows.append((line, str(old) if mark != "+" else "", str(new) if mark != "-" else ""))
        old, new = old + (mark != "+"), new + (mark != "-")
    width = max((len(n) for _, a, b in rows if a is not None for n in (a, b)), default=0)
    return diff[:head] + [
        line if a is None else f"{line[:1]}{a:>{width}} {b:>{width}} | {line[1:]}" for line, a, b in rows
    ]


ORDER = {status: n for n, status in enumerate(("deleted", "changed", "moved", "unchanged"))}  # review first
DIFF_HINT = "old vs new excerpts of the changed and deleted: add --diff"


def _cited_at(c: Carried, root: Path) -> str:
    """Where the notes cite `c`, one file per entry with its lines: `a.md.j2:4,6, reference/x.py:12`."""
    lines: dict[str, list[str]] = {}
    for call in c.places:
        path, line = call.where(root).rsplit(":", 1)
        lines.setdefault(path, []).append(line)
    return ", ".join(f"{path}:{','.join(numbers)}" for path, numbers in lines.items()) or "citations.lock"


def summary_line(c: Carried, root: Path) -> str:
    """`status   SPEC [(old lines)] -> new lines  where`: the index a person reads before any diff."""
    old = f" (L{c.old_lines[0]}-L{c.old_lines[1]})" if c.spec.symbol else ""
    new = f"L{c.answer.lines[0]}-L{c.answer.lines[1]}" if c.answer.lines else "nothing"
    if c.answer.path and c.answer.path != c.spec.path:
        new = f"{c.answer.path}#{new}"
    if c.new_spec and c.new_spec.symbol and c.new_spec.symbol != c.spec.symbol:
        new += f" ({c.new_spec.symbol})"
    kept = ", left as written" if c.new_spec is None else ""
    return f"{c.answer.status:<9} {c.spec}{old} -> {new}{kept}  {_cited_at(c, root)}"


def text_report(bump: Bump, root: Path, dry_run: bool, diff: bool = False) -> str:
    n = bump.record.counts
    head = f"{bump.source}: {bump.old[:12]} -> {bump.new[:12]}" + (f" ({bump.tag})" if bump.tag else "")
    out = [
        head + ("  [dry run: nothing written]" if dry_run else ""),
        f"{len(bump.citations)} citation(s): " + ", ".join(f"{n[s]} {s}" for s in STATUSES),
    ]
    highlights = [h for c in bump.citations for h in c.highlights]
    if highlights:
        flagged = sum(1 for h in highlights if h.review)
        out.append(f"{len(highlights)} highlight(s): {len(highlights) - flagged} carried, {flagged} to review")
    written = sorted(str(p.relative_to(root)) for p in {**bump.writes, **bump.constraints})
    out.append(("would write: " if dry_run else "wrote: ") + ", ".join(written))
    old, new = bump.distribution
    if old != new:
        out.append(f"distribution: {old or 'none'} -> {new or 'none'}")
    elif pinned_version(old):
        out.append(
            f"distribution: {old} left as it was: {bump.tag or bump.new[:12]} names no release; `check` fails "
            "until bump --distribution names the one of the new pin"
        )
    reviewed = [c for c in bump.citations if c.answer.status in REVIEWED]
    if reviewed and not diff:
        out.append(DIFF_HINT)
    ordered = sorted(bump.citations, key=lambda c: (ORDER[c.answer.status], str(c.spec)))
    out += [""] + [summary_line(c, root) for c in ordered]
    defaults = [
        f"default changed: {key}: was {change.old_value}, "
        + (
            f"now {change.new_value}"
            if change.new_value is not None
            else "gone: fix the note (`check` fails until then)"
        )
        + ": re-read the prose around it"
        for key, change in sorted(bump.record.defaults.items())
    ]
    flagged = [
        f'highlight {h.status}: {h.place.where(root)}: {h.place.argument} highlight="{h.place.highlight}" -> '
        + (f'highlight="{h.literal}"' if h.literal else "left as written")
        + f": {h.review}"
        for h in highlights
        if h.review
    ]
    for block in (defaults, flagged):
        out += [""] + block if block else []
    for c in reviewed if diff else []:
        out.append("")
        target = str(c.new_spec) if c.new_spec else "left as written: fix the note (`check` fails until then)"
        out.append(f"{c.answer.status}: {c.spec} -> {target}")
        if c.answer.reason:
            out.append(f"  note: {c.answer.reason}")
        out.append("  cited at " + _cited_at(c, root))
        diff_lines = excerpt_diff(
            c.spec.path,
            Side(bump.old, c.old_lines, c.old_text),
            Side(bump.new, c.answer.lines, c.new_text),
            c.answer.path,
        )
        out += ["  " + line for line in diff_lines]
    return "\n".join(out)


def json_report(bump: Bump, root: Path, dry_run: bool) -> dict:
    return {
        "source": bump.source,
        "from": bump.old,
        "to": bump.new,
        "tag": bump.tag,
        "dry_run": dry_run,
        "counts": bump.record.counts,
        "written": [] if dry_run else sorted(str(p.relative_to(root)) for p in {**bump.writes, **bump.constraints}),
        "distribution": {"old": bump.distribution[0], "new": bump.distribution[1]},
        "citations": [
            {
                **c.answer.as_json(str(c.spec), c.spec.path),
                "new_cite": str(c.new_spec) if c.new_spec else None,
                "where": [call.where(root) for call in c.places],
            }
            for c in bump.citations
        ],
        "defaults": [
            {"default": key, "old": change.old_value, "new": change.new_value}
            for key, change in sorted(bump.record.defaults.items())
        ],
        "highlights": [h.as_json(root) for c in bump.citations for h in c.highlights],
    }
