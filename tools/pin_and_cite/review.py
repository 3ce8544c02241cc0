"""The review report of a bump: counts per status, and for every citation a person must look at (changed or
deleted) where the notes cite it and its old and new excerpts as one unified diff, numbered as upstream."""
from __future__ import annotations

import difflib
import re
from collections import Counter
from pathlib import Path

from pin_and_cite.bump import Bump, Carried

STATUSES = ("unchanged", "moved", "changed", "deleted")


def _anchor(lines: tuple[int, int] | None) -> str:
    return f"#L{lines[0]}-L{lines[1]}" if lines else " (no counterpart)"


def counts(bump: Bump) -> dict[str, int]:
    found = Counter(c.answer.status for c in bump.citations)
    return {status: found[status] for status in STATUSES}


def excerpt_diff(c: Carried, bump: Bump) -> list[str]:
    """Old vs new excerpt, whole (every line as context), with hunk headers in upstream line numbers."""
    old_start = c.old_lines[0]
    new_start = c.answer.lines[0] if c.answer.lines else 0
    diff = difflib.unified_diff(c.old_text, c.new_text, lineterm="", n=max(len(c.old_text), len(c.new_text)),
                                fromfile=f"{c.spec.path}{_anchor(c.old_lines)} @ {bump.old[:12]}",
                                tofile=f"{c.spec.path}{_anchor(c.answer.lines)} @ {bump.new[:12]}")

    def renumber(line: str) -> str:
        match = re.fullmatch(r"@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@", line)
        if not match:
            return line
        a, b = int(match[1]) + old_start - 1, int(match[3]) + max(new_start - 1, 0)
        return f"@@ -{a}{match[2] or ''} +{b}{match[4] or ''} @@"

    return [renumber(line) for line in diff]


def text_report(bump: Bump, root: Path, dry_run: bool) -> str:
    n = counts(bump)
    head = f"{bump.source}: {bump.old[:12]} -> {bump.new[:12]}" + (f" ({bump.tag})" if bump.tag else "")
    out = [head + ("  [dry run: nothing written]" if dry_run else ""),
           f"{len(bump.citations)} citation(s): " + ", ".join(f"{n[s]} {s}" for s in STATUSES)]
    written = sorted(str(p.relative_to(root)) for p in bump.writes)
    out.append(("would write: " if dry_run else "wrote: ") + ", ".join(written))
    for c in bump.citations:
        if c.answer.status not in ("changed", "deleted"):
            continue
        out.append("")
        target = str(c.new_spec) if c.new_spec else "left as written: fix the note (`check` fails until then)"
        out.append(f"{c.answer.status}: {c.spec} -> {target}")
        if c.answer.reason:
            out.append(f"  note: {c.answer.reason}")
        places = [call.where(root) for call in c.places] + (["citations.lock"] if c.in_lock and not c.places else [])
        out.append("  cited at " + ", ".join(places))
        out += ["  " + line for line in excerpt_diff(c, bump)]
    return "\n".join(out)


def json_report(bump: Bump, root: Path, dry_run: bool) -> dict:
    return {"source": bump.source, "from": bump.old, "to": bump.new, "tag": bump.tag, "dry_run": dry_run,
            "counts": counts(bump), "written": [] if dry_run else sorted(str(p.relative_to(root)) for p in bump.writes),
            "citations": [{**c.answer.as_json(str(c.spec)), "new_cite": str(c.new_spec) if c.new_spec else None,
                           "where": [call.where(root) for call in c.places]} for c in bump.citations]}
