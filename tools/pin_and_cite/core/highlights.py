"""The highlight rule: `cite(..., highlight="Lx-Ly")` marks whole statements of the cited code, never half of one.

A highlight that starts on a comment or stops in the middle of a call misleads the reader about where the code
it points at begins and ends. So in a Python file, by the pinned file's AST (never imported), Lx must be the
first line of a statement (for a definition, a decorator line or its `def`/`class` line; an `except` or `case`
clause counts as one) and Ly the last line of a statement of the same block, at or after it: the highlight is
a run of consecutive statements of one block, at any depth, and a compound statement from its header to its
last line is one statement of its parent's block. `else:`/`finally:` lines have no node of their own:
highlight from the first statement under them. In other files a highlight only has to lie inside the citation.
An error names the offending line and the nearest highlights that would do.
"""

from __future__ import annotations

import ast
import bisect
import re
from collections.abc import Sequence
from typing import NamedTuple

from pin_and_cite.core.errors import PinAndCiteError

Lines = tuple[int, int]  # 1-based, inclusive
_HIGHLIGHT = re.compile(r"L(\d+)(?:-L(\d+))?")


def parse_highlight(text: str) -> Lines:
    """`Lx-Ly` or `Lx` -> (x, y)."""
    match = _HIGHLIGHT.fullmatch(text.strip())
    if not match or int(match[1]) < 1 or int(match[2] or match[1]) < int(match[1]):
        raise PinAndCiteError(f"malformed highlight {text!r}: expected Lx-Ly (1-based, x <= y) or Lx")
    return int(match[1]), int(match[2] or match[1])


def format_like(written: str, lines: Lines) -> str:
    """`lines` written as the highlight `written` was: `Lx` stays one-line where it can, else `Lx-Ly`."""
    single = "-" not in written and lines[0] == lines[1]
    return f"L{lines[0]}" if single else f"L{lines[0]}-L{lines[1]}"


class Unit(NamedTuple):
    """Lines a highlight may hold whole or lie inside, never cut."""

    first: int
    last: int
    kind: str  # statement | decorator | clause


Place = tuple[int, int]  # (block number, index of the statement in that block)
_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


def _first_line(node) -> int:
    return node.pattern.lineno if isinstance(node, ast.match_case) else node.lineno


class Statements:
    """A Python file's statement boundaries: for each line the statements (by block and position in it) that
    start or end there, and the spans a highlight may not cut (for saying what it cut and what would do)."""

    def __init__(
        self, lines: Sequence[str], units: list[Unit], starts: dict[int, list[Place]], ends: dict[int, list[Place]]
    ):
        self.lines = lines  # the file's text, for naming blank and comment lines
        self.units: list[Unit] = sorted(units)
        self.starts: dict[int, list[Place]] = starts
        self.ends: dict[int, list[Place]] = ends
        self._start_lines, self._end_lines = sorted(starts), sorted(ends)

    @classmethod
    def of(cls, tree: ast.Module, lines: Sequence[str]) -> Statements:
        """The statements of the file with AST `tree` and text `lines`."""
        units, starts, ends = set(), {}, {}
        blocks = [
            getattr(node, name)
            for node in ast.walk(tree)
            for name in _BLOCKS
            if isinstance(getattr(node, name, None), list)
        ]  # IfExp/Lambda bodies are expressions
        for number, block in enumerate(blocks):
            for index, node in enumerate(block):  # a decorated def's lineno is its `def` line
                kind = "statement" if isinstance(node, ast.stmt) else "clause"
                last = node.body[-1].end_lineno if isinstance(node, ast.match_case) else node.end_lineno
                units.add(Unit(_first_line(node), last, kind))
                ends.setdefault(last, []).append((number, index))
                firsts = [_first_line(node)]
                for decorator in getattr(node, "decorator_list", []):
                    units.add(Unit(decorator.lineno, decorator.end_lineno, "decorator"))
                    firsts.append(decorator.lineno)
                for line in firsts:
                    starts.setdefault(line, []).append((number, index))
        return cls(lines, list(units), starts, ends)

    def as_json(self) -> dict:
        """Units, starts and ends as JSON values, for pin_and_cite.core.parse_cache."""
        return {
            "units": [list(u) for u in self.units],
            "starts": list(self.starts.items()),
            "ends": list(self.ends.items()),
        }

    @classmethod
    def from_json(cls, data: dict, lines: Sequence[str]) -> Statements:
        """What as_json() wrote, back into Statements over the same `lines`."""

        def places(pairs) -> dict[int, list[Place]]:
            return {int(line): [(int(block), int(index)) for block, index in found] for line, found in pairs}

        units = [Unit(int(first), int(last), str(kind)) for first, last, kind in data["units"]]
        return cls(lines, units, places(data["starts"]), places(data["ends"]))

    def problem(self, lines: Lines) -> str | None:
        """Why `lines` is not a whole number of statements, naming the offending line; None when it is."""
        a, b = lines
        if a not in self.starts:
            return f"must start on a statement's first line, and L{a} is {self._describe(a)}"
        if b not in self.ends:
            return f"must end on a statement's last line, and L{b} is {self._describe(b)}"
        cut = self._cut(lines)
        if cut is not None:
            side = f"it begins before L{a}" if cut.first < a else f"it runs past L{b}"
            return f"cuts the {cut.kind} at L{cut.first}-L{cut.last} in half ({side})"
        if not self._one_block(lines):
            holder = self._holder(lines)
            where = f" of the {holder.kind} at L{holder.first}-L{holder.last}" if holder else ""
            return f"takes statements from two blocks{where} (an else/except/finally line between them)"
        return None

    def _one_block(self, lines: Lines) -> bool:
        """Do a statement starting at Lx and one ending at Ly sit in one block, in that order?"""
        return any(sa == sb and ia <= ib for sa, ia in self.starts[lines[0]] for sb, ib in self.ends[lines[1]])

    def _holder(self, lines: Lines) -> Unit | None:
        return min(
            (u for u in self.units if u.first <= lines[0] and lines[1] <= u.last),
            key=lambda u: u.last - u.first,
            default=None,
        )

    def alternatives(self, lines: Lines, cited: Lines) -> list[Lines]:
        """The two nearest whole-statement highlights inside `cited`: each end moved to the nearest statement
        boundary before or after it, the smallest one holding `lines` and the largest one inside them."""
        a, b = lines
        moved = [
            (x, y)
            for x in {_at_or_before(self._start_lines, a), _at_or_after(self._start_lines, a)}
            for y in {_at_or_before(self._end_lines, b), _at_or_after(self._end_lines, b)}
            if x is not None and y is not None and x <= y and self.problem((x, y)) is None
        ]
        found = {
            r
            for r in [self.widen(lines), self.narrow(lines), *moved]
            if r is not None and cited[0] <= r[0] and r[1] <= cited[1]
        }
        return sorted(found, key=lambda r: (abs(r[0] - a) + abs(r[1] - b), r))[:2]

    def widen(self, lines: Lines) -> Lines | None:
        """The smallest whole-statement range holding `lines` (None past the first or last statement)."""
        a, b = lines
        while True:
            start = _at_or_before(self._start_lines, a)
            end = _at_or_after(self._end_lines, b)
            if start is None or end is None:
                return None
            a, b = start, end
            cut = self._cut((a, b))
            if cut is None and self._one_block((a, b)):
                return a, b
            cut = cut or self._holder((a, b))
            if cut is None:
                return None
            a, b = min(a, cut.first), max(b, cut.last)

    def narrow(self, lines: Lines) -> Lines | None:
        """The largest whole-statement range inside `lines` found by stepping its ends inwards (None: empty)."""
        a, b = lines
        while a <= b:
            if a not in self.starts:
                a = _at_or_after(self._start_lines, a) or b + 1
            elif b not in self.ends:
                b = _at_or_before(self._end_lines, b) or a - 1
            elif (cut := self._cut((a, b))) is None:
                if self._one_block((a, b)):
                    return a, b
                b -= 1  # two blocks of one statement: drop the later one's lines
            elif cut.first < a:
                a = cut.last + 1  # the statement begins before: skip past it
            elif cut.first > a:
                b = cut.first - 1  # it runs past the end: stop before it
            else:
                a += 1  # a header whose block runs past the end: into its body
        return None

    def _cut(self, lines: Lines) -> Unit | None:
        """The first unit overlapping `lines` that neither lies inside them nor holds them from above."""
        a, b = lines
        for unit in self.units:
            s, e, _ = unit
            if s > b:
                return None
            if e >= a and not (a <= s and e <= b) and not (s < a and b <= e):
                return unit
        return None

    def _describe(self, line: int) -> str:
        text = self.lines[line - 1].strip() if line <= len(self.lines) else ""
        if not text or text.startswith("#"):
            return "a comment line" if text else "a blank line"
        unit = min((u for u in self.units if u.first <= line <= u.last), key=lambda u: u.last - u.first, default=None)
        return f"in the {unit.kind} at L{unit.first}-L{unit.last}" if unit else "outside every statement"


def _at_or_before(sorted_lines: list[int], line: int) -> int | None:
    i = bisect.bisect_right(sorted_lines, line)
    return sorted_lines[i - 1] if i else None


def _at_or_after(sorted_lines: list[int], line: int) -> int | None:
    i = bisect.bisect_left(sorted_lines, line)
    return sorted_lines[i] if i < len(sorted_lines) else None


def checked_highlight(cite: str, text: str, cited: Lines, statements: Statements | None) -> Lines:
    """The lines of highlight `text` of citation `cite`, refused with a one-line reason (and the nearest lines
    that would do) when they lie outside the cited lines or, in a Python file (`statements`), cut a statement."""
    try:
        lines = parse_highlight(text)
    except PinAndCiteError as exc:
        raise PinAndCiteError(f"{cite}: {exc}") from None
    if not (cited[0] <= lines[0] and lines[1] <= cited[1]):
        raise PinAndCiteError(f"{cite}: highlight {text} lies outside the cited L{cited[0]}-L{cited[1]}")
    why = statements.problem(lines) if statements else None
    if why is None:
        return lines
    better = statements.alternatives(lines, cited)
    instead = (
        " or ".join(f'highlight="L{a}-L{b}"' for a, b in better)
        if better
        else f"no whole statement fits in the cited L{cited[0]}-L{cited[1]}: cite more lines"
    )
    raise PinAndCiteError(f"{cite}: highlight {text} {why}; use {instead}")


def best_guess(lines: Lines, cited: Lines, statements: Statements | None) -> Lines | None:
    """Where a highlight should go when its code moved imperfectly: `lines` clipped to the citation and, in a
    Python file, moved to the nearest whole statements inside it (the first highlight an error would offer);
    None when nothing of it is left inside the citation."""
    clipped = max(lines[0], cited[0]), min(lines[1], cited[1])
    if clipped[0] > clipped[1]:
        return None
    if statements is None or statements.problem(clipped) is None:
        return clipped
    return next(iter(statements.alternatives(clipped, cited)), None)
