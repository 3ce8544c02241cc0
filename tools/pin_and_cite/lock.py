"""reading_notes/citations.lock: per cited file its blob SHA at the pinned commit, per citation its text hash.

JSON with sorted keys, so a diff of the lock reads like a diff of what the notes cite.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pin_and_cite.atomic import atomic_write
from pin_and_cite.errors import PinAndCiteError

VERSION = 1


@dataclass
class LockedFile:
    commit: str
    blob: str
    size: int
    resolved_from: str          # how the blob SHA was learned: "git tree" or "distribution NAME VERSION"


@dataclass
class LockedCitation:
    lines: tuple[int, int]
    text_sha256: str
    symbol: str | None = None


def file_key(source: str, path: str) -> str:
    return f"{source}:{path}"


class Lock:
    def __init__(self, path: Path):
        self.path = path
        self.files: dict[str, LockedFile] = {}
        self.citations: dict[str, LockedCitation] = {}
        if path.exists():
            self._load()

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != VERSION:
                raise PinAndCiteError(f"{self.path}: lock version {data.get('version')!r}, expected {VERSION}")
            self.files = {k: LockedFile(**v) for k, v in data["files"].items()}
            self.citations = {k: LockedCitation(tuple(v["lines"]), v["text_sha256"], v.get("symbol"))
                              for k, v in data["citations"].items()}
        except (ValueError, KeyError, TypeError) as exc:
            raise PinAndCiteError(f"{self.path} is not a valid lock ({exc}); restore it from git")

    def save(self) -> None:
        atomic_write(self.path, self.dumps())

    def dumps(self) -> bytes:
        data = {
            "version": VERSION,
            "files": {k: asdict(v) for k, v in sorted(self.files.items())},
            "citations": {k: {key: val for key, val in asdict(v).items() if val is not None}
                          for k, v in sorted(self.citations.items())},
        }
        return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
