"""Citations written in this repository's own code: a docstring or comment of the reference names the upstream
code it mirrors as `SOURCE:PATH::Qual.name` (for example
`upstream:pkg/module.py::Class.method`).

`check` verifies each one against the lock like a citation in a note, at the file:line where it is written;
`bump` carries it in the lock: a symbol citation names no line, so when upstream code moves only the lock
changes, and when a symbol is renamed or moved to another file `check` names the docstring still citing the
old name. A hand-typed upstream line number (`line 1385`, `lines 1239-1291`, `L88`) or range is what this
replaces, and `check` refuses one, since nothing could keep it true. A bare range counts where it can only be
lines: ascending, and either in parentheses with three digits or more a side (`(504-606)`; upstream files run
to thousands of lines, while a shape or count in parentheses, `(2-3)`, is small), or right after an upstream
name, a `.py` file or a snake_case symbol (`_lazy_init`, 112-143`, `_runtime_utils.py 1416-1470`). The
reference pages render their "mirrors" column from the same docstrings (pin_and_cite.core.local_code.mirrored),
so the citation has one home.
"""

from __future__ import annotations

import re
from pathlib import Path

from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.notes import Written
from pin_and_cite.core.regular_file import MAX_CODE_BYTES, read_in_project

CODE_DIRS = ("reference",)  # the folders of the project whose Python files cite upstream
CODE_CITATION = re.compile(r"(?<![\w/.:-])([A-Za-z][\w-]*:(?:[\w.-]+/)*[\w.-]+\.pyi?::[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
# "line 12", "lines 12", "L123" as words; the leading [lL] lets the regex engine skip to candidate letters
HAND_TYPED_LINE = re.compile(r"[lL](?:(?<=\bl)ines? \d+|(?<=\bL)\d{2,})\b")
# "(504-606)", or "12-34" after a file or snake_case name ("_unshard (277-306)", "x.py 1416-1470"); ascending
HAND_TYPED_RANGE = re.compile(r"\((\d{3,})[-–](\d{3,})\)|(?:\.py|_\w*)`?,? \(?(\d{2,})[-–](\d{2,})\b")
DIGITS_DASH_DIGITS = re.compile(r"\d{2}[-–]\d{2}")  # what every HAND_TYPED_RANGE match holds


def citations_in_text(text: str) -> list[tuple[str, int]]:
    """(spec, line) of every upstream citation written in `text`, in order. A citation never spans lines, so
    only the lines holding "::" are searched (a tenth of the time of searching the whole text)."""
    return [
        (m[1], number)
        for number, line in enumerate(text.split("\n"), 1)
        if "::" in line
        for m in CODE_CITATION.finditer(line)
    ]


def code_files(root: Path) -> list[Path]:
    for folder in CODE_DIRS:
        if (root / folder).is_symlink():  # `reference -> /` would walk the machine
            raise PinAndCiteError(f"{root / folder} is a symlink; the project's code is read from plain files only")
    return sorted(p for folder in CODE_DIRS for p in (root / folder).rglob("*.py") if p.is_file())


def utf8_text(data: bytes, what: str) -> str:
    """`data` decoded, or PinAndCiteError naming `what` and the first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PinAndCiteError(
            f"{what} is not UTF-8 (byte {exc.object[exc.start]:#04x} at offset {exc.start})"
        ) from None


def code_texts(root: Path) -> dict[Path, str]:
    """The project's code files and their text, read once for both scans below."""
    return {
        file: utf8_text(read_in_project(root, file, MAX_CODE_BYTES), str(file.relative_to(root)))
        for file in code_files(root)
    }


def code_citations(texts: dict[Path, str]) -> list[Written]:
    """Every upstream citation written in the project's code (`code_texts`), as `upstream` calls at their
    file:line."""
    return [
        Written("upstream", spec, file, line) for file, text in texts.items() for spec, line in citations_in_text(text)
    ]


def hand_typed_lines(texts: dict[Path, str], root: Path) -> list[tuple[str, str]]:
    """(file:line, what) of every hand-typed upstream line number or range in the project's code (`code_texts`),
    in file order. Neither pattern spans lines, so each file is searched whole, the range pattern only in a file
    holding digits on both sides of a dash (it tries a match at every `_` of the code), and a hit's line number
    is counted only for a hit."""
    found = []
    for file, text in texts.items():
        hits = [(m.start(), m[0]) for m in HAND_TYPED_LINE.finditer(text)]
        if DIGITS_DASH_DIGITS.search(text):
            for m in HAND_TYPED_RANGE.finditer(text):
                group = 1 if m[1] else 3  # in parentheses, or after a name
                first, last = m[group], m[group + 1]
                if int(first) < int(last):
                    hits.append((m.start(group), f"{first}-{last}"))
        for at, what in sorted(hits):
            line = text.count("\n", 0, at) + 1
            found.append((f"{file.relative_to(root)}:{line}", what))
    return found
