"""JSON and TOML from a branch (the lock, pins.toml, traces) read within bounds: the file's size, then its
nesting. Python's parsers recurse once per level, so a file of 100,000 `[` ends in a RecursionError that a
caller would misread (render took it for templates that include each other); and what reads the data later
recurses as deep. No file of ours nests deeper than MAX_DEPTH.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.regular_file import read_regular

MAX_DEPTH = 32


def read_file(path: Path, limit: int, where: str, error=PinAndCiteError) -> bytes | None:
    """The bytes of the regular file `path` (None when absent); `error` when it holds more than `limit`."""
    data = read_regular(path, limit)
    if data is not None and len(data) > limit:
        raise error(f"{where} is larger than {limit >> 20} MiB; no file of ours is")
    return data


def parse(parser: Callable, text, where: str, error=PinAndCiteError):
    """`parser(text)` (json.loads, tomllib.loads), refused in one line when nested deeper than MAX_DEPTH; the
    parser's own errors are the caller's to word."""
    try:
        data = parser(text)
    except RecursionError:
        data = None
    else:
        level, depth = [data] if isinstance(data, (dict, list)) else [], 1  # the containers `depth` levels down
        while level and depth <= MAX_DEPTH:
            level = [
                item
                for value in level
                for item in (value.values() if isinstance(value, dict) else value)
                if isinstance(item, (dict, list))
            ]
            depth += 1
        if not level:
            return data
    raise error(f"{where} is nested deeper than {MAX_DEPTH} levels; no file of ours is")
