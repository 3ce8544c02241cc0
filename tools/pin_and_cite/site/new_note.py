"""`new-note NAME --title TITLE`: write reading_notes/NAME.md.j2 from the skeleton the project's plugin gives
(pin_and_cite.site.plugin), whole or not at all, and never over an existing note (linked into place, which
fails if the name is taken).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from pathlib import Path

from pin_and_cite.core.atomic import stage
from pin_and_cite.core.errors import PinAndCiteError

NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")


def new_note(notes_dir: Path, name: str, title: str, skeleton: Callable[[str], str] | None) -> Path:
    """Write notes_dir/NAME.md.j2 from `skeleton(title)`; refuse a bad or taken name, or a project whose plugin
    gives no skeleton."""
    if not NAME.fullmatch(name):
        raise PinAndCiteError(f"note name {name!r}: use lowercase letters, digits and '-' (e.g. tensor-sharding)")
    title = " ".join(title.split())
    if not title or "{" in title or "}" in title:
        raise PinAndCiteError(f"--title {title!r}: give a title without '{{' or '}}' (the note is a Jinja template)")
    if skeleton is None:
        raise PinAndCiteError("this project's plugin (pins.toml [site] plugin) gives no skeleton for a new note")
    path = notes_dir / f"{name}.md.j2"
    tmp = notes_dir / f".{name}.{os.getpid()}.tmp"
    try:
        stage(tmp, path, skeleton(title).encode())
        os.link(tmp, path)  # atomic, and never replaces a note already there
    except FileExistsError:
        raise PinAndCiteError(f"reading_notes/{name}.md.j2 already exists; choose another name") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path
