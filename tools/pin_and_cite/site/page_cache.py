"""Render each page once per change. Running the templates is most of a `check` and a fifth of a site build,
and a page's text depends only on its own template, the rest of the notes folder (partials, pins.toml, the
lock, the data the plugin's helpers read: traces, recordings, calibrations), the repository files its
ours()/mirrors()/verified_by() calls read, and the code that renders it (this tool, its plugin, Jinja).

A page is a pin_and_cite.core.verified_cache entry, since it is published as it is: its key names the page,
its template's text, a digest of the notes folder (page templates left out, so that editing one note renders
that note alone again) and of the code; its text holds the page, the tests it cites (replayed, so the test
pages still list who cites them) and the SHA-256 of each repository file the render read, taken before the
render read it (a file edited meanwhile misses next time) and compared with the file before the entry is
used. Only a page that rendered without error is kept. A plugin's helpers read the notes folder only
(tests/tools/test_page_cache.py holds the study's to it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path

import jinja2

from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.notes import note_templates, template_text
from pin_and_cite.core.regular_file import MAX_CODE_BYTES, read_in_project, read_regular
from pin_and_cite.core.verified_cache import VerifiedCache, made_from

MAX_FOLDER_BYTES = 256 << 20  # a notes folder larger than this renders uncached (the study's is 2 MiB)


@functools.cache
def code_version(*packages: Path) -> str:
    """A digest of the Python files of `packages` (the tool, its plugin) and of the versions of what runs them."""
    digest = hashlib.sha256(json.dumps([sys.version, jinja2.__version__]).encode())
    for package in packages:
        for file in sorted(package.rglob("*.py")):
            digest.update(f"{file.relative_to(package.parent)}\0".encode())
            digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def folder_digest(notes_dir: Path) -> str | None:
    """A digest of every file under `notes_dir` but the page templates and hidden files (the write lock), or None
    (no cache) when the folder holds more than MAX_FOLDER_BYTES or a file that cannot be read."""
    pages = set(note_templates(notes_dir))
    digest, total = hashlib.sha256(), 0
    for folder, dirs, files in os.walk(notes_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            path = Path(folder) / name
            if path in pages:
                continue
            if path.is_symlink():
                data = b"symlink " + os.fsencode(os.readlink(path))
            else:
                try:
                    data = read_regular(path, MAX_FOLDER_BYTES - total)
                except PinAndCiteError:
                    return None
            if data is None or (total := total + len(data)) > MAX_FOLDER_BYTES:
                return None
            digest.update(f"{path.relative_to(notes_dir)}\0".encode())
            digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def file_sha(root: Path, path: str) -> str | None:
    """The SHA-256 of the repository file `path` as a render reads it (no symlinks), None when it cannot be read."""
    try:
        return hashlib.sha256(read_in_project(root, root / path, MAX_CODE_BYTES)).hexdigest()
    except (PinAndCiteError, OSError, ValueError):  # the call itself says what is wrong with the path
        return None


class PageCache:
    """The pages of one run (a check, a render, a build) of the project at `root`, kept under `cache_root`/pages."""

    def __init__(self, root: Path, notes_dir: Path, cache_root: Path, code: str):
        self.root, self.notes_dir = root, notes_dir
        self.cache = VerifiedCache(cache_root, "pages")
        self.folder = folder_digest(notes_dir)
        self.code = code
        self._shas: dict[str, str | None] = {}

    def sha(self, path: str) -> str | None:
        """file_sha(path), once per run: called before the render first reads the file."""
        if path not in self._shas:
            self._shas[path] = file_sha(self.root, path)
        return self._shas[path]

    def key(self, template: Path, page: str | None, context: dict) -> str | None:
        """The entry's name for `template` rendered as `page` with `context` (named by its keys: the page names
        the source a source page is for), or None when this run keeps no pages."""
        if self.folder is None:
            return None
        text = template_text(template, self.notes_dir)
        return made_from(
            "page", self.code, self.folder, str(template.relative_to(self.notes_dir)), page, text, *sorted(context)
        )

    def get(self, key: str | None) -> tuple[str, list[str]] | None:
        """(page, tests it cites) of the entry `key`, when every file it read is as it was."""
        if key is None or (text := self.cache.get(key)) is None:
            return None
        entry = json.loads(text)
        if any(self.sha(path) != sha for path, sha in entry["read"].items()):
            return None
        return entry["page"], entry["cited"]

    def put(self, key: str | None, page: str, cited: list[str], read: dict[str, str | None]) -> None:
        """Keep the page rendered from what `read` names (path -> sha(path), taken before its read)."""
        if key is not None and None not in read.values():
            self.cache.put(key, json.dumps({"page": page, "cited": cited, "read": dict(sorted(read.items()))}))
