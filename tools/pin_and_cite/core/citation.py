"""Citation specs: `SOURCE:PATH#Lstart-Lend` (1-based, inclusive) or `SOURCE:PATH::Qual.name`.

Parsing is pure (no files touched) so a malformed spec is refused before any work starts.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from pin_and_cite.core.errors import PinAndCiteError

SOURCE_NAME = re.compile(r"[a-z0-9][a-z0-9._-]*")
_LOCATION = r"(?P<path>[^#]+?)(?:#L(?P<start>\d+)(?:-L(?P<end>\d+))?|::(?P<symbol>.+))"
_SPEC = re.compile(r"(?P<source>[^:]+):" + _LOCATION)
_LOCATION_ONLY = re.compile(_LOCATION)
MAX_PATH, MAX_NAME = 1024, 255  # bytes: within what every file system takes (PATH_MAX, NAME_MAX)
_QUALNAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class Spec:
    """What a note asks for; `lines` is None for symbol citations until resolved."""

    source: str
    path: str
    lines: tuple[int, int] | None = None
    symbol: str | None = None

    def __str__(self) -> str:
        anchor = f"::{self.symbol}" if self.symbol else f"#L{self.lines[0]}-L{self.lines[1]}"
        return f"{self.source}:{self.path}{anchor}"


def check_repo_path(path: str) -> str:
    """Refuse paths that could escape a repository, name git's own files, or be too long to open (an OSError
    then, which would end the whole run)."""
    if len(path.encode()) > MAX_PATH or any(len(part.encode()) > MAX_NAME for part in path.split("/")):
        raise PinAndCiteError(
            f"path {path[:60]!r}... is too long (over {MAX_PATH} bytes, or a name over {MAX_NAME}); no repository's is"
        )
    if not path or path.startswith("/") or "\\" in path or re.match(r"[A-Za-z]:", path):
        raise PinAndCiteError(f"path {path!r} must be relative to the repository root, with '/' separators")
    if any(part in ("..", ".", "", ".git") for part in path.split("/")):
        raise PinAndCiteError(f"path {path!r} escapes the repository or names .git; give a plain relative path")
    return path


@functools.cache  # pure, and the notes write the same specs many times over
def parse_spec(text: str) -> Spec:
    match = _SPEC.fullmatch(text.strip())
    if not match:
        raise PinAndCiteError(
            f"malformed citation {text!r}: expected SOURCE:PATH#Lstart-Lend or SOURCE:PATH::Qual.name"
        )
    return _spec(match, text, match["source"])


def parse_location(text: str) -> Spec:
    """A citation without its source (`PATH#Lstart-Lend` or `PATH::Qual.name`), as `relocate` takes them;
    the Spec's source is ''."""
    match = _LOCATION_ONLY.fullmatch(text.strip())
    if not match:
        raise PinAndCiteError(f"malformed citation {text!r}: expected PATH#Lstart-Lend or PATH::Qual.name")
    return _spec(match, text, "")


def _spec(match: re.Match, text: str, source: str) -> Spec:
    path = check_repo_path(match["path"])
    if source and not SOURCE_NAME.fullmatch(source):
        raise PinAndCiteError(f"malformed citation {text!r}: source name {source!r} is not a pins.toml name")
    if match["symbol"] is not None:
        if not _QUALNAME.fullmatch(match["symbol"]):
            raise PinAndCiteError(f"malformed citation {text!r}: {match['symbol']!r} is not a dotted Python name")
        return Spec(source, path, symbol=match["symbol"])
    start = int(match["start"])
    end = int(match["end"]) if match["end"] is not None else start
    if start < 1:
        raise PinAndCiteError(f"citation {text!r}: line numbers start at 1")
    if end < start:
        raise PinAndCiteError(f"citation {text!r}: line range is inverted (L{start} > L{end})")
    return Spec(source, path, lines=(start, end))
