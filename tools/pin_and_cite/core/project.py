"""Where a project's pins, lock and notes live, and the sources they are fetched from."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.lock import Lock
from pin_and_cite.core.pins import Pins, Source
from pin_and_cite.core.remote import Remote, check_url
from pin_and_cite.core.store import Store, default_cache_dir, refuse_cache_inside

NOTES_DIR = "reading_notes"
MAX_NOTES_FILE = 16 << 20  # bytes; the largest file in reading_notes/ (the lock) holds 66 KB


def find_root(start: Path) -> Path:
    """The nearest ancestor holding reading_notes/pins.toml (or $PIN_AND_CITE_PROJECT)."""
    if os.environ.get("PIN_AND_CITE_PROJECT"):
        return Path(os.environ["PIN_AND_CITE_PROJECT"])
    for candidate in [start, *start.parents]:
        if (candidate / NOTES_DIR / "pins.toml").is_file():
            return candidate
    raise PinAndCiteError(
        f"no {NOTES_DIR}/pins.toml in {start} or its parents; run inside the project or pass --project"
    )


def refuse_special_files(notes_dir: Path) -> None:
    """reading_notes/ must hold plain files and folders only: a symlink committed on a branch would make `check`
    read outside the project (a key, /dev/zero, a FIFO) through a template, a trace, the pins or the lock, and
    reading_notes/ itself a symlink would lead all of them out. And no file over MAX_NOTES_FILE: a 50 MB
    template once cost a `check` 21 s and 350 MB."""
    if notes_dir.is_symlink():
        raise PinAndCiteError(f"{notes_dir} is a symlink; {NOTES_DIR}/ must be a plain folder of the project")
    for folder, dirs, files in os.walk(notes_dir):
        for path in (Path(folder) / name for name in dirs + files):
            info = path.lstat()
            if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
                kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a regular file"
                raise PinAndCiteError(f"{path} is {kind}; {NOTES_DIR}/ must hold plain files and folders only")
            if info.st_size > MAX_NOTES_FILE:
                raise PinAndCiteError(f"{path} is larger than {MAX_NOTES_FILE >> 20} MiB; no file of ours is")


@dataclass
class Project:
    root: Path
    timeout: float = 60.0
    url_overrides: dict[str, str] = field(default_factory=dict)
    cache_dir: Path = field(default_factory=default_cache_dir)

    def __post_init__(self):
        self.notes_dir = self.root / NOTES_DIR
        refuse_cache_inside(self.cache_dir, self.root, "the project")
        refuse_special_files(self.notes_dir)
        self.pins = Pins(self.notes_dir / "pins.toml")
        self.lock = Lock(self.notes_dir / "citations.lock")
        self.store = Store(self.cache_dir)
        for name, url in self.url_overrides.items():
            self.pins.get(name)
            check_url(url)

    def remote(self, source: Source) -> Remote:
        return self.remote_at(source.name, source.url)

    def remote_at(self, name: str, url: str) -> Remote:
        """The remote of source `name` (pinned or not yet) at `url`, or at its --url mirror."""
        url = self.url_overrides.get(name, url)
        return Remote(url, self.store.git_dir(url), self.timeout)
