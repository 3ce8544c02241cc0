"""Texts kept between runs under the user's cache (which pin_and_cite.core.store keeps outside every
checkout), each used only when it proves what it stands for and who wrote it: for what a run would run or
publish (a compiled template's Python, a highlighted block's HTML), a planted entry must change nothing.

An entry is JSON naming `made_from` (the SHA-256 of everything its text depends on, which the reader computes
afresh from what it just read) and an HMAC-SHA256 of both under a key only this user can read
(`<cache>/verified.key`, 0600, made once). A planted, copied or damaged entry fails one of the two and the
caller computes the text again; a key that is not this user's own private regular file turns the cache off.
Never a pickle or marshalled code: reading an entry runs nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from pathlib import Path

from pin_and_cite.core.atomic import atomic_write
from pin_and_cite.core.regular_file import NotRegularFile, read_regular

KEY_BYTES = 32
MAX_ENTRY_BYTES = 64 << 20  # a template is at most 16 MiB; what is made of it a few times that


def made_from(*parts: str | None) -> str:
    """The SHA-256 naming an entry made from `parts` (in this order): each part after its length, so no two
    lists of parts run together; a string as its UTF-8 (JSON-escaping a template first cost more than the hash),
    anything else (a fence's missing language: None) as JSON, each marked with which it is."""
    digest = hashlib.sha256()
    for part in parts:
        data = b"s" + _utf8(part) if isinstance(part, str) else b"j" + json.dumps(part).encode()
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate (JSON can write one) is bytes too


def _private_key(path: Path) -> bytes | None:
    """The cache's key, made on first use; None (no cache) unless it is a regular file of this user that no
    one else can read or write."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as out:
                out.write(os.urandom(KEY_BYTES))
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as key_file:
            info = os.fstat(key_file.fileno())
            mine = stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077
            key = key_file.read(KEY_BYTES + 1) if mine else b""
    except OSError:
        return None
    return key if len(key) == KEY_BYTES else None


class VerifiedCache:
    """Entries under `cache_root`/`kind`, keyed by made_from(...), under the key of `cache_root`."""

    def __init__(self, cache_root: Path, kind: str):
        self.key_path = cache_root / "verified.key"
        self.folder = cache_root / kind
        self._key: bytes | None | bool = False  # False: not read yet

    def key(self) -> bytes | None:
        if self._key is False:
            self._key = _private_key(self.key_path)
        return self._key

    def _path(self, made: str) -> Path:
        return self.folder / made[:2] / f"{made[2:]}.json"

    def get(self, made: str) -> str | None:
        """The text of the entry made from `made`, if it is there and verifies."""
        if (key := self.key()) is None:
            return None
        try:
            data = read_regular(self._path(made), MAX_ENTRY_BYTES)
            if data is None or len(data) > MAX_ENTRY_BYTES:
                return None
            entry = json.loads(data)
            text, mac = entry["text"], entry["mac"]
            if entry["made_from"] != made or not isinstance(text, str) or not isinstance(mac, str):
                return None
        except (NotRegularFile, OSError, ValueError, TypeError, KeyError, RecursionError):
            return None
        return text if hmac.compare_digest(mac, _mac(key, made, text)) else None

    def put(self, made: str, text: str) -> None:
        """Keep `text` as made from `made`; a full or read-only cache only costs time."""
        if (key := self.key()) is None:
            return
        entry = {"made_from": made, "text": text, "mac": _mac(key, made, text)}
        try:
            atomic_write(self._path(made), json.dumps(entry).encode())
        except OSError:
            pass


def _mac(key: bytes, made: str, text: str) -> str:
    """The MAC of `text` as made from `made`, a made_from() digest: always 64 characters, so the two cannot run
    together."""
    return hmac.new(key, _utf8(made) + _utf8(text), hashlib.sha256).hexdigest()
