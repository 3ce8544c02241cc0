"""reading_notes/megatron-sha.txt: the pinned Megatron-LM commit, for scripts that want it without TOML.

Generated from pins.toml by `render` (and so by every site build); `check` fails when it disagrees with the
pin, so a moved pin cannot leave a stale SHA behind.
"""
from __future__ import annotations

from pathlib import Path

from pin_and_cite.atomic import atomic_write
from pin_and_cite.project import Project

SHA_FILE = "megatron-sha.txt"
SOURCE = "megatron-lm"


def expected(project: Project) -> str | None:
    source = project.pins.sources.get(SOURCE)
    return f"{source.commit}\n" if source else None


def write_pinned_sha(project: Project) -> list[Path]:
    """Write the file when it differs from the pin; the paths written."""
    path, text = project.notes_dir / SHA_FILE, expected(project)
    if text is None or (path.is_file() and path.read_text() == text):
        return []
    atomic_write(path, text.encode())
    return [path]


def stale_sha(project: Project) -> str | None:
    """Why reading_notes/megatron-sha.txt does not match pins.toml, or None."""
    path, text = project.notes_dir / SHA_FILE, expected(project)
    if text is None:
        return None
    found = path.read_text() if path.is_file() else None
    if found == text:
        return None
    what = "is missing" if found is None else f"says {found.strip()[:12]!r}"
    return f"{SHA_FILE} {what} but pins.toml pins {SOURCE} at {text[:12]}; run tools/pin-and-cite render"
