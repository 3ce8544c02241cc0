"""`ours("reference/x.py::Name")`: where a definition lives in this repository, for the reference pages.

Resolved with the same AST reader as upstream symbols, so a renamed or moved function fails the render
with the template's file:line instead of leaving a stale mapping.
"""
from __future__ import annotations

from pathlib import Path

from pin_and_cite.core import symbols
from pin_and_cite.core.citation import check_repo_path
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.parse_cache import ParseCache


def ours(root: Path, spec: str, parsed: ParseCache) -> str:
    path, sep, symbol = spec.partition("::")
    check_repo_path(path)
    file = root / path
    if not sep or not symbol:
        raise PinAndCiteError(f"ours({spec!r}): expected PATH::Name, e.g. reference/fsdp/runtime.py::pre_forward")
    if not file.is_file():
        raise PinAndCiteError(f"ours({spec!r}): {path} does not exist")
    try:
        data = file.read_bytes()
        text = data.decode()
    except UnicodeDecodeError as exc:
        raise PinAndCiteError(f"ours({spec!r}): {path} is not UTF-8 (byte {exc.object[exc.start]:#04x} at "
                              f"offset {exc.start})") from None
    first, last = symbols.resolve(parsed.definitions_in_text(data, text, path), symbol, path)
    return f"`{symbol}` ({path} L{first}–L{last})"
