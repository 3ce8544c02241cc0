"""reading_notes/<sha_file>: a pinned source's commit in a plain file, for scripts that want it without TOML.

A source in pins.toml that names a `sha_file` (`NAME-sha.txt`) gets that file in the
notes folder, written from the pin by `render` (and so by every site build); `check` fails when it disagrees
with the pin, so a moved pin cannot leave a stale SHA behind.
"""

from __future__ import annotations

from pathlib import Path

from pin_and_cite.core.atomic import atomic_write
from pin_and_cite.core.project import Project


def expected(project: Project) -> dict[str, tuple[str, str]]:
    """{sha_file: (source name, its text)} for every source that names one."""
    return {
        source.sha_file: (name, f"{source.commit}\n")
        for name, source in project.pins.sources.items()
        if source.sha_file
    }


def write_pinned_sha(project: Project) -> list[Path]:
    """Write each file that differs from its pin; the paths written."""
    written = []
    for sha_file, (_, text) in expected(project).items():
        path = project.notes_dir / sha_file
        if not (path.is_file() and path.read_text(encoding="utf-8") == text):
            atomic_write(path, text.encode())
            written.append(path)
    return written


def stale_sha(project: Project) -> list[tuple[str, str]]:
    """(sha_file, why it does not match pins.toml) for each such file."""
    stale = []
    for sha_file, (name, text) in expected(project).items():
        path = project.notes_dir / sha_file
        found = path.read_text(encoding="utf-8") if path.is_file() else None
        if found != text:
            what = "is missing" if found is None else f"says {found.strip()[:12]!r}"
            stale.append(
                (sha_file, f"{sha_file} {what} but pins.toml pins {name} at {text[:12]}; run tools/pin-and-cite render")
            )
    return stale
