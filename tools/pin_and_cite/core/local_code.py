"""`ours("reference/x.py::Name")`: where a definition lives in this repository (`definition` gives its lines too,
for the reference pages to show the code), and `mirrors(...)`: the upstream code its docstring cites.

Resolved with the same AST reader as upstream symbols (through the run's parse cache), so a renamed or moved
function fails the render with the template's file:line instead of leaving a stale mapping.
"""

from __future__ import annotations

from dataclasses import dataclass

from pin_and_cite.core import symbols
from pin_and_cite.core.citation import check_repo_path
from pin_and_cite.core.code_citations import citations_in_text, utf8_text
from pin_and_cite.core.context import Context
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.regular_file import MAX_CODE_BYTES, read_in_project


def _read(context: Context, spec: str, call: str) -> tuple[str, str, bytes, str, list[str]]:
    """(path, symbol, bytes, text, lines) of `PATH::Name`, a definition in this repository; `call` names the
    helper. Each file is read and split once per run (the reference pages ask for the same file hundreds of
    times)."""
    path, sep, symbol = spec.partition("::")
    check_repo_path(path)
    if not sep or not symbol:
        raise PinAndCiteError(f"{call}({spec!r}): expected PATH::Name, e.g. src/pkg/module.py::function")

    def read() -> tuple[bytes, str, list[str]]:
        file = context.root / path
        if not file.is_file():
            raise PinAndCiteError(f"{call}({spec!r}): {path} does not exist")
        data = read_in_project(context.root, file, MAX_CODE_BYTES)
        text = utf8_text(data, f"{call}({spec!r}): {path}")
        return data, text, text.split("\n")

    return path, symbol, *context.parsed.for_this_run(("our file", path), read)


@dataclass(frozen=True)
class Definition:
    path: str
    symbol: str
    first: int  # 1-based, inclusive
    last: int
    text: str  # lines first..last, each ending in a newline

    def __str__(self) -> str:
        return f"`{self.symbol}` ({self.path} L{self.first}–L{self.last})"


def definition(context: Context, spec: str) -> Definition:
    path, symbol, data, text, lines = _read(context, spec, "ours")
    first, last = symbols.resolve(context.parsed.definitions_in_text(data, text, path), symbol, path)
    return Definition(path, symbol, first, last, "".join(line + "\n" for line in lines[first - 1 : last]))


def mirrored(context: Context, spec: str) -> list[str]:
    """The upstream citations written in the docstring of `PATH::Name` (pin_and_cite.core.code_citations), in
    order, each once: what the reference pages show it mirrors."""
    path, symbol, data, text, lines = _read(context, spec, "mirrors")
    symbols.resolve(context.parsed.definitions_in_text(data, text, path), symbol, path)  # it exists, once
    span = context.parsed.docstrings_in_text(data, text, path).get(symbol)
    docstring = "\n".join(lines[span[0] - 1 : span[1]]) if span else ""
    found = list(dict.fromkeys(spec for spec, _ in citations_in_text(docstring)))
    if not found:
        raise PinAndCiteError(
            f"mirrors({spec!r}): the docstring of {symbol} cites no upstream code (SOURCE:PATH::Qual.name)"
        )
    return found
